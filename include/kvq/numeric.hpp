// kvq/numeric.hpp: bf16, fp16 and fp8-e4m3 conversions, shared by host and device code.
//
// All encoders round to nearest, ties to even, keep NaN a NaN (quiet) and handle subnormals.
//  - bf16: float's top 16 bits. Overflow rounds to +-Inf as IEEE does.
//  - fp16: IEEE binary16; overflow -> +-Inf.
//  - fp8 e4m3 ("E4M3FN" of the OCP FP8 spec): bias 7, no infinities, 0x7f / 0xff are NaN,
//    largest finite 448, smallest subnormal 2^-9. `float_to_fp8_e4m3(x, saturate=true)` clamps
//    finite overflow and +-Inf to +-448 (what KV caches want); with saturate=false overflow
//    and Inf become NaN, as a plain cast does.
// The decoders are exact. tests/core/test_numeric.cpp checks every code of every format and
// every rounding boundary against independent tables.
// Also here: kvq::sum_squares, the one summation order of TurboQuant's norms (host code; the
// GPU kernels add in the same order with their lanes), and the norm-correction sum on its grid.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvq/common.hpp"

namespace kvq {

KVQ_HD std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
KVQ_HD float bits_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- bf16 ----------------------------------------------------------------------------------
KVQ_HD std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
KVQ_HD float bf16_to_float(std::uint16_t h) { return bits_f32(static_cast<std::uint32_t>(h) << 16); }
KVQ_HD float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// ---- fp16 ----------------------------------------------------------------------------------
KVQ_HD std::uint16_t float_to_fp16(float f) {
  const std::uint32_t u = f32_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: Inf
  if (a < 0x38800000u) {  // below 2^-14: fp16 subnormal (or zero)
    // value = a_float; fp16 subnormal unit is 2^-24. Shift the 24-bit significand.
    const std::uint32_t e = a >> 23;
    if (e < 102) return static_cast<std::uint16_t>(sign);  // < 2^-25: rounds to zero
    const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;  // 1.m * 2^(e-127)
    const std::uint32_t shift = 126 - e;                   // 14..24 + 1 so that result unit = 2^-24
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  // normal range: rebias exponent 127 -> 15, round 23-bit mantissa to 10 bits.
  std::uint32_t v = a - 0x38000000u;  // exponent - 112
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (v >> 13));
}
KVQ_HD float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu;
  const std::uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return bits_f32(sign);
    // subnormal: m * 2^-24, exact in float.
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
KVQ_HD float round_fp16(float f) { return fp16_to_float(float_to_fp16(f)); }

// ---- fp8 e4m3 ------------------------------------------------------------------------------
inline constexpr float kFp8E4m3Max = 448.0f;

KVQ_HD std::uint8_t float_to_fp8_e4m3(float f, bool saturate = true) {
  const std::uint32_t u = f32_bits(f);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint8_t>(sign | 0x7fu);  // NaN
  // 464 = midpoint of 448 and the next (nonexistent) step 480: >= 464 overflows under RNE.
  if (a >= 0x43e80000u) return static_cast<std::uint8_t>(sign | (saturate ? 0x7eu : 0x7fu));
  if (a < 0x3c800000u) {  // below 2^-6: e4m3 subnormal, unit 2^-9
    const std::uint32_t e = a >> 23;
    if (e < 116) return sign;  // < 2^-11: rounds to zero (2^-10 is the half-unit; exactly 2^-10 -> 0 by ties-to-even)
    const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 141 - e;  // result unit 2^-9
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<std::uint8_t>(sign | r);
  }
  std::uint32_t v = a - 0x3c000000u;  // exponent 127 -> 7 (subtract 120 << 23)
  v += 0x7ffffu + ((v >> 20) & 1u);
  return static_cast<std::uint8_t>(sign | (v >> 20));
}
KVQ_HD float fp8_e4m3_to_float(std::uint8_t b) {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t e = (b >> 3) & 0xfu;
  const std::uint32_t m = b & 0x7u;
  if (e == 0xf && m == 0x7) return bits_f32(sign | 0x7fc00000u);
  if (e == 0) {
    const float v = static_cast<float>(m) * 0.001953125f;  // m * 2^-9
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

// ---- sum of squares (TurboQuant norms and norm correction) ----------------------------------
// Every encoder adds sum x_i^2 in this one order, in float, so that the CPU reference, its AVX2
// path and the GPU store kernels store the same norm bits (docs/formats.md):
//  - the n values in blocks of 32 (the last one shorter when 32 does not divide n);
//  - in each block four chains s_r = fma(x_k, x_k, s_r), k = r, r + 4, r + 8, ... in order
//    (k the index inside the block; each step one rounding), the block's sum (s_0 + s_1) + (s_2 + s_3);
//  - the block sums added as a pairwise tree over adjacent blocks, ((b_0 + b_1) + (b_2 + b_3)) + ...,
//    the block count padded with zero blocks to a power of two (b + 0 = b, so the padding only fixes
//    the shape): the order of a warp's xor-butterfly over lanes that hold one block each.
// The tree's depth and each chain's eight steps bound the rounding error far below what the fp16
// stored norm keeps. Squares that overflow give +inf (the encoders refuse the norm), squares below
// the smallest subnormal give 0.
inline constexpr int kSumSquaresBlock = 32;
inline constexpr int kSumSquaresMaxBlocks = 64;  // block sums kept on the stack (n <= 2048); longer rows use the heap

// Adds nb block sums as the padded pairwise tree; overwrites b.
inline float sum_blocks_pairwise(float* b, int nb) {
  if (nb <= 0) return 0.0f;
  while (nb > 1) {
    const int half = (nb + 1) / 2;
    for (int j = 0; j < half; ++j) b[j] = 2 * j + 1 < nb ? b[2 * j] + b[2 * j + 1] : b[2 * j];
    nb = half;
  }
  return b[0];
}

inline float sum_squares(const float* x, int n) {
  require(n >= 0, "sum_squares: negative length");
  const int nb = (n + kSumSquaresBlock - 1) / kSumSquaresBlock;
  float stack_blocks[kSumSquaresMaxBlocks];
  std::vector<float> heap_blocks;
  float* b = stack_blocks;
  if (nb > kSumSquaresMaxBlocks) {
    heap_blocks.resize(static_cast<std::size_t>(nb));
    b = heap_blocks.data();
  }
  for (int j = 0; j < nb; ++j) {
    const int off = j * kSumSquaresBlock;
    const int len = n - off < kSumSquaresBlock ? n - off : kSumSquaresBlock;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k = 0; k < len; ++k) s[k & 3] = std::fma(x[off + k], x[off + k], s[k & 3]);
    b[j] = (s[0] + s[1]) + (s[2] + s[3]);
  }
  return sum_blocks_pairwise(b, nb);
}

// ---- norm-correction sum (TurboQuant with norm correction) --------------------------------
// c2 = sum_i q(c[idx_i]) over the n chosen centroids, where q(c) is c^2 rounded to nearest (ties to even) on the
// grid 2^e Z of the codebook and length: a grid on which n copies of the largest term fit in 2^24 steps,
// e = ilogb(n cmax^2) - 23, or one more where they do not (cmax the codebook's largest |centroid|). Every term is
// then an integer multiple of 2^e, and so is every partial sum, which stays within 2^(e + 24) (the one-more case:
// n q(c) <= n cmax^2 + n 2^(e - 1) < 2^(e + 23) + 2^(e + 23) for n <= 2^24). Float holds every such multiple, so
// float adds the terms exactly in any order or grouping and c2 is one value however an encoder adds: the CPU
// reference in a loop, AVX2 in eight lanes, the GPU store in chains and shuffles or, for 3-bit codes, from counts
// of the codes by magnitude. The price is the grid: n cmax^2 is about 7.5 for the 4-bit sphere codebooks at any n
// (4.6 at 3 bits, 2.3 at 2), so e = -21 (-22 at 2 bits) and each term moves by at most 2^-22 while c2 is near 1
// for a unit vector: c2 moves by at most n 2^-22 (3.1e-5 at n = 128, 1.2e-4 at 512), the stored norm by half that
// (docs/formats.md). The host computes the terms (TurboQuantMse::centroid_squares); the GPU writers read them from
// their format tables (FormatDesc::key_terms, MlaFormat::tq_terms).
inline int square_grid_exponent(float cmax, int n) {
  const double s2 = static_cast<double>(cmax) * static_cast<double>(cmax);  // exact
  const int e = std::ilogb(static_cast<double>(n) * s2) - 23;
  const double m = std::rint(std::ldexp(s2, -e));                           // the largest term in steps
  return static_cast<double>(n) * m <= 16777216.0 ? e : e + 1;             // n m is exact (n <= 2^16, m < 2^25)
}
// q(c) on the grid 2^e Z.
inline float grid_square(float c, int e) {
  const double s = static_cast<double>(c) * static_cast<double>(c);  // exact: 48 significant bits
  return static_cast<float>(std::ldexp(std::rint(std::ldexp(s, -e)), e));
}
// The terms q(c) of a codebook's centroids for vectors of n elements. Refuses what has no grid: a non-finite or
// all-zero codebook, n outside 1 .. 65536 (the bound above needs n <= 2^24; 2^16 keeps the step below 2^-6 cmax^2).
inline std::vector<float> grid_squares(const std::vector<float>& c, int n) {
  require(n >= 1 && n <= (1 << 16), "norm correction: vector length " + std::to_string(n) + " outside 1 .. 65536");
  float cmax = 0.0f;
  for (float v : c) {
    require(std::isfinite(v), "norm correction: non-finite centroid");
    cmax = std::fabs(v) > cmax ? std::fabs(v) : cmax;
  }
  require(cmax > 0.0f, "norm correction: every centroid is zero");
  const int e = square_grid_exponent(cmax, n);
  std::vector<float> sq(c.size());
  for (std::size_t i = 0; i < c.size(); ++i) sq[i] = grid_square(c[i], e);
  return sq;
}
// c2 of the codes idx[0 .. n-1] with the terms sq (grid_squares(c, n)): a plain float loop, exact.
inline float grid_square_sum(const float* sq, const std::uint8_t* idx, int n) {
  float acc = 0.0f;
  for (int i = 0; i < n; ++i) acc += sq[idx[i]];
  return acc;
}

}  // namespace kvq
