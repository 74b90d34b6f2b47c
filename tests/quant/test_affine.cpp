// Scalar-grid quantizers: QuantMLA's affine rule (ties to even, integer zero points, constant
// and all-zero groups, no NaN/Inf from finite input, a hand-computed C4R4 record), vLLM's
// uniform value rule, fp8 with a per-vector scale.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kvq/common.hpp"
#include "kvq/formats.hpp"
#include "kvq/numeric.hpp"
#include "kvq/quantizers.hpp"
#include "test_util.hpp"

using namespace kvq;

TEST(Affine, TiesRoundToEven) {
  AffineGroup q(64, 4, 64, ScaleType::kFp32);
  std::vector<float> x(64, 0.0f);
  x[0] = 0.0f;
  x[1] = 15.0f;  // s = 1, z = 0
  x[2] = 2.5f;   // -> 2
  x[3] = 3.5f;   // -> 4
  x[4] = 4.5f;   // -> 4
  std::vector<std::uint8_t> rec(q.bytes());
  q.encode_record(x.data(), rec.data());
  std::vector<float> y(64);
  q.decode_record(rec.data(), y.data());
  EXPECT_EQ(y[2], 2.0f);
  EXPECT_EQ(y[3], 4.0f);
  EXPECT_EQ(y[4], 4.0f);
  EXPECT_EQ(q.scale_of(rec.data() + q.code_bytes(), 0), 1.0f);
  // Zero point tie: x_min = -0.5 with s = 1 gives z = rint(0.5) = 0.
  std::vector<float> x2(64, 0.0f);
  x2[0] = -0.5f;
  x2[1] = 14.5f;
  q.encode_record(x2.data(), rec.data());
  EXPECT_EQ(q.zero_of(rec.data() + q.code_bytes(), 0), 0);
}

TEST(Affine, ZeroAndConstantGroupsStayFinite) {
  for (auto st : {ScaleType::kBf16, ScaleType::kFp32}) {
    for (int b : {2, 3, 4, 8}) {
      AffineGroup q(128, b, 64, st);
      std::vector<std::uint8_t> rec(q.bytes());
      std::vector<float> y(128);
      std::vector<float> zero(128, 0.0f);
      q.encode_record(zero.data(), rec.data());
      q.decode_record(rec.data(), y.data());
      for (float v : y) ASSERT_EQ(v, 0.0f);
      for (float c : {1.0f, -3.5f, 1e-30f, 3e38f, -3e38f}) {
        std::vector<float> x(128, c);
        q.encode_record(x.data(), rec.data());
        q.decode_record(rec.data(), y.data());
        for (float v : y) ASSERT_TRUE(std::isfinite(v)) << c;
        EXPECT_GE(q.scale_of(rec.data() + q.code_bytes(), 0), FLT_MIN);
      }
      std::vector<float> bad(128, 1.0f);
      bad[7] = NAN;
      EXPECT_THROW(q.encode_record(bad.data(), rec.data()), Error);
      bad[7] = -INFINITY;
      EXPECT_THROW(q.encode_record(bad.data(), rec.data()), Error);
    }
  }
}

TEST(Affine, RandomInputsNeverProduceNonFinite) {
  std::mt19937 rng(3);
  AffineGroup q(512, 2, 64, ScaleType::kBf16);
  std::vector<std::uint8_t> rec(q.bytes());
  std::vector<float> x(512), y(512);
  for (int t = 0; t < 2000; ++t) {
    const float mag = std::ldexp(1.0f, static_cast<int>(rng() % 200) - 100);
    for (auto& v : x) v = (static_cast<float>(rng() % 2001) / 1000.0f - 1.0f) * mag;
    q.encode_record(x.data(), rec.data());
    q.decode_record(rec.data(), y.data());
    for (int i = 0; i < 512; ++i) {
      ASSERT_TRUE(std::isfinite(y[static_cast<std::size_t>(i)]));
      // Error bounded by the step (half a step, plus scale rounding headroom).
      const int g = i / 64;
      const float s = q.scale_of(rec.data() + q.code_bytes(), g);
      ASSERT_LE(std::fabs(y[static_cast<std::size_t>(i)] - x[static_cast<std::size_t>(i)]), 1.51f * s + 1e-30f);
    }
  }
}

// The C4R4 record of one token at d_c = 512, d_r = 64, computed by hand:
// content group g holds ((i % 16) - 4) * 2^-g, so s_g = 2^-g exactly (bf16 bits (127-g) << 7),
// z_g = 4 and code i % 16; the RoPE key holds ((i % 16) - 3) / 4, so s = 0.25f, z = 3, code i % 16.
// Layout: [content codes 256][rope codes 32][8 bf16 scales][8 zeros][fp32 scale][zero][3 pad].
TEST(Affine, C4R4RecordByteForByte) {
  CacheGeometry g;
  g.n_layers = 1;
  g.mla = true;
  g.d_latent = 512;
  g.d_rope = 64;
  const auto& f = find_format("c4r4");
  const auto tb = token_bytes(f, g);
  ASSERT_EQ(tb.record, 320u);
  const auto lay = record_layout(tb);
  const auto q = make_quantizers(f, g, 0, 0);
  std::vector<float> c(512), r(64);
  for (int i = 0; i < 512; ++i) c[static_cast<std::size_t>(i)] = static_cast<float>((i % 16) - 4) * std::ldexp(1.0f, -(i / 64));
  for (int i = 0; i < 64; ++i) r[static_cast<std::size_t>(i)] = static_cast<float>((i % 16) - 3) * 0.25f;
  std::vector<std::uint8_t> rec(320, 0xEE);
  encode_token_record(q, lay, c.data(), r.data(), rec.data());
  std::vector<std::uint8_t> want(320, 0);
  for (int j = 0; j < 256; ++j) want[static_cast<std::size_t>(j)] = static_cast<std::uint8_t>(((2 * j) % 16) | (((2 * j + 1) % 16) << 4));
  for (int j = 0; j < 32; ++j) want[static_cast<std::size_t>(256 + j)] = static_cast<std::uint8_t>(((2 * j) % 16) | (((2 * j + 1) % 16) << 4));
  for (int gi = 0; gi < 8; ++gi) {
    const unsigned bits = static_cast<unsigned>(127 - gi) << 7;  // bf16 of 2^-g
    want[static_cast<std::size_t>(288 + 2 * gi)] = static_cast<std::uint8_t>(bits & 0xff);
    want[static_cast<std::size_t>(288 + 2 * gi + 1)] = static_cast<std::uint8_t>(bits >> 8);
    want[static_cast<std::size_t>(304 + gi)] = 4;
  }
  // fp32 0.25 = 0x3e800000, little endian.
  want[312] = 0x00;
  want[313] = 0x00;
  want[314] = 0x80;
  want[315] = 0x3e;
  want[316] = 3;
  EXPECT_EQ(rec, want);
  std::vector<float> c2(512), r2(64);
  decode_token_record(q, lay, rec.data(), c2.data(), r2.data());
  EXPECT_EQ(c2, c);
  EXPECT_EQ(r2, r);
}

TEST(Uniform, VllmValueRule) {
  UniformAffine q(8, 2);
  const std::vector<float> x = {0.0f, 1.0f, 2.0f, 3.0f, 0.5f, 1.5f, 2.5f, 0.49f};
  std::vector<std::uint8_t> rec(q.bytes());
  q.encode_record(x.data(), rec.data());
  std::vector<float> y(8);
  q.decode_record(rec.data(), y.data());
  // s = 1, min = 0; round half up: 0.5 -> 1, 1.5 -> 2, 2.5 -> 3; 0.49 -> 0.
  const std::vector<float> want = {0, 1, 2, 3, 1, 2, 3, 0};
  EXPECT_EQ(y, want);
  std::vector<float> z(8, 0.0f);
  q.encode_record(z.data(), rec.data());
  q.decode_record(rec.data(), y.data());
  for (float v : y) EXPECT_EQ(v, 0.0f);
  z[0] = 1e5f;
  EXPECT_THROW(q.encode_record(z.data(), rec.data()), Error);
}

TEST(Fp8, ScaledAndUnscaled) {
  Fp8E4m3 s(4, true), u(4, false);
  const std::vector<float> x = {1000.0f, -2.0f, 0.001f, 0.0f};
  std::vector<std::uint8_t> rs(s.bytes()), ru(u.bytes());
  std::vector<float> y(4);
  s.encode_record(x.data(), rs.data());
  s.decode_record(rs.data(), y.data());
  EXPECT_NEAR(y[0], 1000.0f, 1e-3f * 1000.0f);
  EXPECT_NEAR(y[1], -2.0f, 0.07f);
  u.encode_record(x.data(), ru.data());
  u.decode_record(ru.data(), y.data());
  EXPECT_EQ(y[0], 448.0f);  // saturates without a scale
  std::vector<float> z(4, 0.0f);
  s.encode_record(z.data(), rs.data());
  s.decode_record(rs.data(), y.data());
  for (float v : y) EXPECT_EQ(v, 0.0f);
}
