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
"""

from __future__ import annotations

import atexit
import datetime
import importlib.util
import itertools
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# NVLink multicast stays off in every process started on a GPU machine (shared GPU hosts).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}

SPAWN_TIMEOUT_S = 120.0
DEFAULT_TIMEOUT_S = 120.0
# After one rank fails, how long the others get to report before the pool is killed.
FAILURE_GRACE_S = 5.0


class DistributedFailure(AssertionError):
    """A rank raised, died, or did not finish in time."""


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


def _worker(rank: int, world_size: int, backend: str, init_file: str, tasks, results,
            sys_path: list) -> None:
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.update(GPU_ENV)
    # Ranks share few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
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
                p.join()
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
