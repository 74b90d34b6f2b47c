// kvq/kv_cache.hpp: the KV-cache interface the model runtime writes to and attends through.
//
// The forward pass never touches cache storage directly: per layer it appends the new rows
// (keys after RoPE; for MLA the normalized latent and the rope key after RoPE) and asks the
// cache to compute attention for its queries. A bf16 cache implements it directly; the paged
// packed caches (src/cache) implement it over packed pages, so every query of prefill and decode
// sees history exactly as decode would (protected rows in bf16, the rest from packed copies).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace kvq {

// MLA's per-head up-projections (kv_b_proj), for attention in the expanded form.
struct MlaUpProjection {
  int n_heads = 0;
  int nope = 0;                // qk_nope_head_dim
  int v_dim = 0;               // v_head_dim
  const float* w_uk = nullptr;  // [n_heads][nope][d_latent]
  const float* w_uv = nullptr;  // [n_heads][v_dim][d_latent]
};

struct CacheGeometry {
  int n_layers = 0;
  bool mla = false;
  // MHA / GQA
  int n_kv_heads = 0;
  int head_dim = 0;    // key head dim
  int v_head_dim = 0;  // value head dim
  // MLA
  int d_latent = 0;    // kv_lora_rank (d_c)
  int d_rope = 0;      // qk_rope_head_dim (d_r)
};

class KvCache {
 public:
  virtual ~KvCache() = default;
  virtual const CacheGeometry& geometry() const = 0;
  // Number of tokens stored for `seq` (all layers advance together).
  virtual int length(int seq = 0) const = 0;
  // Appends n rows at positions [length, length + n) of layer `layer` for sequence `seq`.
  //  GQA: k is [n][n_kv_heads * head_dim] (after RoPE), v is [n][n_kv_heads * v_head_dim].
  //  MLA: k is [n][d_latent] (normalized latent), v is [n][d_rope] (rope key after RoPE).
  // The length advances when the last layer has been appended. Throws kvq::Error on NaN/Inf
  // (naming layer and position) or when storage is exhausted.
  virtual void append(int seq, int layer, int n, const float* k, const float* v) = 0;
  // Causal attention of n_q query tokens whose positions are [pos0, pos0 + n_q) against the
  // rows 0..pos of this layer (each query sees positions <= its own), softmax scale `scale`.
  //  GQA: q is [n_q][n_heads * head_dim], out [n_q][n_heads * v_head_dim]; heads grouped in
  //       order (query head h reads kv head h / (n_heads / n_kv_heads)).
  //  MLA (absorbed): q is [n_q][n_heads * (d_latent + d_rope)] laid out per head as
  //       [q_nope W_UK | q_rope]; out [n_q][n_heads * d_latent] (latent-space output; the
  //       caller applies W_UV).
  virtual void attend(int seq, int layer, int n_q, int pos0, int n_heads, float scale,
                      const float* q, float* out) const = 0;
  // MLA only, the same attention as attend() in DeepSeek-V2's expanded form: every row the
  // queries see (protected rows in bf16, the rest decoded from packed copies, exactly as in
  // attend()) is up-projected per head, k_h = [W_UK_h c | k_R], v_h = W_UV_h c, and each head
  // attends over 128 + 64 dimensions instead of 576 + 512. Equal to attend() followed by W_UV
  // up to float rounding; cheaper for prefill-sized chunks (the up-projection costs one GEMM
  // per row, the absorbed form ~6x more per query-row pair).
  //  q is [n_q][n_heads * (nope + d_rope)] laid out per head as [q_nope | q_rope];
  //  out [n_q][n_heads * v_dim].
  // Returns false (and writes nothing) where the cache does not implement it; the caller then
  // uses attend().
  virtual bool attend_expanded(int seq, int layer, int n_q, int pos0, float scale, const MlaUpProjection& up,
                               const float* q, float* out) const {
    (void)seq, (void)layer, (void)n_q, (void)pos0, (void)scale, (void)up, (void)q, (void)out;
    return false;
  }
  // Drops all tokens of `seq` (its storage returns to the pool).
  virtual void reset(int seq = 0) = 0;
  virtual std::string describe() const = 0;
};

}  // namespace kvq
