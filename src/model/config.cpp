// config.json parsing for the supported architectures, and the RoPE frequency tables.
//
// Reads both transformers 5's `rope_parameters` and the older `rope_theta` + `rope_scaling`
// forms. Defaults follow the transformers 5.17 config classes; fields that change the math in a
// way kvq does not implement (sliding windows, other RoPE types, partial rotary, non-SiLU
// activations, other quantization methods...) are errors that name the field, never a guess.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvq/common.hpp"
#include "kvq/model.hpp"

namespace kvq {

namespace {

using json = nlohmann::json;

struct Reader {
  const json& j;
  const std::string& label;

  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }
  [[noreturn]] void bad(const char* key, const std::string& why) const {
    fail(label + ": field '" + key + "' " + why);
  }
  int get_int(const char* key) const {
    if (!has(key)) bad(key, "is required");
    const auto& v = j.at(key);
    if (!v.is_number_integer()) bad(key, "must be an integer, got " + v.dump());
    const auto x = v.get<std::int64_t>();
    if (x < 0 || x > (1ll << 31) - 1) bad(key, "out of range: " + v.dump());
    return static_cast<int>(x);
  }
  int get_int(const char* key, int def) const { return has(key) ? get_int(key) : def; }
  int get_pos(const char* key) const {
    const int x = get_int(key);
    if (x <= 0) bad(key, "must be positive");
    return x;
  }
  double get_num(const char* key, double def) const {
    if (!has(key)) return def;
    const auto& v = j.at(key);
    if (!v.is_number()) bad(key, "must be a number, got " + v.dump());
    return v.get<double>();
  }
  bool get_bool(const char* key, bool def) const {
    if (!has(key)) return def;
    const auto& v = j.at(key);
    if (!v.is_boolean()) bad(key, "must be true or false, got " + v.dump());
    return v.get<bool>();
  }
  std::string get_str(const char* key, const std::string& def) const {
    if (!has(key)) return def;
    const auto& v = j.at(key);
    if (!v.is_string()) bad(key, "must be a string, got " + v.dump());
    return v.get<std::string>();
  }
};

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

void parse_rope(const json& root, const std::string& label, ModelConfig& c) {
  // transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; older files carry
  // rope_theta at the top level and rope_scaling {type|rope_type, factor, ...} (or null).
  json params = json::object();
  std::string where;
  if (root.contains("rope_parameters") && !root.at("rope_parameters").is_null()) {
    params = root.at("rope_parameters");
    where = "rope_parameters";
  } else if (root.contains("rope_scaling") && !root.at("rope_scaling").is_null()) {
    params = root.at("rope_scaling");
    where = "rope_scaling";
  }
  if (!params.is_object()) fail(label + ": field '" + where + "' must be an object");
  if (params.contains("full_attention") || params.contains("sliding_attention"))
    fail(label + ": field '" + where + "' holds per-layer-type RoPE parameters, which kvq does not support");
  const Reader top{root, label};
  const Reader rp{params, label + " (" + (where.empty() ? std::string("rope") : where) + ")"};
  std::string type = rp.get_str("rope_type", rp.get_str("type", "default"));
  if (type == "deepseek_yarn") type = "yarn";
  c.rope.type = type;
  c.rope.theta = rp.has("rope_theta") ? rp.get_num("rope_theta", 10000.0) : top.get_num("rope_theta", 10000.0);
  if (!(c.rope.theta > 1.0)) fail(label + ": field 'rope_theta' must be > 1");
  const double partial = rp.has("partial_rotary_factor") ? rp.get_num("partial_rotary_factor", 1.0)
                                                         : top.get_num("partial_rotary_factor", 1.0);
  if (partial != 1.0) fail(label + ": field 'partial_rotary_factor' = " + std::to_string(partial) + " is not supported");
  if (type == "default") {
    c.rope.attention_factor = 1.0;
  } else if (type == "yarn") {
    if (!rp.has("factor")) rp.bad("factor", "is required for yarn");
    c.rope.factor = rp.get_num("factor", 1.0);
    if (!(c.rope.factor >= 1.0)) rp.bad("factor", "must be >= 1");
    if (!rp.has("original_max_position_embeddings")) rp.bad("original_max_position_embeddings", "is required for yarn");
    c.rope.original_max_position_embeddings = rp.get_pos("original_max_position_embeddings");
    c.rope.beta_fast = rp.get_num("beta_fast", 0.0);
    if (c.rope.beta_fast == 0.0) c.rope.beta_fast = 32.0;  // transformers: `or 32`
    c.rope.beta_slow = rp.get_num("beta_slow", 0.0);
    if (c.rope.beta_slow == 0.0) c.rope.beta_slow = 1.0;
    c.rope.mscale = rp.get_num("mscale", 0.0);
    c.rope.mscale_all_dim = rp.get_num("mscale_all_dim", 0.0);
    c.rope.truncate = rp.get_bool("truncate", true);
    if (rp.has("attention_factor")) {
      c.rope.attention_factor = rp.get_num("attention_factor", 1.0);
    } else if (c.rope.mscale != 0.0 && c.rope.mscale_all_dim != 0.0) {
      c.rope.attention_factor = yarn_get_mscale(c.rope.factor, c.rope.mscale) /
                                yarn_get_mscale(c.rope.factor, c.rope.mscale_all_dim);
    } else {
      c.rope.attention_factor = yarn_get_mscale(c.rope.factor, 1.0);
    }
  } else if (type == "linear") {
    if (!rp.has("factor")) rp.bad("factor", "is required for linear");
    c.rope.factor = rp.get_num("factor", 1.0);
    if (!(c.rope.factor > 0.0)) rp.bad("factor", "must be > 0");
    c.rope.attention_factor = 1.0;
  } else if (type == "llama3") {
    for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
      if (!rp.has(k)) rp.bad(k, "is required for llama3");
    c.rope.factor = rp.get_num("factor", 1.0);
    if (!(c.rope.factor > 0.0)) rp.bad("factor", "must be > 0");
    c.rope.low_freq_factor = rp.get_num("low_freq_factor", 1.0);
    c.rope.high_freq_factor = rp.get_num("high_freq_factor", 4.0);
    if (!(c.rope.low_freq_factor > 0.0)) rp.bad("low_freq_factor", "must be > 0");
    if (!(c.rope.high_freq_factor > c.rope.low_freq_factor)) rp.bad("high_freq_factor", "must be > low_freq_factor");
    c.rope.original_max_position_embeddings = rp.get_pos("original_max_position_embeddings");
    c.rope.attention_factor = 1.0;
  } else {
    fail(label + ": field '" + (where.empty() ? std::string("rope_type") : where + ".rope_type") + "' = '" + type +
         "' is not supported (supported: default, yarn, llama3, linear)");
  }
}

void parse_moe(const Reader& r, ModelConfig& c) {
  MoeConfig& m = c.moe;
  m.n_routed_experts = r.get_int("n_routed_experts", 0);
  if (m.n_routed_experts == 0) return;
  m.n_shared_experts = r.get_int("n_shared_experts", 0);
  m.top_k = r.get_pos("num_experts_per_tok");
  m.moe_intermediate_size = r.get_pos("moe_intermediate_size");
  m.first_k_dense_replace = r.get_int("first_k_dense_replace", 0);
  m.moe_layer_freq = r.get_int("moe_layer_freq", 1);
  if (m.moe_layer_freq <= 0) r.bad("moe_layer_freq", "must be positive");
  m.n_group = r.get_int("n_group", 1);
  m.topk_group = r.get_int("topk_group", 1);
  if (m.n_group <= 0) r.bad("n_group", "must be positive");
  if (m.n_routed_experts % m.n_group != 0) r.bad("n_group", "must divide n_routed_experts");
  if (m.topk_group <= 0 || m.topk_group > m.n_group) r.bad("topk_group", "must be in [1, n_group]");
  const bool v3 = c.arch == Arch::kDeepseekV3;
  const std::string method = r.get_str("topk_method", v3 ? "noaux_tc" : "greedy");
  const std::string scoring = r.get_str("scoring_func", v3 ? "sigmoid" : "softmax");
  if (v3) {
    // transformers' and DeepSeek's V3 code route only one way.
    if (method != "noaux_tc") r.bad("topk_method", "= '" + method + "' is not supported for DeepseekV3 (noaux_tc only)");
    if (scoring != "sigmoid") r.bad("scoring_func", "= '" + scoring + "' is not supported for DeepseekV3 (sigmoid only)");
    m.topk_method = TopkMethod::kNoauxTc;
    m.scoring = MoeScoring::kSigmoid;
    m.correction_bias = true;
    m.norm_topk_prob = r.get_bool("norm_topk_prob", true);
  } else {
    if (method == "greedy") m.topk_method = TopkMethod::kGreedy;
    else if (method == "group_limited_greedy") m.topk_method = TopkMethod::kGroupLimitedGreedy;
    else r.bad("topk_method", "= '" + method + "' is not supported for DeepseekV2 (greedy, group_limited_greedy)");
    if (scoring != "softmax") r.bad("scoring_func", "= '" + scoring + "' is not supported for DeepseekV2 (softmax only)");
    m.scoring = MoeScoring::kSoftmax;
    m.norm_topk_prob = r.get_bool("norm_topk_prob", false);
  }
  m.routed_scaling_factor = static_cast<float>(r.get_num("routed_scaling_factor", 1.0));
  const int per_group = m.n_routed_experts / m.n_group;
  if (m.top_k > m.topk_group * per_group) r.bad("num_experts_per_tok", "exceeds the experts of topk_group groups");
  if (m.topk_method == TopkMethod::kNoauxTc && m.n_group > 1 && per_group < 2)
    r.bad("n_group", "leaves fewer than 2 experts per group (noaux_tc scores a group by its best two)");
}

}  // namespace

ModelConfig parse_model_config(const std::string& text, const std::string& label) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(label + ": malformed JSON: " + e.what());
  }
  if (!j.is_object()) fail(label + ": not a JSON object");
  const Reader r{j, label};
  ModelConfig c;
  if (!r.has("architectures") || !j.at("architectures").is_array() || j.at("architectures").empty() ||
      !j.at("architectures")[0].is_string())
    fail(label + ": field 'architectures' must be a non-empty list of names");
  if (j.at("architectures").size() != 1) fail(label + ": field 'architectures' names more than one architecture");
  c.architecture = j.at("architectures")[0].get<std::string>();
  c.model_type = r.get_str("model_type", "");
  if (c.architecture == "LlamaForCausalLM" || c.architecture == "MistralForCausalLM" ||
      c.architecture == "Qwen2ForCausalLM" || c.architecture == "Qwen3ForCausalLM") {
    c.arch = Arch::kLlama;
  } else if (c.architecture == "DeepseekV2ForCausalLM") {
    c.arch = Arch::kDeepseekV2;
  } else if (c.architecture == "DeepseekV3ForCausalLM") {
    c.arch = Arch::kDeepseekV3;
  } else {
    fail(label + ": field 'architectures' = '" + c.architecture +
         "' is not supported (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
         "DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)");
  }

  c.vocab_size = r.get_pos("vocab_size");
  c.hidden_size = r.get_pos("hidden_size");
  c.n_layers = r.get_pos("num_hidden_layers");
  c.n_heads = r.get_pos("num_attention_heads");
  c.intermediate_size = r.get_pos("intermediate_size");
  c.max_position_embeddings = r.get_pos("max_position_embeddings");
  c.rms_norm_eps = static_cast<float>(r.get_num("rms_norm_eps", 1e-6));
  c.tie_word_embeddings = r.get_bool("tie_word_embeddings", false);
  const std::string act = r.get_str("hidden_act", "silu");
  if (act != "silu") r.bad("hidden_act", "= '" + act + "' is not supported (silu only)");
  c.mlp_bias = r.get_bool("mlp_bias", false);
  const bool attention_bias = r.get_bool("attention_bias", false);
  c.bos_token_id = r.get_int("bos_token_id", -1);
  if (r.has("eos_token_id")) {
    const auto& e = j.at("eos_token_id");
    if (e.is_array()) {
      for (const auto& x : e) {
        if (!x.is_number_integer()) r.bad("eos_token_id", "must hold integers");
        c.eos_token_ids.push_back(x.get<int>());
      }
    } else {
      c.eos_token_ids.push_back(r.get_int("eos_token_id"));
    }
  }
  // Sliding-window attention changes which keys a query sees: refuse it when it is active.
  if (r.get_bool("use_sliding_window", c.architecture == "MistralForCausalLM") && r.has("sliding_window") &&
      r.get_int("sliding_window") < c.max_position_embeddings)
    r.bad("sliding_window", "is active (" + std::to_string(r.get_int("sliding_window")) + " tokens): not supported");
  if (r.has("layer_types")) {
    for (const auto& t : j.at("layer_types"))
      if (!t.is_string() || t.get<std::string>() != "full_attention")
        r.bad("layer_types", "contains " + t.dump() + ": only full_attention is supported");
  }
  if (r.has("quantization_config")) {
    const auto& q = j.at("quantization_config");
    const Reader qr{q, label + " (quantization_config)"};
    const std::string method = qr.get_str("quant_method", "");
    if (method != "fp8") qr.bad("quant_method", "= '" + method + "' is not supported (fp8 only)");
    const std::string fmt = qr.get_str("fmt", "e4m3");
    if (fmt != "e4m3") qr.bad("fmt", "= '" + fmt + "' is not supported (e4m3 only)");
    if (q.contains("weight_block_size") && !q.at("weight_block_size").is_null()) {
      const auto& b = q.at("weight_block_size");
      if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
          b[0].get<int>() <= 0 || b[1].get<int>() <= 0)
        qr.bad("weight_block_size", "must be two positive integers");
      c.fp8_block_rows = b[0].get<int>();
      c.fp8_block_cols = b[1].get<int>();
    } else {
      qr.bad("weight_block_size", "is required (per-tensor fp8 scales are not supported)");
    }
    c.fp8 = true;
  }

  if (c.arch == Arch::kLlama) {
    c.n_kv_heads = r.get_int("num_key_value_heads", c.n_heads);
    if (c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads != 0)
      r.bad("num_key_value_heads", "must divide num_attention_heads");
    c.head_dim = r.has("head_dim") ? r.get_pos("head_dim") : c.hidden_size / c.n_heads;
    if (!r.has("head_dim") && c.hidden_size % c.n_heads != 0) r.bad("hidden_size", "is not a multiple of num_attention_heads");
    if (c.head_dim % 2 != 0) r.bad("head_dim", "must be even");
    if (c.architecture == "Qwen2ForCausalLM") {
      c.qkv_bias = true;  // Qwen2 always has q/k/v bias and no o_proj bias
      c.o_bias = false;
    } else {
      c.qkv_bias = attention_bias;
      c.o_bias = attention_bias;
    }
    c.qk_norm = c.architecture == "Qwen3ForCausalLM";
    parse_rope(j, label, c);
    c.rope.dim = c.head_dim;
    c.rope.interleaved = false;
    c.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  } else {
    c.mla = true;
    if (attention_bias) r.bad("attention_bias", "= true is not supported for DeepSeek models");
    if (c.mlp_bias) r.bad("mlp_bias", "= true is not supported for DeepSeek models");
    c.q_lora_rank = r.get_int("q_lora_rank", 0);
    c.kv_lora_rank = r.get_pos("kv_lora_rank");
    c.qk_nope_head_dim = r.get_pos("qk_nope_head_dim");
    c.qk_rope_head_dim = r.get_pos("qk_rope_head_dim");
    c.v_head_dim = r.get_pos("v_head_dim");
    if (c.qk_rope_head_dim % 2 != 0) r.bad("qk_rope_head_dim", "must be even");
    c.n_kv_heads = c.n_heads;
    c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
    parse_rope(j, label, c);
    c.rope.dim = c.qk_rope_head_dim;
    c.rope.interleaved = c.arch == Arch::kDeepseekV2 ? true : r.get_bool("rope_interleave", true);
    double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim));
    // DeepSeek's softmax-scale correction: with YaRN, scores are scaled by mscale(factor, mscale_all_dim)^2.
    if (c.rope.type != "default" && c.rope.mscale_all_dim != 0.0) {
      const double m = yarn_get_mscale(c.rope.factor, c.rope.mscale_all_dim);
      scale *= m * m;
    }
    c.softmax_scale = static_cast<float>(scale);
    parse_moe(r, c);
  }
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path + ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_model_config(ss.str(), path);
}

std::vector<float> rope_inv_freq(const RopeConfig& rope) {
  const int half = rope.dim / 2;
  std::vector<float> inv(half), pos_freq(half);
  // transformers computes these in float32: base ** (arange(0, dim, 2) / dim) then 1 / that.
  for (int i = 0; i < half; ++i) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(rope.dim);
    pos_freq[i] = static_cast<float>(std::pow(static_cast<double>(static_cast<float>(rope.theta)), double(expo)));
    inv[i] = 1.0f / pos_freq[i];
  }
  if (rope.type == "linear") {
    // Position interpolation: every frequency over the factor (float32, as transformers divides its tensor).
    for (int i = 0; i < half; ++i) inv[i] /= static_cast<float>(rope.factor);
  } else if (rope.type == "llama3") {
    // Llama 3.1's scaling: wavelengths 2 pi / f shorter than orig / high_freq_factor keep f, those longer than
    // orig / low_freq_factor take f / factor, and the band between blends the two with
    // s = (orig / wavelength - low) / (high - low): (1 - s) f / factor + s f. Float32 arithmetic in transformers'
    // order (its tensors are float32; the Python scalars take part as float32).
    const double orig = rope.original_max_position_embeddings;
    const float low_wavelen = static_cast<float>(orig / rope.low_freq_factor);
    const float high_wavelen = static_cast<float>(orig / rope.high_freq_factor);
    const float f = static_cast<float>(rope.factor), lo = static_cast<float>(rope.low_freq_factor);
    const float span = static_cast<float>(rope.high_freq_factor - rope.low_freq_factor);
    for (int i = 0; i < half; ++i) {
      const float wavelen = static_cast<float>(2.0 * M_PI) / inv[i];
      float v = wavelen > low_wavelen ? inv[i] / f : inv[i];
      if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
        const float s = (static_cast<float>(orig) / wavelen - lo) / span;
        v = (1.0f - s) * v / f + s * v;
      }
      inv[i] = v;
    }
  } else if (rope.type == "yarn") {
    // YaRN (arXiv 2309.00071 sec. 3.2): blend interpolated (1/factor) and extrapolated
    // frequencies with a linear ramp between the dims that rotate beta_fast and beta_slow times
    // over the original context.
    const double dim = rope.dim, base = rope.theta, omax = rope.original_max_position_embeddings;
    auto corr_dim = [&](double rot) { return dim * std::log(omax / (rot * 2.0 * M_PI)) / (2.0 * std::log(base)); };
    double low = corr_dim(rope.beta_fast), high = corr_dim(rope.beta_slow);
    if (rope.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, dim - 1);
    if (low == high) high += 0.001;
    for (int i = 0; i < half; ++i) {
      const float extra = inv[i];
      const float inter = 1.0f / (static_cast<float>(rope.factor) * pos_freq[i]);
      float ramp = (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low);
      ramp = std::min(1.0f, std::max(0.0f, ramp));
      const float extra_factor = 1.0f - ramp;
      inv[i] = inter * (1.0f - extra_factor) + extra * extra_factor;
    }
  }
  return inv;
}

}  // namespace kvq

namespace kvq {

void apply_calibration_file(const std::string& dir, ModelConfig& cfg) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(dir) / "kvq_calibration.json";
  if (!fs::exists(path)) return;
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path.string() + ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const std::exception& e) {
    fail(path.string() + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) fail(path.string() + ": expected a JSON object");
  const auto it = j.find("online_rope_hadamard");
  if (it == j.end()) return;
  if (!it->is_boolean()) fail(path.string() + ": online_rope_hadamard must be true or false");
  if (!it->get<bool>()) return;
  const int d = cfg.qk_rope_head_dim;
  if (!cfg.mla) fail(path.string() + ": online_rope_hadamard needs an MLA model");
  if (d <= 0 || (d & (d - 1)) != 0)
    fail(path.string() + ": online_rope_hadamard needs a power-of-two qk_rope_head_dim, not " + std::to_string(d));
  cfg.online_rope_hadamard = true;
}

}  // namespace kvq
