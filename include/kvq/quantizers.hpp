// kvq/quantizers.hpp: the concrete quantizers (scalar references; SIMD paths in
// src/quant/simd_avx2.cpp are tested against them).
//
//  TurboQuantMse   TurboQuant chapter s.3: fp16 norm, rotate x/||x||, nearest Lloyd-Max
//                  centroid by search over midpoints, b-bit codes. Norm correction (s.3, vLLM
//                  "_nc") rescales the codeword to unit length, folded into the stored norm.
//  TurboQuantProd  s.3/s.6: (b-1)-bit MSE + 1-bit QJL sketch sign(S r) of the residual and
//                  fp16 ||r||; <q, x^> is unbiased.
//  OutlierSplit    s.7: two TurboQuantMse instances over a channel subset (outliers, more bits)
//                  and its complement, each with its own rotation and norm.
//  UniformAffine   uniform asymmetric codes with an fp16 scale and fp16 zero (the group
//                  minimum) per vector or per group, vLLM's value rule: s = max((max-min)/m,
//                  1e-8) in fp32, q = clamp(floor((x - min)/s + 1/2), 0, m), stored fp16(s),
//                  fp16(min), decoded q * s16 + min16.
//  AffineGroup     QuantMLA's per-token group-64 asymmetric affine quantizer with integer zero
//                  points and bf16 or fp32 scales (ties to even; DESIGN.md "Numerics").
//  Fp8E4m3         e4m3 codes, saturating, optionally with an fp32 per-vector scale amax/448.
//  Bf16Vector      bf16 storage (the uncompressed baseline).
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "kvq/codebook.hpp"
#include "kvq/quantizer.hpp"
#include "kvq/rotation.hpp"

namespace kvq {

class TurboQuantMse final : public VectorQuantizer {
 public:
  // codebook: nullptr = sphere_codebook(dim, bits); vLLM's presets pass gaussian_codebook.
  // offset: empty, or dim floats subtracted before quantization and added back on decode
  // (centering; the prepared query carries q . offset, the value accumulator the weight sum).
  TurboQuantMse(int dim, int bits, std::shared_ptr<const Rotation> rotation, bool norm_correction,
                const Codebook* codebook = nullptr, std::vector<float> offset = {});
  std::string name() const override;
  std::size_t code_bytes() const override;
  std::size_t meta_bytes() const override { return 2; }
  double code_bits() const override { return bits_; }
  void encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const override;
  void decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const override;
  int query_dim() const override { return dim_ + (offset_.empty() ? 0 : 1); }
  void prepare_query(const float* q, float* qp) const override;
  float score(const float* qp, const std::uint8_t* codes, const std::uint8_t* meta) const override;
  int acc_dim() const override { return dim_ + (offset_.empty() ? 0 : 1); }
  void accumulate(float w, const std::uint8_t* codes, const std::uint8_t* meta, float* acc) const override;
  void finish(const float* acc, float* out) const override;
  void encode_batch(const float* x, std::size_t n, std::uint8_t* records) const override;
  void decode_batch(const std::uint8_t* records, std::size_t n, float* x) const override;

  int bits() const { return bits_; }
  bool norm_correction() const { return nc_; }
  const Codebook& codebook() const { return *cb_; }
  // The norm-correction sum's term per centroid, its square on the codebook's grid (kvq::grid_squares).
  const std::vector<float>& centroid_squares() const { return sq_; }
  const Rotation& rotation() const { return *rot_; }
  const std::vector<float>& offset() const { return offset_; }
  // Scalar reference of encode (the fast path is checked against it).
  void encode_reference(const float* x, std::uint8_t* codes, std::uint8_t* meta) const;
  // The same for a vector already centered (x - offset): the SIMD paths' fallback.
  void encode_centered_reference(const float* xc, std::uint8_t* codes, std::uint8_t* meta) const;
  void decode_reference(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const;
  // Rotated-domain codeword of a code (unit-norm direction times stored norm), for tests.
  void rotated_codeword(const std::uint8_t* codes, const std::uint8_t* meta, float* y) const;

 private:
  int bits_;
  bool nc_;
  std::shared_ptr<const Rotation> rot_;
  const Codebook* cb_;
  std::vector<float> offset_;
  std::vector<float> sq_;
};

class TurboQuantProd final : public VectorQuantizer {
 public:
  // bits >= 2: (bits - 1)-bit TurboQuantMse (norm correction off, as the chapter) + 1-bit QJL.
  TurboQuantProd(int dim, int bits, std::shared_ptr<const Rotation> rotation, std::uint64_t qjl_key);
  std::string name() const override;
  std::size_t code_bytes() const override;
  std::size_t meta_bytes() const override { return 4; }
  double code_bits() const override { return bits_; }
  void encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const override;
  void decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const override;
  int query_dim() const override { return 2 * dim_; }
  void prepare_query(const float* q, float* qp) const override;
  float score(const float* qp, const std::uint8_t* codes, const std::uint8_t* meta) const override;
  const TurboQuantMse& mse() const { return mse_; }
  // The QJL part alone: estimate of the residual r from its sketch.
  void decode_residual(const std::uint8_t* codes, const std::uint8_t* meta, float* r) const;

 private:
  int bits_;
  TurboQuantMse mse_;
  std::vector<float> s_;  // QJL matrix, d x d row-major, N(0, 1) entries
};

// The element orders of an outlier split's two instances (each instance's channels, in the order
// its rotation takes them; also the GPU formats' channel permutation, hi then lo). `outliers`:
// sorted, distinct, < dim. Two halves of 64, 128 or 256 channels: the GPU store kernel gathers the
// element k of every lane of a vector in one shared-memory load, and a channel's bank there is
// fixed by its `split_bank_class` (docs/formats.md "Outlier split"); the hi instance takes its
// channels class by class, the lo instance per element k the classes the hi channels at k left
// free, so that the lanes of that load meet no bank twice. Other splits: ascending channels.
std::pair<std::vector<int>, std::vector<int>> outlier_split_order(int dim, const std::vector<int>& outliers);
// The class of channel c in the GPU store's staged rows at head_dim dim (64, 128, 256): channels
// of different classes read by the lanes of one load never share a bank; -1 for other dims.
int split_bank_class(int dim, int c);

class OutlierSplit final : public VectorQuantizer {
 public:
  // `outliers`: sorted distinct channel indices that get `bits_hi`; the rest get `bits_lo`. The
  // instances take them in outlier_split_order.
  // offset: empty or dim floats (centering, as TurboQuantMse), split between the instances.
  OutlierSplit(int dim, std::vector<int> outliers, int bits_hi, int bits_lo, bool randomize_signs,
               std::uint64_t key_hi, std::uint64_t key_lo, bool norm_correction, std::vector<float> offset = {});
  std::string name() const override;
  std::size_t code_bytes() const override { return hi_->code_bytes() + lo_->code_bytes(); }
  std::size_t meta_bytes() const override { return 4; }
  double code_bits() const override;
  void encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const override;
  void decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const override;
  int query_dim() const override { return hi_->query_dim() + lo_->query_dim(); }
  int acc_dim() const override { return hi_->acc_dim() + lo_->acc_dim(); }
  void prepare_query(const float* q, float* qp) const override;
  float score(const float* qp, const std::uint8_t* codes, const std::uint8_t* meta) const override;
  void accumulate(float w, const std::uint8_t* codes, const std::uint8_t* meta, float* acc) const override;
  void finish(const float* acc, float* out) const override;
  const std::vector<int>& outliers() const { return hi_idx_; }  // sorted
  // The instances' element orders (outlier_split_order): hi_order()[i] is element i of hi().
  const std::vector<int>& hi_order() const { return hi_ord_; }
  const std::vector<int>& lo_order() const { return lo_ord_; }
  const TurboQuantMse& hi() const { return *hi_; }
  const TurboQuantMse& lo() const { return *lo_; }

 private:
  std::vector<int> hi_idx_;          // the outliers, sorted
  std::vector<int> hi_ord_, lo_ord_;  // the instances' element orders
  std::unique_ptr<TurboQuantMse> hi_, lo_;
};

class UniformAffine final : public VectorQuantizer {
 public:
  UniformAffine(int dim, int bits, int group = 0 /* 0: one group per vector */);
  std::string name() const override;
  std::size_t code_bytes() const override;
  std::size_t meta_bytes() const override { return 4 * static_cast<std::size_t>(groups()); }
  double code_bits() const override { return bits_; }
  void encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const override;
  void decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const override;
  void accumulate(float w, const std::uint8_t* codes, const std::uint8_t* meta, float* acc) const override;
  void encode_batch(const float* x, std::size_t n, std::uint8_t* records) const override;
  void decode_batch(const std::uint8_t* records, std::size_t n, float* x) const override;
  int bits() const { return bits_; }
  int group() const { return group_; }
  int groups() const { return dim_ / group_; }
  void encode_reference(const float* x, std::uint8_t* codes, std::uint8_t* meta) const;

 private:
  int bits_, group_;
};

enum class ScaleType { kBf16, kFp32 };

class AffineGroup final : public VectorQuantizer {
 public:
  AffineGroup(int dim, int bits, int group, ScaleType scale_type);
  std::string name() const override;
  std::size_t code_bytes() const override;
  // [scales: groups x (2 | 4) bytes][zeros: groups x 1 byte]
  std::size_t meta_bytes() const override;
  double code_bits() const override { return bits_; }
  void encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const override;
  void decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const override;
  float score(const float* qp, const std::uint8_t* codes, const std::uint8_t* meta) const override;
  void accumulate(float w, const std::uint8_t* codes, const std::uint8_t* meta, float* acc) const override;
  void encode_batch(const float* x, std::size_t n, std::uint8_t* records) const override;
  void decode_batch(const std::uint8_t* records, std::size_t n, float* x) const override;
  int bits() const { return bits_; }
  int group() const { return group_; }
  int groups() const { return dim_ / group_; }
  ScaleType scale_type() const { return scale_type_; }
  float scale_of(const std::uint8_t* meta, int g) const;
  int zero_of(const std::uint8_t* meta, int g) const;
  void encode_reference(const float* x, std::uint8_t* codes, std::uint8_t* meta) const;
  void decode_reference(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const;

 private:
  int bits_, group_;
  ScaleType scale_type_;
};

// The QuantMLA group scale rule: s = (max - min) / m rounded to the scale type; s == 0 (or a
// rounded value that is not a positive normal) becomes the smallest positive normal.
float affine_group_scale(float xmin, float xmax, int bits, ScaleType t);

class Fp8E4m3 final : public VectorQuantizer {
 public:
  Fp8E4m3(int dim, bool per_vector_scale);
  std::string name() const override { return scaled_ ? "fp8-e4m3-scaled" : "fp8-e4m3"; }
  std::size_t code_bytes() const override { return static_cast<std::size_t>(dim_); }
  std::size_t meta_bytes() const override { return scaled_ ? 4 : 0; }
  double code_bits() const override { return 8; }
  void encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const override;
  void decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const override;

 private:
  bool scaled_;
};

class Bf16Vector final : public VectorQuantizer {
 public:
  explicit Bf16Vector(int dim) : VectorQuantizer(dim) {}
  std::string name() const override { return "bf16"; }
  std::size_t code_bytes() const override { return 2 * static_cast<std::size_t>(dim_); }
  std::size_t meta_bytes() const override { return 0; }
  double code_bits() const override { return 16; }
  void encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const override;
  void decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const override;
};

// Index of the cell of y among sorted edges: the number of edges strictly below y
// (numpy.searchsorted(edges, y, side="left")), by binary search.
int bucketize(const float* edges, int n_edges, float y);

// The edge of y's cell before a final scale: the largest float v with fl(v * scale) <= edge
// (scale > 0, finite edge; +-inf is returned as is). Because fl(v * scale) is monotone in v,
// bucketize(thresholds, n, v) == bucketize(edges, n, fl(v * scale)) for every float v, so a
// kernel can bucketize the unscaled value and drop the multiply (src/cuda/store.cu).
float prescale_threshold(float edge, float scale);

}  // namespace kvq
