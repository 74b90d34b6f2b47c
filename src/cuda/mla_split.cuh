// mla_split.cuh: the virtual tiles of one sequence in the MLA decode kernels (tuned and generic) and a
// split's contiguous range of them. Virtual tiles [0, nprt) hold the protected bf16 rows (positions
// [0, pb), then [pe, L): sinks and the recent window), then come the packed tiles of TI tokens that
// cover positions [pb, pe) (packed tile pi holds positions [pi TI, (pi + 1) TI)). Splits take ranges
// of equal cost, a protected tile counting kMlaProtCost packed ones: its rows are loaded from global
// memory inside the loop, not through the cp.async stages (H200, c4r4 with `paper` protection at
// 8 x 4K: ~4 us per protected tile against ~1 us per packed one when the first split took them all).
#pragma once

#include "kvq/cuda_protect.hpp"

namespace kvq::cuda::detail {

constexpr int kMlaProtCost = 4;
// Shared memory per CTA for two CTAs per SM on sm_90: (228 KB - 2 x 1 KB reserved) / 2 (both decode kernels).
constexpr int kMlaSmemTwoPerSm = 115712;

template <int TI>
struct MlaTiles {
  int pb, pe;     // packed positions [pb, pe)
  int first;      // packed tile index of the first packed virtual tile
  int nprot;      // protected positions
  int nprt;       // protected virtual tiles
  int v0, v1;     // this split's virtual tiles [v0, v1)

  __device__ __forceinline__ MlaTiles(const MlaProtectLayout& pr, bool prot, int L, int nsplit, int split) {
    pb = prot ? static_cast<int>(pr.packed_begin(L)) : 0;
    pe = prot ? static_cast<int>(pr.packed_end(L)) : L;
    first = pb / TI;
    const int end = pe > pb ? (pe + TI - 1) / TI : first;
    nprot = prot ? pb + (L - pe) : 0;
    nprt = (nprot + TI - 1) / TI;
    const int cost = kMlaProtCost * nprt + (end - first);
    const int per = (cost + nsplit - 1) / nsplit;
    v0 = tile_at(min(split * per, cost));
    v1 = tile_at(min((split + 1) * per, cost));
  }
  // The first virtual tile that starts at cost >= c.
  __device__ __forceinline__ int tile_at(int c) const {
    return c <= kMlaProtCost * nprt ? (c + kMlaProtCost - 1) / kMlaProtCost : nprt + (c - kMlaProtCost * nprt);
  }
  // Rows [lo, hi) of virtual tile vt that hold positions of this tile's kind.
  __device__ __forceinline__ void range(int vt, int& lo, int& hi) const {
    if (vt < nprt) {
      lo = 0;
      hi = min(TI, nprot - vt * TI);
    } else {
      const int pi = first + vt - nprt;
      lo = max(0, pb - pi * TI);
      hi = min(TI, pe - pi * TI);
    }
  }
  // The position of row r of protected virtual tile vt.
  __device__ __forceinline__ int prot_pos(int vt, int r) const {
    const int idx = vt * TI + r;
    return idx < pb ? idx : pe + (idx - pb);
  }
};

}  // namespace kvq::cuda::detail
