"""The Megatron dispatcher methods of this tree against a baseline's Python package, in one
process, steps interleaved: for changes of the Python path, whose host time varies more from
process to process (~10% on the GPU machine) than the changes themselves. The baseline package
(a tree's megatron_nccl_ep/, e.g. /tmp/baseline_0 of tests/gpu/run.sh) runs on this tree's _C, so
only its Python differs. One rank (EP=1), the bench shape; each step timed as the bench's e2e
mode (idle GPU, CUDA events), the variants alternating first.

    python benchmarks/megatron_ab.py --baseline /tmp/baseline_0 [--iters 200] [--options-from-flags]
"""
import importlib.util
import os
import statistics
import sys

import torch

from megatron_timeline import build_dispatcher, step_inputs  # this folder
from timeline_args import shape_parser

PARTS = ("dispatch", "combine", "fwd_bwd")


def load_baseline(tree: str):
    """``tree``/megatron_nccl_ep as the package ``megatron_nccl_ep_baseline``, on our _C."""
    name = "megatron_nccl_ep_baseline"
    path = os.path.join(tree, "megatron_nccl_ep")
    sys.modules[f"{name}._C"] = importlib.import_module("megatron_nccl_ep._C")
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


def main() -> None:
    p = shape_parser(__doc__)
    p.add_argument("--baseline", required=True, help="a tree holding megatron_nccl_ep/")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--options-from-flags", action="store_true",
                   help="the options as Megatron training passes them (parsed --nccl-ep-* "
                        "flags), not on the config")
    args = p.parse_args()
    torch.cuda.set_device(0)
    ours = build_dispatcher(args)
    variants = {"this tree": ours,
                "baseline": build_dispatcher(args, package=load_baseline(args.baseline))}
    sets = step_inputs(args, 2, seed=5)

    def timed(fn):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3, out

    def step(disp, st):
        """The methods as MoELayer calls them: (dispatch us, combine us, fwd+bwd us)."""
        hidden = st["hidden"].detach().requires_grad_(True)
        probs = st["probs"].detach().requires_grad_(True)

        def dispatch():
            h, pr = disp.dispatch_preprocess(hidden, st["routing_map"], probs)
            h, pr = disp.token_dispatch(h, pr)
            rows, _, row_probs = disp.dispatch_postprocess(h, pr)
            return rows * row_probs.unsqueeze(-1).to(rows.dtype)  # the bench's stand-in expert

        def combine(out):
            return disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(out)))

        t_dispatch, expert_out = timed(dispatch)
        t_combine, y = timed(lambda: combine(expert_out))
        y.backward(st["grad"])
        hidden = st["hidden"].detach().requires_grad_(True)
        probs = st["probs"].detach().requires_grad_(True)
        t_all, _ = timed(lambda: combine(dispatch()).backward(st["grad"]))
        return t_dispatch, t_combine, t_all

    times = {name: [] for name in variants}
    order = list(variants)
    for i in range(args.iters + 10):
        for name in order if i % 2 == 0 else order[::-1]:
            result = step(variants[name], sets[i % len(sets)])
            if i >= 10:
                times[name].append(result)
    print(f"megatron methods A/B, EP=1: {args.tokens} tokens x {args.hidden} x top-{args.topk} of "
          f"{args.experts} experts, bf16, {args.num_sms} SMs; medians (us) of {args.iters} "
          "interleaved steps, e2e from an idle GPU")
    print(f"{'':12s}" + "".join(f"{part:>12s}" for part in PARTS))
    medians = {name: [statistics.median(t[j] for t in ts) for j in range(len(PARTS))]
               for name, ts in times.items()}
    for name, row in medians.items():
        print(f"{name:12s}" + "".join(f"{v:12.1f}" for v in row))
    print(f"{'difference':12s}" + "".join(
        f"{a - b:+12.1f}" for a, b in zip(medians["this tree"], medians["baseline"])))


if __name__ == "__main__":
    main()
