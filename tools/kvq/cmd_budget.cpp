// `kvq budget`: bytes per token, compression vs bf16 and tokens that fit a memory budget, for
// every format, on named model shapes and on a model directory's config.json (the chapter's
// kv_budget table; MLA caches in latent + RoPE form).
#include <fmt/core.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "command.hpp"
#include "kvq/formats.hpp"
#include "kvq/paged_cache.hpp"
#include "table.hpp"

namespace {

kvq::CacheGeometry geometry_from_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream f(path);
  if (!f) kvq::fail(path + ": cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    kvq::fail(path + ": malformed JSON: " + e.what());
  }
  auto geti = [&](const char* k) -> int {
    if (!j.contains(k) || !j[k].is_number_integer()) kvq::fail(path + ": missing integer field '" + std::string(k) + "'");
    return j[k].get<int>();
  };
  kvq::CacheGeometry g;
  g.n_layers = geti("num_hidden_layers");
  if (j.contains("kv_lora_rank") && j["kv_lora_rank"].is_number_integer()) {
    g.mla = true;
    g.d_latent = geti("kv_lora_rank");
    g.d_rope = geti("qk_rope_head_dim");
  } else {
    g.n_kv_heads = j.contains("num_key_value_heads") ? geti("num_key_value_heads") : geti("num_attention_heads");
    g.head_dim = j.contains("head_dim") && j["head_dim"].is_number_integer() ? geti("head_dim")
                                                                             : geti("hidden_size") / geti("num_attention_heads");
    g.v_head_dim = g.head_dim;
  }
  return g;
}

// Persistent bytes of one request per layer and for the whole model (pages, protection rows,
// reverse maps), the QuantMLA paper's accounting (docs/cache.md).
void run_context(const std::vector<kvq::NamedShape>& shapes, const std::string& caches, const std::vector<int>& contexts,
                 const kvq::ProtectionPolicy& pol, bool json) {
  nlohmann::json rows = nlohmann::json::array();
  kvq::cli::Table t({"model", "format", "context", "page bytes/layer", "pages/layer", "packed/layer", "protection/layer",
                     "reverse map/layer", "total (model)", "bf16 total", "x vs bf16"});
  for (const auto& s : shapes) {
    std::vector<std::string> names = caches.empty() ? kvq::format_names(s.geometry.mla ? kvq::FormatFamily::kMLA : kvq::FormatFamily::kKV)
                                                    : kvq::cli::split_list(caches);
    for (const auto& n : names) {
      for (int L : contexts) {
        const auto m = kvq::PagedCache::account(s.geometry, n, pol, L);
        const auto b = kvq::PagedCache::account(s.geometry, "bf16", kvq::ProtectionPolicy{}, L);
        const std::size_t layers = static_cast<std::size_t>(s.geometry.n_layers);
        const auto page = kvq::page_layout(kvq::find_format(n), s.geometry).page_bytes;
        const double ratio = static_cast<double>(b.packed_bytes) / static_cast<double>(m.total());
        rows.push_back({{"model", s.name}, {"format", n}, {"context", L}, {"sinks", pol.sinks}, {"window", pol.window},
                        {"boundary_layers", pol.boundary_layers}, {"page_bytes_per_layer", page}, {"pages", m.blocks},
                        {"packed_bytes", m.packed_bytes}, {"protection_bytes", m.protection_bytes},
                        {"reverse_map_bytes", m.reverse_map_bytes}, {"total_bytes", m.total()},
                        {"bf16_bytes", b.packed_bytes}, {"ratio_vs_bf16", ratio}});
        t.add({s.name, n, std::to_string(L), std::to_string(page), std::to_string(m.blocks), std::to_string(m.packed_bytes / layers),
               std::to_string(m.protection_bytes / layers), std::to_string(m.reverse_map_bytes / layers), std::to_string(m.total()),
               std::to_string(b.packed_bytes), fmt::format("{:.2f}", ratio)});
      }
    }
  }
  if (json) {
    fmt::print("{}\n", nlohmann::json({{"rows", rows}}).dump(1));
    return;
  }
  fmt::print("Persistent bytes of one request (S = {}, W = {}, N = {}; pages of 64 tokens; bf16 = pages only)\n", pol.sinks,
             pol.window, pol.boundary_layers);
  t.print(stdout, 2);
}

void run(const std::vector<std::string>& models, const std::string& caches, double budget_gib, bool json,
         const std::string& contexts, const std::string& protect) {
  std::vector<kvq::NamedShape> shapes;
  if (models.empty()) {
    shapes = kvq::named_shapes();
  } else {
    for (const auto& m : models) {
      bool named = false;
      for (const auto& s : kvq::named_shapes())
        if (s.name == m) shapes.push_back(s), named = true;
      if (!named) shapes.push_back({m, geometry_from_config(kvq::cli::resolve_path(m))});
    }
  }
  if (!contexts.empty()) {
    const std::vector<int> lengths = kvq::cli::parse_int_list(contexts);
    for (int L : lengths) kvq::require(L >= 1, "--context: each request length must be >= 1, got " + std::to_string(L));
    run_context(shapes, caches, lengths,
                protect == "paper" ? kvq::ProtectionPolicy::paper() : kvq::ProtectionPolicy{}, json);
    return;
  }
  const double budget = budget_gib * 1024.0 * 1024.0 * 1024.0;
  nlohmann::json rows = nlohmann::json::array();
  kvq::cli::Table t({"model", "format", "bits/value", "KiB/token", "x vs bf16", fmt::format("tokens in {:g} GiB", budget_gib)});
  for (const auto& s : shapes) {
    const double bf16 = static_cast<double>(kvq::bf16_token_bytes(s.geometry)) * s.geometry.n_layers;
    std::vector<std::string> names = caches.empty() ? kvq::format_names(s.geometry.mla ? kvq::FormatFamily::kMLA : kvq::FormatFamily::kKV)
                                                    : kvq::cli::split_list(caches);
    for (const auto& n : names) {
      const auto& f = kvq::find_format(n);
      kvq::check_format_fits(f, s.geometry);
      const auto tb = kvq::token_bytes(f, s.geometry);
      const double bytes = static_cast<double>(tb.per_layer) * s.geometry.n_layers;
      const double tokens = std::floor(budget / bytes);
      rows.push_back({{"model", s.name}, {"format", n}, {"bits_per_value", tb.bits_per_value}, {"bytes_per_token", bytes},
                      {"ratio_vs_bf16", bf16 / bytes}, {"tokens_in_budget", tokens}});
      t.add({s.name, n, fmt::format("{:.3f}", tb.bits_per_value), fmt::format("{:.1f}", bytes / 1024.0),
             fmt::format("{:.2f}", bf16 / bytes), fmt::format("{:.0f}", tokens)});
    }
  }
  if (json) {
    fmt::print("{}\n", nlohmann::json({{"budget_gib", budget_gib}, {"rows", rows}}).dump(1));
    return;
  }
  t.print(stdout, 2);
}

void register_cmd(CLI::App& app) {
  auto* cmd = app.add_subcommand("budget", "KV-cache bytes per token and capacity per format");
  auto models = std::make_shared<std::vector<std::string>>();
  auto caches = std::make_shared<std::string>();
  auto gib = std::make_shared<double>(40.0);
  auto json = std::make_shared<bool>(false);
  auto ctx = std::make_shared<std::string>();
  auto protect = std::make_shared<std::string>("none");
  cmd->add_option("--context", *ctx, "comma-separated request lengths: print the persistent bytes of one request");
  cmd->add_option("--protect", *protect, "with --context: none or paper (S = 4, W = 128)")->check(CLI::IsMember({"none", "paper"}));
  cmd->add_option("--model", *models, "model dir (config.json) or a named shape: Llama-3.1-8B, Llama-3.1-70B, DeepSeek-V2-Lite");
  cmd->add_option("--cache", *caches, "comma-separated formats (default: every format that fits)");
  cmd->add_option("--budget-gib", *gib, "memory budget for the cache, GiB")->check(kvq::cli::greater_than(0));
  cmd->add_flag("--json", *json, "print one JSON object");
  cmd->callback([=] { run(*models, *caches, *gib, *json, *ctx, *protect); });
}

}  // namespace

KVQ_REGISTER_COMMAND("budget", register_cmd);
