// bins.cuh: bucketization against a codebook's midpoints without a search, shared by the GQA store
// and the mla-tq writer. A table of bins over y: bin(y) = floor(sat(y a + b) n) (a saturating FMA
// and a round-down FMA with 1.5 * 2^23), with n large enough that no bin holds two midpoints; bin k
// stores the number `base` of midpoints in bins below k, and the bucket is base + (mid[base] < y):
// mid[base] is the midpoint inside the bin if there is one, else the next one above (> y), or +inf
// -- the count of midpoints strictly below y, exactly kvq::bucketize, because the bin is a monotone
// function computed the same way for y and for the midpoints. A codebook for which no n <= 255
// works (ok = 0) needs the binary search instead (bin_bucket does it).
// Also the warp forms of kvq::sum_squares (TurboQuant's norm) and of the norm-correction sum on its
// grid (kvq::grid_square_sum), and the corrected norm, shared by both writers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device.cuh"

namespace kvq::cuda::detail {

constexpr int kMaxBins = 256;
constexpr float kFloorMagic = 12582912.0f;  // 1.5 * 2^23: fl_down(t + magic) = magic + floor(t), 0 <= t < 2^22
constexpr std::uint32_t kMagicBits = 0x4B400000u;

struct StoreTables {
  std::uint8_t base[4][kMaxBins];  // [key seg 0, key seg 1, value seg 0, value seg 1]: midpoints in lower bins
  float edges[4][16];              // midpoints, +inf after the last
  // The norm-correction sum's terms, the centroids' squares on their grid (kvq::grid_squares, from the host);
  // 16 words in 16 banks: lanes never conflict.
  float sq[4][16];
  float ba[4], bb[4], bn[4];       // bin(y) = floor(sat(y * ba + bb) * bn)
  int ok[4];
  int sym[4];  // sq[i] == sq[2^bits - 1 - i] for every i (code and mirror code share the square): counts by magnitude
  // The GQA store's (midpoint, base) pair tables: shared address - stride kMagicBits, and the byte
  // stride of a bin's row (8, or 8 kPairCopies) (build_bin_pairs sets them, bin_pair_lookup takes
  // them). Read from shared memory, the compiler cannot split the constant back out of the address
  // (computed in the kernel, it added it per element).
  std::uint32_t pair_base[4], pair_stride[4];
};

__device__ __forceinline__ float fma_sat(float a, float b, float c) {
  float r;
  asm("fma.rn.sat.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}
__device__ __forceinline__ int bin_of(float y, float a, float b, float n) {
  return __float_as_int(__fmaf_rd(fma_sat(y, a, b), n, kFloorMagic)) - static_cast<int>(kMagicBits);
}

// The xor-butterfly over groups of L lanes (L a power of two): with lane j of a group holding the sum of
// block j, every lane of the group gets the pairwise tree of the L block sums, ((b0 + b1) + (b2 + b3)) + ...,
// the last step of kvq::sum_squares (include/kvq/numeric.hpp); a + b = b + a bit for bit, so every lane
// returns the same sum, and lanes past the last block hold +0 (the tree's zero padding). The norm-correction sum
// on its grid adds its lanes with it too: exact there, so the tree's order does not matter.
template <int L>
__device__ __forceinline__ float xor_tree(float t) {
#pragma unroll
  for (int o = 1; o < L; o <<= 1) t = __fadd_rn(t, __shfl_xor_sync(0xffffffffu, t, o));
  return t;
}

// The end of kvq::sum_squares on a warp whose lane b holds the four chains of block b (zeros in
// lanes past the last block): (s0 + s1) + (s2 + s3), then xor_tree over the 32 lanes.
__device__ __forceinline__ float warp_block_tree(float s0, float s1, float s2, float s3) {
  return xor_tree<32>(__fadd_rn(__fadd_rn(s0, s1), __fadd_rn(s2, s3)));
}

// kvq::sum_squares over a warp, n <= 1024: lane b < ceil(n / 32) runs block b's four chains on
// value(b, k), k = 0, 1, ... (chain k mod 4, one FMA each), then warp_block_tree. For the kernels
// whose rows sit in memory; the GQA store's fast kernel, whose lanes hold 32 consecutive values
// each, adds in registers (lanes_sum_squares).
template <class F>
__device__ __forceinline__ float warp_sum_squares(int n, int lane, F&& value) {
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
  const int len = 32 * lane < n ? min(32, n - 32 * lane) : 0;
  if (len == 32) {
#pragma unroll
    for (int k = 0; k < 32; k += 4) {
      const float a = value(lane, k), b = value(lane, k + 1), c = value(lane, k + 2), d = value(lane, k + 3);
      s0 = __fmaf_rn(a, a, s0);
      s1 = __fmaf_rn(b, b, s1);
      s2 = __fmaf_rn(c, c, s2);
      s3 = __fmaf_rn(d, d, s3);
    }
  } else {
    for (int k = 0; k < len; ++k) {
      const float a = value(lane, k);
      const float sq = __fmaf_rn(a, a, (k & 3) == 0 ? s0 : (k & 3) == 1 ? s1 : (k & 3) == 2 ? s2 : s3);
      if ((k & 3) == 0) s0 = sq;
      else if ((k & 3) == 1) s1 = sq;
      else if ((k & 3) == 2) s2 = sq;
      else s3 = sq;
    }
  }
  return warp_block_tree(s0, s1, s2, s3);
}

// A block's sum from its four FMA chains s[0 .. 3]: (s0 + s1) + (s2 + s3), as kvq::sum_squares adds them.
__device__ __forceinline__ float chains_sum(const float* s) { return __fadd_rn(__fadd_rn(s[0], s[1]), __fadd_rn(s[2], s[3])); }
// The end of kvq::sum_squares for the NB = 1 or 2 blocks a lane holds, from their four FMA chains
// each (s[4 b + j]): each block's chains_sum, the two blocks' sum (their node of the blocks'
// pairwise tree), then the butterfly over the PS lanes (PS a power of two, the lanes
// xor-adjacent), which adds the rest of the tree. Every lane of the group returns the same sum.
template <int PS, int NB>
__device__ __forceinline__ float lane_chains_tree(const float (&s)[4 * NB]) {
  static_assert(NB == 1 || NB == 2, "one or two blocks per lane");
  float t = chains_sum(s);
  if constexpr (NB == 2) t = __fadd_rn(t, chains_sum(s + 4));
  return xor_tree<PS>(t);
}
// Lane ls of the GQA store's half exchange (tq_rotate's kHalves, PS >= 2) holds blocks q1 = 4 (ls >> 1) + (ls & 1)
// and q1 + 2 of its vector; its codes go out in those two places.
__host__ __device__ constexpr int halves_first_block(int ls) { return 4 * (ls >> 1) + (ls & 1); }  // q1 above
// kvq::sum_squares of a vector held by PS lanes with N = 32 or 64 elements each, lane ls holding
// elements N ls .. N ls + N - 1 (blocks N ls / 32 ..): four FMA chains per block (element k of the
// lane in chain k mod 4 of block k / 32), then lane_chains_tree.
template <int PS, int N>
__device__ __forceinline__ float lanes_sum_squares(const float (&x)[N]) {
  static_assert(N == 32 || N == 64, "32 or 64 elements per lane");
  float s[N / 8] = {};
#pragma unroll
  for (int k = 0; k < N; ++k) s[4 * (k >> 5) + (k & 3)] = __fmaf_rn(x[k], x[k], s[4 * (k >> 5) + (k & 3)]);
  return lane_chains_tree<PS, N / 32>(s);
}

// The norm-correction sum kvq::grid_square_sum over a warp whose lanes take elements lane, lane + 32, ... of n,
// term(i) giving element i's term: each lane's float sum, then xor_tree over the warp. Every add is exact (the
// terms lie on the grid of kvq::grid_squares), so neither order matters.
template <class F>
__device__ __forceinline__ float warp_grid_square_sum(int n, int lane, F&& term) {
  float t = 0.0f;
  for (int i = lane; i < n; i += 32) t = __fadd_rn(t, term(i));
  return xor_tree<32>(t);
}

// TurboQuantMse's stored norm with norm correction: norm / sqrt(sum c^2), each step correctly
// rounded as on the CPU (a zero norm stays 0: the zero vector).
__device__ __forceinline__ float corrected_norm(float norm, float c2) {
  return norm > 0 ? __fdiv_rn(norm, __fsqrt_rn(c2)) : norm;
}

// Warp-wide: table t from a codebook with `bits` (1..4) bits: its midpoints and its norm-correction terms (the
// host's kvq::grid_squares: FormatDesc::key_terms, MlaFormat::tq_terms).
__device__ inline void build_store_table(StoreTables& T, int t, const float* __restrict__ edges_g,
                                  const float* __restrict__ terms_g, int bits, int lane) {
  const int ne = (1 << bits) - 1, nc = 1 << bits;
  for (int i = lane; i < 16; i += 32) {
    T.edges[t][i] = i < ne ? edges_g[i] + 0.0f : INFINITY;  // -0 as +0 (equal in every comparison; plus_below needs it)
    T.sq[t][i] = i < nc ? terms_g[i] : 0.0f;
  }
  __syncwarp();
  {
    const bool mirror = lane >= nc || T.sq[t][lane] == T.sq[t][nc - 1 - lane];
    const bool sym = __all_sync(0xffffffffu, mirror);
    if (lane == 0) T.sym[t] = sym ? 1 : 0;
  }
  float gap = INFINITY, emax = 0.0f;
  for (int i = lane; i < ne; i += 32) {
    emax = fmaxf(emax, fabsf(T.edges[t][i]));
    if (i + 1 < ne) gap = fminf(gap, T.edges[t][i + 1] - T.edges[t][i]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    gap = fminf(gap, __shfl_xor_sync(0xffffffffu, gap, o));
    emax = fmaxf(emax, __shfl_xor_sync(0xffffffffu, emax, o));
  }
  const float R = emax * 1.0625f + 1e-30f;
  if (ne == 1) gap = R;
  bool ok = gap > 0.0f && R < 1e30f;
  float n = ok ? fmaxf(2.0f, ceilf(2.0f * R / gap * 1.25f)) : 0.0f;
  const float a = 0.5f / R, b = 0.5f;
  for (int attempt = 0; ok; ++attempt) {
    if (!(n <= static_cast<float>(kMaxBins - 1)) || attempt > 8) {
      ok = false;
      break;
    }
    bool bad = false;
    for (int i = lane; i < ne; i += 32) {
      const int bi = bin_of(T.edges[t][i], a, b, n);
      for (int j = 0; j < ne; ++j)
        if (j != i && bin_of(T.edges[t][j], a, b, n) == bi) bad = true;
    }
    if (!__any_sync(0xffffffffu, bad)) break;
    n = ceilf(n * 1.5f);
  }
  if (ok) {
    for (int k = lane; k <= static_cast<int>(n); k += 32) {
      int base = 0;
      for (int i = 0; i < ne; ++i)
        if (bin_of(T.edges[t][i], a, b, n) < k) ++base;
      T.base[t][k] = static_cast<std::uint8_t>(base);
    }
  }
  if (lane == 0) {
    T.ba[t] = a;
    T.bb[t] = b;
    T.bn[t] = n;
    T.ok[t] = ok ? 1 : 0;
  }
}

// k + (mid < y) from the sign bit of mid - y: 2 instructions (FADD, LEA.HI) where the compare, an add and
// a predicated move took 3. mid - y < 0 exactly when mid < y for finite floats: their IEEE difference
// is 0 only when they are equal (gradual underflow; under flush-to-zero a tiny difference keeps its
// sign as -0 / +0) and has the sign of the order. A tie gives +0 (no increment: ties go down): x - x
// is +0, and so is +0 - (-0); -0 - (+0) would be -0, so the tables hold no -0 midpoint
// (build_store_table adds +0). mid = +inf gives +inf. A NaN y gives either code; such a row is refused
// through its norm.
__device__ __forceinline__ int plus_below(int k, float mid, float y) {
  return k + static_cast<int>(__float_as_uint(__fsub_rn(mid, y)) >> 31);
}
// The bucket of y from a table that works (ok): its bin's base plus one if the midpoint mids[base]
// is below y. The table's fields are arguments so that a loop can hold them in registers.
__device__ __forceinline__ int bin_lookup(const std::uint8_t* base, const float* mids, float a, float b, float n, float y) {
  const int k = base[bin_of(y, a, b, n)];
  return plus_below(k, mids[k], y);
}
// The same lookup from one 8-byte entry per bin, (mids[base] as bits, base): one shared-memory load
// and no second address (the GQA store's inner loop). The 32 lanes of a warp look up 32 unrelated
// bins, and a 64-bit load serves each half-warp in one wavefront only if its 16 lanes hit 16
// different bank pairs: with one entry per bin, bins k and k + 16 share a bank pair (ncu counted 4.72M
// bank conflicts in 22.2M shared-load wavefronts per tq-4bit store of 65,536 x 8 rows; the 4-bit sphere
// codebook's table has 26 bins). So each bin's entry is stored kPairCopies = 16 times in a row of 128
// bytes, and lane l reads copy l mod 16, its own bank pair (0.25M conflicts) -- when the rows fit the
// caller's capacity, else one copy per bin.
// Warp-wide: fills table t's pairs (in shared memory, `cap` 8-byte entries) once build_store_table has
// returned (a table that works), and T.pair_base[t] / T.pair_stride[t].
constexpr int kPairCopies = 16;
__device__ inline void build_bin_pairs(StoreTables& T, int t, uint2* pairs, int cap, int lane) {
  __syncwarp();
  const int rows = static_cast<int>(T.bn[t]) + 1, copies = rows * kPairCopies <= cap ? kPairCopies : 1;
  if (lane == 0) {
    T.pair_stride[t] = 8u * static_cast<std::uint32_t>(copies);
    T.pair_base[t] = static_cast<std::uint32_t>(__cvta_generic_to_shared(pairs)) - T.pair_stride[t] * kMagicBits;
  }
  if (!T.ok[t]) return;
  for (int i = lane; i < rows * copies; i += 32) {
    const int b = T.base[t][i / copies];
    pairs[i] = make_uint2(__float_as_uint(T.edges[t][b]), static_cast<std::uint32_t>(b));
  }
}
// The lane's base for bin_pair_lookup: T.pair_base[t] plus the offset of its copy.
__device__ __forceinline__ std::uint32_t pair_lane_base(const StoreTables& T, int t, int lane) {
  return T.pair_base[t] + (T.pair_stride[t] > 8u ? 8u * static_cast<std::uint32_t>(lane & (kPairCopies - 1)) : 0u);
}
// The bucket of y from the pairs: the entry's shared-memory address is taken from the bits of the
// round-down FMA (magic + bin) by one multiply-add with the row stride and `pbase` = pair_lane_base
// (the table's shared address - stride x kMagicBits + the lane's copy, mod 2^32), which the caller
// reads once.
__device__ __forceinline__ int bin_pair_lookup(std::uint32_t pbase, std::uint32_t stride, float a, float b, float n, float y) {
  const std::uint32_t addr = __float_as_uint(__fmaf_rd(fma_sat(y, a, b), n, kFloorMagic)) * stride + pbase;
  std::uint32_t mid, base;
  asm("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(mid), "=r"(base) : "r"(addr));
  return plus_below(static_cast<int>(base), __uint_as_float(mid), y);
}
// The bucket of y with table t (the count of its midpoints strictly below y).
__device__ __forceinline__ int bin_bucket(const StoreTables& T, int t, int ne, float y) {
  if (T.ok[t]) return bin_lookup(T.base[t], T.edges[t], T.ba[t], T.bb[t], T.bn[t], y);
  return count_below<false>(T.edges[t], ne, y);
}

}  // namespace kvq::cuda::detail
