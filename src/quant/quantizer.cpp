// VectorQuantizer defaults: the dequantize-then-compute reference versions of scoring and
// value accumulation, batch loops, finiteness checks.
#include "kvq/quantizer.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kvq/common.hpp"
#include "kvq/quantizers.hpp"

namespace kvq {

void VectorQuantizer::check_finite(const float* x) const {
  for (int i = 0; i < dim_; ++i) {
    if (!std::isfinite(x[i]))
      fail(name() + ": non-finite input (" + std::to_string(x[i]) + ") at coordinate " + std::to_string(i));
  }
}

void VectorQuantizer::prepare_query(const float* q, float* qp) const {
  for (int i = 0; i < dim_; ++i) qp[i] = q[i];
}

float VectorQuantizer::score(const float* qp, const std::uint8_t* codes, const std::uint8_t* meta) const {
  std::vector<float> x(static_cast<std::size_t>(dim_));
  decode(codes, meta, x.data());
  float s = 0;
  for (int i = 0; i < dim_; ++i) s += qp[i] * x[static_cast<std::size_t>(i)];
  return s;
}

void VectorQuantizer::accumulate(float w, const std::uint8_t* codes, const std::uint8_t* meta, float* acc) const {
  std::vector<float> x(static_cast<std::size_t>(dim_));
  decode(codes, meta, x.data());
  for (int i = 0; i < dim_; ++i) acc[i] += w * x[static_cast<std::size_t>(i)];
}

void VectorQuantizer::finish(const float* acc, float* out) const {
  for (int i = 0; i < dim_; ++i) out[i] = acc[i];
}

void VectorQuantizer::encode_batch(const float* x, std::size_t n, std::uint8_t* records) const {
  const std::size_t b = bytes();
  for (std::size_t i = 0; i < n; ++i) encode_record(x + i * static_cast<std::size_t>(dim_), records + i * b);
}

void VectorQuantizer::decode_batch(const std::uint8_t* records, std::size_t n, float* x) const {
  const std::size_t b = bytes();
  for (std::size_t i = 0; i < n; ++i) decode_record(records + i * b, x + i * static_cast<std::size_t>(dim_));
}

double rel_error(const float* a, const float* b, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

int bucketize(const float* edges, int n_edges, float y) {
  int lo = 0, hi = n_edges;  // answer in [0, n_edges]
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (edges[mid] < y) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

float prescale_threshold(float edge, float scale) {
  require(scale > 0.0f && std::isfinite(scale), "prescale_threshold: scale must be finite and positive");
  if (std::isinf(edge)) return edge;
  require(std::isfinite(edge), "prescale_threshold: edge is NaN");
  // Start at the quotient, step down until fl(v scale) <= edge, then up while the next float
  // still qualifies (a few steps; more only below the denormal range's resolution).
  float v = edge / scale;
  if (!std::isfinite(v)) v = std::copysign(std::numeric_limits<float>::max(), edge);
  while (v * scale > edge) v = std::nextafter(v, -INFINITY);
  for (float up = std::nextafter(v, INFINITY); std::isfinite(up) && up * scale <= edge; up = std::nextafter(v, INFINITY)) v = up;
  return v;
}

}  // namespace kvq
