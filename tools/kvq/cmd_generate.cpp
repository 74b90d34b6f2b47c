// `kvq generate`: text generation with the dense bf16 cache: the prompt (after <|bos|>) runs as
// one prefill, then tokens are decoded one at a time and printed as they come, until an
// end-of-sequence token, --max-tokens, or the model's max_position_embeddings.
#include <fmt/core.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cache_options.hpp"
#include "command.hpp"
#include "kvq/dense_cache.hpp"
#include "kvq/model.hpp"
#include "kvq/sampler.hpp"
#include "kvq/tokenizer.hpp"

namespace {

struct Args {
  std::string model, prompt, prompt_file;
  int max_tokens = 64;
  float temperature = 0.0f, top_p = 1.0f;
  std::uint64_t seed = 0;
  bool no_bos = false;
  kvq::cli::CacheCli cache;
};

void run(const Args& a) {
  using clock = std::chrono::steady_clock;
  kvq::require(a.max_tokens >= 0, "--max-tokens must be >= 0");
  std::string prompt = a.prompt;
  if (!a.prompt_file.empty()) {
    std::ifstream f(kvq::cli::resolve_path(a.prompt_file), std::ios::binary);
    if (!f) kvq::fail(a.prompt_file + ": cannot open");
    std::stringstream ss;
    ss << f.rdbuf();
    prompt = ss.str();
  }
  const std::string dir = kvq::cli::resolve_path(a.model);
  auto model = kvq::Model::load(dir);
  const auto& cfg = model->config();
  auto tok = kvq::Tokenizer::load((std::filesystem::path(dir) / "tokenizer.json").string());
  kvq::Sampler sampler({a.temperature, a.top_p, a.seed});
  std::vector<std::int32_t> ids;
  if (!a.no_bos && cfg.bos_token_id >= 0) ids.push_back(cfg.bos_token_id);
  const auto p = tok->encode(prompt);
  ids.insert(ids.end(), p.begin(), p.end());
  if (ids.empty()) kvq::fail("empty prompt");
  if (static_cast<std::int64_t>(ids.size()) > cfg.max_position_embeddings)
    kvq::fail("prompt of " + std::to_string(ids.size()) + " tokens exceeds max_position_embeddings (" +
              std::to_string(cfg.max_position_embeddings) + ")");
  auto cache = a.cache.factory(*model, *tok, cfg.max_position_embeddings)(model->cache_geometry());
  std::vector<float> logits(cfg.vocab_size);
  const auto t0 = clock::now();
  model->forward(ids.data(), static_cast<int>(ids.size()), *cache, 0, logits.data(), kvq::LogitsMode::kLast);
  const auto t1 = clock::now();
  std::vector<std::int32_t> out;
  std::string printed;
  std::string stop = "max-tokens";
  for (int i = 0; i < a.max_tokens; ++i) {
    const std::int32_t next = sampler.sample(logits.data(), cfg.vocab_size);
    bool eos = false;
    for (int e : cfg.eos_token_ids) eos |= next == e;
    if (eos) {
      stop = "eos";
      break;
    }
    out.push_back(next);
    // Print the new bytes of the decoded continuation (BPE tokens may merge across boundaries).
    const std::string text = tok->decode(out);
    if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0) {
      std::fwrite(text.data() + printed.size(), 1, text.size() - printed.size(), stdout);
      std::fflush(stdout);
      printed = text;
    }
    if (cache->length(0) >= cfg.max_position_embeddings) {
      stop = "max_position_embeddings";
      break;
    }
    if (i + 1 == a.max_tokens) break;
    model->forward(&next, 1, *cache, 0, logits.data(), kvq::LogitsMode::kLast);
  }
  const auto t2 = clock::now();
  const std::string text = tok->decode(out);
  if (text != printed) {
    // Only when an earlier print was not a prefix of the final text (never for byte-level BPE).
    fmt::print("\n{}", text);
  }
  fmt::print("\n");
  const double pre = std::chrono::duration<double>(t1 - t0).count();
  const double dec = std::chrono::duration<double>(t2 - t1).count();
  fmt::print(stderr, "[{} prompt tokens in {:.2f} s ({:.0f} tok/s); {} generated in {:.2f} s ({:.1f} tok/s); stop: {}]\n",
             ids.size(), pre, ids.size() / pre, out.size(), dec, out.empty() ? 0.0 : out.size() / dec, stop);
}

void register_cmd(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "generate text from a prompt (dense bf16 cache; greedy by default)");
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "Hugging Face model directory")->required();
  auto* p = cmd->add_option("--prompt", a->prompt, "prompt text");
  auto* pf = cmd->add_option("--prompt-file", a->prompt_file, "read the prompt from a file");
  p->excludes(pf);
  cmd->add_option("--max-tokens", a->max_tokens, "tokens to generate at most (default 64)");
  cmd->add_option("--temperature", a->temperature, "sampling temperature; 0 = greedy (default)");
  cmd->add_option("--top-p", a->top_p, "nucleus sampling mass in (0, 1] (default 1)");
  cmd->add_option("--seed", a->seed, "random seed for sampling (default 0)");
  cmd->add_flag("--no-bos", a->no_bos, "do not prepend the model's bos token");
  a->cache.add(cmd, "cache format FORMAT[@paper|@sS,wW,nN] (default: the dense bf16 cache)");
  cmd->callback([a] { run(*a); });
}

}  // namespace

KVQ_REGISTER_COMMAND("generate", register_cmd);
