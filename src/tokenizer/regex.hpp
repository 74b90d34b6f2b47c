// A compiled PCRE2 pattern (UTF + UCP, JIT when available) for the pre-tokenizer splits.
//
// Hugging Face compiles tokenizer.json regexes with Oniguruma, where \s is the Unicode
// White_Space property; PCRE2's \s differs at the edges, so \s and \S are rewritten to
// \p{White_Space} / \P{White_Space} before compiling. Matching is bounded (match and heap
// limits) so that a hostile pattern fails with kvq::Error instead of running for ever.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvq::tok {

class Regex {
 public:
  // kvq::Error with PCRE2's message and the offset on a pattern that does not compile.
  explicit Regex(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Byte ranges [begin, end) of the successive non-empty matches in `text` (valid UTF-8),
  // scanning left to right as a global JavaScript or Rust find-all does.
  void find_all(std::string_view text, std::vector<std::pair<std::size_t, std::size_t>>& out) const;

  const std::string& pattern() const { return source_; }

 private:
  std::string source_;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

// The pattern with \s / \S replaced by the White_Space property (exposed for tests).
std::string rewrite_whitespace_classes(std::string_view pattern);

}  // namespace kvq::tok
