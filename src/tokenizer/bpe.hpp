// The byte-level BPE model: one pre-tokenized piece (raw bytes) in, token ids out.
//
// Symbols start as the vocabulary ids of the piece's single bytes (through the GPT-2 byte map);
// the adjacent pair with the lowest merge rank is merged first, the leftmost on ties, until no
// pair has a rank (Sennrich et al. 2016, as Hugging Face applies it). A min-heap of candidate
// pairs over a linked list of symbols keeps a word of n bytes at O(n log n). Results for short
// words are cached, since natural text repeats its words.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvq::tok {

class BpeModel {
 public:
  struct Merge {
    std::int32_t rank;
    std::int32_t id;
  };
  struct Options {
    bool ignore_merges = false;  // a piece that is itself a vocabulary token skips the merges
    std::int32_t unk_id = -1;    // id for bytes missing from the vocabulary; -1 drops them
    bool fuse_unk = false;       // consecutive unknown bytes give one unk token
  };

  // raw_vocab: raw byte strings (byte-level tokens decoded) to ids; merges keyed by
  // pair_key(left, right).
  BpeModel(std::unordered_map<std::string, std::int32_t> raw_vocab,
           std::unordered_map<std::uint64_t, Merge> merges, Options options);

  static std::uint64_t pair_key(std::int32_t left, std::int32_t right) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32) |
           static_cast<std::uint32_t>(right);
  }

  // Appends the ids of one piece.
  void encode_piece(std::string_view bytes, std::vector<std::int32_t>& out) const;

  const std::unordered_map<std::string, std::int32_t>& raw_vocab() const { return raw_vocab_; }

 private:
  void merge(std::string_view bytes, std::vector<std::int32_t>& out) const;

  std::unordered_map<std::string, std::int32_t> raw_vocab_;
  std::unordered_map<std::uint64_t, Merge> merges_;
  std::array<std::int32_t, 256> byte_id_{};
  Options options_;

  static constexpr std::size_t kMaxCachedPiece = 64;
  static constexpr std::size_t kMaxCacheEntries = 1 << 18;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<std::int32_t>> cache_;
};

}  // namespace kvq::tok
