"""Tests of bench/gpu/ab.py (the report of scripts/gpu-ab) and of the script's refusals before it builds.

The report must pair rows across runs (GQA decode rows, MLA rows, store rows), give A's time over B's of the minima
and of the medians, and refuse runs whose rows differ or repeat, or whose times are not positive finite numbers.
"""

import importlib.util
import io
import json
import math
import os
import signal
import subprocess

import pytest

ROOT = os.environ.get("KVQ_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
_spec = importlib.util.spec_from_file_location("ab", os.path.join(ROOT, "bench", "gpu", "ab.py"))
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def run_json(path, decode_us, store_us=None, uuid=None):
    """A `kvq bench decode --json` file with the given times per format (batch 8, 16K, 32 / 8 heads, d128)."""
    rows = [{"format": f, "batch": 8, "context": 16384, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "us": us,
             "gbps": 1.0, "splits": 2} for f, us in decode_us.items()]
    store = [{"format": f, "tokens": 1024, "kv_heads": 8, "head_dim": 128, "us": us} for f, us in (store_us or {}).items()]
    with open(path, "w") as fh:
        doc = {"gpu": "test", "commit": "x", "copy_gbps": 1.0, "rows": rows, "store": store}
        if uuid is not None:
            doc["gpu_uuid"] = uuid
        json.dump(doc, fh)
    return str(path)


def test_ratios_of_minima_and_medians(tmp_path):
    a = [run_json(tmp_path / f"a{i}.json", {"tq-4bit-nc": t, "tq-3bit": 2 * t}, {"tq-4bit-nc": 10.0 + i})
         for i, t in enumerate((50.0, 40.0, 45.0))]
    b = [run_json(tmp_path / f"b{i}.json", {"tq-4bit-nc": t, "tq-3bit": 100.0}, {"tq-4bit-nc": 20.0})
         for i, t in enumerate((39.0, 41.0, 38.0))]
    rows = ab.compare([ab.load(p) for p in a], [ab.load(p) for p in b])
    by = {k[1] if k[0] == "decode" else "store " + k[1]: r for k, *r in rows}
    a4, b4, rmin, rmed = by["tq-4bit-nc"]
    assert a4 == [40.0, 45.0, 50.0] and b4 == [38.0, 39.0, 41.0]
    assert rmin == pytest.approx(40.0 / 38.0) and rmed == pytest.approx(45.0 / 39.0)
    assert by["tq-3bit"][2] == pytest.approx(0.8) and by["tq-3bit"][3] == pytest.approx(0.9)
    assert by["store tq-4bit-nc"][2] == pytest.approx(0.5) and by["store tq-4bit-nc"][3] == pytest.approx(11.0 / 20.0)
    # Even counts take the mean of the middle two.
    assert ab.median([1.0, 4.0, 2.0, 3.0]) == 2.5
    out = io.StringIO()
    ab.report(rows, out)
    text = out.getvalue()
    assert "tq-4bit-nc B=8 N=16384 32/8 d128" in text and "1.053  1.154" in text
    assert "store tq-4bit-nc 1024x8 d128" in text


def test_note_when_the_runs_come_from_several_gpus(tmp_path, capsys):
    same = [run_json(tmp_path / f"s{i}.json", {"tq-4bit-nc": 40.0}, uuid="GPU-a") for i in range(2)]
    uuid = lambda paths: [ab.read_run(p)[1] for p in paths]  # noqa: E731
    assert ab.host_note(uuid(same[:1]), uuid(same[1:])) is None
    old = run_json(tmp_path / "old.json", {"tq-4bit-nc": 40.0})  # no UUID recorded
    assert ab.host_note(uuid([old]), uuid(same[:1])) is None
    other = run_json(tmp_path / "o.json", {"tq-4bit-nc": 39.0}, uuid="GPU-b")
    assert ab.host_note(uuid(same), uuid([other])) == "note: the runs come from more than one GPU (A: GPU-a; B: GPU-b)"
    assert ab.main(["--a", *same, "--b", other]) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: the runs come from more than one GPU") and "tq-4bit-nc" in out
    assert ab.main(["--a", same[0], "--b", same[1]]) == 0
    assert "note:" not in capsys.readouterr().out


def test_refuses_other_rows_and_bad_times(tmp_path):
    a = run_json(tmp_path / "a.json", {"tq-4bit-nc": 40.0, "tq-3bit": 50.0})
    b = run_json(tmp_path / "b.json", {"tq-4bit-nc": 40.0})
    with pytest.raises(ValueError, match="run 1 of B has other rows"):
        ab.compare([ab.load(a)], [ab.load(b)])
    for bad in (float("nan"), 0.0, -1.0, None, "fast"):
        p = tmp_path / "bad.json"
        run_json(p, {"tq-4bit-nc": 40.0})
        d = json.load(open(p))
        d["rows"][0]["us"] = bad if not (isinstance(bad, float) and math.isnan(bad)) else "NaN"
        with open(p, "w") as fh:
            fh.write(json.dumps(d).replace('"NaN"', "NaN"))
        with pytest.raises(ValueError, match="no valid time"):
            ab.load(str(p))
    p = tmp_path / "empty.json"
    with open(p, "w") as fh:
        json.dump({"rows": []}, fh)
    with pytest.raises(ValueError, match="no rows"):
        ab.load(str(p))
    # The command line reports the error and exits 1 instead of a traceback.
    assert ab.main(["--a", a, "--b", b]) == 1
    assert ab.main(["--a", a, "--b", str(tmp_path / "missing.json")]) == 1


def test_mla_rows(tmp_path):
    """`kvq bench mla` rows: heads and protection policy identify a row, the kernel a launch took does not."""
    def mla(path, us, kernel):
        rows = [{"format": "c4r4", "batch": 8, "context": 32768, "heads": 16, "protect": pr, "kernel": kernel, "us": t}
                for pr, t in (("none", us), ("paper", us + 1.0))]
        with open(path, "w") as fh:
            json.dump({"rows": rows, "store": [{"format": "c4r4", "tokens": 1048576, "us": 100.0}]}, fh)
        return str(path)

    rows = ab.compare([ab.load(mla(tmp_path / "a.json", 20.0, "fragment"))], [ab.load(mla(tmp_path / "b.json", 16.0, "wgmma"))])
    labels = {ab.label(k): (rmin, rmed) for k, _, _, rmin, rmed in rows}
    assert labels == {"c4r4 B=8 N=32768 h16": (1.25, 1.25), "c4r4 B=8 N=32768 h16 protect=paper": (21.0 / 17.0, 21.0 / 17.0),
                      "store c4r4 1048576": (1.0, 1.0)}
    # A row that appears twice in one run is refused.
    p = tmp_path / "twice.json"
    with open(p, "w") as fh:
        json.dump({"rows": [{"format": "c4r4", "batch": 8, "context": 4096, "heads": 16, "us": 1.0}] * 2}, fh)
    with pytest.raises(ValueError, match="appears twice"):
        ab.load(str(p))


def _script(tmp_path, *args):
    env = dict(os.environ, KVQ_AB_DIR=str(tmp_path / "ab"))
    return subprocess.run([os.path.join(ROOT, "scripts", "gpu-ab"), *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_script_refuses_missing_empty_and_foreign_patches(tmp_path):
    r = _script(tmp_path)
    assert r.returncode == 2 and "usage" in r.stderr
    r = _script(tmp_path, str(tmp_path / "none.patch"))
    assert r.returncode == 2 and "no patch" in r.stderr
    bad = tmp_path / "bad.patch"
    bad.write_text("--- a/no/such/file.cu\n+++ b/no/such/file.cu\n@@ -1 +1 @@\n-x\n+y\n")
    r = _script(tmp_path, str(bad), "--bench", "gemm")
    assert r.returncode == 2 and "--bench takes decode or mla" in r.stderr
    r = _script(tmp_path, str(bad), "--rounds")
    assert r.returncode == 2 and "--rounds needs a positive integer" in r.stderr
    for args, msg in ((("--pads", "0 1G"), "--pads holds '1G', not a whole number of MiB"),
                      (("--pads", ""), "--pads holds '', not a whole number of MiB"),
                      (("--bench", "mla", "--pads", "0 16"), "--pads is for --bench decode"),
                      (("--arena-pad", "16"), "not --arena-pad")):
        r = _script(tmp_path, str(bad), *args)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)
    r = _script(tmp_path, str(bad))
    assert r.returncode == 1 and "does not apply" in r.stderr
    assert not (tmp_path / "ab" / "build-a").exists()


def test_run_order_alternates_which_side_goes_first():
    # kvq_ab_order (scripts/lib/gpu.sh) orders gpu-ab's runs: A first in odd rounds, B first in even ones, so an
    # effect of the position within a round falls on both sides over an even number of rounds.
    lib = os.path.join(ROOT, "scripts", "lib", "gpu.sh")
    out = subprocess.run(["bash", "-c", f'. "{lib}"; for r in 1 2 3 4 5 6; do kvq_ab_order $r; done'],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:6] == ["a b", "b a"] * 3
    script = open(os.path.join(ROOT, "scripts", "gpu-ab")).read()
    assert 'for s in $(kvq_ab_order "$r"); do' in script and "rounds=4" in script


def test_tree_commit_marks_a_tree_that_differs_from_its_head(tmp_path):
    # kvq_tree_commit (scripts/lib/gpu.sh) names the commit of scripts/gpu-bench's results when KVQ_COMMIT is unset:
    # HEAD, "-dirty" where a tracked file differs from it (a GPU host's copy can carry an older .git than its files),
    # "unknown" outside a checkout.
    lib = os.path.join(ROOT, "scripts", "lib", "gpu.sh")

    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path.parent))  # no checkout above tmp_path counts

    def tree_commit():
        return subprocess.run(["bash", "-c", f'. "{lib}"; kvq_tree_commit "{tmp_path}"'], capture_output=True,
                              text=True, check=True, env=env).stdout.strip()

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    assert tree_commit() == "unknown"
    git("init", "-q")
    assert tree_commit() == "unknown"  # no commit yet
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert len(head) == 12 and tree_commit() == head
    (tmp_path / "new.txt").write_text("untracked\n")  # a file git does not track leaves the mark off
    assert tree_commit() == head
    (tmp_path / "a.txt").write_text("two\n")
    assert tree_commit() == head + "-dirty"
    git("add", "a.txt")  # staged but not committed: still not HEAD's tree
    assert tree_commit() == head + "-dirty"


def _fake_build(ab_dir, side, us):
    """A stand-in for gpu-ab's build of one side: a `kvq` that prints one decode row's JSON and records its arguments."""
    kvq = ab_dir / f"build-{side}" / "tools" / "kvq" / "kvq"
    kvq.parent.mkdir(parents=True)
    row = {"format": "tq-4bit", "batch": 8, "context": 16384, "q_heads": 64, "kv_heads": 8, "head_dim": 128, "us": us,
           "gbps": 1.0, "splits": 2}
    doc = json.dumps({"gpu": "test", "commit": "x", "copy_gbps": 1.0, "rows": [row], "store": []})
    kvq.write_text(f"#!/bin/sh\necho \"$@\" >> {ab_dir}/args-{side}\ncat <<'JSON'\n{doc}\nJSON\n")
    kvq.chmod(0o755)


def test_reuse_runs_the_builds_of_the_same_patch_and_rebuilds_for_another(tmp_path):
    # --reuse times other bench options on the builds an earlier call left for the same patch (no copy, no build);
    # with another patch, or without those builds, it goes the usual way (here: the patch does not apply).
    ab_dir = tmp_path / "ab"
    patch = tmp_path / "x.patch"
    patch.write_text("--- a/no/such/file.cu\n+++ b/no/such/file.cu\n@@ -1 +1 @@\n-x\n+y\n")
    _fake_build(ab_dir, "a", 50.0)
    _fake_build(ab_dir, "b", 40.0)
    (ab_dir / "patch").write_text(patch.read_text())
    r = _script(tmp_path, str(patch), "--reuse", "--rounds", "2", "--q-heads", "64", "--formats", "tq-4bit")
    assert r.returncode == 0, r.stderr
    assert "reusing the builds" in r.stdout
    assert "tq-4bit B=8 N=16384 64/8 d128" in r.stdout and "1.250  1.250" in r.stdout
    for side in "ab":
        calls = (ab_dir / f"args-{side}").read_text().splitlines()
        assert len(calls) == 2 and all("--q-heads 64" in c and "--json" in c for c in calls)
    assert not (ab_dir / "a").exists()  # no tree was copied
    # --pads: two rounds per pad (each side first once), the pad passed to both sides.
    for side in "ab":
        (ab_dir / f"args-{side}").unlink()
    r = _script(tmp_path, str(patch), "--reuse", "--rounds", "6", "--pads", "0 016 1024", "--formats", "tq-4bit")
    assert r.returncode == 0, r.stderr
    assert "6 rounds; arena pads 0 16 1024 MiB" in r.stdout
    for side in "ab":
        calls = (ab_dir / f"args-{side}").read_text().splitlines()
        assert [c.split("--arena-pad ")[1].split()[0] for c in calls] == ["0", "0", "16", "16", "1024", "1024"]
    other = tmp_path / "y.patch"
    other.write_text(patch.read_text().replace("+y", "+z"))
    r = _script(tmp_path, str(other), "--reuse")
    assert r.returncode == 1 and "does not apply" in r.stderr and "reusing" not in r.stdout
    # A call that builds removes the recorded patch first, so builds it did not finish are never reused.
    assert not (ab_dir / "patch").exists()


def test_variants_table_of_a_variants_sh_directory(tmp_path):
    # Two rounds of variants 0, 4 and 8 (bench/gpu/variants.sh's file names), in the files' round order.
    times = {0: ((50.0, 30.0), (48.0, 31.0)), 4: ((40.0, 30.0), (41.0, 29.0)), 8: ((60.0, 20.0), (55.0, 25.0))}
    for v, rounds in times.items():
        for r, (a, b) in enumerate(rounds, start=1):
            run_json(tmp_path / f"r{r}_k{v}.json", {"tq-4bit-nc": a, "tq-3bit": b})
    (tmp_path / "log.txt").write_text("not a run")
    runs = ab.variant_runs(str(tmp_path))
    assert list(runs) == [0, 4, 8] and [os.path.basename(p) for p in runs[8]] == ["r1_k8.json", "r2_k8.json"]
    others, rows = ab.variants_table(runs)
    assert others == [4, 8]
    by = {k[1]: (m0, vs) for k, m0, vs in rows}
    assert by["tq-4bit-nc"][0] == 48.0 and by["tq-3bit"][0] == 30.0
    (m4, r4, q4), (m8, r8, q8) = by["tq-4bit-nc"][1]
    assert m4 == 40.0 and r4 == pytest.approx(48.0 / 40.0) and m8 == 55.0 and r8 == pytest.approx(48.0 / 55.0)
    # The medians' speed: 0's median (49.0) over the variant's (40.5; 57.5).
    assert q4 == pytest.approx(49.0 / 40.5) and q8 == pytest.approx(49.0 / 57.5)
    assert by["tq-3bit"][1][1] == (20.0, pytest.approx(1.5), pytest.approx(30.5 / 22.5))
    out = io.StringIO()
    ab.variants_report(others, rows, out)
    text = out.getvalue()
    assert "tq-4bit-nc B=8 N=16384 32/8 d128" in text and "40.0 (1.200, 1.210)" in text and "55.0 (0.873, 0.852)" in text
    # Columns named by variants.txt where variants.sh wrote one.
    assert ab.variant_legend(str(tmp_path)) == {}
    (tmp_path / "variants.txt").write_text("0\t(tree)\n4\tKVQ_ABLATE=4\n8\tKVQ_ABLATE=8,KVQ_FAST_PF=1\n")
    legend = ab.variant_legend(str(tmp_path))
    assert legend == {0: "(tree)", 4: "KVQ_ABLATE=4", 8: "KVQ_ABLATE=8,KVQ_FAST_PF=1"}
    out = io.StringIO()
    ab.variants_report(others, rows, out, legend)
    head = out.getvalue().splitlines()[0]
    assert "KVQ_ABLATE=4 us (speed, of medians)" in head and "KVQ_ABLATE=8,KVQ_FAST_PF=1 us (speed, of medians)" in head
    # The command line: the table, or an error and status 1.
    assert ab.main(["--variants", str(tmp_path)]) == 0


def test_variants_refuses_missing_base_uneven_rounds_and_other_rows(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    run_json(d / "r1_k4.json", {"tq-4bit-nc": 40.0})
    with pytest.raises(ValueError, match="no runs of variant 0"):
        ab.variant_runs(str(d))
    run_json(d / "r1_k0.json", {"tq-4bit-nc": 40.0})
    run_json(d / "r2_k0.json", {"tq-4bit-nc": 41.0})
    with pytest.raises(ValueError, match=r"variant 4 has rounds \[1\], variant 0 \[1, 2\]"):
        ab.variant_runs(str(d))
    run_json(d / "r2_k4.json", {"tq-3bit": 40.0})
    with pytest.raises(ValueError, match="has other rows"):
        ab.variants_table(ab.variant_runs(str(d)))
    assert ab.main(["--variants", str(d)]) == 1
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--variants", str(d), "--a", "x.json"])


def kill_session(sid):
    """SIGKILL every process of session `sid` (Linux /proc)."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid:  # field 6 of stat: the session id
                    os.kill(int(d), signal.SIGKILL)
            except (OSError, IndexError, ValueError):
                pass  # gone meanwhile


def test_variants_script_refuses_bad_variants_before_building(tmp_path):
    # bench/gpu/variants.sh checks every variant's flags (NAME=INTEGER, NAME in FILE's source, a plain value only
    # with MACRO), TESTS, PADS, FLUSH, FILE and STORE_TOKENS before it copies the tree or builds anything (with
    # FILE=store.cu the macros are looked up in src/cuda/store.cu).
    def run(**env):
        e = {k: v for k, v in os.environ.items()
             if k not in ("MACRO", "VARIANTS", "TESTS", "PADS", "FLUSH", "FILE", "STORE_TOKENS")}
        e.update(OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), **env)
        # Its own session, so that a refusal that broke (the script going on to build) is stopped whole at the
        # timeout and fails the test: every process of the session, since ninja puts each command in a process
        # group of its own.
        pr = subprocess.Popen(["bash", os.path.join(ROOT, "bench", "gpu", "variants.sh")], env=e, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = pr.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            kill_session(pr.pid)
            pr.communicate()
            raise
        return subprocess.CompletedProcess(pr.args, pr.returncode, out, err)
    cases = [({"VARIANTS": "1"}, "value without MACRO"),
             ({"VARIANTS": "KVQ_NO_SUCH_MACRO=1"}, "KVQ_NO_SUCH_MACRO is not in src/cuda/decode_fast.cuh"),
             ({"VARIANTS": "KVQ_FAST_BULK=x"}, "is not NAME=INTEGER"),
             ({"VARIANTS": "KVQ_FAST_BULK=0,1"}, "is not NAME=INTEGER"),
             ({"VARIANTS": "KVQ_FAST_BULK=0", "TESTS": "KVQ_FAST_BULK=1"}, "not in VARIANTS"),
             ({"MACRO": "KVQ_FAST_BULK", "VARIANTS": "0", "TESTS": "1"}, "not in VARIANTS"),
             ({"VARIANTS": "KVQ_FAST_BULK=0", "PADS": "0 64M"}, "PADS holds '64M', not a whole number of MiB"),
             ({"VARIANTS": "KVQ_FAST_BULK=0", "FLUSH": "all"}, "FLUSH must be read, write or none, not 'all'"),
             ({"VARIANTS": "KVQ_FAST_BULK=0", "FILE": "decode.cu"}, "FILE must be decode_d128.cu or store.cu, not 'decode.cu'"),
             ({"VARIANTS": "KVQ_FAST_BULK=1", "FILE": "store.cu"}, "KVQ_FAST_BULK is not in src/cuda/store.cu"),
             ({"VARIANTS": "KVQ_FAST_BULK=0", "STORE_TOKENS": "0"}, "STORE_TOKENS must be a positive integer, not '0'")]
    for env, msg in cases:
        r = run(**env)
        assert r.returncode == 1 and msg in r.stderr, (env, r.stderr)
    assert not (tmp_path / "out").exists()  # made only once the builds are done
    assert not (tmp_path / "work").exists()  # made only once every variant is checked
