// The fast decode kernel's byte windows for 3-bit key codes (src/cuda/key_windows.hpp, used by
// decode_fast.cuh's tq_keys_mma and its table fill): for every pair of a 96-bit run of codes, the byte that
// key_window names, read from the run or from the run shifted right by 4 bits, must give that pair's index
// through its table column, whatever the bits around the pair. The same functions build the kernel's
// addresses and table rows; scripts/gpu-test checks the kernel itself against the CPU reference.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <random>
#include <set>

#include "../../src/cuda/key_windows.hpp"

namespace {

using kvq::cuda::detail::key_window;
using kvq::cuda::detail::key_window_pair;
using CodeRun = std::array<std::uint32_t, 3>;  // 96 bits, bit i of the run = bit i % 32 of word i / 32

int bits_at(const CodeRun& r, int pos, int n) {
  int v = 0;
  for (int i = 0; i < n; ++i) {
    const int b = pos + i;
    v |= static_cast<int>((r[static_cast<std::size_t>(b / 32)] >> (b % 32)) & 1u) << i;
  }
  return v;
}

CodeRun shifted_by_4(const CodeRun& r) {  // the run as a 96-bit number, shifted right by 4
  return {(r[0] >> 4) | (r[1] << 28), (r[1] >> 4) | (r[2] << 28), r[2] >> 4};
}

// The pair index the kernel's lookup of pair p yields for run r.
int looked_up(const CodeRun& r, int p) {
  const auto kw = key_window(p);
  const CodeRun w = kw.shifted ? shifted_by_4(r) : r;
  const int byte = static_cast<int>((w[static_cast<std::size_t>(kw.word)] >> (8 * kw.byte)) & 0xffu);
  return key_window_pair(kw.col_b, byte);
}

TEST(KeyWindows, EveryPairOfRandomRuns) {
  std::mt19937 rng(20261202);
  for (int t = 0; t < 20000; ++t) {
    CodeRun r;
    for (auto& w : r) w = static_cast<std::uint32_t>(rng());
    for (int p = 0; p < 16; ++p) ASSERT_EQ(looked_up(r, p), bits_at(r, 6 * p, 6)) << "pair " << p << " run " << t;
  }
}

// Each pair's 64 values against all-zero and all-one surroundings.
TEST(KeyWindows, EveryPairValueWithAnySurroundings) {
  for (int p = 0; p < 16; ++p)
    for (int v = 0; v < 64; ++v)
      for (std::uint32_t fill : {0u, 0xffffffffu}) {
        CodeRun r = {fill, fill, fill};
        for (int i = 0; i < 6; ++i) {
          const int b = 6 * p + i;
          auto& w = r[static_cast<std::size_t>(b / 32)];
          w = (w & ~(1u << (b % 32))) | (static_cast<std::uint32_t>((v >> i) & 1) << (b % 32));
        }
        ASSERT_EQ(looked_up(r, p), v) << "pair " << p << " value " << v << " fill " << fill;
      }
}

// The windows the kernel reads: inside the run and its copy, half of the pairs in each, and both columns in use.
TEST(KeyWindows, WindowsStayInsideTheRun) {
  std::set<std::pair<bool, int>> bytes;
  int shifted = 0, col_b = 0;
  for (int p = 0; p < 16; ++p) {
    const auto kw = key_window(p);
    ASSERT_GE(kw.word, 0);
    ASSERT_LT(kw.word, 3);
    ASSERT_GE(kw.byte, 0);
    ASSERT_LT(kw.byte, 4);
    // The copy holds 92 meaningful bits: its byte 11 would read 4 zero bits past the run.
    if (kw.shifted) {
      ASSERT_LT(4 * kw.word + kw.byte, 11);
    }
    EXPECT_TRUE(bytes.insert({kw.shifted, 4 * kw.word + kw.byte}).second) << "two pairs in one byte, pair " << p;
    shifted += kw.shifted;
    col_b += kw.col_b;
  }
  EXPECT_EQ(shifted, 8);
  EXPECT_EQ(col_b, 8);
  for (int e = 0; e < 256; ++e) {
    EXPECT_EQ(key_window_pair(false, e), e & 63);
    EXPECT_EQ(key_window_pair(true, e), e >> 2);
  }
}

}  // namespace
