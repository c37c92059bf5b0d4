"""Ranks that do not take part (issue 8 item 1), on CPU over gloo with the reference backend
(tests/gpu/test_cuda_faults.py has the GPU versions).

Group creation (the rendezvous that runs before either backend's collectives):
- a rank that never calls Group(): the others raise NcclEpError within timeout_s, naming it;
  a rank that comes late, after they gave up, raises too instead of going on alone;
- a rank whose local checks fail: it raises its own error, the others raise at once naming it;
- a rank that died before Group(): the others raise within timeout_s, naming it;
- creating groups again and again keeps the store bounded and the groups usable.
Operations (the reference backend's timed collectives):
- a rank that never calls an op: the others raise within timeout_s naming the op and the rank,
  the group is stopped (the next call raises at once), and the rank that comes late raises too,
  naming the rank that stopped the group;
- a rank that dies inside an op: the others raise naming the op; every survivor exits cleanly.
Threads: handles destroyed by a second thread while ops run on the group (tests/thread_cases.py,
as on the GPU)."""

import gc
import os
import time

import pytest
import torch
import torch.distributed as tdist

import dist
import megatron_nccl_ep as ep
import thread_cases

TIMEOUT_S = 5.0  # short for a test, long against a loaded box's skew between healthy ranks
# Room for a CI box shared under heavy load; a hang would be killed at the run's deadline instead.
SLACK_S = 30.0
LONG_TIMEOUT_S = 100.0
ARGS = dict(num_experts=8, hidden=16, max_tokens_per_rank=8, max_topk=2, backend="torch",
            device="cpu", timeout_s=TIMEOUT_S)


def started_rank() -> int:
    """Every rank function starts here: a barrier, so that the ranks' imports of this module do
    not skew them against the short timeout, then this rank."""
    tdist.barrier()
    return tdist.get_rank()


def timed(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return dict(error=type(exc).__name__, message=str(exc), took=time.monotonic() - start)
    return dict(error=None, message="", took=time.monotonic() - start)


def timed_group(**overrides) -> dict:
    """Group(**ARGS, **overrides), destroyed at once: what it raised and how long it took."""
    return timed(lambda: ep.Group(**{**ARGS, **overrides}).destroy())


def never_then_late(silent: int) -> dict:
    rank = started_rank()
    if rank == silent:
        time.sleep(TIMEOUT_S + 1.0)  # alive, and arrives after the others gave up
    return timed_group()


def local_check_fails(bad: int) -> dict:
    rank = started_rank()
    # num_experts must be a multiple of the group size: only the bad rank breaks it. The long
    # timeout shows that nobody waits for it.
    return timed_group(num_experts=7 if rank == bad else 8, timeout_s=LONG_TIMEOUT_S)


def dies_before_group(victim: int) -> dict:
    if started_rank() == victim:
        os._exit(17)
    return timed_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_that_never_creates_the_group_makes_the_others_raise(world_size):
    silent = world_size - 1
    runs = dist.run_isolated(world_size, never_then_late, silent,
                             timeout=TIMEOUT_S + SLACK_S + 60.0)
    for r in runs:
        assert r.value is not None and r.exitcode == 0, r.outcome()
    for r in runs[:silent]:
        o = r.value
        assert o["error"] == "NcclEpError", o
        assert TIMEOUT_S <= o["took"] <= TIMEOUT_S + SLACK_S, o
        assert f"rank {silent} of the EP group (global rank {silent})" in o["message"], o["message"]
        assert "did not reach Group() within timeout_s=5 s" in o["message"], o["message"]
    late = runs[silent].value  # finds the others' give-up, never enters a collective alone
    assert late["error"] == "NcclEpError", late
    assert "rank 0 of the EP group" in late["message"], late["message"]
    assert late["took"] <= SLACK_S, late  # at once: it finds the others' give-up


@pytest.mark.parametrize("world_size,bad", [(2, 0), (2, 1), (4, 2)])
def test_local_check_failure_on_one_rank_is_named_by_the_others(world_size, bad):
    runs = dist.run_isolated(world_size, local_check_fails, bad, timeout=LONG_TIMEOUT_S)
    for r in runs:
        o = r.value
        assert o is not None and r.exitcode == 0, r.outcome()
        assert o["error"] == "ValueError", o
        assert o["took"] < LONG_TIMEOUT_S / 2, o  # no rank waits for the timeout
        assert "num_experts (7) must be a multiple of the group size" in o["message"], o
        if r.rank != bad:
            assert f"Group(): rank {bad} of the EP group" in o["message"], o["message"]


def test_rank_dead_before_group_is_named():
    runs = dist.run_isolated(2, dies_before_group, 1, timeout=TIMEOUT_S + SLACK_S + 60.0)
    assert runs[1].exitcode == 17, runs[1].outcome()
    o = runs[0].value
    assert o is not None and o["error"] == "NcclEpError", runs[0].outcome()
    assert "rank 1 of the EP group" in o["message"] and o["took"] <= TIMEOUT_S + SLACK_S, o


def many_groups(count: int) -> tuple:
    # Groups of earlier tests in this pooled process that only the garbage collector frees would
    # delete their keys at some later point, in the middle of a count: free them first.
    gc.collect()
    store = tdist.distributed_c10d._get_default_store()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    for i in range(count):
        group = ep.Group(**{**ARGS, "timeout_s": LONG_TIMEOUT_S})  # ranks skew on a loaded box
        idx = torch.stack([torch.randperm(8)[:2] for _ in range(4)])
        handle = group.create_handle(idx)
        recv_x, _ = handle.dispatch(x)
        y = handle.combine(recv_x)
        torch.testing.assert_close(y.float(), 2 * x.float(), rtol=0, atol=0.1)
        handle.destroy()
        group.destroy()
    tdist.barrier()  # every rank finished its last exchange before the keys are counted
    return store.num_keys()


def test_repeated_group_creation_keeps_the_store_bounded():
    # Each creation posts one key per rank; a rank deletes its previous one when the next
    # exchange completes, so 30 creations leave one key per rank (plus the group's own).
    small, large = (dist.run(2, many_groups, n) for n in (3, 30))
    assert small == large, (small, large)


OP_CASE = dict(tokens=32, hidden=16, experts=8, topk=2)
OPS = ("create_handle", "dispatch", "combine")


def op_inputs(seed: int) -> tuple:
    rng = torch.Generator().manual_seed(seed)
    t, e, k = OP_CASE["tokens"], OP_CASE["experts"], OP_CASE["topk"]
    idx = torch.rand(t, e, generator=rng).topk(k, dim=1).indices
    return idx, torch.randn(t, OP_CASE["hidden"], generator=rng).to(torch.bfloat16)


def run_ops(group, seed: int, skip: str = "", die_in: str = "") -> dict:
    """create_handle, dispatch, combine in order; this rank leaves at ``skip`` (returns) or
    exits inside ``die_in``. The op that raised (or "done"), what it raised, and when."""
    idx, x = op_inputs(seed)
    state: dict = {}
    calls = {"create_handle": lambda: state.update(handle=group.create_handle(idx)),
             "dispatch": lambda: state.update(recv=state["handle"].dispatch(x)[0]),
             "combine": lambda: state["handle"].combine(state["recv"])}
    for op in OPS:
        if op == skip:
            return dict(op=op, error=None, message="skipped", took=0.0)
        if op == die_in:
            time.sleep(0.3)  # the peers' collectives of this op have started without it
            os._exit(17)
        outcome = timed(calls[op])
        if outcome["error"] is not None:
            return dict(op=op, **outcome)
    return dict(op="done", error=None, message="", took=0.0)


def op_group(ranks_per_node: int = 0):
    return ep.Group(**{**ARGS, "max_tokens_per_rank": OP_CASE["tokens"]},
                    ranks_per_node=ranks_per_node)


def never_calls_op(op: str, seed: int, ranks_per_node: int) -> dict:
    rank, world = started_rank(), tdist.get_world_size()
    group = op_group(ranks_per_node)
    if rank == world - 1:
        first = run_ops(group, seed + rank, skip=op)
        time.sleep(TIMEOUT_S + 1.0)  # then comes late, after the others gave up
        idx, _ = op_inputs(seed + rank)
        return dict(first=first, late=timed(lambda: group.create_handle(idx)))
    outcome = run_ops(group, seed + rank)
    # A stopped group refuses the next call at once, without a collective.
    outcome["next"] = timed(lambda: group.create_handle(op_inputs(seed)[0]))
    return outcome


# ranks_per_node: 0 (one node), or nodes (the cuda backend's NCCL steps between nodes are under
# its watchdog; tests/gpu/test_cuda_faults.py runs the same cases there).
@pytest.mark.parametrize("world_size,op,ranks_per_node",
                         [(2, "create_handle", 0), (2, "dispatch", 0), (4, "combine", 0),
                          (2, "dispatch", 1), (4, "combine", 2)])
def test_rank_that_never_calls_an_op_makes_the_others_raise(world_size, op, ranks_per_node, seed):
    silent = world_size - 1
    runs = dist.run_isolated(world_size, never_calls_op, op, seed, ranks_per_node,
                             timeout=2 * TIMEOUT_S + SLACK_S + 60.0)
    for r in runs:
        assert r.value is not None and r.exitcode == 0, r.outcome()
    for r in runs[:silent]:
        o = r.value
        assert (o["op"], o["error"]) == (op, "NcclEpError"), o
        assert TIMEOUT_S <= o["took"] <= TIMEOUT_S + SLACK_S, o
        assert o["message"].startswith(f"{op}: rank {r.rank} waited for rank {silent} "), o
        assert f"which did not reach this {op}" in o["message"], o["message"]
        assert o["next"]["error"] == "NcclEpError" and o["next"]["took"] < SLACK_S, o["next"]
        assert o["next"]["message"].startswith(f"this group stopped after {op} failed"), o
    late = runs[silent].value
    assert late["first"]["message"] == "skipped", late
    assert late["late"]["error"] == "NcclEpError", late
    assert late["late"]["took"] <= TIMEOUT_S + SLACK_S, late
    assert "stopped this group" in late["late"]["message"], late["late"]["message"]


def dies_in_op(op: str, seed: int) -> dict:
    rank, world = started_rank(), tdist.get_world_size()
    return run_ops(op_group(), seed + rank, die_in=op if rank == world - 1 else "")


@pytest.mark.parametrize("world_size,op", [(2, "dispatch"), (4, "combine")])
def test_rank_that_dies_in_an_op_makes_the_others_raise(world_size, op, seed):
    victim = world_size - 1
    runs = dist.run_isolated(world_size, dies_in_op, op, seed,
                             timeout=TIMEOUT_S + SLACK_S + 60.0)
    assert runs[victim].exitcode == 17, runs[victim].outcome()
    for r in runs[:victim]:
        o = r.value
        assert o is not None and r.exitcode == 0, r.outcome()
        assert (o["op"], o["error"]) == (op, "NcclEpError"), o
        assert o["took"] <= TIMEOUT_S + SLACK_S, o
        assert o["message"].startswith(f"{op}: rank {r.rank} "), o["message"]
        assert "this group is stopped" in o["message"], o["message"]


THREAD_ITERATIONS = 200  # the reference's ops take milliseconds on CPU


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
def test_handles_destroyed_by_another_thread_during_ops(recv_mode, world_size, seed,
                                                        summary_line):
    summary_line(dist.run(world_size, thread_cases.check_destroying_thread, recv_mode, seed,
                          "torch", THREAD_ITERATIONS, timeout=600)[0])
