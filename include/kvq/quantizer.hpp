// kvq/quantizer.hpp: one interface for every per-vector quantizer of both seeds.
//
// A quantizer maps a d-dimensional float vector to `code_bytes()` bytes of packed codes plus
// `meta_bytes()` bytes of per-vector metadata (norms, scales, zero points). The two parts are
// written to separate pointers so that paged caches can keep codes and metadata in separate,
// aligned arrays (docs/formats.md); a contiguous record is codes followed by metadata.
//
// Attention reads a quantized cache without dequantizing it to a full vector when it can:
//  - keys: prepare_query() maps q once (e.g. q_rot = Pi q), then score() gives <q, decode(code)>
//    from the packed codes (TurboQuant chapter, section 8);
//  - values: accumulate() adds w * decode(code) into an accumulator kept in the quantizer's own
//    domain (rotated for TurboQuant values) and finish() maps the sum back once.
// The base-class versions of these go through decode(): they are the reference the fast
// overrides are tested against.
//
// encode() throws kvq::Error on NaN / Inf input (never encodes it silently); the caller adds
// layer and position to the message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvq {

class VectorQuantizer {
 public:
  explicit VectorQuantizer(int dim) : dim_(dim) {}
  virtual ~VectorQuantizer() = default;

  virtual std::string name() const = 0;
  int dim() const { return dim_; }
  virtual std::size_t code_bytes() const = 0;
  virtual std::size_t meta_bytes() const = 0;
  std::size_t bytes() const { return code_bytes() + meta_bytes(); }
  // Nominal code bits per coordinate (metadata excluded).
  virtual double code_bits() const = 0;

  virtual void encode(const float* x, std::uint8_t* codes, std::uint8_t* meta) const = 0;
  virtual void decode(const std::uint8_t* codes, const std::uint8_t* meta, float* x) const = 0;

  // Keys: <q, decode(code)> from a prepared query of query_dim() floats.
  virtual int query_dim() const { return dim_; }
  virtual void prepare_query(const float* q, float* qp) const;
  virtual float score(const float* qp, const std::uint8_t* codes, const std::uint8_t* meta) const;

  // Values: acc (acc_dim() floats) += w * decode(code), in the quantizer's domain; finish()
  // writes the dim()-float result.
  virtual int acc_dim() const { return dim_; }
  virtual void accumulate(float w, const std::uint8_t* codes, const std::uint8_t* meta, float* acc) const;
  virtual void finish(const float* acc, float* out) const;

  // Contiguous-record helpers (record = codes then metadata).
  void encode_record(const float* x, std::uint8_t* record) const { encode(x, record, record + code_bytes()); }
  void decode_record(const std::uint8_t* record, float* x) const { decode(record, record + code_bytes(), x); }

  // Batched encode / decode of n vectors (rows of x, records of bytes() each). Quantizers with
  // SIMD paths override these; the defaults loop over encode / decode.
  virtual void encode_batch(const float* x, std::size_t n, std::uint8_t* records) const;
  virtual void decode_batch(const std::uint8_t* records, std::size_t n, float* x) const;

 protected:
  // Throws kvq::Error naming the first non-finite coordinate.
  void check_finite(const float* x) const;
  int dim_;
};

// Relative error ||a - b|| / ||b|| (normwise); NaN anywhere gives NaN, which fails every check.
double rel_error(const float* a, const float* b, std::size_t n);

}  // namespace kvq
