// kvq/tokenizer.hpp: Hugging Face tokenizer.json byte-level BPE.
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
  // as the tokenizer declares).
  virtual std::vector<std::int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<std::int32_t>& ids) const = 0;
  virtual std::string token_text(std::int32_t id) const = 0;
  virtual int vocab_size() const = 0;
  // Id of a special / added token by its content, or -1.
  virtual std::int32_t token_id(std::string_view content) const = 0;
};

}  // namespace kvq
