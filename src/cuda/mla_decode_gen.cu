// mla_decode_gen.cu: paged split-KV MLA decode for any latent / RoPE width that is a multiple of 64
// (d_c = 64 G, 1 <= G <= 16; d_r = 64 R, 1 <= R <= 4) over bf16, QuantMLA affine (c8r8, c4r8,
// c4r4, c3r4, c2r4) and TurboQuant latent (mla-tq4, mla-tq3) caches, with its combine kernel and,
// for mla-tq, its rotation pre-kernel. mla_decode() runs it for every shape other
// than d_c = 512, d_r = 64 (whose tuned kernel is in mla_decode.cu), and for that shape too when
// MlaDecodeParams::generic is set (tests, benchmarks).
//
// One CTA (8 warps) = one sequence x 16 query heads (the last group of a head count may be partial)
// x a contiguous range of tiles of TI = 32 tokens (16 where 32-token tiles do not fit beside two
// CTAs per SM) (a split), as in the tuned kernel, with the same virtual tiles (protected bf16 rows first), the same
// split ranges of equal cost, the same operands (affine: fp16 s (q - z) and the query rounded once
// to fp16; bf16: bf16 rows, the query as bf16 hi + lo) and the same partial-state layout, so the
// two kernels share the error budget and the workspace. cp.async keeps NS - 1 packed tiles in
// flight (NS stages, as many as the shared memory holds, 2..6); per tile:
//  1. bf16: the stage is the operand (rows copied into padded rows, zero-filled outside the
//     sequence); affine: the CTA dequantizes the stage's codes into the operand tile, item = (row,
//     8 dims), pairs of codes as fp16 (1024 + code) by one LOP3, exact code - z, then times the
//     scale (one rounding); mla-tq (rotated domain, as the tuned kernel: a pre-kernel rotates the
//     query's latent part and the protected latent rows, the combine applies Pi^T): pairs of codes
//     looked up as (C[lo], C[hi]) in fp16 and multiplied by the stored norm, the bf16 RoPE key
//     converted to fp16; rows outside the sequence are zeros; protected rows come from global
//     memory (bf16 -> fp16);
//  2. QK on tensor cores: warp w takes the k-steps (16 dims) w, w + 8, ... of the whole row
//     (ldmatrix of the query and the tile), its partial scores meet in shared memory;
//  3. online softmax with an exact running maximum, one thread per (head, TI / 16 tokens);
//  4. PV: warp w owns output dims [8 G w, 8 G (w + 1)) of the 16 heads (ldmatrix.trans of the tile).
// Slower than the tuned kernel (the tile goes through shared memory, four barriers per tile), but
// any width runs on the same paged cache, protection included.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "device.cuh"
#include "mla_split.cuh"
#include "kvq_cuda_mla.hpp"

namespace kvq::cuda {
namespace detail {

namespace {

constexpr int kHG = 16, kPT = 64, kNW = 8, kNT = 32 * kNW;
constexpr int kMaxG = 16, kMaxR = 4;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

__device__ __forceinline__ std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_trans(std::uint32_t& r0, std::uint32_t& r1, std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
// Little-endian 32-bit value of 4 bytes at any address.
__device__ __forceinline__ std::uint32_t load_u32_any(const std::uint8_t* p) {
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 | static_cast<std::uint32_t>(p[2]) << 16 |
         static_cast<std::uint32_t>(p[3]) << 24;
}
// Eight consecutive b-bit codes starting at byte p (8 b bits = b bytes, LSB first).
template <int B>
__device__ __forceinline__ std::uint64_t load_codes8(const std::uint8_t* p) {
  if constexpr (B == 8) return *reinterpret_cast<const std::uint64_t*>(p);
  else if constexpr (B == 4) return *reinterpret_cast<const std::uint32_t*>(p);
  else if constexpr (B == 2) return *reinterpret_cast<const std::uint16_t*>(p);
  else return static_cast<std::uint64_t>(p[0]) | static_cast<std::uint64_t>(p[1]) << 8 | static_cast<std::uint64_t>(p[2]) << 16;
}
// Eight affine values s (code - z) as fp16 from eight B-bit codes (v, LSB first), each rounded once
// (the tuned kernel's operands): a pair of codes becomes the fp16 pair (1024 + c0, 1024 + c1) by one
// LOP3 (exact for codes < 1024), minus (1024 + z) exactly, times (s, s) in fp16.
template <int B>
__device__ __forceinline__ uint4 dequant8(std::uint64_t v, std::uint32_t z2, std::uint32_t s2) {
  std::uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = hmul2u(sub_zero(code_pair<B>(static_cast<std::uint32_t>(v >> (2 * B * k)), 0), z2), s2);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// Eight bf16 values (a uint4) as fp16, each rounded once.
__device__ __forceinline__ uint4 bf16x8_to_half(uint4 x) {
  return make_uint4(bf2_to_h2(x.x), bf2_to_h2(x.y), bf2_to_h2(x.z), bf2_to_h2(x.w));
}

struct GenWork {
  float* opart;  // [batch][heads][nsplit][d_c]
  float* ml;     // [batch][heads][nsplit][2]
  int nsplit;
  int ns;                     // pipeline stages
  const float* q;             // the query the kernel reads: p.q, or for mla-tq the rotated copy
  const std::uint16_t* prot;  // mla-tq: rotated protected latent rows, fp16 [batch][slots][d_c]
};

// Shared memory (bytes) for tiles of TI tokens: the query (fp16; bf16 hi and lo for a bf16 cache) in
// rows of D + 8 halves (the pad keeps ldmatrix free of bank conflicts); affine and mla-tq: the operand
// tile in such rows, then NS raw stages (TI rows of content codes, RoPE codes and metadata, as in the
// page); bf16: NS stages that are operand tiles. Then partial scores [8][16][TI + 8] floats, P
// [16][TI + 8] halves, the rescale factors and the mla-tq code-pair table.
__host__ __device__ constexpr int gen_row(int D) { return D + 8; }
struct GenSmem {
  int q, tile, stage, tail;
  __host__ __device__ GenSmem(int D, bool bf16, int raw_row, int TI) {
    q = (bf16 ? 2 : 1) * kHG * gen_row(D) * 2;
    tile = bf16 ? 0 : TI * gen_row(D) * 2;
    stage = bf16 ? TI * gen_row(D) * 2 : TI * raw_row;
    tail = kNW * kHG * (TI + 8) * 4 + kHG * (TI + 8) * 2 + kHG * 4 + 256 * 4;
  }
  __host__ __device__ int bytes(int ns) const { return q + tile + ns * stage + tail; }
};

template <int N>
__device__ __forceinline__ void wait_stages(int n) {  // cp.async.wait_group n for a runtime n <= N
  if constexpr (N >= 0) {
    if (n >= N) cp_async_wait<N>();
    else wait_stages<N - 1>(n);
  }
}

// Format codes as in mla_decode.cu: 16 (bf16), 8, 4, 3, 2 (affine content bits), 100 + b (mla-tq).
template <int CB, int RB, int TI>
__global__ void __launch_bounds__(kNT, 2) mla_decode_gen_kernel(const __grid_constant__ MlaDecodeParams p, GenWork wk) {
  constexpr bool kB = CB == 16;  // bf16 cache: bf16 operands, query hi + lo
  constexpr bool kTq = CB > 100;  // mla-tq: fp16 n C[idx] in the rotated domain, the RoPE key bf16 -> fp16
  constexpr int BITS = kTq ? CB - 100 : CB;
  const int dc = p.fmt.d_latent, dr = p.fmt.d_rope, D = dc + dr, G = dc / 64, R = dr / 64;
  const int RW = gen_row(D);
  const PageLayout L = p.fmt.page;
  const int KCB = static_cast<int>(L.key_code_bytes), VCB = static_cast<int>(L.value_code_bytes), MB = static_cast<int>(L.meta_bytes);
  const int raw_row = KCB + VCB + MB;
  const GenSmem lay(D, kB, raw_row, TI);
  constexpr int SP = TI + 8;           // row stride of the partial scores (floats) and of P (halves)
  constexpr int TPR = kNT / TI;        // threads per tile row in the copies and the operand fill
  constexpr int NJ = TI / 8, NK = TI / 16;  // QK n-tiles (8 tokens), PV k-steps (16 tokens)
  constexpr int TPT = TI / 16;         // softmax: tokens per thread
  const int NS = wk.ns;
  extern __shared__ __align__(16) std::uint8_t smem_raw[];
  std::uint16_t* sQ = reinterpret_cast<std::uint16_t*>(smem_raw);                  // [16][RW] (bf16: hi, then lo)
  std::uint16_t* sTile = reinterpret_cast<std::uint16_t*>(smem_raw + lay.q);        // affine, mla-tq: [TI][RW]
  std::uint8_t* stages = smem_raw + lay.q + lay.tile;                               // NS x stage
  float* spart = reinterpret_cast<float*>(stages + NS * lay.stage);                 // [8][16][SP]
  std::uint16_t* sP = reinterpret_cast<std::uint16_t*>(spart + kNW * kHG * SP);     // [16][SP]
  float* salpha = reinterpret_cast<float*>(sP + kHG * SP);                          // [16]
  std::uint32_t* tbl = reinterpret_cast<std::uint32_t*>(salpha + kHG);              // mla-tq: [2^(2b)] (C[lo], C[hi]) fp16
  const int split = blockIdx.x, hg = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;

  const int Lq = p.seq_lens[b];
  const MlaTiles<TI> vtiles(p.protect, !kB && p.protect.enabled(), Lq, wk.nsplit, split);
  const int first = vtiles.first, nprt = vtiles.nprt, v0 = vtiles.v0, v1 = vtiles.v1;
  const int kb = max(v0, nprt), nks = max(0, v1 - kb);
  const std::int32_t* bt = p.block_tables + static_cast<std::size_t>(b) * p.max_pages;
  const std::uint32_t sbase = static_cast<std::uint32_t>(__cvta_generic_to_shared(stages));

  // Copies packed tile k of this split (virtual tile kb + k) into stage `slot`.
  auto issue = [&](int k, int slot) {
    if (k >= nks) return;
    const int pi = first + kb + k - nprt;
    const std::uint8_t* page = p.pool + static_cast<std::size_t>(static_cast<unsigned>(bt[(pi * TI) / kPT])) * L.page_bytes;
    const int toff = (pi * TI) % kPT;
    const std::uint32_t dst = sbase + static_cast<std::uint32_t>(slot * lay.stage);
    if constexpr (kB) {  // padded operand rows; rows outside the sequence zero-filled (pages may hold NaN)
      // thread = (row tid / TPR, chunks tid % TPR + TPR j): no division
      const int rows_ok = min(TI, Lq - pi * TI), cpr = D / 8, dcc = dc / 8, r = tid / TPR;
      for (int c = tid % TPR; c < cpr; c += TPR) {
        const std::uint8_t* src = c < dcc ? page + L.key_code_off + static_cast<std::size_t>(toff + r) * KCB + 16 * c
                                          : page + L.value_code_off + static_cast<std::size_t>(toff + r) * VCB + 16 * (c - dcc);
        cp_async16_zfill(dst + static_cast<std::uint32_t>(r * RW * 2 + 16 * c), r < rows_ok ? src : page, r < rows_ok);
      }
    } else {  // the three regions of the tile's TI rows, each contiguous in the page
      const int n1 = TI * KCB / 16, n2 = TI * VCB / 16, n3 = TI * MB / 16;  // 16-byte chunks per region
      for (int i = tid; i < n1 + n2 + n3; i += kNT) {
        const std::uint8_t* src = i < n1        ? page + L.key_code_off + static_cast<std::size_t>(toff) * KCB + 16 * i
                                  : i < n1 + n2 ? page + L.value_code_off + static_cast<std::size_t>(toff) * VCB + 16 * (i - n1)
                                                : page + L.meta_off + static_cast<std::size_t>(toff) * MB + 16 * (i - n1 - n2);
        cp_async16(reinterpret_cast<void*>(stages + slot * lay.stage + 16 * i), src);
      }
    }
  };
  for (int k = 0; k < NS - 1; ++k) {
    issue(k, k);
    cp_async_commit();
  }
  if constexpr (kTq)
    for (int e = tid; e < (1 << (2 * BITS)); e += kNT)
      tbl[e] = pack2<false>(p.fmt.tq_centroids[e & ((1 << BITS) - 1)], p.fmt.tq_centroids[e >> BITS]);

  // ---- query: pre-scaled by scale * log2(e) (scores in log2 units)
  const float sl2 = p.scale * kLog2e;
  const int nh = min(kHG, p.heads - hg * kHG);  // heads of this group that exist (the others: zero query, no output)
  for (int i = tid; i < kHG * D / 2; i += kNT) {
    const int h = i / (D / 2), d = 2 * (i % (D / 2));
    const float* qp = wk.q + (static_cast<std::size_t>(b) * p.heads + hg * kHG + h) * D + d;
    const float x0 = h < nh ? qp[0] * sl2 : 0.0f, x1 = h < nh ? qp[1] * sl2 : 0.0f;
    std::uint32_t hi, lo;
    if constexpr (kB) {
      split2<true>(x0, x1, hi, lo);
      *reinterpret_cast<std::uint32_t*>(sQ + kHG * RW + h * RW + d) = lo;
    } else {
      hi = pack2<false>(x0, x1);
    }
    *reinterpret_cast<std::uint32_t*>(sQ + h * RW + d) = hi;
  }

  float o[kMaxG][4];
#pragma unroll
  for (int n = 0; n < kMaxG; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  // softmax role: thread = (head sh, tokens TPT sk ..); every thread of a head holds its state
  const int sh = tid >> 4, sk = tid & 15;
  float m_run = -INFINITY, l_run = 0.0f;

  for (int vt = v0; vt < v1; ++vt) {
    const bool is_prot = vt < nprt;
    const int k = vt - kb;
    int lo, hi;
    vtiles.range(vt, lo, hi);
    if (!is_prot) wait_stages<6>(NS - 2);  // this tile's copies have landed (this thread's)
    __syncthreads();  // every thread's copies visible; the previous tile's readers are done
    if (!is_prot) {
      issue(k + NS - 1, (k + NS - 1) % NS);
      cp_async_commit();
    }
    const std::uint16_t* tile = sTile;
    if constexpr (kB) {
      tile = reinterpret_cast<const std::uint16_t*>(stages + (k % NS) * lay.stage);
    } else {
      // ---- 1. the operand tile: item = (row r, 8 dims at column 8 c)
      const std::uint8_t* st = stages + (is_prot ? 0 : k % NS) * lay.stage;
      // thread = (row r = tid / TPR, chunks c = tid % TPR + TPR j): group c / 8, no division
      const int chunks = D / 8, r = tid / TPR;
      for (int c = tid % TPR; c < chunks; c += TPR) {
        const int d = 8 * c;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r >= lo && r < hi) {
          if (is_prot) {
            const int slot = p.protect.slot(vtiles.prot_pos(vt, r));
            if (kTq && d < dc)  // the pre-kernel's rotated latent row (fp16)
              v = *reinterpret_cast<const uint4*>(wk.prot + (static_cast<std::size_t>(b) * p.protect.slots() + slot) * dc + d);
            else
              v = bf16x8_to_half(*reinterpret_cast<const uint4*>(p.protect_rows + p.protect.row(b, slot) + d));
          } else if constexpr (kTq) {
            if (d < dc) {  // pairs of codes -> (C[lo], C[hi]) from the table, times the stored norm (n, n)
              const std::uint32_t n = *reinterpret_cast<const std::uint16_t*>(st + TI * (KCB + VCB) + r * MB);
              const std::uint32_t n2 = n * 0x10001u;
              const std::uint64_t cv = load_codes8<BITS>(st + r * KCB + d * BITS / 8);
              std::uint32_t wv[4];
#pragma unroll
              for (int kk = 0; kk < 4; ++kk) {
                const std::uint32_t e = static_cast<std::uint32_t>(cv >> (2 * BITS * kk)) & ((1u << (2 * BITS)) - 1u);
                const __half2 x = __hmul2(*reinterpret_cast<const __half2*>(tbl + e), *reinterpret_cast<const __half2*>(&n2));
                wv[kk] = *reinterpret_cast<const std::uint32_t*>(&x);
              }
              v = make_uint4(wv[0], wv[1], wv[2], wv[3]);
            } else {
              v = bf16x8_to_half(*reinterpret_cast<const uint4*>(st + TI * KCB + r * VCB + 2 * (d - dc)));
            }
          } else {
            const std::uint8_t* meta = st + TI * (KCB + VCB) + r * MB;
            if (d < dc) {
              const int gi = d >> 6;
              const float s = bf16_bits_to_float(*reinterpret_cast<const std::uint16_t*>(meta + 2 * gi));
              const std::uint32_t z = meta[2 * G + gi];
              v = dequant8<CB>(load_codes8<CB>(st + r * KCB + d * CB / 8), zero_pair(z), pack2<false>(s, s));
            } else {
              const int dd = d - dc, ri = dd >> 6;
              const float s = __uint_as_float(load_u32_any(meta + 3 * G + 4 * ri));
              const std::uint32_t z = meta[3 * G + 4 * R + ri];
              v = dequant8<RB>(load_codes8<RB>(st + TI * KCB + r * VCB + dd * RB / 8), zero_pair(z),
                               pack2<false>(s, s));
            }
          }
        }
        *reinterpret_cast<uint4*>(sTile + r * RW + d) = v;
      }
      __syncthreads();
    }
    // ---- 2. QK: warp w takes k-steps w, w + 8, ... (16 dims each) of the whole row
    {
      float acc[NJ][4];
#pragma unroll
      for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
      const int ks_n = D / 16;
      const int qrow = lane & 15, qcol = (lane >> 4) * 8;
      const int krow = (lane >> 4) * 8 + (lane & 7), kcol = ((lane >> 3) & 1) * 8;
      for (int ks = w; ks < ks_n; ks += kNW) {
        std::uint32_t a[4], al[4], kf[NK][4];
        ldsm_x4(a, smem_u32(sQ + qrow * RW + 16 * ks + qcol));
        if constexpr (kB) ldsm_x4(al, smem_u32(sQ + kHG * RW + qrow * RW + 16 * ks + qcol));
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) ldsm_x4(kf[kk], smem_u32(tile + (16 * kk + krow) * RW + 16 * ks + kcol));
#pragma unroll
        for (int kk = 0; kk < NK; ++kk) {
          mma16816<kB>(acc[2 * kk], a, kf[kk][0], kf[kk][1]);
          mma16816<kB>(acc[2 * kk + 1], a, kf[kk][2], kf[kk][3]);
          if constexpr (kB) {
            mma16816<kB>(acc[2 * kk], al, kf[kk][0], kf[kk][1]);
            mma16816<kB>(acc[2 * kk + 1], al, kf[kk][2], kf[kk][3]);
          }
        }
      }
      float* dst = spart + (w * kHG) * SP;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        *reinterpret_cast<float2*>(dst + g * SP + 8 * j + 2 * t) = make_float2(acc[j][0], acc[j][1]);
        *reinterpret_cast<float2*>(dst + (g + 8) * SP + 8 * j + 2 * t) = make_float2(acc[j][2], acc[j][3]);
      }
    }
    __syncthreads();
    // ---- 3. online softmax: thread (head sh, tokens TPT sk .. TPT sk + TPT - 1); 16 threads of a head
    // share a half-warp
    {
      float sv[TPT];
#pragma unroll
      for (int i = 0; i < TPT; ++i) sv[i] = 0.0f;
#pragma unroll
      for (int ww = 0; ww < kNW; ++ww) {
        const float* src = spart + (ww * kHG + sh) * SP + TPT * sk;
        if constexpr (TPT == 2) {
          const float2 v2 = *reinterpret_cast<const float2*>(src);
          sv[0] += v2.x;
          sv[1] += v2.y;
        } else {
          sv[0] += src[0];
        }
      }
      float mx = -INFINITY;
      bool valid[TPT];
#pragma unroll
      for (int i = 0; i < TPT; ++i) {
        valid[i] = TPT * sk + i >= lo && TPT * sk + i < hi;
        sv[i] = valid[i] ? sv[i] : -INFINITY;
        mx = fmaxf(mx, sv[i]);
      }
#pragma unroll
      for (int off = 8; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float mn = fmaxf(m_run, mx);
      const float alpha = mn == m_run ? 1.0f : ex2(m_run - mn);  // m_run = -inf: 0
      float ps = 0.0f;  // the sum of the P the PV product uses
      std::uint16_t pbits[TPT];
#pragma unroll
      for (int i = 0; i < TPT; ++i) {
        const float pr = valid[i] && mn != -INFINITY ? ex2(sv[i] - mn) : 0.0f;
        if constexpr (kB) {
          const __nv_bfloat16 h = __float2bfloat16_rn(pr);
          pbits[i] = __bfloat16_as_ushort(h);
          ps += __bfloat162float(h);
        } else {
          const __half h = __float2half_rn(pr);
          pbits[i] = __half_as_ushort(h);
          ps += __half2float(h);
        }
      }
#pragma unroll
      for (int off = 8; off >= 1; off >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, off);
      l_run = l_run * alpha + ps;
      m_run = mn;
#pragma unroll
      for (int i = 0; i < TPT; ++i) sP[sh * SP + TPT * sk + i] = pbits[i];
      if (sk == 0) salpha[sh] = alpha;
    }
    __syncthreads();
    // ---- 4. PV: warp w accumulates heads g, g + 8 at dims 8 G w + 8 n + 2 t, + 1
    {
      const float a0 = salpha[g], a1 = salpha[g + 8];
      if (__any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f)) {  // a head's maximum moved
#pragma unroll
        for (int n = 0; n < kMaxG; ++n) {
          o[n][0] *= a0;
          o[n][1] *= a0;
          o[n][2] *= a1;
          o[n][3] *= a1;
        }
      }
      std::uint32_t pa[NK][4];
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) ldsm_x4(pa[kk], smem_u32(sP + (lane & 15) * SP + 16 * kk + (lane >> 4) * 8));
      const int vrow = lane & 15;
#pragma unroll
      for (int n = 0; n < kMaxG; ++n) {
        if (n < G) {
#pragma unroll
          for (int kk = 0; kk < NK; ++kk) {
            std::uint32_t b0, b1;
            ldsm_x2_trans(b0, b1, smem_u32(tile + (16 * kk + vrow) * RW + 8 * G * w + 8 * n));
            mma16816<kB>(o[n], pa[kk], b0, b1);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  // ---- partial state of this split: unnormalized output, max (natural log units), sum
  float* dst = wk.opart + ((static_cast<std::size_t>(b) * p.heads + hg * kHG) * wk.nsplit + split) * dc;
  const std::size_t hstride = static_cast<std::size_t>(wk.nsplit) * dc;
#pragma unroll
  for (int n = 0; n < kMaxG; ++n) {
    if (n < G) {
      const int d = 8 * G * w + 8 * n + 2 * t;
      if (g < nh) *reinterpret_cast<float2*>(dst + g * hstride + d) = make_float2(o[n][0], o[n][1]);
      if (g + 8 < nh) *reinterpret_cast<float2*>(dst + (g + 8) * hstride + d) = make_float2(o[n][2], o[n][3]);
    }
  }
  if (sk == 0 && sh < nh) {
    const std::size_t r = (static_cast<std::size_t>(b) * p.heads + hg * kHG + sh) * wk.nsplit + split;
    wk.ml[2 * r] = m_run * kLn2;
    wk.ml[2 * r + 1] = l_run;
  }
}

// mla-tq pre-kernel (any d_c): blocks [0, batch x heads) write Pi q = H (D q) of one query's latent
// part (fp32, the RoPE part copied) to qrot[b][h][D]; the blocks after them (protection on) write
// Pi c of one protected slot's latent row as fp16 to prot[b][slot][d_c]. H is the block Hadamard of
// d_c (smem_fwht: kvq::fwht's operation order), as the CPU quantizer's rotation.
__global__ void __launch_bounds__(128) mla_tq_rotate_gen_kernel(const __grid_constant__ MlaDecodeParams p, float* __restrict__ qrot,
                                                                std::uint16_t* __restrict__ prot) {
  extern __shared__ float sx[];  // [d_c]
  const int dc = p.fmt.d_latent, D = dc + p.fmt.d_rope, tid = threadIdx.x;
  const int nq = p.batch * p.heads;
  const bool isq = static_cast<int>(blockIdx.x) < nq;
  const int r = static_cast<int>(blockIdx.x) - nq;
  const float* q = p.q + static_cast<std::size_t>(blockIdx.x) * D;
  const std::uint16_t* row = isq ? nullptr : p.protect_rows + p.protect.row(r / p.protect.slots(), r % p.protect.slots());
  for (int i = tid; i < dc; i += blockDim.x) {
    const float x = isq ? q[i] : bf16_bits_to_float(row[i]);
    sx[i] = (p.fmt.tq_signs[i >> 5] >> (i & 31)) & 1u ? -x : x;
  }
  __syncthreads();
  smem_fwht(sx, dc, 1, dc, tid, blockDim.x);
  __syncthreads();
  if (isq) {
    float* o = qrot + static_cast<std::size_t>(blockIdx.x) * D;
    for (int i = tid; i < D; i += blockDim.x) o[i] = i < dc ? sx[i] : q[i];
  } else {
    for (int i = tid; i < dc; i += blockDim.x) prot[static_cast<std::size_t>(r) * dc + i] = __half_as_ushort(__float2half_rn(sx[i]));
  }
}

// out[b][h] = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s over the splits (one block per (head,
// sequence); each thread four dims at a time, in split order: deterministic); mla-tq: then
// Pi^T = D H applied to the merged row.
template <bool kTq>
__global__ void __launch_bounds__(128) mla_combine_gen_kernel(const __grid_constant__ MlaDecodeParams p, const float* __restrict__ opart,
                                                              const float* __restrict__ ml, int nsl) {
  extern __shared__ float sx[];  // mla-tq: [d_c]
  const int dc = p.fmt.d_latent;
  const std::size_t bh = static_cast<std::size_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const float2* m = reinterpret_cast<const float2*>(ml + bh * nsl * 2);
  float M = -INFINITY;
  for (int s = 0; s < nsl; ++s) M = fmaxf(M, m[s].x);
  float den = 0.0f;
  for (int s = 0; s < nsl; ++s)
    if (m[s].x != -INFINITY) den += expf(m[s].x - M) * m[s].y;
  const float inv = den > 0.0f ? 1.0f / den : 0.0f;
  for (int d4 = threadIdx.x; d4 < dc / 4; d4 += blockDim.x) {
    float4 acc = make_float4(0, 0, 0, 0);
    for (int s = 0; s < nsl; ++s) {
      if (m[s].x == -INFINITY) continue;
      const float e = expf(m[s].x - M);
      const float4 x = reinterpret_cast<const float4*>(opart + (bh * nsl + s) * dc)[d4];
      acc.x += e * x.x;
      acc.y += e * x.y;
      acc.z += e * x.z;
      acc.w += e * x.w;
    }
    const float4 r = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    if constexpr (kTq) reinterpret_cast<float4*>(sx)[d4] = r;
    else reinterpret_cast<float4*>(p.out + bh * dc)[d4] = r;
  }
  if constexpr (kTq) {
    __syncthreads();
    smem_fwht(sx, dc, 1, dc, threadIdx.x, blockDim.x);
    __syncthreads();
    for (int i = threadIdx.x; i < dc; i += blockDim.x) p.out[bh * dc + i] = (p.fmt.tq_signs[i >> 5] >> (i & 31)) & 1u ? -sx[i] : sx[i];
  }
}

// Shared memory per CTA: two CTAs per SM ((228 KB - 2 x 1 KB reserved) / 2, as the tuned kernel),
// or one.
constexpr int kTwoPerSm = kMlaSmemTwoPerSm, kOnePerSm = 232448 - 1024;
// Stages for tiles of TI tokens: as many as fit (2..6) beside two CTAs per SM when `two`, else in
// one CTA per SM; 0 if fewer than two fit.
int gen_stages(const GenSmem& lay, bool two) {
  const int ns = std::min(6, ((two ? kTwoPerSm : kOnePerSm) - lay.bytes(0)) / lay.stage);
  return ns >= 2 ? ns : 0;
}

template <int CB, int RB, int TI>
cudaError_t launch_gen_ti(const MlaDecodeParams& p, int nsplit, const GenSmem& lay, int ns, cudaStream_t st);

// Tiles of 32 tokens (half the barriers and softmax steps per token) when they fit beside two CTAs
// per SM, else 16-token tiles (two CTAs per SM, else one).
template <int CB, int RB>
cudaError_t launch_gen(const MlaDecodeParams& p, int nsplit, cudaStream_t st) {
  constexpr bool kB = CB == 16;
  const int D = p.fmt.d_latent + p.fmt.d_rope;
  const PageLayout& L = p.fmt.page;
  const int raw = static_cast<int>(L.key_code_bytes + L.value_code_bytes + L.meta_bytes);
  const GenSmem l32(D, kB, raw, 32), l16(D, kB, raw, 16);
  if (const int ns = gen_stages(l32, true)) return launch_gen_ti<CB, RB, 32>(p, nsplit, l32, ns, st);
  if (const int ns = gen_stages(l16, true)) return launch_gen_ti<CB, RB, 16>(p, nsplit, l16, ns, st);
  if (const int ns = gen_stages(l16, false)) return launch_gen_ti<CB, RB, 16>(p, nsplit, l16, ns, st);
  return cudaErrorInvalidValue;
}

template <int CB, int RB, int TI>
cudaError_t launch_gen_ti(const MlaDecodeParams& p, int nsplit, const GenSmem& lay, int ns, cudaStream_t st) {
  const int D = p.fmt.d_latent + p.fmt.d_rope;
  cudaError_t e = smem_limit_once<mla_decode_gen_kernel<CB, RB, TI>>(kOnePerSm);
  if (e != cudaSuccess) return e;
  constexpr bool kTq = CB > 100;
  const int dc = p.fmt.d_latent;
  GenWork wk;
  wk.nsplit = nsplit;
  wk.ns = ns;
  wk.opart = static_cast<float*>(p.workspace);
  const std::size_t rows = static_cast<std::size_t>(p.batch) * p.heads * nsplit;
  wk.ml = wk.opart + rows * dc;
  wk.q = p.q;
  wk.prot = nullptr;
  if constexpr (kTq) {  // workspace after (opart, ml) at the next 16-byte boundary: rotated queries [batch][heads][D] fp32, rotated protected rows [batch][slots][d_c] fp16
    float* qrot = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + mla_tq_ws_offset(rows, dc));
    std::uint16_t* prot = reinterpret_cast<std::uint16_t*>(qrot + static_cast<std::size_t>(p.batch) * p.heads * D);
    const int nblk = p.batch * p.heads + (p.protect.enabled() ? p.batch * p.protect.slots() : 0);
    mla_tq_rotate_gen_kernel<<<nblk, 128, dc * sizeof(float), st>>>(p, qrot, prot);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    wk.q = qrot;
    wk.prot = prot;
  }
  mla_decode_gen_kernel<CB, RB, TI><<<dim3(nsplit, (p.heads + kHG - 1) / kHG, p.batch), kNT, lay.bytes(ns), st>>>(p, wk);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  mla_combine_gen_kernel<kTq><<<dim3(p.heads, p.batch), 128, kTq ? dc * sizeof(float) : 0, st>>>(p, wk.opart, wk.ml, nsplit);
  return cudaGetLastError();
}

}  // namespace

bool mla_generic_shape_ok(int d_latent, int d_rope) {
  return d_latent % 64 == 0 && d_rope % 64 == 0 && d_latent >= 64 && d_latent <= 64 * kMaxG && d_rope >= 64 &&
         d_rope <= 64 * kMaxR;
}

cudaError_t mla_decode_generic(const MlaDecodeParams& p, int nsplit, cudaStream_t st) {
  const MlaFormat& f = p.fmt;
  if (!mla_generic_shape_ok(f.d_latent, f.d_rope)) return cudaErrorInvalidValue;
  const int c = f.content_bits, r = f.rope_bits;
  if (f.tq) {
    if (c == 4) return launch_gen<104, 16>(p, nsplit, st);
    if (c == 3) return launch_gen<103, 16>(p, nsplit, st);
    return cudaErrorInvalidValue;
  }
  if (c == 16) return launch_gen<16, 16>(p, nsplit, st);
  if (c == 8 && r == 8) return launch_gen<8, 8>(p, nsplit, st);
  if (c == 4 && r == 8) return launch_gen<4, 8>(p, nsplit, st);
  if (c == 4 && r == 4) return launch_gen<4, 4>(p, nsplit, st);
  if (c == 3 && r == 4) return launch_gen<3, 4>(p, nsplit, st);
  if (c == 2 && r == 4) return launch_gen<2, 4>(p, nsplit, st);
  return cudaErrorInvalidValue;
}

}  // namespace detail
}  // namespace kvq::cuda
