// `kvq analyze response | jacobian`: sensitivity analysis of the two MLA cache paths (QuantMLA
// section 2 and appendix B; kvq/analysis.hpp, docs/analysis.md). `response` measures the finite
// output response R_b = NMSE_out / NMSE_cache per layer and path over cells of (text, seed);
// `jacobian` estimates the operator diagnostics T, A, O and the gain G, fits the cross-layer
// log-ratio predictor, and runs the equal-energy interventions.
#include <fmt/core.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "command.hpp"
#include "kvq/analysis.hpp"

namespace {

namespace fs = std::filesystem;

struct Args {
  std::string model, cache = "c4r4", seeds = "0,1,2", report;
  std::vector<std::string> texts;
  int seqs = -1, seq_len = -1, probes = 256, permutations = 16;
  double nmse = -1;
  bool json = false, quiet = false;
};

std::string base(const std::string& p) { return fs::path(p).filename().string(); }

kvq::AnalysisOptions options(const Args& a, bool jacobian) {
  kvq::AnalysisOptions o;
  o.model_dir = kvq::cli::resolve_path(a.model);
  std::vector<std::string> texts = a.texts;
  if (texts.empty()) texts = {"data/validation.txt", "data/validation-tech.txt"};
  for (const auto& t : texts) o.texts.push_back(kvq::cli::resolve_path(t));
  o.seeds.clear();
  for (int s : kvq::cli::parse_int_list(a.seeds)) {
    if (s < 0) kvq::fail("--seeds: seeds must be non-negative");
    o.seeds.push_back(static_cast<std::uint64_t>(s));
  }
  o.cache = a.cache;
  // Defaults: the response sizes; the Jacobian sizes fit a 2-core CPU (docs/analysis.md).
  o.seqs = a.seqs > 0 ? a.seqs : (jacobian ? 1 : 8);
  o.seq_len = a.seq_len > 0 ? a.seq_len : (jacobian ? 256 : 512);
  o.nmse = a.nmse > 0 ? a.nmse : (jacobian ? 1e-3 : 1e-2);
  o.probes = a.probes;
  o.permutations = a.permutations;
  if (!a.quiet) o.log = [](const std::string& s) { fmt::print(stderr, "[analyze] {}\n", s); };
  return o;
}

void plot(const std::string& dir, const std::string& json, const std::string& png) {
  const std::string script = kvq::cli::resolve_path("tools/plot_analysis.py");
  const std::string py = fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  const std::string cmd = py + " '" + script + "' '" + dir + "/" + json + "' '" + dir + "/" + png + "' 2>&1";
  if (std::system(cmd.c_str()) != 0) fmt::print(stderr, "kvq analyze: warning: the plot was not written (needs python3-matplotlib)\n");
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  if (!f) kvq::fail(path + ": cannot write");
}

std::string response_table(const kvq::ResponseResult& r, const kvq::AnalysisOptions& o) {
  std::string s = fmt::format("Response at cache NMSE {:g} ({} QDQ error direction), {} sequences x {} tokens per cell\n\n", o.nmse,
                              o.cache, o.seqs, o.seq_len);
  s += "| cell | model ratio |";
  for (int l = 0; l < r.n_layers; ++l) s += fmt::format(" L{} R_C | L{} R_P | L{} r |", l, l, l);
  s += "\n|---|---|";
  for (int l = 0; l < r.n_layers; ++l) s += "---|---|---|";
  s += "\n";
  for (const auto& c : r.cells) {
    s += fmt::format("| {} s{} | {:.3f} |", base(c.text), c.seed, c.model_ratio);
    for (const auto& L : c.layers) s += fmt::format(" {:.4g} | {:.4g} | {:.3f} |", L.r_c, L.r_p, L.ratio);
    s += "\n";
  }
  s += "\n| layer | R_C min | R_C max | R_P min | R_P max | r median | r IQR |\n|---|---|---|---|---|---|---|\n";
  for (int l = 0; l < r.n_layers; ++l) {
    const std::size_t i = static_cast<std::size_t>(l);
    s += fmt::format("| {} | {:.4g} | {:.4g} | {:.4g} | {:.4g} | {:.3f} | [{:.3f}, {:.3f}] |\n", l, r.rc_min[i], r.rc_max[i],
                     r.rp_min[i], r.rp_max[i], r.ratio_median[i], r.ratio_q1[i], r.ratio_q3[i]);
  }
  s += "\nThe quantizer's own error (not rescaled), mean over cells\n\n"
       "| layer | cache NMSE C | output NMSE C | cache NMSE P | output NMSE P |\n|---|---|---|---|---|\n";
  for (int l = 0; l < r.n_layers; ++l) {
    double a = 0, b = 0, c = 0, d = 0;
    for (const auto& cell : r.cells) {
      const auto& L = cell.layers[static_cast<std::size_t>(l)];
      a += L.q_cache_c, b += L.q_out_c, c += L.q_cache_p, d += L.q_out_p;
    }
    const double n = static_cast<double>(r.cells.size());
    s += fmt::format("| {} | {:.3e} | {:.3e} | {:.3e} | {:.3e} |\n", l, a / n, b / n, c / n, d / n);
  }
  s += fmt::format("\nmodel-level ratio (mean_l R_P / mean_l R_C): mean {:.3f} over {} cells, range [{:.3f}, {:.3f}]\n",
                   r.model_ratio_mean, r.cells.size(), r.model_ratio_min, r.model_ratio_max);
  s += fmt::format("layer ratios r_l over (layer, cell): median {:.3f}, IQR [{:.3f}, {:.3f}]\n", r.ratio_median_all,
                   r.ratio_q1_all, r.ratio_q3_all);
  s += fmt::format("({:.0f} s)\n", r.seconds);
  return s;
}

std::string jacobian_table(const kvq::JacobianResult& r, const kvq::AnalysisOptions& o) {
  std::string s = fmt::format(
      "Jacobian diagnostics at cache NMSE {:g} ({} QDQ error direction), {} sequence(s) x {} tokens per cell, {} Hutchinson "
      "probes, {} permutations\n\n",
      o.nmse, o.cache, o.seqs, o.seq_len, o.probes, o.permutations);
  s += "| cell | layer | G_C | T_C | A_C | O_C | G_P | T_P | A_P | O_P | G_P/G_C | R_C fin/loc | R_P fin/loc |\n"
       "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& c : r.cells)
    for (std::size_t l = 0; l < c.layers.size(); ++l) {
      const auto& L = c.layers[l];
      s += fmt::format("| {} s{} | {} | {:.4g} | {:.4g} | {:.3f} | {:+.3f} | {:.4g} | {:.4g} | {:.3f} | {:+.3f} | {:.3f} | {:.3f} | {:.3f} |\n",
                       base(c.text), c.seed, l, L.c.g.G, L.c.g.T, L.c.g.A, L.c.g.O, L.p.g.G, L.p.g.T, L.p.g.A, L.p.g.O,
                       L.p.g.G / L.c.g.G, L.c.r_finite / L.c.r_local, L.p.r_finite / L.p.r_local);
    }
  s += fmt::format("\nPredictor of log(G_P / G_C): gamma fitted on {} (layer, cell) points, tested on {}\n\n", r.fit_points,
                   r.test_points);
  s += "| model | gamma | test RMSE | test R^2 | test Pearson |\n|---|---|---|---|---|\n";
  for (const auto& p : r.predictors) s += fmt::format("| {} | {:+.3f} | {:.3f} | {:.3f} | {:.3f} |\n", p.name, p.gamma, p.rmse, p.r2, p.pearson);
  s += "\nEqual-energy interventions (median gain change G(e') / G(e) over all layers and cells)\n\n"
       "| path | sign randomization | whole-token permutation | isotropic |\n|---|---|---|---|\n";
  s += fmt::format("| content | {:.3f} | {:.3f} | {:.3f} |\n", r.sign_change_median_c, r.perm_change_median_c, r.iso_change_median_c);
  s += fmt::format("| rope | {:.3f} | {:.3f} | {:.3f} |\n", r.sign_change_median_p, r.perm_change_median_p, r.iso_change_median_p);
  s += fmt::format("\nSpearman of JVP gains vs finite-perturbation gains: {:.4f} over {} observations\n", r.spearman, r.spearman_n);
  s += fmt::format("({:.0f} s)\n", r.seconds);
  return s;
}

void run(const Args& a, bool jacobian, const std::string& command) {
  const kvq::AnalysisOptions o = options(a, jacobian);
  if (!a.report.empty()) kvq::cli::make_report_dir(a.report);
  std::string json, table;
  if (jacobian) {
    const auto r = kvq::analyze_jacobian(o);
    json = r.json, table = jacobian_table(r, o);
  } else {
    const auto r = kvq::analyze_response(o);
    json = r.json, table = response_table(r, o);
  }
  const std::string name = jacobian ? "jacobian" : "response";
  if (!a.report.empty()) {
    write_file(a.report + "/" + name + ".json", json);
    write_file(a.report + "/" + name + ".md", "# kvq analyze " + name + "\n\nCommand: `" + command + "`\n\n" + table);
    plot(a.report, name + ".json", name + ".png");
  }
  if (a.json)
    fmt::print("{}", json);
  else
    fmt::print("{}", table);
}

// The command line as given (for the report).
std::string describe(const Args& a, bool jacobian) {
  std::string s = fmt::format("kvq analyze {} --model {}", jacobian ? "jacobian" : "response", a.model);
  for (const auto& t : a.texts) s += " --text " + t;
  s += " --seeds " + a.seeds + " --cache " + a.cache;
  if (a.seqs > 0) s += fmt::format(" --seqs {}", a.seqs);
  if (a.seq_len > 0) s += fmt::format(" --seq-len {}", a.seq_len);
  if (a.nmse > 0) s += fmt::format(" --nmse {:g}", a.nmse);
  if (jacobian) s += fmt::format(" --probes {} --permutations {}", a.probes, a.permutations);
  if (!a.report.empty()) s += " --report " + a.report;
  return s;
}

void add_common(CLI::App* cmd, Args& a) {
  cmd->add_option("--model", a.model, "MLA (DeepSeek-V2/V3) Hugging Face model directory")->required();
  cmd->add_option("--text", a.texts, "text file(s), one cell per text and seed (default data/validation.txt data/validation-tech.txt)");
  cmd->add_option("--seeds", a.seeds, "comma-separated seeds choosing the sequences of a cell (default 0,1,2)");
  cmd->add_option("--cache", a.cache, "cXrY format whose QDQ error direction perturbs the cache (default c4r4)");
  cmd->add_option("--seqs", a.seqs, "non-overlapping sequences per cell");
  cmd->add_option("--seq-len", a.seq_len, "tokens per sequence including <|bos|>");
  cmd->add_option("--nmse", a.nmse, "cache NMSE of the perturbation");
  cmd->add_flag("--json", a.json, "print the result as one JSON object on stdout");
  cmd->add_option("--report", a.report, "write NAME.json, NAME.md and NAME.png to this directory");
  cmd->add_flag("--quiet", a.quiet, "no progress lines on stderr");
}

void register_cmd(CLI::App& app) {
  auto* cmd = app.add_subcommand("analyze", "Sensitivity analysis of the two MLA cache paths (response, jacobian)");
  cmd->require_subcommand(1);
  {
    auto a = std::make_shared<Args>();
    auto* sub = cmd->add_subcommand("response", "R_b = NMSE_out / NMSE_cache per layer and path (default 8 x 512 tokens per cell, NMSE 0.01)");
    add_common(sub, *a);
    sub->callback([a] { run(*a, false, describe(*a, false)); });
  }
  {
    auto a = std::make_shared<Args>();
    auto* sub = cmd->add_subcommand("jacobian", "Hutchinson T, A, O and G per layer and path, predictor, interventions (default 1 x 256 tokens per cell, 256 probes, NMSE 1e-3)");
    add_common(sub, *a);
    sub->add_option("--probes", a->probes, "Hutchinson probes per (sequence, layer, path) (default 256)");
    sub->add_option("--permutations", a->permutations, "whole-token permutations per (sequence, layer, path) (default 16)");
    sub->callback([a] { run(*a, true, describe(*a, true)); });
  }
}

}  // namespace

KVQ_REGISTER_COMMAND("analyze", register_cmd);
