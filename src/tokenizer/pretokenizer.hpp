// Pre-tokenization: cuts a normalized text section into the pieces that BPE merges within.
//
// Supported tokenizer.json forms: ByteLevel (with or without GPT-2's split regex,
// add_prefix_space), Split (regex or literal pattern, the five delimiter behaviours, invert),
// Digits, and Sequence of those, which is how Llama-3, Qwen2/3 and DeepSeek-V3 chain their
// split regexes in front of a regex-free ByteLevel. ByteLevel must come last: the vocabulary is
// byte-level, and a piece leaves this stage as raw bytes (the byte-to-character mapping is
// folded into the vocabulary instead of being applied to the text).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "regex.hpp"

namespace kvq::tok {

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum class Kind { kSplit, kDigits, kByteLevel };
  Kind kind = Kind::kSplit;
  std::shared_ptr<const Regex> regex;  // Split with a Regex pattern; ByteLevel with use_regex
  std::string literal;                 // Split with a String pattern
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool individual_digits = false;
  bool add_prefix_space = false;
};

class PreTokenizer {
 public:
  // Parses the "pre_tokenizer" value; kvq::Error (without the file name: the caller adds it)
  // on anything unsupported.
  static PreTokenizer from_json(const nlohmann::json& j);

  // Calls emit(piece) for each non-empty piece of `text` (valid UTF-8), in order.
  void run(std::string_view text, const std::function<void(std::string_view)>& emit) const;

  const std::vector<PreTokenizerStep>& steps() const { return steps_; }

 private:
  void run_from(std::size_t step, std::string_view text,
                const std::function<void(std::string_view)>& emit) const;
  std::vector<PreTokenizerStep> steps_;
};

// GPT-2's split regex, which ByteLevel applies when use_regex is true.
extern const char* const kGpt2SplitRegex;

}  // namespace kvq::tok
