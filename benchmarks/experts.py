"""The experts section (``--sections experts``; one GPU, EP=1): what a dropless budget costs the
experts, and a MoE layer's step against Megatron's ``alltoall``.

The shape is examples/check_training.py's GRAPH_MODEL MoE layer (SHAPE: hidden 1024, ffn 1024,
32 experts, top-4 of --tokens tokens, bf16), whatever --hidden / --experts / --topk say: the
bench's default 7168 x 256 experts would not fit one GPU's memory as expert weights.

* ``grouped f<F>`` / ``sequential f<F>``: the experts' forward and backward on the rows of a
  capacity budget of F x the balanced share (F in FACTORS), the same routed rows (tokens x top-k
  of a random routing) every time. nccl_ep's GroupedExperts gets capacity mode's packed layout
  (F x tokens x top-k rows, device counts of the rows used): its GEMMs compute the routed rows
  only, its elementwise activation and probs every row. SequentialMLP gets the fixed layout
  (every expert F x its share of rows, a host count), all of which it computes.
* ``layer ...``: Megatron's MoELayer (router, dispatcher, experts) forward and backward, eager
  and as a replayed CUDA graph of both: nccl_ep in capacity mode (factor 1.25) with the grouped
  experts, nccl_ep in exact mode with them (eager only: exact mode reads a count on the host),
  and Megatron's alltoall with drop-and-pad (capacity factor 1.0, SequentialMLP) as the baseline.

Each item's ``extra`` holds the peak of allocated memory above what was allocated before it (MiB).
"""

from __future__ import annotations

import math

from .runner import Rank, kernel_mode

SHAPE = {"hidden": 1024, "ffn": 1024, "experts": 32, "topk": 4}
FACTORS = (1, 2, 4, 8)


def _config(me: Rank, grouped: bool, **fields):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=SHAPE["hidden"], ffn_hidden_size=SHAPE["ffn"],
        num_attention_heads=16, num_moe_experts=SHAPE["experts"], moe_router_topk=SHAPE["topk"],
        bf16=True, params_dtype=torch.bfloat16, moe_permute_fusion=False, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, moe_grouped_gemm=grouped,
        moe_router_load_balancing_type="none", use_cpu_initialization=True, **fields)


def _experts(me: Rank, grouped: bool):
    import torch
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    spec = get_moe_module_spec(use_te=False, num_experts=SHAPE["experts"],
                               moe_grouped_gemm=grouped)
    torch.manual_seed(0)
    return spec.keywords["submodules"].experts(
        SHAPE["experts"], _config(me, grouped),
        pg_collection=get_default_pg_collection()).to(me.device)


def _peak_mib(me: Rank, fn) -> float:
    """Runs ``fn()`` once; the peak of allocated memory above what was allocated before, MiB."""
    torch = me.torch
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(0)
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)


def _expert_items(me: Rank) -> None:
    """The experts alone at each budget factor, the routed rows fixed."""
    torch = me.torch
    tokens, experts, topk = me.args.tokens, SHAPE["experts"], SHAPE["topk"]
    gen = me.generator(5)
    ids = torch.rand(tokens, experts, generator=gen, device=me.device).argsort(1)[:, :topk]
    counts = torch.bincount(ids.flatten(), minlength=experts)  # device: the packed layout's
    used = tokens * topk
    from megatron_nccl_ep.config import capacity_from_factor

    for grouped in (True, False):
        module = _experts(me, grouped)
        name = "grouped" if grouped else "sequential"
        for factor in FACTORS:
            if grouped:
                rows = capacity_from_factor(factor, tokens, topk, experts, 1)
                tpe = counts
            else:  # the fixed layout at EP 1: every expert a block of C rows
                block = math.ceil(factor * used / experts)
                rows, tpe = block * experts, torch.full((experts,), block, dtype=torch.long)
            x = torch.randn(rows, SHAPE["hidden"], generator=gen, device=me.device).to(
                torch.bfloat16).requires_grad_(True)
            probs = torch.rand(rows, generator=gen, device=me.device).requires_grad_(True)
            grad = torch.randn(rows, SHAPE["hidden"], generator=gen, device=me.device).to(
                torch.bfloat16)

            def step(i, module=module, x=x, probs=probs, tpe=tpe, grad=grad):
                out, _ = module(x, tpe, probs)
                out.backward(grad)

            item = f"{name} f{factor}"
            me.attempt(item, lambda: me.measure(
                item, step, mode=kernel_mode(me.args.device), collective=False,
                setup=lambda i, module=module: module.zero_grad(set_to_none=False),
                extra={"peak_mib": _peak_mib(me, step), "rows": rows, "routed_rows": used}))


def _layer(me: Rank, dispatcher: str, grouped: bool, **fields):
    import weakref

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=False, num_experts=SHAPE["experts"],
                               moe_grouped_gemm=grouped)
    me.torch.manual_seed(0)
    layer = spec.func(config=_config(me, grouped, moe_token_dispatcher_type=dispatcher,
                                     **fields), submodules=spec.keywords["submodules"])
    layer = layer.to(me.device)
    if dispatcher == "nccl_ep":
        layer.token_dispatcher.moe_layer = weakref.ref(layer)
    return layer


def _layer_items(me: Rank) -> None:
    """A MoE layer's step, eager and from a CUDA graph, against alltoall's drop-and-pad."""
    torch = me.torch
    from megatron_nccl_ep.options import NcclEpOptions

    tokens, hidden = me.args.tokens, SHAPE["hidden"]
    configs = {
        "nccl_ep capacity, grouped": ("nccl_ep", True, {}, NcclEpOptions(
            backend=me.args.backend, recv_mode="capacity", capacity_factor=1.25)),
        "nccl_ep exact, grouped": ("nccl_ep", True, {}, NcclEpOptions(
            backend=me.args.backend, recv_mode="exact")),
        "alltoall drop-and-pad 1.0, sequential": ("alltoall", False, {
            "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}, None),
    }
    gen = me.generator(11)
    x = torch.randn(tokens, 1, hidden, generator=gen, device=me.device).to(torch.bfloat16)
    grad = torch.randn(tokens, 1, hidden, generator=gen, device=me.device).to(torch.bfloat16)
    for label, (dispatcher, grouped, fields, options) in configs.items():
        layer = _layer(me, dispatcher, grouped, **fields)
        if options is not None:
            layer.config.nccl_ep_options = options
        xs = x.clone().requires_grad_(True)

        def step(i, layer=layer, xs=xs):
            out, _ = layer(xs)
            out.backward(grad)
            return out

        me.attempt(f"layer {label} (eager)", lambda: me.measure(
            f"layer {label} (eager)", step, mode=kernel_mode(me.args.device), collective=False,
            setup=lambda i, layer=layer: layer.zero_grad(set_to_none=False),
            extra={"peak_mib": _peak_mib(me, step)}))
        if "exact" in label:
            continue

        def graphed(layer=layer, step=step):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step(0)  # eager first: groups and lazy loads outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    step(0)
            torch.cuda.current_stream().wait_stream(stream)
            me.measure(f"layer {label} (graph)", lambda i: graph.replay(),
                       mode=kernel_mode(me.args.device), collective=False,
                       extra={"peak_mib": _peak_mib(me, lambda i: graph.replay())})

        me.attempt(f"layer {label} (graph)", graphed)
    from megatron_nccl_ep.dispatcher import destroy_groups

    destroy_groups()


def section(me: Rank) -> None:
    try:
        import megatron_nccl_ep
        from megatron.core import parallel_state
    except Exception as exc:  # noqa: BLE001
        me.emit("error", "import", error=f"megatron-core does not import: {exc}")
        return
    megatron_nccl_ep.register()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=1)
    _expert_items(me)
    _layer_items(me)
    parallel_state.destroy_model_parallel()
