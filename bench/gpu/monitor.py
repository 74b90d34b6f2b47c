#!/usr/bin/env python3
"""Summary of the GPU's clocks, power and clock-event reasons while scripts/gpu-bench ran.

scripts/gpu-bench samples `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,
temperature.gpu,clocks_event_reasons.active --format=csv,noheader,nounits -lms 50` during the peers and
`kvq bench decode` (and `kvq bench mla`). The same device code's compute-bound kernels measured up to 1.26x apart on
different H200 hosts with the same maximum SM clock, while SDPA-flash and the bf16 store agreed within ~2%
(bench/results/gpu-hosts-2026-12-01.md), so a result records what the GPU ran at: the SM clock over the busy samples
(those without the gpu_idle reason; where a sample has no reasons, a power draw of at least 40% of the limit; all
samples when none is busy), the highest power draw and temperature, and every clock-event reason that was active
(NVML's bits: a power cap or a thermal slowdown lowers the clocks under load).

With --rows, the JSON of `kvq bench decode` / `kvq bench mla` (rows with "t_start" / "t_end", host wall-clock
seconds) is matched against the samples' timestamps (the same host's local time): each row that ran below the
highest SM clock of the samples, or under a clock-event reason, is listed with its samples' clocks.

    python3 bench/gpu/monitor.py gpu-monitor.csv [--rows result.json ...] [--json]
"""
import argparse
import datetime
import json
import math
import statistics
import sys

# NVML clock-event reason bits (nvmlClocksEventReasons).
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
FIELDS = ("timestamp", "sm_mhz", "mem_mhz", "power_w", "limit_w", "temp_c", "reasons")


def _num(s):
    """A float, or None for nvidia-smi's '[N/A]' / '[Not Supported]' and anything else that does not parse."""
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def parse(lines):
    """Samples (dicts with FIELDS) of the CSV lines; lines that do not have the seven fields are skipped."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.strip().split(",")]
        if len(parts) != len(FIELDS):
            continue
        s = {"timestamp": parts[0]}
        for k, v in zip(FIELDS[1:6], parts[1:6]):
            s[k] = _num(v)
        try:
            s["reasons"] = int(parts[6], 16)
        except ValueError:
            s["reasons"] = None
        if s["sm_mhz"] is None:
            continue
        out.append(s)
    return out


def epoch(ts):
    """Seconds since the epoch of an nvidia-smi timestamp ('2026/12/01 12:45:47.783', local time), or None."""
    try:
        return datetime.datetime.strptime(ts.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def _reason_names(samples):
    """The clock-event reasons active in any of the samples, by NVML name (gpu_idle left out; bits NVML does not
    name as one hex number)."""
    bits = 0
    for s in samples:
        bits |= s["reasons"] or 0
    names = [n for b, n in sorted(REASONS.items()) if bits & b and n != "gpu_idle"]
    unknown = bits & ~sum(REASONS)
    if unknown:
        names.append(f"0x{unknown:x}")
    return names


def _label(row, store):
    keys = ("batch", "context", "q_heads", "heads", "protect", "tokens")
    return ("store " if store else "") + " ".join([row.get("format", "?")] + [f"{k}={row[k]}" for k in keys if k in row])


def per_row(samples, results):
    """For each timed row of the results (dicts loaded from kvq's JSON) with t_start / t_end: its label, the number of
    samples within its window, their SM clock min and median, and the clock-event reasons among them (_reason_names).
    Rows without samples in their window get None clocks."""
    timed = [(epoch(s["timestamp"]), s) for s in samples]
    out = []
    for res in results:
        for store, rows in ((False, res.get("rows", [])), (True, res.get("store", []))):
            for row in rows:
                t0, t1 = row.get("t_start"), row.get("t_end")
                if t0 is None or t1 is None:
                    continue
                inside = [s for t, s in timed if t is not None and t0 <= t <= t1]
                sm = sorted(s["sm_mhz"] for s in inside)
                out.append({"row": _label(row, store), "samples": len(inside),
                            "sm_mhz_min": sm[0] if sm else None, "sm_mhz_median": statistics.median(sm) if sm else None,
                            "clock_event_reasons": _reason_names(inside)})
    return out


def _busy(s):
    """A sample taken while the GPU ran work: NVML's gpu_idle reason clear; where the sample has no reasons, a power
    draw of at least 40% of the limit."""
    if s["reasons"] is not None:
        return not s["reasons"] & 0x1
    return s["power_w"] is not None and bool(s["limit_w"]) and s["power_w"] >= 0.4 * s["limit_w"]


def summary(samples):
    """The busy samples' SM clock (min, median, max), memory clock, peak power and temperature, the power limit, and
    the names of the clock-event reasons active in any busy sample (gpu_idle left out)."""
    if not samples:
        raise ValueError("no samples with an SM clock")
    busy = [s for s in samples if _busy(s)]
    use = busy or samples
    sm = sorted(s["sm_mhz"] for s in use)
    mem = [s["mem_mhz"] for s in use if s["mem_mhz"] is not None]
    pw = [s["power_w"] for s in samples if s["power_w"] is not None]
    lim = [s["limit_w"] for s in samples if s["limit_w"] is not None]
    tc = [s["temp_c"] for s in samples if s["temp_c"] is not None]
    return {
        "samples": len(samples),
        "busy_samples": len(busy),
        "sm_mhz_min": sm[0],
        "sm_mhz_median": statistics.median(sm),
        "sm_mhz_max": sm[-1],
        "mem_mhz_median": statistics.median(mem) if mem else None,
        "power_w_max": max(pw) if pw else None,
        "power_limit_w": max(lim) if lim else None,
        "temp_c_max": max(tc) if tc else None,
        "clock_event_reasons": _reason_names(use),
    }


def line(s):
    def f(x, spec=".0f"):
        return "-" if x is None else format(x, spec)
    return (f"GPU while benchmarking ({s['busy_samples']} of {s['samples']} samples busy): SM clock "
            f"{f(s['sm_mhz_min'])} / {f(s['sm_mhz_median'])} / {f(s['sm_mhz_max'])} MHz (min / median / max), memory "
            f"{f(s['mem_mhz_median'])} MHz, power up to {f(s['power_w_max'])} W of {f(s['power_limit_w'])} W, up to "
            f"{f(s['temp_c_max'])} C, clock-event reasons: {', '.join(s['clock_event_reasons']) or 'none'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="gpu-monitor.csv of scripts/gpu-bench")
    ap.add_argument("--rows", nargs="+", default=[], metavar="JSON", help="kvq bench results with row time windows")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    with open(args.csv) as fh:
        samples = parse(fh)
    try:
        s = summary(samples)
    except ValueError as e:
        print(f"monitor.py: {args.csv}: {e}", file=sys.stderr)
        return 1
    rows = None
    if args.rows:
        results = []
        for path in args.rows:
            with open(path) as fh:
                results.append(json.load(fh))
        rows = per_row(samples, results)
    if args.json:
        print(json.dumps({**s, "rows": rows} if rows is not None else s))
        return 0
    print(line(s))
    if rows is not None:
        top = s["sm_mhz_max"]
        low = [r for r in rows if r["samples"] and (r["sm_mhz_min"] < top or r["clock_event_reasons"])]
        print(f"rows with samples: {sum(1 for r in rows if r['samples'])} of {len(rows)}; below {top:.0f} MHz or under "
              f"a clock-event reason: {len(low)}")
        for r in low:
            print(f"  {r['row']}: {r['samples']} samples, SM clock {r['sm_mhz_min']:.0f} / {r['sm_mhz_median']:.0f} MHz "
                  f"(min / median), reasons: {', '.join(r['clock_event_reasons']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
