"""Tests of bench/gpu/placements.py: one decode grid from runs at several arena pads.

The merge must take each row's median over the runs (peers too), recompute GB/s and the speedups from the medians,
keep every run's time, and refuse runs of different grids, GPUs or methods, repeated pads and bad times.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.environ.get("KVQ_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
_spec = importlib.util.spec_from_file_location("placements", os.path.join(ROOT, "bench", "gpu", "placements.py"))
pl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pl)


def grid(pad, ours, flash, vllm, store_us, copy=4000.0):
    """A `kvq bench decode --json --peers` result: tq-4bit-nc and bf16 at 8 x 16K, their peers, one store row."""
    def row(fmt, us, nbytes, pair):
        return {"format": fmt, "batch": 8, "context": 16384, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
                "us": us, "gbps": nbytes / (us * 1e3), "bytes": nbytes, "vllm_pair": pair,
                "speedup_vs_bf16_flash": flash / us, "speedup_vs_vllm_triton": None if pair is None else vllm / us,
                "compression_vs_bf16": 3.82 if pair else 1.0, "kernel": "fast", "t_start": 1.0, "t_end": 2.0}

    def peer(impl, us):
        return {"format": "peer:" + impl, "batch": 8, "context": 16384, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
                "us": us, "gbps": None, "speedup_vs_bf16_flash": None, "speedup_vs_vllm_triton": None}
    rows = [row("tq-4bit-nc", ours, 1.4e8, "tq-4bit-nc"), row("bf16", 4 * ours, 5.4e8, None),
            peer("sdpa_flash", flash), peer("vllm_triton:tq-4bit-nc", vllm), peer("vllm_triton:tq-3bit-nc", None)]
    store = [{"format": "tq-4bit-nc", "tokens": 1024, "kv_heads": 8, "head_dim": 128, "us": store_us,
              "gbps": 2.6e6 / (store_us * 1e3), "fraction_of_copy": 2.6e6 / (store_us * 1e3) / copy}]
    return {"gpu": "NVIDIA H200", "commit": "abc", "flush": "read", "gap_ms": 300, "pages": "random", "seed": 7,
            "sms": 132, "l2_bytes": 62914560, "copy_gbps": copy, "arena_pad_mib": pad, "peers": {"torch": "x"},
            "command": "scripts/gpu-bench", "rows": rows, "store": store}


def three():
    return [grid(0, 44.0, 130.0, 600.0, 9.0, 4200.0), grid(16, 42.0, 128.0, 640.0, 9.5, 4300.0),
            grid(1024, 43.0, 131.0, 610.0, 8.8, 4250.0)]


def test_medians_and_speedups_from_the_medians():
    out = pl.merge(three(), ["a", "b", "c"])
    assert [x["arena_pad_mib"] for x in out["placements"]] == [0, 16, 1024]
    assert out["placements"][0]["command"] == "scripts/gpu-bench"
    assert out["copy_gbps"] == 4250.0 and out["copy_gbps_placements"] == [4200.0, 4300.0, 4250.0]
    by = {r["format"]: r for r in out["rows"]}
    t = by["tq-4bit-nc"]
    assert t["us"] == 43.0 and t["us_placements"] == [44.0, 42.0, 43.0]
    assert t["gbps"] == pytest.approx(1.4e8 / 43.0e3)
    # Flash's median (130.0) and vLLM's (610.0) over ours (43.0), not the median of the runs' ratios.
    assert t["speedup_vs_bf16_flash"] == pytest.approx(130.0 / 43.0)
    assert t["speedup_vs_vllm_triton"] == pytest.approx(610.0 / 43.0)
    assert "t_start" not in t and "t_end" not in t and t["kernel"] == "fast"
    assert by["bf16"]["us"] == 172.0 and by["bf16"]["speedup_vs_vllm_triton"] is None
    assert by["peer:sdpa_flash"]["us"] == 130.0 and by["peer:sdpa_flash"]["us_placements"] == [130.0, 128.0, 131.0]
    assert by["peer:vllm_triton:tq-3bit-nc"]["us"] is None  # not run in any placement
    s = out["store"][0]
    assert s["us"] == 9.0 and s["us_placements"] == [9.0, 9.5, 8.8]
    assert s["gbps"] == pytest.approx(2.6e6 / 9.0e3)
    assert s["fraction_of_copy"] == pytest.approx(2.6e6 / 9.0e3 / 4250.0)
    assert out["gpu"] == "NVIDIA H200" and out["commit"] == "abc" and out["arena_pad_mib"] is None


def test_host_fields():
    # Runs of kvq bench decode since the sixtieth session name the GPU by its UUID and the driver's CUDA version.
    runs = three()
    for r in runs:
        r["gpu_uuid"], r["cuda_driver"] = "GPU-1", 13000
    out = pl.merge(runs, ["a", "b", "c"])
    assert out["gpu_uuid"] == "GPU-1" and out["cuda_driver"] == 13000
    assert "gpu_uuid" not in pl.merge(three(), ["a", "b", "c"])  # older runs merge as before
    for key, other in (("gpu_uuid", "GPU-2"), ("cuda_driver", 12080)):
        bad = [dict(r) for r in runs]
        bad[1][key] = other
        with pytest.raises(ValueError, match=f"b: {key}"):
            pl.merge(bad, ["a", "b", "c"])
    bad = [dict(r) for r in runs]
    del bad[2]["gpu_uuid"]  # one run without it: not the same host, as far as the files say
    with pytest.raises(ValueError, match="c: gpu_uuid"):
        pl.merge(bad, ["a", "b", "c"])


def test_refusals():
    def refused(runs, msg):
        with pytest.raises(ValueError, match=msg):
            pl.merge(runs, [f"r{i}" for i in range(len(runs))])
    refused(three()[:1], "at least two runs")
    runs = three()
    runs[1]["gpu"] = "NVIDIA H100 80GB HBM3"
    refused(runs, "r1: gpu")
    runs = three()
    runs[2]["flush"] = "write"
    refused(runs, "r2: flush")
    runs = three()
    runs[1]["arena_pad_mib"] = 0
    refused(runs, "same arena pad")
    runs = three()
    runs[2]["rows"] = runs[2]["rows"][1:]
    refused(runs, "other rows")
    runs = three()
    runs[1]["store"][0]["tokens"] = 2048
    refused(runs, "other store rows")
    for bad in (float("nan"), float("inf"), 0.0, -1.0, "44"):
        runs = three()
        runs[1]["rows"][0]["us"] = bad
        refused(runs, "not a positive finite number")
    runs = three()
    runs[1]["rows"][3]["us"] = None  # a peer measured in some placements only
    refused(runs, "in some runs only")
    runs = three()
    for r in runs:
        r["rows"][0]["us"] = None  # one of ours with no time anywhere
    refused(runs, "no time")


def test_command_line(tmp_path):
    paths = []
    for i, r in enumerate(three()):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    script = os.path.join(ROOT, "bench", "gpu", "placements.py")
    ok = subprocess.run([sys.executable, script, *paths], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["rows"][0]["us"] == 43.0
    (tmp_path / "bad.json").write_text("{not json")
    bad = subprocess.run([sys.executable, script, paths[0], str(tmp_path / "bad.json")], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error:")
    missing = subprocess.run([sys.executable, script, paths[0], str(tmp_path / "none.json")], capture_output=True,
                             text=True)
    assert missing.returncode == 1 and "none.json" in missing.stderr
    usage = subprocess.run([sys.executable, script, paths[0]], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_gpu_bench_runs_the_grid_per_pad_and_merges(tmp_path):
    # scripts/gpu-bench in a scratch root whose peers.py and kvq are stubs that answer with grid() at their
    # --arena-pad (times that grow with the pad), so the driver's loop, arguments, merge and refusals run without a GPU.
    root = tmp_path / "root"
    for rel in ("scripts/gpu-bench", "scripts/lib/gpu.sh", "bench/gpu/placements.py", "bench/gpu/table.py",
                "bench/gpu/monitor.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(open(os.path.join(ROOT, rel)).read())
    stub = f'''import json, sys
sys.path.insert(0, {os.path.join(ROOT, "python", "tests")!r})
from test_placements import grid
a = sys.argv[1:]
pad = int(a[a.index("--arena-pad") + 1]) if "--arena-pad" in a else 0
with open({str(tmp_path / "calls.txt")!r}, "a") as f:
    f.write(" ".join(a) + "\\n")
g = grid(pad, 40.0 + pad / 8, 130.0 + pad / 64, 600.0, 9.0)
if "--arena-pad" not in a:
    del g["arena_pad_mib"]
if sys.argv[0].endswith("peers.py"):
    g = {{"versions": {{}}, "flush": "read", "gap_ms": 300, "arena_pad_mib": pad, "rows": []}}
print(json.dumps(g))
'''
    (root / "bench/gpu/peers.py").write_text(stub)
    kvq = tmp_path / "build" / "tools" / "kvq" / "kvq"
    kvq.parent.mkdir(parents=True)
    kvq.write_text(f"#!/bin/sh\nexec {sys.executable} {root / 'bench/gpu/peers.py'}.kvq \"$@\"\n")
    kvq.chmod(0o755)
    (root / "bench/gpu/peers.py.kvq").write_text(stub)
    env = {k: v for k, v in os.environ.items() if k not in ("KVQ_PADS", "KVQ_BENCH_MLA")}
    env.update(KVQ_BUILD_DIR=str(tmp_path / "build"), PATH=os.path.dirname(sys.executable) + ":/usr/bin:/bin",
               GIT_CEILING_DIRECTORIES=str(tmp_path))  # the scratch root is no checkout, whatever holds tmp_path

    def bench(out, *args, **extra):
        e = dict(env, KVQ_BENCH_OUT=str(tmp_path / out), **extra)
        return subprocess.run(["bash", str(root / "scripts/gpu-bench"), *args], env=e, capture_output=True, text=True,
                              timeout=120)
    # "016" is 16: the driver passes pads without leading zeros, one directory per pad.
    r = bench("merged", "--batch", "8", KVQ_PADS="0 016 1024")
    assert r.returncode == 0, r.stderr
    merged = json.loads((tmp_path / "merged" / "decode-gqa.json").read_text())
    t = {x["format"]: x for x in merged["rows"]}["tq-4bit-nc"]
    assert t["us_placements"] == [40.0, 42.0, 168.0] and t["us"] == 42.0
    assert [x["arena_pad_mib"] for x in merged["placements"]] == [0, 16, 1024]
    for pad in (0, 16, 1024):
        assert (tmp_path / "merged" / f"pad{pad}" / "decode-gqa.json").exists()
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    # Per pad the peers, then kvq, both with the run's arguments and that pad.
    assert len(calls) == 6 and all("--batch 8" in c for c in calls)
    assert [c.split("--arena-pad ")[1].split()[0] for c in calls] == ["0", "0", "16", "16", "1024", "1024"]
    assert "| tq-4bit-nc | 8 | 16384 | 42.0 |" in r.stdout
    # Without KVQ_PADS: one run, no pad passed, as before.
    (tmp_path / "calls.txt").unlink()
    r = bench("one", "--batch", "8")
    assert r.returncode == 0, r.stderr
    assert not any("--arena-pad" in c for c in (tmp_path / "calls.txt").read_text().splitlines())
    # The commit kvq records: the scratch root is no git checkout, so "unknown" unless KVQ_COMMIT names one.
    kvq_calls = [c for c in (tmp_path / "calls.txt").read_text().splitlines() if "--commit" in c]
    assert len(kvq_calls) == 1 and "--commit unknown" in kvq_calls[0]
    (tmp_path / "calls.txt").unlink()
    r = bench("named", "--batch", "8", KVQ_COMMIT="0123abcd")
    assert r.returncode == 0, r.stderr
    assert "--commit 0123abcd " in (tmp_path / "calls.txt").read_text()
    assert json.loads((tmp_path / "one" / "decode-gqa.json").read_text())["rows"][0]["us"] == 40.0
    # Refusals before anything runs.
    (tmp_path / "calls.txt").unlink()
    for pads, args, msg in (("0 16", ("--arena-pad", "4"), "do not pass it too"), ("16", (), "at least two pads"),
                            ("0 1G", (), "not a whole number"), ("0 16 016", (), "repeats a pad")):
        r = bench("bad", *args, KVQ_PADS=pads)
        assert r.returncode == 1 and msg in r.stderr, (pads, r.stderr)
    assert not (tmp_path / "calls.txt").exists()


def test_rows_of_each_protection_merge_apart():
    # kvq bench decode --protect none,paper: the same (format, batch, context) once per policy; each merges alone.
    runs = three()
    for r, paper_us in zip(runs, (61.0, 59.0, 60.0)):
        for x in r["rows"]:
            if not x["format"].startswith("peer:"):
                x["protect"] = "none"
        paper = dict(r["rows"][0])
        paper["protect"], paper["us"] = "paper", paper_us
        r["rows"].insert(1, paper)
    out = pl.merge(runs, ["a", "b", "c"])
    by = {(x["format"], x.get("protect")): x for x in out["rows"]}
    assert by[("tq-4bit-nc", "none")]["us"] == 43.0 and by[("tq-4bit-nc", "paper")]["us"] == 60.0
    assert by[("tq-4bit-nc", "paper")]["speedup_vs_bf16_flash"] == pytest.approx(130.0 / 60.0)
    # A run whose rows lack one policy's row is another grid.
    runs[2]["rows"].pop(1)
    with pytest.raises(ValueError, match="other rows"):
        pl.merge(runs, ["a", "b", "c"])
