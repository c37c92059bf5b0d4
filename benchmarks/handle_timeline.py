"""Where handle creation's time goes on the GPU: every kernel and copy of create_handle + the
exact-mode count read, one rank (EP=1, the bench shape by default), timed by CUPTI through
torch.profiler. Prints each activity's median duration and start (from the handle's first
activity) and the median span, over --handles handles, twice:

- idle: each handle starts on an idle GPU (the host waits for the previous one, as the count
  read makes it do): the gaps between activities are the host's launch latency;
- queued: a sleep kernel first, long enough for the host to enqueue the whole handle: the gaps
  are the GPU's own (what the bench's kernel mode sees).

    python benchmarks/handle_timeline.py [--tokens 4096 --hidden 7168 --topk 8 --experts 256]
"""
import collections
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_nccl_ep.api import Group
from timeline_args import shape_parser  # this folder

# A short sleep kernel before each handle marks where it starts in the activity list.
MARK_CYCLES = 1_000
QUEUE_CYCLES = 400_000  # ~200 us at H200 clocks: more than the host takes to enqueue a handle


def main() -> None:
    p = shape_parser(__doc__)
    p.add_argument("--handles", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cuda", 0)
    group = Group(num_experts=args.experts, hidden=args.hidden, max_tokens_per_rank=args.tokens,
                  max_topk=args.topk, dtype=torch.bfloat16, device=device,
                  num_sms=args.num_sms, backend="cuda")
    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    routings = [torch.rand(args.tokens, args.experts, generator=gen, device=device)
                .topk(args.topk, dim=1).indices for _ in range(4)]

    def one_handle(i, head_start):
        torch.cuda.synchronize()
        torch.cuda._sleep(head_start)
        handle = group.create_handle(routings[i % len(routings)])
        handle.num_recv_tokens
        handle.destroy()

    for i in range(10):  # warm-up: the pool's slots, the kernels' first launches
        one_handle(i, MARK_CYCLES)
    for mode, head_start in (("idle", MARK_CYCLES), ("queued", QUEUE_CYCLES)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(args.handles):
                one_handle(i, head_start)
            torch.cuda.synchronize()
        report(prof, mode, args)
    group.destroy()


def report(prof, mode: str, args) -> None:
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    # One handle's activities: everything after a sleep kernel up to the next one.
    handles = []
    for e in events:
        if "spin_kernel" in e.name:  # torch.cuda._sleep's kernel
            handles.append([])
        elif handles:
            handles[-1].append(e)
    # Keep the handles of the most common sequence of activities and say how many there were.
    shape = lambda h: tuple(e.name for e in h)  # noqa: E731
    common = collections.Counter(shape(h) for h in handles).most_common(1)[0][0]
    handles = [h for h in handles if shape(h) == common]
    print(f"handle timeline, {mode}, EP=1: {args.tokens} tokens x top-{args.topk} of "
          f"{args.experts} experts, medians (us) of {len(handles)} of {args.handles} handles")
    print(f"{'start':>8} {'duration':>9}  activity")
    for j, first in enumerate(handles[0]):
        start = statistics.median(h[j].time_range.start - h[0].time_range.start for h in handles)
        dur = statistics.median(h[j].time_range.end - h[j].time_range.start for h in handles)
        print(f"{start:8.1f} {dur:9.1f}  {first.name[:90]}")
    span = statistics.median(h[-1].time_range.end - h[0].time_range.start for h in handles)
    print(f"span {span:.1f} us (first activity's start to the last one's end)")


if __name__ == "__main__":
    main()
