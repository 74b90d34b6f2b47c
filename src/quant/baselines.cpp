// The chapter's naive baselines (TurboQuant chapter section 5), used by `kvq distortion`.
#include "kvq/baselines.hpp"

#include <algorithm>
#include <cmath>

#include "kvq/common.hpp"
#include "kvq/numeric.hpp"
#include "kvq/rotation.hpp"

namespace kvq {

namespace {
// Min-max quantize-dequantize of `count` values at stride `stride` starting at p.
void minmax_slice(const float* in, float* out, std::size_t count, std::size_t stride, int bits) {
  float lo = in[0], hi = in[0];
  for (std::size_t i = 1; i < count; ++i) {
    lo = std::min(lo, in[i * stride]);
    hi = std::max(hi, in[i * stride]);
  }
  const float m = static_cast<float>((1 << bits) - 1);
  const float s = round_fp16((hi - lo) / m), z = round_fp16(lo);
  for (std::size_t i = 0; i < count; ++i) {
    const float q = s > 0 ? std::clamp(std::rint((in[i * stride] - z) / s), 0.0f, m) : 0.0f;
    out[i * stride] = q * s + z;
  }
}
}  // namespace

std::vector<float> qdq_per_token_absmax(const std::vector<float>& x, std::size_t n, int d, int bits) {
  std::vector<float> y(x.size());
  const float qmax = static_cast<float>((1 << (bits - 1)) - 1);
  for (std::size_t r = 0; r < n; ++r) {
    const float* xr = &x[r * static_cast<std::size_t>(d)];
    float* yr = &y[r * static_cast<std::size_t>(d)];
    float amax = 0;
    for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(xr[i]));
    const float s = round_fp16(amax / qmax);
    for (int i = 0; i < d; ++i) yr[i] = s > 0 ? std::clamp(std::rint(xr[i] / s), -qmax - 1, qmax) * s : 0.0f;
  }
  return y;
}

std::vector<float> qdq_per_token_minmax(const std::vector<float>& x, std::size_t n, int d, int bits) {
  std::vector<float> y(x.size());
  for (std::size_t r = 0; r < n; ++r)
    minmax_slice(&x[r * static_cast<std::size_t>(d)], &y[r * static_cast<std::size_t>(d)], static_cast<std::size_t>(d), 1, bits);
  return y;
}

std::vector<float> qdq_per_channel_minmax(const std::vector<float>& x, std::size_t n, int d, int bits) {
  std::vector<float> y(x.size());
  for (int c = 0; c < d; ++c) minmax_slice(&x[static_cast<std::size_t>(c)], &y[static_cast<std::size_t>(c)], n, static_cast<std::size_t>(d), bits);
  return y;
}

std::vector<float> qdq_rht_per_token_minmax(const std::vector<float>& x, std::size_t n, int d, int bits,
                                            std::uint64_t key) {
  HadamardRotation rot(d, true, key);
  std::vector<float> y(x.size()), t(static_cast<std::size_t>(d)), u(static_cast<std::size_t>(d));
  for (std::size_t r = 0; r < n; ++r) {
    rot.forward(&x[r * static_cast<std::size_t>(d)], t.data());
    minmax_slice(t.data(), u.data(), static_cast<std::size_t>(d), 1, bits);
    rot.inverse(u.data(), &y[r * static_cast<std::size_t>(d)]);
  }
  return y;
}

}  // namespace kvq
