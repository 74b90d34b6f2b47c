// Safetensors reader: the fixture reference files, a write/read round trip, and malformed
// files (truncated, bad header length, bad JSON, overlapping or out-of-range offsets, shape
// mismatch, unknown dtype), each a kvq::Error that names the file.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kvq/safetensors.hpp"
#include "kvq/common.hpp"
#include <cmath>

using namespace kvq;

namespace {
std::string src(const std::string& rel) { return std::string(KVQ_SOURCE_DIR) + "/" + rel; }

std::vector<std::uint8_t> image(const std::string& header, std::size_t data_bytes, std::uint64_t declared = 0) {
  const std::uint64_t n = declared ? declared : header.size();
  std::vector<std::uint8_t> v(8 + header.size() + data_bytes, 0);
  for (int i = 0; i < 8; ++i) v[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(n >> (8 * i));
  for (std::size_t i = 0; i < header.size(); ++i) v[8 + i] = static_cast<std::uint8_t>(header[i]);
  return v;
}

void expect_error(const std::vector<std::uint8_t>& img, const std::string& needle) {
  try {
    SafetensorsFile::from_memory(img, "mem.safetensors");
    FAIL() << "no error for case expecting '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mem.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(Safetensors, ReadsFixtureReferences) {
  SafetensorsFile g(src("models/tiny-gqa/reference.safetensors"));
  EXPECT_EQ(g.get("input_ids").shape, (std::vector<std::int64_t>{128}));
  EXPECT_EQ(g.get("logits").shape, (std::vector<std::int64_t>{128, 4096}));
  const auto& k = g.get("layer0.k");
  EXPECT_EQ(k.dtype, DType::kBF16);
  EXPECT_EQ(k.shape, (std::vector<std::int64_t>{512, 256}));
  const auto kv = k.to_float();
  double s = 0;
  for (float v : kv) s += std::fabs(v);
  EXPECT_GT(s, 0.0);
  SafetensorsFile m(src("models/tiny-mla/reference.safetensors"));
  EXPECT_EQ(m.get("layer3.latent").shape, (std::vector<std::int64_t>{512, 512}));
  EXPECT_EQ(m.get("layer3.k_rope").shape, (std::vector<std::int64_t>{512, 64}));
  EXPECT_THROW(m.get("no.such.tensor"), Error);
}

TEST(Safetensors, WriteReadRoundTrip) {
  const std::string path = (std::filesystem::temp_directory_path() / "kvq_rt.safetensors").string();
  write_safetensors(path, {{"a", DType::kF32, {2, 3}, {1, 2, 3, 4, 5, 6}}, {"b", DType::kBF16, {2}, {1.5f, -2.0f}}},
                    {{"format", "pt"}});
  SafetensorsFile f(path);
  EXPECT_EQ(f.get("a").to_float(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(f.get("b").to_float(), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  std::remove(path.c_str());
}

TEST(Safetensors, MalformedInputsAreErrors) {
  expect_error({1, 2, 3}, "truncated");
  expect_error(image("{}", 0, 1000), "runs past the end");
  expect_error(image("{}", 0, 1ull << 40), "exceeds");
  expect_error(image("{\"a\": ", 0), "malformed header JSON");
  expect_error(image("[1,2]", 0), "not a JSON object");
  expect_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4), "runs past the data buffer");
  expect_error(image(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "shape x dtype size");
  expect_error(image(R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8), "unsupported dtype");
  expect_error(image(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative");
  expect_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "begin > end");
  expect_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
               "overlap");
  expect_error(image(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "needs dtype, shape and data_offsets");
}

TEST(Safetensors, MissingAndTruncatedFiles) {
  EXPECT_THROW(SafetensorsFile("/nonexistent/x.safetensors"), Error);
  const std::string path = (std::filesystem::temp_directory_path() / "kvq_trunc.safetensors").string();
  {
    std::ifstream in(src("models/tiny-gqa/reference.safetensors"), std::ios::binary);
    std::vector<char> buf(4096);
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    std::ofstream out(path, std::ios::binary);
    out.write(buf.data(), in.gcount());
  }
  try {
    SafetensorsFile f(path);
    FAIL() << "truncated file accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
  }
  std::remove(path.c_str());
}
