"""The kernels section: our ``Group``/``Handle`` on every rank of the run.

Handle creation (with the exact-mode count read), dispatch and combine, in each timing mode of the
device (runner), two sanity checks, and our own lower bound: the rank-major layout, one row per
(token, destination rank), made by the same library from a group with one expert per rank.

Bandwidth is counted two ways, per rank: **physical** = unique (token, destination rank != source
rank) pairs x hidden x element size (the bytes that cross the link); **logical** (DeepEP's
convention) = unique (token, rank) pairs received including the rank's own x hidden x element
size. Routing probabilities are left out of both. ``hbm_bytes`` is what the expert-major ops must
read and write at the least (this rank's tokens once and its expert-major rows once): the floors
divide it by the ceilings of the same run (report.add_floors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .runner import Rank, item_name, kernel_mode

if TYPE_CHECKING:
    import torch

HANDLE = "handle: create + count read"
RANK_MAJOR = "{}, rank-major"  # the op of the rank-major lower bound: RANK_MAJOR.format(op)


def group_fields(args) -> dict:
    """The Group keywords that the bench's flags set, shared by every group it makes."""
    fields = {"hidden": args.hidden, "max_tokens_per_rank": args.tokens,
              "timeout_s": args.device_timeout, "staging_chunk_tokens": args.staging_chunk_tokens,
              "staging_depth": args.staging_depth}
    if args.num_sms is not None:  # the reference backend on cpu has no SM budget
        fields["num_sms"] = args.num_sms
    return fields


def rows_per_rank(topk: "torch.Tensor", experts: int, world: int) -> list:
    """Rows that each rank receives from one routing (one per routed (token, slot) it owns),
    without alignment padding."""
    return (topk[topk >= 0] // (experts // world)).bincount(minlength=world).tolist()


def _routing(me: Rank, topk: "torch.Tensor") -> tuple:
    """(destination mask [T, world]: token t has an expert on rank d; M[s][d]: tokens of rank s
    with at least one expert on rank d, for every (s, d); rows this rank receives), from one
    exchange between the ranks."""
    torch = me.torch
    dest = torch.zeros(topk.shape[0], me.world, dtype=torch.bool, device=topk.device)
    valid = topk >= 0
    dest.scatter_(1, torch.where(valid, topk // (me.args.experts // me.world), 0), valid)
    mine = (dest.sum(0).tolist(), rows_per_rank(topk, me.args.experts, me.world))
    if me.world == 1:
        everyone = [mine]
    else:
        everyone = [None] * me.world
        me.dist.all_gather_object(everyone, mine, group=me.host_group)
    return dest, [pairs for pairs, _ in everyone], sum(rows[me.rank] for _, rows in everyone)


def _traffic_bytes(me: Rank, counts: list, rows: int) -> dict:
    """Per-rank bytes of one dispatch/combine under both conventions, and the HBM floor's bytes
    (module doc)."""
    row = me.args.hidden * me.elt
    r = me.rank
    return {
        "dispatch_phys": sum(counts[r][d] for d in range(me.world) if d != r) * row,
        "combine_phys": sum(counts[s][r] for s in range(me.world) if s != r) * row,
        "logical": sum(counts[s][r] for s in range(me.world)) * row,
        "hbm": (me.args.tokens + rows) * row,
    }


def section(me: Rank) -> None:
    args = me.args
    from megatron_nccl_ep.api import Group

    fields = group_fields(args)
    group = Group(num_experts=args.experts, max_topk=args.topk, dtype=me.dtype,
                  backend=args.backend, device=me.device, recv_mode=args.recv_mode,
                  capacity_factor=args.capacity_factor, ranks_per_node=args.ranks_per_node,
                  **fields)
    me.emit("info", data={"backend_resolved": group.backend_name})
    sets = []
    for s in range(args.rotate):
        topk, probs, x = me.input_set(s)
        dest, pairs, rows = _routing(me, topk)
        sets.append({"topk": topk, "probs": probs, "x": x, "dest": dest, "expected_rows": rows,
                     "bytes": _traffic_bytes(me, pairs, rows)})
    mean = lambda key: sum(st["bytes"][key] for st in sets) / len(sets)  # noqa: E731
    dispatch_bytes = {"phys_bytes": mean("dispatch_phys"), "logical_bytes": mean("logical")}
    combine_bytes = {"phys_bytes": mean("combine_phys"), "logical_bytes": mean("logical")}
    # The expert-major ops' floors; the rank-major lower bound moves fewer rows.
    floor_bytes = {"hbm_bytes": mean("hbm")}
    pick = lambda i: sets[i % len(sets)]  # noqa: E731

    def handles_and_outputs():
        for s, st in enumerate(sets):
            st["handle"] = group.create_handle(st["topk"])
            rows = st["handle"].num_recv_tokens
            st["expert_out"] = me.random_tokens(rows, seed=500 + 10 * s + me.rank)

    if not me.attempt("create_handles", handles_and_outputs):
        return

    def check_roundtrip():
        # combine(dispatch(x)) is the unweighted sum over the token's K routed rows: K * x
        # (up to rounding of the per-rank partials). Also the counts against the routing.
        st = sets[0]
        handle = st["handle"]
        recv_x, recv_probs = handle.dispatch(st["x"], st["probs"])
        y = handle.combine(recv_x)
        ref = st["x"].double() * args.topk
        err = ((y.double() - ref).norm() / ref.norm()).item()
        me.check("combine(dispatch(x)) vs K*x, rel err", f"{err:.2e}")
        counts = handle.tokens_per_expert.sum().item()
        expected = st["expected_rows"]
        ok = (args.recv_mode == "capacity" or handle.num_recv_tokens == expected) and \
            counts == expected and recv_probs is not None
        me.check("rows / sum(tokens_per_expert) / expected",
                 f"{'ok' if ok else 'MISMATCH'} {handle.num_recv_tokens}/{counts}/{expected}")

    me.attempt("check", check_roundtrip)

    def new_handle(i):
        # Creation plus the exact-mode count read (what a dispatch needs first).
        handle = group.create_handle(pick(i)["topk"])
        handle.num_recv_tokens
        return handle

    def layout():
        for mode in me.modes:
            me.measure(item_name(HANDLE, mode), new_handle, mode=mode,
                       after=lambda i, handle: handle.destroy())

    me.attempt("layout", layout)

    for mode in me.modes:
        me.attempt(f"dispatch.{mode}", lambda: me.measure(
            item_name("dispatch", mode),
            lambda i: pick(i)["handle"].dispatch(pick(i)["x"], pick(i)["probs"]),
            mode=mode, extra={**dispatch_bytes, **floor_bytes}))
    for mode in me.modes:
        me.attempt(f"combine.{mode}", lambda: me.measure(
            item_name("combine", mode),
            lambda i: pick(i)["handle"].combine(pick(i)["expert_out"]),
            mode=mode, extra={**combine_bytes, **floor_bytes}))

    def rank_major():
        # DeepEP's layout, as our own lower bound: the same tokens and link bytes, but one row
        # per (token, destination rank) instead of per (token, expert), i.e. a group with one
        # "expert" per rank routed by each token's destination ranks (a K-th of the rows to
        # write and to sum at top-K).
        rm_group = Group(num_experts=me.world, max_topk=min(args.topk, me.world), dtype=me.dtype,
                         backend=args.backend, device=me.device,
                         ranks_per_node=args.ranks_per_node, **fields)
        for s, st in enumerate(sets):
            st["rm_handle"] = rm_group.create_handle(routing_map=st["dest"])
            st["rm_rows"] = me.random_tokens(st["rm_handle"].num_recv_tokens,
                                             seed=900 + 10 * s + me.rank)
        mode = kernel_mode(args.device)
        try:
            me.measure(item_name(RANK_MAJOR.format("dispatch"), mode),
                       lambda i: pick(i)["rm_handle"].dispatch(pick(i)["x"]), mode=mode,
                       extra=dispatch_bytes)
            me.measure(item_name(RANK_MAJOR.format("combine"), mode),
                       lambda i: pick(i)["rm_handle"].combine(pick(i)["rm_rows"]), mode=mode,
                       extra=combine_bytes)
        finally:
            for st in sets:
                st.pop("rm_handle").destroy()
            rm_group.destroy()

    me.attempt("rank_major", rank_major)
    for st in sets:
        st["handle"].destroy()
    group.destroy()
