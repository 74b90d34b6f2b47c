// Rotations: the FWHT equals the dense Sylvester matrix built independently, every rotation is
// orthogonal (norm preserved, inverse exact), block-diagonal Hadamard covers 96, 192, 576,
// and seeds are deterministic and distinct per (layer, head).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kvq/rng.hpp"
#include "kvq/rotation.hpp"
#include "kvq/common.hpp"

using namespace kvq;

namespace {
std::vector<float> randn(int d, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<std::size_t>(d));
  for (auto& v : x) v = nd(rng);
  return x;
}
double norm(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s);
}
}  // namespace

TEST(Rotation, FwhtEqualsDenseSylvester) {
  for (int n : {1, 2, 8, 64, 128, 256}) {
    auto x = randn(n, 3);
    std::vector<double> xd(x.begin(), x.end());
    fwht(xd.data(), n);
    for (int i = 0; i < n; ++i) {
      double s = 0;
      for (int j = 0; j < n; ++j) s += ((__builtin_popcount(static_cast<unsigned>(i & j)) & 1) ? -1.0 : 1.0) * x[static_cast<std::size_t>(j)];
      ASSERT_NEAR(xd[static_cast<std::size_t>(i)], s / std::sqrt(static_cast<double>(n)), 1e-9);
    }
  }
  std::vector<float> bad(96);
  EXPECT_THROW(fwht(bad.data(), 96), Error);
}

TEST(Rotation, OrthogonalAndInvertible) {
  for (int d : {64, 96, 128, 192, 256, 512, 576}) {
    for (auto kind : {RotationKind::kHadamard, RotationKind::kRandomizedHadamard, RotationKind::kHaar}) {
      if (kind == RotationKind::kHaar && d > 256) continue;
      auto r = make_rotation(kind, d, mix_seed(1, 2, 3));
      auto x = randn(d, 5);
      std::vector<float> y(x.size()), z(x.size());
      r->forward(x.data(), y.data());
      r->inverse(y.data(), z.data());
      EXPECT_NEAR(norm(y), norm(x), 1e-5 * norm(x)) << r->describe();
      for (int i = 0; i < d; ++i) ASSERT_NEAR(z[static_cast<std::size_t>(i)], x[static_cast<std::size_t>(i)], 1e-5);
      // Orthogonality: <Pi a, Pi b> = <a, b>.
      auto a = randn(d, 11), b = randn(d, 12);
      std::vector<float> ra(a.size()), rb(b.size());
      r->forward(a.data(), ra.data());
      r->forward(b.data(), rb.data());
      double d0 = 0, d1 = 0;
      for (int i = 0; i < d; ++i) {
        d0 += static_cast<double>(a[static_cast<std::size_t>(i)]) * b[static_cast<std::size_t>(i)];
        d1 += static_cast<double>(ra[static_cast<std::size_t>(i)]) * rb[static_cast<std::size_t>(i)];
      }
      EXPECT_NEAR(d0, d1, 1e-4 * d);
    }
  }
}

TEST(Rotation, BlockSizes) {
  EXPECT_EQ(hadamard_blocks(96), (std::vector<int>{64, 32}));
  EXPECT_EQ(hadamard_blocks(192), (std::vector<int>{128, 64}));
  EXPECT_EQ(hadamard_blocks(576), (std::vector<int>{512, 64}));
  EXPECT_EQ(hadamard_blocks(128), (std::vector<int>{128}));
}

TEST(Rotation, SeedsDeterministicAndDistinct) {
  HadamardRotation a(128, true, mix_seed(42, 0, 0, kStreamSigns));
  HadamardRotation b(128, true, mix_seed(42, 0, 0, kStreamSigns));
  HadamardRotation c(128, true, mix_seed(42, 1, 0, kStreamSigns));
  HadamardRotation e(128, true, mix_seed(42, 0, 1, kStreamSigns));
  EXPECT_EQ(a.signs(), b.signs());
  EXPECT_NE(a.signs(), c.signs());
  EXPECT_NE(a.signs(), e.signs());
  int plus = 0;
  for (float s : a.signs()) plus += s > 0;
  EXPECT_GT(plus, 40);
  EXPECT_LT(plus, 88);
  // The first value of the stream is fixed forever (format version 1).
  std::uint64_t st = 0;
  EXPECT_EQ(splitmix64_next(st), 0xe220a8397b1dcdafull);
}

TEST(Rotation, HaarIsOrthogonalMatrix) {
  HaarRotation h(64, 99);
  const auto& q = h.matrix();
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j) {
      double s = 0;
      for (int k = 0; k < 64; ++k) s += q[static_cast<std::size_t>(i * 64 + k)] * q[static_cast<std::size_t>(j * 64 + k)];
      ASSERT_NEAR(s, i == j ? 1.0 : 0.0, 1e-12);
    }
}
