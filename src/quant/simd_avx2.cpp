// AVX2 batch paths (placeholder until the vector kernels land: every entry reports "no fast
// path" so callers use the scalar reference).
#include <cstdlib>

#include "simd.hpp"

namespace kvq::simd {
bool available() { return false; }
bool tq_encode_batch(const TurboQuantMse&, const HadamardRotation&, const float*, std::size_t, std::uint8_t*) { return false; }
bool tq_decode_batch(const TurboQuantMse&, const HadamardRotation&, const std::uint8_t*, std::size_t, float*) { return false; }
bool uniform_encode_batch(const UniformAffine&, const float*, std::size_t, std::uint8_t*) { return false; }
bool uniform_decode_batch(const UniformAffine&, const std::uint8_t*, std::size_t, float*) { return false; }
bool affine_encode_batch(const AffineGroup&, const float*, std::size_t, std::uint8_t*) { return false; }
bool affine_decode_batch(const AffineGroup&, const std::uint8_t*, std::size_t, float*) { return false; }
}  // namespace kvq::simd
