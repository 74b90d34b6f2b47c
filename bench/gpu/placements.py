#!/usr/bin/env python3
"""One decode grid from several placements: `kvq bench decode --json --peers ...` results of the same grid, each
measured with its own `--arena-pad` (scripts/gpu-bench with KVQ_PADS), merged into one result of the same form.

    placements.py RUN1.json RUN2.json ... > decode-gqa.json

Where a pool lands in physical memory moves a row by up to a few percent with the same code (an H200 ran
tq-3.5bit's byte-identical kernel 4.1% faster in one binary than in another; bench/results/
decode-gqa-early-rows-2026-12-06.md), so one placement is one sample. Per row (format, batch, context, heads,
head_dim) the merged `us` is the median over the runs, `us_placements` lists every run's time in run order, `gbps`
is recomputed from the row's bytes, and the speedups are the peers' median times over the row's median (the
peers, rows `peer:...`, are merged the same way). Store rows likewise (`us`, `gbps`, `fraction_of_copy` against the
median copy bandwidth). `placements` lists each run's arena_pad_mib and command. Every run must have the same GPU
(name, and UUID and driver where recorded), commit, flush, gap and rows, each with a positive finite time (a null
time stays null only where it is null in every run); anything else is refused with a message and status 1. Standard
library only; an odd number of runs keeps every median a measured time.
"""

import json
import math
import sys
from statistics import median

_SAME = ("gpu", "gpu_uuid", "cuda_driver", "commit", "flush", "gap_ms", "pages", "seed", "sms", "l2_bytes")
_ROW_KEY = ("format", "batch", "context", "q_heads", "kv_heads", "head_dim", "protect")
_STORE_KEY = ("format", "tokens", "kv_heads", "head_dim")


def _key(row, fields):
    return tuple(row.get(f) for f in fields)


def _time(v, where):
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}: time {v!r} is not a positive finite number")
    return float(v)


def _merge_times(runs, key, fields, section, paths):
    """(median or None, [time per run]) of the row with this key in every run's section."""
    ts = []
    for r, path in zip(runs, paths):
        rows = [x for x in r[section] if _key(x, fields) == key]
        if len(rows) != 1:
            raise ValueError(f"{path}: {len(rows)} {section} rows {key}, need one")
        ts.append(_time(rows[0].get("us"), f"{path}: {section} row {key}"))
    if all(t is None for t in ts):
        return None, ts
    if any(t is None for t in ts):
        raise ValueError(f"{section} row {key}: a time in some runs only ({ts})")
    return median(ts), ts


def merge(runs, paths):
    if len(runs) < 2:
        raise ValueError("need at least two runs")
    first = runs[0]
    for r, path in zip(runs[1:], paths[1:]):
        for k in _SAME:
            if r.get(k) != first.get(k):
                raise ValueError(f"{path}: {k} {r.get(k)!r}, {paths[0]} has {first.get(k)!r}")
        for section, fields in (("rows", _ROW_KEY), ("store", _STORE_KEY)):
            a = sorted(map(repr, (_key(x, fields) for x in first.get(section, []))))
            b = sorted(map(repr, (_key(x, fields) for x in r.get(section, []))))
            if a != b:
                raise ValueError(f"{path}: other {section} rows than {paths[0]}")
    pads = [r.get("arena_pad_mib", 0) for r in runs]
    if len(set(pads)) != len(pads):
        raise ValueError(f"two runs at the same arena pad ({pads}): each run is one placement")
    copies = [_time(r.get("copy_gbps"), f"{p}: copy_gbps") for r, p in zip(runs, paths)]
    out = {k: v for k, v in first.items() if k not in ("rows", "store")}
    out["copy_gbps"] = median(copies)
    out["copy_gbps_placements"] = copies
    out["placements"] = [{"arena_pad_mib": p, "command": r.get("command")} for p, r in zip(pads, runs)]
    out["arena_pad_mib"] = None  # several: see placements
    times = [_merge_times(runs, _key(x, _ROW_KEY), _ROW_KEY, "rows", paths) for x in first["rows"]]
    peers = {(x["format"][5:], x["batch"], x["context"]): m
             for x, (m, _) in zip(first["rows"], times) if x["format"].startswith("peer:")}
    rows = []
    for x, (m, ts) in zip(first["rows"], times):
        row = dict(x)
        row["us"], row["us_placements"] = m, ts
        for k in ("t_start", "t_end", "step_us", "step_programmatic_us"):
            row.pop(k, None)
        if not x["format"].startswith("peer:"):
            if m is None:
                raise ValueError(f"row {_key(x, _ROW_KEY)}: no time")
            row["gbps"] = x["bytes"] / (m * 1e3) if x.get("bytes") is not None else None
            flash = peers.get(("sdpa_flash", x["batch"], x["context"]))
            pair = x.get("vllm_pair")
            vllm = peers.get((f"vllm_triton:{pair}", x["batch"], x["context"])) if pair else None
            row["speedup_vs_bf16_flash"] = None if flash is None else flash / m
            row["speedup_vs_vllm_triton"] = None if vllm is None else vllm / m
        rows.append(row)
    store = []
    for s in first.get("store", []):
        m, ts = _merge_times(runs, _key(s, _STORE_KEY), _STORE_KEY, "store", paths)
        row = dict(s)
        for k in ("t_start", "t_end"):
            row.pop(k, None)
        nbytes = s["gbps"] * s["us"] * 1e3
        row["us"], row["us_placements"] = m, ts
        row["gbps"] = nbytes / (m * 1e3)
        row["fraction_of_copy"] = row["gbps"] / out["copy_gbps"]
        store.append(row)
    out["rows"], out["store"] = rows, store
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or any(a.startswith("-") for a in argv):
        print(__doc__.splitlines()[0], file=sys.stderr)
        print("usage: placements.py RUN1.json RUN2.json ...", file=sys.stderr)
        return 2
    try:
        runs = []
        for p in argv:
            with open(p) as f:
                runs.append(json.load(f))
        print(json.dumps(merge(runs, argv), indent=1))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
