"""The ceilings section: what the hardware moves without our library, on this run's GPUs.

HBM copy (read + write counted), the same copy from only ``--num-sms`` SMs, the copy engine
between two GPUs (one direction, then every GPU to the next at once), and NCCL's
``all_to_all_single`` at two sizes. The kernels' floors divide by these (report.add_floors).
GPUs only (cli refuses it on cpu).
"""

from __future__ import annotations

from .runner import Rank

# Names of the items, as the floors look them up.
HBM_COPY = "HBM copy, read+write (per GPU)"
PEER_COPY_ONE = "peer copy GPU0->GPU1 (copy engine)"
PEER_COPY_ALL = "peer copy, all GPUs at once (per GPU)"

_copy_kernel = None


def _persistent_copy_kernel():
    """A Triton copy whose programs loop over 16 KB blocks, so the grid size is the SM count."""
    global _copy_kernel
    if _copy_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def persistent_copy(src, dst, n_blocks, BLOCK: tl.constexpr):
            for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
                offs = b * BLOCK + tl.arange(0, BLOCK)
                tl.store(dst + offs, tl.load(src + offs))

        _copy_kernel = persistent_copy
    return _copy_kernel


def section(me: Rank) -> None:
    torch, args = me.torch, me.args
    nbytes = args.copy_mib * 2**20

    def random_bytes(device) -> "torch.Tensor":
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)

    def hbm_copy():
        src = random_bytes(me.device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=me.device)
        me.measure(HBM_COPY, lambda i: dst.copy_(src), mode="kernel", collective=False,
                   extra={"phys_bytes": 2.0 * nbytes})

    me.attempt("hbm_copy", hbm_copy)

    def hbm_copy_sm_budget():
        # The same copy from only num_sms SMs (one persistent program per SM): the HBM rate our
        # kernels can reach inside their SM budget.
        src = random_bytes(me.device).view(torch.int32)
        dst = torch.empty_like(src)
        copy = _persistent_copy_kernel()
        block = 4096  # int32 elements: 16 KB per program step
        grid = (args.num_sms,)
        me.measure(f"HBM copy, read+write, {args.num_sms} SMs (per GPU)",
                   lambda i: copy[grid](src, dst, src.numel() // block, BLOCK=block, num_warps=16),
                   mode="kernel", collective=False, extra={"phys_bytes": 2.0 * nbytes})

    me.attempt("hbm_copy_sm_budget", hbm_copy_sm_budget)

    def peer_copy(all_ranks: bool):
        # The copy engine between two GPUs (cross-device copy_ is a peer memcpy in torch).
        peer = torch.device("cuda", (me.rank + 1) % me.world)
        active = all_ranks or me.rank == 0
        if active:
            src, dst = random_bytes(me.device), torch.empty(nbytes, dtype=torch.uint8, device=peer)
            me.measure(PEER_COPY_ALL if all_ranks else PEER_COPY_ONE, lambda i: dst.copy_(src),
                       mode="kernel", collective=all_ranks, extra={"phys_bytes": float(nbytes)})
        me.host_barrier()

    if me.world > 1 and torch.cuda.device_count() >= 2:
        me.attempt("peer_copy_0to1", lambda: peer_copy(False))
        me.attempt("peer_copy_all", lambda: peer_copy(True))

    def all_to_all(rows_per_peer: int, label: str):
        total = rows_per_peer * me.world
        send = torch.randn(total, args.hidden, device=me.device).to(me.dtype)
        recv = torch.empty_like(send)
        remote = rows_per_peer * (me.world - 1) * args.hidden * me.elt
        me.measure(f"all_to_all_single {total} rows ({label})",
                   lambda i: me.dist.all_to_all_single(recv, send), mode="kernel",
                   extra={"phys_bytes": float(remote)})

    if me.world > 1:
        # T*K rows in all: the anchor's size; T rows per peer: the bytes a dispatch moves.
        me.attempt("a2a_TK", lambda: all_to_all(
            max(1, args.tokens * args.topk // me.world), "T*K"))
        me.attempt("a2a_T", lambda: all_to_all(args.tokens, "T per peer"))
