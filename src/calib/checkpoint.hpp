// Internal to kvq_calib: every tensor of a Hugging Face checkpoint directory (one
// model.safetensors, or the shards listed by model.safetensors.index.json), memory-mapped.
#pragma once

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/common.hpp"
#include "kvq/safetensors.hpp"

namespace kvq::calib_detail {

namespace fs = std::filesystem;

inline std::string read_file_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) fail(p.string() + ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Every tensor of a checkpoint directory, in name order, with the file that holds it.
struct Checkpoint {
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, const TensorView*> tensors;

  explicit Checkpoint(const std::string& dir) {
    const fs::path index = fs::path(dir) / "model.safetensors.index.json";
    std::vector<std::string> names;
    if (fs::exists(index)) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(read_file_text(index));
      } catch (const nlohmann::json::exception& e) {
        fail(index.string() + ": malformed JSON: " + e.what());
      }
      if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object())
        fail(index.string() + ": field 'weight_map' must be an object");
      for (auto it = j.at("weight_map").begin(); it != j.at("weight_map").end(); ++it) {
        if (!it.value().is_string()) fail(index.string() + ": weight_map entry '" + it.key() + "' is not a file name");
        const std::string file = it.value().get<std::string>();
        if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
          fail(index.string() + ": weight_map entry '" + it.key() + "' names an invalid file '" + file + "'");
        names.push_back(file);
      }
    } else {
      names.push_back("model.safetensors");
    }
    for (const auto& n : names) {
      if (files.count(n)) continue;
      const fs::path p = fs::path(dir) / n;
      if (!fs::exists(p)) fail(dir + ": checkpoint file " + n + " not found");
      files.emplace(n, std::make_unique<SafetensorsFile>(p.string()));
    }
    for (const auto& [n, f] : files)
      for (const auto& [name, view] : f->tensors()) tensors[name] = &view;
  }
  const TensorView& get(const std::string& name) const {
    auto it = tensors.find(name);
    if (it == tensors.end()) fail("checkpoint: missing tensor '" + name + "'");
    return *it->second;
  }
};

}  // namespace kvq::calib_detail
