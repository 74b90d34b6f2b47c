// Greedy and temperature / top-p sampling (kvq/sampler.hpp).
#include "kvq/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kvq/common.hpp"

namespace kvq {

Sampler::Sampler(const SamplerOptions& opt) : opt_(opt), rng_(opt.seed) {
  require(opt.temperature >= 0.0f && std::isfinite(opt.temperature), "sampler: temperature must be >= 0");
  require(opt.top_p > 0.0f && opt.top_p <= 1.0f, "sampler: top-p must be in (0, 1]");
}

std::int32_t Sampler::sample(const float* logits, int vocab) {
  require(vocab > 0, "sampler: empty vocabulary");
  if (opt_.temperature == 0.0f) {
    int best = 0;
    for (int v = 1; v < vocab; ++v)
      if (logits[v] > logits[best]) best = v;
    return best;
  }
  float mx = logits[0];
  for (int v = 1; v < vocab; ++v) mx = std::max(mx, logits[v]);
  std::vector<double> p(vocab);
  double z = 0.0;
  for (int v = 0; v < vocab; ++v) z += p[v] = std::exp((static_cast<double>(logits[v]) - mx) / opt_.temperature);
  std::vector<int> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
  int keep = vocab;
  double mass = 0.0;
  if (opt_.top_p < 1.0f) {
    for (int i = 0; i < vocab; ++i) {
      mass += p[order[i]] / z;
      if (mass >= opt_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0.0;
  for (int i = 0; i < keep; ++i) kept += p[order[i]];
  double u = rng_.uniform() * kept;
  for (int i = 0; i < keep; ++i) {
    u -= p[order[i]];
    if (u < 0.0) return order[i];
  }
  return order[keep - 1];
}

}  // namespace kvq
