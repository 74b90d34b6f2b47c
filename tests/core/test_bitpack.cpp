// Bit packing: identity for every width and the dimensions caches use, the documented stream
// layout, and agreement with unpack_one (the formula the CUDA kernels use).
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <random>
#include <vector>

#include "kvq/bitpack.hpp"

using namespace kvq;

TEST(Bitpack, IdentityEveryWidthAndDim) {
  std::mt19937 rng(1);
  for (int b = 1; b <= 8; ++b) {
    for (std::size_t n : {64u, 96u, 128u, 256u, 512u, 576u, 1u, 7u, 13u, 333u}) {
      std::vector<std::uint8_t> codes(n), back(n), packed(packed_bytes(n, b) + 4, 0xAB);
      for (auto& c : codes) c = static_cast<std::uint8_t>(rng() & ((1u << b) - 1));
      pack_bits(codes.data(), n, b, packed.data());
      // Never writes past packed_bytes.
      for (std::size_t i = packed_bytes(n, b); i < packed.size(); ++i) ASSERT_EQ(packed[i], 0xAB);
      unpack_bits(packed.data(), n, b, back.data());
      ASSERT_EQ(codes, back) << "b=" << b << " n=" << n;
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(unpack_one(packed.data(), i, b), codes[i]);
    }
  }
}

TEST(Bitpack, Sizes) {
  EXPECT_EQ(packed_bytes(128, 3), 48u);
  EXPECT_EQ(packed_bytes(8, 3), 3u);
  EXPECT_EQ(packed_bytes(128, 4), 64u);
  EXPECT_EQ(packed_bytes(512, 2), 128u);
  EXPECT_EQ(packed_bytes(576, 1), 72u);
  EXPECT_EQ(packed_bytes(5, 3), 2u);
}

TEST(Bitpack, DocumentedLayout) {
  // 4-bit: element 2j in the low nibble of byte j.
  const std::uint8_t c4[4] = {0x1, 0x2, 0xA, 0xF};
  std::uint8_t p4[2];
  pack_bits(c4, 4, 4, p4);
  EXPECT_EQ(p4[0], 0x21);
  EXPECT_EQ(p4[1], 0xFA);
  // 3-bit: 8 codes in 3 bytes, LSB first: codes 0..7 = 1,2,3,4,5,6,7,0.
  const std::uint8_t c3[8] = {1, 2, 3, 4, 5, 6, 7, 0};
  std::uint8_t p3[3];
  pack_bits(c3, 8, 3, p3);
  std::uint32_t w = 0;
  for (int k = 0; k < 8; ++k) w |= static_cast<std::uint32_t>(c3[k]) << (3 * k);
  EXPECT_EQ(p3[0], w & 0xff);
  EXPECT_EQ(p3[1], (w >> 8) & 0xff);
  EXPECT_EQ(p3[2], (w >> 16) & 0xff);
  // 2-bit: element 4j in bits 0-1.
  const std::uint8_t c2[4] = {3, 0, 1, 2};
  std::uint8_t p2[1];
  pack_bits(c2, 4, 2, p2);
  EXPECT_EQ(p2[0], 3 | (0 << 2) | (1 << 4) | (2 << 6));
}

RC_GTEST_PROP(Bitpack, RoundTripProperty, (std::vector<std::uint8_t> raw, unsigned width)) {
  const int b = static_cast<int>(width % 8) + 1;
  for (auto& c : raw) c = static_cast<std::uint8_t>(c & ((1u << b) - 1));
  std::vector<std::uint8_t> packed(packed_bytes(raw.size(), b)), back(raw.size());
  pack_bits(raw.data(), raw.size(), b, packed.data());
  unpack_bits(packed.data(), raw.size(), b, back.data());
  RC_ASSERT(back == raw);
}

TEST(Bitpack, BadWidthIsAnError) {
  std::uint8_t c[1] = {0}, p[2];
  EXPECT_THROW(pack_bits(c, 1, 0, p), Error);
  EXPECT_THROW(pack_bits(c, 1, 9, p), Error);
}

TEST(Bitpack, EmptyInputWritesNothing) {
  for (int b = 1; b <= 8; ++b) {
    pack_bits(nullptr, 0, b, nullptr);
    unpack_bits(nullptr, 0, b, nullptr);
  }
  EXPECT_EQ(packed_bytes(0, 3), 0u);
}
