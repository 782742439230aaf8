"""bench/ncu_source.py on a hand-made source page: shares by execution count, opcodes, top rows."""
import csv
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import ncu_source  # noqa: E402

COLUMNS = ["Address", "Source", ncu_source.SAMPLES, ncu_source.EXECUTED, "stall_barrier", "stall_long_sb",
           "stall_long_sb (Not Issued)"]


def _page(path, rows):
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Kernel Name", "_toy_kernel", ""])
        out.writerow(COLUMNS)
        out.writerows(rows)
    return str(path)


def test_parts_and_top(tmp_path):
    page = _page(tmp_path / "k.csv", [
        ["0x10", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24", "30", "4,096", "0", "10", "99"],
        ["0x20", "@!P0  BRA 0x40", "10", "4,096", "0", "10", "0"],
        ["0x30", "FMUL R1, R2, R3", "50", "64", "0", "0", "0"],
        ["0x40", "FFMA.FTZ R1, R2, R3, R4", "5", "64", "0", "5", "0"],
        ["0x50", "NOP", "5", "2", "5", "0", "0"],
    ])
    kernel, rows = ncu_source.read_sass(page)
    assert kernel == "_toy_kernel" and len(rows) == 5
    got = ncu_source.parts(rows)
    assert [(n, round(share, 3), count) for n, share, count, _ in got] == [(64, 0.55, 2), (4096, 0.4, 2), (2, 0.05, 1)]
    assert got[0][3] == {"FMUL": 1, "FFMA": 1} and got[1][3] == {"HGMMA": 1, "BRA": 1}
    top = ncu_source.top_instructions(rows, 2)
    assert [round(share, 2) for share, _, _ in top] == [0.5, 0.3]
    # the not-issued column is not a reason of its own
    assert top[1][2] == [(10.0, "long_sb"), (0.0, "barrier")]
    text = ncu_source.report(page)
    assert "_toy_kernel: 5 SASS instructions, 100 stall samples" in text and "ran        64x:  55.0%" in text


def test_refuses_another_page(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Kernel Name"\n"0","k"\n"1","k"\n')
    with pytest.raises(SystemExit, match="not ncu's source page"):
        ncu_source.read_sass(str(path))
