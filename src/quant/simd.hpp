// Internal: SIMD batch paths of the quantizers. Each function returns false when no fast path
// applies (CPU without AVX2/FMA/F16C, unsupported shape, or KVQ_NO_SIMD set in the environment),
// and the caller then runs the scalar reference. tests/quant/test_simd.cpp checks every path
// against the reference on random and real vectors.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq {
class TurboQuantMse;
class HadamardRotation;
class UniformAffine;
class AffineGroup;

namespace simd {
bool available();  // AVX2 + FMA + F16C present, not disabled by KVQ_NO_SIMD or set_enabled(false)
void set_enabled(bool on);  // benchmarks and tests switch between the SIMD and scalar paths
// bf16 -> fp32 for n values (exact); false without AVX2.
bool bf16_to_float(const std::uint16_t* in, std::size_t n, float* out);
bool tq_encode_batch(const TurboQuantMse& q, const HadamardRotation& r, const float* x, std::size_t n, std::uint8_t* rec);
bool tq_decode_batch(const TurboQuantMse& q, const HadamardRotation& r, const std::uint8_t* rec, std::size_t n, float* x);
bool uniform_encode_batch(const UniformAffine& q, const float* x, std::size_t n, std::uint8_t* rec);
bool uniform_decode_batch(const UniformAffine& q, const std::uint8_t* rec, std::size_t n, float* x);
bool affine_encode_batch(const AffineGroup& q, const float* x, std::size_t n, std::uint8_t* rec);
bool affine_decode_batch(const AffineGroup& q, const std::uint8_t* rec, std::size_t n, float* x);
}  // namespace simd
}  // namespace kvq
