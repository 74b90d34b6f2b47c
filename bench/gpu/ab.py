#!/usr/bin/env python3
"""Report of a same-call A/B (scripts/gpu-ab): `kvq bench decode --json` or `kvq bench mla --json` runs of two builds.

    ab.py --a A1.json A2.json ... --b B1.json B2.json ...
    ab.py --variants DIR

Per decode row (format, batch, context, and where the run has them the query / KV heads, head_dim and protection
policy) and per store row (format, tokens, KV heads, head_dim):
A's times and B's times in ascending order, and B's speed against A as A's time over B's, of the
minima and of the medians (above 1: B is faster). Every run must hold the same rows; a row with a
time that is not a positive finite number is refused. Where the runs record GPU UUIDs (gpu_uuid) and more than one
appears, a note above the table says so. Standard library only.

With --variants, DIR is the output of bench/gpu/variants.sh (files r<run>_k<variant>.json): per row, variant 0's
(the tree's) minimum over the runs, then each other variant's minimum and its speed against variant 0 (0's minimum
over its minimum, then 0's median over its median: with runs at several arena pads, the median speaks for the
placements, the minimum for the luckiest), with the same checks; each variant needs the same runs as variant 0.
Columns are named by DIR/variants.txt (lines "i<TAB>flags", which variants.sh writes) where it exists.
"""

import argparse
import json
import math
import os
import re
import sys
from statistics import median


# Fields that identify a row besides format, batch and context: GQA rows have q_heads / kv_heads / head_dim, MLA rows
# heads and protect. The kernel a launch took is not one: a patch may change it.
_DECODE_EXTRA = ("q_heads", "kv_heads", "head_dim", "heads", "protect")


def decode_key(r):
    return ("decode", r["format"], r["batch"], r["context"]) + tuple((f, r[f]) for f in _DECODE_EXTRA if f in r)


def store_key(r):
    return ("store", r["format"], r["tokens"]) + tuple((f, r[f]) for f in ("kv_heads", "head_dim") if f in r)


def load(path):
    """{row key: microseconds} of one run."""
    return read_run(path)[0]


def read_run(path):
    """({row key: microseconds}, the GPU's UUID or None) of one run: the file read once for both."""
    with open(path) as f:
        d = json.load(f)
    out = {}
    for kind, rows, key in (("decode", d.get("rows", []), decode_key), ("store", d.get("store") or [], store_key)):
        for r in rows:
            k = key(r)
            us = r.get("us")
            if not isinstance(us, (int, float)) or not math.isfinite(us) or us <= 0:
                raise ValueError(f"{path}: {kind} row {label(k)} has no valid time ({us!r})")
            if k in out:
                raise ValueError(f"{path}: {kind} row {label(k)} appears twice")
            out[k] = float(us)
    if not out:
        raise ValueError(f"{path}: no rows")
    return out, d.get("gpu_uuid")


def host_note(uuids_a, uuids_b):
    """A line saying that the runs come from more than one GPU (by the gpu_uuid that kvq bench records; None where a run
    has none), or None. The same build runs a few percent apart on two hosts
    (bench/results/gpu-hosts-h100-2026-12-06.md), so such an A/B measures the hosts too."""
    a, b = {u for u in uuids_a if u is not None}, {u for u in uuids_b if u is not None}
    if len(a | b) <= 1:
        return None
    return f"note: the runs come from more than one GPU (A: {', '.join(sorted(a)) or '-'}; B: {', '.join(sorted(b)) or '-'})"


def compare(runs_a, runs_b):
    """Rows [(key, a times sorted, b times sorted, min ratio, median ratio)] in the first run's order."""
    if not runs_a or not runs_b:
        raise ValueError("need at least one run of each side")
    keys = list(runs_a[0])
    for i, r in enumerate(runs_a + runs_b):
        if set(r) != set(keys):
            side = "A" if i < len(runs_a) else "B"
            n = i + 1 if i < len(runs_a) else i - len(runs_a) + 1
            missing = sorted((label(k) for k in set(keys) - set(r)))
            extra = sorted((label(k) for k in set(r) - set(keys)))
            raise ValueError(f"run {n} of {side} has other rows than run 1 of A (missing {missing}, extra {extra})")
    out = []
    for k in keys:
        a = sorted(r[k] for r in runs_a)
        b = sorted(r[k] for r in runs_b)
        out.append((k, a, b, a[0] / b[0], median(a) / median(b)))
    return out


def label(k):
    x = dict(k[4:] if k[0] == "decode" else k[3:])
    if k[0] == "decode":
        _, f, batch, ctx = k[:4]
        out = f"{f} B={batch} N={ctx}"
        if "q_heads" in x or "kv_heads" in x:
            out += f" {x.get('q_heads', '?')}/{x.get('kv_heads', '?')}"
        if "heads" in x:
            out += f" h{x['heads']}"
        if "head_dim" in x:
            out += f" d{x['head_dim']}"
        if x.get("protect", "none") != "none":
            out += f" protect={x['protect']}"
        return out
    _, f, tokens = k[:3]
    out = f"store {f} {tokens}"
    if "kv_heads" in x:
        out += f"x{x['kv_heads']}"
    if "head_dim" in x:
        out += f" d{x['head_dim']}"
    return out


def report(rows, out=None):
    out = sys.stdout if out is None else out
    w = max(len(label(k)) for k, *_ in rows)
    print(f"{'row':<{w}}  {'A us':<24}  {'B us':<24}  B speed (min, median)", file=out)
    for k, a, b, rmin, rmed in rows:
        fa = " ".join(f"{x:.1f}" for x in a)
        fb = " ".join(f"{x:.1f}" for x in b)
        print(f"{label(k):<{w}}  {fa:<24}  {fb:<24}  {rmin:.3f}  {rmed:.3f}", file=out)


_VARIANT_FILE = re.compile(r"^r(\d+)_k(\d+)\.json$")


def variant_runs(directory):
    """{variant: [paths, in round order]} of a bench/gpu/variants.sh output directory."""
    runs = {}
    for name in os.listdir(directory):
        m = _VARIANT_FILE.match(name)
        if m:
            runs.setdefault(int(m.group(2)), []).append((int(m.group(1)), os.path.join(directory, name)))
    if 0 not in runs:
        raise ValueError(f"{directory}: no runs of variant 0 (files r<round>_k0.json)")
    rounds = sorted(r for r, _ in runs[0])
    for v, rs in runs.items():
        if sorted(r for r, _ in rs) != rounds:
            raise ValueError(f"{directory}: variant {v} has rounds {sorted(r for r, _ in rs)}, variant 0 {rounds}")
    return {v: [p for _, p in sorted(rs)] for v, rs in sorted(runs.items())}


def variants_table(runs):
    """(variants other than 0, rows [(key, variant 0's minimum, [(minimum, speed of the minima, speed of the medians)
    per other variant])])."""
    base = [load(p) for p in runs[0]]
    others = [v for v in runs if v != 0]
    cols = [compare(base, [load(p) for p in runs[v]]) for v in others]
    rows = []
    for i, (k, a, *_) in enumerate(cols[0] if cols else compare(base, base)):
        rows.append((k, a[0], [(c[i][2][0], c[i][3], c[i][4]) for c in cols]))
    return others, rows


def variant_legend(directory):
    """{variant: its -D flags} from DIR/variants.txt (lines "i<TAB>flags"), or {} where the file is absent."""
    path = os.path.join(directory, "variants.txt")
    if not os.path.exists(path):
        return {}
    legend = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                i, _, flags = line.rstrip("\n").partition("\t")
                legend[int(i)] = flags
    return legend


def variants_report(others, rows, out=None, legend=None):
    out = sys.stdout if out is None else out
    legend = legend or {}
    w = max(len(label(k)) for k, *_ in rows)
    heads = [f"{legend.get(v, v)} us (speed, of medians)" for v in others]
    cw = [max(24, len(h)) for h in heads]
    print(f"{'row':<{w}}  {'0 us':>7}" + "".join(f"  {h:>{c}}" for h, c in zip(heads, cw)), file=out)
    for k, m0, vs in rows:
        cells = "".join(f"  {f'{m:.1f} ({r:.3f}, {rm:.3f})':>{c}}" for (m, r, rm), c in zip(vs, cw))
        print(f"{label(k):<{w}}  {m0:>7.1f}{cells}", file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", nargs="+", help="JSON of the runs of A (the tree)")
    ap.add_argument("--b", nargs="+", help="JSON of the runs of B (the tree with the patch)")
    ap.add_argument("--variants", metavar="DIR", help="the output directory of bench/gpu/variants.sh")
    args = ap.parse_args(argv)
    if args.variants is not None:
        if args.a or args.b:
            ap.error("--variants takes no --a / --b")
        try:
            variants_report(*variants_table(variant_runs(args.variants)), legend=variant_legend(args.variants))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if not args.a or not args.b:
        ap.error("--a and --b are required (or --variants DIR)")
    try:
        runs_a, runs_b = [read_run(p) for p in args.a], [read_run(p) for p in args.b]
        rows = compare([t for t, _ in runs_a], [t for t, _ in runs_b])
        note = host_note([u for _, u in runs_a], [u for _, u in runs_b])
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if note:
        print(note)
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
