// kvq/codebook.hpp: Lloyd-Max codebooks for one coordinate of a uniform unit vector in R^d.
//
// That coordinate has density f(x) = (1 - x^2)^((d-3)/2) / B(1/2, (d-1)/2) on [-1, 1]
// (TurboQuant chapter, section 2). Its CDF is an incomplete beta function and its first moment
// has a closed form, so cell masses and conditional means are computed exactly (no grid). The
// optimality conditions (centroid = conditional mean of its cell, edge = midpoint of adjacent
// centroids) are solved by Lloyd iterations followed by Newton's method on the tridiagonal
// Jacobian until the residual is at rounding level; the chapter's 300 grid iterations stop short
// of convergence at b >= 6. Results are cached per (d, b).
#pragma once

#include <vector>

namespace kvq {

struct Codebook {
  int dim = 0;
  int bits = 0;
  std::vector<double> centroids;  // 2^bits values, ascending
  std::vector<double> edges;      // 2^bits - 1 midpoints between adjacent centroids
  std::vector<float> centroids_f, edges_f;
  double mse = 0;          // D_mse = E||u - Q(u)||^2 for a unit vector u (= d * per-coordinate MSE)
  double residual = 0;     // max_i |c_i - E[x | cell i]| at the solution
  int iterations = 0;      // Lloyd + Newton steps taken
};

// The cached codebook for dimension d >= 3 and 1 <= bits <= 8. Thread-safe.
const Codebook& sphere_codebook(int d, int bits);

// Lloyd-Max codebook for N(0, 1/d), the Gaussian approximation of the sphere coordinate that
// vLLM's TurboQuant presets use (solved exactly with erf, not on a grid). `mse` is again
// E||u - Q(u)||^2 under the Gaussian model. Cached, thread-safe.
const Codebook& gaussian_codebook(int d, int bits);

// Density of one coordinate of a uniform point on S^{d-1}, its CDF, and the two bounds of the
// TurboQuant paper: D_mse >= 4^-b and D_mse <= sqrt(3) pi / 2 * 4^-b.
double sphere_coord_pdf(int d, double x);
double sphere_coord_cdf(int d, double x);
double regularized_incomplete_beta(double a, double b, double x);
double dmse_lower_bound(int bits);
double dmse_upper_bound(int bits);

}  // namespace kvq
