// Split / Digits / ByteLevel / Sequence pre-tokenizers (see pretokenizer.hpp). The delimiter
// behaviours follow the Hugging Face tokenizers library: a text is first cut into alternating
// matched and unmatched segments, which the behaviour then drops, isolates or merges.
#include "pretokenizer.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>

#include "kvq/common.hpp"
#include "text.hpp"

namespace kvq::tok {

const char* const kGpt2SplitRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

namespace {

using json = nlohmann::json;

struct Segment {
  std::size_t begin;
  std::size_t end;
  bool match;
};

std::string type_of(const json& j, const char* what) {
  if (!j.is_object()) fail(std::string(what) + " must be an object");
  const auto it = j.find("type");
  if (it == j.end() || !it->is_string()) fail(std::string(what) + " has no \"type\" string");
  return it->get<std::string>();
}

bool bool_field(const json& j, const char* key, bool fallback) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) fail(std::string("\"") + key + "\" must be true or false");
  return it->get<bool>();
}

SplitBehavior parse_behavior(const json& j) {
  const auto it = j.find("behavior");
  if (it == j.end() || !it->is_string()) fail("Split pre-tokenizer has no \"behavior\" string");
  const auto b = it->get<std::string>();
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  fail("Split pre-tokenizer: unknown behavior '" + b + "'");
}

void parse_into(const json& j, std::vector<PreTokenizerStep>& steps, int depth) {
  if (depth > 8) fail("pre_tokenizer: Sequence nested too deeply");
  const auto type = type_of(j, "pre_tokenizer");
  PreTokenizerStep step;
  if (type == "Sequence") {
    const auto it = j.find("pretokenizers");
    if (it == j.end() || !it->is_array()) fail("Sequence pre-tokenizer has no \"pretokenizers\" array");
    for (const auto& sub : *it) parse_into(sub, steps, depth + 1);
    return;
  }
  if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    step.add_prefix_space = bool_field(j, "add_prefix_space", false);
    if (bool_field(j, "use_regex", true)) step.regex = std::make_shared<Regex>(kGpt2SplitRegex);
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::kSplit;
    const auto pat = j.find("pattern");
    if (pat == j.end() || !pat->is_object()) fail("Split pre-tokenizer has no \"pattern\" object");
    if (const auto r = pat->find("Regex"); r != pat->end() && r->is_string()) {
      step.regex = std::make_shared<Regex>(r->get<std::string>());
    } else if (const auto s = pat->find("String"); s != pat->end() && s->is_string()) {
      step.literal = s->get<std::string>();
      if (step.literal.empty()) fail("Split pre-tokenizer: empty String pattern");
      if (!is_valid_utf8(step.literal)) fail("Split pre-tokenizer: String pattern is not UTF-8");
    } else {
      fail("Split pre-tokenizer: pattern must hold a \"Regex\" or a \"String\"");
    }
    step.behavior = parse_behavior(j);
    step.invert = bool_field(j, "invert", false);
  } else if (type == "Digits") {
    step.kind = PreTokenizerStep::Kind::kDigits;
    step.individual_digits = bool_field(j, "individual_digits", false);
  } else {
    fail("pre-tokenizer type '" + type +
         "' is not supported (kvq reads byte-level BPE: ByteLevel, Split, Digits, Sequence)");
  }
  steps.push_back(std::move(step));
}

// Alternating matched / unmatched segments covering [0, n), without empty ones.
void segments_from_matches(std::size_t n,
                           const std::vector<std::pair<std::size_t, std::size_t>>& matches,
                           std::vector<Segment>& out) {
  std::size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (b > prev) out.push_back({prev, b, false});
    out.push_back({b, e, true});
    prev = e;
  }
  if (prev < n) out.push_back({prev, n, false});
}

void apply_behavior(SplitBehavior behavior, const std::vector<Segment>& segs,
                    std::vector<Segment>& out) {
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const auto& s : segs)
        if (!s.match) out.push_back(s);
      break;
    case SplitBehavior::kIsolated:
      out = segs;
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const auto& s : segs) {
        if (s.match && !previous_match && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back(s);
        }
        previous_match = s.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool next_match = false;
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        if (it->match && !next_match && !out.empty()) {
          out.back().begin = it->begin;
        } else {
          out.push_back(*it);
        }
        next_match = it->match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const auto& s : segs) {
        if (s.match == previous_match && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back(s);
        }
        previous_match = s.match;
      }
      break;
    }
  }
}

}  // namespace

PreTokenizer PreTokenizer::from_json(const json& j) {
  if (j.is_null()) {
    fail("no pre_tokenizer: kvq reads byte-level BPE, which needs a ByteLevel pre-tokenizer");
  }
  PreTokenizer p;
  parse_into(j, p.steps_, 0);
  std::size_t byte_level = 0;
  for (const auto& s : p.steps_) byte_level += s.kind == PreTokenizerStep::Kind::kByteLevel;
  if (byte_level == 0) {
    fail("pre_tokenizer has no ByteLevel step: only byte-level BPE is supported");
  }
  if (byte_level > 1 || p.steps_.back().kind != PreTokenizerStep::Kind::kByteLevel) {
    fail("pre_tokenizer: ByteLevel must be the last step, and only once");
  }
  return p;
}

void PreTokenizer::run(std::string_view text,
                       const std::function<void(std::string_view)>& emit) const {
  run_from(0, text, emit);
}

void PreTokenizer::run_from(std::size_t index, std::string_view text,
                            const std::function<void(std::string_view)>& emit) const {
  if (text.empty()) return;
  if (index == steps_.size()) {
    emit(text);
    return;
  }
  const auto& step = steps_[index];
  std::string prefixed;
  if (step.kind == PreTokenizerStep::Kind::kByteLevel && step.add_prefix_space &&
      text.front() != ' ') {
    prefixed.reserve(text.size() + 1);
    prefixed += ' ';
    prefixed.append(text);
    text = prefixed;
  }
  std::vector<std::pair<std::size_t, std::size_t>> matches;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  switch (step.kind) {
    case PreTokenizerStep::Kind::kByteLevel:
      if (!step.regex) {
        run_from(index + 1, text, emit);
        return;
      }
      step.regex->find_all(text, matches);
      break;
    case PreTokenizerStep::Kind::kSplit:
      behavior = step.behavior;
      invert = step.invert;
      if (step.regex) {
        step.regex->find_all(text, matches);
      } else {
        for (auto pos = text.find(step.literal); pos != std::string_view::npos;
             pos = text.find(step.literal, pos + step.literal.size()))
          matches.emplace_back(pos, pos + step.literal.size());
      }
      break;
    case PreTokenizerStep::Kind::kDigits: {
      behavior = step.individual_digits ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
      for (std::size_t pos = 0; pos < text.size();) {
        const std::size_t start = pos;
        if (is_numeric(next_char(text, pos))) matches.emplace_back(start, pos);
      }
      break;
    }
  }
  std::vector<Segment> segs, pieces;
  segments_from_matches(text.size(), matches, segs);
  if (invert)
    for (auto& s : segs) s.match = !s.match;
  apply_behavior(behavior, segs, pieces);
  for (const auto& s : pieces) run_from(index + 1, text.substr(s.begin, s.end - s.begin), emit);
}

}  // namespace kvq::tok
