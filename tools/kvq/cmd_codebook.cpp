// `kvq codebook`: Lloyd-Max codebooks for the sphere coordinate, with D_mse beside the
// TurboQuant paper's values and its bounds (the chapter's tq_codebook table).
#include <fmt/core.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "command.hpp"
#include "kvq/codebook.hpp"
#include "table.hpp"

namespace {

void run(int dim, const std::string& bits_list, bool gaussian, bool json, bool centroids) {
  const auto bits = kvq::cli::parse_int_list(bits_list);
  for (int b : bits) kvq::require(b >= 1 && b <= 8, "--bits: each value must be 1..8, got " + std::to_string(b));
  kvq::require(dim >= 3, "--dim must be >= 3");
  // The paper's rounded D_mse figures (TurboQuant, Table/Theorem 1), as the chapter prints them.
  const double paper[9] = {0, 0.36, 0.117, 0.03, 0.009, 0, 0, 0, 0};
  const double sd = std::sqrt(static_cast<double>(dim));
  nlohmann::json out = {{"dim", dim}, {"density", gaussian ? "gaussian N(0,1/d)" : "sphere coordinate"}, {"rows", nlohmann::json::array()}};
  kvq::cli::Table t({"bits", "D_mse (ours)", "paper", "lower 4^-b", "upper sqrt(3)pi/2 4^-b", "residual", "iters"});
  for (int b : bits) {
    const auto& cb = gaussian ? kvq::gaussian_codebook(dim, b) : kvq::sphere_codebook(dim, b);
    std::vector<double> scaled;
    for (double c : cb.centroids) scaled.push_back(c * sd);
    out["rows"].push_back({{"bits", b}, {"dmse", cb.mse}, {"paper", paper[b] > 0 ? nlohmann::json(paper[b]) : nlohmann::json()},
                           {"lower", kvq::dmse_lower_bound(b)}, {"upper", kvq::dmse_upper_bound(b)},
                           {"residual", cb.residual}, {"iterations", cb.iterations}, {"centroids_x_sqrt_d", scaled}});
    t.add({std::to_string(b), fmt::format("{:.4f}", cb.mse), paper[b] > 0 ? fmt::format("{:.3f}", paper[b]) : "-",
           fmt::format("{:.4f}", kvq::dmse_lower_bound(b)), fmt::format("{:.4f}", kvq::dmse_upper_bound(b)),
           fmt::format("{:.1e}", cb.residual), std::to_string(cb.iterations)});
  }
  if (json) {
    fmt::print("{}\n", out.dump(1));
    return;
  }
  fmt::print("Lloyd-Max codebook for one coordinate of a uniform unit vector, d = {}{}\n", dim,
             gaussian ? " (Gaussian N(0,1/d) approximation)" : "");
  for (int b : bits) {
    if (b > 2 && !centroids) continue;
    const auto& cb = gaussian ? kvq::gaussian_codebook(dim, b) : kvq::sphere_codebook(dim, b);
    std::string s;
    for (double c : cb.centroids) s += fmt::format("{}{:.3f}", s.empty() ? "" : " ", c * sd);
    fmt::print("{}-bit centroids x sqrt(d): [{}]\n", b, s);
  }
  t.print();
}

void register_cmd(CLI::App& app) {
  auto* cmd = app.add_subcommand("codebook", "Lloyd-Max codebooks and their distortion vs the TurboQuant paper");
  auto dim = std::make_shared<int>(128);
  auto bits = std::make_shared<std::string>("1,2,3,4");
  auto json = std::make_shared<bool>(false);
  auto gauss = std::make_shared<bool>(false);
  auto cents = std::make_shared<bool>(false);
  cmd->add_option("--dim", *dim, "vector dimension d (>= 3)");
  cmd->add_option("--bits", *bits, "comma-separated bit widths, 1..8");
  cmd->add_flag("--gaussian", *gauss, "use the N(0,1/d) approximation (vLLM's codebook) instead of the exact density");
  cmd->add_flag("--centroids", *cents, "print the centroids of every width (default: widths 1 and 2)");
  cmd->add_flag("--json", *json, "print one JSON object");
  cmd->callback([=] { run(*dim, *bits, *gauss, *json, *cents); });
}

}  // namespace

KVQ_REGISTER_COMMAND("codebook", register_cmd);
