// mla_decode.cu: paged split-KV decode for absorbed MLA (d_c = 512, d_r = 64) over bf16, QuantMLA
// affine and TurboQuant (mla-tq4 / mla-tq3) caches, and the combine kernel that merges the splits'
// partial softmax states.
//
// One CTA (8 warps, two CTAs per SM) = one sequence x 16 query heads x a range of tiles (a split);
// a request with H heads runs H / 16 such CTAs per split, reading the same pages (L2). Tiles are
// 32 tokens (affine) or 16 (bf16). Per tile:
//  1. cp.async keeps NS - 1 tiles in flight (a ring of NS shared-memory stages holding the packed
//     rows, RoPE rows and metadata, bank-padded); each thread's chunk offsets are fixed once;
//  2. warp w takes content group w (64 dims) and RoPE dims 8 w .. 8 w + 7 of every token: each
//     lane reads its codes from the stage and dequantizes them in registers straight into mma
//     B fragments as fp16 s (q - z) (exact q - z by LOP3 + one HADD2 / HFMA2 per pair, one HMUL2
//     by the token's scale; the per-token (scale, zero) pairs are prepared once per tile in shared
//     memory); bf16 rows are used as they are;
//  3. QK on tensor cores (mma.sync m16n8k16 + m16n8k8 for the RoPE slice), the query pre-scaled by
//     scale * log2(e); the 8 per-group partial scores meet in shared memory;
//  4. online softmax without per-tile reductions: a lane holds two tokens of one head; the head's
//     reference maximum moves (a warp vote, then a shuffle reduction) only when a score exceeds it
//     by more than kSlack, each lane keeps its own running sum (reduced once at the end), and P is
//     written to shared memory as ready mma A fragments;
//  5. PV on tensor cores from the same registers: movmatrix transposes each 8x8 block of the QK
//     fragments into PV fragments, so every packed tile is read and dequantized once; the output
//     is rescaled only when a reference maximum moved.
// Protected positions (sinks, recent window) of an affine cache are read from their bf16 rows as
// leading tiles of the first split, in the same online softmax; the combine kernel merges the
// splits' (max, sum, output). A bf16 cache needs no protection: its rows are bf16 already.
// MlaDecodeParams::warps is accepted for compatibility (8 or 16) and does not change the kernel.
//
// mla-tq4 / mla-tq3 (TurboQuant latent c = n Pi^T C[idx], Pi = H D, bf16 RoPE key) are decoded in
// the rotated domain with the same tiles, fragments and softmax: a pre-kernel rotates each query's
// latent part once (Pi q, fp32) and the protected latent rows (Pi c, fp16) into the workspace; in
// the tile loop a lane turns each byte (4-bit) or 6-bit field (3-bit) of its codes into the fp16
// pair (C[lo], C[hi]) by one shared-memory load from a code-pair table replicated per lane (bank =
// lane: no conflicts), times the token's stored norm (one HMUL2), so the B fragments hold
// n C[idx] and serve QK and PV as for the affine formats; the RoPE slice stays bf16 (bf16 mma, query
// as hi + lo). The combine kernel applies Pi^T = D H to the merged output.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "device.cuh"
#include "mla_split.cuh"
#include "kvq/quantizers.hpp"
#include "kvq/rotation.hpp"
#include "kvq_cuda_mla.hpp"

namespace kvq::cuda {

MlaFormat mla_format(const FormatSpec& f, int d_latent, int d_rope, int layer) {
  if (f.family != FormatFamily::kMLA && f.kind != FormatKind::kBf16) fail("format '" + f.name + "' is not an MLA format");
  MlaFormat m;
  if (f.kind == FormatKind::kBf16) {
    m.content_bits = m.rope_bits = 16;
  } else if (f.kind == FormatKind::kMlaAffine) {
    m.content_bits = f.key_bits;
    m.rope_bits = f.value_bits;
  } else if (f.kind == FormatKind::kMlaTq) {
    m.content_bits = f.key_bits;
    m.rope_bits = 16;
    m.tq = true;
  } else {
    fail("format '" + f.name + "' has no MLA CUDA kernel (bf16, c8r8, c4r8, c4r4, c3r4, c2r4, mla-tq4, mla-tq3)");
  }
  m.d_latent = d_latent;
  m.d_rope = d_rope;
  CacheGeometry g;
  g.n_layers = std::max(1, layer + 1);
  g.mla = true;
  g.d_latent = d_latent;
  g.d_rope = d_rope;
  m.page = page_layout(f, g);
  if (m.tq) {
    // The layer's rotation and codebook, read off the quantizer the CPU cache uses.
    const QuantizerPair q = make_quantizers(f, g, layer, 0);
    const auto* tq = dynamic_cast<const TurboQuantMse*>(q.key.get());
    const auto* rot = tq ? dynamic_cast<const HadamardRotation*>(&tq->rotation()) : nullptr;
    if (!tq || !rot || !tq->norm_correction() || !tq->offset().empty() || d_latent > 1024 || tq->bits() != f.key_bits)
      fail("format '" + f.name + "': the MLA CUDA kernels need a TurboQuant-MSE latent of at most 1024 dims with norm correction");
    const std::vector<float>& sg = rot->signs();
    for (int i = 0; i < d_latent; ++i)
      if (sg[static_cast<std::size_t>(i)] < 0) m.tq_signs[i / 32] |= 1u << (i % 32);
    const std::vector<float>& c = tq->codebook().centroids_f;
    for (std::size_t i = 0; i < c.size() && i < 16; ++i) m.tq_centroids[i] = c[i];
    const std::vector<float>& e = tq->codebook().edges_f;
    if (c.size() != (std::size_t{1} << f.key_bits) || e.size() + 1 != c.size())
      fail("format '" + f.name + "': codebook of " + std::to_string(c.size()) + " centroids for " + std::to_string(f.key_bits) + " bits");
    for (std::size_t i = 0; i < e.size(); ++i) m.tq_edges[i] = e[i];
    const std::vector<float>& terms = tq->centroid_squares();
    for (std::size_t i = 0; i < terms.size() && i < 16; ++i) m.tq_terms[i] = terms[i];
  }
  return m;
}

bool mla_supported(const MlaFormat& f) {
  if (f.page.tokens != 64 || f.page.heads != 1) return false;
  const bool std512 = f.d_latent == 512 && f.d_rope == 64;
  if (!std512 && !detail::mla_generic_shape_ok(f.d_latent, f.d_rope)) return false;
  const int c = f.content_bits, r = f.rope_bits;
  const auto dc = static_cast<std::uint32_t>(f.d_latent), dr = static_cast<std::uint32_t>(f.d_rope);
  if (f.tq)  // b-bit indices, bf16 RoPE key, metadata = the fp16 stored norm, padded (16 bytes at 512 / 64)
    return (c == 4 || c == 3) && r == 16 && f.page.key_code_bytes == dc * static_cast<unsigned>(c) / 8 &&
           f.page.value_code_bytes == 2 * dr && f.page.key_meta_bytes == 2 && f.page.value_meta_bytes == 0 &&
           f.page.meta_bytes >= 2 && f.page.meta_bytes % 8 == 0 && (!std512 || f.page.meta_bytes == 16);
  if (c == 16) return r == 16 && f.page.key_code_bytes == 2 * dc && f.page.value_code_bytes == 2 * dr;
  if (!((c == 8 && r == 8) || (c == 4 && (r == 8 || r == 4)) || ((c == 3 || c == 2) && r == 4))) return false;
  // Metadata per token: G bf16 scales and G zero points, R fp32 scales and R zero points (G = d_c / 64,
  // R = d_r / 64), padded; 32 bytes at 512 / 64, which the tuned kernels assume.
  const std::uint32_t G = dc / 64, R = dr / 64;
  return f.page.key_code_bytes == dc * static_cast<unsigned>(c) / 8 && f.page.value_code_bytes == dr * static_cast<unsigned>(r) / 8 &&
         f.page.key_meta_bytes == 3 * G && f.page.value_meta_bytes == 5 * R && f.page.meta_bytes >= 3 * G + 5 * R &&
         f.page.meta_bytes % 8 == 0 && (!std512 || f.page.meta_bytes == 32);
}

namespace {

using detail::bf2_to_h2;
using detail::code_pair;
using detail::cp_async16;
using detail::cp_async16_zfill;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::ex2;
using detail::hmul2u;
using detail::mma16816;
using detail::split2;
using detail::sub_zero;

constexpr int kDc = 512, kD = 576, kPT = 64, kHG = 16, kNW = 8, kNT = 32 * kNW;
constexpr int kSmemMax = detail::kMlaSmemTwoPerSm;  // two CTAs per SM
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
// The partial output's staging in shared memory at the end of a split: row h (head) of kOutRow
// floats, dim d at column out_col(d) = d + d / 32. With a row stride of 530 (18 mod 32 banks) the
// fragment scatter (lane (g, t): head g or g + 8, dims 16 t + i of its group) hits 32 different
// banks per store (bf16's dim order: 2 ways), and the row read-back is conflict-free.
constexpr int kOutRow = 530;
__host__ __device__ constexpr int out_col(int d) { return d + (d >> 5); }

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


struct Work {
  float* opart;  // [batch][heads][nsplit][512]
  float* ml;     // [batch][heads][nsplit][2]: running max (natural log units) and sum
  int nsplit;
  const float* q;            // the query the kernel reads: p.q, or for mla-tq the rotated copy
  const std::uint16_t* prot;  // mla-tq: rotated protected latent rows, fp16 [batch][slots][512]
};

// A split's unnormalized partial output of heads hg 16 .. hg 16 + nh - 1, staged in shared memory (row h
// of kOutRow floats, dim d at out_col(d)), written to the workspace as whole 128-byte lines by NT threads.
template <int NT>
__device__ __forceinline__ void store_partial(const float* so, const Work& wk, int b, int heads, int hg, int split, int nh, int tid) {
  float* dst = wk.opart + ((static_cast<std::size_t>(b) * heads + hg * kHG) * wk.nsplit + split) * kDc;
#pragma unroll 8
  for (int j = 0; j < kHG * kDc / NT; ++j) {
    const int h = j / (kDc / NT), d = (j % (kDc / NT)) * NT + tid;
    if (h < nh) dst[static_cast<std::size_t>(h) * wk.nsplit * kDc + d] = so[h * kOutRow + out_col(d)];
  }
}

// Format codes of the kernel templates: 16 (bf16), 8, 4, 3, 2 (affine content bits) and 100 + b
// for mla-tq with b-bit indices.
constexpr bool is_tq(int cb) { return cb > 100; }
constexpr int code_bits(int cb) { return cb > 100 ? cb - 100 : cb; }

// Two elements x0, x1 of sixteen bf16 values held as eight words u (element i in half i % 2 of
// u[i / 2]) as one fp16x2 word.
template <int X0, int X1>
__device__ __forceinline__ std::uint32_t pick_h2(const std::uint32_t (&u)[8]) {
  constexpr unsigned lo = (X0 & 1) ? 0x32u : 0x10u, hi = (X1 & 1) ? 0x76u : 0x54u;
  return bf2_to_h2(__byte_perm(u[X0 / 2], u[X1 / 2], lo | (hi << 8)));
}
// Eight words from two 16-byte loads at lo and hi (w[0..3] from lo, w[4..7] from hi).
__device__ __forceinline__ void load_words8(std::uint32_t (&w)[8], const void* lo, const void* hi) {
  const uint4 a = *reinterpret_cast<const uint4*>(lo);
  const uint4 c = *reinterpret_cast<const uint4*>(hi);
  w[0] = a.x;
  w[1] = a.y;
  w[2] = a.z;
  w[3] = a.w;
  w[4] = c.x;
  w[5] = c.y;
  w[6] = c.z;
  w[7] = c.w;
}
template <int CB, int K>
__device__ __forceinline__ void prot_words(std::uint32_t (&wc)[8], const std::uint32_t (&u)[8]) {
  if constexpr (K < 8) {
    wc[K] = pick_h2<widx<CB>(K, 0), widx<CB>(K, 1)>(u);
    prot_words<CB, K + 1>(wc, u);
  }
}

// (x & mask) | c in one LOP3 (the compiler otherwise splits the two immediates into two).
template <std::uint32_t kMask>
__device__ __forceinline__ std::uint32_t andor(std::uint32_t x, std::uint32_t c) {
  std::uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(x), "n"(kMask), "r"(c));
  return d;
}
__device__ __forceinline__ std::uint32_t hfma2u(std::uint32_t a, std::uint32_t b, std::uint32_t c) {
  const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b),
                            *reinterpret_cast<const __half2*>(&c));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}
// Sixteen codes of one group, loaded as one word of 8 bytes (B = 4), 4 (B = 2) or 16 (B = 8), as eight fp16x2 pairs s (q - z), word k holding codes
// widx(k, 0) and widx(k, 1), from z2 = (1024 + z) x 2 and s2 = (s, s). The low field of each byte
// or half becomes the fp16 1024 + code by one LOP3; a field 2^k higher becomes 1024 + 2^k code and
// is brought to code - z by one HFMA2 with 2^-k (Marlin's trick; exact, as is the HADD2 of the low
// field); the product with s is rounded once. z <= 2^B - 1 keeps every constant exact.
template <int B>
struct Codes16;
template <>
struct Codes16<4> {
  using T = uint2;
};
template <>
struct Codes16<2> {
  using T = std::uint32_t;
};
template <>
struct Codes16<8> {
  using T = uint4;
};
template <int B>
__device__ __forceinline__ void dequant16v(std::uint32_t (&w)[8], typename Codes16<B>::T v, std::uint32_t z2, std::uint32_t s2) {
  constexpr std::uint32_t kM = 0x64006400u;
  const std::uint32_t magic = kM;
  if constexpr (B == 4) {  // word k: codes (k, k + 4), (8 + k, 12 + k)
    const std::uint32_t zh = z2 * 16u + (0xd400d400u - kM * 16u);  // -(64 + z) x 2
    const std::uint32_t r16 = 0x2c002c00u;                          // 1/16 x 2
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::uint32_t x = h ? v.y : v.x;
#pragma unroll
      for (int sh = 0; sh < 2; ++sh) {
        const std::uint32_t y = sh ? x >> 8 : x;
        w[4 * h + 2 * sh] = hmul2u(sub_zero(andor<0x000f000fu>(y, magic), z2), s2);
        w[4 * h + 2 * sh + 1] = hmul2u(hfma2u(andor<0x00f000f0u>(y, magic), r16, zh), s2);
      }
    }
  } else if constexpr (B == 2) {  // word k: codes (k, k + 8)
    const std::uint32_t c1 = z2 * 4u + (0xdc00dc00u - kM * 4u), c2 = z2 * 16u + (0xd400d400u - kM * 16u),
                        c3 = z2 * 64u + (0xcc00cc00u - kM * 64u);  // -(256 + z), -(64 + z), -(16 + z)
#pragma unroll
    for (int sh = 0; sh < 2; ++sh) {
      const std::uint32_t y = sh ? v >> 8 : v;
      w[4 * sh] = hmul2u(sub_zero(andor<0x00030003u>(y, magic), z2), s2);
      w[4 * sh + 1] = hmul2u(hfma2u(andor<0x000c000cu>(y, magic), 0x34003400u, c1), s2);  // 1/4
      w[4 * sh + 2] = hmul2u(hfma2u(andor<0x00300030u>(y, magic), 0x2c002c00u, c2), s2);  // 1/16
      w[4 * sh + 3] = hmul2u(hfma2u(andor<0x00c000c0u>(y, magic), 0x24002400u, c3), s2);  // 1/64
    }
  } else {  // B == 8
    const std::uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = hmul2u(sub_zero(__byte_perm(u[i], 0x64646464u, 0x5150), z2), s2);
      w[2 * i + 1] = hmul2u(sub_zero(__byte_perm(u[i], 0x64646464u, 0x5352), z2), s2);
    }
  }
}
// Sixteen codes of one group (at p; dequant16v: already loaded) as eight fp16x2 pairs s (q - z) (see dequant16v).
template <int B>
__device__ __forceinline__ void dequant16s(std::uint32_t (&w)[8], const std::uint8_t* p, std::uint32_t z2, std::uint32_t s2) {
  if constexpr (B == 3) {
    const std::uint16_t* h = reinterpret_cast<const std::uint16_t*>(p);
    const std::uint32_t a = h[0], bb = h[1], c = h[2];
    const std::uint32_t v0 = a | ((bb & 0xffu) << 16), v1 = (bb >> 8) | (c << 8);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = hmul2u(sub_zero(code_pair<3>(v0, k), z2), s2);
      w[4 + k] = hmul2u(sub_zero(code_pair<3>(v1, k), z2), s2);
    }
  } else {
    dequant16v<B>(w, *reinterpret_cast<const typename Codes16<B>::T*>(p), z2, s2);
  }
}

// mla-tq: word k of a lane's sixteen codes (codes 2k, 2k + 1, widx's plain order) as the fp16
// pair n (C[lo], C[hi]). tb: the code-pair table, entry e of lane l at byte 128 e + 4 l (e = the
// byte of two 4-bit codes, or the 6-bit field of two 3-bit codes); lane4 = 4 lane; s2 = (n, n).
template <int S>
__device__ __forceinline__ std::uint32_t shr(std::uint32_t x) {
  if constexpr (S >= 0) return x >> S;
  else return x << (-S);
}
template <int B>
__device__ __forceinline__ void dequant_tq(std::uint32_t (&w)[8], const std::uint8_t* p, const std::uint8_t* tb, std::uint32_t lane4,
                                           std::uint32_t s2) {
  // One shift and one LOP3 ((x & mask) | lane4) per pair: the address of the lane's copy.
  auto look = [&](std::uint32_t off) { return hmul2u(*reinterpret_cast<const std::uint32_t*>(tb + off), s2); };
  if constexpr (B == 4) {  // byte k of the 8 code bytes: codes 2k, 2k + 1
    const uint2 v = *reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::uint32_t x = h ? v.y : v.x;
      w[4 * h + 0] = look(andor<0x7f80u>(shr<-7>(x), lane4));
      w[4 * h + 1] = look(andor<0x7f80u>(shr<1>(x), lane4));
      w[4 * h + 2] = look(andor<0x7f80u>(shr<9>(x), lane4));
      w[4 * h + 3] = look(andor<0x7f80u>(shr<17>(x), lane4));
    }
  } else {  // B == 3: bits 6k .. 6k + 5 of each 24-bit half: codes 2k, 2k + 1
    const std::uint16_t* h = reinterpret_cast<const std::uint16_t*>(p);
    const std::uint32_t a = h[0], bb = h[1], c = h[2];
    const std::uint32_t v0 = a | ((bb & 0xffu) << 16), v1 = (bb >> 8) | (c << 8);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const std::uint32_t x = u ? v1 : v0;
      w[4 * u + 0] = look(andor<0x1f80u>(shr<-7>(x), lane4));
      w[4 * u + 1] = look(andor<0x1f80u>(shr<-1>(x), lane4));
      w[4 * u + 2] = look(andor<0x1f80u>(shr<5>(x), lane4));
      w[4 * u + 3] = look(andor<0x1f80u>(shr<11>(x), lane4));
    }
  }
}

// In-place orthonormal Walsh-Hadamard transform of 512 values held four per thread (thread i:
// elements 4 i .. 4 i + 3) by a 128-thread block (every thread calls it); sh: 128 float4 of shared
// memory. Stages 1, 2 in registers, 4 .. 64 by warp shuffles, 128 and 256 through shared memory.
__device__ __forceinline__ void fwht512(float (&v)[4], float4* sh) {
  const int tid = threadIdx.x;
  {
    const float a = v[0] + v[1], b = v[0] - v[1], c = v[2] + v[3], d = v[2] - v[3];
    v[0] = a + c;
    v[1] = b + d;
    v[2] = a - c;
    v[3] = b - d;
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool up = tid & m;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float o = __shfl_xor_sync(0xffffffffu, v[i], m);
      v[i] = up ? o - v[i] : v[i] + o;
    }
  }
#pragma unroll
  for (int m = 32; m < 128; m <<= 1) {
    sh[tid] = make_float4(v[0], v[1], v[2], v[3]);
    __syncthreads();
    const float4 o = sh[tid ^ m];
    __syncthreads();
    const bool up = tid & m;
    v[0] = up ? o.x - v[0] : v[0] + o.x;
    v[1] = up ? o.y - v[1] : v[1] + o.y;
    v[2] = up ? o.z - v[2] : v[2] + o.z;
    v[3] = up ? o.w - v[3] : v[3] + o.w;
  }
  constexpr float kInvSqrt512 = 0.044194173824159216f;
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= kInvSqrt512;
}
// Multiplies element 4 i + k (i = threadIdx.x) by D's sign (bit set: -1).
__device__ __forceinline__ void apply_signs(float (&v)[4], const std::uint32_t* signs) {
  const std::uint32_t s = signs[threadIdx.x >> 3] >> ((4 * threadIdx.x) & 31);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = (s >> i) & 1u ? -v[i] : v[i];
}

// Per-format constants. A tile is TI tokens (32 for the affine and mla-tq formats; 16 for bf16,
// whose rows are 1152 bytes). A stage holds one tile: content rows (stride CS), RoPE rows (stride
// RS) and metadata rows (stride MS: 32 bytes for affine formats, 16 for mla-tq, none for bf16);
// the strides are padded so that the per-lane fragment loads are free of bank conflicts.
template <int CB, int RB>
struct Cfg {
  static constexpr bool kTq = is_tq(CB);
  static constexpr int BITS = code_bits(CB);
  static constexpr bool kAff = !kTq && CB != 16;
  static constexpr bool kPk = kAff || kTq;  // packed: 32-token tiles, fp16 operands, protection
  static constexpr int TI = kPk ? 32 : 16;
  static constexpr int NJ = TI / 8;
  static constexpr int CBY = kPk ? 8 * BITS * 8 : 1024;
  static constexpr int RBY = RB == 16 ? 128 : 8 * RB;
  static constexpr int MBY = kAff ? 32 : kTq ? 16 : 0;
  static constexpr int CS = BITS == 16 ? 1088 : BITS == 8 ? 576 : BITS == 4 ? 288 : BITS == 3 ? 208 : 144;
  static constexpr int RS = RB == 16 ? 144 : RB == 8 ? 80 : 48;
  static constexpr int MS = kAff ? 48 : kTq ? 16 : 0;
  static constexpr int kStage = TI * (CS + RS + MS);
  static constexpr int SST = TI + 8;
  // Tail: partial scores [8][16][SST] f32, P fragments [TI / 16][32][4] words, m [16], and the
  // tile's operand records: affine: (s2, z2) per group and token [8][TI], (rs2, rz2) per token
  // [TI]; mla-tq: (n2, 0) per token [TI], then the code-pair table [2^(2b)][32 lanes] (fp16x2).
  static constexpr int kRec = kAff ? 9 * TI * 2 : kTq ? TI * 2 : 0;
  static constexpr int kTabE = kTq ? 1 << (2 * BITS) : 0;
  static constexpr int kTail = (8 * kHG * SST + (TI / 16) * 128 + kHG + kRec + 32 * kTabE) * 4;
  static constexpr int NS0 = (kSmemMax - kTail) / kStage;
  static constexpr int NS = NS0 > 8 ? 8 : NS0;
  static constexpr int kSmem = NS * kStage + kTail;
  static_assert(NS >= 4, "at least four stages");
  static_assert(kHG * kOutRow * 4 <= NS * kStage, "the partial output is staged in the stages");
};

// One CTA (8 warps; two per SM) = one sequence x 16 heads x a contiguous range of tiles (a
// split); the file comment gives the steps. Lane (g, t) = (lane / 4, lane % 4) of warp w loads,
// for tokens 8 j + g, sixteen content dims of group w and RoPE dims 8 w + 2 t, + 1 straight into
// mma B fragments (QK: B[k = dim][n = token]; the dims may come in any order as long as the query
// uses the same, see widx); movmatrix turns them into PV fragments (B[k = token][n = dim]), and
// lane (g, t) accumulates the output of heads g, g + 8 at exactly its own dims. Virtual tiles:
// [0, nprt) are the protected bf16 rows (affine caches with protection; loaded straight from
// global memory, unit scales), then the packed tiles of positions [pb, pe). Operands: affine in
// fp16 (s (q - z) and the query rounded once, P <= 2^kSlack rounded once); bf16 cache in bf16
// with the query as hi + lo pairs (kHiLo) and P rounded once; mla-tq: the latent as affine (fp16
// n C[idx], the rotated query rounded once), the bf16 RoPE slice in bf16 with a hi + lo query.
template <int CB, int RB, bool kHiLo>
__global__ void __launch_bounds__(kNT, 2) mla_decode_kernel(const __grid_constant__ MlaDecodeParams p, Work wk) {
  using C = Cfg<CB, RB>;
  constexpr bool kAff = C::kAff, kTq = C::kTq, kPk = C::kPk, kB = !kPk;
  constexpr bool kRB = kB || kTq;        // RoPE operands in bf16
  constexpr bool kRoHL = kHiLo || kTq;   // RoPE query as bf16 hi + lo
  constexpr int BITS = C::BITS;
  constexpr int TI = C::TI, NJ = C::NJ, NS = C::NS, SST = C::SST;
  constexpr int LPH = TI / 2, HPW = 32 / LPH;  // softmax: lanes per head, heads per warp
  // The softmax reference of a head moves only when a score exceeds it by more than kSlack (log2
  // units), so P <= 2^kSlack and the output is rescaled a few times per split, not per tile.
  constexpr float kSlack = 8.0f;
  extern __shared__ __align__(16) std::uint8_t smem_raw[];
  std::uint8_t* stages = smem_raw;
  float* spart = reinterpret_cast<float*>(smem_raw + NS * C::kStage);  // [8][16][SST]
  std::uint32_t* sP = reinterpret_cast<std::uint32_t*>(spart + 8 * kHG * SST);  // [TI / 16][32][4]
  float* mrow = reinterpret_cast<float*>(sP + (TI / 16) * 128);                 // [16], log2 units
  uint2* rec = reinterpret_cast<uint2*>(mrow + kHG);                            // [8][TI] (s2, z2)
  uint2* rrec = rec + 8 * TI;                                                   // [TI] (rs2, rz2)
  std::uint32_t* tbl = reinterpret_cast<std::uint32_t*>(rec) + C::kRec;          // mla-tq: [2^(2b)][32]
  const PageLayout L = p.fmt.page;

  const int split = blockIdx.x, hg = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int gq = w;
  // The query first: its loads do not depend on the sequence length, so they are in flight with
  // it and with the block-table loads (the cp.async issue below is a compiler barrier for them).
  // mla-tq reads the pre-kernel's rotated query, so it loads it after the page copies are issued
  // and after griddepcontrol.wait (the pre-kernel may still run: programmatic launch).
  const float sl2 = p.scale * kLog2e;
  float x0[16], x1[16];
  float2 xr0, xr1;
  // Heads of this group that exist (the last group of a head count that is not a multiple of 16 is
  // partial): the other rows get a zero query, and their outputs are not written.
  const int nh = min(kHG, p.heads - hg * kHG);
  auto load_query = [&]() {
    const float* q0 = wk.q + (static_cast<std::size_t>(b) * p.heads + hg * kHG + g) * kD;
    const float* q1 = q0 + 8 * kD;
    const bool ok0 = g < nh, ok1 = g + 8 < nh;
    const float4 z4 = make_float4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int d = 64 * gq + (kPk ? 16 * t + 4 * i : (i < 2 ? 8 * t + 4 * i : 24 + 8 * t + 4 * i));
      const float4 a = ok0 ? *reinterpret_cast<const float4*>(q0 + d) : z4;
      const float4 c = ok1 ? *reinterpret_cast<const float4*>(q1 + d) : z4;
      x0[4 * i] = a.x;
      x0[4 * i + 1] = a.y;
      x0[4 * i + 2] = a.z;
      x0[4 * i + 3] = a.w;
      x1[4 * i] = c.x;
      x1[4 * i + 1] = c.y;
      x1[4 * i + 2] = c.z;
      x1[4 * i + 3] = c.w;
    }
    const int dr = kDc + 8 * gq + 2 * t;
    xr0 = ok0 ? *reinterpret_cast<const float2*>(q0 + dr) : make_float2(0, 0);
    xr1 = ok1 ? *reinterpret_cast<const float2*>(q1 + dr) : make_float2(0, 0);
  };
  if constexpr (!kTq) load_query();
  const int Lq = p.seq_lens[b];
  const detail::MlaTiles<TI> vtiles(p.protect, kPk && p.protect.enabled(), Lq, wk.nsplit, split);
  const int pe = vtiles.pe, first = vtiles.first, nprt = vtiles.nprt;
  const int v0 = vtiles.v0, v1 = vtiles.v1;
  const int kb = max(v0, nprt);
  const int nks = max(0, v1 - kb);
  const int pk0 = first + kb - nprt;  // packed tile index of k = 0
  const std::int32_t* bt = p.block_tables + static_cast<std::size_t>(b) * p.max_pages;
  auto range = [&](int vt, int& lo, int& hi) { vtiles.range(vt, lo, hi); };

  // ---- stage copies: per-thread offsets fixed once (a tile's rows are contiguous in its page)
  constexpr int nc = C::CBY / 16, nr = C::RBY / 16, nm = C::MBY / 16;
  constexpr int NCC = TI * nc, CPT = (NCC + kNT - 1) / kNT;
  constexpr bool kPow = kNT % nc == 0;
  constexpr int NRC = TI * nr, NMC = TI * nm;
  static_assert(kTq ? NRC == kNT && NMC <= kNT : NRC + NMC <= kNT, "one rope or meta chunk per thread");
  const int cr0 = tid / nc, cc0 = tid % nc;
  const int c_src = static_cast<int>(L.key_code_off) + 16 * tid, c_dst = cr0 * C::CS + 16 * cc0;
  const bool x_rope = tid < NRC, x_any = tid < NRC + NMC;
  const int x_row = x_rope ? tid / nr : (tid - NRC) / 2;
  const int x_src = x_rope ? static_cast<int>(L.value_code_off) + 16 * tid : static_cast<int>(L.meta_off) + 16 * (tid - NRC);
  const int x_dst = x_rope ? TI * C::CS + x_row * C::RS + 16 * (tid % nr) : TI * (C::CS + C::RS) + x_row * C::MS + 16 * ((tid - NRC) & 1);
  const int x_tb = x_rope ? C::RBY : 32;
  auto page_id = [&](int k) -> int { return k < nks ? bt[(static_cast<unsigned>(pk0 + k) * TI) / kPT] : -1; };
  auto issue = [&](int k, int id, int slot) {
    if (id < 0) return;
    const unsigned pi = static_cast<unsigned>(pk0 + k);
    const int toff = static_cast<int>((pi * TI) % kPT);
    const std::uint8_t* pg = p.pool + static_cast<std::size_t>(static_cast<unsigned>(id)) * L.page_bytes;
    std::uint8_t* st = stages + slot * C::kStage;
    const std::uint8_t* cs = pg + (c_src + toff * C::CBY);
    const int hi = pe - static_cast<int>(pi) * TI;  // bf16: rows >= hi are outside the sequence (zero-filled)
#pragma unroll
    for (int i = 0; i < CPT; ++i) {
      const int c = tid + i * kNT;
      if (NCC % kNT == 0 || c < NCC) {
        const int r = kPow ? cr0 + i * (kNT / nc) : c / nc;
        std::uint8_t* dst = kPow ? st + c_dst + i * (kNT / nc) * C::CS : st + r * C::CS + 16 * (c % nc);
        if constexpr (kPk) cp_async16(dst, cs + i * 16 * kNT);
        else cp_async16_zfill(dst, r < hi ? cs + i * 16 * kNT : pg, r < hi);
      }
    }
    if (x_any) {
      const std::uint8_t* src = pg + (x_src + toff * x_tb);
      if constexpr (kPk) cp_async16(st + x_dst, src);  // mla-tq: RoPE rows outside the sequence are masked scores
      else cp_async16_zfill(st + x_dst, x_row < hi ? src : pg, x_row < hi);
    }
    if constexpr (kTq) {  // metadata: 16 bytes per token (the fp16 norm, then padding)
      if (tid < TI * nm) cp_async16(st + TI * (C::CS + C::RS) + 16 * tid, pg + (static_cast<int>(L.meta_off) + toff * C::MBY + 16 * tid));
    }
  };
  // Affine: operand records of packed virtual tile vt (stage slot): thread (w, lane) = (group,
  // token); scales 0 outside the sequence.
  auto prep = [&](int vt, int slot) {
    if constexpr (kAff) {
      if (vt < nprt) return;
      int lo, hi;
      range(vt, lo, hi);
      const bool ok = lane >= lo && lane < hi;
      const std::uint8_t* me = stages + slot * C::kStage + TI * (C::CS + C::RS) + lane * C::MS;
      const float s = ok ? detail::bf16_bits_to_float(reinterpret_cast<const std::uint16_t*>(me)[gq]) : 0.0f;
      // Rows outside the sequence: scale 0 and zero point 0 (their codes are whatever the page
      // holds, so every dequantized value stays finite and becomes 0).
      const std::uint32_t z = ok ? me[16 + gq] : 0u;
      rec[gq * TI + lane] = make_uint2(detail::pack2<false>(s, s), detail::zero_pair(z));
      if (gq == 0) {
        const float rs = ok ? *reinterpret_cast<const float*>(me + 24) : 0.0f;
        const std::uint32_t rz = ok ? me[28] : 0u;
        rrec[lane] = make_uint2(detail::pack2<false>(rs, rs), detail::zero_pair(rz));
      }
    } else if constexpr (kTq) {  // warp 0: the stored norm of token lane as (n, n); 0 outside the sequence
      if (vt < nprt || w != 0) return;
      int lo, hi;
      range(vt, lo, hi);
      const bool ok = lane >= lo && lane < hi;
      const std::uint32_t n = ok ? *reinterpret_cast<const std::uint16_t*>(stages + slot * C::kStage + TI * (C::CS + C::RS) + lane * C::MS) : 0u;
      rec[lane] = make_uint2(n * 0x10001u, 0u);
    }
  };

  int id_next;
  {
    int ids[NS];  // the block-table entries of the first NS tiles, loaded independently
#pragma unroll
    for (int s = 0; s < NS; ++s) ids[s] = page_id(s);
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
      issue(s, ids[s], s);
      cp_async_commit();
    }
    id_next = ids[NS - 1];
  }
  if constexpr (kTq) {
    detail::grid_dependency_wait();
    load_query();
  }
  int rslot = 0, islot = NS - 1;
  if (tid < kHG) mrow[tid] = -INFINITY;
  if constexpr (kTq) {  // code-pair table: entry e = (C[e & (2^b - 1)], C[e >> b]), replicated per lane
#pragma unroll 4
    for (int i = tid; i < 32 * C::kTabE; i += kNT) {
      const int e = i >> 5;
      tbl[i] = detail::pack2<false>(p.fmt.tq_centroids[e & ((1 << BITS) - 1)], p.fmt.tq_centroids[e >> BITS]);
    }
  }
  // ---- query fragments, pre-scaled by scale * log2(e) (scores in log2 units)
  std::uint32_t qa[4][4], qb[4][4], qra[2], qrb[2];
  {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      x0[i] *= sl2;
      x1[i] *= sl2;
    }
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = 2 * s + h;
        const int i0 = widx<CB>(k, 0), i1 = widx<CB>(k, 1);
        if constexpr (kHiLo) {
          split2<true>(x0[i0], x0[i1], qa[s][2 * h], qb[s][2 * h]);
          split2<true>(x1[i0], x1[i1], qa[s][2 * h + 1], qb[s][2 * h + 1]);
        } else {
          qa[s][2 * h] = detail::pack2<kB>(x0[i0], x0[i1]);
          qa[s][2 * h + 1] = detail::pack2<kB>(x1[i0], x1[i1]);
        }
      }
    if constexpr (kRoHL) {
      split2<true>(xr0.x * sl2, xr0.y * sl2, qra[0], qrb[0]);
      split2<true>(xr1.x * sl2, xr1.y * sl2, qra[1], qrb[1]);
    } else {
      qra[0] = detail::pack2<kB>(xr0.x * sl2, xr0.y * sl2);
      qra[1] = detail::pack2<kB>(xr1.x * sl2, xr1.y * sl2);
    }
  }
  float o[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float mp0 = -INFINITY, mp1 = -INFINITY;  // PV: maxima of heads g, g + 8 the output is relative to
  float sm = -INFINITY, sl = 0.0f;         // softmax role: running maximum and this lane's sum
  const int sh_h = w * HPW + lane / LPH, sub = lane % LPH;  // softmax role: head, token pair
  // Where this lane's token pair (2 sub, 2 sub + 1) of head sh_h goes in the P fragments.
  const int sp_off = (((sub >> 3) * 32 + (sh_h & 7) * 4 + (sub & 3)) << 2) + (sh_h >> 3) + 2 * ((sub >> 2) & 1);
  // Lane-constant parts of the stage addresses.
  const int ld_c = kPk ? g * C::CS + 8 * BITS * gq + 2 * BITS * t : g * C::CS + 128 * gq + 16 * t;
  const std::uint8_t* tb = reinterpret_cast<const std::uint8_t*>(tbl);
  const std::uint32_t lane4 = 4u * static_cast<std::uint32_t>(lane);
  const int ld_r = kAff ? TI * C::CS + g * C::RS + (RB == 8 ? 8 * gq + 2 * t : 4 * gq + t) : TI * C::CS + g * C::RS + 16 * gq + 4 * t;

  cp_async_wait<NS - 2>();
  __syncthreads();
  if (v0 < v1) prep(v0, 0);
  __syncthreads();

#pragma unroll 1
  for (int vt = v0; vt < v1; ++vt) {
    const bool is_prot = kPk && vt < nprt;
    int lo, hi;
    range(vt, lo, hi);
    std::uint32_t wc[NJ][8], wr[NJ];
    if (is_prot) {  // bf16 rows from global memory, unit scales (never for bf16 caches)
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int r = 8 * j + g;
        if (r < hi) {
          const int slot = p.protect.slot(vtiles.prot_pos(vt, r));
          const std::uint16_t* row = p.protect_rows + p.protect.row(b, slot);
          if constexpr (kTq) {  // the rotated latent row (fp16, the pre-kernel's), the RoPE key as it is
            const std::uint16_t* rr = wk.prot + (static_cast<std::size_t>(b) * p.protect.slots() + slot) * kDc + 64 * gq + 16 * t;
            load_words8(wc[j], rr, rr + 8);
            wr[j] = *reinterpret_cast<const std::uint32_t*>(row + kDc + 8 * gq + 2 * t);
          } else {
            std::uint32_t u[8];
            load_words8(u, row + 64 * gq + 16 * t, row + 64 * gq + 16 * t + 8);
            prot_words<CB, 0>(wc[j], u);
            wr[j] = bf2_to_h2(*reinterpret_cast<const std::uint32_t*>(row + kDc + 8 * gq + 2 * t));
          }
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) wc[j][i] = 0u;
          wr[j] = 0u;
        }
      }
    } else {
      const std::uint8_t* st = stages + rslot * C::kStage;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const std::uint8_t* cp = st + ld_c + 8 * j * C::CS;
        const std::uint8_t* rp = st + ld_r + 8 * j * C::RS;
        if constexpr (kAff) {
          const uint2 rc = rec[gq * TI + 8 * j + g];
          const uint2 rr = rrec[8 * j + g];
          dequant16s<CB>(wc[j], cp, rc.y, rc.x);
          std::uint32_t v;  // the lane's two RoPE codes as (1024 + code) x 2
          if constexpr (RB == 8) v = __byte_perm(*reinterpret_cast<const std::uint16_t*>(rp), 0x64646464u, 0x5150);
          else v = andor<0x000f000fu>(static_cast<std::uint32_t>(*rp) * 0x1001u, 0x64006400u);
          wr[j] = hmul2u(sub_zero(v, rr.y), rr.x);
        } else if constexpr (kTq) {
          dequant_tq<BITS>(wc[j], cp, tb, lane4, rec[8 * j + g].x);
          wr[j] = *reinterpret_cast<const std::uint32_t*>(rp);
        } else {
          load_words8(wc[j], cp, cp + 64);
          wr[j] = *reinterpret_cast<const std::uint32_t*>(rp);
        }
      }
    }
    // ---- QK: partial scores (log2 units) of the 16 heads x TI tokens over this warp's dims
    {
      float sp[NJ][4];
#pragma unroll
      for (int j = 0; j < NJ; ++j) sp[j][0] = sp[j][1] = sp[j][2] = sp[j][3] = 0.0f;
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          mma16816<kB>(sp[j], qa[s], wc[j][2 * s], wc[j][2 * s + 1]);
          if constexpr (kHiLo) mma16816<kB>(sp[j], qb[s], wc[j][2 * s], wc[j][2 * s + 1]);
        }
      float* dst = spart + gq * kHG * SST + g * SST + 2 * t;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        mma1688<kRB>(sp[j], qra[0], qra[1], wr[j]);
        if constexpr (kRoHL) mma1688<kRB>(sp[j], qrb[0], qrb[1], wr[j]);
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(sp[j][0], sp[j][1]);
        *reinterpret_cast<float2*>(dst + 8 * SST + 8 * j) = make_float2(sp[j][2], sp[j][3]);
      }
    }
    cp_async_wait<NS - 3>();
    __syncthreads();
    int nslot = rslot;
    if (!is_prot) {
      issue(vt - kb + NS - 1, id_next, islot);
      cp_async_commit();
      id_next = page_id(vt - kb + NS);
      islot = islot + 1 == NS ? 0 : islot + 1;
      nslot = rslot = rslot + 1 == NS ? 0 : rslot + 1;
    }
    // ---- online softmax: lane = (head sh_h, tokens 2 sub, 2 sub + 1)
    if (w < kHG / HPW) {
      float s0 = 0.0f, s1 = 0.0f;
      const float* row = spart + sh_h * SST + 2 * sub;
#pragma unroll
      for (int ww = 0; ww < 8; ++ww) {
        const float2 v = *reinterpret_cast<const float2*>(row + ww * kHG * SST);
        s0 += v.x;
        s1 += v.y;
      }
      const bool full = lo == 0 && hi == TI;
      if (!full) {
        s0 = 2 * sub >= lo && 2 * sub < hi ? s0 : -INFINITY;
        s1 = 2 * sub + 1 >= lo && 2 * sub + 1 < hi ? s1 : -INFINITY;
      }
      if (__any_sync(0xffffffffu, s0 > sm + kSlack || s1 > sm + kSlack)) {
        float mx = fmaxf(s0, s1);
#pragma unroll
        for (int off = LPH / 2; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float mn = fmaxf(sm, mx);
        sl *= mn == sm ? 1.0f : ex2(sm - mn);  // sm = -inf: ex2(-inf) = 0
        sm = mn;
        if (sub == 0) mrow[sh_h] = mn;
      }
      float p0 = ex2(s0 - sm), p1 = ex2(s1 - sm);
      if (!full) {  // masked tokens, and heads with no valid score yet (sm = -inf)
        p0 = s0 == -INFINITY ? 0.0f : p0;
        p1 = s1 == -INFINITY ? 0.0f : p1;
      }
      sl += p0 + p1;
      sP[sp_off] = detail::pack2<kB>(p0, p1);
    }
    if (vt + 1 < v1) prep(vt + 1, nslot);
    __syncthreads();
    // ---- PV: o[heads g, g + 8][this lane's dims] += P x V
    {
      const float m0 = mrow[g], m1 = mrow[g + 8];
      if (__any_sync(0xffffffffu, m0 != mp0 || m1 != mp1)) {  // rare at long context
        const float a0 = m0 == mp0 ? 1.0f : ex2(mp0 - m0), a1 = m1 == mp1 ? 1.0f : ex2(mp1 - m1);
        mp0 = m0;
        mp1 = m1;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          o[n][0] *= a0;
          o[n][1] *= a0;
          o[n][2] *= a1;
          o[n][3] *= a1;
        }
      }
#pragma unroll
      for (int kk = 0; kk < NJ / 2; ++kk) {
        const uint4 pv = reinterpret_cast<const uint4*>(sP)[kk * 32 + lane];
        const std::uint32_t pa[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
        for (int n = 0; n < 8; ++n) mma16816<kB>(o[n], pa, movt(wc[2 * kk][n]), movt(wc[2 * kk + 1][n]));
      }
    }
  }
  cp_async_wait<0>();
  detail::launch_dependents();  // the combine kernel may be scheduled (it waits for this grid's end)
  // Partial state of this split: unnormalized output, max (natural log units), sum. The output
  // goes through shared memory (the stages are free now) so that the global stores are whole
  // 128-byte lines: the fragments scatter each lane's values over 8 head rows.
  __syncthreads();
  {
    float* so = reinterpret_cast<float*>(stages);
    const int c0 = 64 * gq + (gq << 1);  // out_col of the group's first dim
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int d0 = wdim<CB>(t, n, 0), d1 = wdim<CB>(t, n, 1);
      so[g * kOutRow + c0 + d0 + (d0 >> 5)] = o[n][0];
      so[g * kOutRow + c0 + d1 + (d1 >> 5)] = o[n][1];
      so[(g + 8) * kOutRow + c0 + d0 + (d0 >> 5)] = o[n][2];
      so[(g + 8) * kOutRow + c0 + d1 + (d1 >> 5)] = o[n][3];
    }
    __syncthreads();
    store_partial<kNT>(so, wk, b, p.heads, hg, split, nh, tid);
  }
  if (w < kHG / HPW) {
#pragma unroll
    for (int off = LPH / 2; off >= 1; off >>= 1) sl += __shfl_xor_sync(0xffffffffu, sl, off);
    if (sub == 0 && sh_h < nh) {
      const std::size_t r = (static_cast<std::size_t>(b) * p.heads + hg * kHG + sh_h) * wk.nsplit + split;
      wk.ml[2 * r] = sm * kLn2;
      wk.ml[2 * r + 1] = sl;
    }
  }
}

struct TqSigns {
  std::uint32_t w[16];
};

// mla-tq pre-kernel: blocks [0, batch x heads) write Pi q of one query's latent part (fp32, the
// RoPE part copied) to qrot[b][h][576]; the blocks after them (protection on) write Pi c of one
// protected slot's latent row as fp16 to prot[b][slot][512] (Pi = H D: signs first, then H).
__global__ void __launch_bounds__(128) mla_tq_rotate_kernel(const __grid_constant__ MlaDecodeParams p, float* __restrict__ qrot,
                                                            std::uint16_t* __restrict__ prot) {
  __shared__ float4 sh[128];
  detail::launch_dependents();  // the decode kernel may start its page copies meanwhile
  const int tid = threadIdx.x;
  const int nq = p.batch * p.heads;
  const bool isq = static_cast<int>(blockIdx.x) < nq;
  float v[4];
  const float* q = p.q + static_cast<std::size_t>(blockIdx.x) * kD;
  const int r = static_cast<int>(blockIdx.x) - nq;
  if (isq) {
    const float4 x = reinterpret_cast<const float4*>(q)[tid];
    v[0] = x.x;
    v[1] = x.y;
    v[2] = x.z;
    v[3] = x.w;
  } else {
    const int slots = p.protect.slots();
    const std::uint16_t* row = p.protect_rows + p.protect.row(r / slots, r % slots);
    const uint2 x = reinterpret_cast<const uint2*>(row)[tid];
    v[0] = detail::bf16_bits_to_float(static_cast<std::uint16_t>(x.x & 0xffffu));
    v[1] = detail::bf16_bits_to_float(static_cast<std::uint16_t>(x.x >> 16));
    v[2] = detail::bf16_bits_to_float(static_cast<std::uint16_t>(x.y & 0xffffu));
    v[3] = detail::bf16_bits_to_float(static_cast<std::uint16_t>(x.y >> 16));
  }
  apply_signs(v, p.fmt.tq_signs);
  fwht512(v, sh);
  if (isq) {
    float* o = qrot + static_cast<std::size_t>(blockIdx.x) * kD;
    reinterpret_cast<float4*>(o)[tid] = make_float4(v[0], v[1], v[2], v[3]);
    if (tid < (kD - kDc) / 4) reinterpret_cast<float4*>(o + kDc)[tid] = reinterpret_cast<const float4*>(q + kDc)[tid];
  } else {
    reinterpret_cast<uint2*>(prot + static_cast<std::size_t>(r) * kDc)[tid] =
        make_uint2(detail::pack2<false>(v[0], v[1]), detail::pack2<false>(v[2], v[3]));
  }
}

// out[b][h] = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s over the splits s (mla-tq: then
// Pi^T = D H applied to it). With few CTAs the combine is latency-bound, so it makes one pass with
// a running maximum and issues the loads of kBatch splits together (a round trip per kBatch
// splits instead of two per 8).
template <bool kTq>
__global__ void __launch_bounds__(128) mla_combine_kernel(const float* __restrict__ opart, const float* __restrict__ ml,
                                                          int nsl, float* __restrict__ out, const __grid_constant__ TqSigns sg) {
  constexpr int kBatch = 16;
  detail::grid_dependency_wait();  // the decode kernel's partials (programmatic launch)
  const std::size_t bh = static_cast<std::size_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const float2* m = reinterpret_cast<const float2*>(ml + bh * nsl * 2);
  const float4* v = reinterpret_cast<const float4*>(opart + bh * nsl * kDc) + threadIdx.x;
  float M = -INFINITY, den = 0.0f;
  float4 acc = make_float4(0, 0, 0, 0);
  for (int s0 = 0; s0 < nsl; s0 += kBatch) {
    float2 ms[kBatch];
    float4 x[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const bool in = s0 + i < nsl;
      ms[i] = in ? m[s0 + i] : make_float2(-INFINITY, 0.0f);
      x[i] = in ? v[static_cast<std::size_t>(s0 + i) * (kDc / 4)] : make_float4(0, 0, 0, 0);
    }
    float mx = M;
#pragma unroll
    for (int i = 0; i < kBatch; ++i) mx = fmaxf(mx, ms[i].x);
    if (mx == -INFINITY) continue;  // only empty splits so far (they hold zeros)
    const float a = M == mx ? 1.0f : expf(M - mx);  // M = -inf: 0
    den *= a;
    acc.x *= a;
    acc.y *= a;
    acc.z *= a;
    acc.w *= a;
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const float e = ms[i].x == -INFINITY ? 0.0f : expf(ms[i].x - mx);
      den += e * ms[i].y;
      acc.x += e * x[i].x;
      acc.y += e * x[i].y;
      acc.z += e * x[i].z;
      acc.w += e * x[i].w;
    }
    M = mx;
  }
  const float inv = den > 0.0f ? 1.0f / den : 0.0f;
  float r[4] = {acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv};
  if constexpr (kTq) {
    __shared__ float4 sh[128];
    fwht512(r, sh);
    apply_signs(r, sg.w);
  }
  reinterpret_cast<float4*>(out + bh * kDc)[threadIdx.x] = make_float4(r[0], r[1], r[2], r[3]);
}

#include "mla_decode_wg.cuh"

int sm_count_of(const MlaDecodeParams& p) { return p.sm_count > 0 ? p.sm_count : detail::device_sms(); }

bool uses_protect(const MlaDecodeParams& p) { return p.fmt.content_bits != 16 && p.protect.enabled(); }

// The splits' partial outputs and (max, sum) pairs at the start of the workspace; the query as given.
Work make_work(const MlaDecodeParams& p) {
  Work wk;
  wk.nsplit = mla_decode_splits(p);
  const std::size_t rows = static_cast<std::size_t>(p.batch) * p.heads * wk.nsplit;
  wk.opart = static_cast<float*>(p.workspace);
  wk.ml = wk.opart + rows * kDc;
  wk.q = p.q;
  wk.prot = nullptr;
  return wk;
}

template <int CB, int RB>
cudaError_t launch_decode(const MlaDecodeParams& p, cudaStream_t st) {
  using C = Cfg<CB, RB>;
  constexpr bool kHiLo = CB == 16;  // bf16 cache: query as bf16 hi + lo pairs
  cudaError_t e = detail::smem_limit_once<mla_decode_kernel<CB, RB, kHiLo>>(C::kSmem);
  if (e != cudaSuccess) return e;
  Work wk = make_work(p);
  const std::size_t rows = static_cast<std::size_t>(p.batch) * p.heads * wk.nsplit;
  TqSigns sg{};
  if constexpr (C::kTq) {
    // Workspace after (opart, ml), at the next 16-byte boundary (mla_tq_ws_offset): the rotated
    // queries [batch][heads][576] fp32, then the rotated protected latent rows [batch][slots][512] fp16.
    float* qrot = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + detail::mla_tq_ws_offset(rows, kDc));
    std::uint16_t* prot = reinterpret_cast<std::uint16_t*>(qrot + static_cast<std::size_t>(p.batch) * p.heads * kD);
    const int nblk = p.batch * p.heads + (p.protect.enabled() ? p.batch * p.protect.slots() : 0);
    mla_tq_rotate_kernel<<<nblk, 128, 0, st>>>(p, qrot, prot);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    wk.q = qrot;
    wk.prot = prot;
    for (int i = 0; i < 16; ++i) sg.w[i] = p.fmt.tq_signs[i];
  }
  const dim3 grid(wk.nsplit, (p.heads + kHG - 1) / kHG, p.batch);
  // Programmatic launches: the decode kernel after the mla-tq pre-kernel, the combine after the
  // decode kernel (each waits with griddepcontrol.wait before it reads its predecessor's output).
  // The first kernel of a call is launched normally: it may read anything earlier work wrote.
  if ((e = detail::launch_maybe_pdl(mla_decode_kernel<CB, RB, kHiLo>, grid, dim3(kNT), C::kSmem, st, C::kTq, p, wk)) != cudaSuccess)
    return e;
  return detail::launch_maybe_pdl(mla_combine_kernel<C::kTq>, dim3(p.heads, p.batch), dim3(128), 0, st, true, wk.opart,
                                  static_cast<const float*>(wk.ml), wk.nsplit, p.out, sg);
}

// The warpgroup kernel (c4r4, c2r4, c4r8 at 512 / 64 without protection) and the combine kernel.
template <int CB, int RB>
cudaError_t launch_decode_wg(const MlaDecodeParams& p, cudaStream_t st) {
  cudaError_t e = detail::smem_limit_once<wg::mla_decode_wg_kernel<CB, RB>>(wg::kSmem);
  if (e != cudaSuccess) return e;
  const Work wk = make_work(p);
  const dim3 grid(wk.nsplit, (p.heads + kHG - 1) / kHG, p.batch);
  if ((e = detail::launch_maybe_pdl(wg::mla_decode_wg_kernel<CB, RB>, grid, dim3(128), wg::kSmem, st, false, p, wk)) != cudaSuccess)
    return e;
  return detail::launch_maybe_pdl(mla_combine_kernel<false>, dim3(p.heads, p.batch), dim3(128), 0, st, true, wk.opart,
                                  static_cast<const float*>(wk.ml), wk.nsplit, p.out, TqSigns{});
}

}  // namespace

bool mla_decode_uses_wgmma(const MlaDecodeParams& p) {
  const MlaFormat& f = p.fmt;
  const int c = f.content_bits, r = f.rope_bits;
  const bool applies = !p.generic && !f.tq && !uses_protect(p) && f.d_latent == kDc && f.d_rope == kD - kDc &&
                       ((c == 4 && (r == 4 || r == 8)) || (c == 2 && r == 4));
  if (!applies || p.kernel == MlaKernel::kFragment) return false;
  if (p.kernel == MlaKernel::kWarpgroup) return true;
  const int pages = std::max(1, (p.max_seq_len + kPT - 1) / kPT);
  return pages >= kMlaWgMinPages * mla_decode_splits(p);
}

int mla_decode_splits(const MlaDecodeParams& p) {
  const int pages = std::max(1, (p.max_seq_len + kPT - 1) / kPT);
  if (p.num_splits > 0) return std::min(p.num_splits, pages);
  const int ctas = std::max(1, p.batch * ((p.heads + kHG - 1) / kHG));
  return std::clamp(2 * sm_count_of(p) / ctas, 1, pages);  // two CTAs per SM
}

std::size_t mla_decode_workspace_bytes(const MlaDecodeParams& p) {
  const std::size_t nsl = static_cast<std::size_t>(mla_decode_splits(p));
  const std::size_t bh = static_cast<std::size_t>(std::max(0, p.batch)) * static_cast<std::size_t>(std::max(0, p.heads));
  std::size_t bytes = bh * nsl * (static_cast<std::size_t>(std::max(0, p.fmt.d_latent)) + 2) * sizeof(float);
  if (p.fmt.tq) {  // rotated queries and protected latent rows (launch_decode, the generic launcher)
    bytes = detail::mla_tq_ws_offset(bh * nsl, p.fmt.d_latent);
    const std::size_t dc = static_cast<std::size_t>(std::max(0, p.fmt.d_latent)), D = dc + static_cast<std::size_t>(std::max(0, p.fmt.d_rope));
    bytes += bh * D * sizeof(float);
    if (p.protect.enabled())
      bytes += static_cast<std::size_t>(std::max(0, p.batch)) * static_cast<std::size_t>(p.protect.slots()) * dc * sizeof(std::uint16_t);
  }
  return bytes;
}

cudaError_t mla_decode(const MlaDecodeParams& p, cudaStream_t stream) {
  const MlaFormat& f = p.fmt;
  if (!mla_supported(f) || (p.warps != 0 && p.warps != 8 && p.warps != 16) || p.heads <= 0 || p.heads > 128 || p.batch <= 0 || !p.pool ||
      !p.block_tables || !p.seq_lens || !p.q || !p.out || !p.workspace)
    return cudaErrorInvalidValue;
  if (uses_protect(p) && (!p.protect_rows || p.protect.d_latent != f.d_latent || p.protect.d_rope != f.d_rope ||
                          reinterpret_cast<std::uintptr_t>(p.protect_rows) % 16))
    return cudaErrorInvalidValue;
  if (p.workspace_bytes < mla_decode_workspace_bytes(p)) return cudaErrorInvalidValue;
  if (p.generic || f.d_latent != kDc || f.d_rope != kD - kDc) return detail::mla_decode_generic(p, mla_decode_splits(p), stream);
  const int c = f.content_bits, r = f.rope_bits;
  if (mla_decode_uses_wgmma(p)) {
    if (c == 4 && r == 4) return launch_decode_wg<4, 4>(p, stream);
    if (c == 4 && r == 8) return launch_decode_wg<4, 8>(p, stream);
    return launch_decode_wg<2, 4>(p, stream);
  }
  if (f.tq) {
    if (c == 4) return launch_decode<104, 16>(p, stream);
    if (c == 3) return launch_decode<103, 16>(p, stream);
    return cudaErrorInvalidValue;
  }
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
