"""Tests of bench/gpu/protect.py (the table of scripts/gpu-protect) and of the script's refusals before it builds.

The table must group rows by shape, policy and share across runs (the median of each series), give each share's time
over the unprotected one, mark the fastest share of a policy, and refuse rows without the keys it needs or with a time
that is not a positive finite number.
"""

import importlib.util
import io
import json
import os
import subprocess

import pytest

ROOT = os.environ.get("KVQ_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
_spec = importlib.util.spec_from_file_location("protect", os.path.join(ROOT, "bench", "gpu", "protect.py"))
protect = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(protect)


def run_json(path, rows):
    """A `kvq bench decode --json` file; rows: (format, protect, protect_chunks, us) at batch 8, 16K, 32 / 8, d128."""
    doc = {"gpu": "test", "rows": [{"format": f, "batch": 8, "context": 16384, "q_heads": 32, "kv_heads": 8,
                                    "head_dim": 128, "protect": p, "protect_chunks": s, "us": us}
                                   for f, p, s, us in rows]}
    with open(path, "w") as fh:
        json.dump(doc, fh)
    return str(path)


def table(paths):
    out = io.StringIO()
    protect.report(protect.load(paths), out)
    return out.getvalue().splitlines()


def test_medians_ratios_and_the_fastest_share(tmp_path):
    runs = [run_json(tmp_path / f"r{i}.json", [("tq-4bit-nc", "none", 0, none), ("tq-4bit-nc", "paper", 132, d),
                                               ("tq-4bit-nc", "paper", 22, s22)])
            for i, (none, d, s22) in enumerate(((50.0, 60.0, 70.0), (52.0, 61.0, 66.0), (54.0, 65.0, 68.0)))]
    lines = table(runs)
    assert len(lines) == 2
    row = lines[1]
    assert row.startswith("tq-4bit-nc B=8 N=16384 32/8 d128 | 52.0 |")
    # medians: none 52, share 132 61, share 22 68; 61 / 52 = 1.173, 68 / 52 = 1.308; 132 is the fastest
    assert "paper 22: 68.0 (1.308x)" in row and "paper 132: 61.0 (1.173x)*" in row
    assert "paper 22: 68.0 (1.308x)*" not in row


def test_a_single_share_is_not_marked_and_a_missing_baseline_prints_a_dash(tmp_path):
    one = run_json(tmp_path / "one.json", [("tq-3bit", "none", 0, 40.0), ("tq-3bit", "paper", 132, 50.0)])
    assert table([one])[1].endswith("paper 132: 50.0 (1.250x)")
    bare = run_json(tmp_path / "bare.json", [("tq-3bit", "paper", 22, 55.0), ("tq-3bit", "paper", 132, 50.0)])
    row = table([bare])[1]
    assert "| - |" in row and "paper 132: 50.0*" in row and "x)" not in row


def test_shapes_and_policies_are_kept_apart(tmp_path):
    path = tmp_path / "r.json"
    doc = {"rows": [{"format": "tq-3bit", "batch": b, "context": 16384, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
                     "protect": p, "protect_chunks": s, "us": us}
                    for b, p, s, us in ((8, "none", 0, 40.0), (32, "none", 0, 150.0), (8, "paper", 132, 50.0),
                                        (32, "paper", 132, 180.0))]}
    path.write_text(json.dumps(doc))
    lines = table([str(path)])
    assert len(lines) == 3
    assert lines[1].startswith("tq-3bit B=8 ") and "(1.250x)" in lines[1]
    assert lines[2].startswith("tq-3bit B=32 ") and "(1.200x)" in lines[2]


@pytest.mark.parametrize("us", [float("nan"), float("inf"), 0.0, -3.0, "12"])
def test_refuses_times_that_are_not_positive_finite(tmp_path, us):
    bad = run_json(tmp_path / "bad.json", [("tq-3bit", "none", 0, 40.0), ("tq-3bit", "paper", 132, us)])
    with pytest.raises(ValueError, match="time"):
        protect.load([bad])
    assert protect.main([bad]) == 1


def test_refuses_rows_without_the_share(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"rows": [{"format": "tq-3bit", "batch": 8, "context": 16384, "q_heads": 32,
                                         "kv_heads": 8, "head_dim": 128, "protect": "paper", "us": 50.0}]}))
    with pytest.raises(ValueError, match="protect_chunks"):
        protect.load([str(old)])
    notrun = tmp_path / "x.json"
    notrun.write_text("{}")
    with pytest.raises(ValueError, match="no rows"):
        protect.load([str(notrun)])
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert protect.main([str(broken)]) == 1
    assert protect.main([str(tmp_path / "missing.json")]) == 1
    assert protect.main([]) == 2


def _script(*args):
    return subprocess.run([os.path.join(ROOT, "scripts", "gpu-protect"), *args], capture_output=True, text=True,
                          timeout=60)


def test_script_refuses_bad_options_before_building():
    r = _script("--protect", "paper")
    assert r.returncode == 2 and "sets --protect itself" in r.stderr
    r = _script("--protect-chunks=4")
    assert r.returncode == 2 and "sets --protect-chunks=4 itself" in r.stderr
    r = _script("--shares", "22 x")
    assert r.returncode == 2 and "chunk counts >= 0, not 'x'" in r.stderr
    r = _script("--shares", "-1")
    assert r.returncode == 2 and "not '-1'" in r.stderr
    r = _script("--policy", "none")
    assert r.returncode == 2 and "protection policy" in r.stderr
    r = _script("--rounds", "0")
    assert r.returncode == 2 and "positive integer" in r.stderr
