// Block-level Jacobian primitives of the MLA sensitivity analysis (kvq/analysis.hpp): path JVPs
// and VJPs through MlaBlock, the column-by-column Jacobian (tests), Hutchinson trace and
// diagonal estimates of H_b = J_b^T J_b, the exact gain decomposition G = T A (1 + O) (QuantMLA
// section 2, appendix B.2), and the statistics the drivers report.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvq/analysis.hpp"
#include "kvq/common.hpp"
#include "kvq/rng.hpp"

namespace kvq {

const char* cache_path_name(CachePath p) { return p == CachePath::kContent ? "content" : "rope"; }

int path_size(const MlaDims& d, CachePath p) { return d.T * (p == CachePath::kContent ? d.dc : d.dr); }

template <class R>
void path_jvp(MlaBlock<R>& blk, CachePath p, const R* v, R* jv) {
  blk.jvp(p == CachePath::kContent ? v : nullptr, p == CachePath::kRope ? v : nullptr, jv);
}

template <class R>
void path_vjp(MlaBlock<R>& blk, CachePath p, const R* u, R* ju) {
  const MlaDims& d = blk.dims();
  std::vector<R> dc(static_cast<std::size_t>(d.T) * d.dc), dr(static_cast<std::size_t>(d.T) * d.dr);
  blk.backward(u, dc.data(), dr.data());
  const std::vector<R>& src = p == CachePath::kContent ? dc : dr;
  std::copy(src.begin(), src.end(), ju);
}

template <class R>
double jvp_gain(MlaBlock<R>& blk, CachePath p, const R* e) {
  const MlaDims& d = blk.dims();
  const std::size_t D = static_cast<std::size_t>(path_size(d, p));
  double ee = 0;
  for (std::size_t i = 0; i < D; ++i) ee += static_cast<double>(e[i]) * e[i];
  if (ee == 0) return 0;
  std::vector<R> jv(static_cast<std::size_t>(d.T) * d.hidden);
  path_jvp(blk, p, e, jv.data());
  double q = 0;
  for (R v : jv) q += static_cast<double>(v) * v;
  return q / ee;
}

template <class R>
std::vector<R> path_jacobian(MlaBlock<R>& blk, CachePath p) {
  const MlaDims& d = blk.dims();
  const std::size_t D = static_cast<std::size_t>(path_size(d, p)), N = static_cast<std::size_t>(d.T) * d.hidden;
  std::vector<R> J(N * D), v(D, R(0)), jv(N);
  for (std::size_t j = 0; j < D; ++j) {
    v[j] = R(1);
    path_jvp(blk, p, v.data(), jv.data());
    v[j] = R(0);
    for (std::size_t i = 0; i < N; ++i) J[i * D + j] = jv[i];
  }
  return J;
}

template <class R>
HutchinsonEstimate hutchinson(MlaBlock<R>& blk, CachePath p, int probes, std::uint64_t seed) {
  require(probes >= 2, "hutchinson: at least 2 probes are needed for a standard error");
  const MlaDims& d = blk.dims();
  const std::size_t D = static_cast<std::size_t>(path_size(d, p)), N = static_cast<std::size_t>(d.T) * d.hidden;
  SplitMix64 rng(seed);
  std::vector<R> z(D), u(N), w(D);
  // Welford running mean and sum of squared deviations.
  std::vector<double> mean(D, 0.0), m2(D, 0.0);
  double tmean = 0, tm2 = 0;
  for (int k = 1; k <= probes; ++k) {
    std::uint64_t bits = 0;
    for (std::size_t i = 0; i < D; ++i) {
      if (i % 64 == 0) bits = rng.next();
      z[i] = (bits >> (i % 64)) & 1u ? R(1) : R(-1);
    }
    path_jvp(blk, p, z.data(), u.data());
    double t = 0;
    for (R v : u) t += static_cast<double>(v) * v;
    path_vjp(blk, p, u.data(), w.data());
    const double dt = t - tmean;
    tmean += dt / k;
    tm2 += dt * (t - tmean);
    for (std::size_t i = 0; i < D; ++i) {
      const double x = static_cast<double>(z[i]) * w[i];
      const double dx = x - mean[i];
      mean[i] += dx / k;
      m2[i] += dx * (x - mean[i]);
    }
  }
  HutchinsonEstimate h;
  h.probes = probes;
  h.trace = tmean;
  h.trace_se = std::sqrt(tm2 / (probes - 1) / probes);
  h.diag = std::move(mean);
  h.diag_se.resize(D);
  for (std::size_t i = 0; i < D; ++i) h.diag_se[i] = std::sqrt(m2[i] / (probes - 1) / probes);
  return h;
}

GainTerms decompose_gain(double quad, const std::vector<double>& diag, double trace, const std::vector<double>& e) {
  require(diag.size() == e.size() && !e.empty(), "decompose_gain: diag and e sizes differ");
  double ee = 0, dsum = 0;
  for (std::size_t i = 0; i < e.size(); ++i) ee += e[i] * e[i], dsum += diag[i] * e[i] * e[i];
  GainTerms g;
  g.T = trace / static_cast<double>(e.size());
  g.G = quad / ee;
  g.A = dsum / (g.T * ee);
  g.O = (quad - dsum) / dsum;
  return g;
}

GainTerms decompose_gain_dense(const std::vector<double>& H, const std::vector<double>& e) {
  const std::size_t D = e.size();
  require(H.size() == D * D, "decompose_gain_dense: H is not D x D");
  std::vector<double> diag(D);
  double tr = 0, q = 0;
  for (std::size_t i = 0; i < D; ++i) {
    diag[i] = H[i * D + i];
    tr += diag[i];
    for (std::size_t j = 0; j < D; ++j) q += e[i] * H[i * D + j] * e[j];
  }
  return decompose_gain(q, diag, tr, e);
}

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const std::size_t lo = static_cast<std::size_t>(std::floor(pos)), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

namespace {
std::vector<double> ranks(const std::vector<double>& a) {
  std::vector<std::size_t> idx(a.size());
  std::iota(idx.begin(), idx.end(), std::size_t{0});
  std::sort(idx.begin(), idx.end(), [&](std::size_t i, std::size_t j) { return a[i] < a[j]; });
  std::vector<double> r(a.size());
  for (std::size_t i = 0; i < idx.size();) {
    std::size_t j = i;
    while (j + 1 < idx.size() && a[idx[j + 1]] == a[idx[i]]) ++j;
    for (std::size_t k = i; k <= j; ++k) r[idx[k]] = 0.5 * static_cast<double>(i + j) + 1.0;
    i = j + 1;
  }
  return r;
}
double pearson(const std::vector<double>& a, const std::vector<double>& b) {
  const double n = static_cast<double>(a.size());
  const double ma = std::accumulate(a.begin(), a.end(), 0.0) / n, mb = std::accumulate(b.begin(), b.end(), 0.0) / n;
  double sab = 0, saa = 0, sbb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) sab += (a[i] - ma) * (b[i] - mb), saa += (a[i] - ma) * (a[i] - ma), sbb += (b[i] - mb) * (b[i] - mb);
  if (saa == 0 || sbb == 0) return std::numeric_limits<double>::quiet_NaN();
  return sab / std::sqrt(saa * sbb);
}
}  // namespace

double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  require(a.size() == b.size() && a.size() >= 2, "spearman: need two equal-length samples of size >= 2");
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return std::numeric_limits<double>::quiet_NaN();
  return pearson(ranks(a), ranks(b));
}

std::vector<PredictorScore> fit_predictors(const std::vector<PredictorPoint>& pts) {
  struct Model {
    const char* name;
    double wt, wa;
  };
  const Model models[] = {{"trace+allocation", 1, 1}, {"trace-only", 1, 0}, {"cache-error-only", 0, 0}};
  std::vector<PredictorScore> out;
  std::size_t nfit = 0, ntest = 0;
  for (const auto& p : pts) (p.fit ? nfit : ntest) += 1;
  require(nfit > 0 && ntest > 1, "fit_predictors: need fit points and at least two test points");
  for (const auto& m : models) {
    PredictorScore s;
    s.name = m.name;
    double g = 0;
    for (const auto& p : pts)
      if (p.fit) g += p.log_g - m.wt * p.log_t - m.wa * p.log_a;
    s.gamma = g / static_cast<double>(nfit);
    std::vector<double> pred, tgt;
    for (const auto& p : pts)
      if (!p.fit) pred.push_back(m.wt * p.log_t + m.wa * p.log_a + s.gamma), tgt.push_back(p.log_g);
    const double mt = std::accumulate(tgt.begin(), tgt.end(), 0.0) / static_cast<double>(tgt.size());
    double sse = 0, sst = 0;
    for (std::size_t i = 0; i < tgt.size(); ++i) sse += (pred[i] - tgt[i]) * (pred[i] - tgt[i]), sst += (tgt[i] - mt) * (tgt[i] - mt);
    s.rmse = std::sqrt(sse / static_cast<double>(tgt.size()));
    s.r2 = sst > 0 ? 1.0 - sse / sst : std::numeric_limits<double>::quiet_NaN();
    s.pearson = pearson(pred, tgt);
    out.push_back(s);
  }
  return out;
}

#define KVQ_INST(R)                                                                              \
  template void path_jvp<R>(MlaBlock<R>&, CachePath, const R*, R*);                              \
  template void path_vjp<R>(MlaBlock<R>&, CachePath, const R*, R*);                              \
  template double jvp_gain<R>(MlaBlock<R>&, CachePath, const R*);                                \
  template std::vector<R> path_jacobian<R>(MlaBlock<R>&, CachePath);                             \
  template HutchinsonEstimate hutchinson<R>(MlaBlock<R>&, CachePath, int, std::uint64_t);
KVQ_INST(float)
KVQ_INST(double)
#undef KVQ_INST

}  // namespace kvq
