// kvq/page_layout.hpp: the byte layout of one cache page, shared by the CPU cache and the CUDA
// kernels (plain C++, no dependencies; KVQ_HD functions run on both sides).
//
// A page holds `tokens` consecutive tokens (64 by default) of one layer, for every KV head
// (MLA: one "head", the latent + RoPE record). Codes and per-token metadata live in separate
// 16-byte aligned regions so that kernels read them with wide coalesced loads:
//
//   [key codes   : heads x tokens x key_code_bytes  ]   head-major, then token
//   [value codes : heads x tokens x value_code_bytes]
//   [metadata    : heads x tokens x meta_bytes      ]   per token: [key meta][value meta][pad]
//
// meta_bytes = key meta + value meta, padded so that key codes + value codes + meta_bytes equals
// the format's per-token record (TokenBytes::record): for MLA records are 16-byte aligned, so
// a C4R4 page is 64 x (256 + 32 + 32) = 20,480 bytes, as the QuantMLA paper counts.
// docs/formats.md draws every format's page.
#pragma once

#include <cstdint>

#include "kvq/common.hpp"

namespace kvq {

inline constexpr int kDefaultPageTokens = 64;
inline constexpr std::uint64_t kPageAlign = 16;

struct PageLayout {
  std::int32_t tokens = kDefaultPageTokens;
  std::int32_t heads = 1;
  std::uint32_t key_code_bytes = 0, value_code_bytes = 0;  // per token per head
  std::uint32_t key_meta_bytes = 0, value_meta_bytes = 0;  // per token per head (unpadded)
  std::uint32_t meta_bytes = 0;                            // padded metadata record per token per head
  std::uint64_t key_code_off = 0, value_code_off = 0, meta_off = 0;
  std::uint64_t page_bytes = 0;

  KVQ_HD std::uint64_t slot(int head, int tok) const {
    return static_cast<std::uint64_t>(head) * static_cast<std::uint64_t>(tokens) + static_cast<std::uint64_t>(tok);
  }
  KVQ_HD std::uint64_t key_code(int head, int tok) const { return key_code_off + slot(head, tok) * key_code_bytes; }
  KVQ_HD std::uint64_t value_code(int head, int tok) const { return value_code_off + slot(head, tok) * value_code_bytes; }
  KVQ_HD std::uint64_t key_meta(int head, int tok) const { return meta_off + slot(head, tok) * meta_bytes; }
  KVQ_HD std::uint64_t value_meta(int head, int tok) const { return key_meta(head, tok) + key_meta_bytes; }
};

// record: bytes per token per head of the format (>= codes + metas).
KVQ_HD PageLayout make_page_layout(int tokens, int heads, std::uint32_t key_code_bytes, std::uint32_t key_meta_bytes,
                                   std::uint32_t value_code_bytes, std::uint32_t value_meta_bytes,
                                   std::uint64_t record) {
  PageLayout p;
  p.tokens = tokens;
  p.heads = heads;
  p.key_code_bytes = key_code_bytes;
  p.value_code_bytes = value_code_bytes;
  p.key_meta_bytes = key_meta_bytes;
  p.value_meta_bytes = value_meta_bytes;
  const std::uint64_t codes = static_cast<std::uint64_t>(key_code_bytes) + value_code_bytes;
  const std::uint64_t metas = static_cast<std::uint64_t>(key_meta_bytes) + value_meta_bytes;
  p.meta_bytes = static_cast<std::uint32_t>(record > codes + metas ? record - codes : metas);
  const std::uint64_t n = static_cast<std::uint64_t>(tokens) * static_cast<std::uint64_t>(heads);
  p.key_code_off = 0;
  p.value_code_off = align_up(p.key_code_off + n * key_code_bytes, kPageAlign);
  p.meta_off = align_up(p.value_code_off + n * value_code_bytes, kPageAlign);
  p.page_bytes = align_up(p.meta_off + n * p.meta_bytes, kPageAlign);
  return p;
}

}  // namespace kvq
