#!/usr/bin/env python3
"""Protection cost and split 0's share, from `kvq bench decode --json` runs (scripts/gpu-protect).

    protect.py RUN.json [RUN.json ...]

Each run holds GQA decode rows with the keys format, batch, context, q_heads, kv_heads, head_dim, protect ("none" or
a policy such as "paper"), protect_chunks (the share of split 0's range that stood for the protected rows: 0 without
protection) and us. Rows of the same shape, policy and share across the runs are one series (its median is
printed). Per shape: the unprotected time ("-" where no run has it), then each (policy, share) series with its time
over the unprotected one; the fastest share of each policy is marked with `*`. A row without those keys or with a
time that is not a positive finite number is refused (exit status 1). Standard library only.
"""

import json
import math
import sys
from statistics import median

SHAPE = ("format", "batch", "context", "q_heads", "kv_heads", "head_dim")


def load(paths):
    """{shape: {(policy, share): [us, ...]}} over the runs' decode rows."""
    series = {}
    for path in paths:
        with open(path) as fh:
            doc = json.load(fh)
        rows = doc.get("rows")
        if not isinstance(rows, list):
            raise ValueError(f"{path}: no rows (not a `kvq bench decode --json` run)")
        for r in rows:
            missing = [k for k in SHAPE + ("protect", "protect_chunks", "us") if k not in r]
            if missing:
                raise ValueError(f"{path}: a row lacks {', '.join(missing)} (a run of a kvq without --protect-chunks?)")
            us = r["us"]
            if not isinstance(us, (int, float)) or not math.isfinite(us) or us <= 0:
                raise ValueError(f"{path}: {r['format']} batch {r['batch']} context {r['context']}: time {us!r}")
            key = (r["protect"], int(r["protect_chunks"]) if r["protect"] != "none" else 0)
            series.setdefault(tuple(r[k] for k in SHAPE), {}).setdefault(key, []).append(float(us))
    return series


def report(series, out):
    out.write("shape | none us | policy share: us (over none) ...   (* the fastest share of the policy)\n")
    for shape in sorted(series, key=lambda s: tuple(str(x) if isinstance(x, str) else f"{x:012d}" for x in s)):
        s = series[shape]
        base = median(s[("none", 0)]) if ("none", 0) in s else None
        meds = {k: median(v) for k, v in s.items() if k[0] != "none"}
        best = {}
        for (pol, share), t in meds.items():
            if pol not in best or t < meds[(pol, best[pol])]:
                best[pol] = share
        shares = {}
        for pol, _ in meds:
            shares[pol] = shares.get(pol, 0) + 1
        cells = [f"{pol} {share}: {t:.1f}" + (f" ({t / base:.3f}x)" if base else "") +
                 ("*" if best[pol] == share and shares[pol] > 1 else "") for (pol, share), t in sorted(meds.items())]
        name = f"{shape[0]} B={shape[1]} N={shape[2]} {shape[3]}/{shape[4]} d{shape[5]}"
        out.write(f"{name} | {f'{base:.1f}' if base else '-'} | " + "  ".join(cells) + "\n")


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(__doc__)
        return 0 if argv else 2
    try:
        report(load(argv), sys.stdout)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"protect.py: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
