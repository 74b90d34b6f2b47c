// Bit packing of b-bit codes into the little-endian stream of include/kvq/bitpack.hpp.
// Widths 2, 4 and 8 (whole codes per byte) and 3 (8 codes in 3 bytes) take direct paths;
// every other width goes through a 64-bit accumulator. tests/core/test_bitpack.cpp checks all
// widths against unpack_one, the one-code formula that the CUDA kernels use too.
#include "kvq/bitpack.hpp"

#include <cstring>

namespace kvq {

void pack_bits(const std::uint8_t* codes, std::size_t n, int bits, std::uint8_t* out) {
  if (bits < 1 || bits > 8) fail("pack_bits: bits must be 1..8, got " + std::to_string(bits));
  if (n == 0) return;  // nothing to write (and the pointers may be null)
  const std::size_t nbytes = packed_bytes(n, bits);
  if (bits == 8) {
    std::memcpy(out, codes, n);
    return;
  }
  if (bits == 4) {
    std::size_t i = 0;
    for (; i + 1 < n; i += 2) out[i / 2] = static_cast<std::uint8_t>((codes[i] & 15u) | ((codes[i + 1] & 15u) << 4));
    if (i < n) out[i / 2] = static_cast<std::uint8_t>(codes[i] & 15u);
    return;
  }
  if (bits == 3 && n % 8 == 0) {
    for (std::size_t g = 0; g < n / 8; ++g) {
      const std::uint8_t* c = codes + 8 * g;
      std::uint32_t w = 0;
      for (int k = 0; k < 8; ++k) w |= static_cast<std::uint32_t>(c[k] & 7u) << (3 * k);
      out[3 * g] = static_cast<std::uint8_t>(w);
      out[3 * g + 1] = static_cast<std::uint8_t>(w >> 8);
      out[3 * g + 2] = static_cast<std::uint8_t>(w >> 16);
    }
    return;
  }
  const std::uint32_t mask = (1u << bits) - 1u;
  std::uint64_t acc = 0;
  int have = 0;
  std::size_t o = 0;
  for (std::size_t i = 0; i < n; ++i) {
    acc |= static_cast<std::uint64_t>(codes[i] & mask) << have;
    have += bits;
    while (have >= 8) {
      out[o++] = static_cast<std::uint8_t>(acc);
      acc >>= 8;
      have -= 8;
    }
  }
  if (have > 0) out[o++] = static_cast<std::uint8_t>(acc);
  (void)nbytes;
}

void unpack_bits(const std::uint8_t* in, std::size_t n, int bits, std::uint8_t* codes) {
  if (bits < 1 || bits > 8) fail("unpack_bits: bits must be 1..8, got " + std::to_string(bits));
  if (n == 0) return;
  if (bits == 8) {
    std::memcpy(codes, in, n);
    return;
  }
  if (bits == 4) {
    for (std::size_t i = 0; i < n; ++i) codes[i] = static_cast<std::uint8_t>((in[i / 2] >> (4 * (i & 1))) & 15u);
    return;
  }
  if (bits == 3 && n % 8 == 0) {
    for (std::size_t g = 0; g < n / 8; ++g) {
      const std::uint32_t w = in[3 * g] | (static_cast<std::uint32_t>(in[3 * g + 1]) << 8) |
                              (static_cast<std::uint32_t>(in[3 * g + 2]) << 16);
      for (int k = 0; k < 8; ++k) codes[8 * g + k] = static_cast<std::uint8_t>((w >> (3 * k)) & 7u);
    }
    return;
  }
  const std::uint32_t mask = (1u << bits) - 1u;
  std::uint64_t acc = 0;
  int have = 0;
  std::size_t p = 0;
  for (std::size_t i = 0; i < n; ++i) {
    while (have < bits) {
      acc |= static_cast<std::uint64_t>(in[p++]) << have;
      have += 8;
    }
    codes[i] = static_cast<std::uint8_t>(acc & mask);
    acc >>= bits;
    have -= bits;
  }
}

}  // namespace kvq
