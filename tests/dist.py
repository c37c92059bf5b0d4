"""A small multi-process harness for distributed tests.

``pool(world_size, backend)`` returns a pool of ``world_size`` spawned processes that have joined one
torch.distributed process group (gloo on CPU; nccl on GPU, one GPU per rank). ``pool.run(fn, *args)``
runs ``fn(*args)`` in every rank and returns the per-rank results. The pool stays alive across tests
(spawning and importing torch costs seconds per process, running a case costs milliseconds), so a
test module can keep many small, separately reported tests on one process group.

Failure handling: an exception in any rank is sent back with its traceback and re-raised in pytest
as ``DistributedFailure``; a rank that dies or a case that does not finish within ``timeout``
fails the test instead of blocking it. After any failure the pool is torn down (the surviving ranks
may be stuck in a collective that will never complete) and the next ``run`` spawns a fresh one.

``fn`` must be a module-level function. It travels to the ranks as (source file, qualified name),
not by module name, so it works whatever import mode pytest uses.

``run_isolated(world_size, fn, ...)`` is for fault injection: fresh processes for one run, in which
a rank may die (``os._exit``), hang or raise; it returns every rank's outcome (``RankRun``: value or
traceback, exit code, whether it was killed at the deadline, and what it ``report``-ed on the way)
instead of raising.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import faulthandler
import importlib.util
import itertools
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait as wait_for_any
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Before any test module's megatron.core import in a rank: the package's import drops torch's
# "No CUDA runtime is found" notice, which every rank of a CPU machine would print.
import megatron_nccl_ep  # noqa: F401

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# NVLink multicast stays off in every process started on a GPU machine (shared GPU hosts).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}

SPAWN_TIMEOUT_S = 120.0
DEFAULT_TIMEOUT_S = 120.0
# After one rank fails, how long the others get to report before the pool is killed.
FAILURE_GRACE_S = 5.0
# A rank that did not finish in time is asked for its threads' stacks (SIGUSR1, written to its
# stderr, which pytest shows under the failed test) and gets this long to write them.
STACK_DUMP_WAIT_S = 1.0


class DistributedFailure(AssertionError):
    """A rank raised, died, or did not finish in time."""


def dump_stacks(procs: dict) -> None:
    """Asks the live ones of ``procs`` (rank -> process past ``_join_group``), one at a time, to
    write every thread's Python stack to their stderr: where a rank that did not finish in time
    is stuck."""
    for rank, p in sorted(procs.items()):
        if not p.is_alive():
            continue
        print(f"--- rank {rank} (pid {p.pid}) did not finish: its threads' stacks ---",
              file=sys.stderr, flush=True)
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError:
            continue
        time.sleep(STACK_DUMP_WAIT_S)
        native_stacks(p.pid)


def native_stacks(pid: int) -> None:
    """The native stack of every thread of ``pid``, to stderr: a rank stuck inside the library (a
    CUDA or NCCL wait) shows only its Python call above. gdb where the machine has it, else
    py-spy's native frames of the Python threads and every thread's name and kernel wait."""
    gdb = shutil.which("gdb")
    if gdb is not None:
        out = _run_tool([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 25"])
        frames = [line for line in out.splitlines() if line.startswith(("Thread ", "#"))]
        print("\n".join(frames) or out[-4000:], file=sys.stderr, flush=True)
        return
    py_spy = shutil.which("py-spy") or next(
        (p for p in (os.path.join(d, "bin", "py-spy") for d in sys.path if d)
         if os.path.isfile(p)), None)
    if py_spy is not None:
        print(_run_tool([py_spy, "dump", "--native", "--pid", str(pid)])[-8000:], file=sys.stderr,
              flush=True)
    else:
        print("(no gdb or py-spy here: no native stacks)", file=sys.stderr, flush=True)
    threads = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        fields = []
        for name in ("comm", "wchan", "syscall"):
            try:
                with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                    fields.append(f.read().strip().split(" ")[0])
            except OSError:
                fields.append("?")
        threads.append(f"  thread {tid} {fields[0]!r}: wchan {fields[1]}, syscall {fields[2]}")
    print("threads (name, kernel wait, system call number):\n" + "\n".join(threads),
          file=sys.stderr, flush=True)


def _run_tool(cmd: list) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({os.path.basename(cmd[0])} failed: {exc})"


_loaded_modules: dict = {}


def _load_function(path: str, qualname: str):
    module = _loaded_modules.get(path)
    if module is None:
        # The module's own folder first, as pytest's default import mode does for test modules.
        if os.path.dirname(path) not in sys.path:
            sys.path.insert(0, os.path.dirname(path))
        name = "_dist_case_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _loaded_modules[path] = module
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def gpu_of_rank(rank: int, world_size: int) -> int:
    """Rank r's GPU: GPU r, or r mod the GPU count where the ranks outnumber the GPUs. Ranks that
    share a GPU are each an emulated host of their own (NCCL_HOSTID, set here before this
    process's first NCCL call): NCCL refuses two ranks of one host on one GPU, and a test lets ranks
    share GPUs only for groups of one rank per node (gpu_common.gpus_needed)."""
    count = torch.cuda.device_count()
    if world_size > count:
        os.environ["NCCL_HOSTID"] = f"nccl-ep-emulated-host-{rank}"
    return rank % count


def _join_group(rank: int, world_size: int, backend: str, init_file: str, sys_path: list,
                gpus: bool, pg_timeout: float) -> None:
    """A spawned rank's setup: the parent's import path and GPU environment, one intra-op thread
    (ranks share few cores), its GPU (``gpus``), then the process group."""
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # dump_stacks()
    os.environ.update(GPU_ENV)
    torch.set_num_threads(1)
    if gpus:
        torch.cuda.set_device(gpu_of_rank(rank, world_size))
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout))


def _worker(rank: int, world_size: int, backend: str, init_file: str, tasks, results,
            sys_path: list) -> None:
    try:
        _join_group(rank, world_size, backend, init_file, sys_path, backend == "nccl",
                    DEFAULT_TIMEOUT_S)
        results.put(("ready", rank, True, None, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(("ready", rank, False, None, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, path, qualname, args, kwargs = task
        try:
            value = _load_function(path, qualname)(*args, **kwargs)
            results.put((task_id, rank, True, value, None))
        except BaseException:  # noqa: BLE001 - reported to the parent
            results.put((task_id, rank, False, None, traceback.format_exc()))
    # No destroy_process_group(): it can wait on peers that already left; exiting frees it all.


class Pool:
    def __init__(self, world_size: int, backend: str):
        self.world_size, self.backend = world_size, backend
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="nccl_ep_dist_")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._ids = itertools.count()
        if backend == "nccl":
            os.environ.update(GPU_ENV)
        sys_path = [TESTS_DIR, REPO_ROOT] + [p for p in sys.path if p]
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(rank, world_size, backend, os.path.join(self._dir, "rdzv"),
                              self._tasks[rank], self._results, sys_path))
            for rank in range(world_size)]
        for p in self._procs:
            p.start()
        self._collect("ready", SPAWN_TIMEOUT_S, what="process group start-up")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _collect(self, task_id, timeout: float, what: str) -> list:
        __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not this loop
        values, errors = [None] * self.world_size, {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                got_id, rank, ok, value, tb = self._results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                dead = [r for r in pending if not self._procs[r].is_alive()]
                for r in dead:
                    errors[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
                    pending.discard(r)
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            if got_id != task_id:
                continue  # a late answer from an earlier, already failed task
            pending.discard(rank)
            if ok:
                values[rank] = value
            else:
                errors[rank] = tb
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if errors or pending:
            dump_stacks({r: self._procs[r] for r in pending})
            self.shutdown()
            parts = [f"{what} failed on {self.world_size} ranks ({self.backend})"]
            for r in sorted(errors):
                parts.append(f"--- rank {r} ---\n{errors[r]}")
            if pending:
                parts.append(f"--- ranks {sorted(pending)} did not finish "
                             f"({'timeout' if not errors else 'killed after the failure above'})")
            raise DistributedFailure("\n".join(parts))
        return values

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
        """Runs ``fn(*args, **kwargs)`` in every rank; returns the list of per-rank results."""
        __tracebackhide__ = True
        path = os.path.abspath(sys.modules[fn.__module__].__file__)
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, path, fn.__qualname__, args, kwargs))
        return self._collect(task_id, timeout, what=f"{fn.__qualname__}{args!r}")

    def shutdown(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                # Bounded: a rank stuck in the driver may outlive SIGKILL for a while, and the
                # pool's processes are daemons (nothing waits for them at exit).
                p.join(timeout=10.0)
        shutil.rmtree(self._dir, ignore_errors=True)
        _pools.pop((self.world_size, self.backend), None)


_pools: dict = {}


def pool(world_size: int, backend: str = "gloo") -> Pool:
    """The live pool for (world_size, backend), spawned on first use or after a failure."""
    p = _pools.get((world_size, backend))
    if p is not None and not p.alive():
        p.shutdown()
        p = None
    if p is None:
        p = Pool(world_size, backend)
        _pools[(world_size, backend)] = p
    return p


def run(world_size: int, fn, *args, backend: str = "gloo", timeout: float = DEFAULT_TIMEOUT_S,
        **kwargs) -> list:
    __tracebackhide__ = True
    return pool(world_size, backend).run(fn, *args, timeout=timeout, **kwargs)


def shutdown_all() -> None:
    for p in list(_pools.values()):
        p.shutdown()


atexit.register(shutdown_all)


# ------------------------------------------------------------------------------------------------
# one-off runs in fresh processes, for faults (a rank that dies, hangs or raises)
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankRun:
    """What one rank of ``run_isolated`` did."""

    rank: int
    value: object = None            # fn's return value (None when it raised, died or hung)
    error: Optional[str] = None     # the traceback of what fn (or the start-up) raised
    exitcode: Optional[int] = None  # the process's exit code (negative: killed by that signal)
    hung: bool = False              # still running at the deadline, then killed
    # name -> (value, time.time() when sent), from report(); "ready" when the group was up
    reports: dict = dataclasses.field(default_factory=dict)

    def outcome(self) -> str:
        """One phrase: how the rank ended."""
        if self.hung:
            last = max(self.reports, key=lambda k: self.reports[k][1]) if self.reports else None
            return f"HUNG (killed at the deadline; last report: {last})"
        if self.error is not None:
            return f"raised: {self.error.strip().splitlines()[-1]} (exit {self.exitcode})"
        if self.exitcode != 0:
            return f"died, exit code {self.exitcode}"
        return "returned, exit 0"


_report_conn = None  # set in run_isolated's ranks


def report(name: str, value=None) -> None:
    """From inside a ``run_isolated`` rank: sends ``(name, value, time.time())`` to the parent at
    once (a pipe write, so that a report made just before ``os._exit`` arrives)."""
    if _report_conn is None:
        raise RuntimeError("dist.report() works only inside run_isolated's ranks")
    _report_conn.send(("report", name, value, time.time()))


def _isolated_worker(rank: int, world_size: int, backend: str, init_file: str, conn,
                     sys_path: list, gpus: bool, pg_timeout: float, path: str, qualname: str,
                     args: tuple, kwargs: dict) -> None:
    global _report_conn
    _report_conn = conn
    try:
        _join_group(rank, world_size, backend, init_file, sys_path, gpus, pg_timeout)
        report("ready")
        value = _load_function(path, qualname)(*args, **kwargs)
        conn.send(("value", None, value, time.time()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", None, traceback.format_exc(), time.time()))
    conn.close()
    # No destroy_process_group(): a peer may be gone; exiting frees it all.


def run_isolated(world_size: int, fn, *args, backend: str = "gloo", gpus: bool = False,
                 timeout: float = DEFAULT_TIMEOUT_S, pg_timeout: float = DEFAULT_TIMEOUT_S,
                 **kwargs) -> list:
    """Runs ``fn(*args, **kwargs)`` once in ``world_size`` fresh spawned processes that joined one
    process group (``backend``; ``gpus``: rank r on GPU r) and returns a ``RankRun`` per rank,
    whatever happened: a rank may raise, exit (``os._exit``) or hang. ``timeout`` counts from the
    moment every rank is up (or one ended before that); ranks still running then are killed
    (``hung``). Nothing is raised here: the caller asserts on the outcomes."""
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="nccl_ep_isolated_")
    path = os.path.abspath(sys.modules[fn.__module__].__file__)
    if backend == "nccl" or gpus:
        os.environ.update(GPU_ENV)
    sys_path = [TESTS_DIR, REPO_ROOT] + [p for p in sys.path if p]
    runs = [RankRun(rank) for rank in range(world_size)]
    conns, procs = {}, []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_isolated_worker, daemon=True,
                           args=(rank, world_size, backend, os.path.join(tmp, "rdzv"), child_end,
                                 sys_path, gpus, pg_timeout, path, fn.__qualname__, args, kwargs))
        proc.start()
        child_end.close()  # the parent's copy: the pipe reads EOF once the rank is gone
        conns[parent_end] = rank
        procs.append(proc)

    def receive(conn) -> None:
        try:
            kind, name, value, when = conn.recv()
        except (EOFError, OSError):
            del conns[conn]
            return
        run = runs[conns[conn]]
        if kind == "report":
            run.reports[name] = (value, when)
        elif kind == "value":
            run.value = value
        else:
            run.error = value

    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    started = False
    try:
        while conns or any(p.exitcode is None for p in procs):
            # The deadline runs once every rank is up, or one has ended before the others were.
            if not started and (all("ready" in r.reports for r in runs)
                                or any(p.exitcode is not None for p in procs)):
                started, deadline = True, time.monotonic() + timeout
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waitables = list(conns) + [p.sentinel for p in procs if p.exitcode is None]
            for obj in wait_for_any(waitables, timeout=min(0.5, left)):
                if obj in conns:
                    receive(obj)
            for p in procs:
                p.join(timeout=0)
    finally:
        dump_stacks({r: p for r, p in enumerate(procs) if p.exitcode is None and started})
        for rank, p in enumerate(procs):
            if p.exitcode is None:
                runs[rank].hung = True
                p.kill()
                p.join(timeout=10.0)
        for conn in list(conns):  # what a killed rank sent before the kill
            while conn in conns and conn.poll():
                receive(conn)
            conn.close()
        shutil.rmtree(tmp, ignore_errors=True)
    for rank, p in enumerate(procs):
        runs[rank].exitcode = p.exitcode
    return runs
