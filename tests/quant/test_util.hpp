// Shared helpers of the quantizer tests: seeded Gaussian data and the fixture cache dumps.
#pragma once

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kvq/safetensors.hpp"

namespace kvq::testing {

inline std::vector<float> gaussian(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

inline std::string source_path(const std::string& rel) { return std::string(KVQ_SOURCE_DIR) + "/" + rel; }

// Rows [n][d] of one head of a fixture dump (e.g. "layer1.k", head 0 of 2 at head_dim 128).
inline std::vector<float> fixture_rows(const std::string& model, const std::string& tensor, int head, int d) {
  SafetensorsFile f(source_path("models/" + model + "/reference.safetensors"));
  const auto& t = f.get(tensor);
  const auto all = t.to_float();
  const std::size_t n = static_cast<std::size_t>(t.shape[0]), w = static_cast<std::size_t>(t.shape[1]);
  std::vector<float> out(n * static_cast<std::size_t>(d));
  for (std::size_t i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) out[i * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)] = all[i * w + static_cast<std::size_t>(head * d + c)];
  return out;
}

}  // namespace kvq::testing
