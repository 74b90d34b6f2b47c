// UTF-8 scanning, Unicode predicates and normalization for the tokenizer (see text.hpp).
#include "text.hpp"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "kvq/common.hpp"

namespace kvq::tok {

namespace {

// Length of the well-formed character starting at s[pos], or 0 (RFC 3629 table 3-7).
std::size_t char_len(std::string_view s, std::size_t pos) {
  const auto n = s.size() - pos;
  const auto b0 = static_cast<unsigned char>(s[pos]);
  if (b0 < 0x80) return 1;
  auto cont = [&](std::size_t i, unsigned lo = 0x80, unsigned hi = 0xBF) {
    if (i >= n) return false;
    const auto b = static_cast<unsigned char>(s[pos + i]);
    return b >= lo && b <= hi;
  };
  if (b0 >= 0xC2 && b0 <= 0xDF) return cont(1) ? 2 : 0;
  if (b0 == 0xE0) return cont(1, 0xA0) && cont(2) ? 3 : 0;
  if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) return cont(1) && cont(2) ? 3 : 0;
  if (b0 == 0xED) return cont(1, 0x80, 0x9F) && cont(2) ? 3 : 0;
  if (b0 == 0xF0) return cont(1, 0x90) && cont(2) && cont(3) ? 4 : 0;
  if (b0 >= 0xF1 && b0 <= 0xF3) return cont(1) && cont(2) && cont(3) ? 4 : 0;
  if (b0 == 0xF4) return cont(1, 0x80, 0x8F) && cont(2) && cont(3) ? 4 : 0;
  return 0;
}

}  // namespace

std::size_t valid_utf8_run(std::string_view s, std::size_t pos) {
  std::size_t i = pos;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const auto len = char_len(s, i);
    if (len == 0) break;
    i += len;
  }
  return i - pos;
}

std::size_t invalid_utf8_run(std::string_view s, std::size_t pos) {
  std::size_t i = pos;
  while (i < s.size() && char_len(s, i) == 0) ++i;
  return i - pos;
}

bool is_valid_utf8(std::string_view s) { return valid_utf8_run(s, 0) == s.size(); }

char32_t next_char(std::string_view s, std::size_t& pos) {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  if (b0 < 0x80) {
    ++pos;
    return b0;
  }
  int extra = b0 >= 0xF0 ? 3 : b0 >= 0xE0 ? 2 : 1;
  char32_t c = b0 & (0x3F >> extra);
  ++pos;
  for (; extra > 0 && pos < s.size(); --extra, ++pos)
    c = (c << 6) | (static_cast<unsigned char>(s[pos]) & 0x3F);
  return c;
}

char32_t prev_char(std::string_view s, std::size_t end, std::size_t& start) {
  start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  std::size_t p = start;
  return next_char(s, p);
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

bool is_white_space(char32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D);
  if (c < 0x85) return false;
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_word_char(char32_t c) {
  if (c < 0x80) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

bool is_numeric(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

std::string normalize(std::string_view text, NormForm form) {
  // Text below U+0300 (lead bytes < 0xCC) is already in NFC: nothing there decomposes under
  // canonical composition and every combining mark lies above. The other forms rewrite some
  // Latin-1 characters (e-acute, U+00A0...), so only ASCII is safe for them.
  const unsigned char limit = form == NormForm::kNFC ? 0xCC : 0x80;
  bool trivial = true;
  for (const char ch : text) {
    if (static_cast<unsigned char>(ch) >= limit) {
      trivial = false;
      break;
    }
  }
  if (trivial) return std::string(text);
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormForm::kNFC: options |= UTF8PROC_COMPOSE; break;
    case NormForm::kNFD: options |= UTF8PROC_DECOMPOSE; break;
    case NormForm::kNFKC: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormForm::kNFKD: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* out = nullptr;
  const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                              static_cast<utf8proc_ssize_t>(text.size()), &out,
                              static_cast<utf8proc_option_t>(options));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> guard(out, &std::free);
  if (n < 0) fail(std::string("Unicode normalization failed: ") + utf8proc_errmsg(n));
  return std::string(reinterpret_cast<const char*>(out), static_cast<std::size_t>(n));
}

ByteLevelMap::ByteLevelMap() {
  to_byte.fill(-1);
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
    to_char[b] = c;
    to_byte[c] = static_cast<std::int16_t>(b);
  }
}

bool ByteLevelMap::to_bytes(std::string_view token, std::string& out) const {
  out.clear();
  if (!is_valid_utf8(token)) return false;
  for (std::size_t pos = 0; pos < token.size();) {
    const char32_t c = next_char(token, pos);
    if (c >= to_byte.size() || to_byte[c] < 0) return false;
    out += static_cast<char>(to_byte[c]);
  }
  return true;
}

std::string ByteLevelMap::to_token(std::string_view bytes) const {
  std::string out;
  for (const char ch : bytes) append_utf8(out, to_char[static_cast<unsigned char>(ch)]);
  return out;
}

const ByteLevelMap& byte_level_map() {
  static const ByteLevelMap map;
  return map;
}

}  // namespace kvq::tok
