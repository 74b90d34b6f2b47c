// Internal: resolves tensor names of a Hugging Face model directory (one model.safetensors or
// shards listed by model.safetensors.index.json) and converts them to fp32 with shape checks and
// fp8 e4m3 block-scale dequantization. Every error names the file and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvq/model.hpp"
#include "kvq/safetensors.hpp"

namespace kvq::detail {

class WeightStore {
 public:
  WeightStore(const std::string& dir, const ModelConfig& cfg);
  bool has(const std::string& name) const;
  // fp32 values of `name`, which must have exactly `shape`.
  std::vector<float> load(const std::string& name, const std::vector<std::int64_t>& shape);
  const std::vector<std::int64_t>& shape_of(const std::string& name);

 private:
  const SafetensorsFile& file_for(const std::string& name);
  std::string dir_;
  const ModelConfig& cfg_;
  bool sharded_ = false;
  std::string index_path_;
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file name
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

}  // namespace kvq::detail
