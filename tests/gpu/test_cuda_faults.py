"""Faults on the GPU machine (issue 8), one rank per GPU over NCCL, cuda backend: what the other
ranks see when one rank stops calling or dies in the middle of an op, and handles destroyed from
another thread while ops run on the same group.

A rank that stops or dies must make every other rank raise a clear error (the operation and the
rank not heard from) within the group's timeout (FAULT_TIMEOUT_S here), never hang; afterwards
the group can be destroyed and the process can exit. Every test prints one summary line with each
rank's outcome and its time to error.

- A rank that never makes a call (create_handle, dispatch or combine; the last rank): on the shared
  process pool of tests/dist.py. When the others have raised, it makes the calls it skipped
  ("late"): they must raise too, the group is stopped.
- A rank that never creates the Group: fresh processes (dist.run_isolated); the others name it
  within the timeout (group creation's rendezvous).
- A rank killed (os._exit) right before its dispatch, inside its dispatch or inside its combine:
  fresh processes; the survivors raise, naming the victim, in that op or a later one (the
  victim's running kernel may outlive its process), destroy the group and exit with code 0.
- Both also with ranks_per_node=1 (every rank a node of its own: the rail's NCCL send/receive
  and the routing all-gather carry the ops): the watchdog of csrc/runtime/watchdog.cc must turn the
  NCCL wait into the same error within the timeout. These also run with two ranks on one GPU
  (each an emulated host: gpu_common.gpus_needed).
- The existing local-team versions (tests/gpu/test_cuda_local_team.py) run every rank in one
  process; these run one process per GPU, as training does.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as tdist

import dist
import ep_cases
import thread_cases
from ep_cases import group_pair, rank_inputs, recv_rows_bound
from gpu_common import requires_gpus, skip_without_gpus, this_device, world_sizes

pytestmark = requires_gpus

BF16 = torch.bfloat16
FAULT_TIMEOUT_S = 2.0  # the groups' timeout_s in these tests
# Allowed on top of the timeout: the launch of the waiting kernel, the stream synchronize that
# reports the error, Python; far below anything that looks like a hang.
SLACK_S = 8.0
FAULT_CASE = dict(tokens=512, hidden=2048, topk=4, experts=16, dtype=BF16, routing="random")
# One step of training as the library sees it; the last entry synchronizes and checks.
ROUND = ("create_handle", "dispatch", "combine", "check_errors")
# Ranks per node of the fault groups: 0 = one node (the device-side waits), 1 = a node per rank
# (the NCCL steps between nodes, under the watchdog).
NODES = pytest.mark.parametrize("ranks_per_node", [0, 1], ids=["one_node", "node_per_rank"])


def fault_group(device, recv_mode: str, world: int, case: dict = FAULT_CASE, **extra):
    """The cuda group of ``case`` with the short fault timeout; capacity mode with room for any
    routing (no overflow can stand in for the fault under test)."""
    capacity = None
    if recv_mode == "capacity":
        capacity = recv_rows_bound(world, case["tokens"], case["topk"], case["experts"] // world)
    return group_pair(device, experts=case["experts"], hidden=case["hidden"],
                      max_tokens=case["tokens"], max_topk=case["topk"], dtype=case["dtype"],
                      capacity=capacity, backends=("cuda",), timeout_s=FAULT_TIMEOUT_S,
                      **extra)[0]


def step(group, inputs, state: dict, op: str) -> None:
    x, idx, probs = inputs
    if op == "create_handle":
        state["handle"] = group.create_handle(idx)
        state["rows"] = state["handle"].num_recv_tokens  # exact mode: waits for the layout
    elif op == "dispatch":
        state["recv_x"] = state["handle"].dispatch(x, probs)[0]
    elif op == "combine":
        state["y"] = state["handle"].combine(state["recv_x"])
    else:
        group.check_errors()  # synchronizes the stream: a device-side error surfaces here


def run_until_error(group, inputs, state: dict, plan) -> dict:
    """Runs ``plan``'s steps until one raises. ``index``: 1-based position of the step that
    raised (None if none did), ``took``: seconds from the first step to the error."""
    start = time.monotonic()
    for i, op in enumerate(plan):
        try:
            step(group, inputs, state, op)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            return dict(error=type(exc).__name__, message=str(exc), index=i + 1,
                        step=f"{op} (step {i + 1})", took=time.monotonic() - start,
                        at=time.time())
    return dict(error=None, message="", index=None, step="no step", took=time.monotonic() - start,
                at=time.time())


def describe(o: dict) -> str:
    took = f"{o['took']:.2f} s" if "took" in o else "-"
    return (f"rank {o['rank']} ({o['role']}): {o['error'] or 'NO ERROR'} at {o['step']} after "
            f"{took}, destroy {o.get('destroy_s', float('nan')):.2f} s")


def waited_for(message: str, rank: int) -> bool:
    """The message names ``rank`` among those its rank waited for ("waited for rank 3", or, when
    an NCCL step between nodes waited for several, "waited for ranks 1, 2, 3")."""
    return re.search(rf"waited for ranks? (\d+, )*{rank}\b", message) is not None


def names_the_fault(message: str, op: str, rank: int) -> bool:
    """The waiting rank's message names the operation and the rank it did not hear from (or,
    when another survivor timed out first, that survivor's stop of the group in that op)."""
    return op in message and (waited_for(message, rank) or "stopped this group" in message)


# ------------------------------------------------------------------------------------------------
# a rank that never calls
# ------------------------------------------------------------------------------------------------


def check_never_calls(op: str, recv_mode: str, seed: int, ranks_per_node: int) -> dict:
    rank, world = ep_cases.rank_and_size()
    device = this_device()
    host = tdist.new_group(backend="gloo")  # meeting points outside the library and the GPUs
    silent = world - 1
    inputs = rank_inputs(FAULT_CASE, seed, rank, device)
    group = fault_group(device, recv_mode, world, ranks_per_node=ranks_per_node)
    state, skipped = {}, ROUND.index(op)
    if rank == silent:
        for s in ROUND[:skipped]:  # the calls before `op`, together with the others
            step(group, inputs, state, s)
        tdist.barrier(group=host)  # the others have raised (or given up)
        out = dict(run_until_error(group, inputs, state, (ROUND + ROUND)[skipped:]), role="late")
        tdist.barrier(group=host)
    else:
        out = dict(run_until_error(group, inputs, state, ROUND + ROUND), role="waiting")
        tdist.barrier(group=host)
        tdist.barrier(group=host)  # the late rank is done with the group
    start = time.monotonic()
    group.destroy()
    out.update(rank=rank, destroy_s=time.monotonic() - start)
    tdist.destroy_process_group(host)
    return out


@pytest.mark.parametrize("world_size", world_sizes(nodes_of_one=True)[1:])
@NODES
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
@pytest.mark.parametrize("op", ROUND[:3])
def test_rank_that_never_calls_makes_the_others_raise(op, recv_mode, ranks_per_node, world_size,
                                                      seed, summary_line):
    skip_without_gpus(world_size, ranks_per_node)
    per_rank = dist.run(world_size, check_never_calls, op, recv_mode, seed, ranks_per_node,
                        backend="nccl", timeout=60)
    silent = world_size - 1
    waiting, late = per_rank[:silent], per_rank[silent]
    summary_line(f"x{world_size} {recv_mode} G={ranks_per_node or world_size}, rank {silent} "
                 f"never calls {op} (timeout {FAULT_TIMEOUT_S:g} s): "
                 + "; ".join(describe(o) for o in per_rank)
                 + f" | rank 0: {waiting[0]['message'][:200]}")
    for o in waiting:
        assert o["error"] == "NcclEpError", describe(o) + ": " + o["message"]
        assert o["index"] <= len(ROUND), f"rank {o['rank']} got through the step: {describe(o)}"
        assert 0.75 * FAULT_TIMEOUT_S <= o["took"] <= FAULT_TIMEOUT_S + SLACK_S, describe(o)
        assert names_the_fault(o["message"], op, silent), o["message"]
    assert any(waited_for(o["message"], silent) for o in waiting), (
        f"no rank named rank {silent}: {[o['message'] for o in waiting]}")
    # The late rank must not go on as if the group were alive.
    assert late["error"] == "NcclEpError", describe(late) + ": " + late["message"]
    assert late["took"] <= FAULT_TIMEOUT_S + SLACK_S, describe(late)
    for o in per_rank:
        assert o["destroy_s"] < 30.0, describe(o)


def never_creates_group(hold_s: float) -> dict:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    device = this_device()
    tdist.barrier()  # (gloo) the short timeout measures the fault, not the ranks' start-up
    silent = world - 1
    if rank == silent:
        time.sleep(hold_s)  # alive and never calling
        return dict(rank=rank, role="silent", error=None, message="", step="-", took=0.0)
    start = time.monotonic()
    try:
        group = fault_group(device, "exact", world)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        dist.report("raised", type(exc).__name__)
        return dict(rank=rank, role="waiting", error=type(exc).__name__, message=str(exc),
                    step="Group()", took=time.monotonic() - start)
    group.destroy()
    return dict(rank=rank, role="waiting", error=None, message="", step="Group()",
                took=time.monotonic() - start)


@pytest.mark.parametrize("world_size", world_sizes()[1:])
def test_rank_that_never_creates_the_group_makes_the_others_raise(world_size, summary_line):
    hold = FAULT_TIMEOUT_S + SLACK_S + 1.0
    runs = dist.run_isolated(world_size, never_creates_group, hold, gpus=True,
                             timeout=hold + 5.0)
    silent = world_size - 1
    summary_line(f"x{world_size}, rank {silent} never calls Group() (timeout "
                 f"{FAULT_TIMEOUT_S:g} s): " + "; ".join(
                     f"rank {r.rank}: {r.outcome()}" + (f", {r.value['error'] or 'no error'} "
                                                         f"after {r.value['took']:.2f} s"
                                                         if r.value else "") for r in runs)
                 + (f" | rank 0: {runs[0].value['message'][:200]}" if runs[0].value else ""))
    for r in runs[:silent]:
        assert r.value is not None, f"rank {r.rank}: {r.outcome()}"
        o = r.value
        assert o["error"] is not None and o["took"] <= FAULT_TIMEOUT_S + SLACK_S, o
        assert f"rank {silent}" in o["message"], o["message"]
    for r in runs:
        assert r.exitcode == 0, f"rank {r.rank}: {r.outcome()}"


# ------------------------------------------------------------------------------------------------
# a rank killed in the middle of an op
# ------------------------------------------------------------------------------------------------

KILL_CASE = dict(tokens=4096, hidden=2048, topk=8, experts=32, dtype=BF16, routing="random")
# point -> (receive mode, the op the survivors wait in)
KILL_POINTS = {"before_dispatch": ("exact", "dispatch"),
               "during_dispatch": ("exact", "dispatch"),
               "during_combine": ("capacity", "combine")}
KILL_EXIT_CODE = 17
# The survivors join the op this long after the victim entered it: the victim dies while its
# kernel waits for them (inside the op, not after it).
PEER_DELAY_S = 0.5


def die(point: str) -> None:
    dist.report("killed", point)
    os._exit(KILL_EXIT_CODE)


def killed_mid_op(point: str, seed: int, ranks_per_node: int) -> dict:
    recv_mode, op = KILL_POINTS[point]
    rank, world = tdist.get_rank(), tdist.get_world_size()
    device = this_device()
    victim = world - 1
    inputs = rank_inputs(KILL_CASE, seed, rank, device)
    tdist.barrier()  # (gloo) Group()'s rendezvous has the short timeout: no start-up skew
    group = fault_group(device, recv_mode, world, KILL_CASE, ranks_per_node=ranks_per_node)
    state = {}
    step(group, inputs, state, "create_handle")
    if op == "combine":
        step(group, inputs, state, "dispatch")
    torch.cuda.synchronize()
    tdist.barrier()  # (gloo) everyone has the group, the handle and, before a combine, its rows
    if rank == victim:
        if point == "before_dispatch":
            die(point)
        entered = torch.cuda.Event()
        entered.record()
        step(group, inputs, state, op)
        while not entered.query():  # the op's kernel is next on the stream
            time.sleep(0.0002)
        time.sleep(0.05)  # ... and now spins in its waits for the peers
        die(point)
    time.sleep(PEER_DELAY_S)
    out = run_until_error(group, inputs, state, ROUND[ROUND.index(op):] + ROUND)
    dist.report("raised", out["error"])
    start = time.monotonic()
    group.destroy()
    out.update(rank=rank, role="survivor", destroy_s=time.monotonic() - start)
    dist.report("destroyed", out["destroy_s"])
    return out


@pytest.mark.parametrize("world_size", world_sizes(nodes_of_one=True)[1:])
@NODES
@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_rank_killed_mid_op_makes_the_others_raise(point, ranks_per_node, world_size, seed,
                                                   summary_line):
    skip_without_gpus(world_size, ranks_per_node)
    recv_mode, op = KILL_POINTS[point]
    runs = dist.run_isolated(world_size, killed_mid_op, point, seed, ranks_per_node, gpus=True,
                             timeout=45.0)
    victim = runs[-1]
    killed_at = victim.reports.get("killed", (None, None))[1]
    parts = [f"G={ranks_per_node or world_size}: rank {victim.rank} killed "
             f"{point.replace('_', ' ')} ({victim.outcome()})"]
    for r in runs[:-1]:
        o = r.value
        if o is None:
            raised = r.reports.get("raised")
            parts.append(f"rank {r.rank}: {r.outcome()}" + (f" after raising {raised[0]}"
                                                            if raised else ""))
            continue
        after = f", {o['at'] - killed_at:.2f} s after the kill" if killed_at else ""
        parts.append(f"rank {r.rank}: {o['error'] or 'NO ERROR'} at {o['step']} "
                     f"{o['took']:.2f} s into the op{after}, destroy {o['destroy_s']:.2f} s, "
                     f"{r.outcome()}")
    message = runs[0].value["message"][:200] if runs[0].value else ""
    summary_line(f"x{world_size} {recv_mode} (timeout {FAULT_TIMEOUT_S:g} s): "
                 + "; ".join(parts) + f" | rank 0: {message}")
    assert victim.exitcode == KILL_EXIT_CODE and killed_at is not None, victim.outcome()
    for r in runs[:-1]:
        assert r.value is not None, f"rank {r.rank}: {r.outcome()}"
        o = r.value
        assert o["error"] == "NcclEpError", f"rank {r.rank}: {o}"
        # The op the victim died in or the survivors' next one (the time bound below keeps it
        # the next): the victim's kernel, already launched, may finish its part after the
        # process exits (the driver tears the context down after the running kernel), so the
        # survivors' dispatch may complete and their combine time out naming the victim.
        assert any(names_the_fault(o["message"], later, victim.rank)
                   for later in ("create_handle", "dispatch", "combine")), o["message"]
        assert o["at"] - killed_at <= PEER_DELAY_S + FAULT_TIMEOUT_S + SLACK_S, o
        assert o["destroy_s"] < 30.0, o
        assert r.exitcode == 0, f"rank {r.rank}: {r.outcome()}"


# ------------------------------------------------------------------------------------------------
# a thread that destroys handles while another runs ops on the same group (tests/thread_cases.py;
# the reference backend's version: tests/test_reference_faults.py)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", world_sizes()[1:])
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
def test_handles_destroyed_by_another_thread_during_ops(recv_mode, world_size, seed,
                                                        summary_line):
    summary_line(dist.run(world_size, thread_cases.check_destroying_thread, recv_mode, seed,
                          "cuda", backend="nccl")[0])
