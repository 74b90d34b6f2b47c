// The fast decode kernel's byte windows for 3-bit key codes (src/cuda/key_windows.hpp, used by
// decode_fast.cuh's tq_keys_mma and its table fill): for every pair of a 96-bit run of codes, packed as the
// cache stores them, the byte that key_window names, read from the run or from the run shifted right by 4
// bits, must give that pair's index through its table column, whatever the codes around the pair. The same
// holds for tq-3bit's value pairs (value_pair_runs: two tokens' 48-bit value runs merged into runs of
// (token a, token b) pairs per dim). The same functions build the kernel's addresses and table rows;
// scripts/gpu-test checks the kernel itself against the CPU reference.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <random>
#include <set>

#include "../../src/cuda/key_windows.hpp"
#include "kvq/bitpack.hpp"

namespace {

using kvq::cuda::detail::key_window;
using kvq::cuda::detail::key_window_pair;
using kvq::cuda::detail::value_pair_runs;
using CodeRun = std::array<std::uint32_t, 3>;  // the 96-bit run as the kernel loads it: 3 little-endian words

// The run of 32 three-bit codes as the cache stores them (kvq::pack_bits: 12 bytes, code i at bits 3 i).
CodeRun packed_run(const std::array<std::uint8_t, 32>& codes) {
  std::array<std::uint8_t, 12> bytes{};
  kvq::pack_bits(codes.data(), codes.size(), 3, bytes.data());
  CodeRun r{};
  for (std::size_t i = 0; i < bytes.size(); ++i) r[i / 4] |= static_cast<std::uint32_t>(bytes[i]) << (8 * (i % 4));
  return r;
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

// The pair index of codes 2 p and 2 p + 1, as the table rows are filled (first code | second code << 3).
int pair_of(const std::array<std::uint8_t, 32>& c, int p) {
  return c[static_cast<std::size_t>(2 * p)] | c[static_cast<std::size_t>(2 * p + 1)] << 3;
}

TEST(KeyWindows, EveryPairOfRandomRuns) {
  std::mt19937 rng(20261202);
  for (int t = 0; t < 20000; ++t) {
    std::array<std::uint8_t, 32> c;
    for (auto& x : c) x = static_cast<std::uint8_t>(rng() & 7u);
    const CodeRun r = packed_run(c);
    for (int p = 0; p < 16; ++p) ASSERT_EQ(looked_up(r, p), pair_of(c, p)) << "pair " << p << " run " << t;
  }
}

// Each pair's 64 values among codes all 0 and all 7.
TEST(KeyWindows, EveryPairValueWithAnySurroundings) {
  for (int p = 0; p < 16; ++p)
    for (int v = 0; v < 64; ++v)
      for (std::uint8_t fill : {std::uint8_t{0}, std::uint8_t{7}}) {
        std::array<std::uint8_t, 32> c;
        c.fill(fill);
        c[static_cast<std::size_t>(2 * p)] = static_cast<std::uint8_t>(v & 7);
        c[static_cast<std::size_t>(2 * p + 1)] = static_cast<std::uint8_t>(v >> 3);
        ASSERT_EQ(looked_up(packed_run(c), p), v) << "pair " << p << " value " << v << " fill " << int{fill};
      }
}

// tq-3bit's value pairs: two tokens' runs of 16 codes (6 bytes each, as the cache stores them, with random bits
// past them, which the kernel's 8-byte loads also see), merged by value_pair_runs; pair m of the even run must
// look up (dim 2 m of a, dim 2 m of b), of the odd run (dim 2 m + 1 of a, of b), whatever the garbage bits.
TEST(KeyWindows, ValuePairsOfTwoTokens) {
  std::mt19937 rng(20261203);
  auto run48 = [&](const std::array<std::uint8_t, 16>& codes) {
    std::array<std::uint8_t, 6> bytes{};
    kvq::pack_bits(codes.data(), codes.size(), 3, bytes.data());
    CodeRun r{0, static_cast<std::uint32_t>(rng()) & 0xffff0000u, static_cast<std::uint32_t>(rng())};
    for (std::size_t i = 0; i < bytes.size(); ++i) r[i / 4] |= static_cast<std::uint32_t>(bytes[i]) << (8 * (i % 4));
    return r;
  };
  for (int t = 0; t < 20000; ++t) {
    std::array<std::uint8_t, 16> ca, cb;
    for (auto& x : ca) x = static_cast<std::uint8_t>(rng() & 7u);
    for (auto& x : cb) x = static_cast<std::uint8_t>(rng() & 7u);
    const CodeRun ra = run48(ca), rb = run48(cb);
    const auto v = value_pair_runs(ra[0], ra[1], rb[0], rb[1]);
    const CodeRun e{v.e[0], v.e[1], static_cast<std::uint32_t>(rng())}, o{v.o[0], v.o[1], static_cast<std::uint32_t>(rng())};
    for (int m = 0; m < 8; ++m) {
      const auto i = static_cast<std::size_t>(2 * m);
      ASSERT_EQ(looked_up(e, m), ca[i] | cb[i] << 3) << "even dim pair " << m << " run " << t;
      ASSERT_EQ(looked_up(o, m), ca[i + 1] | cb[i + 1] << 3) << "odd dim pair " << m << " run " << t;
    }
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
