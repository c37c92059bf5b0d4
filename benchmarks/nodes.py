"""The nodes section: HT groups that span emulated nodes, and what their rail carries.

One point per shape of ``--nodes-shapes`` (``N`` nodes x ``G`` ranks per node), each in its own
processes (one per rank, as the kernels section runs; ``placement`` says how the nodes are
emulated on GPUs: the group option ``ranks_per_node = G`` with one GPU per rank, or ranks of
one-rank nodes sharing GPUs as emulated hosts; on cpu the reference backend over gloo). A local
team cannot stand in: it is one node (``ncclEpCreateLocalTeam``).

Per routing of ``--nodes-routings`` (``uniform``: top-K of E at random; ``node_limited``: the
experts in NODE_LIMITED_GROUPS groups, each token picks NODE_LIMITED_PICKS of them, then its K
experts among theirs, as DeepSeek-V3's router), exact mode, ``--rotate`` routings per rank: HT
dispatch (with the weights), combine and combine_probs (the weights' backward), timed as the
kernels section times them. Around each timed item, ``Group.info()``'s rail counters
(``rail_rows_sent`` / ``rail_bytes_sent``): their deltas over the item's calls give the rows and
bytes this rank handed the rail per call, against

* the routing's messages (docs/internode.md, "HT: a node gets only what it needs"): dispatch
  sends ``c(self, n)`` rows to each remote node ``n`` (the tokens with a slot there), combine and
  combine_probs return ``c(m G + q, node(self))`` to each remote node ``m``; a row is ``r + 8 K``
  bytes in the dispatch (the token and ``K_max`` 8-byte weight slots), ``r`` in the combine,
  ``8 K`` in combine_probs (``r`` = hidden x element size);
* the share ``p`` of a token's slots on a given other node: counted (dispatch rows /
  ``(N - 1) T``) next to the formula (``share_formula``);
* what a rail that carried every token sent (docs/internode.md's "every token (before)"):
  ``(N - 1) T (r + 8 max(E, K))`` per dispatch, ``(N - 1) T r`` per combine, ``(N - 1) T 8 K``
  per combine_probs.

The check of each routing: every rank's counted rows equal the routing's, and its bytes its rows
x their row bytes, for every op.
"""

from __future__ import annotations

import argparse
import math

from .cli import NODE_LIMITED_GROUPS, NODE_LIMITED_PICKS, ROUTINGS
from .kernels import group_fields
from .runner import Rank, item_name, node_limited_topk, random_tokens, random_topk, run_into

OPS = ("dispatch", "combine", "combine_probs")


def item(routing: str, op: str, mode: str) -> str:
    return item_name(f"{routing}: {op}", mode)


def shape_label(nodes: int, ranks_per_node: int) -> str:
    return f"{nodes}x{ranks_per_node}"


def share_formula(routing: str, experts: int, topk: int, nodes: int) -> float:
    """p: the chance that a token has a slot on a given other node, each node holding
    ``experts / nodes`` experts (docs/internode.md): uniform ``1 - C(E - E/N, K) / C(E, K)``;
    node-limited ``sum_j P(j of its M groups on n) (1 - C((M - j) E_g, K) / C(M E_g, K))``."""
    if routing == "uniform":
        return 1 - math.comb(experts - experts // nodes, topk) / math.comb(experts, topk)
    groups, picks = NODE_LIMITED_GROUPS, NODE_LIMITED_PICKS
    size, per_node = experts // groups, groups // nodes
    p = 0.0
    for j in range(min(picks, per_node) + 1):
        chance = (math.comb(per_node, j) * math.comb(groups - per_node, picks - j)
                  / math.comb(groups, picks))
        p += chance * (1 - math.comb((picks - j) * size, topk) / math.comb(picks * size, topk))
    return p


def rail_counts(routings: list, ranks_per_node: int, experts: int) -> list:
    """c[s][n]: the tokens of rank s (``routings[s]`` [T, K]) with a slot on node n != node(s),
    0 at its own node: the rows of s's rail message to n."""
    import torch

    world = len(routings)
    nodes = world // ranks_per_node
    per_node = experts // nodes
    counts = []
    for s, topk in enumerate(routings):
        node_of = torch.where(topk >= 0, topk // per_node, -1)
        row = [int((node_of == n).any(1).sum()) for n in range(nodes)]
        row[s // ranks_per_node] = 0
        counts.append(row)
    return counts


def message_rows(counts: list, rank: int, ranks_per_node: int) -> dict:
    """Rows ``rank`` hands the rail per op: its own tokens per remote node (dispatch), and per
    remote node m those of the rank of its index there with a slot on this node (combine,
    combine_probs)."""
    G = ranks_per_node
    home, q = rank // G, rank % G
    remote = [n for n in range(len(counts) // G) if n != home]
    back = sum(counts[m * G + q][home] for m in remote)
    return {"dispatch": sum(counts[rank][n] for n in remote), "combine": back,
            "combine_probs": back}


def row_bytes(op: str, token_bytes: int, topk: int, slot_bytes: int) -> int:
    """Bytes of one rail row of ``op``: the token and its weight slots (dispatch with weights),
    the token (combine), the weight slots (combine_probs)."""
    slots = slot_bytes * topk
    return {"dispatch": token_bytes + slots, "combine": token_bytes, "combine_probs": slots}[op]


def every_token_bytes(op: str, tokens: int, nodes: int, token_bytes: int, experts: int,
                      topk: int, slot_bytes: int) -> int:
    """Bytes per call of a rail that carried every token to every remote node, its weights as
    ``max(E, K)`` slots (docs/internode.md's "every token (before)"); every rank ``tokens``."""
    per_row = {"dispatch": token_bytes + slot_bytes * max(experts, topk),
               "combine": token_bytes, "combine_probs": slot_bytes * topk}[op]
    return (nodes - 1) * tokens * per_row


# ------------------------------------------------------------------------------------------------
# worker


def _inputs(me: Rank, routing: str, s: int) -> tuple:
    """(topk, probs, x) of input set ``s`` of ``routing`` on this rank."""
    args = me.args
    gen = me.generator(1_000_003 * (s + 1) + 7919 * me.rank + (0 if routing == "uniform" else 17))
    if routing == "uniform":
        topk = random_topk(gen, args.tokens, args.experts, args.topk)
    else:
        topk = node_limited_topk(gen, args.tokens, args.experts, NODE_LIMITED_GROUPS,
                                 NODE_LIMITED_PICKS, args.topk)
    probs = me.torch.rand(args.tokens, args.topk, generator=gen, device=me.device).softmax(-1)
    return topk, probs, random_tokens(gen, args.tokens, args.hidden, me.dtype)


def section(me: Rank) -> None:
    from megatron_nccl_ep.api import Group

    args = me.args
    group = Group(num_experts=args.experts, max_topk=args.topk, dtype=me.dtype,
                  backend=args.backend, device=me.device, ranks_per_node=args.ranks_per_node,
                  **group_fields(args))
    me.emit("info", data={"backend_resolved": group.backend_name})
    try:
        for routing in args.nodes_routings:
            me.attempt(routing, lambda: _routing_point(me, group, routing))
    finally:
        group.destroy()


def _routing_point(me: Rank, group, routing: str) -> None:
    from megatron_nccl_ep.reference import RAIL_SLOT_BYTES

    args, torch = me.args, me.torch
    G, nodes = args.ranks_per_node, me.world // args.ranks_per_node
    sets = [_inputs(me, routing, s) for s in range(args.rotate)]
    # Every rank's routings: the messages of every pair.
    everyone = [None] * me.world
    me.dist.all_gather_object(everyone, [topk.cpu() for topk, _, _ in sets], group=me.host_group)
    expected = [message_rows(rail_counts([mine[s] for mine in everyone], G, args.experts),
                             me.rank, G) for s in range(args.rotate)]
    handles, outs = [], []
    try:
        for topk, probs, x in sets:
            handles.append(group.create_handle(topk))
            recv_x, recv_probs = handles[-1].dispatch(x, probs)
            outs.append((recv_x, recv_probs))
        pick = lambda i: i % len(sets)  # noqa: E731
        fns = {"dispatch": lambda i: handles[pick(i)].dispatch(sets[pick(i)][2],
                                                                sets[pick(i)][1]),
               "combine": lambda i: handles[pick(i)].combine(outs[pick(i)][0]),
               "combine_probs": lambda i: handles[pick(i)].combine_probs(outs[pick(i)][1])}
        token_bytes = args.hidden * me.elt
        calls = args.warmup + args.iters
        # Per op over its timed items: counted rows, the routing's rows, counted bytes, the
        # routing's rows x row bytes.
        found: dict = {}
        for op in OPS:
            per_row = row_bytes(op, token_bytes, args.topk, RAIL_SLOT_BYTES)
            want = sum(expected[i % len(sets)][op] for i in range(calls))
            before = every_token_bytes(op, args.tokens, nodes, token_bytes, args.experts,
                                       args.topk, RAIL_SLOT_BYTES)
            for mode in me.modes:
                start = group.info()

                def counted(op=op, start=start, per_row=per_row, want=want, before=before):
                    end = group.info()
                    rows = end["rail_rows_sent"][op] - start["rail_rows_sent"][op]
                    sent = end["rail_bytes_sent"][op] - start["rail_bytes_sent"][op]
                    totals = found.setdefault(op, [0, 0, 0, 0])
                    for k, value in enumerate((rows, want, sent, want * per_row)):
                        totals[k] += value
                    return {"rail_rows": rows / calls, "rail_bytes": sent / calls,
                            "routing_rows": want / calls, "row_bytes": per_row,
                            "share": rows / calls / ((nodes - 1) * args.tokens),
                            "every_token_bytes": before, "tokens": args.tokens}

                me.attempt(item(routing, op, mode), lambda: me.measure(
                    item(routing, op, mode), fns[op], mode=mode, extra=counted))
        ok = bool(found) and all(rows == want and sent == rows_bytes
                                 for rows, want, sent, rows_bytes in found.values())
        me.check(f"{routing}: rail rows / the routing's, bytes / rows x row bytes",
                 f"{'ok' if ok else 'MISMATCH'} " + "; ".join(
                     f"{op} rows {rows}/{want} bytes {sent}/{rows_bytes}"
                     for op, (rows, want, sent, rows_bytes) in found.items()))
    finally:
        if me.cuda:
            torch.cuda.synchronize()
        for handle in handles:
            handle.destroy()


# ------------------------------------------------------------------------------------------------
# parent


def placement(world: int, ranks_per_node: int, device: str, gpus: int) -> tuple:
    """(why a point of ``world`` ranks cannot run here or '', how its nodes are emulated).

    On GPUs a process per rank: one GPU each where there are enough, the nodes emulated by the
    group option ``ranks_per_node`` (the rail over NVLink); else, for nodes of one rank, ranks
    share GPUs as emulated hosts (NCCL_HOSTID per rank, as tests/dist.py does: NCCL's own
    transport between "hosts" carries the rail, the GPU time-sliced between processes). Ranks of
    one node cannot share a GPU: NCCL refuses two ranks of one host on one GPU, and a local team
    is one node."""
    if device != "cuda":
        return "", "the reference backend over gloo, a process per rank"
    if world <= gpus:
        return "", ("one GPU per rank, the nodes emulated by the group option ranks_per_node: "
                    "the rail runs over NVLink")
    if ranks_per_node == 1:
        return "", (f"{world} processes on {gpus} GPU(s), each rank an emulated host "
                    f"(NCCL_HOSTID): the rail runs over NCCL's transport between hosts on one "
                    f"machine, the GPU time-sliced (times are a proxy; rows and bytes are exact)")
    return (f"{world} ranks of {ranks_per_node} per node need {world} GPUs (NCCL refuses two "
            f"ranks of one host on one GPU), {gpus} visible"), ""


def run(result: dict, args: argparse.Namespace, budget_end: float) -> None:
    """Each shape of --nodes-shapes as a point of ``result['nodes']['points']``, in its own
    processes, with the formula's share of every routing."""
    gpus = 0
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    out = result["nodes"] = {"routings": list(args.nodes_routings),
                             "node_limited": {"groups": NODE_LIMITED_GROUPS,
                                              "picks": NODE_LIMITED_PICKS},
                             "recv_mode": "exact", "points": []}
    for nodes, per_node in args.nodes_shapes:
        world = nodes * per_node
        point = {"nodes": nodes, "ranks_per_node": per_node, "world": world,
                 "share_formula": {r: share_formula(r, args.experts, args.topk, nodes)
                                   for r in args.nodes_routings}}
        reason, how = placement(world, per_node, args.device, gpus)
        if reason:
            out["points"].append({**point, "skipped": reason})
            continue
        point["placement"] = how
        point_args = argparse.Namespace(**{**vars(args), "nproc": world,
                                           "ranks_per_node": per_node, "recv_mode": "exact",
                                           "capacity_factor": None,
                                           "emulated_hosts": args.device == "cuda"
                                           and world > gpus})
        items, checks, _ = run_into(result, f"nodes({shape_label(nodes, per_node)})", section,
                                    point_args, budget_end)
        out["points"].append({**point, "items": items, "checks": checks})


def points(result: dict) -> list:
    return (result.get("nodes") or {}).get("points") or []
