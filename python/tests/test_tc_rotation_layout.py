"""Tests of bench/gpu/tc_rotation_layout.py: the index maps of the tensor-core rotation (docs/kernels.md, "Open").

The script must pass on the maps it documents and fail on a map that keeps each lane's positions consecutive but
breaks the two-tiles-up-to-sign structure of B.
"""

import importlib.util
import os

ROOT = os.environ.get("KVQ_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
_spec = importlib.util.spec_from_file_location("tcr", os.path.join(ROOT, "bench", "gpu", "tc_rotation_layout.py"))
tcr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tcr)


def test_documented_maps_pass():
    assert tcr.main() == 0


def test_other_output_map_fails(monkeypatch, capsys):
    # positions 16 t + j + 8 (n & 1): still 16 consecutive per lane, but the tiles are no longer two up to sign
    monkeypatch.setattr(tcr, "pi", lambda j, n: 16 * (n // 2) + j + 8 * (n & 1))
    assert tcr.main() == 1
    assert "is not H4" in capsys.readouterr().out


def test_non_consecutive_input_map_fails(monkeypatch, capsys):
    # lanes' inputs interleaved (position 4 c' + t): each lane no longer holds a block of 16
    monkeypatch.setattr(tcr, "sigma", lambda kk, c: 4 * (4 * kk + (c & 1) + 2 * (c >= 8)) + (c % 8) // 2)
    assert tcr.main() == 1
    assert "does not hold positions" in capsys.readouterr().out
