"""``python -m benchmarks.readme``: benchmarks/RESULTS.md and the README's numbers, written from
``benchmarks/results.json``.

    python -m benchmarks.readme [--bench OUT/results.json] [--training OUT/training*.json]
                                [--stress OUT/stress.json]

``--bench`` takes a GPU run's results file (and the plot beside it) as the committed one;
``--training`` puts examples/check_training.py's records (its ``--json``) into it, ``--stress``
tests/gpu/stress_teams.py's (a new bench run keeps the committed ones). RESULTS.md is
then the bench's rendering of results.json and the README's numbers section (between ``BEGIN``
and ``END``) this module's text for it, so neither can drift from the results (tests/test_bench.py
checks that they agree); ``--check`` only says whether both are current and whether every record
in results.json (the bench run, each training record) names the tree's sources
(``report.source_version``): a library change needs a new GPU run before it lands.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap

from . import markdown
from .report import nodes_check_summary, nodes_rows, source_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results.json")
RESULTS_MD = os.path.join(ROOT, "benchmarks", "RESULTS.md")
PLOT = os.path.join(ROOT, "benchmarks", "results.png")
README = os.path.join(ROOT, "README.md")
BEGIN = "<!-- numbers: python -m benchmarks.readme writes this from benchmarks/results.json -->"
END = "<!-- end of numbers -->"
MIB = float(1 << 20)


def _us(item: dict) -> float:
    return item["median_ms"] * 1e3


def _sweep(result: dict, tokens: int, sms: int) -> dict:
    return next(p["items"] for p in result["sweeps"]
                if p["tokens"] == tokens and p["num_sms"] == sms)


def _ll(result: dict, sms: int) -> dict:
    return next(p["items"] for p in result["ll"]["points"]
                if p["world"] == 1 and p["num_sms"] == sms)


def numbers(result: dict) -> str:
    """The README's numbers section from a bench result (a GPU run with the ceilings, kernels,
    megatron and ll sections, and the small-batch kernels sweep at 24 SMs and every SM)."""
    meta, shape = result["meta"], result["shape"]
    every_sm = meta["sm_count"]
    ceilings = {("every" if "SMs" not in name else "budget"): row["phys_GBps"]
                for name, row in result["ceilings"].items()}
    kernels, megatron = result["kernels"], result["megatron"]
    device = meta["device_name"].removeprefix("NVIDIA ")
    machine = f"one {device}" if meta["gpu_count"] == 1 else f"{meta['gpu_count']} x {device}"
    lines = [
        f"From [benchmarks/RESULTS.md](benchmarks/RESULTS.md) ({machine}, sources "
        f"`{meta['source']['sources_sha256']}`):",
        f"{shape['tokens']} tokens per rank x hidden {shape['hidden']} x top-{shape['topk']} of "
        f"{shape['experts']} experts, {shape['dtype']}, an SM budget of {shape['num_sms']}, "
        "medians of",
        f"CUDA-event times. Ceilings of the same run: HBM copy {ceilings['every']:.0f} GB/s "
        f"read+write with every SM, {ceilings['budget']:.0f} GB/s",
        f"from {shape['num_sms']} SMs.",
        "",
        f"| EP={shape['ranks']}, {shape['num_sms']} SMs (us) | kernels | end to end |",
        "|---|---:|---:|",
    ]
    for label, name in (("handle: create + receive count", "handle: create + count read"),
                        ("dispatch", "dispatch"), ("combine", "combine")):
        lines.append(f"| {label} | {_us(kernels[name + ' (kernel)']):.1f} | "
                     f"{_us(kernels[name + ' (e2e)']):.1f} |")
    lines += ["", "| Megatron's dispatcher methods, same run | dispatch (us) | combine (us) | "
              "fwd+bwd (ms) |", "|---|---:|---:|---:|"]
    for label, name in (("`nccl_ep`", "nccl_ep"), ("Megatron's `alltoall`", "alltoall")):
        lines.append(f"| {label} | {_us(megatron[name + '.dispatch']):.0f} | "
                     f"{_us(megatron[name + '.combine']):.0f} | "
                     f"{megatron[name + '.fwd_bwd']['median_ms']:.2f} |")
    small = {(t, s): _sweep(result, t, s) for t in (128, 1024) for s in (shape["num_sms"],
                                                                        every_sm)}

    def dc(tokens: int, sms: int) -> str:
        items = small[(tokens, sms)]
        return (f"{_us(items['dispatch (kernel)']):.1f} / "
                f"{_us(items['combine (kernel)']):.1f}")

    ll_all, ll_budget = _ll(result, every_sm), _ll(result, shape["num_sms"])

    def ll(items: dict, layout: str, op: str) -> str:
        return f"{_us(items[f'T=128 bf16 {layout}: {op}']):.1f}"

    memory = next(r for r in result["ll"]["memory"]["rows"]
                  if r["world"] == 64 and r["layout"] == "expert_major")
    text = (
        f"Of each fwd+bwd, the bench's stand-in expert (`rows * probs` and its backward) takes "
        f"{megatron['nccl_ep.expert_fwd_bwd']['median_ms']:.2f} ms. "
        f"HT's dispatch / combine kernels by SM budget: 128 tokens "
        f"{dc(128, shape['num_sms'])} us at {shape['num_sms']} SMs, "
        f"{dc(128, every_sm)} at {every_sm}; 1024 tokens {dc(1024, shape['num_sms'])} at "
        f"{shape['num_sms']}, {dc(1024, every_sm)} at {every_sm}. "
        f"LL at EP=1, 128 tokens (us), rank-major: dispatch {ll(ll_all, 'rank_major', 'dispatch')}, "
        f"combine {ll(ll_all, 'rank_major', 'combine')}, handle + dispatch + combine as one CUDA "
        f"graph {ll(ll_all, 'rank_major', 'graph h+d+c')} with {every_sm} SMs "
        f"({ll(ll_budget, 'rank_major', 'dispatch')}, {ll(ll_budget, 'rank_major', 'combine')}, "
        f"{ll(ll_budget, 'rank_major', 'graph h+d+c')} with {shape['num_sms']}), against "
        f"{_us(ll_all['T=128 HT: h+d+c']):.1f} for HT on the same batch; expert-major "
        f"{ll(ll_all, 'expert_major', 'dispatch')}, {ll(ll_all, 'expert_major', 'combine')}, "
        f"{ll(ll_all, 'expert_major', 'graph h+d+c')} with {every_sm} SMs. Its buffers at EP=64 "
        f"(T_max {result['ll']['memory']['shape']['tokens']}): "
        f"{memory['total_bytes'] / MIB:.0f} MiB per rank, against DeepEP V1's "
        f"{memory['deepep_bytes'] / MIB:.0f} MiB. RESULTS.md also has {_also(result)}.")
    text += _nodes(result) + _training(result) + _stress(result)
    # The README's line width; words such as "top-8" stay whole.
    lines += ["", *textwrap.wrap(text, 100, break_on_hyphens=False, break_long_words=False)]
    return "\n".join(lines)


def _sizes(values) -> str:
    return "/".join(map(str, sorted(set(values))))


def _also(result: dict) -> str:
    """What else the run measured: LL's tokens, payloads and EP sizes, HT's local teams."""
    ll = result["ll"]
    ll_teams = [p["world"] for p in ll["points"] if p["world"] > 1]
    ht_teams = [p["world"] for p in result.get("team") or []]
    teams = [f"LL EP {_sizes(ll_teams)}" if ll_teams else "",
             f"HT EP {_sizes(ht_teams)}" if ht_teams else ""]
    also = (f"LL at {_sizes(ll['tokens'])} tokens, payloads {', '.join(ll['payloads'])}")
    if any(teams):
        also += (f"; {' and '.join(t for t in teams if t)} as local teams on that one GPU "
                 "(proxies: no NVLink, one HBM)")
    if result["meta"]["gpu_count"] == 1:
        also += "; multi-GPU numbers wait for a multi-GPU machine"
    return also


def _nodes(result: dict) -> str:
    """A sentence on the rail's bytes over emulated nodes, where the run has the nodes section."""
    _, rows, _ = nodes_rows(result) if result.get("nodes") else (None, [], None)
    dispatch = {(row[0], row[1]): row[-1] for row in rows if row[2] == "dispatch"}
    if not dispatch:
        return ""
    passed, done, _ = nodes_check_summary(result)
    limited = result["nodes"]["node_limited"]
    by_shape: dict = {}
    for (shape, routing), share in dispatch.items():
        by_shape.setdefault(shape, []).append(f"{routing} {share:.2f}")
    shares = "; ".join(f"{shape} {', '.join(found)}" for shape, found in by_shape.items())
    return (f" HT over emulated nodes (NxG, RESULTS.md says how each is emulated): the rail "
            f"carries only the tokens with a slot on a node, as many rows as the routing's "
            f"messages ({passed} of {done} checks); a dispatch's rail bytes against a rail that "
            f"carried every token: {shares} (node_limited: {limited['groups']} groups of "
            f"experts, {limited['picks']} picked per token).")


def _training(result: dict) -> str:
    """A sentence on the dropless training step, where the run's training records hold it."""
    for record in result.get("training") or []:
        graphed, eager, alltoall = (record["runs"].get(name, {}).get("ms") for name in (
            "dropless_full_iteration", "dropless", "alltoall_drop_and_pad_full_iteration"))
        if None in (graphed, eager, alltoall):
            continue
        exact = any(c["passed"] and c["label"].startswith("(i)") for c in record["checks"])
        return (f" Training ({record['script']}, examples/check_training.py's GRAPH_MODEL, "
                f"{record['gpus']} x {record['device']}, the model's own routing): dropless in "
                f"capacity mode with the grouped experts, {graphed:.1f} ms per step in a "
                f"full-iteration CUDA graph ({eager:.1f} eager"
                + (", bitwise equal over 100 iterations" if exact else "")
                + f"), against {alltoall:.1f} for Megatron's alltoall with drop-and-pad "
                "(which drops tokens), also in a full-iteration graph.")
    return ""


def _stress(result: dict) -> str:
    """A sentence on the stress record, where there is one."""
    record = result.get("stress")
    if not record:
        return ""
    configs = record["configurations"]
    return (f" Stress (tests/gpu/stress_teams.py, local teams EP "
            f"{_sizes(int(c['name'].split('EP=')[1].split()[0]) for c in configs)} in fresh "
            f"processes, LL and HT, compared bitwise): {sum(c['clean'] for c in configs)} of "
            f"{len(configs)} configurations clean over {sum(c['reps'] for c in configs)} "
            f"repetitions, {sum(c['timeouts'] for c in configs)} timeouts, "
            f"{sum(c['mismatches'] for c in configs)} mismatching elements.")


def other_sources(result: dict) -> list:
    """The records of ``result`` (the bench run, each training record) that name other sources
    than the tree's, each as a line saying which and what they name."""
    tree = source_version()["sources_sha256"]
    named = [("the bench run", result["meta"]["source"]["sources_sha256"])]
    named += [(f"training record {i + 1} ({record.get('command', '?')})",
               record["source"]["sources_sha256"])
              for i, record in enumerate(result.get("training") or [])]
    if result.get("stress"):
        named.append((f"the stress record ({result['stress'].get('command', '?')})",
                      result["stress"]["source"]["sources_sha256"]))
    return [f"{what} names sources {sources}, the tree's are {tree}"
            for what, sources in named if sources != tree]


def section(readme: str) -> tuple:
    """(before, current section, after) of the README text, split at the markers."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no numbers section between {BEGIN!r} and {END!r}")
    start += len(BEGIN)
    return readme[:start], readme[start:end], readme[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", metavar="RESULTS_JSON",
                        help="a bench run's results file to commit (its results.png beside it "
                             "comes too)")
    parser.add_argument("--training", metavar="JSON", nargs="+",
                        help="examples/check_training.py --json records, in this order")
    parser.add_argument("--stress", metavar="JSON",
                        help="tests/gpu/stress_teams.py --json's record")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if RESULTS.md or the README's section differs from "
                             "results.json, writing nothing")
    options = parser.parse_args(argv)
    given = options.bench or options.training or options.stress
    if options.check and given:
        parser.error("--check writes nothing: it takes no --bench, --training or --stress")
    with open(options.bench or RESULTS) as f:
        result = json.load(f)
    if options.bench:  # a new run keeps the committed run's records
        with open(RESULTS) as f:
            committed = json.load(f)
        result["training"] = committed.get("training", [])
        result["stress"] = committed.get("stress")
    if options.training:
        result["training"] = []
        for path in options.training:
            with open(path) as f:
                result["training"].append(json.load(f))
    if options.stress:
        with open(options.stress) as f:
            result["stress"] = json.load(f)
    wanted = "\n" + numbers(result) + "\n"
    with open(README) as f:
        before, current, after = section(f.read())
    with open(RESULTS_MD) as f:
        current_md = f.read()
    if options.check:
        stale = [name for name, ok in (("RESULTS.md", current_md == markdown.render(result)),
                                       ("README.md's numbers", current == wanted)) if not ok]
        if stale:
            print(f"{' and '.join(stale)} differ from benchmarks/results.json: run "
                  "python -m benchmarks.readme", file=sys.stderr)
        others = other_sources(result)
        if others:
            print("benchmarks/results.json is not the tree's run: " + "; ".join(others) +
                  ". Run the bench and the training checks on a GPU (docs/gpu_tests.md), then "
                  "python -m benchmarks.readme --bench OUT/results.json --training "
                  "OUT/training.json --stress OUT/stress.json", file=sys.stderr)
        return 1 if stale or others else 0
    if given:
        with open(RESULTS, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    if options.bench:
        plot = os.path.join(os.path.dirname(os.path.abspath(options.bench)), "results.png")
        if os.path.exists(plot) and os.path.abspath(plot) != PLOT:
            shutil.copyfile(plot, PLOT)
    markdown.write(result, RESULTS_MD)
    with open(README, "w") as f:
        f.write(before + wanted + after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
