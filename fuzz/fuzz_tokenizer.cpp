// libFuzzer target: arbitrary bytes as tokenizer.json. Loading must either succeed or throw
// kvq::Error; a loaded tokenizer must encode a fixed text that touches every pipeline stage
// (added-token lookalikes, white-space runs, digits, CJK, emoji, combining marks, invalid
// UTF-8) and decode the ids it produced. Any other exception, crash, leak or undefined
// behaviour is a finding.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvq/common.hpp"
#include "kvq/tokenizer.hpp"

namespace {
constexpr std::string_view kText =
    "Hello world! It's 2024-05-31, they'll say: 12345 apples.\n\n\t  indented  \r\n"
    "<|bos|>x<|eos|> <s> [MASK] <｜User｜>中文テスト 한국어 👍🏽 e\xcc\x81 \xc2\xa0\xe3\x80\x80 "
    "\xff\xfe broken \xed\xa0\x80 end";
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto tk = kvq::Tokenizer::from_json(
        std::string_view(reinterpret_cast<const char*>(data), size), "fuzz-input.json");
    const auto ids = tk->encode(kText);
    (void)tk->decode(ids);
    for (const auto id : ids) (void)tk->token_text(id);
    (void)tk->token_id("<|eos|>");
    (void)tk->vocab_size();
  } catch (const kvq::Error&) {
    // Rejecting a malformed or unsupported file is the expected outcome for most inputs.
  }
  return 0;
}
