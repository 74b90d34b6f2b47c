"""Tests of bench/gpu/sass_loops.py: the main-loop size of each kernel in a cuobjdump -sass listing."""

import importlib.util
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
        text = b"".join(struct.pack("<QQ", op | 0x1000, 0) for op in ops)
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
    assert "LDL@40 (HMMA 2 | 1)" in out and "other" not in out
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
