// The perplexity protocol (kvq/eval.hpp): document splitting, the token stream, the window
// arithmetic (117 full windows of 2048 on data/validation.txt), and perplexity_windows against a
// direct computation over the same windows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "kvq/common.hpp"
#include "kvq/eval.hpp"
#include "kvq/tokenizer.hpp"
#include "test_util.hpp"

namespace kvq::test {
namespace {

std::string read_text(const std::string& rel) {
  std::ifstream f(src_path(rel), std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(Eval, SplitDocuments) {
  EXPECT_EQ(split_documents("a\nb\n\nc"), (std::vector<std::string>{"a\nb", "c"}));
  EXPECT_EQ(split_documents("\n\na\n \t\n\n\nb\n"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(split_documents("one line"), (std::vector<std::string>{"one line"}));
  EXPECT_TRUE(split_documents("").empty());
  EXPECT_TRUE(split_documents("\n  \n\n").empty());
}

TEST(Eval, TokenStreamAppendsEosPerDocument) {
  const auto enc = [](std::string_view s) { return std::vector<std::int32_t>(s.size(), 7); };
  EXPECT_EQ(ppl_token_stream("ab\n\ncde", enc, 1), (std::vector<std::int32_t>{7, 7, 1, 7, 7, 7, 1}));
  try {
    ppl_token_stream(" \n\n", enc, 1);
    ADD_FAILURE() << "empty text accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("empty text"), std::string::npos);
  }
}

TEST(Eval, FullWindows) {
  EXPECT_EQ(ppl_full_windows(2046, 2048), 0);
  EXPECT_EQ(ppl_full_windows(2047, 2048), 1);
  EXPECT_EQ(ppl_full_windows(4094, 2048), 1);
  EXPECT_EQ(ppl_full_windows(4095, 2048), 2);
  EXPECT_THROW(ppl_full_windows(10, 1), Error);
}

TEST(Eval, ValidationTextHas117Windows) {
  auto tok = Tokenizer::load(src_path("models/tiny-gqa/tokenizer.json"));
  const auto stream =
      ppl_token_stream(read_text("data/validation.txt"), [&](std::string_view s) { return tok->encode(s); }, 1);
  std::printf("[ measure  ] validation.txt: %zu tokens in the protocol stream\n", stream.size());
  // @huggingface/tokenizers: 239,828 tokens over the 30 documents (tests/data/tokenizer/
  // reference_tiny.json), plus one <|eos|> each.
  EXPECT_EQ(stream.size(), 239858u);
  EXPECT_EQ(ppl_full_windows(stream.size(), 2048), 117);
  EXPECT_EQ(stream.back(), 1);
  // The fixture's cache dump is validation text that transformers tokenized: the stream must hold it.
  SafetensorsFile ref(src_path("models/tiny-gqa/reference.safetensors"));
  const auto dump = ids_of(ref.get("kv_input_ids"));
  const auto it = std::search(stream.begin(), stream.end(), dump.begin() + 1, dump.end());
  EXPECT_NE(it, stream.end()) << "kv_input_ids[1:] not found in the stream";
}

TEST(Eval, PerplexityWindowsEqualsDirectComputation) {
  auto m = Model::load(src_path("models/tiny-gqa"));
  SafetensorsFile ref(src_path("models/tiny-gqa/reference.safetensors"));
  const auto stream = ids_of(ref.get("kv_input_ids"));  // 512 tokens
  const int ctx = 96;
  PerplexityOptions opt;
  opt.ctx = ctx;
  opt.windows = 3;
  opt.bos_id = 0;
  opt.make_cache = [](const CacheGeometry& g) { return make_dense_cache(g, 1, 0, DenseStorage::kF32); };
  int calls = 0;
  opt.progress = [&](int done, int total, double) {
    ++calls;
    EXPECT_EQ(total, 3);
    EXPECT_EQ(done, calls);
  };
  const auto r = perplexity_windows(*m, stream, opt);
  EXPECT_EQ(r.windows, 3);
  EXPECT_EQ(r.predictions, 3 * (ctx - 1));
  EXPECT_EQ(calls, 3);
  // Direct: window k = [bos] + stream[ctx*k, ctx*k + ctx - 1), NLL in double.
  double total = 0.0;
  const int V = m->config().vocab_size;
  for (int k = 0; k < 3; ++k) {
    std::vector<std::int32_t> w{0};
    w.insert(w.end(), stream.begin() + ctx * k, stream.begin() + ctx * k + ctx - 1);
    const auto logits = run_all(*m, w);
    for (int i = 0; i + 1 < ctx; ++i) {
      const float* row = logits.data() + static_cast<std::size_t>(i) * V;
      double mx = row[0], z = 0.0;
      for (int v = 1; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
      for (int v = 0; v < V; ++v) z += std::exp(row[v] - mx);
      total += std::log(z) + mx - row[w[i + 1]];
    }
  }
  const double want = std::exp(total / (3.0 * (ctx - 1)));
  std::printf("[ measure  ] 3 windows of %d: ppl %.6f (library) vs %.6f (direct)\n", ctx, r.ppl, want);
  EXPECT_NEAR(r.ppl, want, 1e-5 * want);
  opt.windows = 6;  // (512 - 95) / 96 + 1 = 5 full windows
  EXPECT_THROW(perplexity_windows(*m, stream, opt), Error);
}

}  // namespace
}  // namespace kvq::test
