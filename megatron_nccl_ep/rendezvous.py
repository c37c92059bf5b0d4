"""A timed host-side agreement between the ranks of a process group, through its store.

torch.distributed collectives block until every rank takes part: a rank that never calls (it
stopped, raised on a check of its own, or died) holds its peers forever. The steps that precede
the library's own timed protocol (group creation) go through ``exchange`` instead: every rank
posts a small JSON payload under a key of the default store and polls for its peers' keys with a
deadline, so a missing rank becomes an ``NcclEpError`` naming the step and the ranks not heard
from, and a rank that failed locally is named by the others at once.

NOTES: keys are ``nccl_ep/<step>/<group ranks digest>/<sequence>/<rank>``. Every rank of a group
makes the same calls in the same order (collective semantics), so the per-(step, group) sequence
numbers agree. A rank deletes its keys of earlier exchanges of that (step, group) once the
current one completed: by then every peer has read them (a peer posts sequence n only after it
completed every earlier exchange, or gave up on it), so the store stays bounded.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Optional

import torch.distributed as dist

from .errors import NcclEpError

_sequences: dict = {}  # (step, group digest) -> the next sequence number
_posted: dict = {}  # scope prefix -> this rank's keys not deleted yet


def _name(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def store():
    # The default group's store (TCPStore, FileStore, ...): torch offers no public accessor.
    return dist.distributed_c10d._get_default_store()


def next_scope(process_group, step: str) -> tuple:
    """``(prefix, sequence)``: the store scope of this rank's next ``step`` on this group, the
    same on every rank of the group (every rank makes the same calls in the same order)."""
    ranks = dist.get_process_group_ranks(process_group)
    tag = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    seq = _sequences.get((step, tag), 0)
    _sequences[(step, tag)] = seq + 1
    return f"nccl_ep/{step}/{tag}", seq


def exchange(process_group, step: str, payload: dict, timeout_s: float,
             error: Optional[Exception] = None) -> list:
    """Every rank's ``payload`` (JSON-serialisable), in group rank order. ``error`` is this
    rank's local failure: it is posted for the peers (each raises it, naming this rank, as soon
    as it sees it) and then raised here. A peer's posted error is raised as ``ValueError`` when it
    was one, else ``NcclEpError``; a rank not heard from within ``timeout_s`` is named in an
    ``NcclEpError``."""
    ranks = dist.get_process_group_ranks(process_group)
    me = dist.get_rank(process_group)
    prefix, seq = next_scope(process_group, step)
    keys = [f"{prefix}/{seq}/{r}" for r in range(len(ranks))]
    kv = store()
    mine = dict(payload=payload, error=None if error is None else
                dict(type=type(error).__name__, message=str(error)))
    kv.set(keys[me], json.dumps(mine))
    _posted.setdefault(prefix, []).append(keys[me])
    if error is not None:
        raise error

    got: dict = {}
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        for r, key in enumerate(keys):
            if r not in got and kv.check([key]):
                got[r] = json.loads(kv.get(key))
        failed = sorted(r for r, v in got.items() if v["error"] is not None)
        if failed:
            e = got[failed[0]]["error"]
            exc_type = ValueError if e["type"] == "ValueError" else NcclEpError
            raise exc_type(f"{step}: rank {failed[0]} of the EP group (global rank "
                           f"{ranks[failed[0]]}) failed: {e['message']}")
        if len(got) == len(keys):
            break
        if time.monotonic() >= deadline:
            missing = [r for r in range(len(keys)) if r not in got]
            timed_out = NcclEpError(
                f"{step}: {_name(missing)} of the EP group (global "
                f"{_name([ranks[r] for r in missing])}) did not reach {step} within timeout_s="
                f"{timeout_s:g} s; every rank of the group must call it (rank {me} waited)")
            # A late rank must not go on alone: it finds this error in place of the payload.
            kv.set(keys[me], json.dumps(dict(payload=None, error=dict(
                type="NcclEpError", message=str(timed_out)))))
            raise timed_out
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    for old in _posted.pop(prefix)[:-1]:  # the last one is this exchange's
        try:
            kv.delete_key(old)
        except (RuntimeError, NotImplementedError):  # a store without deletion keeps the key
            pass
    _posted[prefix] = [keys[me]]
    return [got[r]["payload"] for r in range(len(keys))]
