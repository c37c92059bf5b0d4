"""The CUDA backend's resources and errors: 1000 handle create/destroy cycles leave device memory
unchanged, group destroy returns its memory, and bad input raises the same clear errors as the
reference, at the latest by the next call after a synchronize (capacity mode never syncs the
host, so its device-side checks may surface one call later)."""

import re

import pytest
import torch

import dense
import dist
import ep_cases
import megatron_nccl_ep as ep
from ep_cases import rank_inputs
from gpu_common import device_memory, requires_gpus, world_sizes

pytestmark = requires_gpus

CYCLE_CASE = dict(tokens=4096, hidden=1024, topk=8, experts=64, dtype=torch.bfloat16,
                  routing="masked")
CYCLES = 1000


def cuda_group(case, world, device, backend="cuda", **kwargs):
    return ep.Group(num_experts=case["experts"], hidden=case["hidden"],
                    max_tokens_per_rank=case["tokens"], max_topk=case["topk"],
                    dtype=case["dtype"], backend=backend, device=device, **kwargs)


def exercise(group, x, idx, probs):
    """One handle through dispatch, combine and combine_probs; nothing kept."""
    h = group.create_handle(idx)
    recv_x, recv_probs = h.dispatch(x, probs)
    h.combine(recv_x)
    h.combine_probs(recv_probs)
    h.destroy()


def check_handle_cycles(recv_mode: str, seed: int) -> str:
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, probs = rank_inputs(CYCLE_CASE, seed, rank, device)
    extra = {}
    if recv_mode == "capacity":
        extra = dict(recv_mode="capacity", capacity_factor=float(world) + 0.5)
    group = cuda_group(CYCLE_CASE, world, device, **extra)
    for _ in range(10):  # warm-up: lazy module loading, first-use buffers
        exercise(group, x, idx, probs)
    before = device_memory(device)
    counts = set()
    for i in range(CYCLES):
        if i % 100 == 0:
            exercise(group, x, idx, probs)
        h = group.create_handle(idx)
        counts.add(h.num_recv_tokens)
        h.destroy()
    del h  # its tokens_per_expert (a device tensor in capacity mode) is the user's until now
    after = device_memory(device)
    group.destroy()
    assert len(counts) == 1, f"one routing gave several receive counts: {sorted(counts)}"
    assert after[0] == before[0], (
        f"torch-allocated bytes {before[0]} -> {after[0]} after {CYCLES} handle cycles")
    assert after[1] >= before[1], (
        f"driver free memory dropped by {before[1] - after[1]} bytes after {CYCLES} handle cycles")
    return (f"{recv_mode} x{world}: {CYCLES} handle cycles, allocated {before[0]} -> {after[0]} B,"
            f" driver free {before[1]} -> {after[1]} B")


@pytest.mark.parametrize("world_size", world_sizes())
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
def test_handle_cycles_leave_memory_unchanged(recv_mode, world_size, seed, summary_line):
    summary_line(dist.run(world_size, check_handle_cycles, recv_mode, seed, backend="nccl")[0])


def check_group_destroy(seed: int) -> str:
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, probs = rank_inputs(CYCLE_CASE, seed, rank, device)
    capacity = dict(recv_mode="capacity", capacity_factor=float(world) + 0.5)

    def two_groups_lifecycle():
        groups = [cuda_group(CYCLE_CASE, world, device, **kwargs) for kwargs in ({}, capacity)]
        live_handles = [g.create_handle(idx) for g in groups]  # destroyed by their group
        for g in groups:
            exercise(g, x, idx, probs)
        during = device_memory(device)
        for g in groups:
            g.destroy()
        del live_handles, groups
        return during

    # Warm-up: the same lifecycle once, so that what CUDA and NCCL load or cache once per
    # process (kernels, NCCL's own high-water marks for concurrent communicators) is excluded.
    two_groups_lifecycle()
    before = device_memory(device)
    during = two_groups_lifecycle()
    after = device_memory(device)
    assert during[1] < before[1], "two live groups hold no device memory? (the check would be void)"
    assert after[0] == before[0], f"torch-allocated bytes {before[0]} -> {after[0]}"
    assert after[1] >= before[1], (
        f"group destroy left {before[1] - after[1]} bytes of device memory behind "
        f"(the groups held {before[1] - during[1]})")
    return (f"x{world}: 2 groups held {before[1] - during[1]} B; after destroy driver free "
            f"{before[1]} -> {after[1]} B")


@pytest.mark.parametrize("world_size", world_sizes())
def test_group_destroy_returns_memory(world_size, seed, summary_line):
    summary_line(dist.run(world_size, check_group_destroy, seed, backend="nccl")[0])


def check_routing_released(seed: int) -> str:
    """Handle.routing_released: exact mode once a count read has seen the layout (every dispatch
    reads it), never in capacity mode (nothing waits there)."""
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, probs = rank_inputs(CYCLE_CASE, seed, rank, device)
    seen = []
    for extra in ({}, dict(recv_mode="capacity", capacity_factor=float(world) + 0.5)):
        group = cuda_group(CYCLE_CASE, world, device, **extra)
        for read in ("dispatch", "tokens_per_expert"):
            h = group.create_handle(idx)
            before = h.routing_released
            if read == "dispatch":
                h.dispatch(x, probs)
            else:
                h.tokens_per_expert  # noqa: B018 - the read is the point
            seen.append((group.config.recv_mode, read, before, h.routing_released))
            h.destroy()
        torch.cuda.synchronize()
        group.destroy()
    want = [("exact", "dispatch", False, True), ("exact", "tokens_per_expert", False, True),
            ("capacity", "dispatch", False, False),
            ("capacity", "tokens_per_expert", False, False)]
    assert seen == want, f"(mode, read, released before, after): {seen}, expected {want}"
    return f"x{world}: {seen}"


@pytest.mark.parametrize("world_size", world_sizes())
def test_routing_released_follows_the_count_read(world_size, seed, summary_line):
    summary_line(dist.run(world_size, check_routing_released, seed, backend="nccl")[0])


ERROR_CASE = dict(tokens=64, hidden=256, topk=4, experts=16, dtype=torch.bfloat16,
                  routing="random")


def run_until_error(group, idx, x, probs, steps: list):
    """Every call a training step would make, with synchronizes in between: a deferred device-side
    error must have surfaced by the end. ``steps`` records how far it got (for the summary)."""
    steps.append("create_handle")
    h = group.create_handle(**idx) if isinstance(idx, dict) else group.create_handle(idx)
    assert h.num_recv_tokens >= 0
    steps.append("dispatch")
    recv_x, recv_probs = h.dispatch(x, probs)
    torch.cuda.synchronize()
    steps.append("combine")
    h.combine(recv_x)
    steps.append("combine_probs")
    h.combine_probs(recv_probs)
    torch.cuda.synchronize()
    steps.append("dispatch after sync")
    h.dispatch(x, probs)
    torch.cuda.synchronize()
    steps.append("never")


def bad_slot(value_of):
    def edit(idx):
        idx = idx.clone()
        idx[3, 1] = value_of(idx[3])
        return idx
    return edit


E = ERROR_CASE["experts"]
# name -> (routing edit, exception, message pattern)
ROUTING_ERRORS = {
    "expert_out_of_range": (bad_slot(lambda row: E), ValueError,
                            rf"topk_idx\[3, 1\] = {E} is out of range"),
    "expert_below_minus_one": (bad_slot(lambda row: -5), ValueError,
                               r"topk_idx\[3, 1\] = -5 is out of range"),
    "duplicate_expert": (bad_slot(lambda row: row[0]), ValueError,
                         r"token 3 names expert \d+ twice"),
    # Shapes beyond the group's bounds: also agreed on inside the routing exchange.
    "too_many_tokens": (lambda idx: torch.cat([idx, idx[:1]]), ValueError,
                        rf"{ERROR_CASE['tokens'] + 1} tokens, more than max_tokens_per_rank="),
    "topk_above_max_topk": (lambda idx: torch.cat([idx, idx[:, :1]], 1), ValueError,
                            rf"top-k {ERROR_CASE['topk'] + 1}.*max_topk={ERROR_CASE['topk']}"),
    # A routing map whose token 3 routes to every expert (the other ranks may pass top-k ids).
    "routing_map_too_many_experts": (
        lambda idx: {"routing_map": torch.zeros(idx.shape[0], E, dtype=torch.bool,
                                                device=idx.device).index_fill_(0, torch.tensor(
                                                    [3], device=idx.device), True)},
        ValueError, rf"routing_map row 3 routes to {E} experts, more than max_topk="
                    rf"{ERROR_CASE['topk']}"),
}


def check_routing_error(case_name: str, recv_mode: str, bad_ranks, seed: int) -> str:
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, probs = rank_inputs(ERROR_CASE, seed, rank, device)
    edit, exc, pattern = ROUTING_ERRORS[case_name]
    extra = dict(timeout_s=20.0)
    if recv_mode == "capacity":
        extra.update(recv_mode="capacity", capacity_factor=float(world) + 0.5)
    group = cuda_group(ERROR_CASE, world, device, **extra)
    bad = edit(idx) if rank in bad_ranks else idx
    steps = []
    with pytest.raises(exc, match=pattern) as info:
        run_until_error(group, bad, x, probs, steps)
    group.destroy()
    return f"raised at {steps[-1]}: {info.value}"


@pytest.mark.parametrize("world_size", world_sizes())
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
@pytest.mark.parametrize("who", ["all_ranks", "rank_1_only"])
@pytest.mark.parametrize("case_name", list(ROUTING_ERRORS))
def test_cuda_bad_routing_raises(case_name, who, recv_mode, world_size, seed, summary_line):
    if who == "rank_1_only" and world_size < 2:
        pytest.skip("a rank-1-only error needs 2 ranks")
    bad_ranks = tuple(range(world_size)) if who == "all_ranks" else (1,)
    per_rank = dist.run(world_size, check_routing_error, case_name, recv_mode, bad_ranks, seed,
                        backend="nccl")
    summary_line(f"x{world_size} {recv_mode}, bad on ranks {list(bad_ranks)}: rank 0 "
                 f"{per_rank[0]}; rank {world_size - 1} {per_rank[-1]}")


def one_row_short(case: dict, seed: int) -> tuple:
    """This rank's inputs of ``case`` and a capacity-mode group one row short of what the
    routing needs on the fullest rank: (group, x, idx, probs, capacity)."""
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, probs = rank_inputs(case, seed, rank, device)
    exact = cuda_group(case, world, device)
    need = torch.tensor([exact.create_handle(idx).num_recv_tokens], device=device)
    exact.destroy()
    torch.distributed.all_reduce(need, op=torch.distributed.ReduceOp.MAX)
    group = cuda_group(case, world, device, recv_mode="capacity",
                       max_recv_tokens_per_rank=int(need) - 1, timeout_s=20.0)
    return group, x, idx, probs, int(need) - 1


def check_capacity_overflow(routing: str, seed: int) -> str:
    group, x, idx, probs, capacity = one_row_short(dict(ERROR_CASE, routing=routing), seed)
    steps = []
    with pytest.raises(ep.NcclEpError, match=rf"capacity overflow.*max_recv_tokens_per_rank="
                                             rf"{capacity}") as info:
        run_until_error(group, idx, x, probs, steps)
    group.destroy()
    return f"raised at {steps[-1]}: {info.value}"


@pytest.mark.parametrize("world_size", world_sizes())
@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_cuda_capacity_overflow_raises(routing, world_size, seed, summary_line):
    per_rank = dist.run(world_size, check_capacity_overflow, routing, seed, backend="nccl")
    summary_line(f"x{world_size}: rank 0 {per_rank[0]}")


def check_overflow_poisons_the_step(seed: int) -> str:
    """Capacity mode, one row short: a whole step is enqueued before the layout kernel finds the
    overflow (the stream sleeps first), so dispatch and combine start on a stopped group. Their
    outputs must be NaN everywhere (0xFF bytes; the allocator's cache holds 0x5A bytes first,
    so stale memory would show), and the next call must raise the overflow."""
    rank, _ = ep_cases.rank_and_size()
    group, x, idx, probs, _ = one_row_short(ERROR_CASE, seed)
    stale = torch.full((64 << 20,), 0x5A, dtype=torch.uint8, device=x.device)
    del stale  # its block goes back to the cache, where the outputs below come from
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s: the host enqueues the whole step meanwhile
    h = group.create_handle(idx)
    recv_x, recv_probs = h.dispatch(x, probs)
    y = h.combine(recv_x)
    torch.cuda.synchronize()
    for name, t in (("recv_x", recv_x), ("recv_probs", recv_probs), ("y", y)):
        raw = t.view(torch.uint8)
        assert raw.numel() > 0 and bool((raw == 0xFF).all()), (
            f"rank {rank}: {name} not poisoned: {int((raw != 0xFF).sum())} of {raw.numel()} "
            "bytes are not 0xFF")
        assert bool(t.float().isnan().all()), name
    with pytest.raises(ep.NcclEpError, match=r"capacity overflow"):
        group.check_errors()
    group.destroy()
    return f"{recv_x.shape[0]} rows and y poisoned, then raised"


@pytest.mark.parametrize("world_size", world_sizes())
def test_cuda_capacity_overflow_poisons_the_step(world_size, seed, summary_line):
    per_rank = dist.run(world_size, check_overflow_poisons_the_step, seed, backend="nccl")
    summary_line(f"x{world_size}: rank 0 {per_rank[0]}")


def check_argument_errors(seed: int) -> str:
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, probs = rank_inputs(ERROR_CASE, seed, rank, device)
    group = cuda_group(ERROR_CASE, world, device)
    h = group.create_handle(idx)
    T, H = x.shape
    with pytest.raises(TypeError, match=r"x must have dtype .*bfloat16.*got torch\.float32"):
        h.dispatch(x.float(), probs)
    with pytest.raises(ValueError, match=rf"x must be on {device}, got cpu"):
        h.dispatch(x.cpu(), probs)
    with pytest.raises(ValueError, match=rf"x must have shape \({T}, {H}\)"):
        h.dispatch(x[:, :-1], probs)
    with pytest.raises(TypeError, match=r"probs must have dtype"):
        h.dispatch(x, probs.to(torch.int32))
    with pytest.raises(ValueError, match=rf"topk_idx must be on {device}, got cpu"):
        group.create_handle(idx.cpu())
    with pytest.raises(TypeError, match=r"topk_idx must have dtype"):
        group.create_handle(idx.to(torch.int16))
    with pytest.raises(TypeError, match=r"expert_out must have dtype"):
        h.combine(torch.ones(h.num_recv_tokens, H, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"not supported by the cuda backend"):
        ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=4,
                 dtype=torch.float64, backend="cuda", device=device)
    # The handle still works after rejected calls, bitwise as the reference.
    ref = ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=4,
                   dtype=torch.bfloat16, backend="torch", device=device)
    want = ref.create_handle(idx).dispatch(x, probs)
    got = h.dispatch(x, probs)
    dense.assert_bitwise_equal(got[0], want[0], "recv_x after rejected calls")
    dense.assert_bitwise_equal(got[1], want[1], "recv_probs after rejected calls")
    group.destroy()
    return "9 bad arguments rejected with their messages; the handle still matches the reference"


@pytest.mark.parametrize("world_size", world_sizes())
def test_cuda_bad_arguments_raise(world_size, seed, summary_line):
    summary_line(f"x{world_size}: " + dist.run(world_size, check_argument_errors, seed,
                                               backend="nccl")[0])


def check_call_mismatch(case_name: str, seed: int) -> str:
    """Rank 1 makes a different call than the others: the barriers' call signatures must turn it
    into an error on every rank (never a silent wrong result or a hang)."""
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, probs = rank_inputs(ERROR_CASE, seed, rank, device)
    group = cuda_group(ERROR_CASE, world, device, timeout_s=20.0)
    first, second = group.create_handle(idx), group.create_handle(idx)
    odd = rank == 1
    if case_name == "dispatch_vs_combine":
        if odd:
            first.combine(torch.ones(first.num_recv_tokens, x.shape[1], dtype=x.dtype,
                                     device=device))
        else:
            first.dispatch(x, probs)
    elif case_name == "probs_on_some_ranks":
        first.dispatch(x, None if odd else probs)
    elif case_name == "different_handles":
        (second if odd else first).dispatch(x, probs)
    elif case_name == "probs_dtype_differs":  # prob slots are copied as bytes: must agree
        first.dispatch(x, probs.to(torch.bfloat16) if odd else probs)
    with pytest.raises(ep.NcclEpError) as info:
        group.check_errors()
    group.destroy()
    return str(info.value)


CALL_MISMATCHES = {
    "dispatch_vs_combine": r"dispatch \(with probs of 4 bytes\) of handle #0 while rank \d called "
                           r"combine of handle #0|combine of handle #0 while rank \d called "
                           r"dispatch \(with probs of 4 bytes\) of handle #0",
    "probs_on_some_ranks": r"dispatch \((with probs of 4 bytes|without probs)\) of handle #0 while "
                           r"rank \d called dispatch \((with probs of 4 bytes|without probs)\) of "
                           r"handle #0",
    "different_handles": r"dispatch \(with probs of 4 bytes\) of handle #[01] while rank \d called "
                         r"dispatch \(with probs of 4 bytes\) of handle #[01]",
    "probs_dtype_differs": r"dispatch \(with probs of [24] bytes\) of handle #0 while rank \d "
                           r"called dispatch \(with probs of [24] bytes\) of handle #0",
}


@pytest.mark.parametrize("world_size", world_sizes()[1:])
@pytest.mark.parametrize("case_name", list(CALL_MISMATCHES))
def test_cuda_inconsistent_calls_raise(case_name, world_size, seed, summary_line):
    per_rank = dist.run(world_size, check_call_mismatch, case_name, seed, backend="nccl")
    # Every rank raises; the ranks that saw the mismatch name both calls, the others were
    # stopped by them.
    named = [m for m in per_rank if "inconsistent collective calls across ranks" in m]
    assert named, f"no rank named the mismatch: {per_rank}"
    for m in named:
        assert re.search(CALL_MISMATCHES[case_name], m), m
    for m in per_rank:
        assert m in named or "inconsistent calls" in m, m
    summary_line(f"x{world_size}: {named[0]}")


def check_two_errors(first_rank_error: str, recv_mode: str, seed: int) -> str:
    """Rank 0 and rank 1 each pass a different bad routing: every rank of both backends must name
    the same one (the lowest failing rank's)."""
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, probs = rank_inputs(ERROR_CASE, seed, rank, device)
    errors = ["too_many_tokens", "duplicate_expert"]
    if first_rank_error == "duplicate_expert":
        errors.reverse()
    messages = []
    for backend in ("torch", "cuda"):
        extra = dict(timeout_s=20.0)
        if recv_mode == "capacity":
            extra.update(recv_mode="capacity", capacity_factor=float(world) + 0.5)
        group = cuda_group(ERROR_CASE, world, device, backend=backend, **extra)
        bad = ROUTING_ERRORS[errors[rank]][0](idx) if rank < 2 else idx
        with pytest.raises(Exception) as info:
            run_until_error(group, bad, x, probs, [])
        messages.append(str(info.value))
        group.destroy()
    return messages


@pytest.mark.parametrize("world_size", world_sizes()[1:])
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
@pytest.mark.parametrize("first_rank_error", ["duplicate_expert", "too_many_tokens"])
def test_cuda_two_ranks_two_errors_like_the_reference(first_rank_error, recv_mode, world_size,
                                                      seed, summary_line):
    per_rank = dist.run(world_size, check_two_errors, first_rank_error, recv_mode, seed,
                        backend="nccl")
    want = ROUTING_ERRORS[first_rank_error][2]
    for ref_message, cuda_message in per_rank:
        assert cuda_message == ref_message, (cuda_message, ref_message)
        assert re.search(want, cuda_message) and cuda_message.endswith("(rank 0)"), cuda_message
    summary_line(f"x{world_size} {recv_mode}: every rank, both backends: {per_rank[0][1]}")


def without_cumem(seed: int) -> dict:
    """Group creation with NCCL's cuMem allocations off (NCCL_CUMEM_ENABLE=0, set for the whole
    process): either every rank refuses the window with the reason, or the window NCCL gave is
    real and the group computes the reference's bits."""
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, probs = rank_inputs(ERROR_CASE, seed, rank, device)
    try:
        group = cuda_group(ERROR_CASE, world, device)
    except (ValueError, RuntimeError) as exc:
        return dict(error=type(exc).__name__, message=str(exc))
    ref = cuda_group(ERROR_CASE, world, device, backend="torch")
    got, want = group.create_handle(idx), ref.create_handle(idx)
    want_out = want.dispatch(x, probs)
    pairs = list(zip(got.dispatch(x, probs), want_out))
    pairs.append((got.combine(want_out[0]), want.combine(want_out[0])))
    mismatches = sum(int((g.view(torch.uint8) != w.view(torch.uint8)).sum()) for g, w in pairs)
    group.check_errors()
    for g in (got, want, group, ref):
        g.destroy()
    return dict(error=None, mismatches=mismatches)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a window between 2 GPUs")
def test_window_without_cumem_is_refused_or_real(seed, summary_line, monkeypatch):
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "0")  # the spawned ranks inherit it
    runs = dist.run_isolated(2, without_cumem, seed, backend="nccl", gpus=True, timeout=120)
    outcomes = [r.value for r in runs]
    assert all(r.exitcode == 0 and r.value is not None for r in runs), [r.outcome() for r in runs]
    refused = [o for o in outcomes if o["error"] is not None]
    summary_line("NCCL_CUMEM_ENABLE=0, x2: " + (
        f"refused on every rank: {refused[0]['message'][:160]}" if refused else
        f"the window works, {sum(o['mismatches'] for o in outcomes)} mismatching bytes"))
    if refused:
        assert len(refused) == len(outcomes), outcomes  # every rank, not one
        for o in refused:
            assert "symmetric" in o["message"] and "window" in o["message"], o["message"]
    else:
        assert all(o["mismatches"] == 0 for o in outcomes), outcomes
