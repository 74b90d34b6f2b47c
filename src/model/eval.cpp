// Perplexity over fixed windows (the protocol of models/README.md; see kvq/eval.hpp). Each
// window runs as one prefill through a fresh cache and scores every position.
#include "kvq/eval.hpp"

#include <chrono>
#include <cmath>

#include "kvq/common.hpp"
#include "kvq/dense_cache.hpp"
#include "vexp.hpp"

namespace kvq {

namespace {
bool blank(std::string_view line) {
  for (char c : line)
    if (c != ' ' && c != '\t' && c != '\r' && c != '\f' && c != '\v') return false;
  return true;
}
}  // namespace

std::vector<std::string> split_documents(std::string_view text) {
  std::vector<std::string> docs;
  std::string cur;
  bool have = false;
  std::size_t i = 0;
  while (i <= text.size()) {
    std::size_t e = text.find('\n', i);
    if (e == std::string_view::npos) e = text.size();
    const std::string_view line = text.substr(i, e - i);
    if (blank(line)) {
      if (have) docs.push_back(std::move(cur));
      cur.clear();
      have = false;
    } else {
      if (have) cur.push_back('\n');
      cur.append(line);
      have = true;
    }
    i = e + 1;
  }
  if (have) docs.push_back(std::move(cur));
  return docs;
}

std::vector<std::int32_t> ppl_token_stream(std::string_view text, const TextEncoder& encode, std::int32_t eos_id) {
  const auto docs = split_documents(text);
  if (docs.empty()) fail("empty text: no documents to evaluate");
  std::vector<std::int32_t> stream;
  for (const auto& d : docs) {
    const auto ids = encode(d);
    stream.insert(stream.end(), ids.begin(), ids.end());
    stream.push_back(eos_id);
  }
  return stream;
}

int ppl_full_windows(std::size_t n, int ctx) {
  if (ctx < 2) fail("ppl: ctx must be at least 2");
  if (n < static_cast<std::size_t>(ctx - 1)) return 0;
  return static_cast<int>((n - static_cast<std::size_t>(ctx - 1)) / static_cast<std::size_t>(ctx)) + 1;
}

double mean_next_token_nll(const float* logits, int vocab, const std::int32_t* tokens, int n) {
  double total = 0.0;
  for (int i = 0; i + 1 < n; ++i) {
    const float* row = logits + static_cast<std::size_t>(i) * vocab;
    total += vexp::logsumexp(row, vocab) - row[tokens[i + 1]];
  }
  return total / (n - 1);
}

PerplexityResult perplexity_windows(Model& model, const std::vector<std::int32_t>& stream, const PerplexityOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (stream.empty()) fail("ppl: empty token stream");
  if (opt.bos_id < 0) fail("ppl: no <|bos|> token id (config.json has no bos_token_id)");
  const int ctx = opt.ctx;
  const int full = ppl_full_windows(stream.size(), ctx);
  if (full == 0)
    fail("ppl: the text has " + std::to_string(stream.size()) + " tokens, fewer than one window of " +
         std::to_string(ctx - 1));
  if (opt.windows < 0) fail("ppl: windows must be >= 0");
  if (opt.windows > full)
    fail("ppl: asked for " + std::to_string(opt.windows) + " windows but the text holds only " + std::to_string(full) +
         " full windows of " + std::to_string(ctx));
  const int W = opt.windows == 0 ? full : opt.windows;
  const int V = model.config().vocab_size;
  auto cache = opt.make_cache ? opt.make_cache(model.cache_geometry()) : make_dense_cache(model.cache_geometry());
  std::vector<std::int32_t> win(ctx);
  std::vector<float> logits(static_cast<std::size_t>(ctx) * V);
  PerplexityResult r;
  r.stream_tokens = static_cast<std::int64_t>(stream.size());
  double sum = 0.0;
  for (int k = 0; k < W; ++k) {
    win[0] = opt.bos_id;
    std::copy(stream.begin() + static_cast<std::ptrdiff_t>(k) * ctx,
              stream.begin() + static_cast<std::ptrdiff_t>(k) * ctx + ctx - 1, win.begin() + 1);
    cache->reset(0);
    model.forward(win.data(), ctx, *cache, 0, logits.data(), LogitsMode::kAll);
    const double nll = mean_next_token_nll(logits.data(), V, win.data(), ctx);
    r.window_nll.push_back(nll);
    sum += nll;
    if (opt.progress) opt.progress(k + 1, W, std::exp(sum / (k + 1)));
  }
  cache->reset(0);
  r.windows = W;
  r.predictions = static_cast<std::int64_t>(W) * (ctx - 1);
  r.mean_nll = sum / W;
  r.ppl = std::exp(r.mean_nll);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace kvq
