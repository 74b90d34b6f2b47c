// kvq/safetensors.hpp: reading .safetensors files (memory-mapped, validated).
//
// File layout: an 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data buffer. Validation (every failure is a kvq::Error naming the file and tensor):
// N bounded and inside the file, JSON well formed, known dtypes, offsets inside the buffer,
// non-overlapping, and shape x element size == byte length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kvq {

enum class DType { kF32, kF16, kBF16, kF8E4M3, kI64, kI32, kI16, kI8, kU8, kBool, kF64 };
std::size_t dtype_size(DType t);
const char* dtype_name(DType t);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  const std::uint8_t* data = nullptr;  // into the mapping; valid while the file is open
  std::size_t nbytes = 0;
  std::int64_t numel() const;
  // Copies the tensor to float32 (bf16, f16, f32, f8-e4m3, integer types); kvq::Error otherwise.
  std::vector<float> to_float() const;
};

class SafetensorsFile {
 public:
  // Opens and validates; throws kvq::Error with the file name on any problem.
  explicit SafetensorsFile(const std::string& path);
  // Parses an in-memory image (used by the fuzzer); `label` names it in errors.
  static std::unique_ptr<SafetensorsFile> from_memory(std::vector<std::uint8_t> bytes,
                                                      const std::string& label);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  const TensorView& get(const std::string& name) const;  // kvq::Error if missing
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  void parse(const std::uint8_t* base, std::size_t size);
  std::string path_;
  void* map_ = nullptr;
  std::size_t map_size_ = 0;
  std::vector<std::uint8_t> owned_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (float32 data given, stored as `dtype`: F32, BF16 or F16) to a new file.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  std::vector<float> values;
};
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace kvq
