// The paired GQA store's count of 3-bit codes by magnitude (src/cuda/code_counts.hpp, used by store.cu's
// magnitude_c2): on streams of 64 codes packed as the cache stores them, the three counts equal the counts taken
// code by code, whatever the codes (those that straddle a word boundary included), and a code's magnitude names
// the centroid 4 + m whose norm-correction term it shares. scripts/gpu-test checks the kernel's records against the CPU's.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <random>

#include "../../src/cuda/code_counts.hpp"
#include "kvq/bitpack.hpp"

namespace {

using kvq::cuda::detail::magnitude_counts;
using kvq::cuda::detail::MagnitudeCounts;

int magnitude(int code) {
  const int b0 = code & 1, b1 = (code >> 1) & 1, b2 = (code >> 2) & 1;
  return (1 - (b0 ^ b2)) | (1 - (b1 ^ b2)) << 1;
}

MagnitudeCounts counted(const std::array<std::uint8_t, 64>& codes) {
  std::array<std::uint8_t, 24> bytes{};
  kvq::pack_bits(codes.data(), codes.size(), 3, bytes.data());
  std::uint32_t pw[6] = {};
  for (std::size_t i = 0; i < bytes.size(); ++i) pw[i / 4] |= static_cast<std::uint32_t>(bytes[i]) << (8 * (i % 4));
  return magnitude_counts(pw);
}

void expect_counts(const std::array<std::uint8_t, 64>& codes) {
  MagnitudeCounts want;
  for (std::uint8_t c : codes) {
    const int m = magnitude(c);
    want.m0 += m & 1;
    want.m1 += (m >> 1) & 1;
    want.both += m == 3;
  }
  const MagnitudeCounts got = counted(codes);
  ASSERT_EQ(got.m0, want.m0);
  ASSERT_EQ(got.m1, want.m1);
  ASSERT_EQ(got.both, want.both);
}

TEST(CodeCounts, MagnitudeNamesTheMirrorCentroid) {
  for (int c = 0; c < 8; ++c) {
    const int m = magnitude(c);
    EXPECT_TRUE(4 + m == c || 3 - m == c) << c;  // code c is centroid 4 + m or its mirror 7 - (4 + m)
  }
}

TEST(CodeCounts, EqualCodeByCode) {
  std::array<std::uint8_t, 64> codes{};
  for (int c = 0; c < 8; ++c) {  // all one code
    codes.fill(static_cast<std::uint8_t>(c));
    expect_counts(codes);
  }
  for (int k = 0; k < 64; ++k)  // one code among others, at every place (the straddling ones: 10, 21, 42, 53)
    for (int c = 0; c < 8; ++c)
      for (int bg : {0, 7, 3}) {
        codes.fill(static_cast<std::uint8_t>(bg));
        codes[static_cast<std::size_t>(k)] = static_cast<std::uint8_t>(c);
        expect_counts(codes);
      }
  std::mt19937 rng(11);
  for (int rep = 0; rep < 20000; ++rep) {
    for (auto& c : codes) c = static_cast<std::uint8_t>(rng() % 8);
    expect_counts(codes);
  }
}

}  // namespace
