// Offline fusion of calibration transforms into a Hugging Face checkpoint (kvq/calibrate.hpp).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/calibrate.hpp"
#include "kvq/common.hpp"
#include "kvq/model.hpp"
#include "kvq/safetensors.hpp"
#include "checkpoint.hpp"

namespace kvq {

namespace fs = std::filesystem;

std::string file_checksum(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path + ": cannot open for the checksum");
  std::uint64_t h = 1469598103934665603ull;
  std::vector<char> buf(1 << 20);
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize n = f.gcount();
    for (std::streamsize i = 0; i < n; ++i) {
      h ^= static_cast<std::uint8_t>(buf[static_cast<std::size_t>(i)]);
      h *= 1099511628211ull;
    }
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
  return out;
}

std::string fuse_into(const std::string& model_dir, const std::vector<LayerTransform>& tr, const std::string& dir,
                      FuseDtype dtype, const std::string& calibration_json) {
  const ModelConfig cfg = load_model_config((fs::path(model_dir) / "config.json").string());
  if (!cfg.mla) fail(model_dir + ": fusion needs an MLA (DeepSeek-V2/V3) model, not " + cfg.architecture);
  if (cfg.fp8) fail(model_dir + ": fp8 block-scaled checkpoints are not supported by calibration");
  require(static_cast<int>(tr.size()) == cfg.n_layers, "fuse: one transform per layer expected");
  const int dc = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim, nh = cfg.n_heads, nope = cfg.qk_nope_head_dim,
            vd = cfg.v_head_dim, hid = cfg.hidden_size, qh = nope + dr;
  const RopePairs pairs{dr, cfg.rope.interleaved};
  const calib_detail::Checkpoint ck(model_dir);
  std::vector<TensorToWrite> out;
  for (const auto& [name, view] : ck.tensors) {
    TensorToWrite t;
    t.name = name;
    t.shape = view->shape;
    if (view->dtype != DType::kBF16 && view->dtype != DType::kF16 && view->dtype != DType::kF32)
      fail(model_dir + ": tensor '" + name + "' has dtype " + dtype_name(view->dtype) + "; calibration writes F32/BF16/F16 only");
    t.dtype = dtype == FuseDtype::kF32 ? DType::kF32 : view->dtype;
    t.values = view->to_float();
    out.push_back(std::move(t));
  }
  auto find = [&](const std::string& name) -> TensorToWrite& {
    for (auto& t : out)
      if (t.name == name) return t;
    fail(model_dir + ": missing tensor '" + name + "'");
  };
  for (int l = 0; l < cfg.n_layers; ++l) {
    const LayerTransform& T = tr[static_cast<std::size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
    const bool content = !T.rotation.empty() || !T.scale.empty();
    std::vector<double> rot = T.rotation;
    if (rot.empty()) {
      rot.assign(static_cast<std::size_t>(dc) * dc, 0.0);
      for (int i = 0; i < dc; ++i) rot[static_cast<std::size_t>(i) * dc + i] = 1.0;
    }
    require(rot.size() == static_cast<std::size_t>(dc) * dc, "fuse: rotation must be dc x dc");
    TensorToWrite& kva = find(p + "kv_a_proj_with_mqa.weight");
    require(kva.values.size() == static_cast<std::size_t>(dc + dr) * hid, "fuse: kv_a_proj_with_mqa has an unexpected shape");
    if (content) {
      TensorToWrite& norm = find(p + "kv_a_layernorm.weight");
      TensorToWrite& kvb = find(p + "kv_b_proj.weight");
      require(norm.values.size() == static_cast<std::size_t>(dc), "fuse: kv_a_layernorm has an unexpected shape");
      require(kvb.values.size() == static_cast<std::size_t>(nh) * (nope + vd) * dc, "fuse: kv_b_proj has an unexpected shape");
      std::vector<double> s = T.scale;
      if (s.empty()) s.assign(static_cast<std::size_t>(dc), 1.0);
      const std::vector<float> gamma = norm.values;
      fuse_content_producer(kva.values.data(), dc, hid, rot.data());
      fuse_content_consumer(kvb.values.data(), nh * (nope + vd), dc, gamma.data(), rot.data(), s.data());
      for (int j = 0; j < dc; ++j) norm.values[static_cast<std::size_t>(j)] = static_cast<float>(s[static_cast<std::size_t>(j)]);
    }
    if (!T.angle.empty() || !T.rope_scale.empty()) {
      const double* ang = T.angle.empty() ? nullptr : T.angle.data();
      const double* sc = T.rope_scale.empty() ? nullptr : T.rope_scale.data();
      fuse_rope_rows(kva.values.data() + static_cast<std::size_t>(dc) * hid, dr, hid, pairs, ang, sc, false);
      const bool lora = cfg.q_lora_rank > 0;
      TensorToWrite& q = find(p + (lora ? "q_b_proj.weight" : "q_proj.weight"));
      const int in = lora ? cfg.q_lora_rank : hid;
      require(q.values.size() == static_cast<std::size_t>(nh) * qh * in, "fuse: query projection has an unexpected shape");
      for (int h = 0; h < nh; ++h)
        fuse_rope_rows(q.values.data() + (static_cast<std::size_t>(h) * qh + nope) * in, dr, in, pairs, ang, sc, true);
    }
  }
  for (const auto& t : out)
    for (float v : t.values)
      if (!std::isfinite(v)) fail("fuse: non-finite value in fused tensor '" + t.name + "'");
  const fs::path st = fs::path(dir) / "model.safetensors";
  write_safetensors(st.string(), out, {{"format", "pt"}});
  // Config and tokenizer files; config's dtype follows the written tensors.
  nlohmann::json conf = nlohmann::json::parse(calib_detail::read_file_text(fs::path(model_dir) / "config.json"));
  if (dtype == FuseDtype::kF32) {
    conf["dtype"] = "float32";
    if (conf.contains("torch_dtype")) conf["torch_dtype"] = "float32";
  }
  {
    std::ofstream f(fs::path(dir) / "config.json", std::ios::binary);
    f << conf.dump(2) << "\n";
    if (!f) fail(dir + ": cannot write config.json");
  }
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"}) {
    const fs::path src = fs::path(model_dir) / name;
    if (fs::exists(src)) fs::copy_file(src, fs::path(dir) / name, fs::copy_options::overwrite_existing);
  }
  const std::string sum = file_checksum(st.string());
  if (!calibration_json.empty()) {
    std::ofstream f(fs::path(dir) / "kvq_calibration.json", std::ios::binary);
    f << calibration_json;
    if (!f) fail(dir + ": cannot write kvq_calibration.json");
  }
  return sum;
}

}  // namespace kvq
