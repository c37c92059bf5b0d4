"""The GPU script's reader of Nsight Compute source pages (tests/gpu/ncu_hot_lines.py)."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "gpu", "ncu_hot_lines.py")
_spec = importlib.util.spec_from_file_location("ncu_hot_lines", _PATH)
ncu_hot_lines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_hot_lines)

HEADER = ["#", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued)"]


def test_each_kernel_block_ranks_its_lines_by_samples():
    rows = [["Kernel A"], HEADER, ["1", "a = 0;", "1,000", "5"], ["2", "b = x[i];", "3,000", "9"],
            ["3", "// none", "0", "0"],
            HEADER, ["7", "wait();", "50", "50"], ["8", "sum += v;", "150", "10"]]
    lines = ncu_hot_lines.hot_lines(rows, top=2)
    assert lines == [
        "-- 4000 warp-stall samples; top 2 lines",
        " 75.00%  line     2  b = x[i];",
        " 25.00%  line     1  a = 0;",
        "-- 200 warp-stall samples; top 2 lines",
        " 75.00%  line     8  sum += v;",
        " 25.00%  line     7  wait();",
    ]


def test_a_page_without_sampling_gives_nothing():
    assert ncu_hot_lines.hot_lines([["#", "Source"], ["1", "a = 0;"]], top=5) == []


def test_without_sampling_the_lines_rank_by_instructions_executed():
    rows = [["#", "Source", "Instructions Executed"], ["4", "x += y;", "300"], ["5", "z = 0;", "100"]]
    assert ncu_hot_lines.hot_lines(rows, top=1) == [
        "-- 400 instructions executed; top 1 lines",
        " 75.00%  line     4  x += y;",
    ]


def test_a_sass_page_names_instructions_by_address():
    rows = [["Address", "Source", "Warp Stall Sampling (All Samples)"],
            ["0x7f00", "UBLKCP.S.G [UR40], [UR38], UR12", "30"], ["0x7f10", "FADD R1, R1, R2", "10"]]
    assert ncu_hot_lines.hot_lines(rows, top=1) == [
        "-- 40 warp-stall samples; top 1 lines",
        " 75.00%  address 0x7f00  UBLKCP.S.G [UR40], [UR38], UR12",
    ]
