"""Checks of the repository's markdown (README.md, docs/, bench/results/, models/README.md).

Every row of a table has as many cells as its header, and every relative link names a file that exists. Results
tables are edited by scripts as grids come in; a row that gained or lost a cell shifts every figure after it into
the wrong column, which no reader can tell from the rendered page.
"""

import glob
import os
import re

ROOT = os.environ.get("KVQ_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))


def markdown_files():
    pats = ["README.md", "docs/*.md", "bench/results/*.md", "models/README.md"]
    out = []
    for p in pats:
        out += sorted(glob.glob(os.path.join(ROOT, p)))
    return out


def cells(line):
    """The cells of a table row: pipes escaped as \\| and pipes inside code spans do not split."""
    s = re.sub(r"\\\|", "", line.strip())
    s = re.sub(r"`[^`]*`", "code", s)
    return s.strip("|").split("|")


DELIM = re.compile(r"^\s*\|[\s:\-|]+\|\s*$")


def table_errors(text, name="text"):
    """(line number, message) for each row whose cell count differs from its table's header."""
    lines = text.splitlines()
    errors = []
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and DELIM.match(lines[i + 1]):
            n = len(cells(lines[i]))
            if len(cells(lines[i + 1])) != n:
                errors.append((i + 2, f"{name}:{i + 2}: delimiter row has {len(cells(lines[i + 1]))} cells, header {n}"))
            j = i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                m = len(cells(lines[j]))
                if m != n:
                    errors.append((j + 1, f"{name}:{j + 1}: {m} cells, header {n}: {lines[j][:80]}"))
                j += 1
            i = j
        else:
            i += 1
    return errors


def link_errors(path):
    text = open(path, encoding="utf-8").read()
    errors = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        target = target.split("#")[0]
        if not os.path.exists(os.path.join(os.path.dirname(path), target)):
            errors.append(f"{os.path.relpath(path, ROOT)}: link to missing {target}")
    return errors


def test_checker_finds_a_shifted_row():
    ok = "| a | b | c |\n|---|--:|---|\n| 1 | 2 | 3 |\n| `x|y` | 2 \\| 3 | 4 |\n"
    assert table_errors(ok) == []
    # The shape of the defect this test exists for: a grid's figures inserted into another table's rows.
    bad = ok + "| tq-4bit | 2.95 / 3.28 | 1056 | 3.88 |\n"
    assert [e[0] for e in table_errors(bad)] == [5]
    assert [e[0] for e in table_errors("| a | b |\n|---|\n| 1 | 2 |\n")] == [2]


def test_tables_have_consistent_rows():
    files = markdown_files()
    assert any(f.endswith("README.md") for f in files)
    errors = []
    for f in files:
        errors += [e[1] for e in table_errors(open(f, encoding="utf-8").read(), os.path.relpath(f, ROOT))]
    assert errors == [], "\n".join(errors)


def test_relative_links_resolve():
    errors = []
    for f in markdown_files():
        errors += link_errors(f)
    assert errors == [], "\n".join(errors)
