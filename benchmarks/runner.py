"""Runs one section in its own processes and times work inside each of them.

The parent starts one spawned process per rank for a section (``run_section``), collects the
records they send as they are made, and kills what outlives the section's deadline, so whatever
finished before a crash or a hang still reaches the results. Inside a worker, ``Rank`` holds the
rank's device and process groups and times items (``Rank.measure``); every item is guarded on its
own (``Rank.attempt``), so a failing item costs only itself.

Timing modes:
* ``kernel`` (GPUs): the GPUs are held by a short sleep kernel while the host enqueues, then lined
  up by a one-element all-reduce, so the CUDA events bracket device work only;
* ``e2e`` (GPUs): every GPU idle and the hosts lined up by a gloo barrier before the call, so host
  launch overhead and any host synchronization inside the call count;
* ``host wall`` (CPU): the hosts lined up by a gloo barrier, then the host's wall clock around the
  call (the reference backend computes on the host, so this is all the time there is).
Per iteration the slowest rank's time counts (a collective is done when its last rank is).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import logging
import math
import os
import queue as queue_module
import socket
import statistics
import sys
import time
import traceback
import warnings
from typing import TYPE_CHECKING, Callable, Optional

from .cli import DTYPES

if TYPE_CHECKING:  # torch is imported in the workers, where it is used
    import torch

# How long a section's workers get to exit (destroy their groups and process group) once they
# reported done, before they are killed and the section reports them.
EXIT_GRACE_S = 20.0
# Peers of a dead rank wait in a collective that never completes: this long after the first
# death the parent stops waiting for them.
AFTER_DEATH_S = 10.0
# Cycles of torch.cuda._sleep that keep the GPU busy while the host enqueues a kernel-mode
# iteration: longer than the Python overhead of one call.
HEAD_START_CYCLES = 200_000
MODES = {"cuda": ("kernel", "e2e"), "cpu": ("host wall",)}


def kernel_mode(device: str) -> str:
    """Device time where the device has it: kernel on GPUs, host wall on cpu."""
    return MODES[device][0]


def e2e_mode(device: str) -> str:
    """From lined-up hosts: e2e on GPUs, host wall on cpu."""
    return MODES[device][-1]


def item_name(op: str, mode: str) -> str:
    """A timed item's name: its op and its timing mode."""
    return f"{op} ({mode})"


# ------------------------------------------------------------------------------------------------
# parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_section(label: str, section: Callable, args: argparse.Namespace, deadline_s: float, *,
                process_groups: bool = True) -> dict:
    """Starts ``args.nproc`` workers that run ``section(rank)``; returns their records and exit
    status. ``section`` is a module-level function (the spawned workers import it by name)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, name=f"bench-{label}-{rank}",
                         args=(rank, args.nproc, label, section, vars(args), port,
                               process_groups, messages))
             for rank in range(args.nproc)]
    started = time.monotonic()
    for proc in procs:
        proc.start()
    records, done, timed_out = [], set(), False
    first_exit = None  # when the first worker died without finishing
    while len(done) < len(procs):
        try:
            msg = messages.get(timeout=0.5)
        except queue_module.Empty:
            msg = None
        if msg is not None:
            if msg.get("kind") == "done":
                done.add(msg["rank"])
            else:
                records.append(msg)
            continue
        now = time.monotonic()
        if now - started > deadline_s:
            timed_out = True
            break
        crashed = [p for i, p in enumerate(procs) if i not in done and p.exitcode is not None]
        if crashed and first_exit is None:
            first_exit = now
        if first_exit is not None and now - first_exit > AFTER_DEATH_S:
            break
    exit_by = time.monotonic() + EXIT_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, exit_by - time.monotonic()))
    killed = []
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
            killed.append(rank)
    while True:  # messages sent just before the end
        try:
            msg = messages.get(timeout=0.2)
        except queue_module.Empty:
            break
        if msg.get("kind") != "done":
            records.append(msg)
    return {"records": records, "exit_codes": [p.exitcode for p in procs], "killed": killed,
            "timed_out": timed_out, "wall_s": round(time.monotonic() - started, 1)}


def summarize_times(per_rank: dict) -> dict:
    """Per iteration the slowest rank counts; median, min and p90 over iterations."""
    ranks = sorted(per_rank)
    n = min(len(per_rank[r]) for r in ranks)
    slowest = [max(per_rank[r][i] for r in ranks) for i in range(n)]
    return {
        "median_ms": statistics.median(slowest),
        "min_ms": min(slowest),
        "p90_ms": sorted(slowest)[min(n - 1, math.ceil(0.9 * n) - 1)],
        "iters": n,
        "per_rank_median_ms": {str(r): statistics.median(per_rank[r]) for r in ranks},
    }


def collect(records: list) -> tuple:
    """Groups the workers' records by item: times of all ranks side by side, numeric extras
    averaged over ranks, bandwidth = bytes per rank / median time. Returns (items, errors,
    info by rank, checks, point facts by rank)."""
    items: dict = {}
    errors, info, checks, point = [], {}, {}, {}
    for rec in records:
        if rec["kind"] == "error":
            errors.append({k: rec[k] for k in ("section", "item", "rank", "error")})
        elif rec["kind"] in ("info", "point"):
            facts = info if rec["kind"] == "info" else point
            facts.setdefault(str(rec["rank"]), {}).update(rec["data"])
        elif rec["kind"] == "check":
            checks.setdefault(rec["item"], {})[str(rec["rank"])] = rec["value"]
        elif rec["kind"] == "times" and rec["times_ms"]:
            entry = items.setdefault(rec["item"], {"times": {}, "extra": {}})
            entry["times"][rec["rank"]] = rec["times_ms"]
            for key, value in rec.get("extra", {}).items():
                entry["extra"].setdefault(key, {})[rec["rank"]] = value
    out = {}
    for name, entry in items.items():
        summary = summarize_times(entry["times"])
        for key, per_rank in entry["extra"].items():
            values = list(per_rank.values())
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                summary[key] = sum(values) / len(values)
            else:
                summary[key] = {str(r): v for r, v in per_rank.items()}
        seconds = summary["median_ms"] * 1e-3
        for key, label in (("phys_bytes", "phys_GBps"), ("logical_bytes", "logical_GBps"),
                           ("hbm_bytes", "hbm_GBps")):
            if isinstance(summary.get(key), float) and seconds > 0:
                summary[label] = summary[key] / seconds / 1e9
        out[name] = summary
    return out, errors, info, checks, point


def run_into(result: dict, label: str, section: Callable, args: argparse.Namespace,
             budget_end: float, *, process_groups: bool = True) -> tuple:
    """Runs ``section`` within what is left of the budget, records its run and errors in
    ``result`` under ``label`` and what its workers report of themselves (``info`` records, e.g.
    the backend they resolved) in ``result['meta']``, the first answer kept; returns its items,
    checks and rank 0's facts of this point (``point`` records), all empty if skipped."""
    left = budget_end - time.monotonic()
    if left < 10:
        result["errors"].append({"section": label, "item": "-", "rank": "-",
                                 "error": "skipped: --time-budget spent"})
        return {}, {}, {}
    run = run_section(label, section, args, min(args.section_timeout, left),
                      process_groups=process_groups)
    items, errors, info, checks, point = collect(run.pop("records"))
    result["sections"][label] = run
    result["errors"].extend(errors)
    for rank_info in info.values():
        for key, value in rank_info.items():
            result["meta"].setdefault(key, value)
    died = [rank for rank, code in enumerate(run["exit_codes"]) if code != 0]
    if run["timed_out"] or died:
        result["errors"].append({
            "section": label, "item": "-", "rank": "-",
            "error": f"section ended after {run['wall_s']} s: timed out {run['timed_out']}, "
                     f"ranks killed {run['killed']}, exit codes {run['exit_codes']}"})
    return items, checks, point.get("0", {})


# ------------------------------------------------------------------------------------------------
# worker


class Rank:
    """What one worker knows: its rank, device, process groups, and how to report and time."""

    def __init__(self, rank: int, world: int, section: str, args: argparse.Namespace,
                 messages, process_groups: bool = True):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world, self.section, self.args = rank, world, section, args
        self.messages = messages
        self.cuda = args.device == "cuda"
        self.modes = MODES[args.device]
        self.dtype = getattr(torch, DTYPES[args.dtype])
        self.elt = torch.empty((), dtype=self.dtype).element_size()
        if self.cuda:
            gpu = rank
            if getattr(args, "emulated_hosts", False):
                # Ranks outnumber GPUs (nodes of one rank, nodes.placement): each its own host
                # before the first NCCL call, since NCCL refuses two ranks of one host on a GPU.
                os.environ["NCCL_HOSTID"] = f"megatron-nccl-ep-bench-host-{rank}"
                gpu = rank % torch.cuda.device_count()
            torch.cuda.set_device(gpu)
            self.device = torch.device("cuda", gpu)
        else:
            self.device = torch.device("cpu")
        self.host_group = None
        if process_groups:
            timeout = datetime.timedelta(seconds=max(30.0, args.section_timeout))
            dist.init_process_group("nccl" if self.cuda else "gloo",
                                    init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                                    world_size=world, timeout=timeout,
                                    device_id=self.device if self.cuda else None)
            # Host-side agreement (barriers, small metadata) goes over gloo so that it never
            # queues behind device work.
            self.host_group = dist.new_group(backend="gloo", timeout=timeout)
        self._align_buf = torch.ones(1, device=self.device)

    # -- inputs -----------------------------------------------------------------------------------
    def input_set(self, set_index: int, tokens: Optional[int] = None) -> tuple:
        """(topk, probs, x) of input set ``set_index`` on this rank: the routing, its weights
        (softmax over the K slots) and the tokens, each a fresh draw per (input set, rank), of
        ``tokens`` tokens (default ``--tokens``)."""
        args, s, rank = self.args, set_index, self.rank
        tokens = args.tokens if tokens is None else tokens
        topk = random_topk(self.generator(1_000_003 * (s + 1) + rank), tokens, args.experts,
                           args.topk)
        probs = self.torch.rand(tokens, args.topk, generator=self.generator(7 * s + rank),
                                device=self.device)
        return topk, probs.softmax(-1), self.random_tokens(tokens, seed=100 + 10 * s + rank)

    def random_tokens(self, rows: int, seed: int) -> "torch.Tensor":
        return random_tokens(self.generator(seed), rows, self.args.hidden, self.dtype)

    def generator(self, seed: int) -> "torch.Generator":
        return self.torch.Generator(device=self.device).manual_seed(seed)

    # -- reporting --------------------------------------------------------------------------------
    def emit(self, kind: str, item: str = "-", **fields) -> None:
        self.messages.put({"kind": kind, "section": self.section, "item": item,
                           "rank": self.rank, **fields})

    def attempt(self, item: str, fn: Callable[[], None]) -> bool:
        """Runs one measured item; an exception is reported and the section goes on."""
        try:
            fn()
            return True
        except Exception as exc:  # noqa: BLE001 - one item's failure must not lose the others
            tb = traceback.format_exc()
            print(f"[bench rank {self.rank}] {self.section}/{item} failed:\n{tb}",
                  file=sys.stderr, flush=True)
            self.emit("error", item, error=f"{type(exc).__name__}: {exc}"[:2000])
            return False

    def check(self, name: str, value) -> None:
        """A correctness note next to the numbers (not a test: tests/gpu is the test)."""
        self.emit("check", name, value=value)

    # -- timing -----------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def host_barrier(self) -> None:
        if self.host_group is not None and self.world > 1:
            self.dist.barrier(group=self.host_group)

    def _align_devices(self) -> None:
        """Lines the GPUs up in stream order: the next op starts when the slowest rank arrives."""
        if self.world > 1:
            self.dist.all_reduce(self._align_buf)

    def measure(self, item: str, fn: Callable[[int], object], *, mode: str,
                setup: Optional[Callable[[int], None]] = None,
                after: Optional[Callable[[int, object], None]] = None,
                collective: bool = True,
                extra: "Optional[dict | Callable[[], dict]]" = None) -> None:
        """Times ``fn(i)`` (i = iteration; inputs rotate on i) and reports per-iteration ms.

        ``mode`` is one of this device's ``modes`` (module doc); ``setup``/``after`` run outside
        the timed region; ``collective=False`` for single-GPU work (no cross-rank alignment);
        ``extra``: numbers reported with the times, or a function that gives them once every
        call has been made (e.g. what counters counted over the calls).
        """
        if mode not in self.modes:
            raise ValueError(f"timing mode {mode!r} does not exist on {self.args.device}")
        args, torch = self.args, self.torch
        times = []
        pending = []  # kernel mode: events read once at the end, so the host never stalls
        for i in range(args.warmup + args.iters):
            if setup is not None:
                setup(i)
            if mode != "kernel":
                self.sync()
                if collective:
                    self.host_barrier()
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                if mode == "kernel":
                    torch.cuda._sleep(HEAD_START_CYCLES)
                    if collective:
                        self._align_devices()
                start.record()
                out = fn(i)
                end.record()
                if i >= args.warmup:
                    pending.append((start, end))
                if mode == "e2e":
                    end.synchronize()
            else:
                t0 = time.perf_counter()
                out = fn(i)
                if i >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            if after is not None:
                after(i, out)
            del out
        self.sync()
        times.extend(start.elapsed_time(end) for start, end in pending)
        numbers = extra() if callable(extra) else extra
        self.emit("times", item, times_ms=times, extra=numbers or {})


def _quiet_dependencies() -> None:
    """A worker shows the bench's own lines: the notices Megatron and torch print about optional
    packages (Apex, Transformer Engine, absl, CUDA_HOME), once per process, are hidden unless the
    user asked for warnings (``python -W ...`` or PYTHONWARNINGS)."""
    if sys.warnoptions:
        return
    import torch  # noqa: F401 - torch sets its loggers' levels when imported: ours come after

    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def _worker(rank: int, world: int, label: str, section: Callable, args_dict: dict, port: int,
            process_groups: bool, messages) -> None:
    _quiet_dependencies()
    args = argparse.Namespace(**args_dict, port=port)
    me = None
    try:
        me = Rank(rank, world, label, args, messages, process_groups)
        section(me)
    except Exception as exc:  # noqa: BLE001 - set-up failures are reported like item failures
        traceback.print_exc()
        messages.put({"kind": "error", "section": label, "item": "setup", "rank": rank,
                      "error": f"{type(exc).__name__}: {exc}"[:2000]})
    finally:
        messages.put({"kind": "done", "section": label, "rank": rank})
        # The parent kills a rank still running EXIT_GRACE_S after the section ended: say where
        # it was stuck first (every thread's stack on stderr, in the bench log).
        faulthandler.dump_traceback_later(EXIT_GRACE_S / 2, exit=False)
        if me is not None:
            try:
                me.sync()
                if me.dist.is_initialized():
                    me.dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken communicator at exit changes nothing
                pass
        messages.close()
        messages.join_thread()
        # Past the cleanup, interpreter and CUDA teardown may outlast the timer, and a stack of
        # that says nothing.
        faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------------------------------------
# inputs, drawn from a generator (the team section draws all of a rank's from one)


def random_topk(gen: "torch.Generator", tokens: int, experts: int, topk: int) -> "torch.Tensor":
    """Uniform random distinct experts per token."""
    import torch

    return torch.rand(tokens, experts, generator=gen, device=gen.device).topk(topk, dim=1).indices


def node_limited_topk(gen: "torch.Generator", tokens: int, experts: int, groups: int,
                      picks: int, topk: int) -> "torch.Tensor":
    """Node-limited routing as DeepSeek-V3's router draws it: the experts in ``groups`` equal
    groups of consecutive ids; each token picks ``picks`` groups at random, then ``topk``
    distinct experts among theirs."""
    import torch

    size = experts // groups
    picked = torch.rand(tokens, groups, generator=gen, device=gen.device).topk(picks, 1).indices
    ids = (picked.unsqueeze(2) * size + torch.arange(size, device=gen.device)).flatten(1)
    choice = torch.rand(ids.shape, generator=gen, device=gen.device).topk(topk, 1).indices
    return ids.gather(1, choice)


def random_tokens(gen: "torch.Generator", rows: int, hidden: int, dtype) -> "torch.Tensor":
    import torch

    return torch.randn(rows, hidden, generator=gen, device=gen.device).to(dtype)
