#!/usr/bin/env python3
"""Main-loop sizes of the kernels in a CUDA object or cubin, from `cuobjdump -sass`.

For each kernel (Function) the main loop is taken as the smallest backward branch region [target, branch] that holds
at least 16 HMMA instructions (one chunk's QK or PV), or 16 HGMMA (the MLA warpgroup kernels); its instruction count
and its HMMA / LDS / PRMT / LOP3 counts are printed, with the kernel's whole instruction count. Used to check that a
change outside a loop left ptxas's allocation of the loop alone (docs/kernels.md, warps' merge).

  bench/gpu/sass_loops.py A.o [B.o]     one column per file; with two, the kernels present in both, and B - A
A file named *.txt or *.txt.gz is read as cuobjdump's output instead (a listing saved on a GPU host).

  bench/gpu/sass_loops.py --spills K.cubin [PATTERN]
Without cuobjdump (a machine with ptxas only): reads the sm_90 cubin's kernel sections directly and prints, per
kernel whose name contains PATTERN (default decode_fast), every local load / store (LDL / STL, ptxas's spill code)
that has HMMA (or HGMMA) instructions both before and after it, with those counts: for the fast decode kernels, whose
HMMAs are all in the main loop, that is a spill inside or between the loop's MMAs. The opcodes are the low 12 bits of
an instruction's first 64-bit word (sm_90: HMMA 0x23c, HGMMA 0x9f0 / 0xdf0, LDL 0x983, STL 0x387), read off cuobjdump
listings of the same kernels; a heuristic for a local check, not a disassembler.

  bench/gpu/sass_loops.py --local [--hist] A.cubin [B.cubin]
Without cuobjdump: the same table from sm_90 cubins, each instruction named by its low 12 bits through
sm90_opcodes.json (beside this file; KVQ_SM90_OPCODES names another). Branch targets are decoded from the
instruction's offset field: bits 16-23 and 34-63 of the first 64-bit word and bits 0-17 of the second, a signed count
of 4-byte units from the next instruction. Both were read off cuobjdump listings (nvcc 13.0) of six of src/cuda's
files (docs/kernels.md, "Loop budget"); on every kernel of those listings each instruction is named as cuobjdump names
it. An opcode the map lacks prints as ?XXX. --hist adds each loop's full opcode
counts (also with cuobjdump listings).

  bench/gpu/sass_loops.py --opmap LISTING.txt[.gz] K.cubin [LISTING2 K2.cubin ...]
Writes sm90_opcodes.json from cuobjdump listings and the cubins they were made from (the opcodes of all pairs), for
another compiler version or more kernels; an opcode that names two mnemonics is an error.

  bench/gpu/sass_loops.py --same A.cubin B.cubin [C.cubin]
Also without cuobjdump: which kernels a change touched, by their code bytes (.text). With two cubins, each kernel is
"same" or "differs" (or in one file only). With three, each kernel of C is named after the build whose code it has:
"A", "B", "A and B" (both equal), or "neither"; the exit status is 1 if any is "neither". That is how a build that
picks, kernel by kernel, between two measured variants is checked to contain only measured code.

  bench/gpu/sass_loops.py --budget BUDGET.json [--nvcc NVCC] [--write] NAME=K.cubin [NAME=K.cubin ...]
The loop budget (CI): for every kernel of each cubin that has a main loop (as above), the loop's instruction count,
its HMMA and HGMMA counts and the kernel's local loads / stores between them (as --spills), and for every other
kernel its local loads / stores (LDL / STL, spill code), against BUDGET.json's record of the same cubin NAME (the
source file it was compiled from). Fails (exit 1) where a loop grew, gained spills or changed its HMMA / HGMMA counts,
where another kernel gained local loads / stores, or where a kernel appeared, went or gained or lost its main loop;
a count that shrank is reported and passes (write the budget again to keep the gain). The counts belong to one
compiler: where NVCC's (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc) `--version` differs from the one
recorded, exits 77 (skipped). --write records the cubins' counts and the compiler instead (the file then holds the
cubins given, only). The budget of the tree is bench/gpu/loop_budget.json (docs/kernels.md, "Loop budget").
"""
import gzip
import json
import os
import re
import struct
import subprocess
import sys

INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
BRA = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+(0x[0-9a-f]+)")  # cuobjdump's absolute targets


def parse(path):
    if path.endswith(".gz"):
        with gzip.open(path, "rt") as f:
            out = f.read()
    elif path.endswith(".txt"):
        with open(path) as f:
            out = f.read()
    else:
        out = subprocess.run(["cuobjdump", "-sass", path], capture_output=True, text=True, check=True).stdout
    kernels, name, insns = {}, None, []
    for line in out.splitlines():
        m = FUNC.match(line)
        if m:
            if name:
                kernels[name] = insns
            name, insns = m.group(1), []
            continue
        m = INSN.match(line)
        if m and name:
            insns.append((int(m.group(1), 16), m.group(2).strip()))
    if name:
        kernels[name] = insns
    return kernels


def opcode(text):
    t = text.split()
    if t and t[0].startswith("@"):
        t = t[1:]
    return t[0].split(".")[0] if t else ""


def main_loop_body(insns):
    """The main loop's instructions (see main_loop), or None."""
    addr = [a for a, _ in insns]
    best = None
    for i, (a, text) in enumerate(insns):
        if opcode(text) != "BRA":
            continue
        m = BRA.search(text)
        if not m:
            continue
        tgt = int(m.group(1), 16)
        if tgt > a:
            continue
        j = next((k for k, x in enumerate(addr) if x >= tgt), i)
        body = [opcode(t) for _, t in insns[j:i + 1]]
        if body.count("HMMA") < 16 and body.count("HGMMA") < 16:
            continue
        if best is None or len(body) < len(best):
            best = body
    return best


def main_loop(insns):
    best = main_loop_body(insns)
    if best is None:
        return None
    return {"loop": len(best), "HMMA": best.count("HMMA"), "LDS": best.count("LDS"), "PRMT": best.count("PRMT"),
            "LOP3": best.count("LOP3")}


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        return dict(zip(names, out.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


SM90_OPS = {0x23C: "HMMA", 0x9F0: "HGMMA", 0xDF0: "HGMMA", 0x983: "LDL", 0x387: "STL"}
OPMAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_opcodes.json")
BRA_OP = 0x947  # sm_90 BRA, every form (immediate target, .U.ANY, .DIV)


def opmap_path():
    return os.environ.get("KVQ_SM90_OPCODES", OPMAP)


def branch_offset(lo, hi):
    """Byte offset of a branch's target from the next instruction (sm_90 BRA encoding)."""
    v = ((lo >> 16) & 0xFF) | (((lo >> 34) & ((1 << 30) - 1)) << 8) | ((hi & 0x3FFFF) << 38)
    if v >= 1 << 55:
        v -= 1 << 56
    return 4 * v


def parse_local(path):
    """{kernel: [(address, text)]} like parse(), from a cubin without cuobjdump: the text is the mnemonic, and
    'BRA 0x...' with the decoded target for branches."""
    with open(opmap_path()) as f:
        names = {int(k, 16): v for k, v in json.load(f)["opcodes"].items()}
    out = {}
    for n, text in cubin_kernels(path).items():
        insns = []
        for a in range(0, len(text) - 15, 16):
            lo, hi = struct.unpack_from("<QQ", text, a)
            op = lo & 0xFFF
            if op == BRA_OP:
                insns.append((a, f"BRA 0x{a + 16 + branch_offset(lo, hi):x}"))
            else:
                insns.append((a, names.get(op, f"?{op:03X}")))
        out[n] = insns
    return out


def main_opmap(argv):
    if len(argv) < 2 or len(argv) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    seen, errors = {}, 0
    for lpath, kpath in zip(argv[::2], argv[1::2]):
        listing, kernels = parse(lpath), cubin_kernels(kpath)
        for n, insns in listing.items():
            text = kernels.get(n)
            if text is None:
                print(f"error: {n} is not in {kpath}", file=sys.stderr)
                return 1
            errors += opmap_kernel(seen, n, insns, text)
    if errors:
        return 1
    with open(opmap_path(), "w") as f:
        json.dump({"source": "cuobjdump -sass of sm_90a cubins (nvcc 13.0), low 12 bits of the first 64-bit word",
                   "opcodes": {f"0x{k:03x}": v for k, v in sorted(seen.items())}}, f, indent=0, sort_keys=False)
        f.write("\n")
    print(f"{len(seen)} opcodes written to {opmap_path()}")
    return 0


def opmap_kernel(seen, n, insns, text):
    """Adds one kernel's opcodes (its listing's instructions against its code bytes) to seen; the errors found."""
    errors = 0
    for a, t in insns:
        lo, hi = struct.unpack_from("<QQ", text, a)
        op, name = lo & 0xFFF, opcode(t)
        if seen.setdefault(op, name) != name:
            print(f"error: opcode 0x{op:03x} is both {seen[op]} and {name}", file=sys.stderr)
            errors += 1
        if op == BRA_OP:
            m = re.search(r"(0x[0-9a-f]+)\s*$", t)
            if m and a + 16 + branch_offset(lo, hi) != int(m.group(1), 16):
                print(f"error: branch at 0x{a:x} of {n}: decoded target differs from {t}", file=sys.stderr)
                errors += 1
    return errors


def cubin_kernels(path):
    """{kernel name: .text bytes} of an ELF64 cubin (sections named .text.<kernel>)."""
    with open(path, "rb") as f:
        d = f.read()
    if d[:4] != b"\x7fELF" or d[4] != 2:
        raise ValueError(f"{path}: not an ELF64 file")
    shoff = struct.unpack_from("<Q", d, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
    names = secs[shstrndx][4]
    out = {}
    for s in secs:
        name = d[names + s[0]:d.index(b"\0", names + s[0])].decode()
        if name.startswith(".text."):
            out[name[6:]] = d[s[4]:s[4] + s[5]]
    return out


def spills_between_mma(text):
    """(HMMA count, [(offset, LDL/STL, HMMAs before, HMMAs after)]) of one kernel's code, for the local accesses
    that lie between two HMMAs."""
    found = []
    for off in range(0, len(text) - 15, 16):
        op = struct.unpack_from("<Q", text, off)[0] & 0xFFF
        if op in SM90_OPS:
            found.append((off, SM90_OPS[op]))
    mma = [o for o, k in found if k in ("HMMA", "HGMMA")]
    out = []
    for off, kind in found:
        if kind not in ("HMMA", "HGMMA"):
            before = sum(1 for o in mma if o < off)
            if 0 < before < len(mma):
                out.append((off, kind, before, len(mma) - before))
    return len(mma), out


def main_spills(argv):
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        all_kernels = cubin_kernels(argv[0])
    except (OSError, ValueError, struct.error) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    kernels = {n: t for n, t in all_kernels.items() if (argv[1] if len(argv) > 1 else "decode_fast") in n}
    readable = demangle(sorted(kernels))
    for n in sorted(kernels):
        nmma, sp = spills_between_mma(kernels[n])
        what = " ".join(f"{k}@{o:x} (MMA {b} | {a})" for o, k, b, a in sp) or "none"
        print(f"{readable.get(n, n)}\n    HMMA / HGMMA {nmma}, local accesses between them: {what}")
    return 0


def main_same(argv):
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        files = [cubin_kernels(p) for p in argv]
    except (OSError, ValueError, struct.error) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    readable = demangle(sorted(set().union(*files)))
    if len(files) == 2:
        a, b = files
        for n in sorted(set(a) | set(b)):
            what = ("same" if a[n] == b[n] else "differs") if n in a and n in b else ("A only" if n in a else "B only")
            print(f"{what:8s} {readable.get(n, n)}")
        return 0
    a, b, c = files
    rc = 0
    for n in sorted(c):
        src = [side for side, f in (("A", a), ("B", b)) if f.get(n) == c[n]]
        if not src:
            rc = 1
        print(f"{' and '.join(src) or 'neither':8s} {readable.get(n, n)}")
    return rc


def loop_records(path, all_kernels=False):
    """{kernel: {"loop", "hmma", "hgmma", "spills"}} of the kernels of a cubin that have a main loop: the loop's
    instructions, HMMAs and HGMMAs (main_loop_body) and the kernel's local loads / stores between them
    (spills_between_mma); with all_kernels also {"local"} of every other kernel, its local loads / stores (LDL /
    STL: spill code, or a local array)."""
    insns, texts = parse_local(path), cubin_kernels(path)
    out = {}
    for n in sorted(insns):
        body = main_loop_body(insns[n])
        # an anonymous namespace's mangled name carries a hash of the source's path: zeroed, so that clones agree
        key = re.sub(r"_GLOBAL__N__[0-9a-f]{8}_", "_GLOBAL__N__00000000_", n)
        if body is not None:
            out[key] = {"loop": len(body), "hmma": body.count("HMMA"), "hgmma": body.count("HGMMA"),
                        "spills": len(spills_between_mma(texts[n])[1])}
        elif all_kernels:
            out[key] = {"local": sum(1 for _, t in insns[n] if t in ("LDL", "STL"))}
    return out


def budget_of(doc):
    """(nvcc version, {cubin name: {kernel: record}}) of a loaded budget file; ValueError where it is malformed."""
    def record(r):
        keys = ("local",) if isinstance(r, dict) and set(r) == {"local"} else ("loop", "hmma", "hgmma", "spills")
        return isinstance(r, dict) and all(isinstance(r.get(x), int) and r[x] >= 0 for x in keys)

    ok = isinstance(doc, dict) and isinstance(doc.get("nvcc"), str) and isinstance(doc.get("cubins"), dict)
    ok = ok and all(isinstance(k, dict) and all(record(r) for r in k.values()) for k in doc["cubins"].values())
    if not ok:
        raise ValueError('expected {"nvcc": "V...", "cubins": {NAME: {kernel: {"loop", "hmma", "hgmma", "spills"} '
                         'or {"local"}}}}')
    return doc["nvcc"], doc["cubins"]


def nvcc_version(nvcc):
    """The compiler's version as `nvcc --version` prints it last on its release line, e.g. V13.0.88."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release [0-9.]+, (V[0-9][0-9.]*)", out)
    if not m:
        raise ValueError(f"{nvcc} --version names no release")
    return m.group(1)


def check_budget(budget, found, readable=None):
    """(problems, notes): lines saying where `found` ({cubin name: loop_records}) exceeds `budget` (the same shape)
    and where it is below it."""
    readable = readable or {}
    problems, notes = [], []

    def bound(got, recorded, line):  # a count over its record is a problem, under it a note
        if got != recorded:
            (problems if got > recorded else notes).append(line)

    for f in sorted(set(budget) | set(found)):
        if f not in found:
            problems.append(f"{f}: in the budget, but no cubin of it was given")
            continue
        if f not in budget:
            problems.append(f"{f}: no budget recorded for it")
            continue
        b, k = budget[f], found[f]
        for n in sorted(set(b) | set(k)):
            name = f"{f}: {readable.get(n, n)}"
            rb, rk = b.get(n), k.get(n)
            if n not in k:
                problems.append(f"{name}: in the budget, but not in the cubin")
            elif n not in b:
                problems.append(f"{name}: a kernel that the budget lacks")
            elif ("local" in rb) != ("local" in rk):
                problems.append(f"{name}: " + ("has a main loop now" if "local" in rb else "has no main loop now"))
            elif "local" in rk:
                bound(rk["local"], rb["local"], f"{name}: {rk['local']} local loads / stores, {rb['local']} recorded")
            else:
                for x in ("hmma", "hgmma"):
                    if rk[x] != rb[x]:
                        problems.append(f"{name}: {rk[x]} {x.upper()} in the main loop, {rb[x]} recorded")
                bound(rk["loop"], rb["loop"], f"{name}: main loop {rk['loop']} instructions, {rb['loop']} recorded "
                                              f"({rk['loop'] - rb['loop']:+d})")
                bound(rk["spills"], rb["spills"], f"{name}: {rk['spills']} local loads / stores between the products, "
                                                  f"{rb['spills']} recorded")
    return problems, notes


def kernel_counts(found):
    """'N kernels (M with a main loop)' of loop_records per cubin."""
    recs = [r for k in found.values() for r in k.values()]
    return f"{len(recs)} kernels ({sum(1 for r in recs if 'loop' in r)} with a main loop)"


def short_names(names):
    """Demangled kernel names without the kvq::cuda namespaces and the parameter list, for messages."""
    out = {}
    for n, d in demangle(names).items():
        d = re.sub(r"kvq::cuda::(detail::)?", "", d)
        out[n] = re.sub(r"^void ", "", re.sub(r"\((DecodeParams|Mla\w*Params)[^()]*\)$", "", d))
    return out


def main_budget(argv):
    write = "--write" in argv
    argv = [x for x in argv if x != "--write"]
    nvcc = None
    if "--nvcc" in argv:
        i = argv.index("--nvcc")
        if i + 1 >= len(argv):
            print(__doc__, file=sys.stderr)
            return 2
        nvcc = argv[i + 1]
        del argv[i:i + 2]
    if len(argv) < 2 or not all("=" in a and a.index("=") > 0 for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    budget_path = argv[0]
    cubins = dict(a.split("=", 1) for a in argv[1:])
    if nvcc is None:
        nvcc = "nvcc" if any(os.access(os.path.join(d, "nvcc"), os.X_OK)
                             for d in os.environ.get("PATH", "").split(os.pathsep)) else "/usr/local/cuda/bin/nvcc"
    try:
        version = nvcc_version(nvcc)
        found = {f: loop_records(p, all_kernels=True) for f, p in cubins.items()}
    except (OSError, ValueError, struct.error, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if write:
        with open(budget_path, "w") as f:
            json.dump({"nvcc": version, "cubins": found}, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {budget_path}: {kernel_counts(found)}, nvcc {version}")
        return 0
    try:
        with open(budget_path) as f:
            recorded, cubins_b = budget_of(json.load(f))
    except (OSError, ValueError) as e:
        print(f"error: {budget_path}: {e}", file=sys.stderr)
        return 1
    if recorded != version:
        print(f"skipped: {budget_path} was recorded with nvcc {recorded}, {nvcc} is {version}")
        return 77
    # only the cubins given are checked; a budget entry of another source file is not missing
    budget = {f: cubins_b[f] for f in found if f in cubins_b}
    readable = short_names(sorted(set().union(*[set(k) for k in list(found.values()) + list(budget.values())])))
    problems, notes = check_budget(budget, found, readable)
    for line in notes:
        print(f"below the budget (write it again to keep): {line}")
    for line in problems:
        print(f"over the budget: {line}")
    print(f"{'FAILED' if problems else 'passed'}: {kernel_counts(found)} in {len(found)} cubins against {budget_path} "
          f"(nvcc {version})")
    return 1 if problems else 0


def main(argv):
    if argv[:1] == ["--budget"]:
        return main_budget(argv[1:])
    if argv[:1] == ["--spills"]:
        return main_spills(argv[1:])
    if argv[:1] == ["--same"]:
        return main_same(argv[1:])
    if argv[:1] == ["--opmap"]:
        return main_opmap(argv[1:])
    local = "--local" in argv
    hist = "--hist" in argv
    argv = [x for x in argv if x not in ("--local", "--hist")]
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        files = [parse_local(p) if local else parse(p) for p in argv]
    except (OSError, ValueError, struct.error, subprocess.CalledProcessError) as e:
        print(f"error: {e} (cuobjdump is on GPU hosts; here, --spills reads a cubin)", file=sys.stderr)
        return 1
    names = sorted(set(files[0]).intersection(*files[1:]))
    readable = demangle(names)
    for n in names:
        cols = []
        for f in files:
            loop = main_loop(f[n])
            nk = sum(1 for _, t in f[n] if opcode(t) not in ("NOP",))
            cols.append((nk, loop))
        if all(c[1] is None for c in cols):
            continue
        txt = " | ".join(f"total {nk:6d} loop {loop['loop']:>5} (HMMA {loop['HMMA']}, LDS {loop['LDS']}, PRMT {loop['PRMT']}, "
                         f"LOP3 {loop['LOP3']})" if loop else f"total {nk:6d} loop     -" for nk, loop in cols)
        if len(cols) == 2 and cols[0][1] and cols[1][1]:
            txt += f" | loop {cols[1][1]['loop'] - cols[0][1]['loop']:+d}, total {cols[1][0] - cols[0][0]:+d}"
        print(f"{readable.get(n, n)}\n    {txt}")
        if hist:
            for f in files:
                body = main_loop_body(f[n]) or []
                counts = sorted(((body.count(o), o) for o in set(body)), key=lambda x: (-x[0], x[1]))
                print("    loop: " + ", ".join(f"{o} {c}" for c, o in counts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
