// tools/kvq/cache_options.hpp: the cache options shared by `kvq eval`, `kvq ppl` and
// `kvq generate` (--cache, --protect, --sinks, --window, --boundary-layers).
#pragma once

#include <CLI/CLI.hpp>
#include <fstream>
#include <functional>
#include <sstream>
#include <memory>
#include <string>

#include "kvq/dense_cache.hpp"
#include "kvq/model.hpp"
#include "kvq/paged_cache.hpp"
#include "kvq/quality.hpp"
#include "kvq/tokenizer.hpp"
#include "command.hpp"

namespace kvq::cli {

struct CacheCli {
  std::string cache;          // format list (eval) or one format (ppl, generate)
  std::string protect = "none";
  int sinks = -1, window = -1, boundary = -1;  // -1: from --protect
  std::string calib_text = "data/validation-tech.txt";
  double pool_mib = 0;  // page pool budget (0: grow as needed)
  bool preempt = false;

  // with_pool: the page-pool options (--pool-mib, --preempt), for the commands that run one paged cache
  // through factory(); `kvq eval` makes its own caches per window and has none.
  void add(CLI::App* cmd, const std::string& cache_help, bool with_pool = true) {
    cmd->add_option("--cache", cache, cache_help);
    cmd->add_option("--protect", protect, "protection preset: none (S = W = N = 0) or paper (S = 4, W = 128)")
        ->check(CLI::IsMember({"none", "paper"}));
    cmd->add_option("--sinks", sinks, "sink tokens read from bf16 rows (overrides --protect)")->check(at_least(0));
    cmd->add_option("--window", window, "recent tokens read from bf16 rows (overrides --protect)")->check(at_least(0));
    cmd->add_option("--boundary-layers", boundary, "first and last N layers kept bf16 (overrides --protect)")
        ->check(at_least(0));
    cmd->add_option("--calib-text", calib_text, "calibration text of kvq's TurboQuant formats (never the evaluation text)");
    if (!with_pool) return;
    cmd->add_option("--pool-mib", pool_mib, "page pool budget in MiB for all layers (0: grow as needed)")
        ->check(at_least(0));
    cmd->add_flag("--preempt", preempt, "on an exhausted pool evict another sequence instead of failing");
  }

  // The cache for `kvq ppl` / `kvq generate`: the dense bf16 cache when --cache is absent, else
  // the paged cache in that format (calibrated on --calib-text when the format learns from data).
  std::function<std::unique_ptr<KvCache>(const CacheGeometry&)> factory(Model& model, const Tokenizer& tok, int ctx) const {
    if (cache.empty() && protect == "none" && sinks < 0 && window < 0 && boundary < 0 && pool_mib == 0)
      return [](const CacheGeometry& g) { return make_dense_cache(g); };
    CacheOptions o;
    const CacheConfig c = parse_cache_config(cache.empty() ? "bf16" : cache, policy());
    o.format = c.format;
    o.protect = c.protect;
    o.pool_bytes = static_cast<std::size_t>(pool_mib * 1024.0 * 1024.0);
    o.preempt = preempt;
    const FormatSpec& f = find_format(c.format);
    check_format_fits(f, model.cache_geometry());
    if (format_needs_calibration(f)) {
      std::ifstream in(resolve_path(calib_text), std::ios::binary);
      if (!in) fail(calib_text + ": cannot open the calibration text");
      std::stringstream ss;
      ss << in.rdbuf();
      o.outliers = calibrate_format(model, tok, ss.str(), f, 16384, ctx);
    }
    return [o](const CacheGeometry& g) { return std::unique_ptr<KvCache>(std::make_unique<PagedCache>(g, o)); };
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
