"""Tests of bench/gpu/sass_loops.py: the main-loop size of each kernel in a cuobjdump -sass listing."""

import importlib.util
import os
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
