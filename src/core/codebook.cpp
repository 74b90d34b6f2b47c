// Lloyd-Max codebooks for the sphere-coordinate density (TurboQuant chapter, sections 2-4).
//
// With alpha = (d-3)/2 and Z = B(1/2, alpha+1):
//   upper tail   U(x) = int_x^1 f = I_{1-x^2}(alpha+1, 1/2) / 2            (x >= 0)
//   first moment int_a^b x f = [(1-a^2)^(alpha+1) - (1-b^2)^(alpha+1)] / (2 (alpha+1) Z)
// so every cell's mass and conditional mean are exact up to rounding. The fixed point
// c_i = E[x | t_{i-1} < x < t_i], t_i = (c_i + c_{i+1}) / 2 is reached by a few hundred Lloyd
// steps and then Newton's method on G(c) = c - M(t(c)), whose Jacobian is tridiagonal with
//   dM_i/dt_i = f(t_i) (t_i - M_i) / P_i,   dM_i/dt_{i-1} = f(t_{i-1}) (M_i - t_{i-1}) / P_i.
// D_mse = E||u - Q(u)||^2 = 1 - d * sum_i P_i c_i^2 (E[x^2] = 1/d and the centroids are
// conditional means).
#include "kvq/codebook.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "kvq/common.hpp"

namespace kvq {

namespace {

// Continued fraction for the incomplete beta function (modified Lentz).
double betacf(double a, double b, double x) {
  constexpr double kTiny = 1e-300;
  const double qab = a + b, qap = a + 1.0, qam = a - 1.0;
  double c = 1.0, d = 1.0 - qab * x / qap;
  if (std::fabs(d) < kTiny) d = kTiny;
  d = 1.0 / d;
  double h = d;
  for (int m = 1; m <= 10000; ++m) {
    const double m2 = 2.0 * m;
    double aa = m * (b - m) * x / ((qam + m2) * (a + m2));
    d = 1.0 + aa * d;
    if (std::fabs(d) < kTiny) d = kTiny;
    c = 1.0 + aa / c;
    if (std::fabs(c) < kTiny) c = kTiny;
    d = 1.0 / d;
    h *= d * c;
    aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
    d = 1.0 + aa * d;
    if (std::fabs(d) < kTiny) d = kTiny;
    c = 1.0 + aa / c;
    if (std::fabs(c) < kTiny) c = kTiny;
    d = 1.0 / d;
    const double del = d * c;
    h *= del;
    if (std::fabs(del - 1.0) < 1e-16) return h;
  }
  return h;  // converged to double precision in practice for the parameters used here
}

struct Density {
  int d;
  double alpha;  // (d - 3) / 2
  double log_z;  // log B(1/2, alpha + 1)
  double lo = -1.0, hi = 1.0;  // support
  explicit Density(int dim) : d(dim), alpha((dim - 3) / 2.0) {
    log_z = std::lgamma(0.5) + std::lgamma(alpha + 1.0) - std::lgamma(alpha + 1.5);
  }
  double pdf(double x) const {
    if (x <= -1.0 || x >= 1.0) return (alpha == 0.0 && std::fabs(x) <= 1.0) ? std::exp(-log_z) : 0.0;
    return std::exp(alpha * std::log1p(-x * x) - log_z);
  }
  // Upper tail mass from |x| (x >= 0) to 1.
  double upper(double x) const {
    if (x <= 0.0) return 0.5;
    if (x >= 1.0) return 0.0;
    return 0.5 * regularized_incomplete_beta(alpha + 1.0, 0.5, (1.0 - x) * (1.0 + x));
  }
  double cdf(double x) const { return x >= 0 ? 1.0 - upper(x) : upper(-x); }
  // Mass of [a, b], computed without cancellation in the tails.
  double mass(double a, double b) const {
    if (a >= 0) return upper(a) - upper(b);
    if (b <= 0) return upper(-b) - upper(-a);
    return 1.0 - upper(-a) - upper(b);
  }
  // int_a^b x f(x) dx.
  double moment1(double a, double b) const {
    const double p = alpha + 1.0;
    auto lg = [&](double x) { return (x <= -1.0 || x >= 1.0) ? -INFINITY : p * std::log1p(-x * x); };
    const double la = lg(a), lb = lg(b);
    // e^la - e^lb = e^lb * expm1(la - lb) (or the mirror), scaled by 1 / (2 p Z).
    double diff;
    if (la == -INFINITY && lb == -INFINITY) return 0.0;
    if (la >= lb) {
      diff = (lb == -INFINITY) ? std::exp(la) : std::exp(lb) * std::expm1(la - lb);
    } else {
      diff = (la == -INFINITY) ? -std::exp(lb) : -std::exp(la) * std::expm1(lb - la);
    }
    return diff * std::exp(-log_z) / (2.0 * p);
  }
};

// N(0, 1/d) with the same interface as Density (support clipped far in the tails).
struct Gauss {
  int d;
  double sigma;
  double lo = -INFINITY, hi = INFINITY;
  explicit Gauss(int dim) : d(dim), sigma(1.0 / std::sqrt(static_cast<double>(dim))) {}
  double pdf(double x) const {
    if (std::isinf(x)) return 0.0;
    const double z = x / sigma;
    return std::exp(-0.5 * z * z) / (sigma * std::sqrt(2.0 * M_PI));
  }
  double upper(double x) const { return 0.5 * std::erfc(x / (sigma * std::sqrt(2.0))); }
  double cdf(double x) const { return x >= 0 ? 1.0 - upper(x) : upper(-x); }
  double mass(double a, double b) const {
    if (a >= 0) return upper(a) - upper(b);
    if (b <= 0) return upper(-b) - upper(-a);
    return 1.0 - upper(-a) - upper(b);
  }
  double moment1(double a, double b) const { return sigma * sigma * (pdf(a) - pdf(b)); }
};

struct Cells {
  std::vector<double> mass, mean;
};

template <typename F>
Cells cell_stats(const F& f, const std::vector<double>& c) {
  const std::size_t k = c.size();
  Cells s{std::vector<double>(k), std::vector<double>(k)};
  for (std::size_t i = 0; i < k; ++i) {
    const double a = i == 0 ? f.lo : 0.5 * (c[i - 1] + c[i]);
    const double b = i + 1 == k ? f.hi : 0.5 * (c[i] + c[i + 1]);
    s.mass[i] = f.mass(a, b);
    s.mean[i] = s.mass[i] > 0 ? f.moment1(a, b) / s.mass[i] : 0.5 * (a + b);
  }
  return s;
}

double max_residual(const std::vector<double>& c, const Cells& s) {
  double r = 0;
  for (std::size_t i = 0; i < c.size(); ++i) r = std::max(r, std::fabs(c[i] - s.mean[i]));
  return r;
}

template <typename F>
Codebook solve(const F& f, int d, int bits) {
  const std::size_t k = std::size_t{1} << bits;
  // Start at equal-mass quantiles (bisection on the CDF), symmetric by construction.
  std::vector<double> c(k);
  for (std::size_t i = 0; i < k; ++i) {
    const double target = (static_cast<double>(i) + 0.5) / static_cast<double>(k);
    const double span = std::isinf(f.hi) ? 40.0 / std::sqrt(static_cast<double>(d)) : 1.0;
    double lo = -span, hi = span;
    for (int it = 0; it < 200; ++it) {
      const double mid = 0.5 * (lo + hi);
      (f.cdf(mid) < target ? lo : hi) = mid;
    }
    c[i] = 0.5 * (lo + hi);
  }
  int iters = 0;
  Cells s = cell_stats(f, c);
  for (int it = 0; it < 300; ++it, ++iters) {
    c = s.mean;
    s = cell_stats(f, c);
  }
  // Newton with backtracking on max |G|.
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double res = max_residual(c, s);
  for (int it = 0; it < 200 && res > 1e-15 * scale; ++it, ++iters) {
    std::vector<double> t(k + 1);
    t[0] = f.lo;
    t[k] = f.hi;
    for (std::size_t i = 1; i < k; ++i) t[i] = 0.5 * (c[i - 1] + c[i]);
    std::vector<double> lo(k, 0.0), di(k, 1.0), up(k, 0.0), rhs(k);
    for (std::size_t i = 0; i < k; ++i) {
      const double p = s.mass[i], m = s.mean[i];
      const double dm_dt_hi = (i + 1 < k) ? f.pdf(t[i + 1]) * (t[i + 1] - m) / p : 0.0;
      const double dm_dt_lo = (i > 0) ? f.pdf(t[i]) * (m - t[i]) / p : 0.0;
      di[i] = 1.0 - 0.5 * (dm_dt_hi + dm_dt_lo);
      if (i + 1 < k) up[i] = -0.5 * dm_dt_hi;
      if (i > 0) lo[i] = -0.5 * dm_dt_lo;
      rhs[i] = -(c[i] - m);
    }
    // Thomas algorithm.
    for (std::size_t i = 1; i < k; ++i) {
      const double w = lo[i] / di[i - 1];
      di[i] -= w * up[i - 1];
      rhs[i] -= w * rhs[i - 1];
    }
    std::vector<double> step(k);
    step[k - 1] = rhs[k - 1] / di[k - 1];
    for (std::size_t i = k - 1; i-- > 0;) step[i] = (rhs[i] - up[i] * step[i + 1]) / di[i];
    double lambda = 1.0;
    bool improved = false;
    for (int ls = 0; ls < 30; ++ls, lambda *= 0.5) {
      std::vector<double> cn(k);
      bool sorted = true;
      for (std::size_t i = 0; i < k; ++i) cn[i] = c[i] + lambda * step[i];
      for (std::size_t i = 1; i < k; ++i) sorted = sorted && cn[i] > cn[i - 1];
      if (!sorted || cn[0] <= f.lo || cn[k - 1] >= f.hi) continue;
      Cells sn = cell_stats(f, cn);
      const double rn = max_residual(cn, sn);
      if (rn < res) {
        c = std::move(cn);
        s = std::move(sn);
        res = rn;
        improved = true;
        break;
      }
    }
    if (!improved) break;  // at rounding level
  }
  // Symmetrize (the density is even; this removes the last rounding asymmetry).
  for (std::size_t i = 0; i < k / 2; ++i) {
    const double v = 0.5 * (c[k - 1 - i] - c[i]);
    c[i] = -v;
    c[k - 1 - i] = v;
  }
  s = cell_stats(f, c);
  Codebook cb;
  cb.dim = d;
  cb.bits = bits;
  cb.centroids = c;
  cb.edges.resize(k - 1);
  for (std::size_t i = 0; i + 1 < k; ++i) cb.edges[i] = 0.5 * (c[i] + c[i + 1]);
  double acc = 0;
  for (std::size_t i = 0; i < k; ++i) acc += s.mass[i] * c[i] * c[i];
  cb.mse = 1.0 - static_cast<double>(d) * acc;
  cb.residual = max_residual(c, s);
  cb.iterations = iters;
  cb.centroids_f.assign(c.begin(), c.end());
  cb.edges_f.assign(cb.edges.begin(), cb.edges.end());
  return cb;
}

}  // namespace

double regularized_incomplete_beta(double a, double b, double x) {
  if (x <= 0.0) return 0.0;
  if (x >= 1.0) return 1.0;
  const double lbt = std::lgamma(a + b) - std::lgamma(a) - std::lgamma(b) + a * std::log(x) + b * std::log1p(-x);
  const double bt = std::exp(lbt);
  if (x < (a + 1.0) / (a + b + 2.0)) return bt * betacf(a, b, x) / a;
  return 1.0 - bt * betacf(b, a, 1.0 - x) / b;
}

double sphere_coord_pdf(int d, double x) { return Density(d).pdf(x); }
double sphere_coord_cdf(int d, double x) { return Density(d).cdf(x); }
double dmse_lower_bound(int bits) { return std::pow(4.0, -bits); }
double dmse_upper_bound(int bits) { return std::sqrt(3.0) * M_PI / 2.0 * std::pow(4.0, -bits); }

const Codebook& sphere_codebook(int d, int bits) {
  if (d < 3) fail("sphere_codebook: dimension must be >= 3, got " + std::to_string(d));
  if (bits < 1 || bits > 8) fail("sphere_codebook: bits must be 1..8, got " + std::to_string(bits));
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::unique_ptr<Codebook>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[{d, bits}];
  if (!slot) slot = std::make_unique<Codebook>(solve(Density(d), d, bits));
  return *slot;
}

const Codebook& gaussian_codebook(int d, int bits) {
  if (d < 1) fail("gaussian_codebook: dimension must be >= 1, got " + std::to_string(d));
  if (bits < 1 || bits > 8) fail("gaussian_codebook: bits must be 1..8, got " + std::to_string(bits));
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::unique_ptr<Codebook>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[{d, bits}];
  if (!slot) slot = std::make_unique<Codebook>(solve(Gauss(d), d, bits));
  return *slot;
}

}  // namespace kvq
