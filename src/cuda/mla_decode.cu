// mla_decode.cu: paged split-KV decode for absorbed MLA (d_c = 512, d_r = 64) over bf16 and
// QuantMLA affine caches, and the combine kernel that merges the splits' partial softmax states.
//
// One CTA (8 warps, two CTAs per SM) = one sequence x 16 query heads x a range of tiles (a split);
// a request with H heads runs H / 16 such CTAs per split, reading the same pages (L2). Tiles are
// 32 tokens (affine) or 16 (bf16). Per tile:
//  1. cp.async keeps NS - 1 tiles in flight (a ring of NS shared-memory stages holding the packed
//     rows, RoPE rows and metadata, bank-padded);
//  2. warp w takes content group w (64 dims) and RoPE dims 8 w .. 8 w + 7 of every token: each
//     lane reads its codes from the stage and dequantizes them in registers, straight into mma
//     B fragments (fp16 q - z by the exponent trick; bf16 rows as they are);
//  3. QK on tensor cores (mma.sync m16n8k16 + m16n8k8 for the RoPE slice), scaled per token by
//     the group / RoPE scale; the 8 per-group partial scores meet in shared memory;
//  4. online softmax (two heads per warp);
//  5. PV on tensor cores from the same registers: movmatrix transposes each 8x8 block of the QK
//     fragments into PV fragments, so every packed tile is read and dequantized once; A = P scaled
//     per token by the group scale; each lane accumulates its own dims.
// Protected positions (sinks, recent window) of an affine cache are read from their bf16 rows as
// leading tiles of the first split, in the same online softmax; the combine kernel merges the
// splits' (max, sum, output). A bf16 cache needs no protection: its rows are bf16 already.
// MlaDecodeParams::warps is accepted for compatibility (8 or 16) and does not change the kernel.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "device.cuh"
#include "kvq_cuda_mla.hpp"

namespace kvq::cuda {

MlaFormat mla_format(const FormatSpec& f, int d_latent, int d_rope) {
  if (f.family != FormatFamily::kMLA && f.kind != FormatKind::kBf16) fail("format '" + f.name + "' is not an MLA format");
  MlaFormat m;
  if (f.kind == FormatKind::kBf16) {
    m.content_bits = m.rope_bits = 16;
  } else if (f.kind == FormatKind::kMlaAffine) {
    m.content_bits = f.key_bits;
    m.rope_bits = f.value_bits;
  } else {
    fail("format '" + f.name + "' has no MLA CUDA kernel (bf16, c8r8, c4r8, c4r4, c3r4, c2r4)");
  }
  m.d_latent = d_latent;
  m.d_rope = d_rope;
  CacheGeometry g;
  g.n_layers = 1;
  g.mla = true;
  g.d_latent = d_latent;
  g.d_rope = d_rope;
  m.page = page_layout(f, g);
  return m;
}

bool mla_supported(const MlaFormat& f) {
  if (f.d_latent != 512 || f.d_rope != 64 || f.page.tokens != 64 || f.page.heads != 1) return false;
  const int c = f.content_bits, r = f.rope_bits;
  if (c == 16) return r == 16 && f.page.key_code_bytes == 1024 && f.page.value_code_bytes == 128;
  if (f.page.meta_bytes != 32) return false;
  return (c == 8 && r == 8) || (c == 4 && (r == 8 || r == 4)) || ((c == 3 || c == 2) && r == 4);
}

namespace {

using detail::cp_async16;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::mma16816;
using detail::split2;

constexpr int kDc = 512, kD = 576, kPT = 64, kHG = 16, kNW = 8, kNT = 32 * kNW;
constexpr int kSmemMax = 115712;  // two CTAs per SM: (228 KB - 2 x 1 KB reserved) / 2
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// Per-format constants. A tile is TI tokens (32 for the affine formats; 16 for bf16, whose rows
// are 1152 bytes). A stage holds one tile: content rows (stride CS), RoPE rows (stride RS) and,
// for affine formats, 32-byte metadata rows (stride MS); the strides are padded so that the
// per-lane fragment loads below are free of bank conflicts.
template <int CB, int RB>
struct Cfg {
  static constexpr bool kAff = CB != 16;
  static constexpr int TI = kAff ? 32 : 16;
  static constexpr int NJ = TI / 8;  // QK n-tiles (8 tokens) per warp
  static constexpr int CBY = kAff ? 8 * CB * 8 : 1024;  // content bytes per token
  static constexpr int RBY = kAff ? 8 * RB : 128;       // RoPE bytes per token
  static constexpr int MBY = kAff ? 32 : 0;
  static constexpr int CS = CB == 16 ? 1088 : CB == 8 ? 576 : CB == 4 ? 288 : CB == 3 ? 208 : 144;
  static constexpr int RS = RB == 16 ? 144 : RB == 8 ? 80 : 48;
  static constexpr int MS = kAff ? 48 : 0;
  static constexpr int kStage = TI * (CS + RS + MS);
  static constexpr int SST = TI + 8;  // floats per partial-score / P row
  // Affine: per-tile scales [2 buffers][9][TI] (8 content groups, then RoPE), 0 outside the
  // sequence, and the per-group maximum [2][8].
  static constexpr int kScl = kAff ? 2 * (9 * TI + 8) : 0;
  static constexpr int kTail = (8 * kHG * SST + kHG * SST + 3 * kHG + kScl) * 4;
  static constexpr int NS0 = (kSmemMax - kTail) / kStage;
  static constexpr int NS = NS0 > 8 ? 8 : NS0;
  static constexpr int kSmem = NS * kStage + kTail;
  static_assert(NS >= 4, "at least four stages");
};

// Lane (g, t) holds sixteen content dims of its group; word k of its fragment (k = 0..7) holds
// two of them, e = 0 (low half) and e = 1: the order the cheapest dequantization produces. The
// dims of word k are 16 t + widx(k, e) for affine caches and, for bf16, 8 t + widx (widx < 8) or
// 24 + 8 t + widx (widx >= 8), so that a token's four lanes read 64 contiguous bytes.
template <int CB>
__host__ __device__ constexpr int widx(int k, int e) {
  if constexpr (CB == 4) return (k < 4 ? k : 4 + k) + 4 * e;
  else if constexpr (CB == 2) return k + 8 * e;
  else return 2 * k + e;
}
template <int CB>
__device__ __forceinline__ int wdim(int t, int k, int e) {
  const int i = widx<CB>(k, e);
  if constexpr (CB == 16) return i < 8 ? 8 * t + i : 24 + 8 * t + i;
  else return 16 * t + i;
}

__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
// Transposes the 8x8 b16 matrix held one 32-bit pair per lane (row lane / 4, columns 2 (lane % 4) ..).
__device__ __forceinline__ std::uint32_t movt(std::uint32_t x) {
  std::uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// D = A * B + D, m16n8k8 (a0 rows g, a1 rows g + 8, k pair 2t; b0 k pair 2t of column g).
template <bool kBf16>
__device__ __forceinline__ void mma1688(float (&c)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t b0) {
  if constexpr (kBf16) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
  } else {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
  }
}

// (x_lo - z, x_hi - z) of two codes held as fp16 1024 + code (exponent trick: exact for codes,
// zeros <= 255).
__device__ __forceinline__ std::uint32_t sub_zero(std::uint32_t w, std::uint32_t z2) {
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&w), *reinterpret_cast<const __half2*>(&z2));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}
// Codes 2k, 2k + 1 of a little-endian B-bit code word v as an fp16x2 (1024 + code) pair.
template <int B>
__device__ __forceinline__ std::uint32_t code_pair(std::uint32_t v, int k) {
  constexpr std::uint32_t lo = (1u << B) - 1u, hi = lo << 16;
  const std::uint32_t x = v >> (2 * B * k);
  return (x & lo) | ((x << (16 - B)) & hi) | 0x64006400u;
}
// Sixteen consecutive codes (dims 16 t .. 16 t + 15 of one group) at `p` as eight fp16x2 pairs
// q - z, word k holding codes widx(k, 0) and widx(k, 1).
template <int B>
__device__ __forceinline__ void dequant16(std::uint32_t (&w)[8], const std::uint8_t* p, int z) {
  const std::uint32_t z2 = 0x64006400u + static_cast<std::uint32_t>(z) * 0x10001u;
  if constexpr (B == 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const std::uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = sub_zero(__byte_perm(u[i], 0x64646464u, 0x5150), z2);
      w[2 * i + 1] = sub_zero(__byte_perm(u[i], 0x64646464u, 0x5352), z2);
    }
  } else if constexpr (B == 4) {  // word k: codes (k, k + 4), (8 + k, 12 + k)
    const uint2 v = *reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = sub_zero(((v.x >> (4 * k)) & 0x000f000fu) | 0x64006400u, z2);
      w[4 + k] = sub_zero(((v.y >> (4 * k)) & 0x000f000fu) | 0x64006400u, z2);
    }
  } else if constexpr (B == 2) {  // word k: codes (k, k + 8)
    const std::uint32_t v = *reinterpret_cast<const std::uint32_t*>(p);
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = sub_zero(((v >> (2 * k)) & 0x00030003u) | 0x64006400u, z2);
  } else {  // B == 3: 48 bits at a 2-byte aligned address
    const std::uint16_t* h = reinterpret_cast<const std::uint16_t*>(p);
    const std::uint32_t a = h[0], bb = h[1], c = h[2];
    const std::uint32_t v0 = a | ((bb & 0xffu) << 16), v1 = (bb >> 8) | (c << 8);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = sub_zero(code_pair<3>(v0, k), z2);
      w[4 + k] = sub_zero(code_pair<3>(v1, k), z2);
    }
  }
}
__device__ __forceinline__ std::uint32_t bf2_to_h2(std::uint32_t x) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  return detail::pack2<false>(f.x, f.y);
}

struct Work {
  float* opart;  // [batch][heads][nsplit][512]
  float* ml;     // [batch][heads][nsplit][2]: running max (natural log units) and sum
  int nsplit;
};

// Two elements x0, x1 of sixteen bf16 values held as eight words u (element i in half i % 2 of
// u[i / 2]) as one fp16x2 word.
template <int X0, int X1>
__device__ __forceinline__ std::uint32_t pick_h2(const std::uint32_t (&u)[8]) {
  constexpr unsigned lo = (X0 & 1) ? 0x32u : 0x10u, hi = (X1 & 1) ? 0x76u : 0x54u;
  return bf2_to_h2(__byte_perm(u[X0 / 2], u[X1 / 2], lo | (hi << 8)));
}
template <int CB, int K>
__device__ __forceinline__ void prot_words(std::uint32_t (&wc)[8], const std::uint32_t (&u)[8]) {
  if constexpr (K < 8) {
    wc[K] = pick_h2<widx<CB>(K, 0), widx<CB>(K, 1)>(u);
    prot_words<CB, K + 1>(wc, u);
  }
}

// One CTA (8 warps; two CTAs per SM) = one sequence x 16 heads x a contiguous range of tiles (a
// split). Warp w owns content group gq = w (dims 64 gq .. 64 gq + 63) and RoPE dims 8 gq .. + 7 of
// every token of the tile. Lane (g, t) = (lane / 4, lane % 4) loads, for tokens 8 j + g, sixteen
// content dims and RoPE dims 8 gq + 2 t, + 1 straight into mma B fragments (QK: B[k = dim][n =
// token]; the dims may come in any order as long as the query uses the same, see widx),
// dequantized in registers. PV needs B[k = token][n = dim]: movmatrix transposes each 8x8 block
// of the same registers, so a packed tile is read from shared memory and dequantized once for
// both products, and lane (g, t) accumulates the output of heads g, g + 8 at exactly its own dims.
// The per-group partial scores meet in shared memory; each warp runs the online softmax of two
// heads; affine scales multiply the QK result per token and P (A of PV) per token.
// Virtual tiles: [0, nprt) are the protected bf16 rows (affine caches with protection; loaded
// straight from global memory), then the packed tiles of positions [pb, pe), which go through a
// ring of NS cp.async stages. Operands: affine in fp16 (codes q - z exact, query and P rounded
// once; P scaled by a running per-warp maximum of the group scales so it stays <= 1); bf16 cache
// in bf16 with the query as hi + lo pairs and P rounded once to bf16.
template <int CB, int RB>
__global__ void __launch_bounds__(kNT, 2) mla_decode_kernel(MlaDecodeParams p, Work wk) {
  using C = Cfg<CB, RB>;
  constexpr bool kAff = C::kAff, kB = !kAff;
  constexpr int TI = C::TI, NJ = C::NJ, NS = C::NS, SST = C::SST;
  extern __shared__ __align__(16) std::uint8_t smem_raw[];
  std::uint8_t* stages = smem_raw;
  float* spart = reinterpret_cast<float*>(smem_raw + NS * C::kStage);  // [8][16][SST]
  float* sP = spart + 8 * kHG * SST;                                   // [16][SST]
  float* mrow = sP + kHG * SST;                                        // log2 units
  float* lrow = mrow + kHG;
  float* alpha = lrow + kHG;
  float* scl = alpha + kHG;  // affine: [2][9][TI] then smax [2][8]
  float* smx = scl + 2 * 9 * TI;
  const PageLayout L = p.fmt.page;

  const int split = blockIdx.x, hg = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int gq = w;
  const int Lq = p.seq_lens[b];
  const bool prot = kAff && p.protect.enabled();
  const int pb = prot ? static_cast<int>(p.protect.packed_begin(Lq)) : 0;
  const int pe = prot ? static_cast<int>(p.protect.packed_end(Lq)) : Lq;
  const int first = pb / TI, end = pe > pb ? (pe + TI - 1) / TI : first;
  const int npk = end - first;
  const int nprot = prot ? pb + (Lq - pe) : 0;
  const int nprt = (nprot + TI - 1) / TI;
  const int nv = nprt + npk;
  const int per = (nv + wk.nsplit - 1) / wk.nsplit;
  const int v0 = min(split * per, nv), v1 = min(v0 + per, nv);
  const int kb = max(v0, nprt);     // first packed virtual tile of this split
  const int nks = max(0, v1 - kb);  // packed tiles of this split
  const std::int32_t* bt = p.block_tables + static_cast<std::size_t>(b) * p.max_pages;
  // Valid rows [lo, hi) of virtual tile vt.
  auto range = [&](int vt, int& lo, int& hi) {
    if (vt < nprt) {
      lo = 0;
      hi = min(TI, nprot - vt * TI);
    } else {
      const int pi = first + vt - nprt;
      lo = max(0, pb - pi * TI);
      hi = min(TI, pe - pi * TI);
    }
  };

  // ---- stage copies
  auto page_id = [&](int k) -> int { return k < nks ? bt[(first + kb - nprt + k) * TI / kPT] : -1; };
  auto issue = [&](int k, int id) {
    if (id < 0) return;
    const int pi = first + kb - nprt + k;
    const int toff = (pi * TI) % kPT;
    const int lo = max(0, pb - pi * TI), hi = min(TI, pe - pi * TI);
    const std::uint8_t* pg = p.pool + static_cast<std::size_t>(id) * L.page_bytes;
    std::uint8_t* st = stages + (k % NS) * C::kStage;
    constexpr int nc = C::CBY / 16, nr = C::RBY / 16, nm = C::MBY / 16;
    constexpr int total = TI * (nc + nr + nm);
    for (int c = tid; c < total; c += kNT) {
      int r, off;
      const std::uint8_t* src;
      std::uint8_t* dst;
      if (c < TI * nc) {
        r = c / nc;
        off = 16 * (c % nc);
        src = pg + L.key_code_off + static_cast<std::size_t>(toff + r) * C::CBY + off;
        dst = st + r * C::CS + off;
      } else if (c < TI * (nc + nr)) {
        const int c2 = c - TI * nc;
        r = c2 / nr;
        off = 16 * (c2 % nr);
        src = pg + L.value_code_off + static_cast<std::size_t>(toff + r) * C::RBY + off;
        dst = st + TI * C::CS + r * C::RS + off;
      } else {
        const int c2 = c - TI * (nc + nr);
        r = c2 >> 1;
        off = 16 * (c2 & 1);
        src = pg + L.meta_off + static_cast<std::size_t>(toff + r) * 32 + off;
        dst = st + TI * (C::CS + C::RS) + r * C::MS + off;
      }
      if constexpr (kAff) {
        cp_async16(dst, src);
      } else {
        const bool ok = r >= lo && r < hi;  // rows outside the sequence: zeros (pages may hold NaN)
        cp_async16_zfill(dst, ok ? src : pg, ok);
      }
    }
  };
  // Affine: scales of virtual tile vt into buffer buf (warp w: group w; lane: token; warp 0 also
  // the RoPE scales), 0 outside [lo, hi), 1 for protected rows; and each group's maximum.
  auto prep_scales = [&](int vt, int buf) {
    if constexpr (kAff) {
      int lo, hi;
      range(vt, lo, hi);
      const bool ok = lane >= lo && lane < hi;
      float c = ok ? 1.0f : 0.0f, r = c;
      if (vt >= nprt && ok) {
        const std::uint8_t* me = stages + ((vt - kb) % NS) * C::kStage + TI * (C::CS + C::RS) + lane * C::MS;
        c = detail::bf16_bits_to_float(reinterpret_cast<const std::uint16_t*>(me)[gq]);
        r = *reinterpret_cast<const float*>(me + 24);
      }
      float* sb = scl + buf * 9 * TI;
      sb[gq * TI + lane] = c;
      if (gq == 0) sb[8 * TI + lane] = r;
#pragma unroll
      for (int off = 16; off >= 1; off >>= 1) c = fmaxf(c, __shfl_xor_sync(0xffffffffu, c, off));
      if (lane == 0) smx[buf * 8 + gq] = c;
    }
  };
  // Prologue: the first NS - 1 packed tiles in flight while the query fragments load.
  int id_next;
  {
#pragma unroll 1
    for (int s = 0; s < NS - 1; ++s) {
      issue(s, page_id(s));
      cp_async_commit();
    }
    id_next = page_id(NS - 1);
  }
  if (tid < kHG) {
    mrow[tid] = -INFINITY;
    lrow[tid] = 0.0f;
  }
  // ---- query fragments: A[row = head][k]; k-step s = words 2 s, 2 s + 1 of the lane's dims.
  std::uint32_t qa[4][4], qb[4][4], qra[2], qrb[2];
  {
    const float* q0 = p.q + (static_cast<std::size_t>(b) * p.heads + hg * kHG + g) * kD;
    const float* q1 = q0 + 8 * kD;
    float x0[16], x1[16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int d = 64 * gq + (kAff ? 16 * t + 4 * i : (i < 2 ? 8 * t + 4 * i : 24 + 8 * t + 4 * i));
      const float4 a = *reinterpret_cast<const float4*>(q0 + d);
      const float4 c = *reinterpret_cast<const float4*>(q1 + d);
      x0[4 * i] = a.x;
      x0[4 * i + 1] = a.y;
      x0[4 * i + 2] = a.z;
      x0[4 * i + 3] = a.w;
      x1[4 * i] = c.x;
      x1[4 * i + 1] = c.y;
      x1[4 * i + 2] = c.z;
      x1[4 * i + 3] = c.w;
    }
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = 2 * s + h;
        const int i0 = widx<CB>(k, 0), i1 = widx<CB>(k, 1);
        if constexpr (kAff) {
          qa[s][2 * h] = detail::pack2<false>(x0[i0], x0[i1]);
          qa[s][2 * h + 1] = detail::pack2<false>(x1[i0], x1[i1]);
        } else {
          split2<true>(x0[i0], x0[i1], qa[s][2 * h], qb[s][2 * h]);
          split2<true>(x1[i0], x1[i1], qa[s][2 * h + 1], qb[s][2 * h + 1]);
        }
      }
    const int dr = kDc + 8 * gq + 2 * t;
    if constexpr (kAff) {
      qra[0] = detail::pack2<false>(q0[dr], q0[dr + 1]);
      qra[1] = detail::pack2<false>(q1[dr], q1[dr + 1]);
    } else {
      split2<true>(q0[dr], q0[dr + 1], qra[0], qrb[0]);
      split2<true>(q1[dr], q1[dr + 1], qra[1], qrb[1]);
    }
  }
  float o[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float sref = 0.0f;  // affine: running maximum of this warp's group scales (P is scaled by 1 / sref)
  const float sl2 = p.scale * kLog2e;

  cp_async_wait<NS - 2>();
  __syncthreads();
  if (v0 < v1) prep_scales(v0, 0);
  __syncthreads();

#pragma unroll 1
  for (int vt = v0; vt < v1; ++vt) {
    const bool is_prot = kAff && vt < nprt;
    const int k = vt - kb, buf = (vt - v0) & 1;
    int lo, hi;
    range(vt, lo, hi);
    std::uint32_t wc[NJ][8], wr[NJ];
    if (is_prot) {  // never for bf16 caches (kAff false)
      // Protected rows: bf16 rows from global memory, converted to fp16 (finite bf16 latents are
      // far inside fp16's range; values below 2^-14 become fp16 subnormals).
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int r = 8 * j + g;
        if (r < hi) {
          const int idx = vt * TI + r;
          const int pos = idx < pb ? idx : pe + (idx - pb);
          const std::uint16_t* row = p.protect_rows + p.protect.row(b, p.protect.slot(pos));
          const uint4 a = *reinterpret_cast<const uint4*>(row + 64 * gq + 16 * t);
          const uint4 c = *reinterpret_cast<const uint4*>(row + 64 * gq + 16 * t + 8);
          const std::uint32_t u[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
          prot_words<CB, 0>(wc[j], u);
          wr[j] = bf2_to_h2(*reinterpret_cast<const std::uint32_t*>(row + kDc + 8 * gq + 2 * t));
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) wc[j][i] = 0u;
          wr[j] = 0u;
        }
      }
    } else {
      const std::uint8_t* st = stages + (k % NS) * C::kStage;
      const std::uint8_t* rope = st + TI * C::CS;
      const std::uint8_t* meta = rope + TI * C::RS;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int r = 8 * j + g;
        const std::uint8_t* crow = st + r * C::CS;
        if constexpr (kAff) {
          const std::uint8_t* m = meta + r * C::MS;
          dequant16<CB>(wc[j], crow + 8 * CB * gq + 2 * CB * t, m[16 + gq]);
          const std::uint8_t* rr = rope + r * C::RS;
          std::uint32_t v;
          if constexpr (RB == 8) v = *reinterpret_cast<const std::uint16_t*>(rr + 8 * gq + 2 * t);
          else v = rr[4 * gq + t];
          wr[j] = sub_zero(code_pair<RB>(v, 0), 0x64006400u + static_cast<std::uint32_t>(m[28]) * 0x10001u);
        } else {
          const uint4 a = *reinterpret_cast<const uint4*>(crow + 128 * gq + 16 * t);
          const uint4 c = *reinterpret_cast<const uint4*>(crow + 128 * gq + 64 + 16 * t);
          wc[j][0] = a.x;
          wc[j][1] = a.y;
          wc[j][2] = a.z;
          wc[j][3] = a.w;
          wc[j][4] = c.x;
          wc[j][5] = c.y;
          wc[j][6] = c.z;
          wc[j][7] = c.w;
          wr[j] = *reinterpret_cast<const std::uint32_t*>(rope + r * C::RS + 16 * gq + 4 * t);
        }
      }
    }
    const float* sb = scl + buf * 9 * TI;
    // ---- QK: partial scores of the 16 heads x TI tokens over this warp's dims
    {
      float sp[NJ][4];
#pragma unroll
      for (int j = 0; j < NJ; ++j) sp[j][0] = sp[j][1] = sp[j][2] = sp[j][3] = 0.0f;
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          mma16816<kB>(sp[j], qa[s], wc[j][2 * s], wc[j][2 * s + 1]);
          if constexpr (kB) mma16816<kB>(sp[j], qb[s], wc[j][2 * s], wc[j][2 * s + 1]);
        }
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        float ar[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma1688<kB>(ar, qra[0], qra[1], wr[j]);
        if constexpr (kB) mma1688<kB>(ar, qrb[0], qrb[1], wr[j]);
        const int tok = 8 * j + 2 * t;
        float2 c = make_float2(1.0f, 1.0f), r = c;
        if constexpr (kAff) {
          c = *reinterpret_cast<const float2*>(sb + gq * TI + tok);
          r = *reinterpret_cast<const float2*>(sb + 8 * TI + tok);
        }
        float* dst = spart + gq * kHG * SST + tok;
        *reinterpret_cast<float2*>(dst + g * SST) = make_float2(sp[j][0] * c.x + ar[0] * r.x, sp[j][1] * c.y + ar[1] * r.y);
        *reinterpret_cast<float2*>(dst + (g + 8) * SST) =
            make_float2(sp[j][2] * c.x + ar[2] * r.x, sp[j][3] * c.y + ar[3] * r.y);
      }
    }
    cp_async_wait<NS - 3>();  // the next packed tile has landed (this thread's copies)
    __syncthreads();
    if (!is_prot) {
      // Refill the ring with tile k + NS - 1: its slot (k - 1) % NS was last read before the
      // barrier above.
      issue(k + NS - 1, id_next);
      cp_async_commit();
      id_next = page_id(k + NS);
    }
    // ---- online softmax (log2 units): warp w runs heads 2 w, 2 w + 1 (16 lanes each)
    {
      constexpr int TPT = TI / 16;
      const int h = 2 * w + (lane >> 4), sub = lane & 15;
      float s[TPT], mx = -INFINITY;
#pragma unroll
      for (int e = 0; e < TPT; ++e) s[e] = 0.0f;
#pragma unroll
      for (int ww = 0; ww < 8; ++ww) {
        const float* row = spart + (ww * kHG + h) * SST + TPT * sub;
        if constexpr (TPT == 2) {
          const float2 v = *reinterpret_cast<const float2*>(row);
          s[0] += v.x;
          s[1] += v.y;
        } else {
          s[0] += row[0];
        }
      }
#pragma unroll
      for (int e = 0; e < TPT; ++e) {
        const int tok = TPT * sub + e;
        s[e] = (tok >= lo && tok < hi) ? s[e] * sl2 : -INFINITY;
        mx = fmaxf(mx, s[e]);
      }
#pragma unroll
      for (int off = 8; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_old = mrow[h];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
#pragma unroll
      for (int e = 0; e < TPT; ++e) {
        const float pv = s[e] == -INFINITY ? 0.0f : exp2f(s[e] - m_new);
        sum += pv;
        sP[h * SST + TPT * sub + e] = pv;
      }
#pragma unroll
      for (int off = 8; off >= 1; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      __syncwarp();
      if (sub == 0) {
        const float a = m_new == -INFINITY ? 1.0f : (m_old == -INFINITY ? 0.0f : exp2f(m_old - m_new));
        lrow[h] = lrow[h] * a + sum;
        mrow[h] = m_new;
        alpha[h] = a;
      }
    }
    if (vt + 1 < v1) prep_scales(vt + 1, buf ^ 1);
    __syncthreads();
    // ---- PV: o[heads g, g + 8][this lane's dims] += P' x V
    {
      float a0 = alpha[g], a1 = alpha[g + 8];
      float inv = 1.0f;
      if constexpr (kAff) {
        const float snew = fmaxf(sref, smx[buf * 8 + gq]);
        const float r = snew > 0.0f ? sref / snew : 1.0f;
        inv = snew > 0.0f ? 1.0f / snew : 0.0f;
        sref = snew;
        a0 *= r;
        a1 *= r;
      }
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        o[n][0] *= a0;
        o[n][1] *= a0;
        o[n][2] *= a1;
        o[n][3] *= a1;
      }
#pragma unroll
      for (int kk = 0; kk < NJ / 2; ++kk) {
        const int tk = 16 * kk + 2 * t;
        const float2 p00 = *reinterpret_cast<const float2*>(sP + g * SST + tk);
        const float2 p10 = *reinterpret_cast<const float2*>(sP + (g + 8) * SST + tk);
        const float2 p01 = *reinterpret_cast<const float2*>(sP + g * SST + tk + 8);
        const float2 p11 = *reinterpret_cast<const float2*>(sP + (g + 8) * SST + tk + 8);
        std::uint32_t pa[4];
        if constexpr (kAff) {
          const float2 c0 = *reinterpret_cast<const float2*>(sb + gq * TI + tk);
          const float2 c8 = *reinterpret_cast<const float2*>(sb + gq * TI + tk + 8);
          const float s0 = c0.x * inv, s1 = c0.y * inv, s8 = c8.x * inv, s9 = c8.y * inv;
          pa[0] = detail::pack2<false>(p00.x * s0, p00.y * s1);
          pa[1] = detail::pack2<false>(p10.x * s0, p10.y * s1);
          pa[2] = detail::pack2<false>(p01.x * s8, p01.y * s9);
          pa[3] = detail::pack2<false>(p11.x * s8, p11.y * s9);
        } else {
          pa[0] = detail::pack2<true>(p00.x, p00.y);
          pa[1] = detail::pack2<true>(p10.x, p10.y);
          pa[2] = detail::pack2<true>(p01.x, p01.y);
          pa[3] = detail::pack2<true>(p11.x, p11.y);
        }
#pragma unroll
        for (int n = 0; n < 8; ++n) mma16816<kB>(o[n], pa, movt(wc[2 * kk][n]), movt(wc[2 * kk + 1][n]));
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  // Partial state of this split: unnormalized output (times the scale reference), max, sum.
  const float fin = kAff ? sref : 1.0f;
  const std::size_t r0 = (static_cast<std::size_t>(b) * p.heads + hg * kHG + g) * wk.nsplit + split;
  const std::size_t r1 = r0 + 8 * static_cast<std::size_t>(wk.nsplit);
  float* out0 = wk.opart + r0 * kDc + 64 * gq;
  float* out1 = wk.opart + r1 * kDc + 64 * gq;
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const int d0 = wdim<CB>(t, n, 0), d1 = wdim<CB>(t, n, 1);
    out0[d0] = o[n][0] * fin;
    out0[d1] = o[n][1] * fin;
    out1[d0] = o[n][2] * fin;
    out1[d1] = o[n][3] * fin;
  }
  if (tid < kHG) {
    const std::size_t r = (static_cast<std::size_t>(b) * p.heads + hg * kHG + tid) * wk.nsplit + split;
    wk.ml[2 * r] = mrow[tid] * kLn2;
    wk.ml[2 * r + 1] = lrow[tid];
  }
}

// out[b][h] = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s over the splits s.
__global__ void __launch_bounds__(128) mla_combine_kernel(const float* __restrict__ opart, const float* __restrict__ ml,
                                                          int nsl, float* __restrict__ out) {
  const std::size_t bh = static_cast<std::size_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const float* m = ml + bh * nsl * 2;
  float M = -INFINITY;
  for (int s = 0; s < nsl; ++s) M = fmaxf(M, m[2 * s]);
  float4 acc = make_float4(0, 0, 0, 0);
  float den = 0.0f;
  for (int s = 0; s < nsl; ++s) {
    const float ms = m[2 * s];
    if (ms == -INFINITY) continue;
    const float e = expf(ms - M);
    den += e * m[2 * s + 1];
    const float4 v = reinterpret_cast<const float4*>(opart + (bh * nsl + s) * kDc)[threadIdx.x];
    acc.x += e * v.x;
    acc.y += e * v.y;
    acc.z += e * v.z;
    acc.w += e * v.w;
  }
  const float inv = den > 0.0f ? 1.0f / den : 0.0f;
  reinterpret_cast<float4*>(out + bh * kDc)[threadIdx.x] = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
}

int sm_count_of(const MlaDecodeParams& p) {
  if (p.sm_count > 0) return p.sm_count;
  int dev = 0, n = 132;
  if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n;
}

bool uses_protect(const MlaDecodeParams& p) { return p.fmt.content_bits != 16 && p.protect.enabled(); }

template <int CB, int RB>
cudaError_t launch_decode(const MlaDecodeParams& p, cudaStream_t st) {
  using C = Cfg<CB, RB>;
  cudaError_t e = cudaFuncSetAttribute(mla_decode_kernel<CB, RB>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (e != cudaSuccess) return e;
  Work wk;
  wk.nsplit = mla_decode_splits(p);
  const std::size_t rows = static_cast<std::size_t>(p.batch) * p.heads * wk.nsplit;
  wk.opart = static_cast<float*>(p.workspace);
  wk.ml = wk.opart + rows * kDc;
  const dim3 grid(wk.nsplit, p.heads / kHG, p.batch);
  mla_decode_kernel<CB, RB><<<grid, kNT, C::kSmem, st>>>(p, wk);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  mla_combine_kernel<<<dim3(p.heads, p.batch), 128, 0, st>>>(wk.opart, wk.ml, wk.nsplit, p.out);
  return cudaGetLastError();
}

}  // namespace

int mla_decode_splits(const MlaDecodeParams& p) {
  const int pages = std::max(1, (p.max_seq_len + kPT - 1) / kPT);
  if (p.num_splits > 0) return std::min(p.num_splits, pages);
  const int ctas = std::max(1, p.batch * (p.heads / kHG));
  return std::clamp(2 * sm_count_of(p) / ctas, 1, pages);  // two CTAs per SM
}

std::size_t mla_decode_workspace_bytes(const MlaDecodeParams& p) {
  const std::size_t nsl = static_cast<std::size_t>(mla_decode_splits(p));
  return static_cast<std::size_t>(p.batch) * p.heads * nsl * (kDc + 2) * sizeof(float);
}

cudaError_t mla_decode(const MlaDecodeParams& p, cudaStream_t stream) {
  const MlaFormat& f = p.fmt;
  if (!mla_supported(f) || (p.warps != 0 && p.warps != 8 && p.warps != 16) || p.heads <= 0 || p.heads % kHG || p.heads > 128 || p.batch <= 0 || !p.pool ||
      !p.block_tables || !p.seq_lens || !p.q || !p.out || !p.workspace)
    return cudaErrorInvalidValue;
  if (uses_protect(p) && !p.protect_rows) return cudaErrorInvalidValue;
  if (p.workspace_bytes < mla_decode_workspace_bytes(p)) return cudaErrorInvalidValue;
  const int c = f.content_bits, r = f.rope_bits;
  if (c == 16) return launch_decode<16, 16>(p, stream);
  if (c == 8 && r == 8) return launch_decode<8, 8>(p, stream);
  if (c == 4 && r == 8) return launch_decode<4, 8>(p, stream);
  if (c == 4 && r == 4) return launch_decode<4, 4>(p, stream);
  if (c == 3 && r == 4) return launch_decode<3, 4>(p, stream);
  if (c == 2 && r == 4) return launch_decode<2, 4>(p, stream);
  return cudaErrorInvalidValue;
}

std::size_t mla_decode_bytes_read(const MlaFormat& f, const int* seq_lens_host, int batch, const MlaProtectLayout& prot) {
  const bool pr = f.content_bits != 16 && prot.enabled();
  std::size_t bytes = 0;
  for (int b = 0; b < batch; ++b) {
    const std::int64_t L = seq_lens_host[b];
    const std::int64_t pb = pr ? prot.packed_begin(L) : 0, pe = pr ? prot.packed_end(L) : L;
    const std::int64_t pages = pe > pb ? (pe + kPT - 1) / kPT - pb / kPT : 0;
    bytes += static_cast<std::size_t>(pages) * (f.page.page_bytes + 4);
    bytes += static_cast<std::size_t>(pb + (L - pe)) * 2 * (f.d_latent + f.d_rope);
  }
  return bytes;
}

}  // namespace kvq::cuda
