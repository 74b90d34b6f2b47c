// kvq/formats.hpp: the registry of cache formats. One table maps a name to its descriptor;
// the CLI, the caches, the budget accounting and the kernels all read it.
//
// A format defines, for one layer, how a token's cache rows are stored:
//  - MHA/GQA models: a key vector and a value vector per KV head;
//  - MLA models: the content latent (d_c) and the RoPE key (d_r); `key` below is the content
//    path and `value` the RoPE path.
// Byte layouts: docs/formats.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/kv_cache.hpp"
#include "kvq/page_layout.hpp"
#include "kvq/quantizer.hpp"

namespace kvq {

// Seed of every rotation sign diagonal and QJL matrix, part of the format version.
inline constexpr std::uint64_t kFormatSeed = 0x6b76710000000001ull;
inline constexpr int kFormatVersion = 1;

enum class FormatFamily { kAny, kKV, kMLA };

enum class FormatKind {
  kBf16,        // bf16 rows
  kFp8,         // e4m3 with an fp32 per-vector scale
  kTqVllm,      // vLLM preset: plain Hadamard, Gaussian Lloyd-Max keys + norm correction (or fp8
                // keys), uniform per-vector values with fp16 scale and zero
  kTqOurs,      // sign-randomized Hadamard per (layer, head), sphere Lloyd-Max, norm correction,
                // TurboQuant values (rotated-domain accumulation)
  kTqSplit,     // kTqOurs with the outlier split on keys and values (fractional bits)
  kTqQjl,       // (b-1)-bit MSE + 1-bit QJL keys, TurboQuant values
  kMlaAffine,   // QuantMLA group-64 affine: content bf16 scales, RoPE fp32 scales
  kMlaTq,       // TurboQuant on the latent (randomized Hadamard, norm correction), RoPE key bf16
};

struct FormatSpec {
  std::string name;
  FormatFamily family = FormatFamily::kAny;
  FormatKind kind = FormatKind::kBf16;
  int key_bits = 16;    // MLA: content bits
  int value_bits = 16;  // MLA: RoPE bits
  bool fp8_keys = false;
  int outlier_channels = 0;  // kTqSplit at head_dim 128: channels given key_bits + 1
  std::string keys, values;  // human descriptions
  std::string pair;          // the vLLM preset this format must beat ("" if none)
  std::string summary;
};

const std::vector<FormatSpec>& all_formats();
// kvq::Error listing the valid names when `name` is unknown.
const FormatSpec& find_format(std::string_view name);
// kvq::Error when the format's family does not fit the geometry (e.g. c4r4 on a GQA model).
void check_format_fits(const FormatSpec& f, const CacheGeometry& g);
std::vector<std::string> format_names(FormatFamily family);

// What kvq's own TurboQuant formats learn from calibration text (never the evaluation text),
// per layer and KV head, from the rows as cached (keys after RoPE):
//  - key / value: sorted outlier channels of the split formats (tq-3.5bit, tq-2.5bit);
//  - key_mean / value_mean: per-channel means subtracted before quantization (centering). A
//    fixed key offset shifts every score of a query by the same q . mu, so attention is
//    unchanged while the quantized residual is smaller; a value offset is added back once after
//    the softmax-weighted sum (the weights sum to one). Empty: no centering.
struct FormatCalibration {
  std::vector<std::vector<std::vector<int>>> key, value;            // [layer][head] -> channels
  std::vector<std::vector<std::vector<float>>> key_mean, value_mean;  // [layer][head] -> d floats
};
using OutlierChannels = FormatCalibration;
// True for the formats whose quantizers use calibration means when given (kvq's tq-4bit,
// tq-3bit, tq-3.5bit, tq-2.5bit); the vLLM presets and the QJL format never center.
bool format_uses_centering(const FormatSpec& f);
// The `count` channels with the largest mean |x| over n rows of dimension d (sorted).
std::vector<int> select_outlier_channels(const float* rows, std::size_t n, int d, int count);
int split_outlier_count(const FormatSpec& f, int head_dim);

struct QuantizerPair {
  std::unique_ptr<VectorQuantizer> key;    // MLA: content latent
  std::unique_ptr<VectorQuantizer> value;  // MLA: RoPE key
};
// The quantizers of one (layer, KV head). MLA formats ignore `head`. Split formats need
// `outliers`; kvq::Error otherwise.
QuantizerPair make_quantizers(const FormatSpec& f, const CacheGeometry& g, int layer, int head,
                              const OutlierChannels* outliers = nullptr);

// Per-token bytes of one layer (all KV heads; MLA: one 16-byte aligned record) and the split
// between packed codes and metadata.
struct TokenBytes {
  std::size_t key_code = 0, key_meta = 0, value_code = 0, value_meta = 0;  // per head (MLA: per token)
  std::size_t record = 0;     // bytes per token per layer including alignment padding
  std::size_t per_layer = 0;  // == record for MLA; heads x (key + value) for GQA
  double bits_per_value = 0;  // (codes + metadata) bits over the values stored, padding excluded
};
TokenBytes token_bytes(const FormatSpec& f, const CacheGeometry& g);
// The contiguous per-token record of one (layer, head) (MLA: one per token and layer):
// [key codes][value codes][key metadata][value metadata][zero padding to `size`].
// For c4r4 at d_c = 512, d_r = 64: 256 + 32 + 24 + 5 = 317 bytes, padded to 320.
struct RecordLayout {
  std::size_t key_code = 0, value_code = 0, key_meta = 0, value_meta = 0, size = 0;  // offsets, size
};
RecordLayout record_layout(const TokenBytes& t);
void encode_token_record(const QuantizerPair& q, const RecordLayout& l, const float* key, const float* value,
                         std::uint8_t* record);
void decode_token_record(const QuantizerPair& q, const RecordLayout& l, const std::uint8_t* record, float* key,
                         float* value);

// The page layout of a format for a geometry (heads = KV heads; MLA: 1).
PageLayout page_layout(const FormatSpec& f, const CacheGeometry& g, int tokens = kDefaultPageTokens);

// Bytes of a bf16 cache per token per layer for the geometry.
std::size_t bf16_token_bytes(const CacheGeometry& g);

// Named model shapes for budget tables (the chapter's kv_budget models and DeepSeek-V2-Lite).
struct NamedShape {
  std::string name;
  CacheGeometry geometry;
};
const std::vector<NamedShape>& named_shapes();

}  // namespace kvq
