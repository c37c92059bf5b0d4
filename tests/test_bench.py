"""The benchmark as it runs on a machine without a GPU (CPU defaults, reference backend over gloo,
host wall times), its report (text table, JSON, markdown, plot), its argument checks, and the GPU
report rendered from a made-up result (there is no GPU here)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

import torch

from megatron_nccl_ep.bench import cli, kernels, markdown, plot, report, runner, sweeps, team
from megatron_nccl_ep.bench.__main__ import main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_TOKENS = (64,)
STAGING_CHUNK = 24  # passed through to the groups; named in the shape and the table
STAGING_DEPTH = 3  # likewise
KERNEL_OPS = ("handle: create + count read", "dispatch", "combine")
MEGATRON_ITEMS = ("dispatch", "combine", "fwd_bwd", "expert_fwd_bwd")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One CPU run end to end for the tests that read its outputs (it starts three sets of
    processes: the kernels section, the megatron section and one sweep point)."""
    folder = tmp_path_factory.mktemp("bench")
    out, md = folder / "bench.json", folder / "bench.md"
    flags = ["--json", str(out), "--markdown", str(md), "--iters", "2",
             "--sweep-tokens", ",".join(map(str, SWEEP_TOKENS)),
             "--staging-chunk-tokens", str(STAGING_CHUNK), "--staging-depth", str(STAGING_DEPTH)]
    proc = subprocess.run([sys.executable, "-m", "megatron_nccl_ep.bench", *flags],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    with open(out) as f:
        result = json.load(f)
    table = proc.stdout[proc.stdout.index(report.TABLE_MARKER):]
    return {"stdout": proc.stdout, "table": table, "result": result, "json": out, "md": md,
            "flags": flags}


def _positive_median(items: dict, name: str) -> float:
    assert name in items, sorted(items)
    median = items[name]["median_ms"]
    assert median > 0, (name, items[name])
    return median


def test_cpu_run_measures_every_item_and_its_checks_pass(cpu_run):
    result = cpu_run["result"]
    assert result["errors"] == []
    defaults = cli.DEVICE_DEFAULTS["cpu"]
    shape = result["shape"]
    assert (shape["tokens"], shape["hidden"], shape["topk"], shape["experts"]) == (
        defaults["tokens"], defaults["hidden"], defaults["topk"], defaults["experts"])
    assert (shape["backend"], shape["ranks"], result["meta"]["device"]) == ("torch", 2, "cpu")
    assert (shape["staging_chunk_tokens"], shape["staging_depth"]) == (STAGING_CHUNK,
                                                                       STAGING_DEPTH)
    kernels = result["kernels"]
    for op in KERNEL_OPS:
        _positive_median(kernels, f"{op} (host wall)")
        assert kernels[f"{op} (host wall)"]["iters"] == 2
    for op in ("dispatch", "combine"):
        # The rank-major layout through the same library moves the same link bytes.
        rank_major = f"{op}, rank-major (host wall)"
        _positive_median(kernels, rank_major)
        assert kernels[rank_major]["phys_bytes"] == kernels[f"{op} (host wall)"]["phys_bytes"]
    rows_check = result["checks"]["rows / sum(tokens_per_expert) / expected"]
    assert sorted(rows_check) == ["0", "1"]
    assert all(value.startswith("ok ") for value in rows_check.values()), rows_check
    roundtrip = result["checks"]["combine(dispatch(x)) vs K*x, rel err"]
    assert all(float(value) < 1e-2 for value in roundtrip.values()), roundtrip
    for item in MEGATRON_ITEMS:
        _positive_median(result["megatron"], f"nccl_ep.{item}")
    assert {name.split(".")[0] for name in result["megatron"]} == {"nccl_ep"}
    assert result["team"] == [] and "ceilings" not in result
    # The machine as the parent read it once, and what only the workers know.
    assert set(result["meta"]) == {"torch", "python", "source", "device", "command",
                                   "started_utc", "env", "cpu_model", "cpu_count", "device_name",
                                   "gpu_count", "backend_resolved"}
    assert (result["meta"]["device_name"], result["meta"]["gpu_count"]) == ("cpu", 0)
    assert result["meta"]["backend_resolved"] == "torch"


def test_cpu_table_shows_host_wall_times_only(cpu_run):
    table, result = cpu_run["table"], cpu_run["result"]
    assert "host wall time, reference backend (torch) over gloo, 2 processes" in table
    assert "not GPU speed" in table
    for gpu_word in ("SMs", "SM budget", "(kernel)", "(e2e)", "GB/s", "floor", "NCCL"):
        assert gpu_word not in table, gpu_word
    assert result["shape"]["num_sms"] is None
    assert f"staging chunks of {STAGING_CHUNK} tokens" in table
    assert f"staging depth {STAGING_DEPTH}" in table
    items = list(result["kernels"]) + [n for p in result["sweeps"] for n in p["items"]]
    assert all(name.endswith("(host wall)") for name in items), items
    for op in KERNEL_OPS:
        row = next(line for line in table.splitlines() if line.startswith(op + " "))
        # the op and one time in ms, as the JSON has it
        assert float(row.split()[-1]) == pytest.approx(
            result["kernels"][f"{op} (host wall)"]["median_ms"], abs=0.006)


def test_sweep_has_one_entry_per_point(cpu_run):
    table, result = cpu_run["table"], cpu_run["result"]
    sweep = result["sweeps"]
    assert [(p["tokens"], p["num_sms"]) for p in sweep] == [(t, None) for t in SWEEP_TOKENS]
    for point in sweep:
        for op in ("dispatch", "combine"):
            _positive_median(point["items"], f"{op} (host wall)")
        rows_check = point["checks"]["rows / sum(tokens_per_expert) / expected"]
        assert all(value.startswith("ok ") for value in rows_check.values()), rows_check
        row = next(line.split() for line in table.splitlines()
                   if line.split()[:1] == [str(point["tokens"])])
        assert len(row) == 3, row  # tokens, dispatch and combine host wall ms


def test_markdown_names_the_sources_the_command_and_every_table(cpu_run):
    text = cpu_run["md"].read_text()
    meta = cpu_run["result"]["meta"]
    sha = meta["source"]["sources_sha256"]
    assert re.fullmatch(r"[0-9a-f]{16}", sha)
    assert f"`{sha}`" in text
    assert meta["command"].endswith("-m megatron_nccl_ep.bench " + shlex.join(cpu_run["flags"]))
    assert f"`{meta['command']}`" in text
    assert "256 tokens per rank, hidden 256, top-2 of 16 experts, bf16, no SM budget" in text
    for heading in ("## Kernels", "### Rank-major layout", "## Megatron dispatchers",
                    "## Sweeps", "## Checks"):
        assert heading in text, heading
    assert "| op | host wall (ms) |" in text
    assert re.search(r"^\| nccl_ep \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", text, re.M)
    assert "(kernel)" not in text and "GB/s" not in text and "## Ceilings" not in text
    png = cpu_run["json"].with_suffix(".png")
    assert (f"Plot: `{png.name}`" in text) == png.exists()


def test_plot_or_note(cpu_run):
    stdout, png = cpu_run["stdout"], cpu_run["json"].with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plot: {png}" in stdout
    else:
        assert not png.exists()
        assert "no plot: matplotlib is not installed" in stdout


def test_plot_without_a_sweep_says_so(tmp_path):
    result = {"sweeps": [], "meta": {"device": "cpu"}}
    png = tmp_path / "p.png"
    assert plot.write(result, str(png)) == (
        f"no plot: no sweep in this run (--sweep-tokens, --sweep-sms); {png} not written")
    assert not png.exists()


def test_plot_series_include_the_kernels_section_point(cpu_run):
    # The sweeps' x values, plus the kernels section at (--tokens, --num-sms), in x order.
    result = cpu_run["result"]
    (label, series), = sweeps.series(result)
    assert label == "tokens per rank"
    assert [x for x, _ in series] == sorted({result["shape"]["tokens"], *SWEEP_TOKENS})
    assert dict(series)[result["shape"]["tokens"]] == result["kernels"]


def test_floors_take_the_larger_of_hbm_and_link():
    # HBM 4000 GB/s; the link: every GPU copying (200 GB/s) before one direction alone (400).
    ceilings = {"HBM copy, read+write (per GPU)": {"phys_GBps": 4000.0},
                "peer copy GPU0->GPU1 (copy engine)": {"phys_GBps": 400.0},
                "peer copy, all GPUs at once (per GPU)": {"phys_GBps": 200.0}}
    result = {"ceilings": ceilings, "kernels": {
        "dispatch (kernel)": {"median_ms": 1.0, "hbm_bytes": 2e9, "phys_bytes": 5e7},
        "combine (kernel)": {"median_ms": 1.25, "hbm_bytes": 2e9, "phys_bytes": 2e8},
        "dispatch, rank-major (kernel)": {"median_ms": 0.5, "phys_bytes": 5e7}},
        "sweeps": [{"items": {"dispatch (kernel)": {"median_ms": 2.0, "hbm_bytes": 4e9,
                                                    "phys_bytes": 0.0}}}]}
    report.add_floors(result)
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
    report.add_floors(bare)
    assert "floor_us" not in bare["kernels"]["dispatch (kernel)"]


def _gpu_result() -> dict:
    """What a one-GPU run's result holds, with made-up times."""
    def row(ms, **extra):
        return {"median_ms": ms, "min_ms": 0.9 * ms, "p90_ms": 1.1 * ms, "iters": 40, **extra}

    kernel_bytes = {"hbm_bytes": 4e8, "phys_bytes": 0.0, "phys_GBps": 0.0, "logical_GBps": 500.0}
    return {
        "meta": {"device": "cuda", "gpu_count": 1, "device_name": "GPU-X", "sm_count": 132,
                 "gpu_memory_gib": 140.0, "driver": "1.2.3", "torch": "T", "cuda_runtime": "C",
                 "nccl": "N", "source": {"sources_sha256": "0123456789abcdef", "git": None},
                 "command": "python3 -m megatron_nccl_ep.bench --json b.json"},
        "shape": {"tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256, "dtype": "bf16",
                  "num_sms": 24, "ranks": 1, "backend": "cuda", "recv_mode": "exact"},
        "args": {"iters": 40, "warmup": 5, "rotate": 4, "sweep_tokens": [], "sweep_sms": []},
        "ceilings": {"HBM copy, read+write (per GPU)": row(0.5, phys_GBps=4000.0)},
        "kernels": {**{f"{op} ({mode})": row(0.3, **kernel_bytes) for op in ("dispatch", "combine")
                       for mode in ("kernel", "e2e")},
                    "handle: create + count read (kernel)": row(0.03),
                    "handle: create + count read (e2e)": row(0.05)},
        "megatron": {f"nccl_ep.{op}": row(1.0) for op in MEGATRON_ITEMS},
        "team": [{"world": 2, "num_sms": 24, "checks": {},
                  "items": {op: row(0.6, busy_ms=0.5) for op in team.OPS}},
                 {"world": 8, "num_sms": 24, "skipped": team.skip_reason(8, 24, 132, 32)}],
        "sweeps": [], "checks": {}, "errors": [], "sections": {},
    }


def test_gpu_report_names_the_sm_budget_the_modes_and_the_team_proxy():
    result = _gpu_result()
    report.add_floors(result)
    table = report.format_table(result)
    assert "bf16, 24 SMs, 1 ranks" in table and "NCCL N" in table
    assert "dispatch (kernel)" in table and "combine (e2e)" in table
    assert "host wall" not in table
    assert "a proxy (one GPU: no NVLink, one HBM shared by every rank)" in table
    assert re.search(r"^\s+8 skipped: 8 ranks x 24 SMs > the GPU's 132 SMs", table, re.M)
    text = markdown.render(result)
    assert "- machine: 1 x GPU-X (132 SMs, 140.0 GiB), driver 1.2.3; torch T, CUDA C, NCCL N" \
        in text
    assert "SM budget 24 per rank" in text
    assert "Ceilings of this run: HBM copy 4000.0 GB/s" in text
    # dispatch: kernel and e2e side by side; floor = 4e8 B / 4000 GB/s = 100 us of 300 us
    assert "| dispatch | 300.0 | 300.0 | 0.0 | 500.0 | 100.0 | 33 |" in text
    assert "| 2 | dispatch | 600.0 | 500.0 | 540.0 |" in text
    assert "- EP=8: skipped, 8 ranks x 24 SMs" in text


def test_collect_keeps_point_facts_apart_from_the_items():
    # A team worker reports its staging choices once per point, as ints, not per item.
    records = [{"kind": "times", "item": op, "rank": 0, "times_ms": [1.0, 2.0, 3.0],
                "extra": {"busy_ms": 0.5}} for op in team.OPS]
    records += [{"kind": "point", "rank": 0, "data": {"staging_chunk_tokens": 64,
                                                      "staging_depth": 2}},
                {"kind": "info", "rank": 0, "data": {"backend_resolved": "cuda"}}]
    items, errors, info, checks, point = runner.collect(records)
    assert errors == [] and checks == {} and info == {"0": {"backend_resolved": "cuda"}}
    assert point == {"0": {"staging_chunk_tokens": 64, "staging_depth": 2}}
    assert all(set(items[op]) >= {"median_ms", "busy_ms"} for op in team.OPS)
    assert not any("staging_depth" in row for row in items.values())


def test_input_sets_are_the_seeded_draws_and_rows_are_counted_per_rank():
    args = cli.parse_args(["--device", "cpu", "--tokens", "32", "--experts", "8", "--topk", "3",
                           "--hidden", "16"])
    me = runner.Rank(1, 2, "test", args, None, process_groups=False)
    topk, probs, x = me.input_set(2)

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    assert torch.equal(topk, torch.rand(32, 8, generator=gen(1_000_003 * 3 + 1)).topk(3).indices)
    assert torch.equal(probs, torch.rand(32, 3, generator=gen(7 * 2 + 1)).softmax(-1))
    assert torch.equal(x, torch.randn(32, 16, generator=gen(100 + 10 * 2 + 1)).bfloat16())
    topk[0, 0] = -1  # a masked slot is no row
    per_rank = 8 // 2
    assert kernels.rows_per_rank(topk, 8, 2) == [
        int(((topk >= 0) & (topk // per_rank == d)).sum()) for d in range(2)]


def test_item_names_and_timing_modes():
    assert runner.item_name("dispatch", runner.kernel_mode("cuda")) == "dispatch (kernel)"
    assert runner.item_name("combine", runner.e2e_mode("cuda")) == "combine (e2e)"
    assert runner.kernel_mode("cpu") == runner.e2e_mode("cpu") == "host wall"
    assert runner.item_name(kernels.RANK_MAJOR.format("dispatch"), "host wall") == \
        "dispatch, rank-major (host wall)"


def test_team_skips_what_cannot_be_resident_or_queued():
    assert team.skip_reason(4, 24, 132, 8) == ""
    assert "SMs" in team.skip_reason(8, 24, 132, 32)  # 192 SMs of CTAs on 132
    assert "CUDA_DEVICE_MAX_CONNECTIONS >= 16" in team.skip_reason(8, 16, 132, 8)


def test_team_time_runs_from_the_last_rank_in_to_the_last_rank_out():
    # Two iterations of two ranks, (start, end) in ms on one clock.
    collective, busy = team._summarize([[(0.0, 5.0), (2.0, 6.0)], [(1.0, 3.0), (0.0, 4.0)]])
    assert collective == [4.0, 3.0]
    assert busy == pytest.approx(4.0)  # median of 5, 4, 2, 4


def test_explicit_flags_win_over_cpu_defaults():
    args = cli.parse_args(["--device", "cpu", "--tokens", "100", "--sections", "kernels",
                           "--megatron-dispatchers", "alltoall", "--sweep-tokens", "32,64"])
    assert (args.tokens, args.sections, args.megatron_dispatchers) == (
        100, ["kernels"], ["alltoall"])
    assert args.hidden == cli.DEVICE_DEFAULTS["cpu"]["hidden"]  # not given: the CPU default
    assert args.num_sms is None and args.team_sizes == []
    assert cli.sweep_points(args) == [(32, None), (64, None)]
    assert args.plot is None  # no --json, no --plot


@pytest.mark.parametrize("argv, says", [
    (["--sweep-tokens", "all"], "--sweep-tokens: expected comma-separated integers >= 1"),
    (["--sweep-tokens", "0"], "--sweep-tokens: expected comma-separated integers >= 1"),
    (["--sweep-sms", "x"], "--sweep-sms: expected comma-separated integers >= 1 or 'all'"),
    (["--staging-chunk-tokens", "-1"], "--staging-chunk-tokens must be >= 0"),
    (["--staging-depth", "1"], "--staging-depth must be 0"),
    (["--sections", "kernels,fast"], "unknown sections ['fast']"),
    (["--experts", "15"], "--experts (15) must be a multiple of the process count (2)"),
    (["--num-sms", "8"], "--num-sms: the reference backend on cpu has no SM budget"),
    (["--sweep-sms", "8"], "--sweep-sms: the reference backend on cpu has no SM budget"),
    (["--sections", "ceilings"], "--sections ceilings measures GPU hardware"),
    (["--sections", "team"], "--sections team needs a GPU"),
    (["--team-sizes", "2"], "--team-sizes: the team section needs a GPU"),
])
def test_bad_flags_are_refused_with_a_reason(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_dry_run_starts_nothing_and_sets_no_environment(capsys):
    before = dict(os.environ)
    assert main(["--device", "cpu", "--dry-run", "--sweep-tokens", "64"]) == 0
    assert dict(os.environ) == before
    out = capsys.readouterr().out
    assert out.startswith("plan: sections ['kernels', 'megatron'] on 2 cpu processes")
    assert "kernels(64 tokens)" in out and report.TABLE_MARKER in out


def test_source_version_is_importable_from_the_package():
    from megatron_nccl_ep.bench import source_version

    version = source_version()
    assert re.fullmatch(r"[0-9a-f]{16}", version["sources_sha256"])
    assert set(version) == {"git", "sources_sha256"}
