// Byte-level BPE merging with a rank heap and a word cache (see bpe.hpp).
#include "bpe.hpp"

#include <algorithm>
#include <queue>

namespace kvq::tok {

BpeModel::BpeModel(std::unordered_map<std::string, std::int32_t> raw_vocab,
                   std::unordered_map<std::uint64_t, Merge> merges, Options options)
    : raw_vocab_(std::move(raw_vocab)), merges_(std::move(merges)), options_(options) {
  for (int b = 0; b < 256; ++b) {
    const auto it = raw_vocab_.find(std::string(1, static_cast<char>(b)));
    byte_id_[b] = it == raw_vocab_.end() ? -1 : it->second;
  }
}

void BpeModel::encode_piece(std::string_view bytes, std::vector<std::int32_t>& out) const {
  if (bytes.empty()) return;
  if (bytes.size() == 1 && byte_id_[static_cast<unsigned char>(bytes[0])] >= 0) {
    out.push_back(byte_id_[static_cast<unsigned char>(bytes[0])]);
    return;
  }
  if (options_.ignore_merges) {
    const auto it = raw_vocab_.find(std::string(bytes));
    if (it != raw_vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (bytes.size() > kMaxCachedPiece) {
    merge(bytes, out);
    return;
  }
  std::string key(bytes);
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    const auto it = cache_.find(key);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const std::size_t first = out.size();
  merge(bytes, out);
  std::vector<std::int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_.size() < kMaxCacheEntries) cache_.emplace(std::move(key), std::move(ids));
}

void BpeModel::merge(std::string_view bytes, std::vector<std::int32_t>& out) const {
  struct Symbol {
    std::int32_t id;
    std::int32_t prev;
    std::int32_t next;
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(bytes.size());
  bool pending_unk = false;
  auto push = [&](std::int32_t id) {
    const auto n = static_cast<std::int32_t>(sym.size());
    sym.push_back({id, n - 1, -1, true});
    if (n > 0) sym[static_cast<std::size_t>(n - 1)].next = n;
  };
  for (const char ch : bytes) {
    const std::int32_t id = byte_id_[static_cast<unsigned char>(ch)];
    if (id >= 0) {
      pending_unk = false;
      push(id);
    } else if (options_.unk_id >= 0) {
      if (!(pending_unk && options_.fuse_unk)) push(options_.unk_id);
      pending_unk = true;
    }
  }
  if (sym.empty()) return;

  struct Candidate {
    std::int32_t rank;
    std::int32_t pos;
    std::int32_t left;
    std::int32_t right;
    std::int32_t merged;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto consider = [&](std::int32_t pos) {
    const auto& s = sym[static_cast<std::size_t>(pos)];
    if (s.next < 0) return;
    const std::int32_t right = sym[static_cast<std::size_t>(s.next)].id;
    const auto it = merges_.find(pair_key(s.id, right));
    if (it != merges_.end()) heap.push({it->second.rank, pos, s.id, right, it->second.id});
  };
  for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(sym.size()); ++i) consider(i);

  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    auto& s = sym[static_cast<std::size_t>(c.pos)];
    if (!s.alive || s.id != c.left || s.next < 0) continue;
    auto& r = sym[static_cast<std::size_t>(s.next)];
    if (r.id != c.right) continue;
    // An unchanged id on both sides means the pair is the one that was queued: a symbol's id
    // only changes by merging, which always yields a longer, different token.
    s.id = c.merged;
    r.alive = false;
    s.next = r.next;
    if (s.next >= 0) sym[static_cast<std::size_t>(s.next)].prev = c.pos;
    if (s.prev >= 0) consider(s.prev);
    consider(c.pos);
  }
  for (std::int32_t i = 0; i >= 0; i = sym[static_cast<std::size_t>(i)].next)
    out.push_back(sym[static_cast<std::size_t>(i)].id);
}

}  // namespace kvq::tok
