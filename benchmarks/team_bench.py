"""EP=2 (or more) on ONE GPU: the kernels of a local team (``Group.local_team``), every rank in
this process on its own thread and stream with its own SM budget. A proxy for the multi-GPU
bench when only one GPU is lent, not a substitute: the peers' rings are this GPU's memory (no
NVLink), and the ranks share one HBM, so the byte traffic of every rank lands on it. What it does
measure: the engine's structure at EP >= 2 (items of ~K/R rows, round and credit waits, the
handle's barrier), so an A/B of a protocol change can run without a second GPU.

    python benchmarks/team_bench.py [--world 2] [--tokens 4096 --hidden 7168 --topk 8 ...]

Timing: per iteration every rank's thread meets the others, holds its stream with a sleep kernel
long enough for all ranks to enqueue, and brackets its op with CUDA events. The iteration's time
runs from the last rank's start to the last rank's end (the collective from the moment every
rank is in it); per rank, its own start to its own end is its busy time. Medians over --iters,
rotating --rotate routings.
"""
import statistics
import threading

import torch

from megatron_nccl_ep.api import Group, run_local_team
from timeline_args import shape_parser  # this folder

HEAD_START_CYCLES = 1_000_000  # ~500 us at H200 clocks: every rank's host enqueues in that time


def main() -> None:
    p = shape_parser(__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rotate", type=int, default=2)
    p.add_argument("--staging-chunk-tokens", type=int, default=0, help="0: the library's default")
    p.add_argument("--staging-depth", type=int, default=0, help="0: the library's default")
    p.add_argument("--max-topk", type=int, default=0,
                   help="the group's max_topk, above --topk (e.g. the experts, as Megatron's "
                        "drop-and-pad groups have); 0: --topk")
    p.add_argument("--expert-capacity", type=int, default=0,
                   help="C > 0: the drop-and-pad layout (each local expert keeps C rows per "
                        "source rank); 0: off")
    p.add_argument("--routing-map", action="store_true",
                   help="handles from a [T, E] bool routing map, as Megatron's dispatcher makes "
                        "them (a map record has max_topk slots per token), not from topk_idx")
    args = p.parse_args()
    args.max_topk = args.max_topk or args.topk
    device = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if args.world * args.num_sms > sms:
        raise SystemExit(f"--world {args.world} x --num-sms {args.num_sms} > {sms} SMs: "
                         "every CTA of every rank must be resident at once")
    groups = Group.local_team(args.world, num_experts=args.experts, hidden=args.hidden,
                              max_tokens_per_rank=args.tokens, max_topk=args.max_topk,
                              dtype=torch.bfloat16, device=device, num_sms=args.num_sms,
                              staging_chunk_tokens=args.staging_chunk_tokens,
                              staging_depth=args.staging_depth,
                              expert_capacity=args.expert_capacity, timeout_s=20.0)
    ranks = [Rank(r, g, args) for r, g in enumerate(groups)]
    meet = threading.Barrier(args.world)
    ops = ("handle", "dispatch", "combine")

    def body(rank: int, group: Group) -> None:
        me = ranks[rank]
        me.start()
        for op in ops:
            for it in range(args.warmup + args.iters):
                meet.wait(timeout=60)
                pair = me.timed(op, it % args.rotate)
                if it >= args.warmup:
                    me.pairs.setdefault(op, []).append(pair)
        torch.cuda.current_stream().synchronize()
        for handle in me.handles:
            handle.destroy()

    run_local_team(groups, body, prepare=lambda rank, group: ranks[rank].prepare(),
                   timeout_s=600.0)
    info = groups[0].info()
    chunk, depth = info.get("staging_chunk_tokens"), info.get("staging_depth")
    print(f"team bench, 1 GPU ({torch.cuda.get_device_name(device)}), EP={args.world} local "
          f"team (proxy: rings in this GPU's memory, one HBM for every rank): {args.tokens} "
          f"tokens/rank x {args.hidden} x top-{args.topk} of {args.experts} (max_topk "
          f"{args.max_topk}, expert capacity {args.expert_capacity or 'off'}"
          f"{', routing map' if args.routing_map else ''}), bf16, exact mode, "
          f"{args.num_sms} SMs per rank, staging {chunk} tokens x depth {depth}; medians of "
          f"{args.iters} iterations (us)")
    print(f"{'op':>10} {'collective':>11} {'busy/rank':>10} {'min':>8}")
    for op in ops:
        ref = ranks[0].pairs[op][0][0]  # one clock for every rank: rank 0's first start

        def us(event):
            return ref.elapsed_time(event) * 1e3

        iterations = [[(us(me.pairs[op][it][0]), us(me.pairs[op][it][1])) for me in ranks]
                      for it in range(args.iters)]
        collective, busy, fastest = summarize(iterations)
        print(f"{op:>10} {collective:11.1f} {busy:10.1f} {fastest:8.1f}")
    for g in groups:
        g.destroy()


class Rank:
    """One rank's inputs, handles and timings (on the stream run_local_team gives the rank)."""

    def __init__(self, rank: int, group: Group, args) -> None:
        self.rank, self.group, self.args = rank, group, args
        self.pairs: dict = {}
        self.handles: list = []

    def prepare(self) -> None:
        """Before the ranks meet: this stream's memory and the inputs. An allocation that
        reaches cudaMalloc inside the timed ops could wait for the device, whose kernels wait
        for this rank (the peers' threads)."""
        a, device = self.args, self.group.device
        # Its expert rows (~T x K at any EP size, a quarter more for the spread) per routing and
        # one more, and its tokens.
        rows_bytes, token_bytes = a.tokens * a.topk * a.hidden * 2, a.tokens * a.hidden * 2
        reserve = torch.empty(int(1.25 * (a.rotate + 1) * rows_bytes)
                              + (2 * a.rotate + 2) * token_bytes, dtype=torch.uint8, device=device)
        del reserve
        gen = torch.Generator(device=device)
        gen.manual_seed(1000 + self.rank)
        self.routings = [torch.rand(a.tokens, a.experts, generator=gen, device=device)
                         .topk(a.topk, dim=1).indices for _ in range(a.rotate)]
        if a.routing_map:
            self.routings = [torch.zeros(a.tokens, a.experts, dtype=torch.bool, device=device)
                             .scatter_(1, r, True) for r in self.routings]
        self.x = [torch.randn(a.tokens, a.hidden, generator=gen, device=device)
                  .to(torch.bfloat16) for _ in range(a.rotate)]

    def start(self) -> None:
        """The ranks' first calls: a handle per routing and the rows to combine."""
        a = self.args
        self.handles = [self.handle(r) for r in self.routings]
        for h in self.handles:
            h.num_recv_tokens  # the count read waits for every rank's layout
        self.expert_out = [self.handles[i].dispatch(self.x[i])[0] for i in range(a.rotate)]

    def handle(self, routing: torch.Tensor):
        if self.args.routing_map:
            return self.group.create_handle(routing_map=routing)
        return self.group.create_handle(routing)

    def timed(self, op: str, i: int):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HEAD_START_CYCLES)
        start.record()
        if op == "handle":
            handle = self.handle(self.routings[i])
        elif op == "dispatch":
            self.handles[i].dispatch(self.x[i])
        else:
            self.handles[i].combine(self.expert_out[i])
        end.record()
        if op == "handle":
            handle.num_recv_tokens  # waits for the peers' layouts (each rank its own stream)
            handle.destroy()
        torch.cuda.current_stream().synchronize()
        return start, end


def summarize(iterations) -> tuple:
    """Per iteration, every rank's (start, end) in us on one clock -> the medians of the
    collective time (the last start to the last end) and of each rank's busy time (its own start
    to its own end), and the fastest collective time."""
    collective = [max(e for _, e in it) - max(s for s, _ in it) for it in iterations]
    busy = [e - s for it in iterations for s, e in it]
    return statistics.median(collective), statistics.median(busy), min(collective)


if __name__ == "__main__":
    main()
