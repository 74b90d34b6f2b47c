// kvq/cuda_protect.hpp: the per-sequence bf16 side buffer of protected rows (attention sinks and
// the recent window) that the CUDA store and decode kernels share with the CPU cache.
//
// Every token is written once to its packed page; tokens at protected positions are also kept in
// bf16 here and attention reads them from here instead of from the packed copy. For a sequence of
// length L with `sinks` S and `window` W, the protected positions are
//   [0, min(S, L))  and  [max(S, L - W), L);
// all other positions [min(S, L), max(min(S, L), L - W)) are read from the packed pages. A
// position leaves the window by being overwritten in the ring, with no requantization.
//
// Layout of one layer's buffer (bf16 as uint16, no padding):
//   rows[seq][kv_head][slot][2][head_dim]      ([.][.][.][0] = key, [1] = value)
//   slot(pos) = pos                 for pos < S          (sinks)
//             = S + (pos - S) % W   for pos >= S, W > 0   (ring of the last W positions)
// `seq` is the batch row of the block table. Keys are stored after RoPE, as the pages hold them.
#pragma once

#include <cstdint>

#include "kvq/common.hpp"

namespace kvq {

struct ProtectLayout {
  std::int32_t sinks = 0;
  std::int32_t window = 0;
  std::int32_t kv_heads = 0;
  std::int32_t head_dim = 0;

  KVQ_HD std::int32_t slots() const { return sinks + window; }
  KVQ_HD bool enabled() const { return sinks + window > 0; }
  // Slot of a position, or -1 when the position is never kept (pos >= S and W == 0).
  KVQ_HD std::int32_t slot(std::int64_t pos) const {
    if (pos < sinks) return static_cast<std::int32_t>(pos);
    if (window <= 0) return -1;
    return sinks + static_cast<std::int32_t>((pos - sinks) % window);
  }
  // Element offset (in bf16 units) of the key row of (seq, head, slot); the value row follows.
  KVQ_HD std::uint64_t row(std::int64_t seq, std::int32_t head, std::int32_t s) const {
    return ((static_cast<std::uint64_t>(seq) * static_cast<std::uint64_t>(kv_heads) + static_cast<std::uint64_t>(head)) *
                static_cast<std::uint64_t>(slots()) +
            static_cast<std::uint64_t>(s)) *
           2u * static_cast<std::uint64_t>(head_dim);
  }
  KVQ_HD std::uint64_t elements(std::int64_t seqs) const { return row(seqs, 0, 0); }
  // First packed position and end of the packed range for a sequence of length L.
  KVQ_HD std::int64_t packed_begin(std::int64_t L) const { return L < sinks ? L : sinks; }
  KVQ_HD std::int64_t packed_end(std::int64_t L) const {
    const std::int64_t b = packed_begin(L);
    return L - window > b ? L - window : b;
  }
};

}  // namespace kvq

namespace kvq {

// MLA variant: one protected row per (sequence, slot) holding the whole token, the content latent
// followed by the RoPE key, as bf16 (d_latent + d_rope elements; no heads, no key/value pair):
//   rows[seq][slot][d_latent + d_rope]
// Slots and the packed range follow ProtectLayout (sinks first, then a ring of the last W).
struct MlaProtectLayout {
  std::int32_t sinks = 0;
  std::int32_t window = 0;
  std::int32_t d_latent = 512;
  std::int32_t d_rope = 64;

  KVQ_HD ProtectLayout base() const { return ProtectLayout{sinks, window, 1, 0}; }
  KVQ_HD std::int32_t slots() const { return sinks + window; }
  KVQ_HD bool enabled() const { return sinks + window > 0; }
  KVQ_HD std::int32_t row_dim() const { return d_latent + d_rope; }
  KVQ_HD std::int32_t slot(std::int64_t pos) const { return base().slot(pos); }
  // Element offset (bf16 units) of the row of (seq, slot).
  KVQ_HD std::uint64_t row(std::int64_t seq, std::int32_t s) const {
    return (static_cast<std::uint64_t>(seq) * static_cast<std::uint64_t>(slots()) + static_cast<std::uint64_t>(s)) *
           static_cast<std::uint64_t>(row_dim());
  }
  KVQ_HD std::uint64_t elements(std::int64_t seqs) const { return row(seqs, 0); }
  KVQ_HD std::int64_t packed_begin(std::int64_t L) const { return base().packed_begin(L); }
  KVQ_HD std::int64_t packed_end(std::int64_t L) const { return base().packed_end(L); }
};

}  // namespace kvq
