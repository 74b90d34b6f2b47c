// stage.cuh: the layout of the fast store kernel's staged rows (src/cuda/store.cu), a header of its own
// so that a host test can check what the layout implies: the outlier split's segment order
// (kvq::outlier_split_order) is chosen so that the split formats' gather meets no bank twice
// (tests/cuda/test_bins.cu).
#pragma once

#include <cstdint>

namespace kvq::cuda::detail {

constexpr int kLaneElems = 32;  // elements per lane and side in the fast store kernel

// Staged rows. Each warp copies the key and value rows of its V vectors (2 KB a side: 32 lanes x
// 32 bf16) to shared memory with cp.async, one iteration ahead of their use. 16-byte chunk
// q = 4 lane + i of a side is chunk i of the lane's 32 elements (vector g = lane / P owns chunks
// g D / 8 .. (g + 1) D / 8 - 1); it is stored at chunk q ^ f(q >> 3), f(r) = ((r >> LR) ^
// ((r & (R - 1)) << (2 - LR))) & 7 with R = D / 64 = 2^LR groups of 8 chunks per vector. The XOR
// only moves a chunk inside its vector's row, and:
//  - the copy (lane copies chunks lane + 32 j: consecutive lanes, consecutive bytes of a row) and
//    the lane's own reads (chunks 4 lane + i) put the 8 lanes of each 16-byte access phase on 8
//    different bank groups (f's two low bits run through 0..3 with the two low bits of r);
//  - one channel of the warp's 8 (D = 128) or 4 (D = 256) vectors lies in as many different
//    bank groups (for a fixed chunk of the row, f runs through g), so the outlier-split gather,
//    where the vectors of a warp are one head's and read the same channels, conflicts only
//    between the lanes of one vector whose channels share a word position in their chunks (at
//    D = 256 also bit 2 of the chunk; at D = 64, 16 vectors, rows g and g + 8 always share).
//    kvq::outlier_split_order gives the lanes of each gather load channels of distinct classes
//    (kvq::split_bank_class), so that none do (ncu: with the segments in ascending channel order,
//    4.2M of the 6.7M shared-load conflicts per tq-3.5bit store of 65,536 x 8 rows).
template <int D>
struct Stage {
  static constexpr int P = D / kLaneElems, R = D / 64, LR = R == 1 ? 0 : (R == 2 ? 1 : 2);
  __host__ __device__ static constexpr std::uint32_t f(std::uint32_t r) {
    return ((r >> LR) ^ ((r & (R - 1)) << (2 - LR))) & 7u;
  }
  __host__ __device__ static constexpr std::uint32_t pos(std::uint32_t q) { return q ^ f(q >> 3); }
  // Byte offset of channel c in vector g's row is row_base(g) ^ chan_off(c): g 2 D + (chan_off(c) ^ 16 (g & 7)).
  __host__ __device__ static constexpr std::uint32_t chan_off(std::uint32_t c) {
    const std::uint32_t c8 = c >> 3;
    return ((c8 ^ ((c8 >> 3) << (2 - LR))) << 4) | ((c & 7u) << 1);
  }
  __host__ __device__ static constexpr std::uint32_t row_base(std::uint32_t g) { return g * (2u * D) + ((g & 7u) << 4); }
};

}  // namespace kvq::cuda::detail
