// kvq/tokenizer.hpp: Hugging Face tokenizer.json byte-level BPE.
//
// Reads the tokenizer.json of GPT-2-style, Llama-3, Qwen2/3 and DeepSeek-V2/V3 models and
// produces the ids the Hugging Face tokenizers library produces (docs/tokenizer.md lists what
// is supported and how that is checked). Anything outside that set is a kvq::Error at load time,
// never a silent approximation.
//
// Text contract: decode(encode(x)) == x for every byte string x when the tokenizer declares no
// normalizer (with one, such as Qwen's NFC, decode gives the normalized text, as Hugging Face
// does). Valid UTF-8 goes through the full pipeline (added tokens, normalizer, pre-tokenizer,
// BPE). Bytes that are not well-formed UTF-8 do not raise: each maximal run of them becomes a
// piece of its own, encoded through the byte-level vocabulary (byte fallback), and the valid
// text on either side is tokenized as if the run were a boundary. decode() returns the raw
// bytes of the tokens, so a prefix of a sequence may end inside a multi-byte character.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvq {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Loads tokenizer.json; kvq::Error naming the file on anything malformed or unsupported.
  static std::unique_ptr<Tokenizer> load(const std::string& path);
  // Parses tokenizer.json text (for the fuzzer); `label` names it in errors.
  static std::unique_ptr<Tokenizer> from_json(std::string_view json, const std::string& label);

  // Encodes text (no BOS/EOS added; special tokens written literally in the text are matched
  // as the tokenizer declares). Thread-safe.
  virtual std::vector<std::int32_t> encode(std::string_view text) const = 0;
  // Concatenated bytes of the tokens (added tokens give their content); kvq::Error on an id
  // that names no token.
  virtual std::string decode(const std::vector<std::int32_t>& ids) const = 0;
  // The token as the vocabulary spells it (byte-level characters, e.g. "Ġthe"), or the content
  // of an added token; kvq::Error on an id that names no token.
  virtual std::string token_text(std::int32_t id) const = 0;
  // One more than the largest id of the vocabulary and the added tokens.
  virtual int vocab_size() const = 0;
  // Id of a special / added token by its content, else of a vocabulary token by its
  // vocabulary spelling, or -1.
  virtual std::int32_t token_id(std::string_view content) const = 0;
  // True for added tokens marked "special" (BOS, EOS, chat markers).
  virtual bool is_special(std::int32_t id) const = 0;
};

}  // namespace kvq
