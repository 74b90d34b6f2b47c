// kvq/bitpack.hpp: packing b-bit codes (b = 1..8) into a little-endian bit stream.
//
// Layout (docs/formats.md): code i occupies bits [i*b, (i+1)*b) of the stream, least
// significant bit first; stream bit k is bit (k % 8) of byte k / 8. So 4-bit codes put element
// 2j in the low nibble of byte j, 2-bit codes put element 4j in bits 0-1, and 3-bit codes fill
// 8 codes into 3 bytes. The last byte's unused high bits are zero. Codes must be < 2^b.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvq/common.hpp"

namespace kvq {

KVQ_HD constexpr std::size_t packed_bytes(std::size_t n, int bits) {
  return (n * static_cast<std::size_t>(bits) + 7) / 8;
}

// Read code i of a b-bit stream (the scalar reference; device code uses the same formula).
KVQ_HD std::uint32_t unpack_one(const std::uint8_t* p, std::size_t i, int bits) {
  const std::size_t bit = i * static_cast<std::size_t>(bits);
  const std::size_t byte = bit >> 3;
  const unsigned off = static_cast<unsigned>(bit & 7);
  std::uint32_t w = p[byte];
  if (off + static_cast<unsigned>(bits) > 8) w |= static_cast<std::uint32_t>(p[byte + 1]) << 8;
  return (w >> off) & ((1u << bits) - 1u);
}

// Pack n codes into packed_bytes(n, bits) bytes (the whole output is written).
void pack_bits(const std::uint8_t* codes, std::size_t n, int bits, std::uint8_t* out);
// Unpack n codes.
void unpack_bits(const std::uint8_t* in, std::size_t n, int bits, std::uint8_t* codes);

}  // namespace kvq
