"""Tests of bench/gpu/monitor.py: the summary of the nvidia-smi samples that scripts/gpu-bench records."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.environ.get("KVQ_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
_path = os.path.join(ROOT, "bench", "gpu", "monitor.py")
_spec = importlib.util.spec_from_file_location("monitor", _path)
monitor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(monitor)

# timestamp, SM MHz, memory MHz, power W, power limit W, temperature C, clock-event reasons
LINES = [
    "2026/12/01 12:00:00.000, 1980, 3201, 90.10, 700.00, 31, 0x0000000000000001",   # idle
    "2026/12/01 12:00:00.100, 1755, 3201, 640.50, 700.00, 52, 0x0000000000000004",  # busy, power cap
    "2026/12/01 12:00:00.200, 1800, 3201, 610.00, 700.00, 55, 0x0000000000000000",  # busy
    "2026/12/01 12:00:00.300, 1710, 3201, 655.20, 700.00, 57, 0x0000000000000024",  # busy, power cap + sw thermal
    "2026/12/01 12:00:00.400, [N/A], 3201, 100.00, 700.00, 40, 0x0",                # no SM clock: skipped
    "garbage line",
]


def test_busy_samples_set_the_clock_and_reasons():
    s = monitor.summary(monitor.parse(LINES))
    assert s["samples"] == 4 and s["busy_samples"] == 3
    assert (s["sm_mhz_min"], s["sm_mhz_median"], s["sm_mhz_max"]) == (1710, 1755, 1800)
    assert s["mem_mhz_median"] == 3201 and s["power_w_max"] == 655.2 and s["power_limit_w"] == 700
    assert s["temp_c_max"] == 57
    assert s["clock_event_reasons"] == ["sw_power_cap", "sw_thermal_slowdown"]  # the idle bit is left out
    assert "1710 / 1755 / 1800 MHz" in monitor.line(s) and "sw_power_cap" in monitor.line(s)


def test_busy_by_the_idle_bit_else_by_power_and_unknown_bits_are_shown():
    # The idle bit decides where a sample has reasons (a short, low-power run still counts); power otherwise.
    lines = ["t, 345, 3201, 80.0, 700.0, 30, 0x1",          # idle
             "t, 1965, 3201, 120.0, 700.0, 30, 0x10000",    # busy at low power, an unknown bit
             "t, 1950, 3201, 500.0, 700.0, 30, [N/A]",      # no reasons: busy by power
             "t, 1800, 3201, 100.0, 700.0, 30, [N/A]"]      # no reasons, low power: not busy
    s = monitor.summary(monitor.parse(lines))
    assert s["busy_samples"] == 2 and s["samples"] == 4 and (s["sm_mhz_min"], s["sm_mhz_max"]) == (1950, 1965)
    assert s["clock_event_reasons"] == ["0x10000"]
    assert "reasons: 0x10000" in monitor.line(s)
    s = monitor.summary(monitor.parse(["t, 345, 3201, 80.0, 700.0, 30, 0x1", "t, 1980, 3201, 90.0, 700.0, 30, 0x1"]))
    assert s["busy_samples"] == 0 and (s["sm_mhz_min"], s["sm_mhz_max"]) == (345, 1980)  # none busy: all samples


def test_no_samples_is_an_error(tmp_path):
    with pytest.raises(ValueError):
        monitor.summary(monitor.parse(["", "[N/A], [N/A]"]))
    empty = tmp_path / "m.csv"
    empty.write_text("nothing useful\n")
    r = subprocess.run([sys.executable, _path, str(empty)], capture_output=True, text=True)
    assert r.returncode == 1 and "no samples" in r.stderr
    good = tmp_path / "g.csv"
    good.write_text("\n".join(LINES) + "\n")
    r = subprocess.run([sys.executable, _path, str(good), "--json"], capture_output=True, text=True, check=True)
    assert json.loads(r.stdout)["sm_mhz_median"] == 1755


def _ts(t):
    import datetime
    return datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_rows_are_matched_to_their_samples_by_time(tmp_path):
    t = 1_800_000_000.0
    lines = [f"{_ts(t + 0.1 * i)}, {mhz}, 3201, 600.0, 700.0, 50, {bits}"
             for i, (mhz, bits) in enumerate([(1980, "0x0"), (1980, "0x0"), (1980, "0x0"), (1755, "0x4"), (1830, "0x4"),
                                              (1980, "0x0"), (1980, "0x1")])]
    samples = monitor.parse(lines)
    res = {"rows": [{"format": "tq-4bit-nc", "batch": 8, "context": 16384, "q_heads": 32, "us": 46.0,
                     "t_start": t - 0.01, "t_end": t + 0.15},                       # samples 0, 1
                    {"format": "tq-3bit", "batch": 8, "context": 65536, "q_heads": 32, "us": 158.0,
                     "t_start": t + 0.25, "t_end": t + 0.45},                       # samples 3, 4
                    {"format": "tq-3bit", "batch": 32, "context": 65536, "q_heads": 32, "us": 570.0,
                     "t_start": t + 5.0, "t_end": t + 6.0},                         # none
                    {"format": "bf16", "batch": 8, "context": 4096, "us": 48.0}],  # not timed: left out
           "store": [{"format": "tq-3bit", "tokens": 65536, "us": 220.0, "t_start": t + 0.35, "t_end": t + 0.65}]}
    rows = {r["row"]: r for r in monitor.per_row(samples, [res])}
    assert len(rows) == 4
    a = rows["tq-4bit-nc batch=8 context=16384 q_heads=32"]
    assert a["samples"] == 2 and a["sm_mhz_min"] == 1980 and a["clock_event_reasons"] == []
    b = rows["tq-3bit batch=8 context=65536 q_heads=32"]
    assert (b["samples"], b["sm_mhz_min"], b["sm_mhz_median"]) == (2, 1755, 1792.5)
    assert b["clock_event_reasons"] == ["sw_power_cap"]
    assert rows["tq-3bit batch=32 context=65536 q_heads=32"]["sm_mhz_min"] is None
    st = rows["store tq-3bit tokens=65536"]
    assert (st["samples"], st["sm_mhz_min"]) == (3, 1830) and st["clock_event_reasons"] == ["sw_power_cap"]
    csv, js = tmp_path / "m.csv", tmp_path / "r.json"
    csv.write_text("\n".join(lines) + "\n")
    js.write_text(json.dumps(res))
    out = subprocess.run([sys.executable, _path, str(csv), "--rows", str(js)], capture_output=True, text=True,
                         check=True).stdout
    assert "rows with samples: 3 of 4; below 1980 MHz or under a clock-event reason: 2" in out
    assert "tq-3bit batch=8 context=65536 q_heads=32: 2 samples, SM clock 1755 / 1792 MHz" in out
    # Bits NVML does not name are listed per row as in the summary.
    odd = monitor.parse([f"{_ts(t + 0.1)}, 1965, 3201, 600.0, 700.0, 50, 0x10004"])
    assert monitor.per_row(odd, [res])[0]["clock_event_reasons"] == ["sw_power_cap", "0x10000"]
    r = subprocess.run([sys.executable, _path, str(csv), "--rows"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr


FAKE_SMI = """#!/bin/sh
# A stand-in for nvidia-smi: records its arguments; the one-shot probe of clocks_event_reasons fails when
# FAKE_OLD_DRIVER is set; the sampling call (-lms) prints one sample line and sleeps until it is killed.
echo "$@" >> "$FAKE_LOG"
case "$*" in
  *clocks_event_reasons.active*--format=csv,noheader) [ -n "$FAKE_OLD_DRIVER" ] && exit 6; echo 0x0; exit 0 ;;
esac
echo "2026/12/01 12:00:00.000, 1980, 3201, 600.00, 700.00, 50, 0x0000000000000004"
exec sleep 30
"""


def _monitor(tmp_path, visible, old_driver=False):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    log, csv = tmp_path / "smi.log", tmp_path / "m.csv"
    log.write_text("")
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", FAKE_LOG=str(log))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if old_driver:
        env["FAKE_OLD_DRIVER"] = "1"
    lib = os.path.join(ROOT, "scripts", "lib", "gpu.sh")
    subprocess.run(["bash", "-c", f'. "{lib}"; kvq_monitor_start "{csv}"; sleep 0.5; kvq_monitor_stop; '
                    'kvq_monitor_stop; [ -z "$kvq_monitor_pid" ]'], env=env, check=True, timeout=20)
    calls = log.read_text().splitlines()
    return [c for c in calls if "-lms" in c], csv.read_text()


def test_gpu_bench_samples_the_benchmarked_gpu_until_stopped(tmp_path):
    # kvq_monitor_start / kvq_monitor_stop (scripts/lib/gpu.sh), which scripts/gpu-bench runs around the benchmark.
    for visible, gpu in ((None, "0"), ("3", "3"), ("2,5", "2"), ("GPU-1234-abcd,GPU-ffff", "GPU-1234-abcd"), ("x", "0")):
        sampling, csv = _monitor(tmp_path, visible)
        assert len(sampling) == 1 and sampling[0].startswith(f"-i {gpu} "), (visible, sampling)
        assert "clocks_event_reasons.active" in sampling[0] and "-lms 50" in sampling[0]
        s = monitor.summary(monitor.parse(csv.splitlines()))
        assert s["samples"] == 1 and s["clock_event_reasons"] == ["sw_power_cap"]
    sampling, _ = _monitor(tmp_path, None, old_driver=True)
    assert "clocks_throttle_reasons.active" in sampling[0] and "clocks_event_reasons" not in sampling[0]
    script = open(os.path.join(ROOT, "scripts", "gpu-bench")).read()
    assert 'kvq_monitor_start "$out/gpu-monitor.csv"' in script and "trap kvq_monitor_stop EXIT" in script
