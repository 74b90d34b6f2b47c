// Tensor lookup across safetensors shards and conversion to fp32 (bf16, f16, f32, and fp8 e4m3
// with DeepSeek-V3's block scales: w = fp8 * weight_scale_inv[row / block_rows][col / block_cols]).
#include "weights.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvq/common.hpp"

namespace kvq::detail {

namespace {
std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
}  // namespace

WeightStore::WeightStore(const std::string& dir, const ModelConfig& cfg) : dir_(dir), cfg_(cfg) {
  namespace fs = std::filesystem;
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    sharded_ = true;
    index_path_ = index.string();
    std::ifstream f(index_path_, std::ios::binary);
    if (!f) fail(index_path_ + ": cannot open");
    std::stringstream ss;
    ss << f.rdbuf();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(ss.str());
    } catch (const nlohmann::json::exception& e) {
      fail(index_path_ + ": malformed JSON: " + e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object())
      fail(index_path_ + ": field 'weight_map' must be an object");
    for (auto it = j.at("weight_map").begin(); it != j.at("weight_map").end(); ++it) {
      if (!it.value().is_string()) fail(index_path_ + ": weight_map entry '" + it.key() + "' is not a file name");
      const std::string file = it.value().get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        fail(index_path_ + ": weight_map entry '" + it.key() + "' names an invalid file '" + file + "'");
      weight_map_[it.key()] = file;
    }
  } else if (fs::exists(single)) {
    files_["model.safetensors"] = std::make_unique<SafetensorsFile>(single.string());
  } else {
    fail(dir + ": neither model.safetensors nor model.safetensors.index.json found");
  }
}

const SafetensorsFile& WeightStore::file_for(const std::string& name) {
  std::string file = "model.safetensors";
  if (sharded_) {
    auto it = weight_map_.find(name);
    if (it == weight_map_.end()) fail(index_path_ + ": missing tensor '" + name + "' (required by config.json)");
    file = it->second;
  }
  auto f = files_.find(file);
  if (f == files_.end()) {
    const std::string path = (std::filesystem::path(dir_) / file).string();
    f = files_.emplace(file, std::make_unique<SafetensorsFile>(path)).first;
  }
  if (!f->second->has(name))
    fail(f->second->path() + ": missing tensor '" + name + "' (required by config.json)");
  return *f->second;
}

bool WeightStore::has(const std::string& name) const {
  if (sharded_) return weight_map_.count(name) != 0;
  return files_.begin()->second->has(name);
}

const std::vector<std::int64_t>& WeightStore::shape_of(const std::string& name) {
  return file_for(name).get(name).shape;
}

std::vector<float> WeightStore::load(const std::string& name, const std::vector<std::int64_t>& shape) {
  const SafetensorsFile& file = file_for(name);
  const TensorView& t = file.get(name);
  const std::string where = file.path() + ": tensor '" + name + "'";
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16 && t.dtype != DType::kF8E4M3)
    fail(where + " has dtype " + dtype_name(t.dtype) + "; expected F32, F16, BF16 or F8_E4M3");
  if (t.shape != shape) fail(where + " has shape " + shape_str(t.shape) + ", expected " + shape_str(shape));
  std::vector<float> v = t.to_float();
  if (t.dtype == DType::kF8E4M3) {
    if (shape.size() != 2) fail(where + " is F8_E4M3 but not a matrix");
    const std::string sname = name + "_scale_inv";
    if (!has(sname)) fail(where + " is F8_E4M3 but its block scales '" + sname + "' are missing");
    const int br = cfg_.fp8_block_rows, bc = cfg_.fp8_block_cols;
    const std::int64_t rows = shape[0], cols = shape[1];
    const std::int64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
    const SafetensorsFile& sf = file_for(sname);
    const TensorView& st = sf.get(sname);
    if (st.dtype != DType::kF32 && st.dtype != DType::kBF16 && st.dtype != DType::kF16)
      fail(sf.path() + ": tensor '" + sname + "' has dtype " + dtype_name(st.dtype) + "; expected F32, BF16 or F16");
    if (st.shape != std::vector<std::int64_t>{sr, sc})
      fail(sf.path() + ": tensor '" + sname + "' has shape " + shape_str(st.shape) + ", expected " +
           shape_str({sr, sc}) + " (" + std::to_string(br) + "x" + std::to_string(bc) + " blocks)");
    const std::vector<float> s = st.to_float();
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) v[r * cols + c] *= s[(r / br) * sc + c / bc];
  }
  for (std::size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i])) fail(where + " contains NaN or Inf at element " + std::to_string(i));
  return v;
}

}  // namespace kvq::detail
