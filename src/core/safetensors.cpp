// Safetensors reading and writing. The header is untrusted input: every offset and size is
// checked before use (fuzz/fuzz_safetensors.cpp drives this parser).
#include "kvq/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvq/common.hpp"
#include "kvq/numeric.hpp"

namespace kvq {

namespace {
constexpr std::uint64_t kMaxHeader = 100ull << 20;  // 100 MiB, as the reference implementation

bool parse_dtype(const std::string& s, DType& t) {
  static const std::pair<const char*, DType> table[] = {
      {"F32", DType::kF32},     {"F16", DType::kF16}, {"BF16", DType::kBF16},
      {"F8_E4M3", DType::kF8E4M3}, {"I64", DType::kI64}, {"I32", DType::kI32},
      {"I16", DType::kI16},     {"I8", DType::kI8},   {"U8", DType::kU8},
      {"BOOL", DType::kBool},   {"F64", DType::kF64}};
  for (const auto& [name, dt] : table) {
    if (s == name) {
      t = dt;
      return true;
    }
  }
  return false;
}
}  // namespace

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF64: case DType::kI64: return 8;
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF16: case DType::kBF16: case DType::kI16: return 2;
    case DType::kF8E4M3: case DType::kI8: case DType::kU8: case DType::kBool: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
    case DType::kI16: return "I16";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
    case DType::kF64: return "F64";
  }
  return "?";
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

std::vector<float> TensorView::to_float() const {
  const std::size_t n = static_cast<std::size_t>(numel());
  std::vector<float> out(n);
  if (n == 0) return out;
  const std::uint8_t* p = data;
  switch (dtype) {
    case DType::kF32: std::memcpy(out.data(), p, n * 4); break;
    case DType::kF64:
      for (std::size_t i = 0; i < n; ++i) { double v; std::memcpy(&v, p + 8 * i, 8); out[i] = static_cast<float>(v); }
      break;
    case DType::kBF16:
      for (std::size_t i = 0; i < n; ++i) { std::uint16_t h; std::memcpy(&h, p + 2 * i, 2); out[i] = bf16_to_float(h); }
      break;
    case DType::kF16:
      for (std::size_t i = 0; i < n; ++i) { std::uint16_t h; std::memcpy(&h, p + 2 * i, 2); out[i] = fp16_to_float(h); }
      break;
    case DType::kF8E4M3:
      for (std::size_t i = 0; i < n; ++i) out[i] = fp8_e4m3_to_float(p[i]);
      break;
    case DType::kI64:
      for (std::size_t i = 0; i < n; ++i) { std::int64_t v; std::memcpy(&v, p + 8 * i, 8); out[i] = static_cast<float>(v); }
      break;
    case DType::kI32:
      for (std::size_t i = 0; i < n; ++i) { std::int32_t v; std::memcpy(&v, p + 4 * i, 4); out[i] = static_cast<float>(v); }
      break;
    case DType::kI16:
      for (std::size_t i = 0; i < n; ++i) { std::int16_t v; std::memcpy(&v, p + 2 * i, 2); out[i] = static_cast<float>(v); }
      break;
    case DType::kI8:
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<std::int8_t>(p[i]));
      break;
    case DType::kU8: case DType::kBool:
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
      break;
  }
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail(path + ": cannot stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path + ": not a regular file");
  }
  map_size_ = static_cast<std::size_t>(st.st_size);
  if (map_size_ < 8) {
    ::close(fd);
    fail(path + ": truncated safetensors file (" + std::to_string(map_size_) + " bytes, need at least 8)");
  }
  map_ = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    fail(path + ": mmap failed (" + std::strerror(errno) + ")");
  }
  try {
    parse(static_cast<const std::uint8_t*>(map_), map_size_);
  } catch (...) {
    ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::from_memory(std::vector<std::uint8_t> bytes,
                                                              const std::string& label) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = label;
  f->owned_ = std::move(bytes);
  if (f->owned_.size() < 8) fail(label + ": truncated safetensors file (need at least 8 bytes)");
  f->parse(f->owned_.data(), f->owned_.size());
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

void SafetensorsFile::parse(const std::uint8_t* base, std::size_t size) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | base[i];
  if (n > kMaxHeader) fail(path_ + ": header length " + std::to_string(n) + " exceeds the 100 MiB limit");
  if (n > size - 8) fail(path_ + ": header length " + std::to_string(n) + " runs past the end of the file (" +
                         std::to_string(size) + " bytes): truncated file?");
  const char* hdr = reinterpret_cast<const char*>(base + 8);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(hdr, hdr + n);
  } catch (const nlohmann::json::exception& e) {
    fail(path_ + ": malformed header JSON: " + e.what());
  }
  if (!j.is_object()) fail(path_ + ": header is not a JSON object");
  const std::uint8_t* buf = base + 8 + n;
  const std::size_t buf_size = size - 8 - static_cast<std::size_t>(n);
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(path_ + ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail(path_ + ": __metadata__ value of '" + m.key() + "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = path_ + ": tensor '" + name + "'";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      fail(where + ": entry needs dtype, shape and data_offsets");
    TensorView t;
    t.name = name;
    if (!v["dtype"].is_string() || !parse_dtype(v["dtype"].get<std::string>(), t.dtype))
      fail(where + ": unsupported dtype " + v["dtype"].dump());
    if (!v["shape"].is_array()) fail(where + ": shape is not an array");
    std::uint64_t numel = 1;
    bool zero = false;
    for (const auto& s : v["shape"]) {
      if (!s.is_number_unsigned()) fail(where + ": shape entries must be non-negative integers");
      const std::uint64_t d = s.get<std::uint64_t>();
      if (d == 0) zero = true;
      if (d != 0 && numel > (std::uint64_t{1} << 56) / d) fail(where + ": shape too large");
      numel *= d;
      t.shape.push_back(static_cast<std::int64_t>(d));
    }
    if (zero) numel = 0;
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(where + ": data_offsets must be two non-negative integers");
    const std::uint64_t b = off[0].get<std::uint64_t>(), e = off[1].get<std::uint64_t>();
    if (b > e) fail(where + ": data_offsets begin > end");
    if (e > buf_size)
      fail(where + ": data [" + std::to_string(b) + ", " + std::to_string(e) + ") runs past the data buffer (" +
           std::to_string(buf_size) + " bytes): truncated file?");
    const std::uint64_t expect = numel * dtype_size(t.dtype);  // < 2^59: no overflow
    if (expect != e - b)
      fail(where + ": shape x dtype size = " + std::to_string(expect) +
           " bytes but data_offsets span " + std::to_string(e - b));
    t.data = buf + b;
    t.nbytes = static_cast<std::size_t>(e - b);
    ranges.emplace_back(static_cast<std::size_t>(b), static_cast<std::size_t>(e));
    tensors_.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second && ranges[i].first != ranges[i].second &&
        ranges[i - 1].first != ranges[i - 1].second)
      fail(path_ + ": tensors overlap in the data buffer at byte " + std::to_string(ranges[i].first));
  }
}

const TensorView& SafetensorsFile::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_ + ": missing tensor '" + name + "'");
  return it->second;
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json hdr = nlohmann::json::object();
  if (!metadata.empty()) hdr["__metadata__"] = metadata;
  std::size_t off = 0;
  std::vector<std::vector<std::uint8_t>> blobs;
  for (const auto& t : tensors) {
    std::int64_t numel = 1;
    for (auto s : t.shape) numel *= s;
    require(numel == static_cast<std::int64_t>(t.values.size()),
            path + ": tensor '" + t.name + "' shape does not match its value count");
    std::vector<std::uint8_t> blob;
    if (t.dtype == DType::kF32) {
      blob.resize(t.values.size() * 4);
      std::memcpy(blob.data(), t.values.data(), blob.size());
    } else if (t.dtype == DType::kBF16 || t.dtype == DType::kF16) {
      blob.resize(t.values.size() * 2);
      for (std::size_t i = 0; i < t.values.size(); ++i) {
        const std::uint16_t h = t.dtype == DType::kBF16 ? float_to_bf16(t.values[i]) : float_to_fp16(t.values[i]);
        std::memcpy(blob.data() + 2 * i, &h, 2);
      }
    } else {
      fail(path + ": write_safetensors supports F32, BF16 and F16 only");
    }
    hdr[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {off, off + blob.size()}}};
    off += blob.size();
    blobs.push_back(std::move(blob));
  }
  std::string h = hdr.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) fail(path + ": cannot open for writing");
  std::uint64_t n = h.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  f.write(reinterpret_cast<const char*>(len), 8);
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& b : blobs) f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  if (!f) fail(path + ": write failed");
}

}  // namespace kvq
