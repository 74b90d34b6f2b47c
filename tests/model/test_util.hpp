// Helpers shared by the model tests: fixture paths, reference tensors, a cache wrapper that
// records the rows the runtime appends, and a one-shot forward with a fresh dense cache.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kvq/dense_cache.hpp"
#include "kvq/model.hpp"
#include "kvq/safetensors.hpp"

namespace kvq::test {

inline std::string src_path(const std::string& rel) { return std::string(KVQ_SOURCE_DIR) + "/" + rel; }

inline bool have_dir(const std::string& rel) { return std::filesystem::is_directory(src_path(rel)); }

#define KVQ_REQUIRE_DIR(rel)                                                                                   \
  do {                                                                                                         \
    if (!::kvq::test::have_dir(rel))                                                                           \
      GTEST_SKIP() << rel << " is missing: run tests/data/make_tiny_checkpoints.py on a host with PyTorch and " \
                              "transformers 5.17 to create it";                                                 \
  } while (0)

inline std::vector<std::int32_t> ids_of(const TensorView& t) {
  std::vector<std::int32_t> out;
  for (float f : t.to_float()) out.push_back(static_cast<std::int32_t>(f));
  return out;
}

inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0.0f;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const float d = std::fabs(a[i] - b[i]);
    if (std::isnan(d)) return INFINITY;  // NaN never passes
    m = std::max(m, d);
  }
  return m;
}

// One forward over all tokens with a fresh dense cache (fp32 rows unless asked); all logits.
inline std::vector<float> run_all(Model& m, const std::vector<std::int32_t>& ids,
                                  DenseStorage storage = DenseStorage::kF32) {
  auto cache = make_dense_cache(m.cache_geometry(), 1, 0, storage);
  std::vector<float> logits(ids.size() * static_cast<std::size_t>(m.config().vocab_size));
  m.forward(ids.data(), static_cast<int>(ids.size()), *cache, 0, logits.data(), LogitsMode::kAll);
  return logits;
}

// Passes everything to a dense cache and keeps a copy of every appended row per layer.
class RecordingCache : public KvCache {
 public:
  explicit RecordingCache(const CacheGeometry& g) : inner_(make_dense_cache(g, 1, 0, DenseStorage::kF32)), k_(g.n_layers), v_(g.n_layers) {
    kw_ = g.mla ? g.d_latent : g.n_kv_heads * g.head_dim;
    vw_ = g.mla ? g.d_rope : g.n_kv_heads * g.v_head_dim;
  }
  const CacheGeometry& geometry() const override { return inner_->geometry(); }
  int length(int seq) const override { return inner_->length(seq); }
  void append(int seq, int layer, int n, const float* k, const float* v) override {
    k_[layer].insert(k_[layer].end(), k, k + static_cast<std::size_t>(n) * kw_);
    v_[layer].insert(v_[layer].end(), v, v + static_cast<std::size_t>(n) * vw_);
    inner_->append(seq, layer, n, k, v);
  }
  void attend(int seq, int layer, int n_q, int pos0, int n_heads, float scale, const float* q,
              float* out) const override {
    inner_->attend(seq, layer, n_q, pos0, n_heads, scale, q, out);
  }
  void reset(int seq) override { inner_->reset(seq); }
  std::string describe() const override { return "recording " + inner_->describe(); }
  const std::vector<float>& k(int layer) const { return k_[layer]; }
  const std::vector<float>& v(int layer) const { return v_[layer]; }

 private:
  std::unique_ptr<KvCache> inner_;
  std::vector<std::vector<float>> k_, v_;
  int kw_ = 0, vw_ = 0;
};

}  // namespace kvq::test
