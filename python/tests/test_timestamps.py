"""Tests of bench/gpu/timestamps.py (the decode kernel's timestamp probes and their report).

The patch must still apply to the kernel source as it is (each probe's anchor text exactly once),
and the report must read dumps correctly: synthetic launches with known times, and malformed
dumps refused with a message.
"""

import importlib.util
import io
import os
import struct

import pytest

ROOT = os.environ.get("KVQ_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
_spec = importlib.util.spec_from_file_location("timestamps", os.path.join(ROOT, "bench", "gpu", "timestamps.py"))
ts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ts)

KERNEL = os.path.join(ROOT, "src", "cuda", "decode_fast.cuh")


def test_patch_applies_to_the_kernel():
    with open(KERNEL) as f:
        src = f.read()
    out = ts.patch(src)
    for probe in ("pt0_ = gt64_()", "tfirst_ = gt32_()", "tend_ = gt32_()", "tmw_ = gt32_()", "tfin_ = gt32_()",
                  "atexit(probe_dump)", "%%smid"):
        assert probe in out
    # Every edit only adds text: the kernel source is still there line by line, in order.
    it = iter(out.splitlines())
    assert all(any(line == o for o in it) for line in src.splitlines())


def test_patch_refuses_a_changed_kernel():
    with open(KERNEL) as f:
        src = f.read()
    with pytest.raises(ValueError, match="expected one occurrence"):
        ts.patch(src.replace("    issue_or_skip(i + C::NST - 1 < nloc, slot_wr, page_next);", "    issue_or_skip(i + 1 < nloc, slot_wr, page_next);"))
    with pytest.raises(ValueError, match="found 2"):
        ts.patch(src + "\n  int page_next = page_first(C::NST - 1);\n")


# ns; its low 32 bits are 10 us short of wrapping, so every time the 32-bit slots hold past 10 us has wrapped.
BASE = 1165 * (1 << 32) - 10_000


def dump(path, grid, ctas):
    """ctas: list of dicts with entry (us), sm, first[w], lend[w], merge0, merge1, end (us after entry)."""
    recs = []
    for c in ctas:
        r = [0] * ts.SLOTS
        e = BASE + int(round(c["entry"] * 1000))
        r[0] = e
        lo = lambda t: (e + int(round(t * 1000))) & 0xffffffff  # noqa: E731
        r[40] = c["sm"]
        for w, t in enumerate(c["first"]):
            r[24 + w] = lo(t)
        for w, t in enumerate(c["lend"]):
            r[8 + w] = lo(t)
        r[3], r[4], r[5] = lo(c["merge0"]), lo(c["merge1"]), lo(c["end"])
        for k, v in enumerate(c.get("prologue", [])):
            r[41 + k] = lo(v)
        for k, v in zip((1, 2, 6, 7), c.get("cluster", [])):  # first cluster barrier, sends, rows landed, merged
            r[k] = lo(v)
        recs.append(r)
    n = len(recs)
    with open(path, "wb") as f:
        f.write(struct.pack("<3I", *grid))
        f.write(struct.pack(f"<{n * ts.SLOTS}Q", *[v for r in recs for v in r]))
        f.write(b"\0" * 8 * ts.SLOTS * 3)  # unused records after the grid, as the kernel's buffer has


def launch(sm_of_cta, slow_sms):
    """Four CTAs of 16 warps: warp w ends 0.1 w us after the CTA's first warp; SMs in slow_sms loop 4 us longer."""
    ctas = []
    for k, sm in enumerate(sm_of_cta):
        entry = 0.25 * k
        loop = 30.0 + (4.0 if sm in slow_sms else 0.0)
        first = [2.0 + 0.01 * w for w in range(16)]
        lend = [2.0 + loop + 0.1 * w for w in range(16)]
        ctas.append({"entry": entry, "sm": sm, "first": first, "lend": lend, "prologue": [1.0 + 0.1 * k, 1.2, 1.3, 1.4, 1.5],
                     "merge0": lend[-1] + 0.2,
                     "merge1": lend[-1] + 1.2, "end": lend[-1] + 3.0})
    return ctas


def test_report_of_known_launches(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    dump(a, (2, 1, 2), launch([10, 11, 12, 13], slow_sms={12, 13}))
    dump(b, (2, 1, 2), launch([12, 13, 10, 11], slow_sms={12, 13}))  # other CTA -> SM map, same slow SMs
    out = io.StringIO()
    sa, sb = ts.report([str(a), str(b)], out=out)
    assert sa["ctas"] == 4
    # Slowest CTA: entry 0.75, loop end of warp 15 at 2 + 34 + 1.5, done 3 us later.
    assert sa["span"] == pytest.approx(0.75 + 2.0 + 34.0 + 1.5 + 3.0, abs=2e-3)
    assert sa["spread"] == pytest.approx([1.5] * 4, abs=2e-3)
    # Balance bounds: the last warp ends 1.5 us after the first, 0.75 after the mean; CTAs done at 36.5, 36.75, 41 and
    # 41.25 us (entry + 2 + loop + 1.5 + 3), mean 38.875.
    assert sa["warp_excess"] == pytest.approx([0.75] * 4, abs=2e-3)
    assert sa["cta_excess"] == pytest.approx(41.25 - 38.875, abs=2e-3)
    assert sa["warps_merge"] == pytest.approx([1.0] * 4, abs=2e-3)
    assert sa["tail"] == pytest.approx([3.0] * 4, abs=2e-3)
    assert sa["warp_pattern"] == pytest.approx([0.1 * w - 0.75 for w in range(16)], abs=2e-3)
    assert sa["prologue"] == pytest.approx([1.15, 1.2, 1.3, 1.4, 1.5], abs=2e-3)  # page ids: median of 1.0 .. 1.3
    assert sa["warp_pattern_share"] == pytest.approx(1.0, abs=1e-6)
    # Loop time per SM: mean warp's end minus the median warp's chunk 0.
    assert sa["loop_by_sm"][10] == pytest.approx(30.0 + 0.75 - 0.075, abs=2e-3)
    assert sa["loop_by_sm"][12] - sa["loop_by_sm"][10] == pytest.approx(4.0, abs=2e-3)
    text = out.getvalue()
    assert "correlation between the two launches: 1.00 over 4 SMs" in text
    assert "CTAs on the same SM in both: 0%" in text
    assert "last CTA done - mean CTA done: 2.38 us" in text
    assert sb["span"] == pytest.approx(0.25 + 2.0 + 34.0 + 1.5 + 3.0, abs=2e-3)


def test_cluster_steps_follow_each_clusters_later_cta(tmp_path):
    # Two clusters of two CTAs (grid x = 2). In cluster 0 CTA 1 ends its warps' merge 2 us after CTA 0, in cluster 1
    # CTA 2 ends it 1 us after CTA 3: the later CTAs are 1 and 2. Each CTA: merge1 -> first cluster barrier +0.5 (the
    # earlier one +w, waiting for its partner), sends +0.4, rows landed, merged +0.7.
    ctas = launch([10, 11, 12, 13], slow_sms=set())
    shift = [0.0, 2.0, 1.0, 0.0]
    for k, c in enumerate(ctas):
        c["merge0"] += shift[k]
        c["merge1"] += shift[k]
        c["lend"] = [t + shift[k] for t in c["lend"]]
    late = {0: 1, 1: 0, 2: 3, 3: 2}  # partner
    for k, c in enumerate(ctas):
        p = ctas[late[k]]
        # absolute (launch) times: entry 0.25 k; the partner's merge1 in this CTA's frame
        pm1 = p["merge1"] + 0.25 * late[k] - 0.25 * k
        s1 = max(c["merge1"], pm1) + 0.5
        s2 = s1 + 0.4
        c["cluster"] = [s1, s2, s2 + 0.1, s2 + 0.1 + 0.7]
        c["end"] = s2 + 0.9
    path = tmp_path / "c.bin"
    dump(path, (2, 1, 2), ctas)
    out = io.StringIO()
    (S,) = ts.report([str(path)], out=out)
    steps = {side: dict(S["cluster_steps"][side]) for side in ("later", "earlier")}
    lat = steps["later"]
    assert lat["warps' merge"] == pytest.approx([1.0, 1.0], abs=2e-3)
    assert lat["-> first cluster barrier passed"] == pytest.approx([0.5, 0.5], abs=2e-3)
    assert lat["-> sends issued"] == pytest.approx([0.4, 0.4], abs=2e-3)
    assert lat["-> rows merged and stored"] == pytest.approx([0.7, 0.7], abs=2e-3)
    # The earlier CTA waited at the first cluster barrier for its partner: 2 us in cluster 0 (CTA 1's merge ended
    # 2 us later, but CTA 1 entered 0.25 us later too), 1 us in cluster 1.
    assert steps["earlier"]["-> first cluster barrier passed"] == pytest.approx([2.0 + 0.25 + 0.5, 1.0 - 0.25 + 0.5],
                                                                              abs=2e-3)
    assert "cluster merge, the later CTA of each cluster" in out.getvalue()
    # A dump without the cluster slots (the launch had no cluster merge) reports none.
    dump(path, (2, 1, 2), launch([10, 11, 12, 13], slow_sms=set()))
    (S,) = ts.report([str(path)], out=io.StringIO())
    assert S["cluster_steps"] is None


def test_malformed_dumps_are_refused(tmp_path):
    p = tmp_path / "short.bin"
    p.write_bytes(b"\1\0")
    with pytest.raises(ValueError, match="too short"):
        ts.load(str(p))
    p = tmp_path / "grid.bin"
    p.write_bytes(struct.pack("<3I", 100, 100, 100) + b"\0" * 64)
    with pytest.raises(ValueError, match="does not match"):
        ts.load(str(p))
    p = tmp_path / "empty.bin"
    p.write_bytes(struct.pack("<3I", 2, 1, 1) + b"\0" * 8 * ts.SLOTS * 2)
    with pytest.raises(ValueError, match="without an entry time"):
        ts.Launch(str(p))
    assert ts.main(["report"]) == 2
