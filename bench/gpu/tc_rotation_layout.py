#!/usr/bin/env python3
"""Index check of the tensor-core rotation sketched in docs/kernels.md ("Open": the rotation by tensor cores).

y = H64 x for 16 rows of 64 as m16n8k16 products: A's column c at k-step kk is input position
sigma(kk, c) = 16 (c % 8 // 2) + 4 kk + (c & 1) + 2 [c >= 8], B's column n of n-tile j is output position
pi(j, n) = 16 (n // 2) + 2 j + (n & 1), so that lane t of a quad holds positions 16 t .. 16 t + 15 in A and in C.
Checks, exactly on integer H64 and in float64 on random rows: the 32 B tiles are the two tiles of j & 1 times the
sign H4[kk][j >> 1], and the tiled products give H64 x. No GPU; numpy only. Exit status 1 when a check fails.
"""
import sys

import numpy as np


def sigma(kk, c):
    return 16 * ((c % 8) // 2) + 4 * kk + (c & 1) + 2 * (c >= 8)


def pi(j, n):
    return 16 * (n // 2) + 2 * j + (n & 1)


def main():
    h = np.array([[(-1) ** bin(p & q).count("1") for q in range(64)] for p in range(64)], dtype=np.int64)
    h4 = h[:4, :4]
    tiles = {(kk, j): np.array([[h[sigma(kk, c)][pi(j, n)] for n in range(8)] for c in range(16)])
             for kk in range(4) for j in range(8)}
    ok = True
    for (kk, j), b in tiles.items():
        if not np.array_equal(b, h4[kk][j >> 1] * tiles[(0, j & 1)]):
            print(f"tile (kk={kk}, j={j}) is not H4[kk][j>>1] times tile (0, {j & 1})")
            ok = False
    # every lane of a quad holds 16 consecutive positions, in (A: c in {2t, 2t+1, 2t+8, 2t+9}) and out (C: n in {2t, 2t+1})
    for t in range(4):
        ins = sorted(sigma(kk, c) for kk in range(4) for c in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9))
        outs = sorted(pi(j, n) for j in range(8) for n in (2 * t, 2 * t + 1))
        if ins != list(range(16 * t, 16 * t + 16)) or outs != ins:
            print(f"lane {t} does not hold positions {16 * t} .. {16 * t + 15}")
            ok = False
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 64))
    y = np.zeros((16, 64))
    for j in range(8):
        for kk in range(4):
            a = x[:, [sigma(kk, c) for c in range(16)]]
            y[:, [pi(j, n) for n in range(8)]] += a @ tiles[(kk, j)]
    err = np.abs(y - x @ h.T).max()
    if not err < 1e-12:
        print(f"tiled product differs from H64 x by {err}")
        ok = False
    print("tensor-core rotation layout:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
