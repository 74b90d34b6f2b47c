// key_windows.hpp: where the fast decode kernel finds a pair of 3-bit key codes (decode_fast.cuh,
// FCfg::kKeyWin), written once for the device and the host: tests/core/test_key_windows.cpp checks the
// mapping on any machine (CI has no GPU), and scripts/gpu-test checks the kernel that uses it.
//
// A lane's run of a token's 3-bit key codes is 96 bits: pair p (codes 2 p and 2 p + 1, the pair index
// c_2p | c_2p+1 << 3) at bits 6 p .. 6 p + 5, so a pair starts at bit 0, 6, 4 or 2 of a byte. The kernel also
// keeps a copy of the run shifted right by 4 bits: there the pairs at bit 4 or 6 of a byte of the run start at
// bit 0 or 2. Every pair thus lies in bits 0-5 or 2-7 of one byte of the run or of the copy, and one PRMT
// makes a table address of that byte. Row e of the 256-row table holds the pair (e & 63) in column A (the
// pair at bit 0 of its byte) and the pair (e >> 2) in column B (at bit 2).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVQ_KEYWIN_HD __host__ __device__
#else
#define KVQ_KEYWIN_HD
#endif

namespace kvq::cuda::detail {

struct KeyWindow {
  bool shifted;  // in the copy shifted right by 4 bits, not in the run
  int word;      // 32-bit word of the run (or copy): 0, 1 or 2
  int byte;      // byte of that word: 0..3
  bool col_b;    // the pair starts at bit 2 of the byte (column B), not at bit 0 (column A)
};

// The byte that holds pair p (0..15) of a run.
KVQ_KEYWIN_HD constexpr KeyWindow key_window(int pair) {
  const int pos = 6 * pair;
  const bool shifted = (pos & 4) != 0;  // pos % 8 is 4 or 6
  const int q = shifted ? pos - 4 : pos;
  return KeyWindow{shifted, q >> 5, (q >> 3) & 3, (q & 2) != 0};
}

// The pair index that row e (0..255) of column A / B holds.
KVQ_KEYWIN_HD constexpr int key_window_pair(bool col_b, int e) { return !col_b ? e & 63 : e >> 2; }

// 3-bit TurboQuant values (FCfg::kValWin, tq-3bit). PV takes a lane's 16 value dims of two tokens a and b as
// pairs (c_a, c_b) per dim, so the kernel merges the tokens' 48-bit runs (a0 / b0: bits 0-31, a1 / b1: bits 32-47,
// bits above garbage) into two runs of 6-bit pair fields c_a | c_b << 3 at bits 6 m: e[] for the even dims
// (dim 2 m) and o[] for the odd ones (dim 2 m + 1). Pair m of either then lies where pair m of a key run does,
// so key_window(m) names its byte (in the run or in the run shifted right by 4) and the key table's rows give
// the value pair whenever the two codebooks are equal. Bits 48-63 of e[] and o[] are garbage; key_window never
// reads them for m < 8. Each field is one bit select: Me marks the bits 6 m .. 6 m + 2, its complement in the
// 48 bits the bits 6 m + 3 .. 6 m + 5.
struct ValuePairRuns {
  std::uint32_t e[2], o[2];
};
KVQ_KEYWIN_HD constexpr ValuePairRuns value_pair_runs(std::uint32_t a0, std::uint32_t a1, std::uint32_t b0,
                                                      std::uint32_t b1) {
  constexpr std::uint32_t Me0 = 0xc71c71c7u, Me1 = 0x00001c71u;
  const std::uint32_t bs0 = b0 << 3, bs1 = (b1 << 3) | (b0 >> 29);  // b << 3
  const std::uint32_t as0 = (a0 >> 3) | (a1 << 29), as1 = a1 >> 3;  // a >> 3
  return ValuePairRuns{{(a0 & Me0) | (bs0 & ~Me0), (a1 & Me1) | (bs1 & ~Me1)},
                       {(as0 & Me0) | (b0 & ~Me0), (as1 & Me1) | (b1 & ~Me1)}};
}

}  // namespace kvq::cuda::detail

#undef KVQ_KEYWIN_HD
