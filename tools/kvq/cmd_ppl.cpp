// `kvq ppl`: perplexity of a model on a text file (dense bf16 cache, or --cache FORMAT), following the
// protocol of models/README.md (kvq::perplexity_windows in src/model/eval.cpp does the work, so
// `kvq eval` scores quantized caches with the same code).
#include <fmt/core.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cache_options.hpp"
#include "command.hpp"
#include "kvq/dense_cache.hpp"
#include "kvq/eval.hpp"
#include "kvq/model.hpp"
#include "kvq/tokenizer.hpp"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) kvq::fail(path + ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool show_progress() { return ::isatty(2) && std::getenv("CI") == nullptr; }

void run(const std::string& model_arg, const std::string& text_arg, int ctx, int windows, bool json,
         const kvq::cli::CacheCli& cc) {
  kvq::require(ctx >= 2, "--ctx must be at least 2");
  kvq::require(windows >= 0, "--windows must be >= 0");
  const std::string dir = kvq::cli::resolve_path(model_arg);
  const std::string text_path = kvq::cli::resolve_path(text_arg);
  const std::string text = read_file(text_path);
  auto model = kvq::Model::load(dir);
  const auto& cfg = model->config();
  kvq::require(ctx <= cfg.max_position_embeddings,
               "--ctx " + std::to_string(ctx) + " exceeds max_position_embeddings (" +
                   std::to_string(cfg.max_position_embeddings) + ")");
  kvq::require(!cfg.eos_token_ids.empty(), dir + "/config.json: no eos_token_id (the protocol appends <|eos|>)");
  auto tok = kvq::Tokenizer::load((std::filesystem::path(dir) / "tokenizer.json").string());
  const auto stream = kvq::ppl_token_stream(
      text, [&](std::string_view s) { return tok->encode(s); }, cfg.eos_token_ids[0]);
  kvq::PerplexityOptions opt;
  opt.ctx = ctx;
  opt.windows = windows;
  opt.bos_id = cfg.bos_token_id;
  opt.make_cache = cc.factory(*model, *tok, ctx);
  const std::string cache_name = cc.cache.empty() && !cc.policy().sinks && !cc.policy().window && !cc.policy().boundary_layers
                                     ? std::string("dense-bf16")
                                     : opt.make_cache(model->cache_geometry())->describe();
  if (show_progress())
    opt.progress = [](int done, int total, double ppl) {
      fmt::print(stderr, "\rwindow {}/{}  ppl {:.4f}", done, total, ppl);
      if (done == total) fmt::print(stderr, "\n");
    };
  const auto r = kvq::perplexity_windows(*model, stream, opt);
  if (json) {
    nlohmann::json out = {{"model", dir},
                          {"text", text_path},
                          {"cache", cache_name},
                          {"ctx", ctx},
                          {"windows", r.windows},
                          {"predictions", r.predictions},
                          {"stream_tokens", r.stream_tokens},
                          {"mean_nll", r.mean_nll},
                          {"ppl", r.ppl},
                          {"seconds", r.seconds},
                          {"window_nll", r.window_nll}};
    fmt::print("{}\n", out.dump(1));
    return;
  }
  fmt::print("model {} ({}), text {} ({} tokens)\n", dir, cfg.architecture, text_path, r.stream_tokens);
  fmt::print("ppl {:.4f} (mean NLL {:.5f}) over {} windows of {} ({} predictions), {} cache, {:.1f} s\n", r.ppl,
             r.mean_nll, r.windows, ctx, r.predictions, cache_name, r.seconds);
}

void register_cmd(CLI::App& app) {
  auto* cmd = app.add_subcommand("ppl", "perplexity on a text file (protocol of models/README.md), dense bf16 cache");
  auto model = std::make_shared<std::string>();
  auto text = std::make_shared<std::string>();
  auto ctx = std::make_shared<int>(2048);
  auto windows = std::make_shared<int>(0);
  auto json = std::make_shared<bool>(false);
  cmd->add_option("--model", *model, "Hugging Face model directory")->required();
  cmd->add_option("--text", *text, "text file; documents separated by blank lines")->required();
  cmd->add_option("--ctx", *ctx, "window length including <|bos|> (default 2048)");
  cmd->add_option("--windows", *windows, "number of windows (0 or absent: every full window)");
  cmd->add_flag("--json", *json, "print one JSON object");
  auto cc = std::make_shared<kvq::cli::CacheCli>();
  cc->add(cmd, "cache format FORMAT[@paper|@sS,wW,nN] (default: the dense bf16 cache)");
  cmd->callback([=] { run(*model, *text, *ctx, *windows, *json, *cc); });
}

}  // namespace

KVQ_REGISTER_COMMAND("ppl", register_cmd);
