// kvq::Tokenizer for Hugging Face tokenizer.json byte-level BPE: loading and validation, the
// added-token pass, normalization, pre-tokenization and BPE, and decoding.
//
// The encode pipeline is the one of the Hugging Face tokenizers library:
//   1. added tokens whose "normalized" flag is false are found in the raw text (leftmost,
//      then longest match; lstrip / rstrip absorb the white space next to them; single_word
//      discards a match that touches a word character);
//   2. every other section is normalized, then searched for the normalized added tokens;
//   3. what remains is pre-tokenized into pieces and each piece is merged by the BPE model.
// Invalid UTF-8 is cut out first and encoded byte by byte (see include/kvq/tokenizer.hpp).
#include "kvq/tokenizer.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "bpe.hpp"
#include "kvq/common.hpp"
#include "pretokenizer.hpp"
#include "text.hpp"

namespace kvq {

namespace {

using json = nlohmann::json;
using tok::BpeModel;
using tok::NormForm;

// Ids must stay dense enough for a flat id -> token table (a hostile file must not make the
// loader allocate gigabytes).
constexpr std::int64_t kMaxTokenId = (1 << 24) - 1;

struct AddedToken {
  std::string content;
  std::int32_t id = -1;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// Byte trie over added-token contents for leftmost-longest matching.
class TokenTrie {
 public:
  void add(std::string_view s, std::int32_t index) {
    std::int32_t node = 0;
    for (const char ch : s) {
      const auto b = static_cast<unsigned char>(ch);
      auto& edges = nodes_[static_cast<std::size_t>(node)].edges;
      const auto it = std::find_if(edges.begin(), edges.end(),
                                   [b](const auto& e) { return e.first == b; });
      if (it != edges.end()) {
        node = it->second;
      } else {
        const auto next = static_cast<std::int32_t>(nodes_.size());
        edges.emplace_back(b, next);
        nodes_.emplace_back();
        node = next;
      }
    }
    nodes_[static_cast<std::size_t>(node)].token = index;
    first_[static_cast<unsigned char>(s[0])] = true;
    empty_ = false;
  }
  bool empty() const { return empty_; }
  bool can_start(char ch) const { return first_[static_cast<unsigned char>(ch)]; }
  // Longest token starting at text[pos]: {length, token index}, or {0, -1}.
  std::pair<std::size_t, std::int32_t> longest(std::string_view text, std::size_t pos) const {
    std::pair<std::size_t, std::int32_t> best{0, -1};
    std::int32_t node = 0;
    for (std::size_t i = pos; i < text.size(); ++i) {
      const auto b = static_cast<unsigned char>(text[i]);
      const auto& edges = nodes_[static_cast<std::size_t>(node)].edges;
      const auto it = std::find_if(edges.begin(), edges.end(),
                                   [b](const auto& e) { return e.first == b; });
      if (it == edges.end()) break;
      node = it->second;
      if (nodes_[static_cast<std::size_t>(node)].token >= 0)
        best = {i + 1 - pos, nodes_[static_cast<std::size_t>(node)].token};
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, std::int32_t>> edges;
    std::int32_t token = -1;
  };
  std::vector<Node> nodes_{Node{}};
  std::array<bool, 256> first_{};
  bool empty_ = true;
};

// Reads an integer token id; kvq::Error on anything else.
std::int32_t parse_id(const json& v, const std::string& what) {
  if (!v.is_number_integer()) fail(what + ": id must be an integer");
  const auto id = v.get<std::int64_t>();
  if (id < 0 || id > kMaxTokenId) {
    fail(fmt::format("{}: id {} is outside [0, {}]", what, id, kMaxTokenId));
  }
  return static_cast<std::int32_t>(id);
}

void parse_normalizer(const json& j, std::vector<NormForm>& out, int depth) {
  if (j.is_null()) return;
  if (depth > 8) fail("normalizer: Sequence nested too deeply");
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
    fail("normalizer must be null or an object with a \"type\"");
  }
  const auto type = j["type"].get<std::string>();
  if (type == "Sequence") {
    const auto it = j.find("normalizers");
    if (it == j.end() || !it->is_array()) fail("Sequence normalizer has no \"normalizers\" array");
    for (const auto& sub : *it) parse_normalizer(sub, out, depth + 1);
  } else if (type == "NFC") {
    out.push_back(NormForm::kNFC);
  } else if (type == "NFD") {
    out.push_back(NormForm::kNFD);
  } else if (type == "NFKC") {
    out.push_back(NormForm::kNFKC);
  } else if (type == "NFKD") {
    out.push_back(NormForm::kNFKD);
  } else {
    fail("normalizer type '" + type + "' is not supported (supported: NFC, NFD, NFKC, NFKD, Sequence)");
  }
}

void check_decoder(const json& j, int depth) {
  if (j.is_null()) return;
  if (depth > 8) fail("decoder: Sequence nested too deeply");
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) {
    fail("decoder must be null or an object with a \"type\"");
  }
  const auto type = j["type"].get<std::string>();
  if (type == "ByteLevel") return;
  if (type == "Sequence" && j.contains("decoders") && j["decoders"].is_array()) {
    for (const auto& sub : j["decoders"]) check_decoder(sub, depth + 1);
    return;
  }
  fail("decoder type '" + type + "' is not supported (byte-level BPE decodes with ByteLevel)");
}

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(const json& root);

  std::vector<std::int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<std::int32_t>& ids) const override;
  std::string token_text(std::int32_t id) const override;
  int vocab_size() const override { return static_cast<int>(tokens_.size()); }
  std::int32_t token_id(std::string_view content) const override;
  bool is_special(std::int32_t id) const override {
    return id >= 0 && static_cast<std::size_t>(id) < special_.size() &&
           special_[static_cast<std::size_t>(id)] != 0;
  }

 private:
  struct TokenEntry {
    std::string text;   // vocabulary spelling or added-token content
    std::string bytes;  // what decode() writes
    bool present = false;
  };

  void encode_valid(std::string_view text, std::vector<std::int32_t>& out) const;
  void encode_section(std::string_view section, std::vector<std::int32_t>& out) const;
  void encode_pieces(std::string_view text, std::vector<std::int32_t>& out) const;
  // Cuts `text` at the added tokens of `trie`: emit(segment, added index or -1).
  template <class Emit>
  void split_added(std::string_view text, const TokenTrie& trie, Emit&& emit) const;

  std::vector<NormForm> normalizers_;
  tok::PreTokenizer pre_;
  std::unique_ptr<BpeModel> model_;
  std::vector<AddedToken> added_;
  TokenTrie raw_trie_, normalized_trie_;
  std::unordered_map<std::string, std::int32_t> added_by_content_;
  std::unordered_map<std::string, std::int32_t> vocab_;  // vocabulary spelling -> id
  std::vector<TokenEntry> tokens_;
  std::vector<std::uint8_t> special_;
};

BpeTokenizer::BpeTokenizer(const json& root) {
  if (!root.is_object()) fail("top level must be a JSON object");

  // --- model -------------------------------------------------------------------------------
  const auto mit = root.find("model");
  if (mit == root.end() || !mit->is_object()) fail("no \"model\" object");
  const json& model = *mit;
  const auto tit = model.find("type");
  if (tit == model.end() || !tit->is_string()) {
    fail("model has no \"type\" (kvq reads only \"BPE\" models)");
  }
  if (tit->get<std::string>() != "BPE") {
    fail("model type '" + tit->get<std::string>() + "' is not supported (only BPE)");
  }
  const auto vit = model.find("vocab");
  if (vit == model.end() || !vit->is_object()) fail("model has no \"vocab\" object");
  if (vit->empty()) fail("model vocab is empty");
  if (const auto d = model.find("dropout");
      d != model.end() && !d->is_null() && !(d->is_number() && d->get<double>() == 0.0)) {
    fail("BPE dropout is not supported");
  }
  if (const auto b = model.find("byte_fallback");
      b != model.end() && b->is_boolean() && b->get<bool>()) {
    fail("BPE byte_fallback (SentencePiece-style <0xNN> tokens) is not supported");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto it = model.find(key);
    if (it != model.end() && !it->is_null() && !(it->is_string() && it->get<std::string>().empty())) {
      fail(std::string("BPE ") + key + " is not supported");
    }
  }

  const auto& bmap = tok::byte_level_map();
  std::int64_t max_id = -1;
  std::size_t entries = 0;
  std::unordered_map<std::string, std::int32_t> raw_vocab;
  vocab_.reserve(vit->size());
  raw_vocab.reserve(vit->size());
  std::string raw;
  for (const auto& [text, value] : vit->items()) {
    const auto id = parse_id(value, "vocab entry '" + text + "'");
    vocab_[text] = id;
    if (bmap.to_bytes(text, raw)) raw_vocab[raw] = id;
    max_id = std::max<std::int64_t>(max_id, id);
    ++entries;
  }

  std::vector<AddedToken> added;
  if (const auto ait = root.find("added_tokens"); ait != root.end() && !ait->is_null()) {
    if (!ait->is_array()) fail("\"added_tokens\" must be an array");
    for (const auto& a : *ait) {
      if (!a.is_object()) fail("added_tokens: every entry must be an object");
      AddedToken t;
      const auto c = a.find("content");
      if (c == a.end() || !c->is_string()) fail("added_tokens: entry without a \"content\" string");
      t.content = c->get<std::string>();
      const auto i = a.find("id");
      if (i == a.end()) fail("added token '" + t.content + "' has no id");
      t.id = parse_id(*i, "added token '" + t.content + "'");
      auto flag = [&](const char* key, bool fallback) {
        const auto f = a.find(key);
        if (f == a.end() || f->is_null()) return fallback;
        if (!f->is_boolean()) fail("added token '" + t.content + "': \"" + key + "\" must be a boolean");
        return f->get<bool>();
      };
      t.special = flag("special", false);
      t.single_word = flag("single_word", false);
      t.lstrip = flag("lstrip", false);
      t.rstrip = flag("rstrip", false);
      t.normalized = flag("normalized", !t.special);
      if (!tok::is_valid_utf8(t.content)) fail("added token content is not UTF-8");
      max_id = std::max<std::int64_t>(max_id, t.id);
      ++entries;
      if (!t.content.empty()) added.push_back(std::move(t));
    }
  }
  if (max_id >= 2 * static_cast<std::int64_t>(entries) + 65536) {
    fail(fmt::format("token ids are too sparse: largest id {} for {} tokens", max_id, entries));
  }

  std::unordered_map<std::uint64_t, BpeModel::Merge> merges;
  const auto git = model.find("merges");
  if (git == model.end() || !git->is_array()) fail("model has no \"merges\" array");
  merges.reserve(git->size());
  std::int32_t rank = 0;
  for (const auto& m : *git) {
    std::string left, right;
    if (m.is_string()) {
      const auto s = m.get<std::string>();
      const auto space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        fail(fmt::format("merge {} '{}' is not two tokens separated by one space", rank, s));
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      fail(fmt::format("merge {} is neither \"a b\" nor [\"a\", \"b\"]", rank));
    }
    const auto l = vocab_.find(left), r = vocab_.find(right), c = vocab_.find(left + right);
    if (l == vocab_.end() || r == vocab_.end() || c == vocab_.end()) {
      fail(fmt::format("merge {} ('{}' + '{}') uses a token missing from the vocab", rank, left,
                       right));
    }
    merges.insert_or_assign(BpeModel::pair_key(l->second, r->second),
                            BpeModel::Merge{rank, c->second});
    ++rank;
  }

  BpeModel::Options options;
  options.ignore_merges = model.value("ignore_merges", json(false)).is_boolean() &&
                          model.value("ignore_merges", false);
  options.fuse_unk = model.value("fuse_unk", json(false)).is_boolean() && model.value("fuse_unk", false);
  if (const auto u = model.find("unk_token"); u != model.end() && !u->is_null()) {
    if (!u->is_string()) fail("model unk_token must be a string or null");
    const auto it = vocab_.find(u->get<std::string>());
    if (it == vocab_.end()) fail("unk_token '" + u->get<std::string>() + "' is not in the vocab");
    options.unk_id = it->second;
  }
  model_ = std::make_unique<BpeModel>(std::move(raw_vocab), std::move(merges), options);

  // --- id table ----------------------------------------------------------------------------
  tokens_.resize(static_cast<std::size_t>(max_id + 1));
  special_.assign(tokens_.size(), 0);
  for (const auto& [text, id] : vocab_) {
    auto& e = tokens_[static_cast<std::size_t>(id)];
    e.text = text;
    // A vocabulary token with characters outside the byte map decodes to its own UTF-8, as
    // the Hugging Face ByteLevel decoder does.
    if (!bmap.to_bytes(text, e.bytes)) e.bytes = text;
    e.present = true;
  }
  for (std::size_t i = 0; i < added.size(); ++i) {
    const auto& t = added[i];
    auto& e = tokens_[static_cast<std::size_t>(t.id)];
    e.text = t.content;
    e.bytes = t.content;
    e.present = true;
    special_[static_cast<std::size_t>(t.id)] = t.special;
    added_by_content_[t.content] = t.id;
  }

  // --- normalizer, pre-tokenizer, decoder --------------------------------------------------
  if (const auto n = root.find("normalizer"); n != root.end()) parse_normalizer(*n, normalizers_, 0);
  const auto p = root.find("pre_tokenizer");
  pre_ = tok::PreTokenizer::from_json(p == root.end() ? json() : *p);
  if (const auto d = root.find("decoder"); d != root.end()) check_decoder(*d, 0);

  // Added tokens: a token marked normalized is searched for in normalized text, under its
  // normalized spelling, but only when a normalizer is declared at all.
  const bool has_normalizer = root.contains("normalizer") && !root["normalizer"].is_null();
  added_ = std::move(added);
  for (std::size_t i = 0; i < added_.size(); ++i) {
    auto& t = added_[i];
    if (t.normalized && has_normalizer) {
      std::string spelled = t.content;
      for (const auto form : normalizers_) spelled = tok::normalize(spelled, form);
      if (!spelled.empty()) normalized_trie_.add(spelled, static_cast<std::int32_t>(i));
      added_by_content_.emplace(spelled, t.id);
    } else {
      raw_trie_.add(t.content, static_cast<std::int32_t>(i));
    }
  }
}

template <class Emit>
void BpeTokenizer::split_added(std::string_view text, const TokenTrie& trie, Emit&& emit) const {
  if (trie.empty()) {
    emit(text, -1);
    return;
  }
  std::size_t done = 0;  // end of what has been emitted
  std::size_t i = 0;
  while (i < text.size()) {
    if (!trie.can_start(text[i])) {
      ++i;
      continue;
    }
    const auto [len, index] = trie.longest(text, i);
    if (len == 0) {
      ++i;
      continue;
    }
    std::size_t start = i, stop = i + len;
    const auto& t = added_[static_cast<std::size_t>(index)];
    i = stop;
    if (t.single_word) {
      std::size_t p = 0;
      const bool word_before = start > 0 && tok::is_word_char(tok::prev_char(text, start, p));
      std::size_t q = stop;
      const bool word_after = stop < text.size() && tok::is_word_char(tok::next_char(text, q));
      if (word_before || word_after) continue;
    }
    if (t.lstrip) {
      while (start > done) {
        std::size_t p = 0;
        if (!tok::is_white_space(tok::prev_char(text, start, p))) break;
        start = p;
      }
    }
    if (t.rstrip) {
      while (stop < text.size()) {
        std::size_t q = stop;
        if (!tok::is_white_space(tok::next_char(text, q))) break;
        stop = q;
      }
      i = stop;
    }
    if (start > done) emit(text.substr(done, start - done), -1);
    emit(text.substr(start, stop - start), index);
    done = stop;
  }
  if (done < text.size()) emit(text.substr(done), -1);
}

std::vector<std::int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<std::int32_t> out;
  out.reserve(text.size() / 3 + 4);
  for (std::size_t pos = 0; pos < text.size();) {
    const auto valid = tok::valid_utf8_run(text, pos);
    if (valid > 0) encode_valid(text.substr(pos, valid), out);
    pos += valid;
    const auto invalid = tok::invalid_utf8_run(text, pos);
    if (invalid > 0) model_->encode_piece(text.substr(pos, invalid), out);
    pos += invalid;
  }
  return out;
}

void BpeTokenizer::encode_valid(std::string_view text, std::vector<std::int32_t>& out) const {
  split_added(text, raw_trie_, [&](std::string_view seg, std::int32_t index) {
    if (index >= 0) {
      out.push_back(added_[static_cast<std::size_t>(index)].id);
    } else {
      encode_section(seg, out);
    }
  });
}

void BpeTokenizer::encode_section(std::string_view section, std::vector<std::int32_t>& out) const {
  std::string normalized;
  if (!normalizers_.empty()) {
    normalized = std::string(section);
    for (const auto form : normalizers_) normalized = tok::normalize(normalized, form);
    section = normalized;
  }
  split_added(section, normalized_trie_, [&](std::string_view seg, std::int32_t index) {
    if (index >= 0) {
      out.push_back(added_[static_cast<std::size_t>(index)].id);
    } else {
      encode_pieces(seg, out);
    }
  });
}

void BpeTokenizer::encode_pieces(std::string_view text, std::vector<std::int32_t>& out) const {
  pre_.run(text, [&](std::string_view piece) { model_->encode_piece(piece, out); });
}

std::string BpeTokenizer::decode(const std::vector<std::int32_t>& ids) const {
  std::string out;
  for (const auto id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= tokens_.size() ||
        !tokens_[static_cast<std::size_t>(id)].present) {
      fail(fmt::format("decode: token id {} is not in the vocabulary (size {})", id, tokens_.size()));
    }
    out += tokens_[static_cast<std::size_t>(id)].bytes;
  }
  return out;
}

std::string BpeTokenizer::token_text(std::int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= tokens_.size() ||
      !tokens_[static_cast<std::size_t>(id)].present) {
    fail(fmt::format("token id {} is not in the vocabulary (size {})", id, tokens_.size()));
  }
  return tokens_[static_cast<std::size_t>(id)].text;
}

std::int32_t BpeTokenizer::token_id(std::string_view content) const {
  const std::string key(content);
  if (const auto it = added_by_content_.find(key); it != added_by_content_.end()) return it->second;
  if (const auto it = vocab_.find(key); it != vocab_.end()) return it->second;
  return -1;
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_json(std::string_view text, const std::string& label) {
  json root;
  try {
    root = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    fail(label + ": malformed JSON: " + e.what());
  }
  try {
    return std::make_unique<BpeTokenizer>(root);
  } catch (const Error& e) {
    fail(label + ": " + e.what());
  } catch (const json::exception& e) {
    fail(label + ": invalid tokenizer.json: " + e.what());
  }
}

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path + ": cannot open tokenizer file");
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) fail(path + ": read error");
  return from_json(buf.str(), path);
}

}  // namespace kvq
