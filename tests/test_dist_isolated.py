"""The fault-injection harness itself (``dist.run_isolated``), on CPU over gloo: it must return
every rank's outcome (a value, an exception, a death with its exit code, a hang killed at the
deadline) and what each rank reported before, including a report sent right before ``os._exit``.
The GPU fault tests (tests/gpu/test_cuda_faults.py) read their results through it."""

import os
import time

import torch.distributed as tdist

import dist


def four_endings(hold_s: float) -> int:
    rank = tdist.get_rank()
    dist.report("started", rank)
    if rank == 1:
        dist.report("exiting", 17)
        os._exit(17)
    if rank == 2:
        raise ValueError("rank 2 fails on purpose")
    if rank == 3:
        time.sleep(hold_s)  # past the deadline
    return 10 + rank


def test_run_isolated_reports_values_deaths_errors_and_hangs():
    start = time.monotonic()
    runs = dist.run_isolated(4, four_endings, 300.0, timeout=5.0)
    took = time.monotonic() - start
    ok, dead, failed, hung = runs
    assert (ok.value, ok.exitcode, ok.error, ok.hung) == (10, 0, None, False), ok
    assert dead.exitcode == 17 and dead.value is None and not dead.hung, dead
    assert dead.reports["exiting"][0] == 17 and "started" in dead.reports, dead.reports
    assert failed.value is None and "ValueError: rank 2 fails on purpose" in failed.error, failed
    assert failed.exitcode == 0 and not failed.hung, failed
    assert hung.hung and hung.value is None and hung.exitcode != 0, hung
    for run in runs:  # every rank joined the group and reported before its ending
        assert "ready" in run.reports and run.reports["started"][0] == run.rank, run
    assert [r.outcome().split()[0] for r in runs] == ["returned,", "died,", "raised:", "HUNG"]
    # Start-up may take up to SPAWN_TIMEOUT_S on a loaded machine; rank 3 would hold for 300 s.
    assert took < dist.SPAWN_TIMEOUT_S + 60, f"the 5 s deadline took {took:.0f} s to end the run"
