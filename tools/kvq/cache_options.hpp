// tools/kvq/cache_options.hpp: the cache options shared by `kvq eval`, `kvq ppl` and
// `kvq generate` (--cache, --protect, --sinks, --window, --boundary-layers).
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "kvq/paged_cache.hpp"

namespace kvq::cli {

struct CacheCli {
  std::string cache;          // format list (eval) or one format (ppl, generate)
  std::string protect = "none";
  int sinks = -1, window = -1, boundary = -1;  // -1: from --protect
  std::string calib_text = "data/validation-tech.txt";

  void add(CLI::App* cmd, const std::string& cache_help) {
    cmd->add_option("--cache", cache, cache_help);
    cmd->add_option("--protect", protect, "protection preset: none (S = W = N = 0) or paper (S = 4, W = 128)")
        ->check(CLI::IsMember({"none", "paper"}));
    cmd->add_option("--sinks", sinks, "sink tokens read from bf16 rows (overrides --protect)")->check(CLI::NonNegativeNumber);
    cmd->add_option("--window", window, "recent tokens read from bf16 rows (overrides --protect)")->check(CLI::NonNegativeNumber);
    cmd->add_option("--boundary-layers", boundary, "first and last N layers kept bf16 (overrides --protect)")
        ->check(CLI::NonNegativeNumber);
    cmd->add_option("--calib-text", calib_text, "calibration text for the outlier-split formats (never the evaluation text)");
  }
  ProtectionPolicy policy() const {
    ProtectionPolicy p = protect == "paper" ? ProtectionPolicy::paper() : ProtectionPolicy{};
    if (sinks >= 0) p.sinks = sinks;
    if (window >= 0) p.window = window;
    if (boundary >= 0) p.boundary_layers = boundary;
    return p;
  }
};

}  // namespace kvq::cli
