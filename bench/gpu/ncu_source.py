#!/usr/bin/env python3
"""Stall samples of one kernel's SASS, from ncu's source page, grouped where the time goes.

  ncu --kernel-name regex:decode_fast --launch-skip 4 --launch-count 1 --section SourceCounters -o R kvq bench decode ...
  ncu --import R.ncu-rep --page source --csv --print-source sass | gzip > src.csv.gz
  bench/gpu/ncu_source.py src.csv.gz [--chunks N] [--top K]

The main loop is taken as the address range from the first to the last instruction executed N times (by default the
largest execution count that at least 64 instructions share: one per warp and chunk in the fast decode kernels, whose
loop head and tail run every chunk); instructions inside that range that run less often (a copy skipped in the last
chunks, a rare branch) count as the loop's.
Printed: the samples before, in and after that range; inside it, per execution count (every chunk, the chunks that
issue a copy, the rescale branch ...) the instructions' dynamic count per chunk and their samples; the loop's
samples by opcode with each opcode's dynamic count per chunk; the stall reasons of each part; and the K instructions
with the most samples. Samples are ncu's warp-state samples (every resident warp, at a fixed interval), so a part's
share of them is its share of the warps' time, not of the SM's issue slots.
"""
import argparse
import collections
import csv
import gzip
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_loops import opcode  # noqa: E402  (the mnemonic of a SASS line, predicate and modifiers dropped)


def _int(s):
    s = (s or "").replace(",", "").strip()
    return int(s) if s and s != "-" else 0


def read(path):
    """Rows of (address, source, executions, samples, {stall reason: samples}) from a source-page CSV."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if head is None:
        raise ValueError(f"{path}: no header row starting with 'Address' (ncu --page source --csv --print-source sass)")
    hdr = rows[head]
    col = {h: i for i, h in enumerate(hdr)}
    for need in ("Address", "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"):
        if need not in col:
            raise ValueError(f"{path}: no column '{need}'")
    stalls = [h for h in hdr if h.startswith("stall_") and "(" not in h]
    out = []
    for r in rows[head + 1:]:
        if len(r) < len(hdr):
            continue
        out.append((int(r[col["Address"]], 16), r[col["Source"]].strip(), _int(r[col["Instructions Executed"]]),
                    _int(r[col["Warp Stall Sampling (All Samples)"]]),
                    {h[len("stall_"):]: _int(r[col[h]]) for h in stalls}))
    if not out:
        raise ValueError(f"{path}: no instructions")
    return out


def loop_count(ins, min_share=64):
    counts = collections.Counter(i[2] for i in ins if i[2] > 0)
    common = [c for c, k in counts.items() if k >= min_share]
    if not common:
        raise ValueError(f"no execution count shared by {min_share} instructions: give --chunks")
    return max(common)


def summarize(ins, chunks=None, top=10):
    chunks = chunks or loop_count(ins)
    at = [k for k, i in enumerate(ins) if i[2] == chunks]
    if not at:
        raise ValueError(f"no instruction executed {chunks} times")
    lo, hi = min(at), max(at)
    parts = {"before the loop": ins[:lo], "loop": ins[lo:hi + 1], "after the loop": ins[hi + 1:]}
    total = sum(i[3] for i in ins)
    lines = [f"samples {total}; loop: {hi - lo + 1} instructions executed up to {chunks} times "
             f"(addresses +{ins[lo][0] - ins[0][0]:#x} .. +{ins[hi][0] - ins[0][0]:#x})"]
    for name, part in parts.items():
        s = sum(i[3] for i in part)
        why = collections.Counter()
        for i in part:
            why.update(i[4])
        reasons = ", ".join(f"{k} {v}" for k, v in why.most_common(6) if v)
        lines.append(f"  {name:16s} {s:6d} samples ({100.0 * s / max(total, 1):5.1f}%)  {reasons}")
    loop = parts["loop"]
    ls = max(sum(i[3] for i in loop), 1)
    lines.append(f"loop: {sum(i[2] for i in loop) / chunks:.1f} instructions per chunk; by execution count:")
    by = collections.defaultdict(list)
    for i in loop:
        by[i[2]].append(i)
    for c in sorted(by, reverse=True):
        g = by[c]
        s = sum(i[3] for i in g)
        lines.append(f"  executed {c:8d}: {len(g):4d} instructions, {sum(i[2] for i in g) / chunks:6.1f} per chunk, "
                     f"{s:5d} samples ({100.0 * s / ls:5.1f}% of the loop's)")
    ops, dyn = collections.Counter(), collections.Counter()
    for i in loop:
        ops[opcode(i[1])] += i[3]
        dyn[opcode(i[1])] += i[2] / chunks
    lines.append("loop by opcode: samples (% of the loop's), instructions per chunk")
    for o, s in ops.most_common():
        if s:
            lines.append(f"  {o:12s} {s:6d} ({100.0 * s / ls:5.1f}%) {dyn[o]:7.1f}")
    lines.append(f"the {top} instructions with the most samples:")
    for i in sorted(ins, key=lambda i: -i[3])[:top]:
        why = ", ".join(f"{k} {v}" for k, v in sorted(i[4].items(), key=lambda kv: -kv[1]) if v)
        lines.append(f"  +{i[0] - ins[0][0]:#07x} x{i[2]:<8d} {i[3]:5d}  {i[1][:60]}  ({why})")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--chunks", type=int, help="the main loop's execution count (default: found)")
    ap.add_argument("--top", type=int, default=10, help="instructions with the most samples to list")
    a = ap.parse_args(argv)
    try:
        print(summarize(read(a.csv), a.chunks, a.top))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
