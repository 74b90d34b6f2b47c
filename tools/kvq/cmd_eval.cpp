// `kvq eval`: for each model and cache configuration, bits per value, bytes per token,
// compression, perplexity and its change, KL divergence and top-1 agreement against the bf16
// cache, needle retrieval, and per-layer attention diagnostics (src/quality does the work).
#include <fmt/core.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cache_options.hpp"
#include "command.hpp"
#include "kvq/model.hpp"
#include "kvq/quality.hpp"
#include "table.hpp"

namespace {

namespace fs = std::filesystem;

const char* kGqaSweep = "bf16,fp8,tq-k8v4,tq-4bit-nc,tq-k3v4-nc,tq-3bit-nc,tq-3bit-qjl,tq-4bit,tq-3.5bit,tq-3bit,tq-2.5bit";
const char* kMlaSweep = "bf16,fp8,c8r8,c4r4,c3r4,c2r4,mla-tq4,c4r4@paper";

bool tty_progress() { return ::isatty(2) && std::getenv("CI") == nullptr; }

nlohmann::json to_json(const kvq::ModelEvalResult& m) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& r : m.rows) {
    nlohmann::json needle = nlohmann::json::object(), dis = nlohmann::json::object();
    for (const auto& [len, a] : r.needle_acc) needle[std::to_string(len)] = a;
    for (const auto& [len, d] : r.needle_disagree) dis[std::to_string(len)] = d;
    nlohmann::json layers = nlohmann::json::array();
    for (const auto& l : r.layers)
      layers.push_back({{"logit_rmse", l.logit_rmse}, {"tv", l.tv}, {"top8_overlap", l.top8}, {"output_nmse", l.out_nmse}});
    rows.push_back({{"cache", r.config.label},
                    {"format", r.config.format},
                    {"sinks", r.config.protect.sinks},
                    {"window", r.config.protect.window},
                    {"boundary_layers", r.config.protect.boundary_layers},
                    {"bits_per_value", r.bits_per_value},
                    {"bytes_per_token", r.bytes_per_token},
                    {"compression", r.compression},
                    {"ppl", r.ppl},
                    {"delta_ppl_pct", r.delta_ppl_pct},
                    {"kl", r.kl},
                    {"top1", r.top1},
                    {"needle_accuracy", needle},
                    {"needle_disagreements_vs_bf16", dis},
                    {"layers", layers},
                    {"seconds", r.seconds}});
  }
  nlohmann::json bn = nlohmann::json::object();
  for (const auto& [len, a] : m.bf16_needle) bn[std::to_string(len)] = a;
  return {{"model", m.model_dir},       {"architecture", m.architecture}, {"windows", m.windows},
          {"predictions", m.predictions}, {"bf16_ppl", m.bf16_ppl},     {"bf16_needle_accuracy", bn},
          {"needle_samples", m.needle_samples}, {"baseline_model", m.baseline_model}, {"blas_kernels", m.blas_kernels},
          {"rows", rows}};
}

// "+0.000" rather than "-0.000" for a difference that rounds to zero (a bf16 row whose prefill
// ran in the expanded MLA form differs from the absorbed baseline by float rounding only).
std::string signed3(double x) {
  std::string s = fmt::format("{:+.3f}", x);
  return s == "-0.000" ? "+0.000" : s;
}

void print_tables(const std::vector<kvq::ModelEvalResult>& all, std::FILE* out, bool md) {
  std::vector<std::string> head = {"model", "cache", "bits/value", "bytes/token", "x bf16", "ppl", "dppl %", "KL", "top-1"};
  std::vector<int> lens;
  for (const auto& m : all)
    for (const auto& [len, a] : m.bf16_needle)
      if (std::find(lens.begin(), lens.end(), len) == lens.end()) lens.push_back(len);
  for (int len : lens) head.push_back(fmt::format("needle {} (diff)", len));
  kvq::cli::Table t(head);
  for (const auto& m : all) {
    const std::string name = fs::path(m.model_dir).filename().string();
    for (const auto& r : m.rows) {
      std::vector<std::string> row = {name, r.config.label, fmt::format("{:.3f}", r.bits_per_value), fmt::format("{:.0f}", r.bytes_per_token),
                                      fmt::format("{:.2f}", r.compression), fmt::format("{:.4f}", r.ppl), signed3(r.delta_ppl_pct),
                                      fmt::format("{:.5f}", r.kl), fmt::format("{:.2f}%", 100 * r.top1)};
      for (int len : lens) {
        auto it = r.needle_acc.find(len);
        row.push_back(it == r.needle_acc.end() ? "-" : fmt::format("{:.3f} ({})", it->second, r.needle_disagree.at(len)));
      }
      t.add(row);
    }
  }
  t.print(out, 2, md);
  for (const auto& m : all) {
    if (m.rows.empty() || m.rows[0].layers.empty()) continue;
    fmt::print(out, "\n{}Per-layer attention diagnostics, {} (bf16 queries of window 0; one layer quantized at a time):\n\n",
               md ? "" : "", fs::path(m.model_dir).filename().string());
    kvq::cli::Table d({"cache", "layer", "logit RMSE", "TV", "top-8 overlap", "output NMSE"});
    for (const auto& r : m.rows)
      for (std::size_t l = 0; l < r.layers.size(); ++l)
        d.add({r.config.label, std::to_string(l), fmt::format("{:.4f}", r.layers[l].logit_rmse), fmt::format("{:.4f}", r.layers[l].tv),
               fmt::format("{:.3f}", r.layers[l].top8), fmt::format("{:.2e}", r.layers[l].out_nmse)});
    d.print(out, 1, md);
  }
}

void write_report(const std::string& dir, const std::vector<kvq::ModelEvalResult>& all, const nlohmann::json& j,
                  const std::string& command) {
  {
    std::ofstream f(dir + "/report.json", std::ios::trunc);
    f << j.dump(1) << "\n";
    if (!f) kvq::fail(dir + "/report.json: cannot write");
  }
  const std::string md = dir + "/report.md";
  std::FILE* f = std::fopen(md.c_str(), "w");
  if (!f) kvq::fail(md + ": cannot write");
  fmt::print(f, "# kvq eval report\n\nCommand: `{}`\n\n", command);
  for (const auto& m : all)
    fmt::print(f, "- {} ({}): {} windows, {} predictions; bf16 ppl {:.4f}{}; {} needle samples per length; BLAS kernels {}\n",
               m.model_dir, m.architecture, m.windows, m.predictions, m.bf16_ppl,
               m.baseline_model.empty() ? std::string() : " (bf16 reference: " + m.baseline_model + ")", m.needle_samples,
               m.blas_kernels);
  fmt::print(f, "\n");
  print_tables(all, f, true);
  fmt::print(f, "\n![delta-ppl against bytes per token](delta_ppl_vs_bytes.png)\n");
  std::fclose(f);
  // The plot: python3 + matplotlib (Debian's python3-matplotlib; /usr/bin/python3).
  const std::string script = kvq::cli::resolve_path("tools/plot_eval.py");
  const std::string py = fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  const std::string cmd = py + " '" + script + "' '" + dir + "/report.json' '" + dir + "/delta_ppl_vs_bytes.png' 2>&1";
  if (std::system(cmd.c_str()) != 0) fmt::print(stderr, "kvq eval: warning: the plot was not written (needs python3-matplotlib)\n");
}

void run(const std::vector<std::string>& models, const std::string& text, const kvq::cli::CacheCli& cc, int ctx, int windows,
         int needle, bool diag, bool json, const std::string& report, std::uint64_t seed, const std::string& command,
         const std::string& baseline) {
  kvq::require(!models.empty(), "--model is required");
  kvq::EvalOptions opt;
  if (!baseline.empty()) opt.baseline_model = kvq::cli::resolve_path(baseline);
  opt.ctx = ctx;
  opt.windows = windows;
  opt.needle_samples = needle;
  opt.diagnostics = diag;
  opt.seed = seed;
  opt.calib_text = kvq::cli::resolve_path(cc.calib_text);
  opt.needle_words_text = opt.calib_text;
  const std::string text_path = kvq::cli::resolve_path(text);
  kvq::require(fs::absolute(opt.calib_text) != fs::absolute(text_path) || !fs::exists(text_path),
               "the calibration text must differ from the evaluation text");
  if (!report.empty()) kvq::cli::make_report_dir(report);
  std::vector<kvq::ModelEvalResult> all;
  for (const auto& m : models) {
    const std::string dir = kvq::cli::resolve_path(m);
    const auto cfg = kvq::load_model_config(dir + "/config.json");
    const std::string list = cc.cache.empty() ? (cfg.mla ? kMlaSweep : kGqaSweep) : cc.cache;
    std::vector<kvq::CacheConfig> configs;
    for (const auto& s : kvq::cli::split_list(list)) configs.push_back(kvq::parse_cache_config(s, cc.policy()));
    const std::string name = fs::path(dir).filename().string();
    if (tty_progress())
      opt.progress = [name](const std::string& stage, double frac) {
        const int w = 30, f = static_cast<int>(frac * w + 0.5);
        fmt::print(stderr, "\r{} {:<24} [{}{}] {:3.0f}%", name, stage, std::string(static_cast<std::size_t>(f), '#'),
                   std::string(static_cast<std::size_t>(w - f), ' '), 100 * frac);
        if (frac >= 1.0) fmt::print(stderr, "\n");
      };
    all.push_back(kvq::evaluate_model(dir, configs, text_path, opt));
  }
  nlohmann::json j = {{"text", text_path}, {"ctx", ctx}, {"command", command}, {"models", nlohmann::json::array()}};
  for (const auto& m : all) j["models"].push_back(to_json(m));
  if (!report.empty()) write_report(report, all, j, command);
  if (json) {
    fmt::print("{}\n", j.dump(1));
    return;
  }
  for (const auto& m : all)
    fmt::print("{} ({}): {} windows of {} on {} ({} predictions), bf16 ppl {:.4f}{}\n", m.model_dir, m.architecture, m.windows,
               ctx, text_path, m.predictions, m.bf16_ppl,
               m.baseline_model.empty() ? std::string() : " (bf16 reference: " + m.baseline_model + ")");
  print_tables(all, stdout, false);
}

void register_cmd(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "quality and memory of KV-cache formats on models (ppl, KL, needle, diagnostics)");
  auto models = std::make_shared<std::vector<std::string>>();
  auto text = std::make_shared<std::string>("data/validation.txt");
  auto cc = std::make_shared<kvq::cli::CacheCli>();
  auto ctx = std::make_shared<int>(2048);
  auto windows = std::make_shared<int>(8);
  auto needle = std::make_shared<int>(0);
  auto nodiag = std::make_shared<bool>(false);
  auto json = std::make_shared<bool>(false);
  auto report = std::make_shared<std::string>();
  auto seed = std::make_shared<std::uint64_t>(20261129);
  auto baseline = std::make_shared<std::string>();
  cmd->add_option("--model", *models, "model directory (repeatable)")->required();
  cmd->add_option("--baseline-model", *baseline,
                  "bf16 reference model for delta-ppl, KL, top-1 and needle pairing (e.g. the original of a calibrated model)");
  cmd->add_option("--text", *text, "evaluation text (documents separated by blank lines)");
  cc->add(cmd, std::string("comma-separated cache configurations FORMAT[@paper|@sS,wW,nN]; default sweep: GQA ") + kGqaSweep +
                   "; MLA " + kMlaSweep,
          false);
  cmd->add_option("--ctx", *ctx, "perplexity window")->check(CLI::Range(2, 1 << 20));
  cmd->add_option("--windows", *windows, "windows (0: all)")->check(kvq::cli::at_least(0));
  cmd->add_option("--needle-samples", *needle, "needle samples per length (256, 512, 1024, 2000); 0: skip")->check(kvq::cli::at_least(0));
  cmd->add_flag("--no-diagnostics", *nodiag, "skip the per-layer attention diagnostics");
  cmd->add_option("--seed", *seed, "seed of the needle samples");
  cmd->add_flag("--json", *json, "print one JSON object");
  cmd->add_option("--report", *report, "write report.md, report.json and a PNG plot to this directory");
  cmd->callback([=] {
    std::string command = "kvq eval";
    for (const auto& m : *models) command += " --model " + m;
    command += " --text " + *text + (cc->cache.empty() ? "" : " --cache " + cc->cache) + " --ctx " + std::to_string(*ctx) +
               " --windows " + std::to_string(*windows) + " --needle-samples " + std::to_string(*needle);
    if (cc->protect != "none") command += " --protect " + cc->protect;
    if (!baseline->empty()) command += " --baseline-model " + *baseline;
    run(*models, *text, *cc, *ctx, *windows, *needle, !*nodiag, *json, *report, *seed, command, *baseline);
  });
}

}  // namespace

KVQ_REGISTER_COMMAND("eval", register_cmd);
