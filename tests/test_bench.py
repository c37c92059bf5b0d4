"""The benchmark as a newcomer runs it on a machine without a GPU: no shape flags, CPU defaults,
exit 0, kernels measured, the GPU-only parts skipped with a note; and a small tokens sweep with
its table rows and its plot (or the note saying why there is none)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megatron_nccl_ep import bench

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_TOKENS = (64, 128)
STAGING_CHUNK = 24  # passed through to the groups; named in the shape and the table
STAGING_DEPTH = 3  # likewise


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One run for every test here (it starts a few sets of processes: ~20 s on 2 cores)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    command = [sys.executable, "-m", "megatron_nccl_ep.bench", "--json", str(out), "--iters", "2",
               "--sweep-tokens", ",".join(map(str, SWEEP_TOKENS)),
               "--staging-chunk-tokens", str(STAGING_CHUNK), "--staging-depth", str(STAGING_DEPTH)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    with open(out) as f:
        return proc.stdout, json.load(f), out


def _positive_median(items: dict, name: str) -> float:
    assert name in items, sorted(items)
    median = items[name]["median_ms"]
    assert median > 0, (name, items[name])
    return median


def test_cpu_defaults_measure_kernels(cpu_run):
    _, result, _ = cpu_run
    assert result["errors"] == []
    cpu = bench.DEVICE_DEFAULTS["cpu"]
    shape = result["shape"]
    assert (shape["tokens"], shape["hidden"], shape["topk"], shape["experts"]) == (
        cpu["tokens"], cpu["hidden"], cpu["topk"], cpu["experts"])
    assert (shape["backend"], shape["ranks"], result["meta"]["device"]) == ("torch", 2, "cpu")
    assert shape["staging_chunk_tokens"] == STAGING_CHUNK
    assert f"staging chunks of {STAGING_CHUNK} tokens" in cpu_run[0]
    assert shape["staging_depth"] == STAGING_DEPTH
    assert f"staging depth {STAGING_DEPTH}" in cpu_run[0]
    for op in ("dispatch", "combine"):
        for mode in ("kernel", "e2e"):
            _positive_median(result["kernels"], f"{op} ({mode})")
        assert result["kernels"][f"{op} (kernel)"]["iters"] == 2
        # DeepEP's rank-major layout through the same library: the lower bound, same link bytes
        lower = f"{op}, rank-major (kernel)"
        _positive_median(result["kernels"], lower)
        assert result["kernels"][lower]["phys_bytes"] == \
            result["kernels"][f"{op} (kernel)"]["phys_bytes"]
    rows_check = result["checks"]["rows / sum(tokens_per_expert) / expected"]
    assert sorted(rows_check) == ["0", "1"]
    assert all(value.startswith("ok ") for value in rows_check.values()), rows_check


def test_cpu_skips_gpu_only_parts_and_says_so(cpu_run):
    stdout, result, _ = cpu_run
    note = result["note"]
    assert note.startswith("cpu: measured kernels, megatron (nccl_ep)"), note
    assert "skipped ceilings" in note and "alltoall" in note, note
    assert note in stdout
    assert "ceilings" not in result["sections"] and not result.get("ceilings")
    assert result["megatron"], "the nccl_ep dispatcher is measured on CPU"
    assert {name.split(".")[0] for name in result["megatron"]} == {"nccl_ep"}


def test_sweep_has_one_entry_per_point(cpu_run):
    stdout, result, _ = cpu_run
    sweeps = result["sweeps"]
    assert [(p["tokens"], p["num_sms"]) for p in sweeps] == [
        (tokens, result["shape"]["num_sms"]) for tokens in SWEEP_TOKENS]
    for point in sweeps:
        for op in ("dispatch", "combine"):
            _positive_median(point["items"], f"{op} (kernel)")
        rows_check = point["checks"]["rows / sum(tokens_per_expert) / expected"]
        assert all(value.startswith("ok ") for value in rows_check.values()), rows_check
        row = next(line.split() for line in stdout.splitlines()
                   if line.split()[:2] == [str(point["tokens"]), str(point["num_sms"])])
        # tokens, SMs, then per op time, two bandwidths and floor % ("-": no ceilings on CPU)
        assert len(row) == 10, row


def test_floors_take_the_larger_of_hbm_and_link():
    # HBM 4000 GB/s; the link: both GPUs copying (200 GB/s) before one direction alone (400).
    ceilings = {"HBM copy, read+write (per GPU)": {"phys_GBps": 4000.0},
                "peer copy GPU0->GPU1 (copy engine)": {"phys_GBps": 400.0},
                "peer copy, all GPUs at once (per GPU)": {"phys_GBps": 200.0}}
    result = {"ceilings": ceilings, "kernels": {
        "dispatch (kernel)": {"median_ms": 1.0, "hbm_bytes": 2e9, "phys_bytes": 5e7},
        "combine (kernel)": {"median_ms": 1.25, "hbm_bytes": 2e9, "phys_bytes": 2e8},
        "dispatch, rank-major (kernel)": {"median_ms": 0.5, "phys_bytes": 5e7}},
        "sweeps": [{"items": {"dispatch (kernel)": {"median_ms": 2.0, "hbm_bytes": 4e9,
                                                    "phys_bytes": 0.0}}}]}
    bench.add_floors(result)
    kernels = result["kernels"]
    # HBM floor 500 us beats the link's 250 us; the link's 1000 us beats HBM's 500 us.
    assert (kernels["dispatch (kernel)"]["floor_us"], kernels["dispatch (kernel)"]["floor_pct"]) \
        == pytest.approx((500.0, 50.0))
    assert (kernels["combine (kernel)"]["floor_us"], kernels["combine (kernel)"]["floor_pct"]) \
        == pytest.approx((1000.0, 80.0))
    assert "floor_us" not in kernels["dispatch, rank-major (kernel)"]  # no hbm_bytes: no floor
    sweep_row = result["sweeps"][0]["items"]["dispatch (kernel)"]
    assert (sweep_row["floor_us"], sweep_row["floor_pct"]) == pytest.approx((1000.0, 50.0))
    # Without the HBM ceiling (no ceilings section) nothing gets a floor.
    bare = {"kernels": {"dispatch (kernel)": {"median_ms": 1.0, "hbm_bytes": 2e9}}, "sweeps": []}
    bench.add_floors(bare)
    assert "floor_us" not in bare["kernels"]["dispatch (kernel)"]


def test_plot_series_include_the_kernels_section_point(cpu_run):
    # The sweeps' x values, plus the kernels section at (--tokens, --num-sms), in x order.
    _, result, _ = cpu_run
    (label, series), = bench.sweep_series(result)
    assert label == "tokens per rank"
    xs = [x for x, _ in series]
    assert xs == sorted({result["shape"]["tokens"], *SWEEP_TOKENS}), xs
    assert dict(series)[result["shape"]["tokens"]] is result["kernels"]


def test_plot_or_note(cpu_run):
    stdout, _, out = cpu_run
    png = out.with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plot: {png}" in stdout
    else:
        assert not png.exists()
        assert "no plot: matplotlib is not installed" in stdout


def test_explicit_flags_win_over_cpu_defaults():
    args = bench.parse_args(["--device", "cpu", "--tokens", "100", "--sections", "ceilings",
                             "--megatron-dispatchers", "alltoall", "--sweep-sms", "8,all"])
    assert (args.tokens, args.sections, args.megatron_dispatchers) == (
        100, ["ceilings"], ["alltoall"])
    assert args.hidden == bench.DEVICE_DEFAULTS["cpu"]["hidden"]  # not given: the CPU default
    assert args.sweep_sms == [8, os.cpu_count()]
    assert args.plot is None  # no --json, no --plot


@pytest.mark.parametrize("argv", [["--sweep-tokens", "all"], ["--sweep-tokens", "0"],
                                  ["--sweep-sms", "x"], ["--plot", "a.png"],
                                  ["--staging-chunk-tokens", "-1"], ["--staging-depth", "1"]])
def test_bad_sweep_and_plot_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
