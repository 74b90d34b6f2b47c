// kvq/eval.hpp: the perplexity protocol of models/README.md, as a library so that `kvq ppl`
// (dense bf16 cache) and `kvq eval` (quantized caches) compute exactly the same thing.
//
// Protocol: split the text into documents at blank lines; tokenize each and append <|eos|>;
// concatenate; window k takes the ctx-1 tokens starting at ctx*k (one token between windows is
// unused) and prepends <|bos|>; the loss is the mean next-token NLL over the ctx-1 predictions
// of each window (natural log), averaged over all windows; ppl = exp(mean).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/kv_cache.hpp"
#include "kvq/model.hpp"

namespace kvq {

// Documents separated by one or more blank (empty or whitespace-only) lines; each document keeps
// its inner newlines and loses the newlines that separate it from the next. Empty documents are
// dropped.
std::vector<std::string> split_documents(std::string_view text);

using TextEncoder = std::function<std::vector<std::int32_t>(std::string_view)>;

// The concatenated token stream of the protocol. kvq::Error on a text with no document.
std::vector<std::int32_t> ppl_token_stream(std::string_view text, const TextEncoder& encode, std::int32_t eos_id);

// Number of full windows of `ctx` tokens (ctx - 1 from the stream) the stream holds.
int ppl_full_windows(std::size_t stream_tokens, int ctx);

struct PerplexityOptions {
  int ctx = 2048;
  int windows = 0;  // 0: every full window
  std::int32_t bos_id = -1;
  // Cache for one window (default: dense bf16); it is reset between windows.
  std::function<std::unique_ptr<KvCache>(const CacheGeometry&)> make_cache;
  // Called after each window with (windows done, windows total, running ppl).
  std::function<void(int, int, double)> progress;
};

struct PerplexityResult {
  double ppl = 0.0;
  double mean_nll = 0.0;
  int windows = 0;
  std::int64_t predictions = 0;
  std::int64_t stream_tokens = 0;
  std::vector<double> window_nll;  // mean NLL of each window
  double seconds = 0.0;
};

PerplexityResult perplexity_windows(Model& model, const std::vector<std::int32_t>& stream, const PerplexityOptions& opt);

// Mean next-token NLL of tokens[1..n) given logits [n][vocab] of tokens[0..n-1) (row i predicts
// token i + 1), in double.
double mean_next_token_nll(const float* logits, int vocab, const std::int32_t* tokens, int n);

}  // namespace kvq
