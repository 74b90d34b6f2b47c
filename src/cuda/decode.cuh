// decode.cuh: the paged split-KV decode kernel for GQA caches (TurboQuant keys and values,
// vLLM-style uniform values, fp8 keys, bf16), one template instantiated per format and head_dim.
//
// Grid (split, kv head, sequence); a CTA of W warps owns one KV head of one sequence over a
// range of 32-token chunks (half pages) and all G <= 8 query heads of that head's group, so each
// packed byte is read from HBM once per group. Each warp streams its own chunks through a
// cp.async ring in shared memory and keeps its own online softmax; warps merge at the end and
// write one partial (normalized output + log2-sum-exp) per split; the last CTA of each (sequence,
// KV head) merges the splits and applies the inverse value rotation once (finish_group).
//
// Tensor cores (mma.m16n8k16, fp32 accumulate) do both products with the query heads as rows:
//  - QK: rows g < G hold the rotated query rounded to fp16 (bf16 for the bf16 cache), rows g + 8
//    the rounding residual, so the product sees the query at ~22 bits; K^T is the B operand,
//    decoded from packed codes straight into registers: a pair of adjacent codes indexes a
//    shared-memory table of (centroid, centroid) fp16 pairs, replicated per lane so that random
//    indices never conflict on a bank.
//  - PV: P (scaled per token by the value norm or scale) as hi/lo rows again, V as the B operand;
//    a value column pairs two tokens' codes, so the same pair table serves values.
// The dims of a head are permuted inside the MMA (keys: each lane reads one contiguous run of
// codes per token; values: lane group g owns a contiguous run of dims); queries and outputs use
// the same permutation, so no data is shuffled. Accumulation stays in the rotated domain for
// TurboQuant values (finish_group rotates back once per output row).
#pragma once

#include <algorithm>
#include <cstdint>

#include "arrive.hpp"
#include "device.cuh"
#include "kvq_cuda.hpp"

namespace kvq::cuda::detail {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr int kChunk = 32;                  // tokens per pipeline stage (half a page)
inline constexpr int kSmemBudget = 225 * 1024;     // dynamic shared memory per CTA
inline constexpr int kMaxGroup = 8;                // query heads per CTA (generic kernel, protected rows)
inline constexpr int kMaxGroup16 = 16;             // query heads per CTA of the fast kernel's sixteen-head form

constexpr int align16c(int x) { return (x + 15) / 16 * 16; }

// Per-launch arguments of the split kernels besides DecodeParams (decode.cu fills them).
struct SplitArgs {
  int nsplit = 0;                           // CTAs per group: splits of the packed range (protection adds a partial,
                                            // not a CTA: NS = nsplit + 1 partials, below)
  int cps = 0;                              // 32-token chunks per split, of the virtual range below
  int prot_chunks = 0;                      // protection: virtual chunks ahead of the packed range that stand for the
                                            // protected rows, which split 0 reads after its packed rows (0: none)
  float* part_o = nullptr;                  // [batch * q_heads][NS][head_dim] normalized partial outputs
  float* part_lse = nullptr;                // [batch * q_heads][NS] their log2-sum-exp
  unsigned long long* counters = nullptr;   // [batch][kv_heads x head_sub]: epoch << 32 | CTAs of the group done
  unsigned epoch = 0;                       // this launch's tag, never 0
  int cluster = 0;                          // 1: the NS CTAs of a group are one thread-block cluster and
                                            // merge through distributed shared memory (fast kernel)
  int head_sub = 1;                         // head_sub(G): grid rows per KV head (below)
  int group = 1;                            // G, query heads per KV head
  int heads = 1;                            // G / head_sub: query heads per CTA
  unsigned sub_magic = 0;                   // ceil(2^32 / head_sub) (head_sub > 1): y / head_sub = umulhi(y, magic)
};

// A CTA holds at most M query heads: M = kMaxGroup16 where the fast kernel's sixteen-head form serves the launch
// (fast16_serves), else kMaxGroup. A KV head with G > M query heads takes head_sub(G, M) rows of the grid (y = KV head x
// head_sub + s), sub-group s holding query heads s G / S .. (s + 1) G / S - 1 of the KV head: S is the smallest divisor
// of G with G / S <= M, so every CTA of a launch holds as many heads. The sub-groups' CTAs of one split are adjacent in
// the grid and read the same pages at about the same time, so the later reads can find them in L2; each CTA unpacks
// the codes itself.
__host__ __device__ constexpr int head_sub(int G, int M = kMaxGroup) {
  int s = (G + M - 1) / M;
  if (s < 1) s = 1;
  while (G % s != 0) ++s;
  return s;
}
// The multiplier that makes y / S one umulhi(y, sub_magic(S)) (exact for y < 2^32 / S; decode.cu checks it at
// compile time).
constexpr unsigned sub_magic(int S) { return static_cast<unsigned>((0x100000000ull + S - 1) / static_cast<unsigned>(S)); }
// Query heads per KV head (G), per CTA, and grid rows of a launch.
inline int group_size(const DecodeParams& p) { return p.fmt.kv_heads > 0 ? p.q_heads / p.fmt.kv_heads : 0; }
// Whether the fast kernel's sixteen-head form serves p (decode_d128.cu): head_dim 128, a fast format,
// DecodeParams::sixteen_heads, and more than kMaxGroup heads per CTA with M = kMaxGroup16.
bool fast16_serves(const DecodeParams& p);
inline int cta_limit(const DecodeParams& p) { return fast16_serves(p) ? kMaxGroup16 : kMaxGroup; }
inline int cta_heads(const DecodeParams& p) {
  const int G = group_size(p);
  return G > 0 ? G / head_sub(G, cta_limit(p)) : 0;
}
inline int grid_rows(const DecodeParams& p) { return p.fmt.kv_heads * head_sub(std::max(1, group_size(p)), cta_limit(p)); }

// A launch's grid rows, from the SplitArgs whose head_sub the kernels' cta_row below decodes: decode.cu fills
// head_sub once (grid_rows(p) / kv_heads) and checks the grid's y extent on these rows; the launchers use them.
inline int grid_rows(const DecodeParams& p, const SplitArgs& a) { return p.fmt.kv_heads * a.head_sub; }

// The CTA of grid row y of sequence b (S = SplitArgs::head_sub): its KV head, its query heads (G of them) and the
// first one's row in q / out.
struct CtaRow {
  int kh, G;
  std::size_t row0;
};
// No division: the launcher passes G, G / S and the multiplier of y / S (exact for y < 2^32 / S: gridDim.y < 2^16).
__device__ __forceinline__ CtaRow cta_row(const DecodeParams& p, const SplitArgs& a, int y, int b) {
  CtaRow r;
  const int S = a.head_sub;
  r.kh = S == 1 ? y : static_cast<int>(__umulhi(static_cast<unsigned>(y), a.sub_magic));
  r.G = a.heads;
  r.row0 = static_cast<std::size_t>(b) * p.q_heads + static_cast<std::size_t>(r.kh) * a.group +
           static_cast<std::size_t>(y - r.kh * S) * r.G;
  return r;
}

// threadIdx.x, read where it is used: code after a kernel's main loop that computes its indices
// from it cannot be hoisted above the loop (see finish_group).
__device__ __forceinline__ int tid_after_loop() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}
// blockIdx.y, blockIdx.z likewise (the tail's table pointers derive from them).
__device__ __forceinline__ int ctaid_y_after_loop() {
  int t;
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(t));
  return t;
}
__device__ __forceinline__ int ctaid_z_after_loop() {
  int t;
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(t));
  return t;
}

// Counts a CTA of a (sequence, KV head) group in on the group's counter word; true for the group's last one
// (the protocol, and why it is not a CAS loop: arrive.hpp).
struct CounterOps {
  unsigned long long* c;
  __device__ unsigned long long cas(unsigned long long expected, unsigned long long desired) {
    return atomicCAS(c, expected, desired);
  }
  __device__ unsigned long long add(unsigned long long v) { return atomicAdd(c, v); }
};
__device__ __forceinline__ bool arrive_last(unsigned long long* c, unsigned epoch, int n) {
  CounterOps ops{c};
  return arrive_last_on(ops, epoch, n);
}

// finish_group's merge through shared memory (smem: G * D + G floats), for the shapes without a
// warp per query head at head_dim 128;
// perm, sg, mu: the KV head's value permutation, signs and mean (nullptr: uncentered).
template <int THREADS, int D>
__device__ __forceinline__ void finish_group_smem(const DecodeParams& p, const SplitArgs& a, int NS, int G,
                                                  std::size_t row0, int tid, const std::int32_t* perm, const float* sg,
                                                  const float* mu, unsigned long long* ctr, float* smem) {
  float* y = smem;
  float* live = smem + G * D;  // 1 where the row has any history
  for (int i = tid; i < G * D; i += THREADS) {
    const int h = i / D, d = i - h * D;
    const float* lse = a.part_lse + (row0 + h) * NS;
    const float* po = a.part_o + (row0 + h) * NS * D + d;
    float M = -INFINITY;
    for (int s = 0; s < NS; ++s) M = fmaxf(M, __ldcg(lse + s));
    float sw = 0, acc = 0;
    if (M != -INFINITY) {
      for (int s = 0; s < NS; ++s) {
        const float l = __ldcg(lse + s);
        if (l == -INFINITY) continue;
        const float wgt = exp2f(l - M);
        sw += wgt;
        acc += wgt * __ldcg(po + static_cast<std::size_t>(s) * D);
      }
    }
    y[i] = sw > 0 ? acc / sw : 0.0f;
    if (d == 0) live[h] = M != -INFINITY ? 1.0f : 0.0f;
  }
  __syncthreads();
  float* out = p.out + row0 * D;
  if (p.fmt.value == ValueCode::kTq) {
    int off = 0;
    for (int s = 0; s < p.fmt.segments; ++s) {
      smem_fwht(y + off, p.fmt.seg_dims[s], G, D, tid, THREADS);
      off += p.fmt.seg_dims[s];
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += THREADS) {
      const int h = i / D, d = i - h * D;
      const int c = perm[d];
      out[h * D + c] = mu && live[h] != 0.0f ? y[i] * sg[d] + mu[c] : y[i] * sg[d];
    }
  } else {
    for (int i = tid; i < G * D; i += THREADS) out[i] = y[i];
  }
  if (tid == 0) *ctr = 0;  // ready for the next launch (a replayed graph keeps its epoch)
}

// Output row `row` of a split merge in registers (head_dim 128, a warp per row): lane l holds dims
// 4 l .. 4 l + 3. lse_of(s) / part_of(s): split s's log2-sum-exp and the lane's float4 of its normalized
// partial (a split that saw no token has -inf and a partial that is never read). The splits are
// weighted in order s = 0 .. NS - 1 (fixed summation order: the same bits whichever CTA merges);
// TurboQuant values are rotated back (FWHT per segment, signs, permutation; vp / vs: the lane's
// permutation entries and signs), the value mean mu (centered formats) added to rows with any history.
template <bool TQ, class LseOf, class PartOf>
__device__ __forceinline__ void merge_row_reg(const DecodeParams& p, int NS, int lane, int4 vp, float4 vs, const float* mu,
                                              std::size_t row, LseOf lse_of, PartOf part_of) {
  // Lane s holds split s's log2-sum-exp (splits >= 32 are read in the loop); the partials'
  // loads do not wait for the weights, so the loop's loads are in flight together.
  const float l_lane = lane < NS ? lse_of(lane) : -INFINITY;
  float M = l_lane;
  for (int s = lane + 32; s < NS; s += 32) M = fmaxf(M, lse_of(s));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  float x[4] = {0, 0, 0, 0}, sw = 0;
  if (M != -INFINITY) {
#pragma unroll 4
    for (int s = 0; s < NS; ++s) {
      const float4 v = part_of(s);
      const float l = s < 32 ? __shfl_sync(0xffffffffu, l_lane, s) : lse_of(s);
      const float wgt = l == -INFINITY ? 0.0f : exp2f(l - M);  // an empty split wrote no partial
      sw += wgt;
      x[0] += wgt == 0.0f ? 0.0f : wgt * v.x;
      x[1] += wgt == 0.0f ? 0.0f : wgt * v.y;
      x[2] += wgt == 0.0f ? 0.0f : wgt * v.z;
      x[3] += wgt == 0.0f ? 0.0f : wgt * v.w;
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) x[j] = sw > 0 ? x[j] / sw : 0.0f;
  float* out = p.out + row * 128;
  if constexpr (TQ) {
    const int n = p.fmt.seg_dims[0];  // 128, or 64 + 64 for the outlier splits
    warp_fwht4(x, lane, n);
    const float sc = static_cast<float>(1.0 / sqrt(static_cast<double>(n)));
    const int c[4] = {vp.x, vp.y, vp.z, vp.w};
    const float sgn[4] = {vs.x, vs.y, vs.z, vs.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float y = x[j] * sc * sgn[j];
      out[c[j]] = mu && M != -INFINITY ? y + mu[c[j]] : y;
    }
  } else {
    reinterpret_cast<float4*>(out)[lane] = make_float4(x[0], x[1], x[2], x[3]);
  }
}

// The end of every CTA of the split kernels, after it wrote its partial (every exit path calls it,
// with all threads). The group's last CTA merges the NS partials of its G query heads by their
// log2-sum-exp (one softmax over all splits; nothing is normalized separately), rotates TurboQuant
// values back to the model's basis (inverse block FWHT per segment, sign diagonal, outlier-split
// scatter), adds the value mean of centered formats (not to an empty history, whose output stays
// zero) and writes the output rows.
//  - head_dim 128 with a warp per query head: warp h merges row h in registers (lane l: dims
//    4 l .. 4 l + 3), the FWHT by shuffles (warp_fwht4); the permutation and signs are loaded before
//    the CTA counts in, so only the partials' loads are left after it.
//  - otherwise through shared memory (smem: G * D + G floats that no thread uses any more);
//    kSmemPath = false leaves that path out (the fast kernel, which always has a warp per head and
//    16-byte aligned tables: decode_fast_d128 checks).
// kValueTq: the kernel's values are TurboQuant codes (known at compile time, so a kernel with
// uniform values carries no rotation code in its tail). ROWS: output rows per warp of the register path
// (rows w, w + THREADS / 32, ...; 2 for the fast kernel's sixteen heads on 8 warps).
// The thread and block indices are read again here (volatile): from threadIdx / blockIdx, ptxas
// hoisted this tail's index and pointer arithmetic above the fast kernel's main loop, which then held
// it in registers (~45 more SASS instructions per chunk for the 3-bit-key formats); a call instead
// of inlining cost stack and spills.
template <int THREADS, int D, bool kValueTq, bool kSmemPath = true, int ROWS = 1>
__device__ __forceinline__ void finish_group(const DecodeParams& p, const SplitArgs& a, int NS, int G, float* smem) {
  const int tid = tid_after_loop(), y = ctaid_y_after_loop(), b = ctaid_z_after_loop();  // grid (split, row, sequence)
  const CtaRow cr = cta_row(p, a, y, b);
  const int kh = cr.kh;
  const std::size_t row0 = cr.row0;
  constexpr bool tq = kValueTq;  // the kernel's value code (TurboQuant values need the inverse rotation)
  const std::int32_t* perm = p.fmt.value_perm + static_cast<std::size_t>(kh) * D;
  const float* sg = p.fmt.value_signs + static_cast<std::size_t>(kh) * D;
  const float* mu = p.fmt.value_mean ? p.fmt.value_mean + static_cast<std::size_t>(kh) * D : nullptr;
  constexpr bool kRegPath = D == 128 && THREADS >= 128;
  const bool reg = kRegPath && G <= ROWS * (THREADS / 32) && (p.fmt.segments == 1 || 2 * p.fmt.seg_dims[0] == D) &&
                   ((reinterpret_cast<std::uintptr_t>(perm) | reinterpret_cast<std::uintptr_t>(sg)) & 15u) == 0;
  const int w = tid >> 5, lane = tid & 31;
  int4 vp = make_int4(0, 0, 0, 0);
  float4 vs = make_float4(0, 0, 0, 0);
  if (reg && tq && w < G) {
    vp = reinterpret_cast<const int4*>(perm)[lane];
    vs = reinterpret_cast<const float4*>(sg)[lane];
  }
  unsigned long long* const ctr =
      a.counters + static_cast<std::size_t>(b) * p.fmt.kv_heads * a.head_sub + static_cast<std::size_t>(y);
  // Every thread's partial stores are visible device-wide (fence) and done (barrier) before thread 0
  // counts the CTA in; without the barrier a last CTA elsewhere could read this CTA's partial while
  // its other threads were still writing it. (Fencing in thread 0 alone after the barrier, the
  // release pattern of CUTLASS's semaphore, measured the same.)
  __threadfence();
  __syncthreads();
  bool last = false;
  if (tid == 0) last = arrive_last(ctr, a.epoch, a.nsplit);  // one arrival per CTA; NS partials (protection: + 1)
  if (!__syncthreads_or(last)) return;
  __threadfence();
  if constexpr (kRegPath) {
    if (reg) {
#pragma unroll
      for (int k = 0; k < ROWS; ++k) {
        const int h = w + k * (THREADS / 32);
        if (h < G) {
          const float* lse = a.part_lse + (row0 + h) * NS;
          const float4* po = reinterpret_cast<const float4*>(a.part_o + (row0 + h) * NS * D) + lane;
          merge_row_reg<tq>(
              p, NS, lane, vp, vs, mu, row0 + h, [=](int s) { return __ldcg(lse + s); },
              [=](int s) { return __ldcg(po + static_cast<std::size_t>(s) * (D / 4)); });
        }
      }
      if (tid == 0) *ctr = 0;
      return;
    }
  }
  if constexpr (kSmemPath) finish_group_smem<THREADS, D>(p, a, NS, G, row0, tid, perm, sg, mu, ctr, smem);
  else __trap();  // unreachable: the fast kernel's launcher checks the shape and the table alignment
}

template <int D_, KeyCode KC_, int KB0, int KB1, ValueCode VC_, int VB0, int VB1>
struct Cfg {
  static constexpr int D = D_;
  static constexpr KeyCode KC = KC_;
  static constexpr ValueCode VC = VC_;
  static constexpr int NSEG = KB1 > 0 ? 2 : 1;
  static constexpr bool kBf16 = KC == KeyCode::kBf16;
  static constexpr int sd(int s) { return NSEG == 2 ? (s == 0 ? D / 2 : D - D / 2) : (s == 0 ? D : 0); }
  static constexpr int soff(int s) { return s == 0 ? 0 : sd(0); }
  static constexpr int kb(int s) { return s == 0 ? KB0 : KB1; }
  static constexpr int vb(int s) { return s == 0 ? VB0 : VB1; }
  static constexpr int kbytes(int s) { return (sd(s) * kb(s) + 7) / 8; }
  static constexpr int vbytes(int s) { return (sd(s) * vb(s) + 7) / 8; }
  static constexpr int KCB = kbytes(0) + (NSEG == 2 ? kbytes(1) : 0);
  static constexpr int VCB = vbytes(0) + (NSEG == 2 ? vbytes(1) : 0);
  static constexpr int kcoff(int s) { return s == 0 ? 0 : kbytes(0); }
  static constexpr int vcoff(int s) { return s == 0 ? 0 : vbytes(0); }
  static constexpr int KMB = KC == KeyCode::kTq ? 2 * NSEG : 0;
  static constexpr int VMB = VC == ValueCode::kTq ? 2 * NSEG : (VC == ValueCode::kUniform ? 4 : 0);
  static constexpr int MB = KMB + VMB;
  static constexpr int KT(int s) { return sd(s) / 16; }  // k-tiles of QK per segment
  static constexpr int NT(int s) { return sd(s) / 8; }   // n-tiles of PV per segment
  static constexpr int KTOT = D / 16, NTOT = D / 8;
  static constexpr int ktoff(int s) { return s == 0 ? 0 : KT(0); }
  static constexpr int ntoff(int s) { return s == 0 ? 0 : NT(0); }
  static constexpr int WARPS = kBf16 ? (D > 128 ? 2 : 4) : (D > 128 ? 4 : 8);
  static constexpr int THREADS = WARPS * 32;
  static constexpr bool kLutK = KC == KeyCode::kTq;
  static constexpr bool kLutV = VC != ValueCode::kBf16;
  static constexpr int lutk_words(int s) { return kLutK && s < NSEG ? (1 << (2 * kb(s))) * 32 : 0; }
  static constexpr int lutv_words(int s) { return kLutV && s < NSEG ? (1 << (2 * vb(s))) * 32 : 0; }
  static constexpr int LUT_WORDS = lutk_words(0) + lutk_words(1) + lutv_words(0) + lutv_words(1);
  static constexpr int Q_BYTES = kMaxGroup * D * 4;
  static constexpr int STAGE_BYTES = align16c(kChunk * (KCB + VCB + MB)) + 16;
  static constexpr int STAGES_FIT = (kSmemBudget - LUT_WORDS * 4 - Q_BYTES) / (WARPS * STAGE_BYTES);
  static constexpr int STAGES = STAGES_FIT > 4 ? 4 : STAGES_FIT;
  static constexpr int RED_BYTES = WARPS * kMaxGroup * (D + 3) * 4;
  static constexpr int SMEM = LUT_WORDS * 4 + Q_BYTES + WARPS * STAGES * STAGE_BYTES;
  static_assert(STAGES >= 2, "not enough shared memory for two pipeline stages");
  static_assert(RED_BYTES <= WARPS * STAGES * STAGE_BYTES, "reduction buffer must fit in the stages");
  static_assert(D % 32 == 0 && sd(0) % 16 == 0 && sd(1) % 16 == 0, "head_dim / segment split not supported");
};

// Bits [pos, pos + wd) of a little-endian word array (pos, wd compile-time after unrolling).
__device__ __forceinline__ std::uint32_t get_bits(const std::uint32_t* w, int pos, int wd) {
  const int i = pos >> 5, o = pos & 31;
  std::uint32_t x = w[i] >> o;
  if (o + wd > 32) x |= w[i + 1] << (32 - o);
  return wd == 32 ? x : (x & ((1u << wd) - 1u));
}

// Loads NB bits starting at bit `bitoff` of the byte string at `p` (shared memory) into w[],
// bit 0 of w[0] = first bit. kA32: p 4-byte aligned and bitoff a multiple of 32; kA128: p 16-byte
// aligned and bitoff a multiple of 128. The generic path may read up to 7 bytes past the end.
template <int NB, bool kA32, bool kA128>
__device__ __forceinline__ void load_bits(const std::uint8_t* p, int bitoff, std::uint32_t (&w)[(NB + 31) / 32]) {
  constexpr int NW = (NB + 31) / 32;
  if constexpr (kA128) {
    const uint4* q = reinterpret_cast<const uint4*>(p) + (bitoff >> 7);
#pragma unroll
    for (int i = 0; i < NW / 4; ++i) {
      const uint4 v = q[i];
      w[4 * i] = v.x;
      w[4 * i + 1] = v.y;
      w[4 * i + 2] = v.z;
      w[4 * i + 3] = v.w;
    }
  } else if constexpr (kA32) {
    const std::uint32_t* q = reinterpret_cast<const std::uint32_t*>(p) + (bitoff >> 5);
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = q[i];
  } else {
    const std::uint8_t* s = p + (bitoff >> 3);
    const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(s);
    const std::uint32_t* q = reinterpret_cast<const std::uint32_t*>(a & ~std::uintptr_t{3});
    const int sh = static_cast<int>(a & 3) * 8 + (bitoff & 7);
    std::uint32_t raw[NW + 1];
#pragma unroll
    for (int i = 0; i <= NW; ++i) raw[i] = q[i];
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = __funnelshift_r(raw[i], raw[i + 1], sh);
  }
}

template <class C>
struct Smem {
  std::uint32_t* lutk[2];
  std::uint32_t* lutv[2];
  float* q;
  std::uint8_t* stages;
  __device__ explicit Smem(std::uint8_t* base) {
    std::uint32_t* l = reinterpret_cast<std::uint32_t*>(base);
    lutk[0] = l;
    l += C::lutk_words(0);
    lutk[1] = l;
    l += C::lutk_words(1);
    lutv[0] = l;
    l += C::lutv_words(0);
    lutv[1] = l;
    l += C::lutv_words(1);
    q = reinterpret_cast<float*>(l);
    stages = reinterpret_cast<std::uint8_t*>(q + kMaxGroup * C::D);
  }
};

// The protected bf16 rows of the CTA's (sequence, KV head), read by split 0's CTA after its packed rows
// (protected_rows) in fp32 on CUDA cores and written as one more partial, rotated into the value domain of the
// format. MAXH: the most query heads of the kernel's CTAs (kMaxGroup, or kMaxGroup16 for the fast kernel's
// sixteen-head form), the size of its per-head state. Not inlined (inlined, the fast kernels' main loops grew as
// much: bench/results/decode-gqa-protect-fold-2026-12-07.md).
template <class C, int MAXH = kMaxGroup>
__device__ __noinline__ void protected_split(const float* __restrict__ qin, std::size_t row0, int kh, float scale,
                                const ProtectLayout pr, const std::uint16_t* __restrict__ prot_rows,
                                const std::int32_t* __restrict__ vperm, const float* __restrict__ vsigns,
                                const float* __restrict__ kmean, const float* __restrict__ vmean, int G, int L, int NS,
                                float* po, float* plse, std::uint8_t* smem) {
  constexpr int D = C::D, T = C::THREADS, W = C::WARPS, RS = D + 3;
  // Row stride of the staged rows in bf16 elements: key, value, 16 bytes of pad (16-byte aligned rows).
  constexpr int ST = 2 * D + 8;
  constexpr int OPT = (MAXH * D + T - 1) / T;  // outputs (head, dim) per thread
  const int b = blockIdx.z;
  // Centered formats: the rows enter as k - key_mean and v - value_mean, the packed rows' domain
  // (finish_group adds value_mean back once): the scores lose q . key_mean, the outputs value_mean.
  const float* __restrict__ kmu = kmean ? kmean + static_cast<std::size_t>(kh) * D : nullptr;
  const float* __restrict__ vmu = vmean ? vmean + static_cast<std::size_t>(kh) * D : nullptr;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
  // Shared memory: the scaled query [MAXH][D], the region `red` ([W][MAXH][RS] floats: the block's scores [MAXH][cap]
  // here, the value rotation below), the per-head softmax state, then a block of up to `cap` staged rows.
  float* qs = reinterpret_cast<float*>(smem);
  float* red = qs + MAXH * D;
  float* hm = red + W * MAXH * RS;  // [MAXH] running maximum, [MAXH] sum, [MAXH] rescale, [MAXH] q . key_mean
  float* hl = hm + MAXH;
  float* ha = hl + MAXH;
  float* hq = ha + MAXH;
  constexpr int kStageOff = ((MAXH * D + W * MAXH * RS + 4 * MAXH) * 4 + 15) / 16 * 16;
  std::uint16_t* rows = reinterpret_cast<std::uint16_t*>(smem + kStageOff);
  unsigned dyn = 0;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  int cap = (static_cast<int>(dyn) - kStageOff) / (ST * 2);
  cap = cap < 256 ? cap : 256;
  cap = cap < W * RS ? cap : W * RS;  // the scores [MAXH][cap] fit in red
  if (cap < 1) __trap();  // every kernel's layout leaves room for 16 rows or more (the tests run each kind)
  float* sc = red;
  const float qscale = scale * kLog2e;
  const int n_sink = L < pr.sinks ? L : pr.sinks;
  const std::int64_t w0 = pr.packed_end(L);
  const int n_rows = n_sink + static_cast<int>(L - w0);
  constexpr int PIECES = 2 * D / 8;  // 16-byte pieces per row
  // Rows [r0, r0 + nb) into the staging block by cp.async, one group.
  auto stage = [&](int r0, int nb) {
    for (int i = tid; i < nb * PIECES; i += T) {
      const int r = r0 + i / PIECES, pc = i % PIECES;
      const std::int64_t pos = r < n_sink ? r : w0 + (r - n_sink);
      cp_async16(rows + (i / PIECES) * ST + pc * 8, prot_rows + pr.row(b, kh, pr.slot(pos)) + pc * 8);
    }
    cp_async_commit();
  };
  stage(0, n_rows < cap ? n_rows : cap);  // in flight with the query, permutation and sign loads below
  int vpv[OPT];
  float vsv[OPT];
#pragma unroll
  for (int k = 0; k < OPT; ++k) {
    const int d = (tid + k * T) % D;
    vpv[k] = C::VC == ValueCode::kTq && tid + k * T < G * D ? vperm[static_cast<std::size_t>(kh) * D + d] : 0;
    vsv[k] = C::VC == ValueCode::kTq && tid + k * T < G * D ? vsigns[static_cast<std::size_t>(kh) * D + d] : 0.0f;
  }
  for (int i = tid; i < G * D; i += T) qs[i] = qin[row0 * D + i] * qscale;
  __syncthreads();
  for (int h = w; h < G; h += W) {
    float s = 0;
    if (kmu)
      for (int d = lane; d < D; d += 32) s += qs[h * D + d] * kmu[d];
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) s += __shfl_xor_sync(0xffffffffu, s, x);
    if (lane == 0) {
      hm[h] = -INFINITY;
      hl[h] = 0;
      hq[h] = s;
    }
  }
  float o[OPT];
#pragma unroll
  for (int k = 0; k < OPT; ++k) o[k] = 0;
  // Blocks of up to `cap` rows: staged by cp.async (the first block's copies issued before the query loads, so that
  // one round trip serves both), then the scores of every (head, row) pair, a warp per head for the softmax, and a
  // thread per (head, dim) for the output.
  for (int r0 = 0; r0 < n_rows; r0 += cap) {
    const int nb = n_rows - r0 < cap ? n_rows - r0 : cap;
    if (r0 > 0) stage(r0, nb);
    cp_async_wait<0>();
    __syncthreads();  // the rows are staged (and, before the first block, the per-head state is set)
    // Scores (log2 domain): pair (h, r) of this block; each lane starts at another 8-dim piece.
    for (int i = tid; i < G * nb; i += T) {
      const int h = i / nb, r = i - h * nb;
      const uint4* kr = reinterpret_cast<const uint4*>(rows + r * ST);
      const float4* qh = reinterpret_cast<const float4*>(qs + h * D);
      float s = 0;
      int j = lane % (D / 8);
      for (int jj = 0; jj < D / 8; ++jj, j = j + 1 < D / 8 ? j + 1 : 0) {
        const uint4 kw = kr[j];
        const float4 qa = qh[2 * j], qb = qh[2 * j + 1];
        s += qa.x * __uint_as_float(kw.x << 16) + qa.y * __uint_as_float(kw.x & 0xffff0000u);
        s += qa.z * __uint_as_float(kw.y << 16) + qa.w * __uint_as_float(kw.y & 0xffff0000u);
        s += qb.x * __uint_as_float(kw.z << 16) + qb.y * __uint_as_float(kw.z & 0xffff0000u);
        s += qb.z * __uint_as_float(kw.w << 16) + qb.w * __uint_as_float(kw.w & 0xffff0000u);
      }
      sc[h * cap + r] = s - hq[h];
    }
    __syncthreads();
    // Softmax state: warp h % W takes head h; the scores become weights against the new maximum.
    for (int h = w; h < G; h += W) {
      float mb = -INFINITY;
      for (int r = lane; r < nb; r += 32) mb = fmaxf(mb, sc[h * cap + r]);
#pragma unroll
      for (int x = 16; x > 0; x >>= 1) mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, x));
      const float mo = hm[h], mn = fmaxf(mo, mb);
      float sum = 0;
      for (int r = lane; r < nb; r += 32) {
        const float e = exp2f(sc[h * cap + r] - mn);
        sc[h * cap + r] = e;
        sum += e;
      }
#pragma unroll
      for (int x = 16; x > 0; x >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, x);
      __syncwarp();
      if (lane == 0) {
        const float a = mo == -INFINITY ? 0.0f : exp2f(mo - mn);
        hl[h] = hl[h] * a + sum;
        ha[h] = a;
        hm[h] = mn;
      }
    }
    __syncthreads();
    // Outputs: thread (h, d) rescales its sum and adds the block's weighted values.
#pragma unroll
    for (int k = 0; k < OPT; ++k) {
      const int i = tid + k * T;
      if (i < G * D) {
        const int h = i / D, d = i - h * D;
        const float* ph = sc + h * cap;
        const std::uint16_t* vd = rows + D + d;
        float acc = o[k] * ha[h];
        for (int r = 0; r < nb; ++r) acc += ph[r] * bf16_bits_to_float(vd[r * ST]);
        o[k] = acc;
      }
    }
    __syncthreads();  // the block's rows and weights are read before the next block is staged
  }
  __syncthreads();  // the per-head state is final (also without rows) and the query is read: qs is free
  // The normalized output in the original domain (into qs) and its log2-sum-exp.
#pragma unroll
  for (int k = 0; k < OPT; ++k) {
    const int i = tid + k * T;
    if (i < G * D) {
      const int h = i / D, d = i - h * D;
      const float l = hl[h];
      qs[i] = l > 0 ? o[k] / l - (vmu ? vmu[d] : 0.0f) : 0.0f;
      if (d == 0) plse[static_cast<std::size_t>(h) * NS] = l > 0 ? hm[h] + log2f(l) : -INFINITY;
    }
  }
  __syncthreads();
  // To the value domain of the format: gather, signs, block FWHT per segment.
  float* vd = red;
  if constexpr (C::VC == ValueCode::kTq) {
#pragma unroll
    for (int k = 0; k < OPT; ++k) {  // vpv / vsv: the permutation and signs of dim (tid + k T) % D, loaded above
      const int i = tid + k * T;
      if (i < G * D) vd[i] = qs[(i / D) * D + vpv[k]] * vsv[k];
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < C::NSEG; ++s) smem_fwht(vd + C::soff(s), C::sd(s), G, D, tid, C::THREADS);
    __syncthreads();
  } else {
    vd = qs;
  }
  for (int i = tid; i < G * D; i += C::THREADS) {
    const int h = i / D, d = i % D;
    po[static_cast<std::size_t>(h) * NS * D + d] = vd[i];
  }
}

// Split 0's second part under protection: the protected rows as partial NS - 1 of the group (protected_split), after
// the CTA's packed rows and their partial, or in place of them where its packed range is empty. The indices are read
// again (after the main loop: ctaid_*_after_loop, as finish_group does) so that none is held across the loop.
template <class C, int MAXH = kMaxGroup>
__device__ __forceinline__ void protected_rows(const DecodeParams& p, const SplitArgs& a, int NS, std::uint8_t* smem) {
  const int b = ctaid_z_after_loop();
  const CtaRow cr = cta_row(p, a, ctaid_y_after_loop(), b);
  __syncthreads();  // the packed rows' partial has been read out of shared memory
  protected_split<C, MAXH>(p.q, cr.row0, cr.kh, p.scale, p.protect, p.protect_rows, p.fmt.value_perm,
                           p.fmt.value_signs, p.fmt.key_mean, p.fmt.value_mean, cr.G, p.seq_lens[b], NS,
                           a.part_o + (cr.row0 * NS + (NS - 1)) * C::D, a.part_lse + cr.row0 * NS + (NS - 1), smem);
}

template <class C>
__global__ void __launch_bounds__(C::THREADS, 1)
    decode_kernel(const DecodeParams p, const SplitArgs a) {
  extern __shared__ __align__(16) std::uint8_t smem_raw[];
  const int nsplit = a.nsplit, cps = a.cps;
  float* __restrict__ part_o = a.part_o;
  float* __restrict__ part_lse = a.part_lse;
  constexpr int D = C::D;
  constexpr bool kB = C::kBf16;
  const int split = blockIdx.x, b = blockIdx.z;
  const CtaRow cr = cta_row(p, a, blockIdx.y, b);
  const int kh = cr.kh, G = cr.G;
  const int L = p.seq_lens[b];
  const ProtectLayout prl = p.protect;
  const bool prot = prl.enabled();
  const int NS = nsplit + (prot ? 1 : 0);
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const std::size_t row0 = cr.row0;
  float* po = part_o + (row0 * NS + split) * D;  // head h: + h * NS * D
  float* plse = part_lse + row0 * NS + split;    // head h: + h * NS
  grid_dependency_wait();  // the query, pages, protected rows and workspace after the kernel before (programmatic)

  const std::int64_t lo = prot ? prl.packed_begin(L) : 0;
  const std::int64_t hi = prot ? prl.packed_end(L) : L;
  const int c_lo = static_cast<int>(lo / kChunk);
  const int c_hi = hi > lo ? static_cast<int>((hi + kChunk - 1) / kChunk) : c_lo;
  // Split s: virtual chunks [s cps, (s + 1) cps), the first prot_chunks of them the protected rows (split 0's).
  const int px = a.prot_chunks;
  const int cb = max(c_lo, split * cps - px), ce = min(c_hi, (split + 1) * cps - px);
  if (cb >= ce) {
    for (int h = tid; h < G; h += C::THREADS) plse[static_cast<std::size_t>(h) * NS] = -INFINITY;
    if (prot && split == 0) protected_rows<C>(p, a, NS, smem_raw);
    finish_group<C::THREADS, C::D, C::VC == ValueCode::kTq>(p, a, NS, G, reinterpret_cast<float*>(smem_raw));
    return;
  }

  Smem<C> sm(smem_raw);
  const std::uint64_t page_bytes = p.fmt.page.page_bytes, koff = p.fmt.page.key_code_off,
                      voff = p.fmt.page.value_code_off, moff = p.fmt.page.meta_off;
  const std::uint8_t* __restrict__ pool = p.pool;
  const int nloc = (ce - cb - w + C::WARPS - 1) / C::WARPS > 0 ? (ce - cb - w + C::WARPS - 1) / C::WARPS : 0;
  std::uint8_t* my_stages = sm.stages + static_cast<std::size_t>(w) * C::STAGES * C::STAGE_BYTES;
  const std::int32_t* bt = p.block_tables + static_cast<std::size_t>(b) * p.max_pages;

  auto issue = [&](int i) {
    const int c = cb + w + i * C::WARPS;
    const int page = bt[c >> 1];
    const int off = (c & 1) * kChunk;
    const std::uint8_t* base = pool + static_cast<std::size_t>(page) * page_bytes;
    std::uint8_t* dst = my_stages + (i % C::STAGES) * C::STAGE_BYTES;
    const std::size_t slot = static_cast<std::size_t>(kh) * 64 + static_cast<std::size_t>(off);
    const std::uint8_t* srck = base + koff + slot * C::KCB;
    const std::uint8_t* srcv = base + voff + slot * C::VCB;
    const std::uint8_t* srcm = base + moff + slot * C::MB;
    constexpr int nk = kChunk * C::KCB / 16, nv = kChunk * C::VCB / 16, nm = kChunk * C::MB / 16;
    for (int j = lane; j < nk + nv + nm; j += 32) {
      if (j < nk) cp_async16(dst + 16 * j, srck + 16 * j);
      else if (j < nk + nv) cp_async16(dst + 16 * j, srcv + 16 * (j - nk));
      else cp_async16(dst + 16 * j, srcm + 16 * (j - nk - nv));
    }
  };
#pragma unroll
  for (int i = 0; i < C::STAGES - 1; ++i) {
    if (i < nloc) issue(i);
    cp_async_commit();
  }

  // Pair tables (replicated per lane): entry e = (first code) | (second code) << bits.
#pragma unroll
  for (int s = 0; s < C::NSEG; ++s) {
    if constexpr (C::kLutK) {
      const int bits = C::kb(s), n = 1 << (2 * bits), mask = (1 << bits) - 1;
      const float* cent = p.fmt.key_centroids + s * kMaxCodebook;
      for (int i = tid; i < n * 32; i += C::THREADS) {
        const int e = i >> 5;
        sm.lutk[s][i] = pack2<false>(cent[e & mask], cent[e >> bits]);
      }
    }
    if constexpr (C::kLutV) {
      const int bits = C::vb(s), n = 1 << (2 * bits), mask = (1 << bits) - 1;
      const float* cent = p.fmt.value_centroids + s * kMaxCodebook;
      for (int i = tid; i < n * 32; i += C::THREADS) {
        const int e = i >> 5;
        sm.lutv[s][i] = pack2<false>(cent[e & mask], cent[e >> bits]);
      }
    }
  }
  // Query: scaled into the log2 domain, gathered and rotated like the keys.
  {
    const float qscale = p.scale * kLog2e;
    const float* qg = p.q + row0 * D;
    if constexpr (C::KC == KeyCode::kTq) {
      const std::int32_t* perm = p.fmt.key_perm + static_cast<std::size_t>(kh) * D;
      const float* sg = p.fmt.key_signs + static_cast<std::size_t>(kh) * D;
      for (int i = tid; i < G * D; i += C::THREADS) {
        const int h = i / D, d = i % D;
        sm.q[i] = qg[h * D + perm[d]] * qscale * sg[d];
      }
      __syncthreads();
#pragma unroll
      for (int s = 0; s < C::NSEG; ++s) smem_fwht(sm.q + C::soff(s), C::sd(s), G, D, tid, C::THREADS);
    } else {
      for (int i = tid; i < G * D; i += C::THREADS) sm.q[i] = qg[i] * qscale;
    }
    __syncthreads();
  }
  // A fragments of the query: row g = rounded query of head g, row g + 8 = residual.
  std::uint32_t qa[C::KTOT][4];
#pragma unroll
  for (int s = 0; s < C::NSEG; ++s) {
#pragma unroll
    for (int kt = 0; kt < C::KT(s); ++kt) {
      const int pr0 = 2 * C::KT(s) * t4 + 2 * kt;  // pair for k = 2t, 2t+1; pr0 + 1 for k = 2t+8, 2t+9
      std::uint32_t h0 = 0, l0 = 0, h1 = 0, l1 = 0;
      if (g < G) {
        const float* qq = sm.q + g * D + C::soff(s);
        split2<kB>(qq[2 * pr0], qq[2 * pr0 + 1], h0, l0);
        split2<kB>(qq[2 * pr0 + 2], qq[2 * pr0 + 3], h1, l1);
      }
      std::uint32_t* a = qa[C::ktoff(s) + kt];
      a[0] = h0;
      a[1] = l0;
      a[2] = h1;
      a[3] = l1;
    }
  }

  float o[C::NTOT][4];
#pragma unroll
  for (int i = 0; i < C::NTOT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0;
  float m_run = -INFINITY, l_run = 0, z_run = 0;

  for (int i = 0; i < nloc; ++i) {
    cp_async_wait<C::STAGES - 2>();
    __syncwarp();
    const std::uint8_t* st = my_stages + (i % C::STAGES) * C::STAGE_BYTES;
    const std::uint8_t* sk = st;
    const std::uint8_t* sv = st + kChunk * C::KCB;
    const std::uint8_t* smeta = sv + kChunk * C::VCB;
    const std::int64_t pos0 = static_cast<std::int64_t>(cb + w + i * C::WARPS) * kChunk;
    const bool full = pos0 >= lo && pos0 + kChunk <= hi;
    auto valid = [&](int t) { return full || (pos0 + t >= lo && pos0 + t < hi); };

    // ---- scores: k-tiles outer, the 4 token n-tiles inner, so consecutive MMAs are independent ----
    float acc[4][C::NSEG][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int s = 0; s < C::NSEG; ++s) acc[nt][s][0] = acc[nt][s][1] = acc[nt][s][2] = acc[nt][s][3] = 0;
    if constexpr (C::KC == KeyCode::kTq) {
#define KVQ_KPAIRS(S)                                                                                  \
  {                                                                                                    \
    constexpr int NB = 4 * C::kb(S) * C::KT(S), NW = (NB + 31) / 32;                                   \
    constexpr bool A32 = C::KCB % 4 == 0 && C::kcoff(S) % 4 == 0 && NB % 32 == 0;                      \
    constexpr bool A128 = C::KCB % 16 == 0 && C::kcoff(S) % 16 == 0 && NB % 128 == 0;                  \
    std::uint32_t wv[4][NW];                                                                           \
    _Pragma("unroll") for (int nt = 0; nt < 4; ++nt)                                                   \
        load_bits<NB, A32, A128>(sk + (nt * 8 + g) * C::KCB + C::kcoff(S), t4 * NB, wv[nt]);           \
    const std::uint32_t* lut = sm.lutk[S] + lane;                                                      \
    _Pragma("unroll") for (int kt = 0; kt < C::KT(S); ++kt) {                                          \
      _Pragma("unroll") for (int nt = 0; nt < 4; ++nt) {                                               \
        const std::uint32_t b0 = lut[get_bits(wv[nt], (2 * kt) * 2 * C::kb(S), 2 * C::kb(S)) * 32];    \
        const std::uint32_t b1 = lut[get_bits(wv[nt], (2 * kt + 1) * 2 * C::kb(S), 2 * C::kb(S)) * 32];\
        mma16816<kB>(acc[nt][S], qa[C::ktoff(S) + kt], b0, b1);                                        \
      }                                                                                                \
    }                                                                                                  \
  }
      KVQ_KPAIRS(0)
      if constexpr (C::NSEG == 2) KVQ_KPAIRS(1)
#undef KVQ_KPAIRS
    } else {
      // fp8 (1 byte per code) or bf16 (2 bytes): 2 * KT pairs = 4 * KT codes of this lane. Where the four n-tiles'
      // words would take more than 64 registers (bf16 at head_dim 256: 128, beside the query's 64 and the output's
      // 128) they are loaded in blocks of KB k-tiles, 8 words per n-tile; otherwise in one block (KB = KT).
      constexpr int BPC = C::KC == KeyCode::kFp8 ? 1 : 2;
      constexpr int NB = 4 * C::KT(0) * BPC * 8, NW = NB / 32;
      constexpr int KB = 4 * NW > 64 ? 8 / BPC : C::KT(0), NBB = 4 * KB * BPC * 8;
      static_assert(C::KT(0) % KB == 0, "key blocks must tile the k-tiles");
      constexpr bool A128 = C::KCB % 16 == 0 && NB % 128 == 0 && NBB % 128 == 0;
#pragma unroll
      for (int k0 = 0; k0 < C::KT(0); k0 += KB) {
        std::uint32_t wv[4][NBB / 32];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          load_bits<NBB, true, A128>(sk + (nt * 8 + g) * C::KCB, t4 * NB + k0 * 4 * BPC * 8, wv[nt]);
#pragma unroll
        for (int kt = 0; kt < KB; ++kt) {
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            std::uint32_t b0, b1;
            if constexpr (C::KC == KeyCode::kFp8) {
              b0 = fp8x2_to_half2(get_bits(wv[nt], (2 * kt) * 16, 16));
              b1 = fp8x2_to_half2(get_bits(wv[nt], (2 * kt + 1) * 16, 16));
            } else {
              b0 = wv[nt][2 * kt];
              b1 = wv[nt][2 * kt + 1];
            }
            mma16816<kB>(acc[nt][0], qa[k0 + kt], b0, b1);
          }
        }
      }
    }
    float sc[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int t = nt * 8 + 2 * t4 + e;
        float v;
        if constexpr (C::KC == KeyCode::kTq) {
          const std::uint16_t* km = reinterpret_cast<const std::uint16_t*>(smeta + t * C::MB);
          v = (acc[nt][0][e] + acc[nt][0][2 + e]) * half_bits_to_float(km[0]);
          if constexpr (C::NSEG == 2) v += (acc[nt][1][e] + acc[nt][1][2 + e]) * half_bits_to_float(km[1]);
        } else {
          v = acc[nt][0][e] + acc[nt][0][2 + e];
        }
        sc[nt][e] = valid(t) ? v : -INFINITY;
      }
    }

    // ---- online softmax (log2 domain) ----
    float mx = sc[0][0];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) mx = fmaxf(mx, fmaxf(sc[nt][0], sc[nt][1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = exp2f(m_run - m_use);
    float psum = 0;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      sc[nt][0] = exp2f(sc[nt][0] - m_use);
      sc[nt][1] = exp2f(sc[nt][1] - m_use);
      psum += sc[nt][0] + sc[nt][1];
    }
    l_run = l_run * alpha + psum;
    m_run = m_new;
    z_run *= alpha;
#pragma unroll
    for (int n = 0; n < C::NTOT; ++n) {
      o[n][0] *= alpha;
      o[n][1] *= alpha;
      o[n][2] *= alpha;
      o[n][3] *= alpha;
    }

    // ---- P V ----
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const int ta = 16 * kk + 2 * t4, tb = ta + 8;  // tokens ta, ta+1 (k 2t, 2t+1), tb, tb+1
      const float pr[4] = {sc[2 * kk][0], sc[2 * kk][1], sc[2 * kk + 1][0], sc[2 * kk + 1][1]};
      const int tk[4] = {ta, ta + 1, tb, tb + 1};
      if constexpr (C::VC == ValueCode::kUniform) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const std::uint16_t* vm = reinterpret_cast<const std::uint16_t*>(smeta + tk[j] * C::MB + C::KMB);
          if (pr[j] > 0) z_run += pr[j] * half_bits_to_float(vm[1]);
        }
      }
#pragma unroll
      for (int s = 0; s < C::NSEG; ++s) {
        float pp[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if constexpr (C::VC == ValueCode::kBf16) {
            pp[j] = pr[j];
          } else {
            const std::uint16_t* vm = reinterpret_cast<const std::uint16_t*>(smeta + tk[j] * C::MB + C::KMB);
            pp[j] = pr[j] > 0 ? pr[j] * half_bits_to_float(vm[s]) : 0.0f;
          }
        }
        std::uint32_t a[4];
        split2<kB>(pp[0], pp[1], a[0], a[1]);
        split2<kB>(pp[2], pp[3], a[2], a[3]);
        if constexpr (C::VC == ValueCode::kBf16) {
          // The four tokens' words for NTB n-tiles at a time: all of them (NT) up to head_dim 128, 8 n-tiles (16
          // registers) at 256, where the output's 128 accumulators leave no room for 64.
          constexpr int NB = C::NT(0) * 16, NTB = NB / 32 * 4 > 32 ? 8 : C::NT(0), NBB = NTB * 16;
          static_assert(C::NT(0) % NTB == 0, "value blocks must tile the n-tiles");
          constexpr bool A128 = C::VCB % 16 == 0 && NB % 128 == 0 && NBB % 128 == 0;
          // the tokens' masks: after the loads where there is one block (ptxas's schedule of the smaller head dims),
          // once before the blocks otherwise
          struct Masks {
            bool ok;
            std::uint32_t m01, m23;
          };
          auto masks = [&] {
            const std::uint32_t mk0 = (full || valid(tk[0])) ? 0xffffu : 0u;
            const std::uint32_t mk1 = (full || valid(tk[1])) ? 0xffff0000u : 0u;
            const std::uint32_t mk2 = (full || valid(tk[2])) ? 0xffffu : 0u;
            const std::uint32_t mk3 = (full || valid(tk[3])) ? 0xffff0000u : 0u;
            return Masks{full || (valid(tk[0]) && valid(tk[1]) && valid(tk[2]) && valid(tk[3])), mk0 | mk1, mk2 | mk3};
          };
          constexpr bool kBlocked = NTB < C::NT(0);
          Masks early{};
          if constexpr (kBlocked) early = masks();
#pragma unroll
          for (int n0 = 0; n0 < C::NT(0); n0 += NTB) {
            std::uint32_t w0[NBB / 32], w1[NBB / 32], w2[NBB / 32], w3[NBB / 32];
            load_bits<NBB, true, A128>(sv + tk[0] * C::VCB, g * NB + n0 * 16, w0);
            load_bits<NBB, true, A128>(sv + tk[1] * C::VCB, g * NB + n0 * 16, w1);
            load_bits<NBB, true, A128>(sv + tk[2] * C::VCB, g * NB + n0 * 16, w2);
            load_bits<NBB, true, A128>(sv + tk[3] * C::VCB, g * NB + n0 * 16, w3);
            Masks mk = early;
            if constexpr (!kBlocked) mk = masks();
#pragma unroll
            for (int n = 0; n < NTB; ++n) {
              const unsigned sel = (n & 1) ? 0x7632u : 0x5410u;
              std::uint32_t b0 = __byte_perm(w0[n >> 1], w1[n >> 1], sel);
              std::uint32_t b1 = __byte_perm(w2[n >> 1], w3[n >> 1], sel);
              if (!mk.ok) {
                b0 &= mk.m01;
                b1 &= mk.m23;
              }
              mma16816<kB>(o[n0 + n], a, b0, b1);
            }
          }
        } else {
#define KVQ_VPAIRS(S)                                                                                  \
  {                                                                                                    \
    constexpr int VB = C::vb(S), NB = C::NT(S) * VB;                                                   \
    constexpr bool A32 = C::VCB % 4 == 0 && C::vcoff(S) % 4 == 0 && NB % 32 == 0;                      \
    constexpr bool A128 = C::VCB % 16 == 0 && C::vcoff(S) % 16 == 0 && NB % 128 == 0;                  \
    std::uint32_t w0[(NB + 31) / 32], w1[(NB + 31) / 32], w2[(NB + 31) / 32], w3[(NB + 31) / 32];      \
    load_bits<NB, A32, A128>(sv + tk[0] * C::VCB + C::vcoff(S), g * NB, w0);                           \
    load_bits<NB, A32, A128>(sv + tk[1] * C::VCB + C::vcoff(S), g * NB, w1);                           \
    load_bits<NB, A32, A128>(sv + tk[2] * C::VCB + C::vcoff(S), g * NB, w2);                           \
    load_bits<NB, A32, A128>(sv + tk[3] * C::VCB + C::vcoff(S), g * NB, w3);                           \
    const std::uint32_t* lut = sm.lutv[S] + lane;                                                      \
    _Pragma("unroll") for (int n = 0; n < C::NT(S); ++n) {                                             \
      const std::uint32_t i0 = get_bits(w0, n * VB, VB) | (get_bits(w1, n * VB, VB) << VB);            \
      const std::uint32_t i1 = get_bits(w2, n * VB, VB) | (get_bits(w3, n * VB, VB) << VB);            \
      mma16816<kB>(o[C::ntoff(S) + n], a, lut[i0 * 32], lut[i1 * 32]);                                 \
    }                                                                                                  \
  }
          if (s == 0) KVQ_VPAIRS(0)
          if constexpr (C::NSEG == 2) {
            if (s == 1) KVQ_VPAIRS(1)
          }
#undef KVQ_VPAIRS
        }
      }
    }
    __syncwarp();
    if (i + C::STAGES - 1 < nloc) issue(i + C::STAGES - 1);
    cp_async_commit();
  }
  cp_async_wait<0>();

  // ---- merge the warps ----
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  z_run += __shfl_xor_sync(0xffffffffu, z_run, 1);
  z_run += __shfl_xor_sync(0xffffffffu, z_run, 2);
  __syncthreads();
  constexpr int RS = D + 3;
  float* red = reinterpret_cast<float*>(sm.stages);
  if (g < G) {
    float* rr = red + (w * kMaxGroup + g) * RS;
#pragma unroll
    for (int s = 0; s < C::NSEG; ++s) {
#pragma unroll
      for (int n = 0; n < C::NT(s); ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float* c = o[C::ntoff(s) + n];
          rr[C::soff(s) + C::NT(s) * (2 * t4 + e) + n] = c[e] + c[2 + e];
        }
      }
    }
    if (t4 == 0) {
      rr[D] = nloc > 0 ? m_run : -INFINITY;
      rr[D + 1] = l_run;
      rr[D + 2] = z_run;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < G * D; idx += C::THREADS) {
    const int h = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int ww = 0; ww < C::WARPS; ++ww) M = fmaxf(M, red[(ww * kMaxGroup + h) * RS + D]);
    float sum = 0, acc = 0;
    if (M != -INFINITY) {
      for (int ww = 0; ww < C::WARPS; ++ww) {
        const float* rr = red + (ww * kMaxGroup + h) * RS;
        if (rr[D] == -INFINITY) continue;
        const float f = exp2f(rr[D] - M);
        sum += f * rr[D + 1];
        acc += f * (rr[d] + rr[D + 2]);
      }
    }
    po[static_cast<std::size_t>(h) * NS * D + d] = sum > 0 ? acc / sum : 0.0f;
    if (d == 0) plse[static_cast<std::size_t>(h) * NS] = sum > 0 ? M + log2f(sum) : -INFINITY;
  }
  if (p.protect.enabled() && blockIdx.x == 0) protected_rows<C>(p, a, NS, smem_raw);
  finish_group<C::THREADS, C::D, C::VC == ValueCode::kTq>(p, a, NS, G, reinterpret_cast<float*>(smem_raw));
}

}  // namespace kvq::cuda::detail
