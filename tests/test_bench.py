"""The benchmark as it runs on a machine without a GPU (CPU defaults, reference backend over gloo,
host wall times), its report (text table, JSON, markdown, plot), its argument checks, and the GPU
report rendered from a made-up result (there is no GPU here)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import torch

import ep_cases
from benchmarks import (cli, host, kernels, ll, markdown, nodes, plot, readme, report, runner,
                        sweeps, team)
from benchmarks.__main__ import main
from benchmarks.report import source_version
from megatron_nccl_ep import config

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
    proc = subprocess.run([sys.executable, "-m", "benchmarks", *flags],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    with open(out) as f:
        result = json.load(f)
    table = proc.stdout[proc.stdout.index(report.TABLE_MARKER):]
    return {"stdout": proc.stdout, "stderr": proc.stderr, "table": table, "result": result,
            "json": out, "md": md, "flags": flags}


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


def test_cpu_run_prints_no_dependency_notices(cpu_run):
    # Megatron's and torch's notices about optional packages, once per worker, are not the
    # bench's: the run shows its own lines only (python -W brings them back).
    output = cpu_run["stdout"] + cpu_run["stderr"]
    for notice in ("UserWarning", "Apex is not installed", "No CUDA runtime is found"):
        assert notice not in output, notice


def test_cpu_table_shows_host_wall_times_only(cpu_run):
    table, result = cpu_run["table"], cpu_run["result"]
    assert "host wall time of the reference backend (torch) over gloo, 2 processes" in table
    assert "not GPU speed" in table and "Ran: kernels" in table
    assert "Not run on a CPU: ceilings and team (they need a GPU)" in table
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
    assert meta["command"].endswith("-m benchmarks " + shlex.join(cpu_run["flags"]))
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
                 "command": "python3 -m benchmarks --json b.json"},
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


def test_host_report_puts_costs_steps_and_megatron_beside_the_kernels():
    """The host section's rows from made-up items: per configuration the enqueue times and the
    kernels, the eager step against the graph's device time, and Megatron's methods against the
    HT kernels of the same T and receive mode."""
    def row(us):
        return {"median_ms": us / 1e3, "min_ms": us / 1e3, "p90_ms": us / 1e3, "iters": 40}

    result = _gpu_result()
    ht, ll_cfg = host.ht_prefix(128, "exact"), host.ll_prefix(128, "rank_major")
    result["host"] = {
        f"{ht}: handle (host)": row(12.0), f"{ht}: handle (kernel)": row(30.0),
        f"{ht}: dispatch (host)": row(8.0), f"{ht}: dispatch (kernel)": row(40.0),
        f"{ht}: combine (host)": row(6.0), f"{ht}: combine (kernel)": row(24.0),
        f"{ht}: step (eager)": row(120.0),
        f"{ll_cfg}: dispatch out= (host)": row(5.0), f"{ll_cfg}: step (eager)": row(30.0),
        f"{ll_cfg}: step (graph)": row(21.0), f"{ll_cfg}: graph (kernel)": row(20.0),
        f"{host.megatron_prefix(128)}: dispatch": row(95.0),
        f"{host.megatron_prefix(128)}: combine": row(35.0),
        f"{host.inference_prefix(128)}: dispatch (host)": row(9.0),
        f"{host.inference_prefix(128)}: combine (kernel)": row(11.0),
        f"{host.FLOOR}: {host.FLOOR_OP} (host)": row(3.5),
    }
    op_rows, step_rows, meg_rows = report.host_rows(result)
    assert all(config != host.FLOOR for config, *_ in op_rows + step_rows)
    assert (ht, "host", 12.0, 8.0, 6.0, None, None) in op_rows
    assert (ll_cfg, "host", None, None, None, 5.0, None) in op_rows
    # The inference dispatcher's methods are a configuration of their own, beside the LL calls.
    assert (host.inference_prefix(128), "host", None, 9.0, None, None, None) in op_rows
    assert (host.inference_prefix(128), "kernel", None, None, 11.0, None, None) in op_rows
    assert (ht, 120.0, None, None, None) in step_rows
    assert step_rows[-1] == (ll_cfg, 30.0, 21.0, 20.0, 1.5)
    assert meg_rows == [(128, 95.0, 70.0, 25.0, 35.0, 24.0, 11.0)]
    table = report.format_table(result)
    assert re.search(r"^T=128\s+95\.0\s+70\.0\s+25\.0\s+35\.0\s+24\.0\s+11\.0$", table, re.M)
    assert re.search(rf"^{ll_cfg}\s+30\.0\s+21\.0\s+20\.0\s+1\.50$", table, re.M)
    result["host_profiles"] = {f"{ll_cfg}: profile": [["cudaLaunchKernel", 3.0, 7.5]]}
    assert (f"{ll_cfg}: profile (per step: calls, self CPU us): cudaLaunchKernel 3 7.5"
            in report.format_table(result))
    text = markdown.render(result)
    assert "## Host cost: what a call costs the host, next to its kernels" in text
    assert "| 128 | 95.0 | 70.0 | 25.0 | 35.0 | 24.0 | 11.0 |" in text
    assert f"torch.profiler profiles of the eager steps ({ll_cfg}: profile)" in text
    assert "cudaLaunchKernel" not in text  # in the bench's output and results.json only
    assert ("one torch kernel (`torch.cuda._sleep(1)`, one launch through torch) costs the host "
            "3.5 us") in text
    assert "floor: one torch kernel (torch.cuda._sleep) 3.5 us to enqueue" in table


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
    collective, busy = team.summarize([[(0.0, 5.0), (2.0, 6.0)], [(1.0, 3.0), (0.0, 4.0)]])
    assert collective == [4.0, 3.0]
    assert busy == pytest.approx(4.0)  # median of 5, 4, 2, 4


def test_team_runner_breaks_the_meeting_and_cleans_up_every_rank(monkeypatch):
    """team.run_team, the runner of the team and ll sections' local teams: a rank that raises
    breaks the ranks' meeting (its peers stop waiting), and every rank's cleanup runs, on its own
    thread. run_local_team is stood in for by plain threads (no GPU here)."""
    import threading

    from megatron_nccl_ep import api

    def threads_for_ranks(groups, fn, *, prepare=None):
        outcome = [None] * len(groups)

        def one(rank):
            try:
                prepare(rank, groups[rank])
                outcome[rank] = fn(rank, groups[rank])
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                outcome[rank] = exc

        threads = [threading.Thread(target=one, args=(r,)) for r in range(len(groups))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return outcome

    monkeypatch.setattr(api, "run_local_team", threads_for_ranks)
    prepared, cleaned = [], []

    def body(rank, group, meet):
        if rank == 1:
            raise ValueError("rank 1 failed")
        meet.wait(timeout=30)
        return group

    cleanup = lambda rank: cleaned.append((rank, threading.current_thread().name))  # noqa: E731
    outcome = team.run_team(["g0", "g1", "g2"], body,
                            prepare=lambda rank, group: prepared.append(rank), cleanup=cleanup)
    assert isinstance(outcome[1], ValueError)
    assert all(isinstance(outcome[r], threading.BrokenBarrierError) for r in (0, 2)), outcome
    assert sorted(prepared) == [0, 1, 2]
    assert sorted(rank for rank, _ in cleaned) == [0, 1, 2]
    assert threading.current_thread().name not in {name for _, name in cleaned}
    # Ranks that all meet get through, with their results in rank order.
    assert team.run_team(["g0", "g1"], lambda rank, group, meet: (meet.wait(timeout=30), group)[1],
                         prepare=lambda rank, group: None) == ["g0", "g1"]


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
    (["--sections", "host"], "--sections host times the host next to the GPU"),
    (["--host-ll-tokens", "1"], "--host-ll-tokens: the host section's flags (add host"),
    (["--nodes-shapes", "2x2"], "--nodes-shapes: the nodes section's flags (add nodes"),
    (["--sections", "nodes", "--nodes-shapes", "1x4"], "nodes >= 2 and ranks per node >= 1"),
    (["--sections", "nodes", "--nodes-shapes", "2x"], "expected comma-separated NODESxRANKS"),
    (["--sections", "nodes", "--nodes-routings", "skewed"], "--nodes-routings: expected comma"),
    (["--sections", "nodes", "--nodes-shapes", "3x2", "--experts", "16",
      "--nodes-routings", "uniform"], "must be a multiple of every --nodes-shapes group's"),
    (["--sections", "nodes", "--nodes-shapes", "3x1", "--experts", "24"],
     "the nodes of --nodes-shapes must divide 8 (not [3])"),
    (["--sections", "nodes", "--experts", "16", "--topk", "9"],
     "--topk (9) at most the experts of 4 groups"),
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


def test_source_version_is_importable_from_the_bench():
    from benchmarks import source_version

    version = source_version()
    assert re.fullmatch(r"[0-9a-f]{16}", version["sources_sha256"])
    assert set(version) == {"git", "sources_sha256"}


# ------------------------------------------------------------------------------------------------
# the LL section (benchmarks/ll.py)

LL_TOKENS = (1, 8)


def _ll_ready() -> str:
    """Why the LL section cannot run on this machine's reference backend ('' when it can)."""
    from megatron_nccl_ep import reference

    if not hasattr(reference.ReferenceBackend, "ll_dispatch"):
        return "the reference backend has no LL ops (ll_dispatch) yet"
    return ""


@pytest.fixture(scope="module")
def ll_cpu_run(tmp_path_factory):
    """The LL section on cpu through its parent (ll.run: one process for EP=1; the local teams
    skipped), rendered as the bench renders it."""
    if _ll_ready():
        pytest.skip(_ll_ready())
    import time

    from benchmarks.__main__ import new_result

    argv = ["--device", "cpu", "--sections", "ll", "--iters", "2",
            "--ll-tokens", ",".join(map(str, LL_TOKENS))]
    args = cli.parse_args(argv)
    result = new_result(args, argv)
    ll.run(result, args, time.monotonic() + 200)
    report.add_floors(result)
    path = tmp_path_factory.mktemp("ll") / "ll.json"
    report.write_json(result, str(path))
    with open(path) as f:
        assert json.load(f)["ll"]["tokens"] == list(LL_TOKENS)  # the JSON holds the section
    return {"result": result, "args": args, "table": report.format_table(result),
            "md": markdown.render(result)}


def _ll_point(result: dict, world: int) -> dict:
    (point,) = [p for p in result["ll"]["points"] if p["world"] == world]
    return point


def test_ll_cpu_section_times_every_configuration_and_checks_it(ll_cpu_run):
    result, args = ll_cpu_run["result"], ll_cpu_run["args"]
    assert result["errors"] == [], result["errors"]
    assert (args.ll_payloads, args.ll_layouts) == (["bf16", "fp8"], list(config.LL_LAYOUTS))
    point = _ll_point(result, 1)
    assert (point["proxy"], point["num_sms"]) == (False, None)
    assert point["skipped_items"] == {op: "CUDA graphs need a GPU" for op in ll.GRAPH_OPS}
    items, checks = point["items"], point["checks"]
    H, K = args.hidden, args.topk
    for tokens in LL_TOKENS:
        for op in ll.HT_OPS:
            _positive_median(items, ll.ht_item(tokens, op))
        for payload in ("bf16", "fp8"):
            for layout in config.LL_LAYOUTS:
                for op in ll.LL_OPS[:3]:
                    name = ll.ll_item(tokens, payload, layout, op)
                    _positive_median(items, name)
                    assert items[name]["iters"] == 2
                assert not any(ll.ll_item(tokens, payload, layout, op) in items
                               for op in ll.GRAPH_OPS)
                # One rank: every slot is a row (expert-major), every token one (rank-major).
                rows = tokens * K if layout == "expert_major" else tokens
                payload_row = H + 4 * (H // 128) if payload == "fp8" else 2 * H
                dispatch = items[ll.ll_item(tokens, payload, layout, "dispatch")]
                assert dispatch["hbm_bytes"] == 2 * H * tokens + rows * payload_row
                combine = items[ll.ll_item(tokens, payload, layout, "combine")]
                assert combine["hbm_bytes"] == 2 * H * (tokens + rows)
                check = checks[ll.ll_item(tokens, payload, layout, "check")]["0"]
                found = re.fullmatch(r"ok rows (\d+)/(\d+), rel err (\S+)", check)
                assert found, check
                assert int(found[1]) == int(found[2]) == rows
                err = float(found[3])
                # FP8 loses bits of random tokens (so the cast ran); bf16 rounds the sum once.
                assert (1e-4 < err < 0.1) if payload == "fp8" else err < 1e-2, check
    for world in (2, 4, 8):
        team_point = _ll_point(result, world)
        assert team_point["proxy"] and "needs a GPU" in team_point["skipped"]
        assert "items" not in team_point
    assert result["meta"]["ll_backend_resolved"] == "torch"


def test_ll_cpu_table_and_markdown_show_host_wall_times(ll_cpu_run):
    table, text, result = ll_cpu_run["table"], ll_cpu_run["md"], ll_cpu_run["result"]
    items = _ll_point(result, 1)["items"]
    assert "host wall time (ms); no CUDA graphs and no local teams on cpu" in table
    lines = table.splitlines()
    head = next(line for line in lines if line.split()[:2] == ["EP", "T"])
    assert head.split()[4:] == ["handle_ms", "dispatch_ms", "combine_ms", "HT_ms"]
    for tokens in LL_TOKENS:
        row = next(line.split() for line in lines
                   if line.split()[:4] == ["1", str(tokens), "fp8", "rank_major"])
        want = [items[ll.ll_item(tokens, "fp8", "rank_major", op)]["median_ms"]
                for op in ll.LL_OPS[:3]] + [items[ll.ht_item(tokens, "h+d+c")]["median_ms"]]
        assert [float(v) for v in row[4:]] == pytest.approx(want, abs=0.006)
    # The section's rows and notes name nothing that only GPUs have.
    start = lines.index(head)
    rows = "\n".join(lines[start:start + 1 + 4 * len(LL_TOKENS)])
    for gpu_word in ("graph", "SMs", "floor", "GB/s", "target", "us"):
        assert gpu_word not in rows, gpu_word
    assert not any(line.startswith("LL targets") for line in lines)
    assert re.search(r"^\s+8 PROXY skipped: a local team needs a GPU", table, re.M)
    assert re.search(r"^LL checks: (\d+) of \1 ok$", table, re.M)
    assert "## LL: low-latency dispatch and combine" in text
    assert ("| EP | T | payload | layout | handle (ms) | dispatch (ms) | combine (ms) | "
            "HT h+d+c (ms) |") in text
    assert re.search(r"^\| 1 \| 8 \| bf16 \| expert_major( \| [0-9.]+){4} \|$", text, re.M)
    assert "- EP=4 PROXY: skipped, a local team needs a GPU" in text
    assert "### LL memory per rank" in text


def test_ll_memory_query_next_to_deepep(ll_cpu_run):
    memory = ll_cpu_run["result"]["ll"]["memory"]
    if memory.get("skipped"):
        assert "ll_memory_size" in memory["skipped"] or "not importable" in memory["skipped"]
        return
    shape = memory["shape"]
    assert (shape["tokens"], shape["hidden"], shape["experts"], shape["topk"]) == (128, 7168,
                                                                                    256, 8)
    rows = memory["rows"]
    assert [(r["world"], r["layout"]) for r in rows] == [
        (world, layout) for world in (8, 64) for layout in config.LL_LAYOUTS]
    deepep = ll.deepep_ll_buffer_bytes(128, 7168, 256)
    for row in rows:
        assert row["deepep_bytes"] == deepep
        if "error" not in row:
            sizes = [row[k] for k in ("window_bytes", "device_bytes", "handle_bytes",
                                      "total_bytes")]
            assert all(isinstance(v, int) and v >= 0 for v in sizes) and sizes[-1] > 0, row


def test_deepep_low_latency_buffer_formula():
    # DeepEP V1's layout at T=128, H=7168, E=256, by its parts: a dispatch message is a 16-byte
    # header and a bf16 row (larger than 7168 FP8 bytes + 56 fp32 scales), a combine message a
    # bf16 row and 56 bf16 pairs; send and receive buffers both hold E x T combine-sized
    # messages (the larger kind); the signal buffer 256 ints; two of each; then 128 more bytes.
    dispatch_msg, combine_msg = 16 + 2 * 7168, 2 * 7168 + 4 * 56
    assert combine_msg > dispatch_msg
    per_set = 2 * (256 * 128 * combine_msg) + 4 * 256
    assert ll.deepep_ll_buffer_bytes(128, 7168, 256) == 2 * per_set + 128
    # Linear in T_max and in the experts once the combine buffers dominate (no EP in it).
    one = ll.deepep_ll_buffer_bytes(64, 7168, 256)
    assert ll.deepep_ll_buffer_bytes(128, 7168, 256) - 128 == 2 * (one - 128) - 2 * 4 * 256
    assert ll.deepep_ll_buffer_bytes(128, 7168, 256) % 128 == 0


def test_ll_rows_received_count_masked_slots_and_ranks():
    # Two source ranks, 4 experts over 2 ranks (2 each); -1 = masked.
    a = torch.tensor([[0, 1], [2, -1], [-1, -1]])
    b = torch.tensor([[3, 0], [1, 0]])
    slots, pairs = ll.received([a, b], 4, 2)
    assert slots == [2 + 0 + 0 + 1 + 2, 0 + 1 + 0 + 1 + 0]  # slots of experts 0-1 / 2-3
    assert pairs == [1 + 0 + 0 + 1 + 1, 0 + 1 + 0 + 1 + 0]  # tokens with an expert there


def _ll_gpu_result() -> dict:
    """A one-GPU run's LL section with made-up times: EP=1 and a local team of 2, and EP=8
    skipped."""
    result = _gpu_result()

    def row(us, **extra):
        return {"median_ms": us / 1e3, "min_ms": 0.9 * us / 1e3, "iters": 40, **extra}

    ep1 = {ll.ll_item(128, "bf16", "expert_major", op): row(us, **extra) for op, us, extra in (
        ("handle", 3.0, {}), ("dispatch", 8.0, {"hbm_bytes": 8e6}),
        ("combine", 12.0, {"hbm_bytes": 4e6}), ("graph h+d+c", 20.0, {"hbm_bytes": 12e6}),
        ("graph d+c", 18.0, {"hbm_bytes": 12e6}))}
    ep1.update({ll.ht_item(128, op): row(us) for op, us in (
        ("handle + count read", 40.0), ("dispatch", 30.0), ("combine", 30.0),
        ("h+d+c", 100.0))})
    team2 = {ll.ll_item(128, "bf16", "expert_major", op): row(30.0, busy_ms=0.02)
             for op in ll.LL_OPS}
    result["ll"] = {
        "tokens": [128], "payloads": ["bf16"], "layouts": ["expert_major"],
        "memory": {"shape": dict(ll.MEMORY_SHAPE), "rows": [
            {"world": 8, "layout": "expert_major", "deepep_bytes": 2**31,
             "window_bytes": 2**29, "device_bytes": 2**28, "handle_bytes": 2**20,
             "total_bytes": 2**29 + 2**28},
            {"world": 64, "layout": "expert_major", "deepep_bytes": 2**31,
             "error": "RuntimeError: no"}]},
        "points": [{"world": 1, "num_sms": 24, "proxy": False, "items": ep1, "checks": {
                        ll.ll_item(128, "bf16", "expert_major", "check"): {"0": "ok rows 1/1"},
                        ll.ll_item(128, "bf16", "expert_major", "graphs"): {"0": "MISMATCH x"}}},
                   {"world": 2, "num_sms": 24, "proxy": True, "items": team2, "checks": {}},
                   {"world": 8, "num_sms": 16, "proxy": True,
                    "skipped": team.skip_reason(8, 16, 132, 8)}]}
    return result


def test_ll_gpu_report_floors_ratio_targets_proxy_and_memory():
    result = _ll_gpu_result()
    report.add_floors(result)  # HBM 4000 GB/s: 8e6 B -> 2 us, 4e6 B -> 1 us
    items = result["ll"]["points"][0]["items"]
    dispatch = items[ll.ll_item(128, "bf16", "expert_major", "dispatch")]
    assert (dispatch["floor_us"], dispatch["floor_pct"]) == pytest.approx((2.0, 25.0))
    table = report.format_table(result)
    row = next(line.split() for line in table.splitlines()
               if line.split()[:5] == ["1", "24", "128", "bf16", "expert_major"])
    # handle dispatch combine graph graph_dc HT HT/graph d_floor c_floor
    assert [float(v) for v in row[5:]] == [3.0, 8.0, 12.0, 20.0, 18.0, 100.0, 5.0, 2.0, 1.0]
    proxy = next(line.split() for line in table.splitlines() if line.split()[:2] == ["2", "PROXY"])
    assert proxy[2:6] == ["24", "128", "bf16", "expert_major"] and proxy[-4:-2] == ["-", "-"]
    assert "Every EP>1 figure is a PROXY" in table
    assert re.search(r"^\s+8 PROXY skipped: 8 ranks need CUDA_DEVICE_MAX_CONNECTIONS >= 16",
                     table, re.M)
    targets = next(line for line in table.splitlines() if line.startswith("LL targets"))
    assert "expert_major, 24 SMs: dispatch 8.0 us (target <= 10 us: met)" in targets
    assert "expert_major, 24 SMs: combine 12.0 us (target <= 10 us: MISSED)" in targets
    assert "expert_major, 24 SMs: graph h+d+c 20.0 us (target <= 25 us: met)" in targets
    assert "expert_major, 24 SMs: HT / graph 5.0 (target >= 3: met)" in targets
    assert "LL memory EP=8 expert_major" in table and "DeepEP V1 LL buffer 2048.0 (2.7 x)" in table
    assert "LL memory EP=64 expert_major: query failed: RuntimeError: no" in table
    assert "LL checks: 1 of 2 ok" in table and "MISMATCH x" in table
    text = markdown.render(result)
    assert ("| EP | SMs | T | payload | layout | handle (us) | dispatch (us) | combine (us) | "
            "graph h+d+c (us) | graph d+c (us) | HT h+d+c (us) | HT / graph | dispatch floor (us) "
            "| combine floor (us) |") in text
    assert "| 1 | 24 | 128 | bf16 | expert_major | 3.0 | 8.0 | 12.0 | 20.0 | 18.0 | 100.0 | " \
           "5.0 | 2.0 | 1.0 |" in text
    assert "| 2 PROXY | 24 | 128 |" in text
    assert "HBM copy rate of this run, 4000.0 GB/s" in text
    assert "- expert_major, 24 SMs: combine 12.0 us (target <= 10 us: MISSED)" in text
    assert "| 8 | expert_major | 512.0 | 256.0 | 1.0 | 768.0 | 2048.0 | 2.7 |" in text
    assert "- EP=64 expert_major: the query failed: RuntimeError: no" in text


def test_ll_team_sms_fit_the_gpu_and_cpu_skips_teams():
    args = cli.parse_args(["--device", "cpu", "--sections", "ll"])
    assert ll.point_sms(args, 1, None) == [None]
    assert "needs a GPU" in ll.team_skip_reason(2, None, "cpu", None)
    gpu = argparse.Namespace(device="cuda", ll_num_sms=[24, "all"])
    # EP=8 on 132 SMs: 16 CTAs a rank, so every rank's are resident at once (one point, not two).
    assert [ll.point_sms(gpu, world, 132) for world in (1, 2, 4, 8)] == [
        [24, 132], [24, 66], [24, 33], [16]]


@pytest.mark.parametrize("argv, says", [
    (["--sections", "ll", "--ll-payloads", "fp16"], "--ll-payloads: ['fp16'] is neither"),
    (["--sections", "ll", "--ll-payloads", "int8"], "--ll-payloads: expected comma-separated"),
    (["--sections", "ll", "--ll-layouts", "3d"], "--ll-layouts: expected comma-separated words"),
    (["--sections", "ll", "--ll-sizes", "3"], "must be a multiple of every --ll-sizes value"),
    (["--sections", "ll", "--hidden", "100"], "--hidden (100) must be a multiple of 128"),
    (["--sections", "ll", "--ll-tokens", str(config.LL_MAX_TOKENS + 1)],
     f"at most {config.LL_MAX_TOKENS} tokens per rank"),
    (["--sections", "ll", "--ll-num-sms", "8"], "--ll-num-sms: the reference backend on cpu"),
    (["--ll-tokens", "8"], "--ll-tokens: the ll section's flags (add ll to --sections)"),
])
def test_bad_ll_flags_are_refused_with_a_reason(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--device", "cpu", *argv])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_ll_flags_and_their_defaults():
    args = cli.parse_args(["--device", "cpu", "--sections", "kernels,ll", "--dtype", "fp16",
                           "--ll-tokens", "4,2", "--ll-layouts", "rank_major"])
    assert (args.ll_tokens, args.ll_sizes, args.ll_layouts) == ([4, 2], [1, 2, 4, 8],
                                                                ["rank_major"])
    assert args.ll_payloads == ["fp16", "fp8"]  # the token dtype and FP8
    assert args.ll_num_sms is None
    bare = cli.parse_args(["--device", "cpu"])
    assert "ll" not in bare.sections and bare.ll_payloads is None


def test_ll_team_times_come_from_every_rank_that_finished():
    class Event:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, other):
            return other.ms - self.ms

    class Mine:
        def __init__(self, spans):
            self.pairs = {op: [(Event(s), Event(e)) for s, e in it] for op, it in spans.items()}

    sent = []
    me = argparse.Namespace(args=argparse.Namespace(iters=2),
                            emit=lambda kind, item, **fields: sent.append((kind, item, fields)))
    # Rank 1 finished one iteration of the combine only (its run failed): no combine row.
    ranks = [Mine({"dispatch": [(0.0, 5.0), (10.0, 12.0)], "combine": [(0, 1), (2, 3)]}),
             Mine({"dispatch": [(1.0, 6.0), (9.0, 13.0)], "combine": [(0, 1)]})]
    team.emit_team_times(me, ranks, {"dispatch": ("d", 1e6), "combine": ("c", None)})
    (kind, item, fields), = sent
    assert (kind, item, fields["extra"]["hbm_bytes"]) == ("times", "d", 1e6)
    assert fields["times_ms"] == [5.0, 3.0]  # last start to last end, per iteration
    assert fields["extra"]["busy_ms"] == pytest.approx(4.5)  # median of 5, 2, 5, 4


def test_readme_numbers_and_results_name_the_committed_run():
    """The README's numbers section is benchmarks.readme's text for the committed results.json,
    and RESULTS.md names the sources hash of that run."""
    assert readme.main(["--check"]) == 0, "run python -m benchmarks.readme"
    with open(readme.RESULTS) as f:
        result = json.load(f)
    sources = result["meta"]["source"]["sources_sha256"]
    assert sources == source_version()["sources_sha256"], "results.json is another tree's run"
    assert [r["source"]["sources_sha256"] for r in result["training"]] == \
        [sources] * len(result["training"])
    with open(os.path.join(os.path.dirname(readme.RESULTS), "RESULTS.md")) as f:
        assert f"sources: `{sources}`" in f.read()
    with open(readme.README) as f:
        _, current, _ = readme.section(f.read())
    assert f"sources `{sources}`" in current


def test_readme_numbers_follow_the_results(tmp_path):
    # A changed figure in results.json changes the README's text (no number is written by hand).
    with open(readme.RESULTS) as f:
        result = json.load(f)
    before = readme.numbers(result)
    result["kernels"]["dispatch (kernel)"]["median_ms"] = 0.123456
    result["meta"]["source"]["sources_sha256"] = "0123456789abcdef"
    after = readme.numbers(result)
    assert "| dispatch | 123.5 |" in after and "sources `0123456789abcdef`" in after
    assert before != after


def training_record(sources: str = None, ms: float = 101.25) -> dict:
    """A record as examples/check_training.py --json writes it (of the tree's sources unless
    ``sources`` is given)."""
    return {"device": "NVIDIA H100 80GB HBM3", "gpus": 1,
            "source": {"git": None,
                       "sources_sha256": sources or source_version()["sources_sha256"]},
            "command": "python examples/check_training.py --checks iu",
            "script": "Megatron-LM's pretrain_gpt.py",
            "checks": [{"label": "(i) dropless", "passed": True, "detail": "bits equal"},
                       {"label": "(u) against alltoall", "passed": False, "detail": "1.2x"}],
            "runs": {"dropless_full_iteration": {"exit_status": 0, "iterations": 100,
                                                 "graphs": True, "ms": ms, "tokens": 16384,
                                                 "tokens_per_s": 16384 / ms * 1e3},
                     "dropless": {"exit_status": 1, "iterations": 3, "graphs": False}}}


@pytest.fixture
def results_files(tmp_path, monkeypatch):
    """benchmarks.readme's files (results.json, RESULTS.md, README.md) as copies in tmp_path."""
    for name in ("RESULTS", "RESULTS_MD", "README", "PLOT"):
        copy = tmp_path / os.path.basename(getattr(readme, name))
        if os.path.exists(getattr(readme, name)):
            shutil.copyfile(getattr(readme, name), copy)
        monkeypatch.setattr(readme, name, str(copy))
    return readme


def test_readme_puts_training_records_into_results_and_results_md(results_files, tmp_path):
    readme = results_files
    record = tmp_path / "training.json"
    record.write_text(json.dumps(training_record()))
    assert readme.main(["--training", str(record)]) == 0
    with open(readme.RESULTS) as f:
        assert json.load(f)["training"] == [training_record()]
    with open(readme.RESULTS_MD) as f:
        text = f.read()
    assert "## Training: Megatron's pretrain() end to end" in text
    assert f"sources `{source_version()['sources_sha256']}`; script: Megatron-LM's " \
        "pretrain_gpt.py" in text
    assert "| dropless_full_iteration | 100 | yes | 101.2 | 161817 |" in text
    assert "| dropless | 3 | no | - | - |" in text  # a run that logged no step time
    assert "| (u) against alltoall | FAIL: 1.2x |" in text
    assert readme.main(["--check"]) == 0
    # A bench run taken in keeps the committed training records.
    with open(readme.RESULTS) as f:
        bench = {**json.load(f), "training": None}
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "results.json").write_text(json.dumps(bench))
    (tmp_path / "new" / "results.png").write_bytes(b"png")
    assert readme.main(["--bench", str(tmp_path / "new" / "results.json")]) == 0
    with open(readme.RESULTS) as f:
        assert json.load(f)["training"] == [training_record()]
    with open(readme.PLOT, "rb") as f:
        assert f.read() == b"png"


def test_readme_check_fails_on_a_hand_edited_results_md(results_files):
    readme = results_files
    assert readme.main(["--check"]) == 0
    with open(readme.RESULTS_MD) as f:
        text = f.read()
    with open(readme.RESULTS_MD, "w") as f:
        f.write(text.replace("- sources: `", "- sources: `0", 1))
    assert readme.main(["--check"]) == 1
    assert readme.main([]) == 0 and readme.main(["--check"]) == 0  # rewritten from the results


def test_readme_check_fails_when_a_record_names_other_sources(results_files, tmp_path, capsys):
    """results.json rendered faithfully but naming other sources than the tree's (a hand-edited
    hash, or a run of older code) fails --check, naming the record."""
    readme = results_files
    with open(readme.RESULTS) as f:
        result = json.load(f)
    result["meta"]["source"]["sources_sha256"] = "0" * 16
    with open(readme.RESULTS, "w") as f:
        json.dump(result, f)
    assert readme.main([]) == 0  # RESULTS.md and the README rendered from it
    assert readme.main(["--check"]) == 1
    assert f"the bench run names sources {'0' * 16}" in capsys.readouterr().err
    record = tmp_path / "training.json"
    record.write_text(json.dumps(training_record(sources="f" * 16)))
    result["meta"]["source"] = source_version()
    with open(readme.RESULTS, "w") as f:
        json.dump(result, f)
    assert readme.main(["--training", str(record)]) == 0
    assert readme.main(["--check"]) == 1
    assert f"training record 1 (python examples/check_training.py --checks iu) names sources " \
        f"{'f' * 16}" in capsys.readouterr().err


def stress_record(tmp_path, error=None) -> str:
    """A record as tests/gpu/stress_teams.py --json writes it (its own ``record``), of the tree's
    sources: two configurations, the second with ``error`` if given."""
    spec = importlib.util.spec_from_file_location(
        "stress_teams", os.path.join(REPO_ROOT, "tests", "gpu", "stress_teams.py"))
    stress = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stress)
    args = argparse.Namespace(processes=2, reps=3, timeout_s=6.0)
    totals = {"LL EP=2 rank_major fp8": dict(processes=2, reps=6, timeouts=0, mismatches=0,
                                             seconds=4.25, error=None),
              "HT EP=4 capacity": dict(processes=2, reps=5 if error else 6, timeouts=0,
                                       mismatches=7 if error else 0, seconds=3.5, error=error)}
    path = tmp_path / "stress.json"
    stress.write_record(str(path), stress.record(["tests/gpu/stress_teams.py", "--reps", "3"],
                                                 args, totals, finished=True))
    return str(path)


def test_readme_puts_the_stress_record_into_results_md_and_the_readme(results_files, tmp_path):
    readme = results_files
    assert readme.main(["--stress", stress_record(tmp_path, error="ValueError: bad\nmore")]) == 0
    with open(readme.RESULTS_MD) as f:
        text = f.read()
    assert "## Stress: local teams in fresh processes" in text
    assert "- command: `python tests/gpu/stress_teams.py --reps 3`" in text
    assert "| LL EP=2 rank_major fp8 | clean | 2 | 6 | 0 | 0 | 4.2 |" in text
    assert "| HT EP=4 capacity | FAIL: ValueError: bad | 2 | 5 | 0 | 7 | 3.5 |" in text
    assert "1 of 2 configurations clean." in text
    with open(readme.README) as f:
        _, numbers, _ = readme.section(f.read())
    assert "1 of 2 configurations clean over 11 repetitions" in " ".join(numbers.split())
    assert readme.main(["--check"]) == 0


# -- the nodes section: HT over emulated nodes, what the rail carries -----------------------------
# E = 32 in 8 groups of 4, top-4: at 4 nodes node-limited routing's share (0.622) is far below
# uniform's (0.705) against the counted shares' spread over 64 tokens x 4 ranks x 2 routings.
NODES_FLAGS = ["--sections", "nodes", "--experts", "32", "--topk", "4", "--tokens", "64",
               "--hidden", "32", "--iters", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def nodes_cpu_run(tmp_path_factory):
    """The nodes section on CPU (its default shapes 2x2 and 4x1, both routings), its table, JSON
    and markdown."""
    folder = tmp_path_factory.mktemp("nodes")
    out, md = folder / "nodes.json", folder / "nodes.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--device", "cpu", *NODES_FLAGS,
                           "--json", str(out), "--markdown", str(md)],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    with open(out) as f:
        result = json.load(f)
    return {"table": proc.stdout[proc.stdout.index(report.TABLE_MARKER):], "result": result,
            "md": md.read_text()}


def test_nodes_cpu_section_counts_what_the_routing_sends(nodes_cpu_run):
    result = nodes_cpu_run["result"]
    assert result["errors"] == []
    section = result["nodes"]
    assert section["routings"] == list(nodes.ROUTINGS) and section["recv_mode"] == "exact"
    assert [(p["nodes"], p["ranks_per_node"], p["world"]) for p in section["points"]] == [
        (2, 2, 4), (4, 1, 4)]
    hidden_bytes, topk, experts = 32 * 2, 4, 32
    row_bytes = {"dispatch": hidden_bytes + 8 * topk, "combine": hidden_bytes,
                 "combine_probs": 8 * topk}
    before_row = {"dispatch": hidden_bytes + 8 * experts, "combine": hidden_bytes,
                  "combine_probs": 8 * topk}
    shares = {}
    for point in section["points"]:
        checks = point["checks"]
        assert sorted(checks) == [f"{r}: rail rows / the routing's, bytes / rows x row bytes"
                                  for r in sorted(nodes.ROUTINGS)]
        for per_rank in checks.values():
            assert sorted(per_rank) == ["0", "1", "2", "3"]
            assert all(v.startswith("ok dispatch rows ") for v in per_rank.values()), per_rank
        remote = point["nodes"] - 1
        for routing in nodes.ROUTINGS:
            rows = {}
            for op in nodes.OPS:
                row = point["items"][nodes.item(routing, op, "host wall")]
                assert row["median_ms"] > 0 and row["iters"] == 2
                assert row["rail_rows"] == pytest.approx(row["routing_rows"])
                assert row["row_bytes"] == row_bytes[op]
                assert row["rail_bytes"] == pytest.approx(row["rail_rows"] * row_bytes[op])
                assert row["share"] == pytest.approx(row["rail_rows"] / (remote * 64))
                assert row["every_token_bytes"] == remote * 64 * before_row[op]
                assert 0 < row["rail_rows"] < remote * 64  # some tokens stay off some nodes
                rows[op] = row["rail_rows"]
            # Rank averages: every rank's combine returns what its rail peers' dispatch sent.
            assert rows["combine"] == pytest.approx(rows["dispatch"])
            assert rows["combine_probs"] == rows["combine"]
            share = point["items"][nodes.item(routing, "dispatch", "host wall")]["share"]
            assert share == pytest.approx(point["share_formula"][routing], abs=0.05)
            shares[(point["nodes"], routing)] = share
    # At 4 nodes of 2 groups each, a node-limited token reaches fewer nodes.
    assert shares[(4, "node_limited")] < shares[(4, "uniform")] - 0.03, shares
    formula = section["points"][1]["share_formula"]
    assert formula["node_limited"] < formula["uniform"]


def test_nodes_cpu_table_and_markdown_show_the_json(nodes_cpu_run):
    result, table, md = nodes_cpu_run["result"], nodes_cpu_run["table"], nodes_cpu_run["md"]
    point = result["nodes"]["points"][1]
    row = point["items"][nodes.item("node_limited", "dispatch", "host wall")]
    printed = next(line.split() for line in table.splitlines()
                   if line.split()[:3] == ["4x1", "node_limited", "dispatch"])
    want = [row["median_ms"], row["rail_rows"] / 64, row["rail_bytes"] / 64, row["share"],
            point["share_formula"]["node_limited"], row["every_token_bytes"] / 64,
            row["rail_bytes"] / row["every_token_bytes"]]
    digits = (2, 3, 1, 3, 3, 1, 3)  # the table's precision per column
    assert len(printed) == 3 + len(want), printed
    for text, value, places in zip(printed[3:], want, digits):
        assert float(text) == pytest.approx(value, abs=0.6 * 10**-places), (printed, want)
    assert "nodes checks (rail counters against the routing): 16 of 16 ok" in table
    assert "## Nodes: HT over emulated nodes, what the rail carries" in md
    cells = next(line for line in md.splitlines()
                 if line.startswith("| 4x1 | node_limited | dispatch |")).strip("| ").split(" | ")
    assert float(cells[-1]) == pytest.approx(row["rail_bytes"] / row["every_token_bytes"],
                                             abs=6e-4)
    assert "16 of 16 ok." in md


def test_nodes_counts_are_the_messages_counted_token_by_token(seed):
    """The bench's message counts against the tests' own count, token by token, with masked
    slots, for nodes of 1 and 2 ranks."""
    gen = torch.Generator().manual_seed(seed)
    for ranks_per_node in (1, 2):
        routing = [runner.node_limited_topk(gen, 40 + 3 * r, 32, 8, 4, 4) for r in range(4)]
        routing[1][::5, 1] = -1
        counts = nodes.rail_counts(routing, ranks_per_node, 32)
        experts_per_node = 32 // (4 // ranks_per_node)
        by_token = ep_cases.rail_counts_by_token(routing, ranks_per_node, experts_per_node)
        assert counts == by_token
        for rank in range(4):
            want = ep_cases.rail_rows_sent(by_token, rank, ranks_per_node)
            got = nodes.message_rows(counts, rank, ranks_per_node)
            assert (got["dispatch"], got["combine"], got["combine_probs"]) == (*want, want[1])


def test_node_limited_routing_picks_distinct_experts_of_few_groups(seed):
    gen = torch.Generator().manual_seed(seed)
    topk = runner.node_limited_topk(gen, 500, 64, 8, 4, 6)
    assert topk.shape == (500, 6)
    assert all(len(set(row)) == 6 for row in topk.tolist())
    groups = topk // 8
    assert all(len(set(row)) <= 4 for row in groups.tolist())
    assert set(groups.flatten().tolist()) == set(range(8))  # every group gets picked


def test_nodes_share_formula_is_the_design_table():
    """docs/internode.md's table: top-8 of 256 experts, 8 groups of 32 with 4 picked."""
    table = {2: (0.997, 0.963), 4: (0.904, 0.732), 8: (0.662, 0.454)}
    for n, (uniform, limited) in table.items():
        assert nodes.share_formula("uniform", 256, 8, n) == pytest.approx(uniform, abs=5e-4)
        assert nodes.share_formula("node_limited", 256, 8, n) == pytest.approx(limited, abs=5e-4)
    # The dispatch's bytes, packed over every token: (r + 64) / (r + 2048) x p at H = 7168 bf16.
    r = 7168 * 2
    packed = nodes.row_bytes("dispatch", r, 8, 8)
    every = nodes.every_token_bytes("dispatch", 1, 2, r, 256, 8, 8)
    assert packed / every * 0.997 == pytest.approx(0.876, abs=5e-4)


def test_nodes_flags_and_gpu_skips():
    args = cli.parse_args(["--device", "cpu", "--sections", "nodes", "--nodes-shapes", "2x1,2x1",
                           "--nodes-routings", "node_limited"])
    assert (args.nodes_shapes, args.nodes_routings) == ([(2, 1)], ["node_limited"])
    bare = cli.parse_args(["--device", "cpu", "--sections", "nodes"])
    assert bare.nodes_shapes == [(2, 2), (4, 1)] and bare.nodes_routings == list(nodes.ROUTINGS)
    # Nodes of several ranks need a GPU per rank; nodes of one rank share GPUs as emulated hosts.
    reason, how = nodes.placement(4, 2, "cuda", 2)
    assert reason.startswith("4 ranks of 2 per node need 4 GPUs") and "2 visible" in reason
    assert how == ""
    assert nodes.placement(4, 2, "cuda", 4) == ("", nodes.placement(4, 1, "cuda", 4)[1])
    assert "group option ranks_per_node" in nodes.placement(4, 2, "cuda", 4)[1]
    reason, how = nodes.placement(4, 1, "cuda", 1)
    assert reason == "" and "4 processes on 1 GPU(s)" in how and "NCCL_HOSTID" in how
    assert nodes.placement(4, 2, "cpu", 0)[0] == ""


def test_nodes_gpu_report_has_kernel_and_e2e_times_and_skips():
    """A made-up GPU result: kernel and e2e times in us, the NVLink proxy named, skipped
    shapes."""
    counted = {"rail_rows": 96.0, "rail_bytes": 96.0 * (14336 + 64), "routing_rows": 96.0,
               "row_bytes": 14400, "share": 0.75, "every_token_bytes": 128 * (14336 + 2048),
               "tokens": 128}
    items = {nodes.item("uniform", "dispatch", mode): {"median_ms": ms, **counted}
             for mode, ms in (("kernel", 0.25), ("e2e", 0.5))}
    result = {"meta": {"device": "cuda", "backend_resolved": "cuda"},
              "shape": {"tokens": 128, "hidden": 7168, "topk": 8, "experts": 256,
                        "dtype": "bf16", "backend": "cuda"},
              "nodes": {"routings": ["uniform"], "node_limited": {"groups": 8, "picks": 4},
                        "points": [{"nodes": 2, "ranks_per_node": 1, "world": 2,
                                    "share_formula": {"uniform": 0.997}, "items": items,
                                    "placement": nodes.placement(2, 1, "cuda", 2)[1],
                                    "checks": {"c": {"0": "ok", "1": "MISMATCH x"}}},
                                   {"nodes": 2, "ranks_per_node": 2, "world": 4,
                                    "skipped": nodes.placement(4, 2, "cuda", 2)[0]}]}}
    times, rows, skipped = report.nodes_rows(result)
    assert times == ("kernel (us)", "e2e (us)")
    assert rows == [("2x1", "uniform", "dispatch", 250.0, 500.0, 0.75, 96 * 14400 / 128, 0.75,
                     0.997, 14336 + 2048, 96 * 14400 / (128 * (14336 + 2048)))]
    assert skipped == [("2x2", nodes.placement(4, 2, "cuda", 2)[0])]
    assert report.nodes_check_summary(result) == (1, 2, [("2x1", "c", "1", "MISMATCH x")])
    lines = report._nodes(result)
    assert "2x1 one GPU per rank" in lines[0] and "the rail runs over NVLink" in lines[0]
    assert any(line.split()[:2] == ["2x2", "skipped:"] for line in lines)
    out = []
    markdown._nodes(result, out)
    assert "| 2x1 | uniform | dispatch | 250.0 | 500.0 | 0.750 |" in "\n".join(out)
    assert "- 2x2: skipped, 4 ranks of 2 per node need 4 GPUs" in "\n".join(out)
    # The README's sentence: the dispatch's packed / every-token bytes and the checks.
    share = 96 * 14400 / (128 * (14336 + 2048))
    sentence = readme._nodes(result)
    assert f"2x1 uniform {share:.2f}" in sentence and "(1 of 2 checks)" in sentence
    assert readme._nodes({**result, "nodes": None}) == ""


def test_stress_rows_group_clean_configurations_and_keep_failures_apart():
    def config(name, clean=True, reps=10, seconds=1.0):
        return {"name": name, "clean": clean, "error": None if clean else "ValueError: x",
                "processes": 2, "reps": reps, "timeouts": 0, "mismatches": 0 if clean else 3,
                "seconds": seconds}

    rows = markdown._stress_rows([config("LL EP=2 expert_major bf16"),
                                  config("LL EP=2 rank_major fp8", reps=20, seconds=2.5),
                                  config("HT EP=2 exact", clean=False),
                                  config("HT EP=2 capacity")])
    assert rows == [("HT EP=2 exact", "FAIL: ValueError: x", 2, 10, 0, 3, 1.0),
                    ("LL EP=2: expert_major bf16, rank_major fp8", "clean", 2, 30, 0, 0, 3.5),
                    ("HT EP=2 capacity", "clean", 2, 10, 0, 0, 1.0)]
