// bf16 / fp16 / fp8-e4m3 conversions against independent tables: every code decodes to the
// value its fields define (computed with ldexp), every code re-encodes to itself, every rounding
// boundary (midpoints between neighbouring codes, one ulp either side) rounds to nearest-even,
// and, in the "slow" suite, every one of the 2^32 float inputs.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvq/numeric.hpp"

using namespace kvq;

namespace {

// Independent decoders from the bit fields (no bit tricks shared with the code under test).
double ref_fp16(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 31) v = m ? std::numeric_limits<double>::quiet_NaN() : INFINITY;
  else if (e == 0) v = std::ldexp(m, -24);
  else v = std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}
double ref_bf16(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 7) & 255, m = h & 127;
  double v;
  if (e == 255) v = m ? std::numeric_limits<double>::quiet_NaN() : INFINITY;
  else if (e == 0) v = std::ldexp(m, -133);
  else v = std::ldexp(128 + m, e - 134);
  return s ? -v : v;
}
double ref_fp8(std::uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  double v;
  if (e == 15 && m == 7) v = std::numeric_limits<double>::quiet_NaN();
  else if (e == 0) v = std::ldexp(m, -9);
  else v = std::ldexp(8 + m, e - 10);
  return s ? -v : v;
}

bool same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b)); }

// Nearest-even rounding of a finite double onto a sorted table of non-negative finite values
// whose code order equals value order (codes 0..n-1); returns the code.
template <typename Dec>
int round_to_table(double v, int n, Dec dec) {
  int lo = 0, hi = n - 1;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    (dec(mid) <= v ? lo : hi) = mid;
  }
  const double a = dec(lo), b = dec(hi);
  if (v <= a) return lo;
  if (v >= b) return hi;
  const double da = v - a, db = b - v;
  if (da < db) return lo;
  if (db < da) return hi;
  return (lo % 2 == 0) ? lo : hi;  // tie: even mantissa (codes alternate parity)
}

std::uint8_t ref_encode_fp8(float f, bool sat) {
  if (std::isnan(f)) return std::signbit(f) ? 0xff : 0x7f;  // NaN keeps its sign
  const std::uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 464.0) return sign | (sat ? 0x7e : 0x7f);
  return sign | static_cast<std::uint8_t>(round_to_table(a, 127, [](int c) { return ref_fp8(static_cast<std::uint8_t>(c)); }));
}
// Table of every bf16 code's value (from ref_bf16) so the exhaustive sweep stays fast.
const std::vector<double>& bf16_table() {
  static const std::vector<double> t = [] {
    std::vector<double> v(65537);
    for (std::uint32_t h = 0; h < 65536; ++h) v[h] = ref_bf16(static_cast<std::uint16_t>(h));
    return v;
  }();
  return t;
}

std::uint16_t ref_encode_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  const std::uint16_t sign = (u >> 31) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  // Candidates: truncation and the next code up; compare distances in double (exact here).
  const std::uint16_t t = static_cast<std::uint16_t>((u >> 16) & 0x7fff);
  const auto& tab = bf16_table();
  const double lo = tab[t];
  if (lo == a) return sign | t;
  const double hi = (t == 0x7f7f) ? std::ldexp(1.0, 128) : tab[t + 1u];
  const double dl = a - lo, dh = hi - a;
  const std::uint16_t r = (dl < dh || (dl == dh && (t & 1) == 0)) ? t : static_cast<std::uint16_t>(t + 1);
  return sign | r;
}

}  // namespace

TEST(Numeric, Fp16DecodeEveryCode) {
  for (std::uint32_t h = 0; h < 65536; ++h)
    ASSERT_TRUE(same(fp16_to_float(static_cast<std::uint16_t>(h)), ref_fp16(static_cast<std::uint16_t>(h)))) << h;
}
TEST(Numeric, Bf16DecodeEveryCode) {
  for (std::uint32_t h = 0; h < 65536; ++h)
    ASSERT_TRUE(same(bf16_to_float(static_cast<std::uint16_t>(h)), ref_bf16(static_cast<std::uint16_t>(h)))) << h;
}
TEST(Numeric, Fp8DecodeEveryCode) {
  for (std::uint32_t b = 0; b < 256; ++b)
    ASSERT_TRUE(same(fp8_e4m3_to_float(static_cast<std::uint8_t>(b)), ref_fp8(static_cast<std::uint8_t>(b)))) << b;
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(Numeric, EveryCodeReencodesToItself) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto c = static_cast<std::uint16_t>(h);
    const float f16 = fp16_to_float(c), b16 = bf16_to_float(c);
    if (!std::isnan(f16)) ASSERT_EQ(float_to_fp16(f16), c) << h;
    else ASSERT_TRUE(std::isnan(fp16_to_float(float_to_fp16(f16))));
    if (!std::isnan(b16)) ASSERT_EQ(float_to_bf16(b16), c) << h;
    else ASSERT_TRUE(std::isnan(bf16_to_float(float_to_bf16(b16))));
  }
  for (std::uint32_t b = 0; b < 256; ++b) {
    const auto c = static_cast<std::uint8_t>(b);
    const float f = fp8_e4m3_to_float(c);
    if (!std::isnan(f)) ASSERT_EQ(float_to_fp8_e4m3(f), c) << b;
    else ASSERT_TRUE(std::isnan(fp8_e4m3_to_float(float_to_fp8_e4m3(f))));
  }
}

// Around every midpoint between adjacent codes: the midpoint itself (ties to even) and the
// floats one and two ulps either side.
TEST(Numeric, RoundingBoundariesAllFormats) {
  auto probe = [](double mid, auto&& check) {
    const float m = static_cast<float>(mid);
    if (static_cast<double>(m) == mid) check(m);
    float lo = m, hi = m;
    for (int k = 0; k < 2; ++k) {
      lo = std::nextafter(lo, -INFINITY);
      hi = std::nextafter(hi, INFINITY);
      check(lo);
      check(hi);
    }
  };
  for (std::uint32_t h = 0; h + 1 < 0x7c00; ++h) {  // positive finite fp16 pairs
    const double mid = 0.5 * (ref_fp16(static_cast<std::uint16_t>(h)) + ref_fp16(static_cast<std::uint16_t>(h + 1)));
    probe(mid, [](float f) {
      ASSERT_EQ(float_to_fp16(f), _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)) << f;
      ASSERT_EQ(float_to_fp16(-f), _cvtss_sh(-f, _MM_FROUND_TO_NEAREST_INT)) << -f;
    });
  }
  for (std::uint32_t h = 0; h + 1 < 0x7f80; ++h) {
    const double mid = 0.5 * (ref_bf16(static_cast<std::uint16_t>(h)) + ref_bf16(static_cast<std::uint16_t>(h + 1)));
    probe(mid, [](float f) {
      ASSERT_EQ(float_to_bf16(f), ref_encode_bf16(f)) << f;
      ASSERT_EQ(float_to_bf16(-f), ref_encode_bf16(-f)) << -f;
    });
  }
  for (std::uint32_t b = 0; b + 1 < 0x7f; ++b) {
    const double mid = 0.5 * (ref_fp8(static_cast<std::uint8_t>(b)) + ref_fp8(static_cast<std::uint8_t>(b + 1)));
    probe(mid, [](float f) {
      for (bool sat : {true, false}) {
        ASSERT_EQ(float_to_fp8_e4m3(f, sat), ref_encode_fp8(f, sat)) << f;
        ASSERT_EQ(float_to_fp8_e4m3(-f, sat), ref_encode_fp8(-f, sat)) << -f;
      }
    });
  }
  // The overflow edge of e4m3: 448 + 16 = 464 is the midpoint to the nonexistent 480.
  probe(464.0, [](float f) {
    for (bool sat : {true, false}) ASSERT_EQ(float_to_fp8_e4m3(f, sat), ref_encode_fp8(f, sat)) << f;
  });
}

TEST(Numeric, SpecialValues) {
  const float inf = INFINITY, nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(float_to_fp16(inf), 0x7c00);
  EXPECT_EQ(float_to_fp16(-inf), 0xfc00);
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);  // tie with the next step rounds to even = Inf
  EXPECT_EQ(float_to_fp16(65519.0f), 0x7bff);
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(nan))));
  EXPECT_EQ(float_to_bf16(inf), 0x7f80);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(nan))));
  EXPECT_EQ(float_to_fp8_e4m3(inf, true), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-inf, true), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(inf, false), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3(1e6f, true), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(nan, true), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0f, -10), true), 0x00);  // tie between 0 and 2^-9 -> 0
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.5f, -10), true), 0x01);
  EXPECT_EQ(float_to_fp16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(float_to_fp16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(float_to_fp16(-0.0f), 0x8000);
}

TEST(Numeric, RandomFloatsMatchReferences) {
  std::mt19937 rng(7);
  for (int i = 0; i < 2000000; ++i) {
    std::uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    if (i % 2) f = std::ldexp(static_cast<float>(u % 100000) / 1000.0f - 50.0f, static_cast<int>(u % 40) - 20);
    ASSERT_EQ(float_to_fp16(f), _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)) << f;
    ASSERT_EQ(float_to_bf16(f), ref_encode_bf16(f)) << f;
    ASSERT_EQ(float_to_fp8_e4m3(f, true), ref_encode_fp8(f, true)) << f;
  }
}

#ifndef KVQ_SANITIZE
// All 2^32 float inputs (every NaN payload, subnormal and infinity included).
TEST(NumericExhaustive, AllFloatsFp16MatchesF16C) {
  std::uint64_t bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (std::int64_t hi = 0; hi < 65536; ++hi) {
    for (std::uint32_t lo = 0; lo < 65536; ++lo) {
      const std::uint32_t u = static_cast<std::uint32_t>(hi) << 16 | lo;
      float f;
      std::memcpy(&f, &u, 4);
      const std::uint16_t a = float_to_fp16(f), b = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
      // NaN: F16C keeps the top payload bits and sets quiet; so do we.
      bad += (a != b);
    }
  }
  EXPECT_EQ(bad, 0u);
}
TEST(NumericExhaustive, AllFloatsBf16MatchesReference) {
  std::uint64_t bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (std::int64_t hi = 0; hi < 65536; ++hi) {
    for (std::uint32_t lo = 0; lo < 65536; ++lo) {
      const std::uint32_t u = static_cast<std::uint32_t>(hi) << 16 | lo;
      float f;
      std::memcpy(&f, &u, 4);
      bad += (float_to_bf16(f) != ref_encode_bf16(f));
    }
  }
  EXPECT_EQ(bad, 0u);
}
TEST(NumericExhaustive, AllFloatsFp8MatchesReference) {
  // The reference here is the 256-entry table search; sweep every float whose low 12 mantissa
  // bits are 0, 1, 0x7ff, 0x800, 0x801 or 0xfff (all rounding cases of e4m3's 3-bit mantissa
  // lie in the high bits; the low bits only decide exact ties, covered by 0x000 and 0x800).
  std::uint64_t bad = 0;
  const std::uint32_t lows[] = {0x000, 0x001, 0x7ff, 0x800, 0x801, 0xfff};
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (std::int64_t top = 0; top < (1 << 20); ++top) {
    for (std::uint32_t low : lows) {
      const std::uint32_t u = static_cast<std::uint32_t>(top) << 12 | low;
      float f;
      std::memcpy(&f, &u, 4);
      bad += (float_to_fp8_e4m3(f, true) != ref_encode_fp8(f, true));
      bad += (float_to_fp8_e4m3(f, false) != ref_encode_fp8(f, false));
    }
  }
  EXPECT_EQ(bad, 0u);
}
#endif

// The GPU store kernel's uniform-value quotient (src/cuda/store.cu): with y = RN(1/s) and
// q0 = RN(d y), one remainder correction q = RN(q0 + RN(d - q0 s) y) (two FMAs) is the correctly
// rounded d / s (Markstein's theorem: y correctly rounded, q0 within one ulp). Checked here on
// the kernel's inputs (d = x - lo, s = max((hi - lo) / m, 1e-8) from bf16 rows, m = 7 and 15)
// and on random floats, divisors with all-ones and all-zeros significand tails included.
TEST(Numeric, OneCorrectionQuotientIsCorrectlyRounded) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto one_correction = [](float d, float s) {
    const float y = 1.0f / s;
    const float q0 = d * y;
    return std::fma(std::fma(-q0, s, d), y, q0);
  };
  long checked = 0;
  for (int i = 0; i < 2000000; ++i) {
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
    float lo = round_bf16(nd(rng) * scale), hi = round_bf16(nd(rng) * scale);
    if (hi < lo) std::swap(lo, hi);
    const float m = (rng() & 1) ? 15.0f : 7.0f;
    float s = (hi - lo) / m;
    if (!(s > 1e-8f)) s = 1e-8f;
    for (int k = 0; k < 4; ++k) {
      const float x = std::clamp(round_bf16(lo + (hi - lo) * static_cast<float>(rng() % 4097) / 4096.0f), lo, hi);
      const float d = x - lo;
      ASSERT_EQ(one_correction(d, s), d / s) << "x " << x << " lo " << lo << " hi " << hi << " m " << m;
      ++checked;
    }
  }
  for (int i = 0; i < 8000000; ++i) {
    const std::uint64_t r = rng();
    std::uint32_t sm = r & 0x7fffffu;
    if (((r >> 23) & 7) == 0) sm |= 0x7fff00u;
    if (((r >> 23) & 7) == 1) sm &= 0x7f0000u;
    const float s = bits_f32((static_cast<std::uint32_t>(107 + (r >> 26) % 40) << 23) | sm);
    const float d = std::ldexp(static_cast<float>(rng() & 0xffffff) / 16777216.0f, 4) * s;
    ASSERT_EQ(one_correction(d, s), d / s) << "d " << d << " s " << s;
    ++checked;
  }
  EXPECT_EQ(checked, 16000000);
}

// kvq::sum_squares against an independent statement of its order: a recursion over the block
// count padded to a power of two (the padding blocks add an explicit +0), each block's four FMA
// chains written out. Bits must agree; a sequential float sum must not agree on many of the same
// rows (so the rows tell orders apart).
namespace {
float block_chains(const float* x, int n, int b) {
  float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int k = 0; k < 32 && 32 * b + k < n; ++k) s[k % 4] = std::fma(x[32 * b + k], x[32 * b + k], s[k % 4]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}
float padded_tree(const float* x, int n, int first, int count) {
  if (count == 1) return 32 * first < n ? block_chains(x, n, first) : 0.0f;
  return padded_tree(x, n, first, count / 2) + padded_tree(x, n, first + count / 2, count / 2);
}
float sum_squares_spec(const float* x, int n) {
  int m = 1;
  while (32 * m < n) m *= 2;
  return padded_tree(x, n, 0, m);
}
}  // namespace

TEST(Numeric, SumSquaresFollowsItsStatedOrder) {
  std::mt19937 rng(20261201);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  int rows = 0, sequential_differs = 0;
  for (int n : {0, 1, 2, 3, 4, 7, 31, 32, 33, 63, 64, 65, 96, 100, 127, 128, 129, 160, 192, 255, 256, 288, 384, 512, 576,
                1000, 1024, 1056, 2047, 2048, 2049, 4096, 5000}) {
    for (int lo : {-3, -40, -80, 50}) {
      std::uniform_int_distribution<int> ex(lo, lo + (lo == 50 ? 16 : lo == -40 ? 60 : 6));
      std::vector<float> x(static_cast<std::size_t>(n));
      for (float& v : x) v = std::ldexp(nd(rng), ex(rng));
      const float got = kvq::sum_squares(x.data(), n), want = sum_squares_spec(x.data(), n);
      ASSERT_EQ(kvq::f32_bits(got), kvq::f32_bits(want)) << "n " << n << " exponents from " << lo;
      float seq = 0.0f;
      for (float v : x) seq = std::fma(v, v, seq);
      sequential_differs += kvq::f32_bits(seq) != kvq::f32_bits(got);
      ++rows;
    }
  }
  EXPECT_GT(sequential_differs, rows / 4) << "the rows should tell a sequential sum from the stated order";
  // Edges: nothing and zeros give +0, overflowing squares +inf, squares below the subnormals 0.
  EXPECT_EQ(kvq::f32_bits(kvq::sum_squares(nullptr, 0)), 0u);
  const std::vector<float> zeros(100, -0.0f), huge(64, 1e30f), tiny(64, 1e-30f);
  EXPECT_EQ(kvq::f32_bits(kvq::sum_squares(zeros.data(), 100)), 0u);
  EXPECT_EQ(kvq::sum_squares(huge.data(), 64), std::numeric_limits<float>::infinity());
  EXPECT_EQ(kvq::f32_bits(kvq::sum_squares(tiny.data(), 64)), 0u);
  EXPECT_THROW(kvq::sum_squares(zeros.data(), -1), kvq::Error);
}
