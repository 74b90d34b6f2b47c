// code_counts.hpp: the paired GQA store's count of 3-bit codes by magnitude (store.cu, magnitude_c2), written once
// for the device and the host: tests/core/test_code_counts.cpp checks it on any machine (CI has no GPU), and
// scripts/gpu-test checks the kernel's records against the CPU's.
//
// A lane's 64 codes are the 192-bit stream of six words pw[0..5], code k at bits 3 k (pack_fields' order, the
// cache's: kvq::pack_bits), so codes 10, 21, 42 and 53 straddle a word boundary and every 96 bits end with a whole
// code. With a codebook whose mirror codes j and 7 - j share their norm-correction term (kvq::grid_squares; kvq's
// symmetric Lloyd-Max codebooks), a code's term depends only on its magnitude m = (m1 m0), m_i = NOT(b_i XOR b2):
// codes 7 and 0 have m = 3, codes 4 and 3 m = 0, and centroid 4 + m has that term. In word i the codes start at the bits of
// code_starts(i mod 3) (bit t with (32 i + t) mod 3 == 0); funnel shifts by 1 and 2 bring each code's b1 and b2
// onto its b0, across the word boundary for the codes that straddle one, and three masked population counts per
// word count the codes with m0 set, with m1 set and with both.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVQ_COUNTS_HD __host__ __device__
#else
#define KVQ_COUNTS_HD
#endif

namespace kvq::cuda::detail {

// The bits of word i at which codes start, r = i mod 3: every third bit from bit r (32 = 2 mod 3).
KVQ_COUNTS_HD constexpr std::uint32_t code_starts(int r) { return 0x49249249u << r; }

KVQ_COUNTS_HD inline std::uint32_t popc32(std::uint32_t x) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint32_t>(__popc(x));
#else
  return static_cast<std::uint32_t>(__builtin_popcount(x));
#endif
}
// Bits s.. of the 64-bit value hi:lo (s = 1 or 2), as __funnelshift_r.
KVQ_COUNTS_HD inline std::uint32_t funnel_r(std::uint32_t lo, std::uint32_t hi, int s) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(lo, hi, static_cast<unsigned>(s));
#else
  return (lo >> s) | (hi << (32 - s));
#endif
}

struct MagnitudeCounts {
  std::uint32_t m0 = 0, m1 = 0, both = 0;  // codes with m0 set, with m1 set, with both
};

// The counts over the 64 codes of pw.
KVQ_COUNTS_HD inline MagnitudeCounts magnitude_counts(const std::uint32_t (&pw)[6]) {
  MagnitudeCounts c;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 6; ++i) {
    const std::uint32_t w = pw[i], nx = i % 3 < 2 ? pw[i + 1] : 0u;
    const std::uint32_t b1 = funnel_r(w, nx, 1), b2 = funnel_r(w, nx, 2);
    const std::uint32_t mask = code_starts(i % 3);
    const std::uint32_t m0 = ~(w ^ b2) & mask, m1 = ~(b1 ^ b2) & mask;
    c.m0 += popc32(m0);
    c.m1 += popc32(m1);
    c.both += popc32(m0 & m1);
  }
  return c;
}

}  // namespace kvq::cuda::detail
