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

}  // namespace kvq::cuda::detail

#undef KVQ_KEYWIN_HD
