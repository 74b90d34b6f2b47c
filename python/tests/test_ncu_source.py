"""Tests of bench/gpu/ncu_source.py: stall samples of a kernel's SASS grouped by loop, execution count and opcode."""

import csv
import gzip
import importlib.util
import io
import os

import pytest

ROOT = os.environ.get("KVQ_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
_path = os.path.join(ROOT, "bench", "gpu", "ncu_source.py")
_spec = importlib.util.spec_from_file_location("ncu_source", _path)
ncu_source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_source)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "# Samples", "Instructions Executed", "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]


def kernel_csv(path, loop_len=100, chunks=64, issue=20):
    """A prologue of 10 instructions run once per warp (8 warps), a loop of loop_len run `chunks` times of which
    `issue` (from the loop's eleventh on) run chunks - 8 times (the copies of the last chunks are skipped), an
    epilogue of 10 run once."""
    rows = []
    addr = 0x7f0000000000

    def add(src, ex, wait, barrier=0):
        nonlocal addr
        rows.append([hex(addr), "      " + src, str(wait + barrier), str(wait + barrier), str(wait + barrier),
                     f"{ex:,}", str(wait), str(barrier), "0"])
        addr += 16

    for k in range(10):
        add("LDC R1, c[0x0][0x28]", 8, 1)
    for k in range(loop_len):
        if 10 <= k < 10 + issue:  # a loop's head and tail run every chunk
            add("@P1   ELECT P2, URZ, PT", chunks - 8, 2)
        elif k % 2:
            add("PRMT R64, R60, 0x7604, R95", chunks, 3)
        else:
            add("@!P0  LDS.U16 R64, [R64]", chunks, 1)  # a predicate and modifiers: counted as LDS
    for k in range(10):
        add("BAR.SYNC.DEFER_BLOCKING 0x0", 8, 0, barrier=5)
    text = io.StringIO()
    w = csv.writer(text, quoting=csv.QUOTE_ALL)
    w.writerow(["Kernel Name", "void k()"])
    w.writerow(HEADER)
    w.writerows(rows)
    with gzip.open(path, "wt") as f:
        f.write(text.getvalue())


def test_loop_parts_and_opcodes(tmp_path):
    p = str(tmp_path / "src.csv.gz")
    kernel_csv(p)
    ins = ncu_source.read(p)
    assert len(ins) == 120
    assert ncu_source.loop_count(ins) == 64
    out = ncu_source.summarize(ins, top=3)
    # prologue 10 x 1, loop 20 x 2 + 40 x 3 + 40 x 1, epilogue 10 x 5 = 10 + 200 + 50
    assert "samples 260;" in out
    assert "before the loop      10 samples" in out
    assert "loop                200 samples" in out
    assert "after the loop       50 samples" in out
    # 80 instructions every chunk, 20 in 56 of 64 chunks: 80 + 17.5 per chunk
    assert "97.5 instructions per chunk" in out
    assert "executed       56:   20 instructions,   17.5 per chunk,    40 samples ( 20.0% of the loop's)" in out
    assert "executed       64:   80 instructions,   80.0 per chunk,   160 samples ( 80.0% of the loop's)" in out
    assert "PRMT            120 ( 60.0%)    40.0" in out
    assert "ELECT            40 ( 20.0%)    17.5" in out
    assert "LDS              40 ( 20.0%)    40.0" in out
    assert "barrier 5" in out


def test_chunks_override_and_errors(tmp_path, capsys):
    p = str(tmp_path / "src.csv.gz")
    kernel_csv(p, loop_len=40, issue=0)  # 40 loop instructions: below the 64 that the search asks for
    ins = ncu_source.read(p)
    with pytest.raises(ValueError, match="no execution count shared by 64"):
        ncu_source.loop_count(ins)
    assert "loop: 40 instructions executed up to 64 times" in ncu_source.summarize(ins, chunks=64)
    with pytest.raises(ValueError, match="no instruction executed 7 times"):
        ncu_source.summarize(ins, chunks=7)
    bad = tmp_path / "bad.csv"
    bad.write_text('"Kernel Name","k"\n"Source","x"\n')
    assert ncu_source.main([str(bad)]) == 1
    assert "no header row" in capsys.readouterr().err
    assert ncu_source.main([str(tmp_path / "missing.csv")]) == 1
