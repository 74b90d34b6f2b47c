// Scalar-grid quantizers: uniform asymmetric values with fp16 scale and zero (vLLM's value
// scheme), QuantMLA's group affine quantizer with integer zero points, fp8 e4m3, bf16.
//
// QuantMLA's rule (paper appendix C.4, DESIGN.md "Numerics"), all in float32 with correctly
// rounded division and rint (ties to even):
//   m = 2^b - 1;  s = round_T((x_max - x_min) / m)  (T = bf16 for the content latent, fp32 for
//   the RoPE key); s not a positive normal -> s = FLT_MIN;  z = clamp(rint(-x_min / s), 0, m)
//   as one byte;  q = clamp(rint(x / s) + z, 0, m);  decode s * (q - z).
#include <cfloat>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kvq/bitpack.hpp"
#include "kvq/common.hpp"
#include "kvq/numeric.hpp"
#include "kvq/quantizers.hpp"
#include "simd.hpp"

namespace kvq {

namespace {
void put16(std::uint8_t* p, std::uint16_t v) { std::memcpy(p, &v, 2); }
std::uint16_t get16(const std::uint8_t* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }
}  // namespace

// ---- UniformAffine -------------------------------------------------------------------------

UniformAffine::UniformAffine(int dim, int bits, int group) : VectorQuantizer(dim), bits_(bits), group_(group ? group : dim) {
  require(bits >= 1 && bits <= 8, "UniformAffine: bits must be 1..8");
  require(group_ > 0 && dim % group_ == 0, "UniformAffine: group size must divide the dimension");
}

std::string UniformAffine::name() const {
  return "uniform-" + std::to_string(bits_) + "bit" + (group_ == dim_ ? "" : "-g" + std::to_string(group_));
}

std::size_t UniformAffine::code_bytes() const { return packed_bytes(static_cast<std::size_t>(dim_), bits_); }

void UniformAffine::encode_reference(const float* x, std::uint8_t* codes, std::uint8_t* meta) const {
  check_finite(x);
  const int m = (1 << bits_) - 1;
  std::vector<std::uint8_t> q(static_cast<std::size_t>(dim_));
  for (int g = 0; g < groups(); ++g) {
    const float* xg = x + g * group_;
    float lo = xg[0], hi = xg[0];
    for (int i = 1; i < group_; ++i) {
      lo = std::fmin(lo, xg[i]);
      hi = std::fmax(hi, xg[i]);
    }
    if (!(std::fabs(lo) <= 65504.0f && std::fabs(hi) <= 65504.0f))
      fail(name() + ": value outside the fp16 range of the stored scale and zero");
    float s = (hi - lo) / static_cast<float>(m);
    if (!(s > 1e-8f)) s = 1e-8f;
    put16(meta + 4 * g, float_to_fp16(s));
    put16(meta + 4 * g + 2, float_to_fp16(lo));
    for (int i = 0; i < group_; ++i)
      q[static_cast<std::size_t>(g * group_ + i)] =
          static_cast<std::uint8_t>(clampf(std::floor((xg[i] - lo) / s + 0.5f), 0.0f, static_cast<float>(m)));
  }
  pack_bits(q.data(), static_cast<std::size_t>(dim_), bits_, codes);
}

void UniformAffine::encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const {
  encode_reference(x, codes, meta);
}

void UniformAffine::decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const {
  for (int g = 0; g < groups(); ++g) {
    const float s = fp16_to_float(get16(meta + 4 * g)), z = fp16_to_float(get16(meta + 4 * g + 2));
    for (int i = 0; i < group_; ++i) {
      const int k = g * group_ + i;
      x[k] = static_cast<float>(unpack_one(codes, static_cast<std::size_t>(k), bits_)) * s + z;
    }
  }
}

void UniformAffine::accumulate(float w, const std::uint8_t* codes, const std::uint8_t* meta, float* acc) const {
  for (int g = 0; g < groups(); ++g) {
    const float s = fp16_to_float(get16(meta + 4 * g)) * w, z = fp16_to_float(get16(meta + 4 * g + 2)) * w;
    for (int i = 0; i < group_; ++i) {
      const int k = g * group_ + i;
      acc[k] += static_cast<float>(unpack_one(codes, static_cast<std::size_t>(k), bits_)) * s + z;
    }
  }
}

void UniformAffine::encode_batch(const float* x, std::size_t n, std::uint8_t* records) const {
  if (simd::uniform_encode_batch(*this, x, n, records)) return;
  VectorQuantizer::encode_batch(x, n, records);
}
void UniformAffine::decode_batch(const std::uint8_t* records, std::size_t n, float* x) const {
  if (simd::uniform_decode_batch(*this, records, n, x)) return;
  VectorQuantizer::decode_batch(records, n, x);
}

// ---- AffineGroup (QuantMLA) ----------------------------------------------------------------

float affine_group_scale(float xmin, float xmax, int bits, ScaleType t) {
  const float m = static_cast<float>((1 << bits) - 1);
  float s = (xmax - xmin) / m;
  if (t == ScaleType::kBf16) s = round_bf16(s);
  if (!(s >= FLT_MIN)) s = FLT_MIN;  // zero (constant group) or underflow: smallest positive normal
  return s;
}

AffineGroup::AffineGroup(int dim, int bits, int group, ScaleType scale_type)
    : VectorQuantizer(dim), bits_(bits), group_(group), scale_type_(scale_type) {
  require(bits >= 1 && bits <= 8, "AffineGroup: bits must be 1..8");
  require(group > 0 && dim % group == 0, "AffineGroup: group size " + std::to_string(group) + " must divide " + std::to_string(dim));
}

std::string AffineGroup::name() const {
  return "affine-int" + std::to_string(bits_) + "-g" + std::to_string(group_) + (scale_type_ == ScaleType::kBf16 ? "-bf16" : "-fp32");
}

std::size_t AffineGroup::code_bytes() const { return packed_bytes(static_cast<std::size_t>(dim_), bits_); }
std::size_t AffineGroup::meta_bytes() const {
  return static_cast<std::size_t>(groups()) * ((scale_type_ == ScaleType::kBf16 ? 2 : 4) + 1);
}

float AffineGroup::scale_of(const std::uint8_t* meta, int g) const {
  if (scale_type_ == ScaleType::kBf16) return bf16_to_float(get16(meta + 2 * g));
  float s;
  std::memcpy(&s, meta + 4 * g, 4);
  return s;
}
int AffineGroup::zero_of(const std::uint8_t* meta, int g) const {
  const std::size_t off = static_cast<std::size_t>(groups()) * (scale_type_ == ScaleType::kBf16 ? 2 : 4);
  return meta[off + static_cast<std::size_t>(g)];
}

void AffineGroup::encode_reference(const float* x, std::uint8_t* codes, std::uint8_t* meta) const {
  check_finite(x);
  const int m = (1 << bits_) - 1;
  const float mf = static_cast<float>(m);
  const std::size_t zoff = static_cast<std::size_t>(groups()) * (scale_type_ == ScaleType::kBf16 ? 2 : 4);
  std::vector<std::uint8_t> q(static_cast<std::size_t>(dim_));
  for (int g = 0; g < groups(); ++g) {
    const float* xg = x + g * group_;
    float lo = xg[0], hi = xg[0];
    for (int i = 1; i < group_; ++i) {
      lo = std::fmin(lo, xg[i]);
      hi = std::fmax(hi, xg[i]);
    }
    if (!std::isfinite(hi - lo)) fail(name() + ": value range of group " + std::to_string(g) + " overflows float32");
    const float s = affine_group_scale(lo, hi, bits_, scale_type_);
    const float z = clampf(std::rint(-lo / s), 0.0f, mf);
    if (scale_type_ == ScaleType::kBf16) put16(meta + 2 * g, float_to_bf16(s));
    else std::memcpy(meta + 4 * g, &s, 4);
    meta[zoff + static_cast<std::size_t>(g)] = static_cast<std::uint8_t>(z);
    for (int i = 0; i < group_; ++i)
      q[static_cast<std::size_t>(g * group_ + i)] = static_cast<std::uint8_t>(clampf(std::rint(xg[i] / s) + z, 0.0f, mf));
  }
  pack_bits(q.data(), static_cast<std::size_t>(dim_), bits_, codes);
}

void AffineGroup::decode_reference(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const {
  for (int g = 0; g < groups(); ++g) {
    const float s = scale_of(meta, g);
    const int z = zero_of(meta, g);
    for (int i = 0; i < group_; ++i) {
      const int k = g * group_ + i;
      x[k] = s * static_cast<float>(static_cast<int>(unpack_one(codes, static_cast<std::size_t>(k), bits_)) - z);
    }
  }
}

void AffineGroup::encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const { encode_reference(x, codes, meta); }
void AffineGroup::decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const {
  decode_reference(codes, meta, x);
}

float AffineGroup::score(const float* qp, const std::uint8_t* codes, const std::uint8_t* meta) const {
  // Group-wise dequantization fused into the dot product: sum_g s_g * (sum_i q_i c_i - z_g sum_i q_i).
  float total = 0;
  for (int g = 0; g < groups(); ++g) {
    const float s = scale_of(meta, g);
    const float z = static_cast<float>(zero_of(meta, g));
    float dot = 0, qsum = 0;
    for (int i = 0; i < group_; ++i) {
      const int k = g * group_ + i;
      dot += qp[k] * static_cast<float>(unpack_one(codes, static_cast<std::size_t>(k), bits_));
      qsum += qp[k];
    }
    total += s * (dot - z * qsum);
  }
  return total;
}

void AffineGroup::accumulate(float w, const std::uint8_t* codes, const std::uint8_t* meta, float* acc) const {
  for (int g = 0; g < groups(); ++g) {
    const float ws = w * scale_of(meta, g);
    const float z = static_cast<float>(zero_of(meta, g));
    for (int i = 0; i < group_; ++i) {
      const int k = g * group_ + i;
      acc[k] += ws * (static_cast<float>(unpack_one(codes, static_cast<std::size_t>(k), bits_)) - z);
    }
  }
}

void AffineGroup::encode_batch(const float* x, std::size_t n, std::uint8_t* records) const {
  if (simd::affine_encode_batch(*this, x, n, records)) return;
  VectorQuantizer::encode_batch(x, n, records);
}
void AffineGroup::decode_batch(const std::uint8_t* records, std::size_t n, float* x) const {
  if (simd::affine_decode_batch(*this, records, n, x)) return;
  VectorQuantizer::decode_batch(records, n, x);
}

// ---- fp8 / bf16 ----------------------------------------------------------------------------

Fp8E4m3::Fp8E4m3(int dim, bool per_vector_scale) : VectorQuantizer(dim), scaled_(per_vector_scale) {}

void Fp8E4m3::encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const {
  check_finite(x);
  float scale = 1.0f;
  if (scaled_) {
    float amax = 0;
    for (int i = 0; i < dim_; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    scale = amax / kFp8E4m3Max;
    if (!(scale >= FLT_MIN)) scale = amax > 0 ? FLT_MIN : 0.0f;
    std::memcpy(meta, &scale, 4);
  }
  const float inv = scale > 0 ? 1.0f / scale : 0.0f;
  for (int i = 0; i < dim_; ++i) codes[i] = float_to_fp8_e4m3(x[i] * inv, true);
}

void Fp8E4m3::decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const {
  float scale = 1.0f;
  if (scaled_) std::memcpy(&scale, meta, 4);
  for (int i = 0; i < dim_; ++i) x[i] = fp8_e4m3_to_float(codes[i]) * scale;
}

void Bf16Vector::encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const {
  check_finite(x);
  for (int i = 0; i < dim_; ++i) put16(codes + 2 * i, float_to_bf16(x[i]));
}

void Bf16Vector::decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const {
  for (int i = 0; i < dim_; ++i) x[i] = bf16_to_float(get16(codes + 2 * i));
}

}  // namespace kvq
