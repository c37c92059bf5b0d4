"""Where the time of Megatron's dispatcher methods goes, host and GPU: one rank (EP=1, the bench
shape by default), the `nccl_ep` dispatcher driven as MoELayer drives it (dispatch_preprocess,
token_dispatch, dispatch_postprocess, a stand-in expert, combine, backward), timed by
torch.profiler (CPU ranges and CUPTI kernels on one clock). Prints, as medians over --iters
steps, each method's host range and every GPU activity, from the step's first host call, and
the host calls that take longest inside token_dispatch. --trace also writes the chrome trace;
--host-steps times each method on the host without the profiler, --host-calls each library and
torch call on the path (timers wrapped around them, no profiler).

    python benchmarks/megatron_timeline.py [--tokens 4096 --hidden 7168 --topk 8 --experts 256]
        [--host-steps 2000] [--host-calls 300]
"""
import collections
import contextlib
import functools
import importlib
import inspect
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from timeline_args import shape_parser  # this folder

METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "expert",
           "token_combine", "backward")


def build_dispatcher(args, package=None):
    """The `nccl_ep` dispatcher of ``package`` (default: megatron_nccl_ep) on one rank; the first
    call initializes torch.distributed and Megatron's model parallel state."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_nccl_ep

    package = package or megatron_nccl_ep
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1,
                                             device_id=torch.device("cuda", 0))
        parallel_state.initialize_model_parallel(expert_model_parallel_size=1)
        megatron_nccl_ep.register()
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=1,
        ffn_hidden_size=args.hidden, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_token_dispatcher_type="nccl_ep", expert_model_parallel_size=1, bf16=True,
        params_dtype=torch.bfloat16, moe_permute_fusion=False, add_bias_linear=False)
    if getattr(args, "options_from_flags", False):
        # As in Megatron training: the --nccl-ep-* flags of the parsed arguments, read by the
        # dispatcher at each forward (no options on the config).
        import argparse

        from megatron.training.global_vars import set_args

        set_args(argparse.Namespace(nccl_ep_backend="cuda", nccl_ep_num_sms=args.num_sms,
                                    nccl_ep_max_tokens_per_rank=args.tokens))
    else:
        options = importlib.import_module(f"{package.__name__}.options")
        config.nccl_ep_options = options.NcclEpOptions(
            backend="cuda", num_sms=args.num_sms, max_tokens_per_rank=args.tokens)
    return package.NcclEpTokenDispatcher(
        args.experts, list(range(args.experts)), config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def step_inputs(args, count: int, seed: int) -> list:
    """``count`` random steps' router outputs (a routing map and dense probs), hidden states
    [S, 1, H] as MoELayer hands them over, and output gradients."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    steps = []
    for _ in range(count):
        topk = torch.rand(args.tokens, args.experts, generator=gen, device="cuda").topk(
            args.topk, dim=1).indices
        weights = torch.rand(args.tokens, args.topk, generator=gen, device="cuda").softmax(-1)
        steps.append({
            "routing_map": torch.zeros(args.tokens, args.experts, dtype=torch.bool,
                                       device="cuda").scatter_(1, topk, True),
            "probs": torch.zeros(args.tokens, args.experts, device="cuda").scatter_(
                1, topk, weights),
            "hidden": torch.randn(args.tokens, 1, args.hidden, generator=gen, device="cuda",
                                  dtype=torch.bfloat16),
            "grad": torch.randn(args.tokens, 1, args.hidden, generator=gen, device="cuda",
                                dtype=torch.bfloat16)})
    return steps


def main() -> None:
    p = shape_parser(__doc__)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--trace", help="also write the chrome trace here")
    p.add_argument("--host-steps", type=int, default=0,
                   help="then this many steps timed on the host only (no profiler)")
    p.add_argument("--host-calls", type=int, default=0,
                   help="then this many steps with the library's calls on the path timed one "
                        "by one (each call's start and end in the step, medians)")
    args = p.parse_args()
    torch.cuda.set_device(0)
    dispatcher = build_dispatcher(args)
    steps = step_inputs(args, 4, seed=1)

    def step(i, mark):
        st = steps[i % len(steps)]
        hidden = st["hidden"].detach().requires_grad_(True)
        probs = st["probs"].detach().requires_grad_(True)
        torch.cuda.synchronize()
        with mark("dispatch_preprocess"):
            h, pr = dispatcher.dispatch_preprocess(hidden, st["routing_map"], probs)
        with mark("token_dispatch"):
            h, pr = dispatcher.token_dispatch(h, pr)
        with mark("dispatch_postprocess"):
            rows, _, row_probs = dispatcher.dispatch_postprocess(h, pr)
        with mark("expert"):
            out = rows * row_probs.unsqueeze(-1).to(rows.dtype)
        with mark("token_combine"):
            y = dispatcher.combine_postprocess(
                dispatcher.token_combine(dispatcher.combine_preprocess(out)))
        with mark("backward"):
            y.backward(st["grad"])
        torch.cuda.synchronize()

    for i in range(5):
        step(i, record_function)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.iters):
            step(i, record_function)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    report(prof, args)
    if args.host_steps:
        host_times(step, args.host_steps)
    if args.host_calls:
        host_calls(step, args.host_calls, dispatcher)


def host_times(step, n: int) -> None:
    """Each method's host time without the profiler (its per-call overhead would dominate),
    the GPU synchronized before each step only: a sampling profiler may watch these steps."""
    spent = collections.defaultdict(list)

    @contextlib.contextmanager
    def clock(name):
        t0 = time.perf_counter()
        yield
        spent[name].append((time.perf_counter() - t0) * 1e6)

    for i in range(n):
        step(i, clock)
    print(f"host time per method without the profiler, median us of {n} steps "
          "(token_dispatch includes the wait for the count)")
    for name in METHODS:
        print(f"{statistics.median(spent[name]):10.1f}  {name}")


def traced_calls(dispatcher) -> list:
    """(owner, attribute) of the calls on the methods' path that host_calls times."""
    import megatron_nccl_ep.api as api
    import megatron_nccl_ep.autograd as autograd
    import megatron_nccl_ep.cuda_backend as backend
    import megatron_nccl_ep.dispatcher as dispatcher_module

    calls = [(dispatcher, name) for name in METHODS if hasattr(dispatcher, name)]
    calls += [(dispatcher_module, "_group_for"), (dispatcher_module, "dispatch"),
              (dispatcher_module, "combine"), (api.Group, "create_handle"),
              (api.Handle, "dispatch"), (api.Handle, "combine"),
              (autograd._Dispatch, "forward"), (autograd._Combine, "forward"),
              (backend.CudaBackend, "create_handle"), (backend.CudaBackend, "dispatch"),
              (backend.CudaBackend, "combine"), (torch, "empty"), (torch.Tensor, "record_stream"),
              (torch.cuda, "current_stream")]
    calls += [(backend._C, name) for name in ("create_handle", "handle_num_recv_tokens",
                                               "dispatch", "combine", "combine_topk_weights")]
    return calls


def host_calls(step, n: int, dispatcher) -> None:
    """Each traced call's start and end from the step's start (medians of n steps, the k-th call
    of a name as 'name #k'): where the host time of the path goes. The timers cost ~1 us a call;
    calls inside a step cost several times their hot-loop time (their code runs cold)."""
    spans = []

    def timed(fn, label):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans.append((label, t0, time.perf_counter()))
        return wrapper

    saved = []  # (owner, name, its own attribute or None: inherited / from the class)
    for owner, name in traced_calls(dispatcher):
        raw = inspect.getattr_static(owner, name)
        label = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
        wrapper = timed(getattr(owner, name), label)
        saved.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, staticmethod(wrapper) if isinstance(raw, staticmethod) else wrapper)
    starts = collections.defaultdict(list)
    try:
        for i in range(n):
            spans.clear()
            step(i, lambda _method: contextlib.nullcontext())
            t0 = min(t for _, t, _ in spans)
            seen = collections.Counter()
            for label, a, b in sorted(spans, key=lambda x: x[1]):
                seen[label] += 1
                key = label if seen[label] == 1 else f"{label} #{seen[label]}"
                starts[key].append(((a - t0) * 1e6, (b - t0) * 1e6))
    finally:
        for owner, name, own in reversed(saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
    print(f"host calls of a step, median us of {n} steps from the step's first call "
          "(start, end, duration)")
    rows = sorted((statistics.median(a for a, _ in v), statistics.median(b for _, b in v), k)
                  for k, v in starts.items())
    for a, b, label in rows:
        print(f"{a:10.1f} {b:8.1f} {b - a:8.1f}  {label}")


def report(prof, args) -> None:
    events = list(prof.events())
    ranges = sorted((e for e in events if e.name in METHODS and
                     e.device_type == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.time_range.start)
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    # A step: METHODS in order, from its dispatch_preprocess's start.
    starts = [e.time_range.start for e in ranges if e.name == METHODS[0]]
    bounds = starts[1:] + [float("inf")]
    host = collections.defaultdict(list)
    kernels = []
    inner = collections.defaultdict(list)
    for t0, t1 in zip(starts, bounds):
        for e in ranges:
            if t0 <= e.time_range.start < t1:
                host[e.name].append((e.time_range.start - t0, e.time_range.end - t0))
                if e.name == "token_dispatch":
                    for c in e.cpu_children:
                        inner[c.name].append(c.time_range.end - c.time_range.start)
        kernels.append([e for e in gpu if t0 <= e.time_range.start < t1])
    print(f"megatron timeline, nccl_ep, EP=1: {args.tokens} tokens x {args.hidden} x top-"
          f"{args.topk} of {args.experts} experts, bf16, {args.num_sms} SMs; medians (us) of "
          f"{len(starts)} steps, from the step's first host call")
    print(f"{'host from':>10} {'to':>8}  method")
    for name in METHODS:
        if host[name]:
            print(f"{statistics.median(a for a, _ in host[name]):10.1f} "
                  f"{statistics.median(b for _, b in host[name]):8.1f}  {name}")
    shape = lambda ks: tuple(e.name for e in ks)  # noqa: E731
    common = collections.Counter(shape(ks) for ks in kernels).most_common(1)[0][0]
    same = [(t0, ks) for t0, ks in zip(starts, kernels) if shape(ks) == common]
    print(f"{'gpu start':>10} {'duration':>8}  activity ({len(same)} of {len(starts)} steps alike)")
    for j, first in enumerate(same[0][1]):
        start = statistics.median(ks[j].time_range.start - t0 for t0, ks in same)
        dur = statistics.median(ks[j].time_range.end - ks[j].time_range.start for _, ks in same)
        print(f"{start:10.1f} {dur:8.1f}  {first.name[:90]}")
    print("token_dispatch's host calls, median us per step (top 12):")
    totals = {name: statistics.median(v) * len(v) / len(starts) for name, v in inner.items()}
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{us:10.1f}  {name[:90]}")


if __name__ == "__main__":
    main()
