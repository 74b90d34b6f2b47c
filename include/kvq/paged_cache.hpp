// kvq/paged_cache.hpp: the paged, packed KV cache with the protection policy.
//
// Storage (docs/cache.md): a page pool of fixed-size blocks of `page_tokens` tokens; each
// physical block id owns one page per layer (layout: include/kvq/page_layout.hpp, shared with
// the CUDA kernels); a block table per sequence maps logical block -> physical block; each
// layer's pool has a reverse map (8 bytes per page) back to (sequence, logical block), for
// preemption and defragmentation. Every token is written once, packed, at insertion.
//
// Protection policy (QuantMLA section on the mixed-precision cache): the first S tokens
// (sinks) and the last W tokens (recent window) are *read* from bf16 rows; a token leaving the
// window switches to its packed copy without requantization. Boundary layers (the first and
// last N) store bf16 pages. Every query, in prefill and decode alike, sees history as decode at
// its position would: rows t < S or t > p - W from bf16, every other row decoded from its
// packed copy; protected and packed rows share one online softmax.
//
// Attention has two paths with the same semantics: the reference (decode rows, then attend;
// loops in double) and the fast path (prefill: rows dequantized once per call, GEMMs, exact
// corrections for the protected band; decode: rotated-domain scoring from packed codes and
// rotated-domain value accumulation). tests/cache checks fast == reference within 1e-5.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvq/formats.hpp"
#include "kvq/kv_cache.hpp"

namespace kvq {

struct ProtectionPolicy {
  int sinks = 0;            // S
  int window = 0;           // W
  int boundary_layers = 0;  // N: layers [0, N) and [L - N, L) stay bf16
  static ProtectionPolicy paper() { return {4, 128, 0}; }  // QuantMLA: 132 protected rows
};

struct CacheOptions {
  std::string format = "bf16";
  ProtectionPolicy protect;
  int page_tokens = kDefaultPageTokens;
  std::size_t pool_bytes = 0;  // byte budget of the page pool (all layers); 0 = grow as needed
  bool preempt = false;        // on exhaustion evict a whole other sequence instead of failing
  std::shared_ptr<const OutlierChannels> outliers;  // split formats (tq-3.5bit, tq-2.5bit)
};

enum class AttentionPath { kReference, kFast };

// Exact persistent bytes (excluding weights, shared page tables, allocator overhead and
// temporary workspaces, as the QuantMLA paper counts).
struct CacheMemory {
  std::size_t blocks = 0;             // physical blocks held
  std::size_t packed_bytes = 0;       // pages of every layer
  std::size_t protection_bytes = 0;   // bf16 sink + window rows
  std::size_t reverse_map_bytes = 0;  // 8 bytes per page of every layer
  std::size_t total() const { return packed_bytes + protection_bytes + reverse_map_bytes; }
};

class PagedCache final : public KvCache {
 public:
  PagedCache(const CacheGeometry& g, CacheOptions opt, int max_seqs = 1);
  ~PagedCache() override;

  const CacheGeometry& geometry() const override { return geo_; }
  int length(int seq = 0) const override;
  void append(int seq, int layer, int n, const float* k, const float* v) override;
  void attend(int seq, int layer, int n_q, int pos0, int n_heads, float scale, const float* q,
              float* out) const override;
  // The fast path's expanded MLA form (see KvCache); false on the reference path and for
  // MHA/GQA caches.
  bool attend_expanded(int seq, int layer, int n_q, int pos0, float scale, const MlaUpProjection& up, const float* q,
                       float* out) const override;
  void reset(int seq = 0) override;
  std::string describe() const override;

  void set_attention_path(AttentionPath p) { path_ = p; }
  AttentionPath attention_path() const { return path_; }

  // The format of layer l (bf16 for boundary layers).
  const FormatSpec& layer_format(int layer) const;
  const PageLayout& layer_layout(int layer) const;
  std::size_t block_bytes() const { return block_bytes_; }  // one physical block, all layers
  std::size_t max_blocks() const { return max_blocks_; }    // 0 = unbounded
  CacheMemory memory(int seq) const;
  CacheMemory memory_total() const;
  bool is_protected(int t, int as_of) const {
    return t < opt_.protect.sinks || t > as_of - opt_.protect.window;
  }
  bool preempted(int seq) const;      // evicted; its tokens must be appended again
  int preemptions() const { return preemptions_; }
  // Decoded cache row of token t (what attention reads for a query at position `as_of`; with
  // as_of < 0, always the packed copy): for tests and diagnostics. k: key (latent) of every
  // head, v: value (rope key).
  void read_row(int seq, int layer, int t, int as_of, float* k, float* v) const;

  // Channel statistics for calibration: while on, append() accumulates the mean and the mean
  // |x| of every key and value channel per (layer, KV head), after RoPE, as stored.
  void collect_channel_stats(bool on) { stats_ = on; }
  // The calibration of format `f` from the statistics collected so far: outlier channels for
  // the split formats (largest mean |x|), channel means for the centering formats.
  std::shared_ptr<FormatCalibration> calibration(const FormatSpec& f) const;

  // Analytic persistent bytes of one request of `tokens` tokens (the same formula as memory(),
  // used by `kvq budget --context`).
  static CacheMemory account(const CacheGeometry& g, const std::string& format, const ProtectionPolicy& p,
                             int tokens, int page_tokens = kDefaultPageTokens);

  struct Impl;  // storage; defined in src/cache/paged_cache.cpp

 private:
  CacheGeometry geo_;
  CacheOptions opt_;
  std::size_t block_bytes_ = 0, max_blocks_ = 0;
  AttentionPath path_ = AttentionPath::kFast;
  int preemptions_ = 0;
  bool stats_ = false;
  std::unique_ptr<Impl> impl_;
};


}  // namespace kvq
