// mla_decode.cu: paged split-KV decode for absorbed MLA (d_c = 512, d_r = 64) over bf16 and
// QuantMLA affine caches, and the combine kernel that merges the splits' partial softmax states.
//
// One CTA (16 warps, or 8 with MlaDecodeParams::warps = 8) = one sequence x 16 query heads x a
// range of tiles (a split); a request with H heads runs H / 16 such CTAs per split, reading the
// same pages (L2). Per 64-token tile:
//  1. cp.async brings the pages ahead (packed bytes, or the bf16 rows into the other tile buffer)
//     while the current one computes;
//  2. affine formats: the packed page is dequantized once into an fp16 tile of integer codes
//     (q - z), exact in fp16, with the per-token group scales kept apart in fp32;
//  3. QK on tensor cores (mma.sync m16n8k16): warp w multiplies the 16 query rows of content
//     group w % 8 (dims 64 (w % 8) ..) with the tile (16 warps: token half w / 8) and scales the
//     per-token result by that group's scale; warps with w % 8 < 4 add one 16-dim slice of the
//     RoPE part; the 8 partial scores are summed in shared memory;
//  4. online softmax per head (running max, sum, rescale factor);
//  5. PV on tensor cores: warp w accumulates 512 / warps output columns from the same tile, with
//     A = P scaled per token by the group's scale.
// Operands: affine tiles in fp16 (query, P single fp16: ~11 bits); bf16 tiles in bf16 with the
// query and P as hi + lo pairs (~16 bits). Protected positions (sinks, recent window) of an
// affine cache are read from their bf16 rows as extra tiles after the packed pages, in the same
// online softmax; the combine kernel merges the splits' (max, sum, output). A bf16 cache needs
// no protection: its rows are bf16 already.
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

constexpr int kDc = 512, kDr = 64, kD = 576, kT = 64, kHG = 16;
constexpr int kKStride = kD + 8;  // bf16 per tile row: 1168 bytes, conflict-free ldmatrix rows
constexpr int kSStride = kT + 4;  // floats per score row
constexpr std::size_t kTileBytes = static_cast<std::size_t>(kT) * kKStride * 2;
// Partial scores [8 warps][16][kSStride] (P overwrites warp 0's rows), scales, softmax state.
constexpr std::size_t kSmemTail = static_cast<std::size_t>(8 * kHG * kSStride + kT * 8 + kT + 3 * kHG) * 4;
// Pages in flight: the prefetch runs kStages - 1 pages ahead (the bf16 tile buffers are the stages).
template <int CB>
constexpr int kStages = CB == 16 ? 2 : (CB == 8 ? 3 : 4);

__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void ldsm_x4_t(std::uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
struct Smem {
  std::uint8_t* stage[4];  // affine: packed pages
  std::uint16_t* tile[2];  // bf16 cache: two tile buffers (bf16); affine: tile[0] only (fp16)
  float* spart;            // [8][16][kSStride]
  float* P;                // [16][kSStride]
  float* sc;               // [64][8]
  float* sr;               // [64]
  float* mrow;             // [16]
  float* lrow;
  float* alpha;
};

template <int CB>
__host__ __device__ constexpr std::size_t head_bytes(std::size_t page_bytes) {
  return CB == 16 ? 2 * kTileBytes : kStages<CB> * page_bytes + kTileBytes;
}
template <int CB>
std::size_t smem_bytes(std::size_t page_bytes) {
  return head_bytes<CB>(page_bytes) + kSmemTail;
}

// Eight consecutive codes (dims 8 ch .. 8 ch + 7, code i at bits B i) minus z as four fp16x2 words,
// by the exponent trick: (0x6400 | n) is the fp16 1024 + n, and (1024 + n) - (1024 + z) = n - z
// exactly (n, z <= 255).
template <int B>
__device__ __forceinline__ uint4 dequant8(const std::uint8_t* row, int ch, int z) {
  constexpr std::uint32_t e = 0x64006400u;
  std::uint32_t w[4];
  if constexpr (B == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(row + 8 * ch);
    w[0] = __byte_perm(v.x, e, 0x5150);
    w[1] = __byte_perm(v.x, e, 0x5352);
    w[2] = __byte_perm(v.y, e, 0x5150);
    w[3] = __byte_perm(v.y, e, 0x5352);
  } else {
    std::uint32_t v;
    if constexpr (B == 4) v = *reinterpret_cast<const std::uint32_t*>(row + 4 * ch);
    else if constexpr (B == 2) v = *reinterpret_cast<const std::uint16_t*>(row + 2 * ch);
    else v = row[3 * ch] | (static_cast<std::uint32_t>(row[3 * ch + 1]) << 8) | (static_cast<std::uint32_t>(row[3 * ch + 2]) << 16);
    constexpr std::uint32_t lo = (1u << B) - 1u, hi = lo << 16;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t x = v >> (2 * B * k);
      w[k] = (x & lo) | ((x << (16 - B)) & hi) | e;
    }
  }
  const __half zz = __ushort_as_half(static_cast<unsigned short>(0x6400 + z));
  const __half2 z2 = __halves2half2(zz, zz);
  uint4 o;
  std::uint32_t* op = &o.x;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&w[k]), z2);
    op[k] = *reinterpret_cast<const std::uint32_t*>(&r);
  }
  return o;
}

// Dequantizes one staged affine page into the fp16 tile (integers q - z, exact) and the scales
// (0 for tokens outside [tlo, thi), whose rows then contribute nothing).
template <int CB, int RB, int NT>
__device__ __forceinline__ void dequant_page(const Smem& sm, const std::uint8_t* pg, const PageLayout& L, int tlo, int thi) {
  const int tid = threadIdx.x;
  std::uint16_t* K = sm.tile[0];
#pragma unroll 4
  for (int c = tid; c < kT * (kDc / 8); c += NT) {
    const int tok = c >> 6, ch = c & 63;
    const int z = pg[L.meta_off + tok * 32 + 16 + (ch >> 3)];
    *reinterpret_cast<uint4*>(K + tok * kKStride + 8 * ch) =
        dequant8<CB>(pg + L.key_code_off + static_cast<std::size_t>(tok) * L.key_code_bytes, ch, z);
  }
  for (int c = tid; c < kT * (kDr / 8); c += NT) {
    const int tok = c >> 3, ch = c & 7;
    const int z = pg[L.meta_off + tok * 32 + 28];
    *reinterpret_cast<uint4*>(K + tok * kKStride + kDc + 8 * ch) =
        dequant8<RB>(pg + L.value_code_off + static_cast<std::size_t>(tok) * L.value_code_bytes, ch, z);
  }
  if (tid < kT) {
    const std::uint8_t* m = pg + L.meta_off + tid * 32;
    const bool ok = tid >= tlo && tid < thi;
#pragma unroll
    for (int g = 0; g < 8; ++g)
      sm.sc[tid * 8 + g] = ok ? detail::bf16_bits_to_float(reinterpret_cast<const std::uint16_t*>(m)[g]) : 0.0f;
    sm.sr[tid] = ok ? *reinterpret_cast<const float*>(m + 24) : 0.0f;
  }
}

// Protected bf16 rows [0, n) of one tile, converted to fp16 (finite bf16 latents are far inside
// fp16's range; values below 2^-14 become fp16 subnormals) into the affine kernel's tile.
template <int NT>
__device__ __forceinline__ void load_protected(const Smem& sm, const MlaDecodeParams& p, int b, int first, int n,
                                               int pb, int pe) {
  std::uint16_t* K = sm.tile[0];
  for (int c = threadIdx.x; c < kT * 72; c += NT) {
    const int r = c / 72, k = c % 72;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < n) {
      const int idx = first + r;
      const int pos = idx < pb ? idx : pe + (idx - pb);
      const uint4 u = *reinterpret_cast<const uint4*>(p.protect_rows + p.protect.row(b, p.protect.slot(pos)) + 8 * k);
      const std::uint32_t* in = &u.x;
      std::uint32_t* out = &v.x;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&in[i]));
        const __half2 h = __floats2half2_rn(f.x, f.y);
        out[i] = *reinterpret_cast<const std::uint32_t*>(&h);
      }
    }
    *reinterpret_cast<uint4*>(K + r * kKStride + 8 * k) = v;
  }
  if (threadIdx.x < kT) {
    const float one = threadIdx.x < n ? 1.0f : 0.0f;
#pragma unroll
    for (int g = 0; g < 8; ++g) sm.sc[threadIdx.x * 8 + g] = one;
    sm.sr[threadIdx.x] = one;
  }
}

// QK, online softmax and PV of one tile held in `K`, by NW warps (8 or 16).
//  kAff = false (bf16 cache): bf16 operands, query and P as hi + lo pairs (~16 bits), unit scales.
//  kAff = true (affine cache): fp16 operands (codes exact), query qa in fp16, per-token group
//  scales from sm.sc / sm.sr; P is scaled per token by the group scale over its largest value in
//  the tile (so it stays in [0, 1], clear of fp16 underflow) and the tile's sum is rescaled.
// QK: warp w takes content group w % 8 over token half w / 8 (all 64 tokens when NW = 8), and the
// warps with w % 8 < 4 add RoPE slice w & 3 over the same tokens. PV: warp w owns 512 / NW
// output columns.
template <bool kAff, int NW>
__device__ __forceinline__ void compute_tile(const Smem& sm, const std::uint16_t* K, const std::uint32_t (&qa)[5][4],
                                             const std::uint32_t (&qb)[5][4], float (&o)[512 / NW / 8][4], float scale,
                                             int tlo, int thi) {
  constexpr bool kB = !kAff;
  constexpr int NJ = 8 * 8 / NW;        // QK n-tiles (8 tokens) per warp
  constexpr int NN = 512 / NW / 8;      // PV n-tiles (8 columns) per warp
  constexpr int TPH = 32 * NW / kHG;    // softmax threads per head
  constexpr int TPT = kT / TPH;         // tokens per softmax thread
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int gq = w & 7, tb = (w >> 3) * 8 * NJ;
  // ---- QK
  {
    float acc[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < 4; ks += 2) {
#pragma unroll
      for (int jn = 0; jn < NJ; ++jn) {
        std::uint32_t b[4];
        ldsm_x4(b, K + (tb + 8 * jn + (lane & 7)) * kKStride + 64 * gq + 16 * ks + 8 * (lane >> 3));
        mma16816<kB>(acc[jn], qa[ks], b[0], b[1]);
        mma16816<kB>(acc[jn], qa[ks + 1], b[2], b[3]);
        if constexpr (!kAff) {
          mma16816<kB>(acc[jn], qb[ks], b[0], b[1]);
          mma16816<kB>(acc[jn], qb[ks + 1], b[2], b[3]);
        }
      }
    }
    if constexpr (kAff) {
#pragma unroll
      for (int jn = 0; jn < NJ; ++jn) {
        const int c0 = tb + 8 * jn + 2 * t;
        const float s0 = sm.sc[c0 * 8 + gq], s1 = sm.sc[(c0 + 1) * 8 + gq];
        acc[jn][0] *= s0;
        acc[jn][1] *= s1;
        acc[jn][2] *= s0;
        acc[jn][3] *= s1;
      }
    }
    if (gq < 4) {
      float ar[NJ][4];
#pragma unroll
      for (int j = 0; j < NJ; ++j) ar[j][0] = ar[j][1] = ar[j][2] = ar[j][3] = 0.0f;
#pragma unroll
      for (int jn = 0; jn < NJ; jn += 2) {
        std::uint32_t b[4];
        ldsm_x4(b, K + (tb + 8 * jn + (lane & 7) + 8 * (lane >> 4)) * kKStride + kDc + 16 * gq + 8 * ((lane >> 3) & 1));
        mma16816<kB>(ar[jn], qa[4], b[0], b[1]);
        mma16816<kB>(ar[jn + 1], qa[4], b[2], b[3]);
        if constexpr (!kAff) {
          mma16816<kB>(ar[jn], qb[4], b[0], b[1]);
          mma16816<kB>(ar[jn + 1], qb[4], b[2], b[3]);
        }
      }
#pragma unroll
      for (int jn = 0; jn < NJ; ++jn) {
        const int c0 = tb + 8 * jn + 2 * t;
        const float s0 = kAff ? sm.sr[c0] : 1.0f, s1 = kAff ? sm.sr[c0 + 1] : 1.0f;
        acc[jn][0] += ar[jn][0] * s0;
        acc[jn][1] += ar[jn][1] * s1;
        acc[jn][2] += ar[jn][2] * s0;
        acc[jn][3] += ar[jn][3] * s1;
      }
    }
    float* sp = sm.spart + gq * kHG * kSStride;
#pragma unroll
    for (int jn = 0; jn < NJ; ++jn) {
      const int c0 = tb + 8 * jn + 2 * t;
      *reinterpret_cast<float2*>(sp + g * kSStride + c0) = make_float2(acc[jn][0], acc[jn][1]);
      *reinterpret_cast<float2*>(sp + (g + 8) * kSStride + c0) = make_float2(acc[jn][2], acc[jn][3]);
    }
  }
  __syncthreads();
  // ---- online softmax: TPH threads per head, TPT consecutive tokens each
  {
    const int h = tid / TPH, sub = tid % TPH;
    float s[TPT];
#pragma unroll
    for (int k = 0; k < TPT; ++k) s[k] = 0.0f;
#pragma unroll
    for (int ww = 0; ww < 8; ++ww) {
      const float* row = sm.spart + (ww * kHG + h) * kSStride + TPT * sub;
      if constexpr (TPT == 4) {
        const float4 v = *reinterpret_cast<const float4*>(row);
        s[0] += v.x;
        s[1] += v.y;
        s[2] += v.z;
        s[3] += v.w;
      } else {
        const float2 v = *reinterpret_cast<const float2*>(row);
        s[0] += v.x;
        s[1] += v.y;
      }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < TPT; ++k) {
      const int tok = TPT * sub + k;
      s[k] = (tok >= tlo && tok < thi) ? s[k] * scale : -INFINITY;
      mx = fmaxf(mx, s[k]);
    }
#pragma unroll
    for (int off = TPH / 2; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float m_old = sm.mrow[h];
    const float m_new = fmaxf(m_old, mx);
    float a = 1.0f, sum = 0.0f, pv[TPT];
#pragma unroll
    for (int k = 0; k < TPT; ++k) {
      pv[k] = (m_new == -INFINITY || s[k] == -INFINITY) ? 0.0f : expf(s[k] - m_new);
      sum += pv[k];
    }
    if (m_new != -INFINITY) a = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
#pragma unroll
    for (int off = TPH / 2; off >= 1; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    float* prow = sm.P + h * kSStride + TPT * sub;
#pragma unroll
    for (int k = 0; k < TPT; ++k) prow[k] = pv[k];
    __syncwarp();
    if (sub == 0) {
      sm.lrow[h] = sm.lrow[h] * a + sum;
      sm.mrow[h] = m_new;
      sm.alpha[h] = a;
    }
  }
  __syncthreads();
  // ---- PV: warp w owns output columns cb .. cb + 8 NN - 1, inside content group gp
  {
    const int cb = w * 8 * NN, gp = cb / 64;
    const float a0 = sm.alpha[g], a1 = sm.alpha[g + 8];
    float smax = 1.0f, inv = 1.0f;
    if constexpr (kAff) {
      smax = fmaxf(sm.sc[lane * 8 + gp], sm.sc[(lane + 32) * 8 + gp]);
#pragma unroll
      for (int off = 16; off >= 1; off >>= 1) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, off));
      inv = smax > 0.0f ? 1.0f / smax : 0.0f;
    }
    float ot[NN][4];
#pragma unroll
    for (int n = 0; n < NN; ++n) {
      if constexpr (kAff) {
        ot[n][0] = ot[n][1] = ot[n][2] = ot[n][3] = 0.0f;
      } else {
        o[n][0] *= a0;
        o[n][1] *= a0;
        o[n][2] *= a1;
        o[n][3] *= a1;
      }
    }
    float(&acc)[NN][4] = kAff ? ot : o;
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      const int k0 = 16 * kt + 2 * t;
      const float* P0 = sm.P + g * kSStride;
      const float* P1 = sm.P + (g + 8) * kSStride;
      std::uint32_t ah[4], al[4];
      if constexpr (kAff) {
        const float s0 = sm.sc[k0 * 8 + gp] * inv, s1 = sm.sc[(k0 + 1) * 8 + gp] * inv;
        const float s8 = sm.sc[(k0 + 8) * 8 + gp] * inv, s9 = sm.sc[(k0 + 9) * 8 + gp] * inv;
        ah[0] = detail::pack2<false>(P0[k0] * s0, P0[k0 + 1] * s1);
        ah[1] = detail::pack2<false>(P1[k0] * s0, P1[k0 + 1] * s1);
        ah[2] = detail::pack2<false>(P0[k0 + 8] * s8, P0[k0 + 9] * s9);
        ah[3] = detail::pack2<false>(P1[k0 + 8] * s8, P1[k0 + 9] * s9);
      } else {
        split2<true>(P0[k0], P0[k0 + 1], ah[0], al[0]);
        split2<true>(P1[k0], P1[k0 + 1], ah[1], al[1]);
        split2<true>(P0[k0 + 8], P0[k0 + 9], ah[2], al[2]);
        split2<true>(P1[k0 + 8], P1[k0 + 9], ah[3], al[3]);
      }
#pragma unroll
      for (int np = 0; np < NN / 2; ++np) {
        std::uint32_t b[4];
        ldsm_x4_t(b, K + (16 * kt + (lane & 7) + 8 * ((lane >> 3) & 1)) * kKStride + cb + 16 * np + 8 * (lane >> 4));
        mma16816<kB>(acc[2 * np], ah, b[0], b[1]);
        mma16816<kB>(acc[2 * np + 1], ah, b[2], b[3]);
        if constexpr (!kAff) {
          mma16816<kB>(acc[2 * np], al, b[0], b[1]);
          mma16816<kB>(acc[2 * np + 1], al, b[2], b[3]);
        }
      }
    }
    if constexpr (kAff) {
#pragma unroll
      for (int n = 0; n < NN; ++n) {
        o[n][0] = o[n][0] * a0 + ot[n][0] * smax;
        o[n][1] = o[n][1] * a0 + ot[n][1] * smax;
        o[n][2] = o[n][2] * a1 + ot[n][2] * smax;
        o[n][3] = o[n][3] * a1 + ot[n][3] * smax;
      }
    }
  }
}

struct Work {
  float* opart;  // [batch][heads][nsplit][512]
  float* ml;     // [batch][heads][nsplit][2]
  int nsplit;
};

// Issues cp.async of the bf16 rows of one packed page into tile buffer `K` (rows outside
// [tlo, thi) zero-filled).
template <int NT>
__device__ __forceinline__ void load_bf16_page(std::uint16_t* K, const std::uint8_t* pg, const PageLayout& L, int tlo,
                                               int thi) {
  for (int c = threadIdx.x; c < kT * 72; c += NT) {
    const int tok = c / 72, k = c % 72;
    const bool ok = tok >= tlo && tok < thi;
    const std::uint8_t* src = k < 64 ? pg + L.key_code_off + tok * 1024 + 16 * k : pg + L.value_code_off + tok * 128 + 16 * (k - 64);
    cp_async16_zfill(K + tok * kKStride + 8 * k, ok ? src : pg, ok);
  }
}

// Work of one CTA: virtual tiles [v0, v1) of its sequence, where tiles [0, np) are the packed
// pages of positions [pb, pe) and tiles [np, np + ceil(nprot / 64)) hold the protected rows, so
// protected rows join the same online softmax as the packed pages of the last split.
template <int CB, int RB, int NW>
__global__ void __launch_bounds__(32 * NW, 1) mla_decode_kernel(MlaDecodeParams p, Work wk) {
  constexpr int NT = 32 * NW, NN = 512 / NW / 8;
  extern __shared__ __align__(16) std::uint8_t smem_raw[];
  const PageLayout L = p.fmt.page;
  constexpr bool kAff = CB != 16;
  constexpr int NS = kStages<CB>;
  Smem sm;
  std::uint8_t* base = smem_raw;
  if constexpr (!kAff) {
    sm.tile[0] = reinterpret_cast<std::uint16_t*>(base);
    sm.tile[1] = reinterpret_cast<std::uint16_t*>(base + kTileBytes);
    base += 2 * kTileBytes;
  } else {
#pragma unroll
    for (int s = 0; s < NS; ++s) sm.stage[s] = base + s * L.page_bytes;
    sm.tile[0] = sm.tile[1] = reinterpret_cast<std::uint16_t*>(base + NS * L.page_bytes);
    base += NS * L.page_bytes + kTileBytes;
  }
  float* f = reinterpret_cast<float*>(base);
  sm.spart = f;
  sm.P = f;  // each P element overwrites the warp-0 partial score that only its own thread reads
  f += 8 * kHG * kSStride;
  sm.sc = f;
  f += kT * 8;
  sm.sr = f;
  f += kT;
  sm.mrow = f;
  sm.lrow = f + kHG;
  sm.alpha = f + 2 * kHG;

  const int split = blockIdx.x, hg = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int Lq = p.seq_lens[b];
  const bool prot = kAff && p.protect.enabled();
  const int pb = prot ? static_cast<int>(p.protect.packed_begin(Lq)) : 0;
  const int pe = prot ? static_cast<int>(p.protect.packed_end(Lq)) : Lq;

  if (tid < kHG) {
    sm.mrow[tid] = -INFINITY;
    sm.lrow[tid] = 0.0f;
  }
  // Query fragments (A operand, rows = the 16 heads): content k-steps of group w % 8, RoPE
  // slice w & 3.
  std::uint32_t qa[5][4], qb[5][4];
  {
    const float* q0 = p.q + (static_cast<std::size_t>(b) * p.heads + hg * kHG + g) * kD;
    const float* q1 = q0 + 8 * kD;
#pragma unroll
    for (int ks = 0; ks < 5; ++ks) {
      const int d = ks < 4 ? 64 * (w & 7) + 16 * ks + 2 * t : kDc + 16 * (w & 3) + 2 * t;
      if constexpr (kAff) {
        qa[ks][0] = detail::pack2<false>(q0[d], q0[d + 1]);
        qa[ks][1] = detail::pack2<false>(q1[d], q1[d + 1]);
        qa[ks][2] = detail::pack2<false>(q0[d + 8], q0[d + 9]);
        qa[ks][3] = detail::pack2<false>(q1[d + 8], q1[d + 9]);
      } else {
        split2<true>(q0[d], q0[d + 1], qa[ks][0], qb[ks][0]);
        split2<true>(q1[d], q1[d + 1], qa[ks][1], qb[ks][1]);
        split2<true>(q0[d + 8], q0[d + 9], qa[ks][2], qb[ks][2]);
        split2<true>(q1[d + 8], q1[d + 9], qa[ks][3], qb[ks][3]);
      }
    }
  }
  float o[NN][4];
#pragma unroll
  for (int n = 0; n < NN; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  const int first = pb / kT, end = pe > pb ? (pe + kT - 1) / kT : first;
  const int np = end - first;
  const int nprot = prot ? pb + (Lq - pe) : 0;
  const int nv = np + (nprot + kT - 1) / kT;
  const int per = (nv + wk.nsplit - 1) / wk.nsplit;
  const int v0 = split * per, v1 = min(v0 + per, nv);
  const int ntiles = max(0, v1 - v0);
  const std::int32_t* bt = p.block_tables + static_cast<std::size_t>(b) * p.max_pages;
  // Page id of tile `it`, or -1 for a protected tile or none. Ids are read one iteration before
  // their copy is issued, so that the block-table load is off the critical path.
  auto page_id = [&](int it) -> int {
    const int vt = v0 + it;
    return (it < ntiles && vt < np) ? bt[first + vt] : -1;
  };
  auto issue = [&](int it, int id) {
    if (id < 0) return;  // protected tile: loaded when it is used
    const std::uint8_t* src = p.pool + static_cast<std::size_t>(id) * L.page_bytes;
    if constexpr (!kAff) {
      const int pi = first + v0 + it;
      load_bf16_page<NT>(sm.tile[it & 1], src, L, max(0, pb - pi * kT), min(kT, pe - pi * kT));
    } else {
      std::uint8_t* dst = sm.stage[it % NS];
      for (int c = tid; c < static_cast<int>(L.page_bytes / 16); c += NT) cp_async16(dst + 16 * c, src + 16 * c);
    }
  };
#pragma unroll
  for (int s = 0; s < NS - 1; ++s) {
    issue(s, page_id(s));
    cp_async_commit();
  }
  int id_next = page_id(NS - 1);
  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<NS - 2>();
    __syncthreads();
    issue(it + NS - 1, id_next);
    cp_async_commit();
    id_next = page_id(it + NS);
    const int vt = v0 + it;
    int lo = 0, hi = 0;
    if (vt < np) {
      const int pi = first + vt;
      lo = max(0, pb - pi * kT);
      hi = min(kT, pe - pi * kT);
    } else {
      hi = min(kT, nprot - (vt - np) * kT);
    }
    if constexpr (!kAff) {
      compute_tile<false, NW>(sm, sm.tile[it & 1], qa, qb, o, p.scale, lo, hi);
    } else {
      if (vt < np) dequant_page<CB, RB, NT>(sm, sm.stage[it % NS], L, lo, hi);
      else load_protected<NT>(sm, p, b, (vt - np) * kT, hi, pb, pe);
      __syncthreads();
      compute_tile<true, NW>(sm, sm.tile[0], qa, qb, o, p.scale, lo, hi);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  // Partial state of this split: unnormalized output, running max and sum.
  const std::size_t r0 = (static_cast<std::size_t>(b) * p.heads + hg * kHG + g) * wk.nsplit + split;
  const std::size_t r1 = r0 + 8 * static_cast<std::size_t>(wk.nsplit);
#pragma unroll
  for (int n = 0; n < NN; ++n) {
    const int c = w * 8 * NN + 8 * n + 2 * t;
    *reinterpret_cast<float2*>(wk.opart + r0 * kDc + c) = make_float2(o[n][0], o[n][1]);
    *reinterpret_cast<float2*>(wk.opart + r1 * kDc + c) = make_float2(o[n][2], o[n][3]);
  }
  if (tid < kHG) {
    const std::size_t r = (static_cast<std::size_t>(b) * p.heads + hg * kHG + tid) * wk.nsplit + split;
    wk.ml[2 * r] = sm.mrow[tid];
    wk.ml[2 * r + 1] = sm.lrow[tid];
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

template <int CB, int RB, int NW>
cudaError_t launch_decode_nw(const MlaDecodeParams& p, cudaStream_t st) {
  const std::size_t smem = smem_bytes<CB>(p.fmt.page.page_bytes);
  cudaError_t e = cudaFuncSetAttribute(mla_decode_kernel<CB, RB, NW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  Work wk;
  wk.nsplit = mla_decode_splits(p);
  const std::size_t rows = static_cast<std::size_t>(p.batch) * p.heads * wk.nsplit;
  wk.opart = static_cast<float*>(p.workspace);
  wk.ml = wk.opart + rows * kDc;
  const dim3 grid(wk.nsplit, p.heads / kHG, p.batch);
  mla_decode_kernel<CB, RB, NW><<<grid, 32 * NW, smem, st>>>(p, wk);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  mla_combine_kernel<<<dim3(p.heads, p.batch), 128, 0, st>>>(wk.opart, wk.ml, wk.nsplit, p.out);
  return cudaGetLastError();
}

template <int CB, int RB>
cudaError_t launch_decode(const MlaDecodeParams& p, cudaStream_t st) {
  return p.warps == 8 ? launch_decode_nw<CB, RB, 8>(p, st) : launch_decode_nw<CB, RB, 16>(p, st);
}

}  // namespace

int mla_decode_splits(const MlaDecodeParams& p) {
  const int pages = std::max(1, (p.max_seq_len + kT - 1) / kT);
  if (p.num_splits > 0) return std::min(p.num_splits, pages);
  const int ctas = std::max(1, p.batch * (p.heads / kHG));
  return std::clamp(sm_count_of(p) / ctas, 1, pages);
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
    const std::int64_t pages = pe > pb ? (pe + kT - 1) / kT - pb / kT : 0;
    bytes += static_cast<std::size_t>(pages) * (f.page.page_bytes + 4);
    bytes += static_cast<std::size_t>(pb + (L - pe)) * 2 * (f.d_latent + f.d_rope);
  }
  return bytes;
}

}  // namespace kvq::cuda
