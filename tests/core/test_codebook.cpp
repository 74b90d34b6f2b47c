// Lloyd-Max codebooks: the chapter's D_mse values, the optimality conditions checked by an
// independent quadrature of the density (centroids are conditional means, edges are
// midpoints), the paper's bounds, and the exact 1-bit centroid.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kvq/codebook.hpp"
#include "kvq/common.hpp"

using namespace kvq;

namespace {
// Composite 8-point Gauss-Legendre on [a, b] with `panels` panels (independent of the
// incomplete-beta and closed-form moments the solver uses).
template <typename F>
double integrate(F f, double a, double b, int panels = 400) {
  static const double x[8] = {-0.9602898564975363, -0.7966664774136267, -0.5255324099163290, -0.1834346424956498,
                              0.1834346424956498,  0.5255324099163290,  0.7966664774136267,  0.9602898564975363};
  static const double w[8] = {0.1012285362903763, 0.2223810344533745, 0.3137066458778873, 0.3626837833783620,
                              0.3626837833783620, 0.3137066458778873, 0.2223810344533745, 0.1012285362903763};
  double s = 0;
  const double h = (b - a) / panels;
  for (int p = 0; p < panels; ++p) {
    const double lo = a + p * h, mid = lo + 0.5 * h;
    for (int i = 0; i < 8; ++i) s += w[i] * f(mid + 0.5 * h * x[i]);
  }
  return s * 0.5 * h;
}
}  // namespace

TEST(Codebook, ChapterDistortionAtD128) {
  const double paper[5] = {0, 0.3609, 0.1160, 0.0340, 0.0093};
  for (int b = 1; b <= 4; ++b) {
    const auto& cb = sphere_codebook(128, b);
    EXPECT_NEAR(cb.mse, paper[b], 0.01 * paper[b]) << "bits " << b;
  }
  // The chapter's printed 2-bit centroids x sqrt(d): +-0.452, +-1.505.
  const auto& c2 = sphere_codebook(128, 2);
  EXPECT_NEAR(c2.centroids[2] * std::sqrt(128.0), 0.452, 1e-3);
  EXPECT_NEAR(c2.centroids[3] * std::sqrt(128.0), 1.505, 1e-3);
}

TEST(Codebook, OptimalityConditionsAndBounds) {
  for (int d : {32, 64, 96, 128, 512}) {
    const double sd = 1.0 / std::sqrt(static_cast<double>(d));
    for (int b = 1; b <= 8; ++b) {
      const auto& cb = sphere_codebook(d, b);
      const std::size_t k = cb.centroids.size();
      ASSERT_EQ(k, std::size_t{1} << b);
      ASSERT_EQ(cb.edges.size(), k - 1);
      double total_mass = 0, mse = 0;
      for (std::size_t i = 0; i < k; ++i) {
        if (i + 1 < k) {
          ASSERT_LT(cb.centroids[i], cb.centroids[i + 1]);
          ASSERT_DOUBLE_EQ(cb.edges[i], 0.5 * (cb.centroids[i] + cb.centroids[i + 1]));
        }
        // Cells far in the tail carry no measurable mass; integrate over the bulk +-12 sd.
        const double a = std::max(i == 0 ? -1.0 : cb.edges[i - 1], -12 * sd);
        const double e = std::min(i + 1 == k ? 1.0 : cb.edges[i], 12 * sd);
        if (a >= e) continue;
        const double m0 = integrate([&](double x) { return sphere_coord_pdf(d, x); }, a, e);
        const double m1 = integrate([&](double x) { return x * sphere_coord_pdf(d, x); }, a, e);
        const double m2 = integrate([&](double x) { return (x - cb.centroids[i]) * (x - cb.centroids[i]) * sphere_coord_pdf(d, x); }, a, e);
        total_mass += m0;
        mse += m2;
        if (m0 > 1e-12) {
          ASSERT_NEAR(cb.centroids[i], m1 / m0, 1e-7 * sd) << "d=" << d << " b=" << b << " cell " << i;
        }
      }
      EXPECT_NEAR(total_mass, 1.0, 1e-9);
      EXPECT_NEAR(cb.mse, d * mse, 1e-6 * cb.mse + 1e-12) << "d=" << d << " b=" << b;
      EXPECT_LE(cb.mse, dmse_upper_bound(b)) << "d=" << d << " b=" << b;
      EXPECT_GE(cb.mse, dmse_lower_bound(b)) << "d=" << d << " b=" << b;
      EXPECT_LT(cb.residual, 1e-12 * sd * 100);
    }
  }
}

TEST(Codebook, OneBitCentroidClosedForm) {
  for (int d : {3, 4, 5, 16, 32, 64, 96, 128, 512, 576}) {
    const double exact = std::exp(std::lgamma(d / 2.0) - std::lgamma((d + 1) / 2.0)) / std::sqrt(M_PI);
    const auto& cb = sphere_codebook(d, 1);
    EXPECT_NEAR(cb.centroids[1], exact, 1e-4 * exact) << d;
    EXPECT_NEAR(cb.centroids[0], -exact, 1e-4 * exact) << d;
  }
}

TEST(Codebook, GaussianVariantMatchesClassicLloydMax) {
  // Max (1960) / Lloyd: unit-variance Gaussian MSE 0.3634, 0.1175, 0.03454, 0.009497.
  const double classic[5] = {0, 0.3634, 0.1175, 0.03454, 0.009497};
  for (int b = 1; b <= 4; ++b) EXPECT_NEAR(gaussian_codebook(128, b).mse, classic[b], 2e-4 * 10 * classic[b]);
  EXPECT_NEAR(gaussian_codebook(128, 1).centroids[1] * std::sqrt(128.0), std::sqrt(2.0 / M_PI), 1e-9);
}

TEST(Codebook, CachedAndValidated) {
  EXPECT_EQ(&sphere_codebook(128, 3), &sphere_codebook(128, 3));
  EXPECT_THROW(sphere_codebook(2, 3), Error);
  EXPECT_THROW(sphere_codebook(128, 0), Error);
  EXPECT_THROW(sphere_codebook(128, 9), Error);
}
