"""Tests of bench/gpu/sass_loops.py: the main-loop size of each kernel in a cuobjdump -sass listing."""

import importlib.util
import json
import os
import struct
import subprocess
import sys

ROOT = os.environ.get("KVQ_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
_path = os.path.join(ROOT, "bench", "gpu", "sass_loops.py")
_spec = importlib.util.spec_from_file_location("sass_loops", _path)
sass_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loops)


def listing(name, extra_in_loop=0):
    """A cuobjdump-style kernel: a prologue, a spin loop (no HMMA), the main loop (16 HMMA, a barrier wait loop
    inside), an outer loop around everything with more HMMA after the main loop."""
    ops = ["S2R R0, SR_TID.X", "MOV R1, c[0x0][0x28]"]
    spin = len(ops)
    ops += ["NANOSLEEP 0x100", "@!P0 BRA {spin}"]
    outer = len(ops)
    ops += ["IADD3 R2, R2, 0x1, RZ"]
    main = len(ops)
    ops += ["LDS R4, [R5]"] * 4 + ["PRMT R6, R7, 0x5410, R8"] * 2
    ops += ["HMMA.16816.F32 R8, R12, R16, R8"] * 8
    wait = len(ops)
    ops += ["SYNCS.PHASECHK.TRANS64 P1, [R9], RZ", "@!P1 BRA {wait}"]
    ops += ["HMMA.16816.F32 R8, R12, R16, R8"] * 8 + ["LOP3.LUT R3, R3, 0xff, RZ, 0xc0, !PT"] * extra_in_loop
    ops += ["@P2 BRA {main}"]
    ops += ["HMMA.16816.F32 R8, R12, R16, R8"] * 16 + ["@P3 BRA {outer}", "EXIT", "BRA {end}"]
    end = len(ops) - 1
    lines = [f"\t\tFunction : {name}", "\t.headerflags\t@\"EF_CUDA_SM90\""]
    for i, op in enumerate(ops):
        text = op.format(spin=hex(16 * spin), wait=hex(16 * wait), main=hex(16 * main), outer=hex(16 * outer),
                         end=hex(16 * end))
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x000000000000000000000000 */")
    return "\n".join(lines) + "\n", 8 + 2 + 8 + extra_in_loop + 1


def test_main_loop_is_the_smallest_region_with_a_chunk_of_hmma(tmp_path):
    text, loop_len = listing("_Z6kernelv")
    path = tmp_path / "a.txt"
    path.write_text(text)
    kernels = sass_loops.parse(str(path))
    assert list(kernels) == ["_Z6kernelv"]
    loop = sass_loops.main_loop(kernels["_Z6kernelv"])
    # 4 LDS + 2 PRMT + 8 HMMA + the wait loop (2) + 8 HMMA + the branch back
    assert loop == {"loop": 6 + loop_len, "HMMA": 16, "LDS": 4, "PRMT": 2, "LOP3": 0}


def test_predicates_are_not_opcodes_and_a_kernel_without_mma_has_no_loop(tmp_path):
    assert sass_loops.opcode("@!P1 BRA 0x40") == "BRA"
    assert sass_loops.opcode("HMMA.16816.F32 R8, R12, R16, R8") == "HMMA"
    path = tmp_path / "b.txt"
    path.write_text("\t\tFunction : _Z4copyv\n        /*0000*/   LDG.E R2, [R4.64] ;\n"
                    "        /*0010*/   @P0 BRA 0x0 ;\n        /*0020*/   EXIT ;\n")
    kernels = sass_loops.parse(str(path))
    assert sass_loops.main_loop(kernels["_Z4copyv"]) is None


def test_two_listings_print_the_difference(tmp_path):
    a, _ = listing("_Z6kernelv")
    b, _ = listing("_Z6kernelv", extra_in_loop=3)
    (tmp_path / "a.txt").write_text(a + listing("_Z5otherv")[0])
    (tmp_path / "b.txt").write_text(b)
    out = subprocess.run([sys.executable, _path, str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
                         capture_output=True, text=True, check=True).stdout
    # only the kernel present in both, with B - A of the loop and of the whole kernel
    assert "other" not in out
    assert "loop +3, total +3" in out
    # each column's counts, the LOP3s added in B's loop among them
    assert "(HMMA 16, LDS 4, PRMT 2, LOP3 0)" in out and "(HMMA 16, LDS 4, PRMT 2, LOP3 3)" in out


def tiny_cubin(path, kernels):
    """An ELF64 file with a section .text.<name> per kernel, holding 16-byte instructions of the given opcodes."""
    names = b"\0.shstrtab\0" + b"".join(b".text." + n.encode() + b"\0" for n in kernels)
    body, secs = b"", []
    off = 64 + len(names)
    for n, ops in kernels.items():
        # an int: an instruction with that opcode; a (lo, hi) pair: the instruction's two 64-bit words
        text = b"".join(struct.pack("<QQ", *op) if isinstance(op, tuple) else struct.pack("<QQ", op | 0x1000, 0)
                        for op in ops)
        secs.append((names.index(b".text." + n.encode()), off + len(body), len(text)))
        body += text
    shoff = off + len(body)
    header = bytearray(64)
    header[:7] = b"\x7fELF\x02\x01\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 2 + len(secs), 1)
    shdrs = struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    shdrs += struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64, len(names), 0, 0, 1, 0)
    for name, o, size in secs:
        shdrs += struct.pack("<IIQQQQIIQQ", name, 1, 6, 0, o, size, 0, 0, 128, 0)
    path.write_bytes(bytes(header) + names + body + shdrs)


def test_spills_between_mma_from_a_cubin(tmp_path):
    HMMA, LDL, STL, NOP = 0x23C, 0x983, 0x387, 0x918
    # a store before the loop and a reload after it (outside), then one reload between two HMMAs (inside)
    tiny_cubin(tmp_path / "k.cubin", {"_Z11decode_fastv": [STL, NOP, HMMA, HMMA, LDL, HMMA, NOP, LDL],
                                      "_Z5otherv": [HMMA, LDL, HMMA]})
    kernels = sass_loops.cubin_kernels(str(tmp_path / "k.cubin"))
    assert sorted(kernels) == ["_Z11decode_fastv", "_Z5otherv"]
    assert sass_loops.spills_between_mma(kernels["_Z11decode_fastv"]) == (3, [(4 * 16, "LDL", 2, 1)])
    out = subprocess.run([sys.executable, _path, "--spills", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                         check=True).stdout
    assert "LDL@40 (MMA 2 | 1)" in out and "other" not in out
    (tmp_path / "bad.cubin").write_bytes(b"not an elf")
    bad = subprocess.run([sys.executable, _path, "--spills", str(tmp_path / "bad.cubin")], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and "not an ELF64 file" in bad.stderr


def test_same_names_the_build_each_kernel_comes_from(tmp_path):
    HMMA, LDL, NOP = 0x23C, 0x983, 0x918
    tiny_cubin(tmp_path / "a.cubin", {"_Z1fv": [HMMA, NOP], "_Z1gv": [HMMA, HMMA], "_Z1hv": [NOP]})
    tiny_cubin(tmp_path / "b.cubin", {"_Z1fv": [HMMA, LDL], "_Z1gv": [HMMA, HMMA], "_Z1kv": [NOP]})

    def run(*files):
        r = subprocess.run([sys.executable, _path, "--same", *map(str, files)], capture_output=True, text=True)
        # "WHAT     NAME" (WHAT padded to 8); NAME demangled where c++filt is installed ("f()"), else "_Z1fv"
        return r.returncode, {line[9:].replace("_Z1", "").replace("v", "()"): line[:8].strip()
                              for line in r.stdout.splitlines()}

    assert run(tmp_path / "a.cubin", tmp_path / "b.cubin") == (
        0, {"f()": "differs", "g()": "same", "h()": "A only", "k()": "B only"})
    # A build that takes f from B and g from either: every kernel is measured code.
    tiny_cubin(tmp_path / "c.cubin", {"_Z1fv": [HMMA, LDL], "_Z1gv": [HMMA, HMMA]})
    assert run(tmp_path / "a.cubin", tmp_path / "b.cubin", tmp_path / "c.cubin") == (0, {"f()": "B", "g()": "A and B"})
    # A kernel with the code of neither build fails the check.
    tiny_cubin(tmp_path / "d.cubin", {"_Z1fv": [LDL, LDL], "_Z1gv": [HMMA, HMMA]})
    assert run(tmp_path / "a.cubin", tmp_path / "b.cubin", tmp_path / "d.cubin") == (1, {"f()": "neither",
                                                                                         "g()": "A and B"})


def bra(offset):
    """An sm_90 BRA whose target is `offset` bytes from the next instruction (sass_loops.branch_offset's fields)."""
    v = (offset // 4) & ((1 << 56) - 1)
    return (0x947 | ((v & 0xFF) << 16) | (((v >> 8) & ((1 << 30) - 1)) << 34), (v >> 38) & 0x3FFFF)


def test_branch_offsets_round_trip_through_the_fields():
    for off in (0, 16, 208, 138080, -16, -4096, -(1 << 40), (1 << 40) + 48):
        lo, hi = bra(off)
        assert lo & 0xFFF == 0x947 and sass_loops.branch_offset(lo, hi) == off


def test_local_mode_finds_the_main_loop_without_cuobjdump(tmp_path, monkeypatch):
    # opcodes of this test's own map (not sm_90's), so the map read is the one KVQ_SM90_OPCODES names
    HMMA, LDS, LOP3, NOP = 0x7A1, 0x7A2, 0x7A3, 0x7A4
    opmap = tmp_path / "ops.json"
    opmap.write_text('{"opcodes": {"0x7a1": "HMMA", "0x7a2": "LDS", "0x7a3": "LOP3", "0x7a4": "NOP"}}')
    monkeypatch.setenv("KVQ_SM90_OPCODES", str(opmap))
    # instruction 0: NOP; 1-4: LDS; 5-20: HMMA; 21: LOP3; 22: BRA back to 1 (a loop of 22); 23: BRA forward to 25;
    # 24: an unknown opcode; 25: BRA back to 0 (a larger region: not the main loop)
    ops = [NOP] + [LDS] * 4 + [HMMA] * 16 + [LOP3, bra(16 * 1 - 16 * 23), bra(16 * 25 - 16 * 24), 0x7AB,
                                             bra(16 * 0 - 16 * 26)]
    tiny_cubin(tmp_path / "k.cubin", {"_Z1fv": ops})
    parsed = sass_loops.parse_local(str(tmp_path / "k.cubin"))["_Z1fv"]
    assert parsed[22] == (16 * 22, "BRA 0x10") and parsed[23] == (16 * 23, "BRA 0x190") and parsed[24][1] == "?7AB"
    assert sass_loops.main_loop(parsed) == {"loop": 22, "HMMA": 16, "LDS": 4, "PRMT": 0, "LOP3": 1}
    out = subprocess.run([sys.executable, _path, "--local", "--hist", str(tmp_path / "k.cubin")], capture_output=True,
                         text=True, check=True).stdout  # the child inherits KVQ_SM90_OPCODES
    assert "loop    22 (HMMA 16, LDS 4, PRMT 0, LOP3 1)" in out
    assert "loop: HMMA 16, LDS 4, BRA 1, LOP3 1" in out


def test_opmap_is_written_from_a_listing_and_refuses_two_names_for_one_opcode(tmp_path):
    HMMA, LDS = 0x23C, 0x984
    tiny_cubin(tmp_path / "k.cubin", {"_Z1fv": [LDS, HMMA, bra(-48)]})
    rows = ["LDS R4, [R5]", "HMMA.16816.F32 R8, R12, R16, R8", "@P0 BRA 0x0"]
    text = "\t\tFunction : _Z1fv\n" + "".join(f"        /*{16 * i:04x}*/   {r} ;\n" for i, r in enumerate(rows))
    (tmp_path / "k.txt").write_text(text)
    env = dict(os.environ, KVQ_SM90_OPCODES=str(tmp_path / "ops.json"))
    r = subprocess.run([sys.executable, _path, "--opmap", str(tmp_path / "k.txt"), str(tmp_path / "k.cubin")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ops.json").read_text())["opcodes"] == {"0x23c": "HMMA", "0x947": "BRA",
                                                                         "0x984": "LDS"}
    # two listings with their cubins: one map of the opcodes of both
    tiny_cubin(tmp_path / "k2.cubin", {"_Z1gv": [0x918, HMMA]})
    (tmp_path / "k2.txt").write_text("\t\tFunction : _Z1gv\n        /*0000*/   NOP ;\n"
                                     "        /*0010*/   HMMA.16816.F32 R8, R12, R16, R8 ;\n")
    r = subprocess.run([sys.executable, _path, "--opmap", str(tmp_path / "k.txt"), str(tmp_path / "k.cubin"),
                        str(tmp_path / "k2.txt"), str(tmp_path / "k2.cubin")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ops.json").read_text())["opcodes"] == {"0x23c": "HMMA", "0x918": "NOP",
                                                                         "0x947": "BRA", "0x984": "LDS"}
    odd = subprocess.run([sys.executable, _path, "--opmap", str(tmp_path / "k.txt"), str(tmp_path / "k.cubin"),
                          str(tmp_path / "k2.txt")], capture_output=True, text=True, env=env)
    assert odd.returncode == 2
    # one opcode listed as two instructions, and a branch whose decoded target is not the listing's
    tiny_cubin(tmp_path / "bad.cubin", {"_Z1fv": [LDS, LDS, bra(-48)]})
    bad = subprocess.run([sys.executable, _path, "--opmap", str(tmp_path / "k.txt"), str(tmp_path / "bad.cubin")],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and "is both" in bad.stderr
    (tmp_path / "bad2.txt").write_text(text.replace("BRA 0x0", "BRA 0x10"))
    bad2 = subprocess.run([sys.executable, _path, "--opmap", str(tmp_path / "bad2.txt"), str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, env=env)
    assert bad2.returncode == 1 and "decoded target differs" in bad2.stderr


def fake_nvcc(tmp_path, version):
    """An executable that answers --version as nvcc does, with `version` (e.g. V13.0.88) on the release line."""
    path = tmp_path / f"nvcc-{version}"
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release 13.0, {version}'\n")
    path.chmod(0o755)
    return str(path)


def test_loop_budget_fails_on_grown_loops_spills_and_changed_kernels_and_skips_another_compiler(tmp_path):
    HMMA, LDS, LDL, STL, NOP = 0x23C, 0x984, 0x983, 0x387, 0x918  # sm_90 (bench/gpu/sm90_opcodes.json)

    def kernel(extra=0, spill=False):
        # 0: NOP; 1 .. 4 + extra: LDS; then 16 HMMA (an LDL among them when spill); a branch back to 1
        body = [LDS] * (4 + extra) + [HMMA] * 8 + ([LDL] if spill else []) + [HMMA] * 8
        return [NOP] + body + [bra(-16 * (len(body) + 1))]

    anon = "_ZN3kvq4cuda46_GLOBAL__N__{}_13_mla_decode_cu_d4afc68c1kEv"  # an anonymous namespace's hash per path
    nvcc = fake_nvcc(tmp_path, "V13.0.88")

    def check(kernels, *extra):
        tiny_cubin(tmp_path / "k.cubin", kernels)
        r = subprocess.run([sys.executable, _path, "--budget", str(tmp_path / "b.json"), *extra,
                            f"decode_d128.cu={tmp_path / 'k.cubin'}"], capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr

    # two kernels with a main loop, and a store-like kernel without one (one local store, one load: a spill)
    base = {"_Z1fv": kernel(), anon.format("a528e5fc"): kernel(), "_Z4copyv": [NOP, STL, NOP, LDL]}
    rc, out = check(base, "--nvcc", nvcc, "--write")
    assert rc == 0 and "3 kernels (2 with a main loop)" in out
    recorded = json.loads((tmp_path / "b.json").read_text())
    assert recorded["nvcc"] == "V13.0.88"
    assert recorded["cubins"]["decode_d128.cu"]["_Z1fv"] == {"loop": 21, "hmma": 16, "hgmma": 0, "spills": 0}
    assert anon.format("00000000") in recorded["cubins"]["decode_d128.cu"]
    # the same code, the anonymous namespace compiled from another path: passes
    rc, out = check({**base, anon.format("7f352e9d"): kernel()}, "--nvcc", nvcc)
    assert rc == 0 and "passed" in out
    # one instruction more in a loop
    rc, out = check({**base, "_Z1fv": kernel(extra=1)}, "--nvcc", nvcc)
    assert rc == 1 and "over the budget" in out and "main loop 22 instructions, 21 recorded (+1)" in out
    # one fewer: passes, and says so
    rc, out = check({**base, "_Z1fv": kernel(extra=-1)}, "--nvcc", nvcc)
    assert rc == 0 and "below the budget" in out and "(-1)" in out
    # a local load between the HMMAs
    rc, out = check({**base, "_Z1fv": kernel(spill=True)}, "--nvcc", nvcc)
    assert rc == 1 and "1 local loads / stores between the products, 0 recorded" in out
    # a warpgroup kernel's loop (16 HGMMA, no HMMA) is a main loop too; another HGMMA count fails
    HGMMA = 0x9F0
    wg = [NOP] + [LDS] * 3 + [HGMMA] * 16 + [bra(-16 * 20)]
    rc, out = check({**base, "_Z2wgv": wg}, "--nvcc", nvcc, "--write")
    assert rc == 0 and json.loads((tmp_path / "b.json").read_text())["cubins"]["decode_d128.cu"]["_Z2wgv"] == {
        "loop": 20, "hmma": 0, "hgmma": 16, "spills": 0}
    rc, out = check({**base, "_Z2wgv": [NOP] + [LDS] * 2 + [HGMMA] * 17 + [bra(-16 * 20)]}, "--nvcc", nvcc)
    assert rc == 1 and "17 HGMMA in the main loop, 16 recorded" in out
    rc, out = check(base, "--nvcc", nvcc, "--write")
    assert rc == 0
    # the kernel without a main loop: one spill more fails, one fewer passes with a note, a loop of 16 HMMA in it fails
    rc, out = check({**base, "_Z4copyv": [NOP, STL, LDL, LDL]}, "--nvcc", nvcc)
    assert rc == 1 and "3 local loads / stores, 2 recorded" in out
    rc, out = check({**base, "_Z4copyv": [NOP, STL, NOP, NOP]}, "--nvcc", nvcc)
    assert rc == 0 and "1 local loads / stores, 2 recorded" in out
    rc, out = check({**base, "_Z4copyv": kernel()}, "--nvcc", nvcc)
    assert rc == 1 and "has a main loop now" in out
    # a kernel that the budget lacks, and one that went
    rc, out = check({**base, "_Z1gv": kernel()}, "--nvcc", nvcc)
    assert rc == 1 and "the budget lacks" in out
    rc, out = check({"_Z1fv": kernel()}, "--nvcc", nvcc)
    assert rc == 1 and "in the budget, but not in the cubin" in out
    # another compiler: skipped (ctest's SKIP_RETURN_CODE), whatever the code
    rc, out = check({**base, "_Z1fv": kernel(extra=5)}, "--nvcc", fake_nvcc(tmp_path, "V13.1.20"))
    assert rc == 77 and "skipped" in out and "V13.0.88" in out
    # a cubin name the budget does not hold, a broken budget file, a missing argument
    tiny_cubin(tmp_path / "k.cubin", base)
    r = subprocess.run([sys.executable, _path, "--budget", str(tmp_path / "b.json"), "--nvcc", nvcc,
                        f"store.cu={tmp_path / 'k.cubin'}"], capture_output=True, text=True)
    assert r.returncode == 1 and "store.cu: no budget recorded for it" in r.stdout
    (tmp_path / "b.json").write_text("{")
    rc, out = check(base, "--nvcc", nvcc)
    assert rc == 1 and out.startswith("error:")
    (tmp_path / "b.json").write_text('{"nvcc": "V13.0.88", "cubins": {"decode_d128.cu": {"_Z1fv": {"loop": 21}}}}')
    rc, out = check(base, "--nvcc", nvcc)
    assert rc == 1 and out.startswith("error:") and "expected" in out
    r = subprocess.run([sys.executable, _path, "--budget", str(tmp_path / "b.json")], capture_output=True, text=True)
    assert r.returncode == 2
