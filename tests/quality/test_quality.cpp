// kvq eval's pieces: cache-configuration parsing, needle samples (exact length, answer at the
// end, stratified depths, deterministic), and the honest-evaluation property: prefill through
// a packed cache gives the same logits as token-by-token decode (every query sees packed rows
// as decode would), plus an end-to-end evaluate_model on a short window.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/common.hpp"
#include "kvq/eval.hpp"
#include "kvq/model.hpp"
#include "kvq/paged_cache.hpp"
#include "kvq/quality.hpp"
#include "kvq/tokenizer.hpp"

using namespace kvq;

namespace {
std::string src(const std::string& rel) { return std::string(KVQ_SOURCE_DIR) + "/" + rel; }
std::string read(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
}  // namespace

TEST(Quality, ParseCacheConfig) {
  const auto a = parse_cache_config("c4r4@paper", {});
  EXPECT_EQ(a.format, "c4r4");
  EXPECT_EQ(a.protect.sinks, 4);
  EXPECT_EQ(a.protect.window, 128);
  const auto b = parse_cache_config("tq-3bit@s2,w16,n1", {});
  EXPECT_EQ(b.protect.sinks, 2);
  EXPECT_EQ(b.protect.window, 16);
  EXPECT_EQ(b.protect.boundary_layers, 1);
  const auto c = parse_cache_config("tq-3bit", {1, 2, 3});
  EXPECT_EQ(c.protect.window, 2);
  EXPECT_THROW(parse_cache_config("tq-3bit@x5", {}), Error);
  EXPECT_THROW(parse_cache_config("tq-3bit@s-1", {}), Error);
  EXPECT_THROW(parse_cache_config("q8_0", {}), Error);
}

TEST(Quality, NeedleWords) {
  const auto w = needle_words("The kernel uses spinlocks, RCU and kmalloc() in fs/ext4; data2 is bad. alpha beta gamma alpha");
  for (const auto& s : w) {
    EXPECT_GE(s.size(), 4u);
    EXPECT_LE(s.size(), 9u);
    for (char ch : s) EXPECT_TRUE(ch >= 'a' && ch <= 'z') << s;
  }
  EXPECT_NE(std::find(w.begin(), w.end(), "kernel"), w.end());
  EXPECT_EQ(std::find(w.begin(), w.end(), "data2"), w.end());
  EXPECT_EQ(std::find(w.begin(), w.end(), "The"), w.end());
  EXPECT_EQ(std::count(w.begin(), w.end(), "alpha"), 1);
}

TEST(Quality, NeedleSamplesFollowTheProtocol) {
  auto tok = Tokenizer::load(src("models/tiny-gqa/tokenizer.json"));
  const auto stream = ppl_token_stream(read(src("data/validation.txt")), [&](std::string_view s) { return tok->encode(s); }, 1);
  const auto words = needle_words(read(src("data/validation-tech.txt")));
  ASSERT_GT(words.size(), 100u);
  for (int len : {256, 2000}) {
    const auto a = make_needle_samples(*tok, stream, words, len, 20, 7, 0);
    const auto b = make_needle_samples(*tok, stream, words, len, 20, 7, 0);
    ASSERT_EQ(a.size(), 20u);
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(static_cast<int>(a[i].tokens.size()), len);
      EXPECT_EQ(a[i].tokens, b[i].tokens);
      EXPECT_EQ(a[i].tokens[0], 0);
      EXPECT_GE(a[i].depth, (i % 10) / 10.0);
      EXPECT_LT(a[i].depth, (i % 10 + 1) / 10.0);
      // The answer is " D D D D D D." and the question precedes it.
      const std::vector<std::int32_t> ans(a[i].tokens.begin() + a[i].answer_start, a[i].tokens.end());
      const std::string at = tok->decode(ans);
      ASSERT_EQ(at.size(), 13u) << at;
      EXPECT_EQ(at.back(), '.');
      const std::vector<std::int32_t> all(a[i].tokens.begin() + 1, a[i].tokens.end());
      const std::string text = tok->decode(all);
      const std::string code = at.substr(1, 11);
      EXPECT_NE(text.find("The secret code for "), std::string::npos);
      EXPECT_NE(text.find(" is " + code + ". "), std::string::npos) << text.substr(0, 200);
      EXPECT_NE(text.find("What is the secret code for "), std::string::npos);
    }
  }
}

// Prefill (one forward of n tokens) and decode (n forwards of one token) through a packed cache
// with protection give the same logits: prefill sees packed rows exactly as decode does. The
// model computes K/V rows with a GEMM in prefill and a GEMV in decode, so a row can differ in
// its last fp32 bit and round to a neighbouring bf16 value in the protected window: that limits
// agreement to about 1e-4 (without protection the formats agree to 1e-6). The bound 5e-4 is 20x
// below what reading bf16 rows instead of packed ones changes (checked below, > 1e-2).
TEST(Quality, PrefillSeesTheCacheAsDecodeDoes) {
  for (const char* dir : {"models/tiny-gqa", "models/tiny-mla"}) {
    auto model = Model::load(src(dir));
    const auto geo = model->cache_geometry();
    const std::string fmt = geo.mla ? "c2r4" : "tq-3bit-nc";
    CacheOptions o;
    o.format = fmt;
    o.protect = {2, 8, 0};
    PagedCache a(geo, o), b(geo, o);
    auto tok = Tokenizer::load(src(std::string(dir) + "/tokenizer.json"));
    auto ids = tok->encode("The secret code for kernel is 1 2 3 4 5 6. The quick brown fox jumps over the lazy dog again and again.");
    ids.insert(ids.begin(), 0);
    const int n = static_cast<int>(ids.size());
    const int V = model->config().vocab_size;
    std::vector<float> la(static_cast<std::size_t>(n) * static_cast<std::size_t>(V)), lb(la.size());
    model->forward(ids.data(), n, a, 0, la.data(), LogitsMode::kAll);
    for (int i = 0; i < n; ++i) model->forward(&ids[static_cast<std::size_t>(i)], 1, b, 0, &lb[static_cast<std::size_t>(i) * static_cast<std::size_t>(V)], LogitsMode::kLast);
    double num = 0, den = 0;
    for (std::size_t i = 0; i < la.size(); ++i) {
      num += (static_cast<double>(la[i]) - lb[i]) * (static_cast<double>(la[i]) - lb[i]);
      den += static_cast<double>(lb[i]) * lb[i];
    }
    const double same = std::sqrt(num / den);
    std::printf("%s: prefill vs decode %.3g\n", dir, same);
    EXPECT_LT(same, 5e-4) << dir;
    // And a bf16 cache differs from the packed one: the packed rows are really read.
    PagedCache c(geo, CacheOptions{});
    std::vector<float> lc(la.size());
    model->forward(ids.data(), n, c, 0, lc.data(), LogitsMode::kAll);
    double d2 = 0;
    for (std::size_t i = 0; i < la.size(); ++i) d2 += (static_cast<double>(la[i]) - lc[i]) * (static_cast<double>(la[i]) - lc[i]);
    std::printf("%s: packed vs bf16 %.3g\n", dir, std::sqrt(d2 / den));
    EXPECT_GT(std::sqrt(d2 / den), 1e-2) << dir;
  }
}

TEST(Quality, EvaluateModelEndToEnd) {
  EvalOptions opt;
  opt.ctx = 256;
  opt.windows = 2;
  opt.needle_samples = 3;
  opt.needle_lengths = {256};
  opt.diag_queries = 8;
  opt.calib_tokens = 512;
  opt.calib_text = src("data/validation-tech.txt");
  opt.needle_words_text = opt.calib_text;
  const auto r = evaluate_model(src("models/tiny-gqa"), {parse_cache_config("bf16", {}), parse_cache_config("tq-3bit", {})},
                                src("data/validation.txt"), opt);
  ASSERT_EQ(r.rows.size(), 2u);
  EXPECT_EQ(r.windows, 2);
  EXPECT_EQ(r.predictions, 2 * 255);
  EXPECT_FALSE(r.blas_kernels.empty());
  EXPECT_EQ(r.blas_kernels, std::string(blas_kernels()));
  EXPECT_NEAR(r.rows[0].ppl, r.bf16_ppl, 1e-9 * r.bf16_ppl);
  EXPECT_EQ(r.rows[0].kl, 0.0);
  EXPECT_EQ(r.rows[0].top1, 1.0);
  EXPECT_GT(r.rows[1].kl, 0.0);
  EXPECT_LT(r.rows[1].top1, 1.0);
  EXPECT_NEAR(r.rows[1].compression, 5.12, 0.01);
  ASSERT_EQ(r.rows[1].layers.size(), 4u);
  for (const auto& l : r.rows[0].layers) EXPECT_EQ(l.tv, 0.0);
  for (const auto& l : r.rows[1].layers) {
    EXPECT_GT(l.tv, 0.0);
    EXPECT_GT(l.out_nmse, 0.0);
    EXPECT_LE(l.top8, 1.0);
  }
  EXPECT_EQ(r.rows[0].needle_disagree.at(256), 0);
  // The same runtime with a dense bf16 cache gives the same perplexity (bf16 rows both ways).
  auto model = Model::load(src("models/tiny-gqa"));
  auto tok = Tokenizer::load(src("models/tiny-gqa/tokenizer.json"));
  const auto stream = ppl_token_stream(read(src("data/validation.txt")), [&](std::string_view s) { return tok->encode(s); }, 1);
  PerplexityOptions po;
  po.ctx = 256;
  po.windows = 2;
  po.bos_id = 0;
  EXPECT_NEAR(perplexity_windows(*model, stream, po).ppl, r.bf16_ppl, 1e-4 * r.bf16_ppl);
  // A GQA model with an MLA format is an error naming the format.
  EXPECT_THROW(evaluate_model(src("models/tiny-gqa"), {parse_cache_config("c4r4", {})}, src("data/validation.txt"), opt), Error);
}
