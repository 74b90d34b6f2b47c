// PCRE2 wrapper used by the Split and ByteLevel pre-tokenizers (see regex.hpp).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "regex.hpp"

#include <pcre2.h>

#include "kvq/common.hpp"
#include "text.hpp"

namespace kvq::tok {

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  if (pcre2_get_error_message(code, buf, sizeof buf) < 0) return "error " + std::to_string(code);
  return reinterpret_cast<const char*>(buf);
}

// Per-thread matching state: the compiled pattern is shared, match data and the JIT stack
// are not thread-safe.
struct MatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, nullptr);
    if (!data || !context) fail("regex: out of memory");
    pcre2_set_match_limit(context, 20'000'000);
    pcre2_set_heap_limit(context, 64 * 1024);  // KiB
    if (stack) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchState() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
  }
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

}  // namespace

std::string rewrite_whitespace_classes(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 32);
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i] != '\\' || i + 1 == p.size()) {
      out += p[i];
      continue;
    }
    const char next = p[i + 1];
    if (next == 's') {
      out += "\\p{White_Space}";
    } else if (next == 'S') {
      out += "\\P{White_Space}";
    } else if (next == 'Q') {  // \Q...\E quotes its content literally
      const auto end = p.find("\\E", i + 2);
      const auto stop = end == std::string_view::npos ? p.size() : end + 2;
      out.append(p.substr(i, stop - i));
      i = stop - 1;
      continue;
    } else {
      out += '\\';
      out += next;
    }
    ++i;
  }
  return out;
}

Regex::Regex(std::string_view pattern) : source_(pattern) {
  const std::string rewritten = rewrite_whitespace_classes(pattern);
  int err = 0;
  PCRE2_SIZE offset = 0;
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                             PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
  if (!code) {
    fail("regex '" + source_ + "' does not compile: " + pcre2_message(err) + " at offset " +
         std::to_string(offset));
  }
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Regex::find_all(std::string_view text,
                     std::vector<std::pair<std::size_t, std::size_t>>& out) const {
  auto* code = static_cast<pcre2_code*>(code_);
  auto& st = match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t pos = 0;
  while (pos <= text.size()) {
    int rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, st.data, st.context);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // Deep backtracking outgrew the JIT stack: the interpreter keeps its state on the heap.
      rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                       st.data, st.context);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) fail("regex '" + source_ + "': matching failed: " + pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
    const std::size_t b = ov[0], e = ov[1];
    if (e > b && e <= text.size()) {
      out.emplace_back(b, e);
      pos = e;
      continue;
    }
    // An empty match (or a \K inside a lookaround reporting its start after its end): step
    // one character past the later of the match end and the current position.
    std::size_t p = e > pos ? e : pos;
    if (p >= text.size()) break;
    next_char(text, p);
    pos = p;
  }
}

}  // namespace kvq::tok
