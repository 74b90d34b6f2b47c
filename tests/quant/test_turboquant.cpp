// TurboQuant quantizers: round-trip distortion against the Lloyd-Max model, rotated-domain
// scoring and value accumulation against dequantize-then-compute, QJL unbiasedness, the sign
// diagonal on Walsh-aligned inputs, the outlier split and its element order, zero vectors and
// non-finite input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "kvq/codebook.hpp"
#include "kvq/common.hpp"
#include "kvq/numeric.hpp"
#include "kvq/quantizers.hpp"
#include "kvq/rng.hpp"
#include "test_util.hpp"

using namespace kvq;
using kvq::testing::gaussian;

namespace {
std::shared_ptr<HadamardRotation> rht(int d, std::uint64_t key = 77) { return std::make_shared<HadamardRotation>(d, true, key); }

// Mean of ||x - x^||^2 / ||x||^2 over n vectors.
double mean_rel_mse(const VectorQuantizer& q, const std::vector<float>& x, std::size_t n) {
  const std::size_t d = static_cast<std::size_t>(q.dim());
  std::vector<std::uint8_t> rec(q.bytes());
  std::vector<float> y(d);
  double acc = 0;
  for (std::size_t i = 0; i < n; ++i) {
    q.encode_record(&x[i * d], rec.data());
    q.decode_record(rec.data(), y.data());
    double e = 0, s = 0;
    for (std::size_t j = 0; j < d; ++j) {
      const double diff = static_cast<double>(x[i * d + j]) - y[j];
      e += diff * diff;
      s += static_cast<double>(x[i * d + j]) * x[i * d + j];
    }
    acc += e / s;
  }
  return acc / static_cast<double>(n);
}
}  // namespace

TEST(TurboQuant, RoundTripMatchesModelOnGaussians) {
  const int d = 128;
  const std::size_t n = 20000;
  const auto x = gaussian(n * d, 1);
  for (int b = 1; b <= 4; ++b) {
    TurboQuantMse q(d, b, rht(d), false);
    const double got = mean_rel_mse(q, x, n);
    EXPECT_NEAR(got, sphere_codebook(d, b).mse, 0.01 * sphere_codebook(d, b).mse) << "bits " << b;
  }
}

TEST(TurboQuant, HaarRotationAlsoMatchesModel) {
  const int d = 64;
  const std::size_t n = 20000;
  const auto x = gaussian(n * d, 2);
  TurboQuantMse q(d, 3, std::make_shared<HaarRotation>(d, 5), false);
  EXPECT_NEAR(mean_rel_mse(q, x, n), sphere_codebook(d, 3).mse, 0.01 * sphere_codebook(d, 3).mse);
}

TEST(TurboQuant, NormCorrectionPutsCodewordOnSphere) {
  const int d = 128;
  TurboQuantMse q(d, 2, rht(d), true);
  const auto x = gaussian(d, 3);
  std::vector<std::uint8_t> rec(q.bytes());
  q.encode_record(x.data(), rec.data());
  std::vector<float> y(d);
  q.decode_record(rec.data(), y.data());
  double nx = 0, ny = 0;
  for (int i = 0; i < d; ++i) {
    nx += static_cast<double>(x[static_cast<std::size_t>(i)]) * x[static_cast<std::size_t>(i)];
    ny += static_cast<double>(y[static_cast<std::size_t>(i)]) * y[static_cast<std::size_t>(i)];
  }
  EXPECT_NEAR(std::sqrt(ny), std::sqrt(nx), 2e-3 * std::sqrt(nx));  // fp16 norm rounding only
}

// The norm-correction sum on its grid: every term of kvq::grid_squares is an integer multiple of the grid step
// 2^e, so kvq::grid_square_sum equals an independent exact sum (the terms as 64-bit integer multiples of 2^e,
// converted once) for every codebook the formats use, in any order; the step is at most 2^-21 for c2 near 1
// (the 1-4-bit codebooks: n cmax^2 < 8), the grid moves each term by at most half a step, and for these codebooks
// it is the finest: on the grid one step finer, n copies of the largest term would not fit in 2^24 steps.
TEST(TurboQuant, NormCorrectionSumIsExactOnItsGrid) {
  std::mt19937 rng(5);
  for (int bits = 1; bits <= 4; ++bits)
    for (int d : {32, 64, 96, 128, 256, 576, 1024}) {
      for (const Codebook* cb : {&sphere_codebook(d, bits), &gaussian_codebook(d, bits)}) {
        const std::vector<float>& c = cb->centroids_f;
        const std::vector<float> sq = grid_squares(c, d);
        float cmax = 0.0f;
        for (float v : c) cmax = std::max(cmax, std::fabs(v));
        const int e = square_grid_exponent(cmax, d);
        EXPECT_LE(e, -21) << bits << " bits, d " << d;
        {
          const double m_finer = std::rint(std::ldexp(static_cast<double>(cmax) * cmax, -(e - 1)));
          EXPECT_GT(static_cast<double>(d) * m_finer, 16777216.0) << "a finer grid fits: " << bits << " bits, d " << d;
        }
        std::vector<std::int64_t> units(sq.size());
        for (std::size_t i = 0; i < sq.size(); ++i) {
          const double u = std::ldexp(static_cast<double>(sq[i]), -e);
          ASSERT_EQ(u, std::floor(u)) << "a term off the grid: " << bits << " bits, d " << d;
          units[i] = static_cast<std::int64_t>(u);
          const double exact = static_cast<double>(c[i]) * c[i];
          EXPECT_LE(std::fabs(static_cast<double>(sq[i]) - exact), std::ldexp(0.5, e));
          ASSERT_LE(static_cast<std::int64_t>(d) * units[i], std::int64_t{1} << 24) << bits << " bits, d " << d;
        }
        std::vector<std::uint8_t> idx(static_cast<std::size_t>(d));
        for (int rep = 0; rep < 50; ++rep) {
          // Uniform codes, and codes at the extremes (the largest sums).
          for (auto& i : idx) i = static_cast<std::uint8_t>(rep % 2 ? rng() % sq.size() : (rng() % 2 ? 0 : sq.size() - 1 - rng() % 2));
          std::int64_t acc = 0;
          for (std::uint8_t i : idx) acc += units[i];
          const float want = static_cast<float>(std::ldexp(static_cast<double>(acc), e));
          ASSERT_EQ(std::ldexp(static_cast<double>(want), -e), static_cast<double>(acc)) << "the sum is a float";
          ASSERT_EQ(f32_bits(grid_square_sum(sq.data(), idx.data(), d)), f32_bits(want)) << bits << " bits, d " << d;
          std::vector<std::uint8_t> other = idx;
          std::reverse(other.begin(), other.end());
          EXPECT_EQ(f32_bits(grid_square_sum(sq.data(), other.data(), d)), f32_bits(want));
          std::shuffle(other.begin(), other.end(), rng);
          EXPECT_EQ(f32_bits(grid_square_sum(sq.data(), other.data(), d)), f32_bits(want));
        }
      }
    }
  // The earlier rules round differently on some rows, so the encoders' bit-for-bit checks tell the grid from them:
  // the float chains of kvq::sum_squares over the centroids (the rule until 2026-12-05) and the exact sum of the
  // squares rounded to float.
  const std::vector<float>& cent = sphere_codebook(128, 4).centroids_f;
  const std::vector<float> sq = grid_squares(cent, 128);
  int differ_chains = 0, differ_exact = 0;
  std::vector<std::uint8_t> idx(128);
  std::vector<float> terms(128);
  for (int rep = 0; rep < 2000; ++rep) {
    for (int k = 0; k < 128; ++k) idx[static_cast<std::size_t>(k)] = static_cast<std::uint8_t>(rng() % 16);
    double exact = 0;
    for (int k = 0; k < 128; ++k) {
      const float ck = cent[idx[static_cast<std::size_t>(k)]];
      terms[static_cast<std::size_t>(k)] = ck;
      exact += static_cast<double>(ck * ck);  // fl(c^2), added exactly in double (spans under 2^29)
    }
    const float grid = grid_square_sum(sq.data(), idx.data(), 128);
    differ_chains += f32_bits(sum_squares(terms.data(), 128)) != f32_bits(grid);
    differ_exact += f32_bits(static_cast<float>(exact)) != f32_bits(grid);
    EXPECT_LE(std::fabs(static_cast<double>(grid) - exact), 128 * std::ldexp(0.5, -21));
  }
  EXPECT_GT(differ_chains, 0);
  EXPECT_GT(differ_exact, 0);
}

TEST(TurboQuant, NormCorrectionRefusesCodebooksWithoutAGrid) {
  EXPECT_THROW(grid_squares({0.0f, 0.0f}, 64), Error);
  EXPECT_THROW(grid_squares({1.0f, std::numeric_limits<float>::infinity()}, 64), Error);
  EXPECT_THROW(grid_squares({1.0f, std::numeric_limits<float>::quiet_NaN()}, 64), Error);
  EXPECT_THROW(grid_squares({1.0f, -1.0f}, 0), Error);
  EXPECT_THROW(grid_squares({1.0f, -1.0f}, (1 << 16) + 1), Error);
  EXPECT_EQ(grid_squares({1.0f, -0.5f}, 1 << 16), (std::vector<float>{1.0f, 0.25f}));  // step 2^-8 there
  // A codebook whose terms span 2^40 (the exact double sum refused it): the small term rounds to the grid.
  const std::vector<float> wide = grid_squares({1.0f, 0x1p-20f}, 2);
  EXPECT_EQ(wide[0], 1.0f);
  EXPECT_EQ(wide[1], 0.0f);
  Codebook cb;
  cb.dim = 64;
  cb.bits = 1;
  cb.centroids = {0.0, 0.0};
  cb.edges = {0.0};
  cb.centroids_f = {0.0f, 0.0f};
  cb.edges_f = {0.5f};
  EXPECT_THROW(TurboQuantMse(64, 1, rht(64), true, &cb), Error);
  EXPECT_NO_THROW(TurboQuantMse(64, 1, rht(64), false, &cb));
}

// Rotated-domain scoring and value accumulation equal dequantize-then-compute (fp32, 1e-6
// normwise over a batch), on random and on real fixture keys.
TEST(TurboQuant, RotatedDomainEqualsDequantize) {
  const int d = 128;
  std::vector<std::unique_ptr<VectorQuantizer>> qs;
  qs.push_back(std::make_unique<TurboQuantMse>(d, 3, rht(d), true));
  qs.push_back(std::make_unique<TurboQuantMse>(d, 4, rht(d), false));
  qs.push_back(std::make_unique<TurboQuantMse>(d, 2, std::make_shared<HaarRotation>(d, 9), true));
  qs.push_back(std::make_unique<TurboQuantProd>(d, 3, rht(d), 11));
  std::vector<int> out;
  for (int i = 0; i < 32; ++i) out.push_back(i * 4 + 1);
  qs.push_back(std::make_unique<OutlierSplit>(d, out, 3, 2, true, 21, 22, true));
  const auto mu = gaussian(static_cast<std::size_t>(d), 12, 0.5f);
  qs.push_back(std::make_unique<TurboQuantMse>(d, 4, rht(d), true, nullptr, mu));
  qs.push_back(std::make_unique<OutlierSplit>(d, out, 4, 3, true, 23, 24, true, mu));
  const auto real = kvq::testing::fixture_rows("tiny-gqa", "layer1.k", 1, d);
  for (const auto& q : qs) {
    for (int source = 0; source < 2; ++source) {
      const std::size_t n = 256;
      const auto keys = source == 0 ? gaussian(n * d, 4) : std::vector<float>(real.begin(), real.begin() + static_cast<long>(n * d));
      const auto query = gaussian(static_cast<std::size_t>(d), 5);
      std::vector<std::uint8_t> recs(n * q->bytes());
      q->encode_batch(keys.data(), n, recs.data());
      std::vector<float> qp(static_cast<std::size_t>(q->query_dim()));
      q->prepare_query(query.data(), qp.data());
      std::vector<float> fast(n), ref(n), kh(static_cast<std::size_t>(d));
      std::vector<float> acc(static_cast<std::size_t>(q->acc_dim()), 0.0f), vfast(static_cast<std::size_t>(d));
      std::vector<double> vref_d(static_cast<std::size_t>(d), 0.0);
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint8_t* r = &recs[i * q->bytes()];
        fast[i] = q->score(qp.data(), r, r + q->code_bytes());
        q->decode_record(r, kh.data());
        double s = 0;
        for (int j = 0; j < d; ++j) s += static_cast<double>(query[static_cast<std::size_t>(j)]) * kh[static_cast<std::size_t>(j)];
        ref[i] = static_cast<float>(s);
        const float w = 1.0f / static_cast<float>(i + 1);
        q->accumulate(w, r, r + q->code_bytes(), acc.data());
        for (int j = 0; j < d; ++j) vref_d[static_cast<std::size_t>(j)] += static_cast<double>(w) * kh[static_cast<std::size_t>(j)];
      }
      q->finish(acc.data(), vfast.data());
      const std::vector<float> vref(vref_d.begin(), vref_d.end());
      EXPECT_LT(rel_error(fast.data(), ref.data(), n), 1e-6) << q->name() << " source " << source;
      // Values: an fp32 accumulation of 256 weighted rows against a double reference; its
      // rounding error is about sqrt(256) x 2^-24 ~ 1e-6, hence the bound.
      if (dynamic_cast<TurboQuantProd*>(q.get()) == nullptr) {
        EXPECT_LT(rel_error(vfast.data(), vref.data(), static_cast<std::size_t>(d)), 2e-6) << q->name();
      }
    }
  }
}

// The QJL residual estimator alone is unbiased: slope of <q, r^> against <q, r> is 1.
TEST(TurboQuant, QjlResidualUnbiasedAtTwoBits) {
  const int d = 128;
  TurboQuantProd q(d, 2, rht(d), 1234);
  // 16384 keys x 4 independent queries = 65536 pairs: the slope's sampling noise (about
  // 0.75 / sqrt(pairs)) stays well inside the +-0.02 tolerance.
  const std::size_t keys = 16384, per_key = 4;
  const auto x = gaussian(keys * d, 6);
  const auto qs = gaussian(keys * per_key * d, 7);
  std::vector<std::uint8_t> rec(q.bytes());
  std::vector<float> xh(d), rh(d);
  double num = 0, den = 0;
  for (std::size_t i = 0; i < keys; ++i) {
    const float* xi = &x[i * d];
    q.encode_record(xi, rec.data());
    q.mse().decode(rec.data(), rec.data() + q.code_bytes(), xh.data());
    q.decode_residual(rec.data(), rec.data() + q.code_bytes(), rh.data());
    for (std::size_t k = 0; k < per_key; ++k) {
      const float* qi = &qs[(i * per_key + k) * d];
      double t = 0, e = 0;
      for (int j = 0; j < d; ++j) {
        t += static_cast<double>(qi[j]) * (xi[j] - xh[static_cast<std::size_t>(j)]);
        e += static_cast<double>(qi[j]) * rh[static_cast<std::size_t>(j)];
      }
      num += e * t;
      den += t * t;
    }
  }
  EXPECT_NEAR(num / den, 1.0, 0.02);
}

// Chapter section 8 (tq_signs.py): on inputs near Walsh rows the plain Hadamard concentrates
// the energy and the codebook clips it; the sign diagonal keeps the error at the model.
TEST(TurboQuant, SignDiagonalProtectsWalshAlignedInputs) {
  const int d = 128;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  const std::size_t n = 2048;
  std::vector<float> x(n * d);
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned row = rng() % d;
    for (int j = 0; j < d; ++j)
      x[i * d + static_cast<std::size_t>(j)] = ((__builtin_popcount(row & static_cast<unsigned>(j)) & 1) ? -3.0f : 3.0f) + 0.3f * nd(rng);
  }
  TurboQuantMse plain(d, 3, std::make_shared<HadamardRotation>(d, false, 0), false);
  TurboQuantMse signed_(d, 3, rht(d, 4), false);
  const double e_plain = mean_rel_mse(plain, x, n), e_signed = mean_rel_mse(signed_, x, n);
  EXPECT_LE(e_signed, 0.04);
  EXPECT_GT(e_plain, 0.3);
}

TEST(TurboQuant, OutlierSplitBitsAndQuality) {
  const int d = 128;
  std::vector<int> out;
  for (int i = 0; i < 32; ++i) out.push_back(i);
  OutlierSplit q(d, out, 3, 2, true, 1, 2, true);
  // The chapter's example: 32 channels x 3 bits + 96 x 2 bits = 288 bits = 2.25 bits/channel.
  EXPECT_DOUBLE_EQ(q.code_bits(), 2.25);
  EXPECT_EQ(q.code_bytes(), 12u + 24u);
  EXPECT_EQ(q.meta_bytes(), 4u);
  // Keys with hot channels 0..31: the split beats uniform 2-bit and loses to uniform 3-bit.
  std::vector<float> x = gaussian(4096 * d, 8);
  for (std::size_t i = 0; i < 4096; ++i)
    for (int j = 0; j < 32; ++j) x[i * d + static_cast<std::size_t>(j)] *= 6.0f;
  TurboQuantMse b2(d, 2, rht(d), true), b3(d, 3, rht(d), true);
  const double e_split = mean_rel_mse(q, x, 4096), e2 = mean_rel_mse(b2, x, 4096), e3 = mean_rel_mse(b3, x, 4096);
  EXPECT_LT(e_split, e2);
  EXPECT_GT(e_split, e3);
  EXPECT_THROW(OutlierSplit(d, {5, 3, 9}, 3, 2, true, 1, 2, true), Error);
}

// outlier_split_order on halves of 64 / 128 / 256 channels: each instance gets its channel set, and the channels that
// the GPU store's lanes gather in one load (element k of every 32-element lane column of both instances) have
// distinct split_bank_class (tests/cuda/test_bins.cu checks the classes against the kernel's staged-row layout).
// Ascending order, on the same sets, repeats classes (so the check can fail). Other splits stay ascending, and
// OutlierSplit takes the order (its encode then reads x in that order: a permuted hi set changes the codes).
TEST(TurboQuant, OutlierSplitOrderSpreadsBankClasses) {
  std::mt19937 rng(7);
  for (int d : {64, 128, 256}) {
    std::vector<int> all(static_cast<std::size_t>(d));
    for (int c = 0; c < d; ++c) all[static_cast<std::size_t>(c)] = c;
    int ascending_repeats = 0;
    for (int t = 0; t < 300; ++t) {
      std::vector<int> out;
      if (t == 0) {
        for (int c = 0; c < d / 2; ++c) out.push_back(c);
      } else if (t == 1) {
        for (int c = 0; c < d; ++c)
          if ((c & 7) < 4) out.push_back(c);  // two classes only
      } else {
        std::shuffle(all.begin(), all.end(), rng);
        out.assign(all.begin(), all.begin() + d / 2);
        std::sort(out.begin(), out.end());
      }
      const auto [hi, lo] = outlier_split_order(d, out);
      std::vector<int> hs = hi, ls = lo, rest;
      std::sort(hs.begin(), hs.end());
      std::sort(ls.begin(), ls.end());
      for (int c = 0; c < d; ++c)
        if (!std::binary_search(out.begin(), out.end(), c)) rest.push_back(c);
      ASSERT_EQ(hs, out) << "d " << d << " set " << t;
      ASSERT_EQ(ls, rest) << "d " << d << " set " << t;
      const int cols = d / 64;
      for (int k = 0; k < 32; ++k) {
        std::vector<int> cls, asc;
        for (int j = 0; j < cols; ++j) {
          cls.push_back(split_bank_class(d, hi[static_cast<std::size_t>(32 * j + k)]));
          cls.push_back(split_bank_class(d, lo[static_cast<std::size_t>(32 * j + k)]));
          asc.push_back(split_bank_class(d, out[static_cast<std::size_t>(32 * j + k)]));
          asc.push_back(split_bank_class(d, rest[static_cast<std::size_t>(32 * j + k)]));
        }
        std::sort(cls.begin(), cls.end());
        std::sort(asc.begin(), asc.end());
        EXPECT_TRUE(std::adjacent_find(cls.begin(), cls.end()) == cls.end()) << "d " << d << " set " << t << " k " << k;
        if (std::adjacent_find(asc.begin(), asc.end()) != asc.end()) ++ascending_repeats;
      }
    }
    EXPECT_GT(ascending_repeats, 0) << "d " << d;
  }
  const std::vector<int> odd = {1, 5, 7, 40, 41, 90};
  const auto [h96, l96] = outlier_split_order(96, odd);
  EXPECT_EQ(h96, odd);
  EXPECT_TRUE(std::is_sorted(l96.begin(), l96.end()));
  EXPECT_EQ(l96.size(), 90u);
  const auto [h7, l7] = outlier_split_order(128, {3, 4, 9, 20, 70, 71, 99});
  EXPECT_TRUE(std::is_sorted(h7.begin(), h7.end()) && std::is_sorted(l7.begin(), l7.end()));
  EXPECT_EQ(split_bank_class(96, 3), -1);
  std::vector<int> out;
  for (int c = 0; c < 128; c += 2) out.push_back(c);
  const OutlierSplit q(128, out, 4, 3, true, 1, 2, true);
  const auto [hi, lo] = outlier_split_order(128, out);
  EXPECT_EQ(q.hi_order(), hi);
  EXPECT_EQ(q.lo_order(), lo);
  EXPECT_EQ(q.outliers(), out);
  EXPECT_NE(hi, out);  // not ascending: the order is in use
  EXPECT_THROW(outlier_split_order(128, {3, 3}), Error);
  EXPECT_THROW(outlier_split_order(128, {128}), Error);
}

TEST(TurboQuant, ZeroVectorAndNonFinite) {
  const int d = 96;  // block-diagonal Hadamard 64 + 32
  TurboQuantMse q(d, 3, rht(d), true);
  std::vector<float> z(d, 0.0f), y(d, 1.0f);
  std::vector<std::uint8_t> rec(q.bytes());
  q.encode_record(z.data(), rec.data());
  q.decode_record(rec.data(), y.data());
  for (float v : y) EXPECT_EQ(v, 0.0f);
  z[5] = NAN;
  EXPECT_THROW(q.encode_record(z.data(), rec.data()), Error);
  z[5] = INFINITY;
  EXPECT_THROW(q.encode_record(z.data(), rec.data()), Error);
  z[5] = 1e6f;  // norm beyond fp16
  EXPECT_THROW(q.encode_record(z.data(), rec.data()), Error);
}

// Centering: a fixed offset is removed before quantization and restored on decode; on keys
// with a common offset the error drops, and attention scores shift by q . mu only.
TEST(TurboQuant, CenteringRemovesCommonOffset) {
  const int d = 128;
  const std::size_t n = 4096;
  auto x = gaussian(n * d, 30);
  const auto mu = gaussian(static_cast<std::size_t>(d), 31, 1.5f);
  for (std::size_t i = 0; i < n; ++i)
    for (int j = 0; j < d; ++j) x[i * d + static_cast<std::size_t>(j)] += mu[static_cast<std::size_t>(j)];
  TurboQuantMse plain(d, 3, rht(d), true), centered(d, 3, rht(d), true, nullptr, mu);
  const double ep = mean_rel_mse(plain, x, n), ec = mean_rel_mse(centered, x, n);
  EXPECT_LT(ec, 0.6 * ep);
  std::vector<float> z(static_cast<std::size_t>(d), 0.0f), y(static_cast<std::size_t>(d));
  std::vector<std::uint8_t> rec(centered.bytes());
  centered.encode_record(mu.data(), rec.data());  // x = mu: residual zero, decodes to mu exactly
  centered.decode_record(rec.data(), y.data());
  for (int j = 0; j < d; ++j) EXPECT_EQ(y[static_cast<std::size_t>(j)], mu[static_cast<std::size_t>(j)]);
  EXPECT_THROW(TurboQuantMse(d, 3, rht(d), true, nullptr, std::vector<float>(5, 0.0f)), Error);
}

// prescale_threshold: bucketizing the unscaled FWHT output against the thresholds gives the
// cell of fl(v * scale) against the midpoints, for every sphere codebook the GPU store kernel
// uses (block 64, 128, 256 at 1..4 bits; scale 1 / sqrt(block), as the FWHT applies it last),
// at and around every threshold (+-8 ulps), on random values, at zero and on denormals.
TEST(Bucketize, PrescaleThresholdsMatchScaledCells) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::size_t checked = 0;
  for (int block : {64, 128, 256}) {
    const float sc = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
    for (int bits = 1; bits <= 4; ++bits) {
      const Codebook& cb = sphere_codebook(block, bits);
      const int ne = static_cast<int>(cb.edges_f.size());
      std::vector<float> th(cb.edges_f.size());
      for (int i = 0; i < ne; ++i) {
        const float e = cb.edges_f[static_cast<std::size_t>(i)];
        th[static_cast<std::size_t>(i)] = prescale_threshold(e, sc);
        const float t = th[static_cast<std::size_t>(i)];
        ASSERT_LE(t * sc, e) << block << " " << bits << " edge " << i;
        ASSERT_GT(std::nextafter(t, INFINITY) * sc, e) << block << " " << bits << " edge " << i;
      }
      std::vector<float> probes = {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(),
                                   -std::numeric_limits<float>::denorm_min(), 1e-40f, -1e-40f, 1e30f, -1e30f};
      for (float t : th) {
        float lo = t, hi = t;
        for (int k = 0; k < 8; ++k) {
          lo = std::nextafter(lo, -INFINITY);
          hi = std::nextafter(hi, INFINITY);
          probes.push_back(lo);
          probes.push_back(hi);
        }
        probes.push_back(t);
      }
      for (int k = 0; k < 20000; ++k) probes.push_back(nd(rng) * 3.0f);
      for (float v : probes) {
        ASSERT_EQ(bucketize(th.data(), ne, v), bucketize(cb.edges_f.data(), ne, v * sc))
            << "block " << block << " bits " << bits << " v " << v;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 12u * 20000u);
  EXPECT_EQ(prescale_threshold(INFINITY, 0.125f), INFINITY);
  EXPECT_EQ(prescale_threshold(0.5f, 0.125f), 4.0f);  // an exact power-of-two scale
  EXPECT_THROW(prescale_threshold(NAN, 0.125f), std::exception);
  EXPECT_THROW(prescale_threshold(1.0f, 0.0f), std::exception);
}
