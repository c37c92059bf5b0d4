"""A thread that destroys handles while another thread runs ops on the same group (issue 8), for
any backend: the GPU test runs the cuda backend (tests/gpu/test_cuda_faults.py), the CPU suite the
torch reference (tests/test_reference_faults.py). The expected outputs come from the reference
backend, computed one handle at a time before the race starts."""

from __future__ import annotations

import bisect
import queue
import threading
import time

import torch

import ep_cases

THREAD_CASE = dict(tokens=256, hidden=1024, topk=4, experts=16, dtype=torch.bfloat16)
THREAD_BANK = 8  # routings, used in turn


def overlapping(spans, sequential) -> int:
    """How many of ``spans`` (start, end) overlap one of ``sequential``: spans of one thread, in
    order and disjoint, so only the last of them that starts before a span ends can overlap it."""
    starts = [s for s, _ in sequential]
    count = 0
    for s, e in spans:
        i = bisect.bisect_right(starts, e)
        count += i > 0 and sequential[i - 1][1] >= s
    return count


def check_destroying_thread(recv_mode: str, seed: int, backend: str,
                            iterations: int = 1000) -> str:
    """``iterations`` create/dispatch/combine rounds on a ``backend`` group of this rank's device
    (the current CUDA device for "cuda", else the CPU), each handle handed to a second thread
    that destroys it (half by ``destroy()``, half by dropping the last reference) while the
    next round's calls run; every output bitwise equal to the reference's."""
    rank, world = ep_cases.rank_and_size()
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "cuda"
              else torch.device("cpu"))
    c = THREAD_CASE
    capacity = (ep_cases.recv_rows_bound(world, c["tokens"], c["topk"], c["experts"] // world)
                if recv_mode == "capacity" else None)
    ref, group = ep_cases.group_pair(device, experts=c["experts"], hidden=c["hidden"],
                                     max_tokens=c["tokens"], max_topk=c["topk"],
                                     dtype=c["dtype"], capacity=capacity,
                                     backends=("torch", backend))
    bank = []
    for i in range(THREAD_BANK):
        odd = 1 + 37 * i % (c["tokens"] - 1)  # in [1, tokens)
        case = dict(c, tokens=(c["tokens"], odd, 0, c["tokens"] // 2)[(rank + i) % 4],
                    routing=("random", "masked", "one_expert")[i % 3])
        x, idx, probs = ep_cases.rank_inputs(case, seed + i, rank, device)
        h = ref.create_handle(idx)
        recv_x, _ = h.dispatch(x, probs)
        bank.append((x, idx, probs, h.num_recv_tokens, recv_x, h.combine(recv_x)))
        h.destroy()
    ref.destroy()

    doomed = queue.Queue(maxsize=3)  # a few handles wait for the reaper at most
    destroy_spans, reaper_errors = [], []

    def reaper():
        n = 0
        while True:
            h = doomed.get()
            if h is None:
                return
            start = time.perf_counter()
            try:
                if n % 2:
                    h.destroy()
                else:
                    del h  # the last reference: Handle.__del__ destroys it on this thread
            except Exception as exc:  # noqa: BLE001 - reported below
                reaper_errors.append(repr(exc))
            destroy_spans.append((start, time.perf_counter()))
            n += 1

    thread = threading.Thread(target=reaper, daemon=True)
    thread.start()
    op_spans, mismatches, wrong_counts = [], 0, 0
    previous = None  # the last iteration's handle and outputs, not yet synchronized
    for i in range(iterations + 1):
        if previous is not None:
            # Handed over while its kernels may still run (allowed), just before this thread's
            # next create_handle: the reaper destroys it while that call runs.
            doomed.put(previous.pop("handle"))
        if i < iterations:
            x, idx, probs, rows, want_x, want_y = bank[(i * 3) % THREAD_BANK]
            start = time.perf_counter()
            h = group.create_handle(idx)
            recv_x, _ = h.dispatch(x, probs)
            y = h.combine(recv_x)
            op_spans.append((start, time.perf_counter()))
            wrong_counts += h.num_recv_tokens != rows
        if previous is not None:
            mismatches += (ep_cases.count_mismatches(previous["recv_x"], previous["want_x"])
                           + ep_cases.count_mismatches(previous["y"], previous["want_y"]))
        previous = None
        if i < iterations:
            previous = dict(handle=h, recv_x=recv_x, y=y, want_x=want_x, want_y=want_y)
            h = None
    doomed.put(None)
    thread.join(60)
    assert not thread.is_alive(), "the reaper thread did not finish"
    group.check_errors()
    # The cuda backend's registry of live handles (the reference keeps none).
    live = len(getattr(group._backend, "_handles", ()))
    group.destroy()
    overlaps = overlapping(destroy_spans, op_spans)
    assert not reaper_errors, reaper_errors
    assert len(destroy_spans) == iterations, len(destroy_spans)
    assert live == 0, f"{live} handles still registered after every one was destroyed"
    assert wrong_counts == 0 and mismatches == 0, (wrong_counts, mismatches)
    assert overlaps > 0, "no destroy overlapped an op: the race was not exercised"
    return (f"x{world} {recv_mode} {backend}: {iterations} handles over {THREAD_BANK} routings, "
            f"destroyed by a second thread (half by Handle.__del__), {overlaps} destroys "
            f"overlapped create/dispatch/combine calls; outputs bitwise equal to the reference")
