"""The host section (GPUs): what each call costs the host next to what its kernels cost the GPU,
and a whole eager step next to the same step replayed from a CUDA graph, at EP=1 in one process
(one rank of NCCL, which Megatron's dispatcher needs).

Configurations: HT at each ``--host-ht-tokens`` T, on an exact-mode group and on a capacity-mode
group of ``T x top-k`` rows (at EP=1 every slot lands on the rank, so nothing is dropped; HT
graphs need capacity mode); LL at each ``--host-ll-tokens`` T (T_max = T), in each layout of
``--ll-layouts``, on every SM of the GPU. Items, each a median over ``--iters`` iterations after
``--warmup``:

* ``<op> (host)``: the host's time to enqueue one call (handle, dispatch, combine; LL also
  ``dispatch out=`` and ``combine out=``, which write into the previous call's outputs), the GPU
  held by a sleep kernel queued first so that no call waits for it. Each iteration runs the
  calls ``HOST_REPEATS`` times in a row under one hold: ``(host)`` is of the repeats after the
  first (the steady state of a loop), ``(host, first)`` of the first, which follows a device
  synchronize. Exact mode's count read waits for the GPU: it runs untimed between the handle
  and the dispatch, the GPU held again after it;
* ``<op> (kernel)``: the same call's device time, CUDA events around it, in a second pass of
  each iteration of ``KERNEL_REPEATS`` repeats (an event recorded just before a call adds to its
  enqueue time);
* ``floor: one torch kernel (host)``: the same for ``torch.cuda._sleep(1)``, the host's floor
  under every call (one launch through torch);
* ``step (eager)``: handle + dispatch + combine, ``HOST_STEPS`` steps back to back from an idle
  GPU, the wall time per step: what an eager decode or training loop sees (host and GPU
  overlap; the slower sets the pace);
* ``step (graph)``: the same step captured once into a CUDA graph (capacity mode and LL) and
  replayed ``HOST_STEPS`` times back to back, the wall time per replay; ``graph (kernel)``: one
  replay's device time, the GPU held while it is enqueued;
* ``profile``: for the configurations of ``PROFILED``, ``torch.profiler`` over ``HOST_STEPS``
  eager steps (CPU and CUDA activity: torch's ops and the CUDA runtime calls of every library
  in the process): the ``PROFILE_ROWS`` events of most self CPU time, per step; for Megatron's
  methods a step is their forward (dispatch, the stand-in expert, combine). The profiles run
  after every timed item, each on a new group (``section``);
* ``megatron T=<T>: dispatch`` / ``combine``: ``NcclEpTokenDispatcher``'s methods as MoELayer
  calls them (``benchmarks.dispatchers.MethodDriver``), e2e as the megatron section times them,
  at the group's receive mode (``--recv-mode``); the report puts the HT kernels of the same T
  and mode beside them (like for like in exact mode: in capacity mode the dispatcher sizes its
  rows by the capacity factor, the HT items by T x top-k).
* ``inference T=<T>``, for each ``--host-ll-tokens`` T: ``NcclEpInferenceDispatcher``'s methods
  as Megatron's inference MoE layer calls them (``benchmarks.dispatchers.InferenceDriver``: its
  rank-major LL group on every SM, T_max = T, the experts' fp32 output), timed as a configuration
  is: ``dispatch`` (preprocess + token_dispatch + postprocess: the handle and the dispatch) and
  ``combine`` (the same three: the LL combine takes the experts' fp32 rows) on the host and on
  the GPU,
  beside the ``LL T=<T> rank-major`` calls they make, and the eager step next to its graph.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from .dispatchers import (InferenceDriver, MethodDriver, build_dispatcher,
                          build_inference_dispatcher, megatron_inputs)
from .ll import capture
from .runner import Rank, e2e_mode, run_into

# Cycles of the sleep kernel that holds the GPU while one repeat's calls are enqueued: a few ms,
# longer than any repeat's host work (an iteration holds it HOST_REPEATS times as long).
HOLD_CYCLES = 10_000_000
HOST_REPEATS = 8  # the calls of one iteration, in a row under one hold
KERNEL_REPEATS = 2  # the same for the pass that times the kernels (device times need no loop)
HOST_STEPS = 20  # steps (or replays) back to back per iteration of the step items
HOST_OPS = ("handle", "dispatch", "combine", "dispatch out=", "combine out=")
HOST_KINDS = ("host", "host, first", "kernel")  # the rows of each configuration
# The host's floor, measured as the calls are: one kernel launched through torch (the cheapest
# op that launches one), the configuration FLOOR's item FLOOR_OP.
FLOOR, FLOOR_OP = "floor", "one torch kernel"
# Where the host time goes: the configurations profiled (their prefixes) and the rows kept.
PROFILED = ("HT T=128 exact", "LL T=128 rank-major", "megatron T=128", "megatron T=4096",
            "inference T=128")
PROFILE_ROWS = 15
LL_LAYOUT_NAMES = {"rank_major": "rank-major", "expert_major": "expert-major"}


def ht_prefix(tokens: int, mode: str) -> str:
    return f"HT T={tokens} {mode}"


def ll_prefix(tokens: int, layout: str) -> str:
    return f"LL T={tokens} {LL_LAYOUT_NAMES[layout]}"


def megatron_prefix(tokens: int) -> str:
    return f"megatron T={tokens}"


def inference_prefix(tokens: int) -> str:
    return f"inference T={tokens}"


def _inputs(me: Rank, tokens: int) -> list:
    """``--rotate`` sets of (topk_idx, weights, x) of ``tokens`` tokens."""
    return [me.input_set(s, tokens) for s in range(me.args.rotate)]


def _enqueue_costs(me: Rank, prefix: str, script) -> None:
    """``script(j)``: repeat j's calls in order, each ``(name, fn)`` (timed) or ``(None, fn)``
    (untimed, the GPU held again after it). Emits ``<name> (host)``, ``<name> (host, first)``
    and ``<name> (kernel)`` per timed call. Each iteration runs its repeats twice: HOST_REPEATS
    timed on the host alone, then KERNEL_REPEATS between CUDA events for the kernels (an event
    recorded before a call adds to that call's enqueue time, which a loop without events does
    not pay)."""
    torch, args = me.torch, me.args
    host, first, kernel = defaultdict(list), defaultdict(list), defaultdict(list)

    def repeats(i: int, timed: bool) -> list:
        events, count = [], HOST_REPEATS if timed else KERNEL_REPEATS
        torch.cuda.synchronize()
        torch.cuda._sleep(HOLD_CYCLES * count)
        for repeat in range(count):
            for name, fn in script(i * HOST_REPEATS + repeat):
                if name is None:
                    fn()
                    torch.cuda._sleep(HOLD_CYCLES)  # for the rest of this repeat
                    continue
                if timed:
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    if i >= args.warmup:
                        (host if repeat else first)[name].append((t1 - t0) * 1e3)
                    continue
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                start.record()
                fn()
                end.record()
                events.append((name, start, end))
        torch.cuda.synchronize()
        return events

    for i in range(args.warmup + args.iters):
        repeats(i, True)
        for name, start, end in repeats(i, False):
            if i >= args.warmup:
                kernel[name].append(start.elapsed_time(end))
    for name in host:
        me.emit("times", f"{prefix}: {name} (host)", times_ms=host[name])
        me.emit("times", f"{prefix}: {name} (host, first)", times_ms=first[name])
        me.emit("times", f"{prefix}: {name} (kernel)", times_ms=kernel[name])


def _steps(me: Rank, prefix: str, step, graphed: bool) -> None:
    """``step(i)`` eager, back to back; with ``graphed``, captured once and replayed."""
    torch, args = me.torch, me.args

    def back_to_back(run) -> list:
        walls = []
        for i in range(args.warmup + args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for j in range(HOST_STEPS):
                run(i * HOST_STEPS + j)
            torch.cuda.synchronize()
            if i >= args.warmup:
                walls.append((time.perf_counter() - t0) * 1e3 / HOST_STEPS)
        return walls

    me.emit("times", f"{prefix}: step (eager)", times_ms=back_to_back(step))
    if not graphed:
        return
    graph, _kept = capture(lambda: step(0))
    try:
        me.emit("times", f"{prefix}: step (graph)",
                times_ms=back_to_back(lambda i: graph.replay()))
        device = []
        for i in range(args.warmup + args.iters):
            torch.cuda.synchronize()
            torch.cuda._sleep(HOLD_CYCLES)
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if i >= args.warmup:
                device.append(start.elapsed_time(end))
        me.emit("times", f"{prefix}: graph (kernel)", times_ms=device)
    finally:
        torch.cuda.synchronize()
        graph.reset()  # the graph first, then (with this frame) the handles it replays


def _profile(me: Rank, prefix: str, step) -> None:
    """For a configuration of ``PROFILED``: emits ``<prefix>: profile``, ``[name, calls per step,
    self CPU us per step]`` of the events of most self CPU time over ``HOST_STEPS`` eager
    steps, after ``HOST_STEPS`` steps unprofiled (a new group's first calls)."""
    if prefix not in PROFILED:
        return
    from torch.profiler import ProfilerActivity, profile

    torch = me.torch
    for i in range(HOST_STEPS):
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(HOST_STEPS):
            step(i)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    me.emit("point", data={f"{prefix}: profile": [
        [e.key[:90], e.count / HOST_STEPS, e.self_cpu_time_total / HOST_STEPS]
        for e in events[:PROFILE_ROWS]]})


def _group(me: Rank, tokens: int, **fields):
    from megatron_nccl_ep import Group

    args = me.args
    return Group(num_experts=args.experts, hidden=args.hidden, max_tokens_per_rank=tokens,
                 max_topk=args.topk, dtype=me.dtype, backend="cuda", device=me.device,
                 timeout_s=args.device_timeout, **fields)


def _configuration(me: Rank, prefix: str, script, step, graphed: bool,
                   profile_only: bool) -> None:
    """One HT or LL configuration's pass of the section: its profile (the last pass), else its
    enqueue costs (``script``) and its steps (``step``, replayed from a graph when
    ``graphed``)."""
    if profile_only:
        _profile(me, prefix, step)
        return
    _enqueue_costs(me, prefix, script)
    _steps(me, prefix, step, graphed)


def _ht(me: Rank, tokens: int, mode: str, profile_only: bool) -> None:
    args = me.args
    fields = {"num_sms": args.num_sms}
    if mode == "capacity":
        fields.update(recv_mode="capacity", max_recv_tokens_per_rank=tokens * args.topk)
    group = _group(me, tokens, **fields)
    sets = _inputs(me, tokens)
    prefix = ht_prefix(tokens, mode)
    try:
        def script(i):
            topk, probs, x = sets[i % len(sets)]
            st = {}
            return [("handle", lambda: st.update(h=group.create_handle(topk))),
                    (None, lambda: st["h"].num_recv_tokens),
                    ("dispatch", lambda: st.update(d=st["h"].dispatch(x, probs))),
                    ("combine", lambda: st["h"].combine(st["d"][0]))]

        def step(i):
            topk, probs, x = sets[i % len(sets)]
            handle = group.create_handle(topk)
            recv_x, _ = handle.dispatch(x, probs)
            return handle, handle.combine(recv_x)

        _configuration(me, prefix, script, step, mode == "capacity", profile_only)
    finally:
        me.torch.cuda.synchronize()
        group.destroy()


def _ll(me: Rank, tokens: int, layout: str, profile_only: bool) -> None:
    sms = me.torch.cuda.get_device_properties(me.device).multi_processor_count
    group = _group(me, tokens, mode="ll", ll_layout=layout, num_sms=sms)
    sets = _inputs(me, tokens)
    expert_major = layout == "expert_major"
    prefix = ll_prefix(tokens, layout)
    try:
        def script(i):
            topk, weights, x = sets[i % len(sets)]
            st = {}
            combine_w = weights if expert_major else None
            return [
                (HOST_OPS[0], lambda: st.update(h=group.create_handle(topk))),
                (HOST_OPS[1], lambda: st.update(d=st["h"].dispatch(x, weights))),
                (HOST_OPS[2], lambda: st.update(y=st["h"].combine(st["d"].x, combine_w))),
                (HOST_OPS[3], lambda: st["h"].dispatch(x, weights, out=st["d"])),
                (HOST_OPS[4], lambda: st["h"].combine(st["d"].x, combine_w, out=st["y"]))]

        def step(i):
            topk, weights, x = sets[i % len(sets)]
            handle = group.create_handle(topk)
            out = handle.dispatch(x, weights)
            return handle, out, handle.combine(out.x, weights if expert_major else None)

        _configuration(me, prefix, script, step, True, profile_only)
    finally:
        me.torch.cuda.synchronize()
        group.destroy()


def _megatron(me: Rank, tokens: int, profile_only: bool) -> None:
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    drive = MethodDriver(build_dispatcher(me, "nccl_ep", pg_collection, tokens),
                         megatron_inputs(me, tokens))
    prefix, mode = megatron_prefix(tokens), e2e_mode("cuda")
    if not profile_only:
        me.measure(f"{prefix}: dispatch", drive.dispatch, mode=mode, setup=drive.leaf_inputs)
        me.measure(f"{prefix}: combine", drive.combine_kept, mode=mode,
                   setup=drive.dispatched_rows)
        return

    def forward(i):  # the methods' forward around the stand-in expert (its ops show apart)
        drive.leaf_inputs(i)
        return drive.combine(drive.expert_stand_in(*drive.dispatch(i)))

    _profile(me, prefix, forward)


def _inference(me: Rank, tokens: int, profile_only: bool) -> None:
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    drive = InferenceDriver(build_inference_dispatcher(me, pg_collection, tokens), me, tokens)

    def script(i):
        return [(HOST_OPS[1], lambda: drive.dispatch(i)), (HOST_OPS[2], drive.combine)]

    def step(i):
        return drive.dispatch(i), drive.combine()

    _configuration(me, inference_prefix(tokens), script, step, True, profile_only)


def section(me: Rank) -> None:
    """Every timed item first, then the profiles (``PROFILED``): a torch.profiler run leaves
    CUPTI attached to the process (kineto detaches it only under ``TEARDOWN_CUPTI=1``), which
    adds to the host time of every CUDA call after it."""
    args = me.args
    torch = me.torch
    me.attempt(FLOOR, lambda: _enqueue_costs(
        me, FLOOR, lambda i: [(FLOOR_OP, lambda: torch.cuda._sleep(1))]))
    kernels = []  # (prefix, run(profile_only)) of the HT and LL configurations
    for tokens in args.host_ht_tokens:
        for mode in ("exact", "capacity"):
            kernels.append((ht_prefix(tokens, mode), lambda p, t=tokens, m=mode: _ht(me, t, m, p)))
    for tokens in args.host_ll_tokens:
        for layout in args.ll_layouts:
            kernels.append((ll_prefix(tokens, layout),
                            lambda p, t=tokens, lay=layout: _ll(me, t, lay, p)))
    for prefix, configuration in kernels:
        me.attempt(prefix, lambda: configuration(False))
    methods = []  # the same for Megatron's dispatcher methods
    try:
        from megatron.core import parallel_state
    except Exception as exc:  # noqa: BLE001 - the other items stand without Megatron
        me.emit("error", "megatron", error=f"megatron-core does not import: {exc}")
        parallel_state = None
    else:
        parallel_state.initialize_model_parallel(expert_model_parallel_size=1)
        methods = [(megatron_prefix(tokens), lambda p, t=tokens: _megatron(me, t, p))
                   for tokens in args.host_ht_tokens]
        methods += [(inference_prefix(tokens), lambda p, t=tokens: _inference(me, t, p))
                    for tokens in args.host_ll_tokens]
    try:
        for prefix, configuration in methods:
            me.attempt(prefix, lambda: configuration(False))
        for prefix, configuration in kernels + methods:
            if prefix in PROFILED:
                me.attempt(f"{prefix}: profile", lambda: configuration(True))
    finally:
        if parallel_state is not None:
            from megatron_nccl_ep.dispatcher import destroy_groups
            from megatron_nccl_ep.inference import destroy_inference_groups

            destroy_groups()
            destroy_inference_groups()
            parallel_state.destroy_model_parallel()


def run(result: dict, args: argparse.Namespace, budget_end: float) -> None:
    """The section on GPU 0 in one process: ``result['host']``, its items by name, and
    ``result['host_profiles']``, the profiles by configuration."""
    host_args = argparse.Namespace(**{**vars(args), "nproc": 1})
    result["host"], _, facts = run_into(result, "host", section, host_args, budget_end)
    result["host_profiles"] = facts
