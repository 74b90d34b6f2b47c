// kvq/baselines.hpp: the TurboQuant chapter's naive 3-bit baselines (section 5,
// tq_vs_naive.py), as quantize-dequantize over a row-major matrix of n vectors of dimension d.
// Scales and zeros are rounded to fp16 as stored; rounding is to nearest, ties to even.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvq {

// Symmetric, one scale per row: s = absmax / (2^(b-1) - 1), q = clamp(rint(x/s), -2^(b-1), 2^(b-1)-1).
std::vector<float> qdq_per_token_absmax(const std::vector<float>& x, std::size_t n, int d, int bits);
// Asymmetric min-max per row: s = (max - min) / (2^b - 1), x^ = rint((x - min)/s) s + min.
std::vector<float> qdq_per_token_minmax(const std::vector<float>& x, std::size_t n, int d, int bits);
// Asymmetric min-max per channel (column) over all n rows (KIVI-style keys).
std::vector<float> qdq_per_channel_minmax(const std::vector<float>& x, std::size_t n, int d, int bits);
// Randomized Hadamard (seeded), per-token min-max in the rotated basis, rotate back.
std::vector<float> qdq_rht_per_token_minmax(const std::vector<float>& x, std::size_t n, int d, int bits,
                                            std::uint64_t key);

}  // namespace kvq
