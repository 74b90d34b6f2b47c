#!/usr/bin/env python3
"""Kernel timestamps of the fast GQA decode kernel (src/cuda/decode_fast.cuh), for profiling only.

  timestamps.py patch FILE          rewrite FILE (a copy of decode_fast.cuh) with timestamp probes
  timestamps.py report A.bin [B.bin] timeline, per-warp and per-SM tables of one or two launches

scripts/gpu-timestamps does both around `kvq bench decode` in a scratch copy of the tree; the
patched kernel is never built into the project.

What the patch records, per CTA (record of 48 64-bit slots, CTA index x + X (y + Y z)):
  slot 0        CTA entry (%globaltimer, ns)
  slot 40       %smid
  slots 41-45   prologue points: page ids read, first barrier, tables built, query rotated, B
                fragments loaded (low 32 bits of the timer)
  slots 24-39   per warp: chunk 0 landed (tq-3bit and the outlier splits: its key codes and metadata; its values may follow)
  slots 8-23    per warp: main loop ended (all copies waited for)
  slot 3, 4, 5  warps' merge start, warps' merge done, CTA done (split merge, and split 0's protected rows, included)
  slots 1, 2    cluster merge (finish_cluster): the first cluster barrier passed, the sends to the other CTAs issued
  slots 6, 7    the same, in the CTA's first row-owning warp: the other CTAs' rows landed, its rows merged and stored
Timestamps are kept in registers and stored where the store does not delay the measured work
(the warps' times after the CTA's merge). Every launch overwrites the records; the buffer of the
last launch is written to $KVQ_PROBE_OUT (default /tmp/probe.bin) at exit: 3 uint32 grid
dimensions, then 8192 x 48 uint64.

Each replacement must match the kernel source exactly once: when the kernel changes, the patch
stops with the text it did not find instead of measuring something else.
"""

import struct
import sys
from statistics import median as _median

SLOTS = 48
MAX_CTAS = 8192

_HEADER = r'''namespace kvq::cuda::detail {
__device__ unsigned long long* g_probe;
__device__ __forceinline__ unsigned long long gt64_() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ unsigned gt32_() { unsigned t; asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(t)); return t; }
#define PSLOT(k) ((blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) * 48 + (k))
inline unsigned long long* probe_buf = nullptr;
inline unsigned probe_dims[3];
inline void probe_dump() {
  const size_t n = 8192 * 48;
  std::vector<unsigned long long> h(n);
  cudaDeviceSynchronize();
  cudaMemcpy(h.data(), probe_buf, n * 8, cudaMemcpyDeviceToHost);
  const char* fn = getenv("KVQ_PROBE_OUT");
  FILE* f = fopen(fn ? fn : "/tmp/probe.bin", "wb");
  if (!f) return;
  fwrite(probe_dims, 4, 3, f);
  fwrite(h.data(), 8, n, f);
  fclose(f);
}
'''

# (text in the kernel source, replacement); each text must occur exactly once.
_EDITS = [
    ("namespace kvq::cuda::detail {\n", _HEADER),
    ("#include <type_traits>\n", "#include <type_traits>\n#include <vector>\n#include <cstdio>\n#include <cstdlib>\n"),
    ("  extern __shared__ __align__(16) std::uint8_t smem_raw[];\n  const int nsplit = a.nsplit, cps = a.cps;\n",
     "  extern __shared__ __align__(16) std::uint8_t smem_raw[];\n  const unsigned long long pt0_ = gt64_();\n"
     "  unsigned long long* const pbp_ = g_probe;\n  unsigned pt_[6] = {0, 0, 0, 0, 0, 0};\n"
     "  const int nsplit = a.nsplit, cps = a.cps;\n"),
    ("  int page_next = page_first(C::NST - 1);\n", "  int page_next = page_first(C::NST - 1);\n  pt_[0] = gt32_();\n"),
    ("  __syncthreads();\n  // Pair tables: row e", "  __syncthreads();\n  pt_[1] = gt32_();\n  // Pair tables: row e"),
    ("  // Rotation of the query in registers: warp h", "  pt_[2] = gt32_();\n  // Rotation of the query in registers: warp h"),
    ("  __syncthreads();\n  // B fragments of the query", "  __syncthreads();\n  pt_[3] = gt32_();\n  // B fragments of the query"),
    ("  float m_run = -INFINITY, l_run = 0, z_run = 0;\n", "  float m_run = -INFINITY, l_run = 0, z_run = 0;\n  pt_[4] = gt32_();\n"),
    ("  for (int i = 0; i < nloc; ++i) {\n",
     "  if (tid == 0 && pbp_) {\n"
     "    unsigned s_; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(s_));\n"
     "    pbp_[PSLOT(0)] = pt0_; pbp_[PSLOT(40)] = s_;\n"
     "    for (int k = 0; k < 6; ++k) pbp_[PSLOT(41 + k)] = pt_[k];\n"
     "  }\n"
     "  unsigned tfirst_ = 0;\n"
     "  for (int i = 0; i < nloc; ++i) {\n"),
    ("    __syncwarp();\n    issue_or_skip(i + C::NST - 1 < nloc, slot_wr, page_next);",
     "    __syncwarp();\n    if (i == 0) tfirst_ = gt32_();\n    issue_or_skip(i + C::NST - 1 < nloc, slot_wr, page_next);"),
    ("\n\n  // ---- merge: rounded", "\n  const unsigned tend_ = gt32_();\n\n  // ---- merge: rounded"),
    ("  float* const red = reinterpret_cast<float*>(smem_raw + C::red_off(lut_pad));",
     "  const unsigned tbar_ = gt32_();\n  float* const red = reinterpret_cast<float*>(smem_raw + C::red_off(lut_pad));"),
    ("  sum_warps<C>(red, zc_s, po, pst, G);\n"
     "  if (p.protect.enabled() && blockIdx.x == 0) protected_rows<C, C::PMAXH>(p, a, NS, smem_raw);\n"
     "  finish();\n}",
     "  sum_warps<C>(red, zc_s, po, pst, G);\n"
     "  const unsigned tmw_ = gt32_();\n"
     "  if (p.protect.enabled() && blockIdx.x == 0) protected_rows<C, C::PMAXH>(p, a, NS, smem_raw);\n"
     "  finish();\n"
     "  const unsigned tfin_ = gt32_();\n"
     "  {\n"
     "    unsigned long long* const pb = g_probe;\n"
     "    const int tt = tid_after_loop();\n"
     "    if (pb && (tt & 31) == 0) { pb[PSLOT(24 + (tt >> 5))] = tfirst_; pb[PSLOT(8 + (tt >> 5))] = tend_; }\n"
     "    if (pb && tt == 0) { pb[PSLOT(3)] = tbar_; pb[PSLOT(4)] = tmw_; pb[PSLOT(5)] = tfin_; }\n"
     "  }\n"
     "}"),
    ("  __cluster_barrier_wait();  // early: the prologue's arrivals (the partner's buffer and barrier are ready)\n",
     "  __cluster_barrier_wait();  // early: the prologue's arrivals (the partner's buffer and barrier are ready)\n"
     "  if (g_probe && tid == 0) g_probe[PSLOT(1)] = gt32_();\n"),
    ("  __cluster_barrier_arrive_relaxed();\n  if (mine) {\n    wait_cluster_bytes(rbar);\n",
     "  __cluster_barrier_arrive_relaxed();\n  if (g_probe && tid == 0) g_probe[PSLOT(2)] = gt32_();\n"
     "  if (mine) {\n    wait_cluster_bytes(rbar);\n    if (g_probe && w == rank && lane == 0) g_probe[PSLOT(6)] = gt32_();\n"),
    ("  }\n  __cluster_barrier_wait();\n}\n\ntemplate <class C>\n__global__ void __launch_bounds__(C::THREADS, 1)\n",
     "  }\n  if (g_probe && w == rank && lane == 0) g_probe[PSLOT(7)] = gt32_();\n  __cluster_barrier_wait();\n}\n\n"
     "template <class C>\n__global__ void __launch_bounds__(C::THREADS, 1)\n"),
    ("  const dim3 grid(static_cast<unsigned>(NS), static_cast<unsigned>(grid_rows(p, a)), static_cast<unsigned>(p.batch));\n",
     "  const dim3 grid(static_cast<unsigned>(NS), static_cast<unsigned>(grid_rows(p, a)), static_cast<unsigned>(p.batch));\n"
     "  if (grid.x * grid.y * grid.z > 8192) return cudaErrorInvalidValue;  // the probe buffer's CTAs\n"
     "  if (!probe_buf) {\n"
     "    cudaMalloc(&probe_buf, 8192 * 48 * 8);\n"
     "    cudaMemset(probe_buf, 0, 8192 * 48 * 8);\n"
     "    cudaMemcpyToSymbol(g_probe, &probe_buf, sizeof(probe_buf));\n"
     "    atexit(probe_dump);\n"
     "  }\n"
     "  probe_dims[0] = grid.x; probe_dims[1] = grid.y; probe_dims[2] = grid.z;\n"),
]


def patch(src):
    """The kernel source with the probes; raises ValueError naming the first text not found once."""
    for old, new in _EDITS:
        n = src.count(old)
        if n != 1:
            raise ValueError(f"timestamps: expected one occurrence, found {n}:\n{old}")
        src = src.replace(old, new)
    return src


def load(path):
    """(grid dims, records[ctas][48] as Python ints) of one dump."""
    with open(path, "rb") as f:
        d = f.read()
    if len(d) < 12:
        raise ValueError(f"{path}: too short for a timestamp dump")
    gx, gy, gz = struct.unpack("<3I", d[:12])
    n = gx * gy * gz
    if n == 0 or n > MAX_CTAS or len(d) < 12 + n * SLOTS * 8:
        raise ValueError(f"{path}: grid {gx}x{gy}x{gz} does not match the dump's size")
    vals = struct.unpack(f"<{n * SLOTS}Q", d[12:12 + n * SLOTS * 8])
    return (gx, gy, gz), [list(vals[i * SLOTS:(i + 1) * SLOTS]) for i in range(n)]


class Launch:
    """Times of one launch in microseconds from the first CTA's entry."""

    def __init__(self, path):
        self.grid, recs = load(path)
        if any(r[0] == 0 for r in recs):
            raise ValueError(f"{path}: a CTA without an entry time (was the patched kernel run?)")
        t0 = min(r[0] for r in recs)
        self.off = [(r[0] - t0) / 1000.0 for r in recs]

        def rel(r, k, off):  # 32-bit timer values after the 64-bit entry time
            return off + ((r[k] - (r[0] & 0xffffffff)) % (1 << 32)) / 1000.0

        self.warps = max(sum(1 for w in range(16) if r[8 + w] != 0) for r in recs)
        W = self.warps
        self.sm = [int(r[40]) for r in recs]
        self.first = [[rel(r, 24 + w, o) for w in range(W)] for r, o in zip(recs, self.off)]
        self.lend = [[rel(r, 8 + w, o) for w in range(W)] for r, o in zip(recs, self.off)]
        self.merge0 = [rel(r, 3, o) for r, o in zip(recs, self.off)]
        self.merge1 = [rel(r, 4, o) for r, o in zip(recs, self.off)]
        self.end = [rel(r, 5, o) for r, o in zip(recs, self.off)]
        # cluster merge (None where the launch had none): first barrier passed, sends issued, rows landed, rows merged
        self.cl = [[rel(r, k, o) if r[k] != 0 else None for k in (1, 2, 6, 7)] for r, o in zip(recs, self.off)]
        # page ids read, first barrier, tables built, query rotated, B fragments loaded (after the CTA's entry)
        self.prologue = [[rel(r, 41 + k, 0.0) for k in range(5)] for r in recs]


def _mean(xs):
    return sum(xs) / len(xs)


def _q(xs):
    return f"{min(xs):6.2f} {_median(xs):6.2f} {max(xs):6.2f}"


def _corr(x, y):
    mx, my = _mean(x), _mean(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")


def summary(L):
    """Dict of the launch's figures (the report prints them; tests check them)."""
    last = [max(w) for w in L.lend]
    firstw = [min(w) for w in L.lend]
    W = L.warps
    dev = [[x - _mean(w) for x in w] for w in L.lend]
    pattern = [_mean([d[k] for d in dev]) for k in range(W)]
    var_all = _mean([x * x for d in dev for x in d])
    var_pat = _mean([p * p for p in pattern])
    loop = [_mean(w) - _median(f) for w, f in zip(L.lend, L.first)]  # mean warp's loop time
    by_sm = {}
    for s, t in zip(L.sm, loop):
        by_sm.setdefault(s, []).append(t)
    return {
        "ctas": len(L.end),
        "span": max(L.end),
        "prologue": [_median([x[k] for x in L.prologue]) for k in range(5)],
        "first": [_median(f) for f in L.first],
        "loop_end_first": firstw,
        "loop_end_last": last,
        "spread": [a - b for a, b in zip(last, firstw)],
        "warps_merge": [b - a for a, b in zip(L.merge0, L.merge1)],
        "tail": [e - a for e, a in zip(L.end, last)],
        "end": L.end,
        # What a perfectly balanced assignment could take off (an upper bound: no granularity, no cost): per CTA, its
        # last warp's loop end past its warps' mean loop end; per launch, its last CTA's end past the CTAs' mean end.
        "warp_excess": [a - _mean(w) for a, w in zip(last, L.lend)],
        "cta_excess": max(L.end) - _mean(L.end),
        "warp_pattern": pattern,
        "warp_pattern_share": var_pat / var_all if var_all > 0 else 0.0,
        "loop_by_sm": {s: _mean(v) for s, v in by_sm.items()},
        "cluster_steps": cluster_steps(L),
    }


def cluster_steps(L):
    """The cluster merge's steps of clusters of two CTAs along x, as (name, [us]) lists for the cluster's later CTA
    (the one whose warps' merge ended last: the launch's critical path through the cluster) and its earlier one; None
    unless every CTA recorded the first cluster barrier and its sends (a launch without the cluster merge)."""
    if L.grid[0] != 2 or any(c[0] is None or c[1] is None for c in L.cl):
        return None
    late, early = [], []
    for i in range(0, len(L.end), 2):
        a, b = (i, i + 1) if L.merge1[i] >= L.merge1[i + 1] else (i + 1, i)
        late.append(a)
        early.append(b)

    def steps(idx, other):
        out = {"loop end (last warp) -> warps' merge start": [], "warps' merge": [],
               "-> first cluster barrier passed": [], "-> sends issued": [],
               "-> the other CTA's rows landed (row-owning warp)": [], "-> rows merged and stored": [],
               "-> CTA done": [], "the other CTA: this CTA's sends issued -> its rows landed": []}
        for c, o in zip(idx, other):
            s1, s2, s6, s7 = L.cl[c]
            if None in (s1, s2, s6, s7):
                continue
            last = max(L.lend[c])
            out["loop end (last warp) -> warps' merge start"].append(L.merge0[c] - last)
            out["warps' merge"].append(L.merge1[c] - L.merge0[c])
            out["-> first cluster barrier passed"].append(s1 - L.merge1[c])
            out["-> sends issued"].append(s2 - s1)
            out["-> the other CTA's rows landed (row-owning warp)"].append(s6 - s2)
            out["-> rows merged and stored"].append(s7 - s6)
            out["-> CTA done"].append(L.end[c] - s7)
            if L.cl[o][2] is not None:
                out["the other CTA: this CTA's sends issued -> its rows landed"].append(L.cl[o][2] - s2)
        return [(k, v) for k, v in out.items() if v]

    return {"later": steps(late, early), "earlier": steps(early, late)}


def report(paths, out=sys.stdout):
    launches = [Launch(p) for p in paths]
    sums = [summary(L) for L in launches]
    for p, L, S in zip(paths, launches, sums):
        gx, gy, gz = L.grid
        print(f"{p}: grid {gx}x{gy}x{gz}, {L.warps} warps; span {S['span']:.2f} us from the first CTA's entry", file=out)
        print("  (min / median / max over CTAs, us)", file=out)
        for name, key in [("entry", None), ("chunk 0 landed (median warp)", "first"), ("loop end, first warp", "loop_end_first"),
                          ("loop end, last warp", "loop_end_last"), ("warps' loop-end spread", "spread"),
                          ("warps' merge", "warps_merge"), ("last loop end -> CTA done", "tail"), ("CTA done", "end"),
                          ("last warp - mean warp loop end", "warp_excess")]:
            xs = L.off if key is None else S[key]
            print(f"    {name:30s} {_q(xs)}", file=out)
        print(f"  last CTA done - mean CTA done: {S['cta_excess']:.2f} us", file=out)
        if S["cluster_steps"]:
            for side in ("later", "earlier"):
                print(f"  cluster merge, the {side} CTA of each cluster (by its warps' merge end; min / median / max, us):",
                      file=out)
                for name, xs in S["cluster_steps"][side]:
                    print(f"    {name:52s} {_q(xs)}", file=out)
        pr = S["prologue"]
        print(f"  prologue, median CTA, us after its entry: page ids {pr[0]:.2f}, first barrier {pr[1]:.2f}, tables {pr[2]:.2f}, "
              f"query rotated {pr[3]:.2f}, B fragments {pr[4]:.2f}", file=out)
        print("  loop end by warp, mean deviation from the CTA's mean (us):", file=out)
        print("    " + " ".join(f"{x:5.2f}" for x in S["warp_pattern"]), file=out)
        print(f"    share of the warps' variance the warp index explains: {S['warp_pattern_share']:.2f}", file=out)
        loops = sorted(S["loop_by_sm"].values())
        lo, hi = loops[0], loops[-1]
        nb = 8
        step = (hi - lo) / nb if hi > lo else 1.0
        hist = [0] * nb
        for t in loops:
            hist[min(nb - 1, int((t - lo) / step))] += 1
        print(f"  loop time per SM (mean warp, chunk 0 landed to loop end): {lo:.1f} .. {hi:.1f} us; SMs per bin:", file=out)
        print("    " + " ".join(f"{lo + i * step:5.1f}:{h}" for i, h in enumerate(hist)), file=out)
    if len(sums) == 2:
        a, b = sums[0]["loop_by_sm"], sums[1]["loop_by_sm"]
        common = sorted(set(a) & set(b))
        same = sum(1 for x, y in zip(launches[0].sm, launches[1].sm) if x == y) / len(launches[0].sm)
        if len(common) > 2:
            c = _corr([a[s] for s in common], [b[s] for s in common])
            print(f"loop time per SM, correlation between the two launches: {c:.2f} over {len(common)} SMs "
                  f"(CTAs on the same SM in both: {same:.0%})", file=out)
    return sums


def main(argv):
    if len(argv) == 2 and argv[0] == "patch":
        with open(argv[1]) as f:
            src = f.read()
        with open(argv[1], "w") as f:
            f.write(patch(src))
        return 0
    if len(argv) in (2, 3) and argv[0] == "report":
        report(argv[1:])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
