// Text helpers for the tokenizer: strict UTF-8 scanning, the few Unicode predicates the
// added-token rules need (White_Space, "word" characters), Unicode normalization through
// utf8proc, and GPT-2's byte <-> printable-character map that byte-level BPE vocabularies use.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvq::tok {

// Length of the longest prefix of s[pos..] that is well-formed UTF-8 (no overlongs, no
// surrogates, nothing above U+10FFFF, no truncated sequence).
std::size_t valid_utf8_run(std::string_view s, std::size_t pos);
// Length of the run of bytes at s[pos..] that cannot start a well-formed character
// (at least 1 when s[pos] itself is bad, 0 when s[pos..] starts with a valid character).
std::size_t invalid_utf8_run(std::string_view s, std::size_t pos);
bool is_valid_utf8(std::string_view s);

// Decodes the character at s[pos] (s must be valid UTF-8 there) and advances pos past it.
char32_t next_char(std::string_view s, std::size_t& pos);
// Decodes the character that ends at s[end] (exclusive), returning its start in `start`.
char32_t prev_char(std::string_view s, std::size_t end, std::size_t& start);
void append_utf8(std::string& out, char32_t c);

// The Unicode White_Space property (what Rust's char::is_whitespace and Oniguruma's \s use).
bool is_white_space(char32_t c);
// Regex \w in Unicode mode: letters, marks, decimal digits, connector punctuation.
bool is_word_char(char32_t c);
// General category N* (Rust's char::is_numeric).
bool is_numeric(char32_t c);

enum class NormForm { kNFC, kNFD, kNFKC, kNFKD };
// Normalizes valid UTF-8 text; kvq::Error when utf8proc reports a failure.
std::string normalize(std::string_view text, NormForm form);

// GPT-2 bytes_to_unicode: bytes that are printable Latin-1 map to themselves, the other 68
// bytes to U+0100 + k in byte order, so that every byte has a visible one-character stand-in.
struct ByteLevelMap {
  std::array<char32_t, 256> to_char{};
  std::array<std::int16_t, 324> to_byte{};  // indexed by code point < 324, -1 where none
  ByteLevelMap();
  // Raw bytes of a byte-level token string; false if some character has no byte.
  bool to_bytes(std::string_view token, std::string& out) const;
  std::string to_token(std::string_view bytes) const;
};
const ByteLevelMap& byte_level_map();

}  // namespace kvq::tok
