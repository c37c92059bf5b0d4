"""The bench's flags, their per-device defaults and the checks on them."""

from __future__ import annotations

import argparse
import os

from megatron_nccl_ep.options import NcclEpOptions  # no torch: parsing stays light

SECTIONS = ("ceilings", "kernels", "megatron", "team", "ll", "host", "experts", "nodes")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# The LL section's payloads: the token dtype, or a payload dtype of the library's by its word (the
# group's payload_dtype: a key of megatron_nccl_ep.config.LL_PAYLOADS, by torch name). Its layouts
# are the library's (megatron_nccl_ep.config.LL_LAYOUTS). Both read where used: config imports
# torch, which parsing the flags leaves until a value needs it.
LL_FP8 = "fp8"
LL_PAYLOAD_DTYPES = {LL_FP8: "float8_e4m3fn"}
LL_FLAGS = ("ll_tokens", "ll_sizes", "ll_num_sms", "ll_payloads", "ll_layouts")
HOST_FLAGS = ("host_ht_tokens", "host_ll_tokens")
NODES_FLAGS = ("nodes_shapes", "nodes_routings")
# The nodes section's routings; node-limited: groups of experts, and how many of them a token picks
# (docs/internode.md's table: 8 groups, 4 picked).
ROUTINGS = ("uniform", "node_limited")
NODE_LIMITED_GROUPS = 8
NODE_LIMITED_PICKS = 4

# Flags left out take their device's value. On CPU the reference backend runs over gloo, so the
# shape is one that takes seconds there, and what measures GPU hardware is left out. The team
# section joins the GPU defaults where exactly one GPU is visible (parse_args).
DEVICE_DEFAULTS = {
    "cuda": {"tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256, "warmup": 5,
             "iters": 40, "rotate": 4, "copy_mib": 1024, "num_sms": 24,
             "sections": "ceilings,kernels,megatron",
             "megatron_dispatchers": "nccl_ep,alltoall", "team_sizes": [2, 4],
             "ll_tokens": [1, 8, 32, 128, 256], "ll_sizes": [1, 2, 4, 8], "ll_num_sms": [24],
             "host_ht_tokens": [128, 4096], "host_ll_tokens": [1, 128],
             "nodes_shapes": [(2, 2), (4, 1)]},
    "cpu": {"tokens": 256, "hidden": 256, "topk": 2, "experts": 16, "warmup": 2, "iters": 10,
            "rotate": 2, "copy_mib": 64, "num_sms": None, "sections": "kernels,megatron",
            "megatron_dispatchers": "nccl_ep", "team_sizes": [],
            "ll_tokens": [1, 8, 32, 128, 256], "ll_sizes": [1, 2, 4, 8], "ll_num_sms": None,
            "host_ht_tokens": None, "host_ll_tokens": None, "nodes_shapes": [(2, 2), (4, 1)]},
}


def _by_device(key: str) -> str:
    return (f"default {DEVICE_DEFAULTS['cuda'][key]} on GPUs, "
            f"{DEVICE_DEFAULTS['cpu'][key]} on cpu")


def _int_list(minimum: int, allow_all: bool):
    """An argparse type: '16,24,all' -> [16, 24, 'all'], every number >= ``minimum``."""
    def parse(text: str) -> list:
        words = [word for word in text.split(",") if word]
        ok = words and all((allow_all and w == "all") or (w.isdigit() and int(w) >= minimum)
                           for w in words)
        if not ok:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers >= {minimum}"
                + (" or 'all'" if allow_all else "") + f": {text!r}")
        return [w if w == "all" else int(w) for w in words]
    return parse


def _word_list(choices):
    """An argparse type: 'a,b' -> ['a', 'b'], every word one of ``choices`` (a tuple, or a
    function that returns it, called when a value is parsed)."""
    def parse(text: str) -> list:
        allowed = choices() if callable(choices) else choices
        words = [word for word in text.split(",") if word]
        if not words or any(w not in allowed for w in words):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated words of {','.join(allowed)}: {text!r}")
        return list(dict.fromkeys(words))
    return parse


def _node_shapes(text: str) -> list:
    """An argparse type: '2x2,4x1' -> [(2, 2), (4, 1)], (nodes >= 2, ranks per node >= 1)."""
    found = []
    for word in (w for w in text.split(",") if w):
        nodes, _, per_node = word.partition("x")
        if not (nodes.isdigit() and per_node.isdigit() and int(nodes) >= 2
                and int(per_node) >= 1):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated NODESxRANKS_PER_NODE, nodes >= 2 and ranks per node "
                f">= 1: {text!r}")
        found.append((int(nodes), int(per_node)))
    if not found:
        raise argparse.ArgumentTypeError(f"expected at least one NODESxRANKS_PER_NODE: {text!r}")
    return list(dict.fromkeys(found))


def _node_routings() -> tuple:
    return ROUTINGS


def _ll_layouts() -> tuple:
    from megatron_nccl_ep.config import LL_LAYOUTS

    return LL_LAYOUTS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark of megatron_nccl_ep: link and memory ceilings, our dispatch and "
                    "combine (HT kernels and LL), Megatron's dispatcher interface, EP>1 as a "
                    "local team on one GPU, host time per call, Megatron's experts, HT over "
                    "emulated nodes and the rail's bytes, and sweeps over tokens per rank and "
                    "SM budget. One process per GPU (emulated hosts may share one), each "
                    "section in its own processes; without a GPU, the reference backend over "
                    "gloo at a small shape (a check that the code runs, not a measurement).")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (one per GPU); default: all GPUs, or 2 with --device cpu")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when a GPU is visible; cpu runs the reference backend over "
                        "gloo at a small shape and times it by host wall clock")
    p.add_argument("--tokens", type=int, help=f"tokens per rank; {_by_device('tokens')}")
    p.add_argument("--hidden", type=int, help=_by_device("hidden"))
    p.add_argument("--topk", type=int, help=_by_device("topk"))
    p.add_argument("--experts", type=int, help=_by_device("experts"))
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--num-sms", type=int, default=None,
                   help="SM budget of our kernels, per rank; default 24 (GPUs only: the "
                        "reference backend has none)")
    p.add_argument("--staging-chunk-tokens", type=int, default=0,
                   help="tokens per staging-ring chunk of our kernels (0: the library's choice)")
    p.add_argument("--staging-depth", type=int, default=0,
                   help="ring slots per (channel, peer) of our kernels (0: the library's choice)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="ranks per node of our groups (0: one NVLink domain; smaller: emulated "
                        "nodes, tokens between them over NCCL send/receive)")
    p.add_argument("--backend", choices=("cuda", "torch", "auto"), default=None,
                   help="our Group's backend; default: cuda on GPUs, torch on cpu")
    p.add_argument("--recv-mode", choices=("exact", "capacity"), default="exact",
                   help="our groups' receive mode: exact (the count read on the host once per "
                        "handle) or capacity (fixed-size outputs, no host read)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="capacity mode: rows = factor x tokens x top-k (default: the plugin's, "
                        f"{NcclEpOptions.capacity_factor})")
    p.add_argument("--warmup", type=int, help=_by_device("warmup"))
    p.add_argument("--iters", type=int, help=_by_device("iters"))
    p.add_argument("--rotate", type=int, help=f"input sets rotated through; {_by_device('rotate')}")
    p.add_argument("--copy-mib", type=int,
                   help=f"size of the ceiling copies; {_by_device('copy_mib')}")
    p.add_argument("--sections",
                   help=f"comma-separated subset of {','.join(SECTIONS)}; default "
                        f"{DEVICE_DEFAULTS['cuda']['sections']} on GPUs (and team where exactly "
                        f"one GPU is visible), {DEVICE_DEFAULTS['cpu']['sections']} on cpu")
    p.add_argument("--megatron-dispatchers",
                   help="Megatron dispatchers to drive: nccl_ep, alltoall, allgather; "
                        + _by_device("megatron_dispatchers"))
    p.add_argument("--team-sizes", type=_int_list(2, allow_all=False), default=None,
                   metavar="2,4,8",
                   help="world sizes of the team section, one point each: EP=N as a local team "
                        "on GPU 0, every rank a thread with its own stream and SM budget (a "
                        "proxy: no NVLink, one HBM for every rank); default 2,4")
    p.add_argument("--ll-tokens", type=_int_list(1, allow_all=False), default=None,
                   metavar="1,8,...",
                   help="the ll section's tokens per rank, each its own T_max; default "
                        f"{','.join(map(str, DEVICE_DEFAULTS['cuda']['ll_tokens']))}")
    p.add_argument("--ll-sizes", type=_int_list(1, allow_all=False), default=None,
                   metavar="1,2,4,8",
                   help="the ll section's EP sizes: 1 a single-rank Group, more a local team on "
                        "GPU 0 (a proxy; skipped, saying why, where it cannot run); default "
                        f"{','.join(map(str, DEVICE_DEFAULTS['cuda']['ll_sizes']))}")
    p.add_argument("--ll-num-sms", type=_int_list(1, allow_all=True), default=None,
                   metavar="24,...,all",
                   help="CTAs of each LL kernel, a point per value ('all': the GPU's SMs); in a "
                        "local team at most the GPU's SMs / ranks; default 24 (GPUs only)")
    p.add_argument("--ll-payloads", type=_word_list(tuple(DTYPES) + tuple(LL_PAYLOAD_DTYPES)),
                   default=None,
                   metavar="bf16,fp8",
                   help="the ll section's dispatch payloads: the token dtype (--dtype) and/or "
                        "fp8 (payload_dtype float8_e4m3fn); default both")
    p.add_argument("--ll-layouts", type=_word_list(_ll_layouts), default=None,
                   metavar="expert_major,rank_major",
                   help="the ll section's dispatch layouts; default both")
    p.add_argument("--host-ht-tokens", type=_int_list(1, allow_all=False), default=None,
                   metavar="128,4096",
                   help="the host section's HT tokens per rank (EP=1, exact and capacity mode); "
                        f"default {','.join(map(str, DEVICE_DEFAULTS['cuda']['host_ht_tokens']))}"
                        " (GPUs only)")
    p.add_argument("--host-ll-tokens", type=_int_list(1, allow_all=False), default=None,
                   metavar="1,128",
                   help="the host section's LL tokens per rank (EP=1, every SM, the layouts of "
                        "--ll-layouts); default "
                        f"{','.join(map(str, DEVICE_DEFAULTS['cuda']['host_ll_tokens']))}")
    p.add_argument("--nodes-shapes", type=_node_shapes, default=None, metavar="2x2,4x1",
                   help="the nodes section's groups, one point each: NODES x ranks per node, a "
                        "process per rank (GPUs: one GPU each, the group option ranks_per_node "
                        "emulating the nodes); default 2x2,4x1")
    p.add_argument("--nodes-routings", type=_word_list(_node_routings), default=None,
                   metavar="uniform,node_limited",
                   help="the nodes section's routings: uniform top-k, and/or node-limited (the "
                        "experts in 8 groups, 4 picked per token); default both")
    p.add_argument("--sweep-sms", type=_int_list(1, allow_all=True), default=[],
                   metavar="16,24,...,all",
                   help="after the sections, the kernels section once per SM budget (at --tokens;"
                        " all: the GPU's SM count; GPUs only)")
    p.add_argument("--sweep-tokens", type=_int_list(1, allow_all=False), default=[],
                   metavar="1024,2048,...",
                   help="after the sections, the kernels section once per tokens-per-rank value "
                        "(at --num-sms, or at each --sweep-tokens-sms)")
    p.add_argument("--sweep-tokens-sms", type=_int_list(1, allow_all=False), default=[],
                   metavar="24,132",
                   help="the SM budgets of the tokens sweep (default: --num-sms): shows whether "
                        "small batches cost more with a larger budget")
    p.add_argument("--device-timeout", type=float, default=20.0,
                   help="timeout_s of our Group: a device-side wait fails after this long")
    p.add_argument("--section-timeout", type=float, default=75.0,
                   help="seconds one section (or sweep or team point) may take before its "
                        "processes are killed")
    p.add_argument("--time-budget", type=float, default=170.0,
                   help="seconds for the whole bench; later sections and points get what is left")
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="write the results as markdown tables here (the body of "
                        "benchmarks/RESULTS.md)")
    p.add_argument("--plot", default=None,
                   help="PNG of the sweeps (needs matplotlib; a run without a sweep writes "
                        "none); default with a sweep: the --json path with .png")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and an empty table, start no process")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        p.error("--device cuda: no GPU is visible")
    if args.device == "cpu":
        for flag, value in (("--num-sms", args.num_sms), ("--sweep-sms", args.sweep_sms or None)):
            if value is not None:
                p.error(f"{flag}: the reference backend on cpu has no SM budget")
        if args.team_sizes:
            p.error("--team-sizes: the team section needs a GPU and the built extension")
        if args.ll_num_sms is not None:
            p.error("--ll-num-sms: the reference backend on cpu has no SM budget")
    team_sizes_given = args.team_sizes is not None
    ll_given = [f"--{key.replace('_', '-')}" for key in LL_FLAGS if getattr(args, key) is not None]
    host_given = [f"--{key.replace('_', '-')}" for key in HOST_FLAGS
                  if getattr(args, key) is not None]
    nodes_given = [f"--{key.replace('_', '-')}" for key in NODES_FLAGS
                   if getattr(args, key) is not None]
    sections_given = args.sections is not None
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)
    if args.backend is None:
        args.backend = "cuda" if args.device == "cuda" else "torch"
    if args.nproc is None:
        args.nproc = gpus if args.device == "cuda" else 2
    args.sections = [s for s in args.sections.split(",") if s]
    # Why the cuda backend cannot run here ('' when its extension is built and loads), where
    # the team section may run.
    problem = ""
    if args.device == "cuda" and ("team" in args.sections or (not sections_given and gpus == 1)):
        from megatron_nccl_ep import cuda_backend

        problem = cuda_backend.unavailable_reason()
    if not sections_given and gpus == 1 and not problem:
        args.sections.append("team")
    args.megatron_dispatchers = [d for d in args.megatron_dispatchers.split(",") if d]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {','.join(SECTIONS)}")
    if "ceilings" in args.sections and args.device != "cuda":
        p.error("--sections ceilings measures GPU hardware (HBM, peer copies, NCCL): not on cpu")
    if "experts" in args.sections and args.device != "cuda":
        p.error("--sections experts times bf16 grouped GEMMs and CUDA graphs: not on cpu")
    if "host" in args.sections:
        _check_host(p, args)
    elif host_given:
        p.error(f"{', '.join(host_given)}: the host section's flags (add host to --sections)")
    if "team" in args.sections:
        if args.device != "cuda":
            p.error("--sections team needs a GPU (a local team runs the cuda backend)")
        if problem:
            p.error(f"--sections team needs the built extension: {problem}")
    elif team_sizes_given:
        p.error("--team-sizes needs the team section (add team to --sections)")
    if "nodes" in args.sections:
        _check_nodes(p, args)
    elif nodes_given:
        p.error(f"{', '.join(nodes_given)}: the nodes section's flags (add nodes to --sections)")
    if "ll" in args.sections:
        _check_ll(p, args)
    else:
        # The host section takes the LL layouts only.
        misplaced = [f for f in ll_given if not ("host" in args.sections and f == "--ll-layouts")]
        if misplaced:
            p.error(f"{', '.join(misplaced)}: the ll section's flags (add ll to --sections)")
        if "host" in args.sections and args.ll_layouts is None:
            args.ll_layouts = list(_ll_layouts())
    if args.nproc < 1:
        p.error("--nproc must be >= 1")
    if args.device == "cuda" and args.nproc > gpus:
        p.error(f"--nproc {args.nproc}: only {gpus} GPU(s) visible (one process per GPU)")
    if args.experts % args.nproc:
        p.error(f"--experts ({args.experts}) must be a multiple of the process count "
                f"({args.nproc})")
    if "team" in args.sections:
        uneven = [w for w in args.team_sizes if args.experts % w]
        if uneven:
            p.error(f"--experts ({args.experts}) must be a multiple of every --team-sizes "
                    f"value (not of {uneven})")
    if not 1 <= args.topk <= args.experts:
        p.error("--topk must be in [1, --experts]")
    if min(args.iters, args.rotate, args.tokens, args.hidden) < 1 or args.warmup < 0:
        p.error("--iters, --rotate, --tokens, --hidden must be >= 1 and --warmup >= 0")
    if args.num_sms is not None and args.num_sms < 1:
        p.error("--num-sms must be >= 1")
    if args.staging_chunk_tokens < 0:
        p.error("--staging-chunk-tokens must be >= 0 (0: the library's choice)")
    if args.staging_depth < 0 or args.staging_depth == 1:
        p.error("--staging-depth must be 0 (the library's choice) or >= 2")
    if args.ranks_per_node < 0 or (args.ranks_per_node and args.nproc % args.ranks_per_node):
        p.error(f"--ranks-per-node must be 0 or a divisor of the process count ({args.nproc})")
    if "all" in args.sweep_sms:
        from .machine import machine_info

        every = machine_info("cuda")["sm_count"]
        args.sweep_sms = [every if v == "all" else v for v in args.sweep_sms]
    sweeping = bool(args.sweep_sms or args.sweep_tokens)
    if args.plot is None and args.json and sweeping:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    if args.recv_mode == "capacity" and args.capacity_factor is None:
        args.capacity_factor = NcclEpOptions.capacity_factor
    return args


def _check_ll(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    import torch

    from megatron_nccl_ep.config import LL_LAYOUTS, LL_MAX_TOKENS, LL_PAYLOADS

    if args.ll_payloads is None:
        args.ll_payloads = [args.dtype, LL_FP8]
    if args.ll_layouts is None:
        args.ll_layouts = list(LL_LAYOUTS)
    other = [w for w in args.ll_payloads if w != args.dtype and w not in LL_PAYLOAD_DTYPES]
    if other:
        p.error(f"--ll-payloads: {other} is neither the token dtype (--dtype {args.dtype}) nor "
                f"one of {', '.join(LL_PAYLOAD_DTYPES)}")
    for word in set(args.ll_payloads) & set(LL_PAYLOAD_DTYPES):
        block = LL_PAYLOADS[getattr(torch, LL_PAYLOAD_DTYPES[word])].scale_block
        if args.hidden % block:
            p.error(f"--ll-payloads {word} casts blocks of {block} columns: --hidden "
                    f"({args.hidden}) must be a multiple of {block}")
    uneven = [w for w in args.ll_sizes if args.experts % w]
    if uneven:
        p.error(f"--experts ({args.experts}) must be a multiple of every --ll-sizes value (not "
                f"of {uneven})")
    if max(args.ll_tokens) > LL_MAX_TOKENS:
        p.error(f"--ll-tokens: an LL group takes at most {LL_MAX_TOKENS} tokens per rank")


def _check_nodes(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.nodes_routings is None:
        args.nodes_routings = list(ROUTINGS)
    for nodes, per_node in args.nodes_shapes:
        if args.experts % (nodes * per_node):
            p.error(f"--experts ({args.experts}) must be a multiple of every --nodes-shapes "
                    f"group's ranks (not of {nodes} x {per_node})")
    if "node_limited" in args.nodes_routings:
        group_size = args.experts // NODE_LIMITED_GROUPS
        if args.experts % NODE_LIMITED_GROUPS or args.topk > NODE_LIMITED_PICKS * group_size:
            p.error(f"--nodes-routings node_limited: --experts ({args.experts}) must be a "
                    f"multiple of {NODE_LIMITED_GROUPS} groups and --topk ({args.topk}) at most "
                    f"the experts of {NODE_LIMITED_PICKS} groups")
        split = [nodes for nodes, _ in args.nodes_shapes if NODE_LIMITED_GROUPS % nodes]
        if split:
            p.error(f"--nodes-routings node_limited: every node holds whole groups, so the "
                    f"nodes of --nodes-shapes must divide {NODE_LIMITED_GROUPS} (not {split})")


def _check_host(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from megatron_nccl_ep.config import LL_MAX_TOKENS

    if args.device != "cuda":
        p.error("--sections host times the host next to the GPU (enqueue costs with the GPU "
                "held, CUDA graphs): not on cpu")
    if max(args.host_ll_tokens) > LL_MAX_TOKENS:
        p.error(f"--host-ll-tokens: an LL group takes at most {LL_MAX_TOKENS} tokens per rank")


def sweep_points(args: argparse.Namespace) -> "list[tuple[int, int | None]]":
    """(tokens, SMs) of every sweep point: the tokens sweep at each --sweep-tokens-sms (default
    --num-sms), the SM sweep at --tokens; a point of both runs once."""
    points = [(tokens, num_sms) for num_sms in (args.sweep_tokens_sms or [args.num_sms])
              for tokens in args.sweep_tokens]
    points += [(args.tokens, num_sms) for num_sms in args.sweep_sms]
    return list(dict.fromkeys(points))
