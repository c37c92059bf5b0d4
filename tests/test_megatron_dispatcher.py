"""NcclEpTokenDispatcher inside Megatron-Core's MoELayer, on gloo with the reference backend.

Parity: the same MoELayer weights and inputs through Megatron's own ``allgather`` dispatcher and
through ``nccl_ep`` give equal outputs and gradients (input, router, experts), in float64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer import TransformerConfig

import dist
import megatron_nccl_ep
from device_local_router import DeviceLocalTopKRouter
from megatron_nccl_ep import options as options_module
from megatron_nccl_ep.dispatcher import NcclEpTokenDispatcher, check_budgets, destroy_groups
from megatron_nccl_ep.errors import NcclEpError
from megatron_nccl_ep.options import NcclEpOptions, set_options

megatron_nccl_ep.register()

HIDDEN, FFN, SEQ, BATCH = 16, 24, 6, 3


@contextlib.contextmanager
def megatron_parallel(ep: int, etp: int = 1, tp: int = 1):
    """Megatron's model-parallel state for this test, torn down afterwards (the pool's processes
    run other tests too), with the process groups it made."""
    before = set(torch.distributed.distributed_c10d._world.pg_map)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    try:
        yield
    finally:
        destroy_groups()
        parallel_state.destroy_model_parallel()
        # Megatron drops its groups but c10d keeps them, each gloo one with its own network
        # threads: hundreds of them per pool process by the end of the suite. In creation order,
        # the same on every rank: an NCCL group's destroy may wait for its peers (a set's order
        # differs across processes, and two ranks destroying different groups wait forever).
        for group in list(torch.distributed.distributed_c10d._world.pg_map):
            if group not in before:
                torch.distributed.destroy_process_group(group)


@contextlib.contextmanager
def megatron_on_cpu(ep: int, etp: int = 1, tp: int = 1):
    """``megatron_parallel`` on CPU. Megatron-Core 0.19.2's allgather dispatcher allocates its
    gather outputs on ``torch.cuda.current_device()``: the baseline needs that pointed at the
    CPU."""
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with megatron_parallel(ep, etp=etp, tp=tp):
            yield
    finally:
        torch.cuda.current_device = current_device


@contextlib.contextmanager
def cuda_streams_on_cpu():
    """Megatron's overlaps (the shared expert's stream, the 1F1B schedule's communication stream
    and events) take torch.cuda streams; on CPU every stream is the one CPU stream, so what runs
    is the order of the calls (and Megatron's shared-expert state machine checks that order).
    The schedule also records tensors on streams and makes one torch.zeros(device="cuda")."""
    from megatron.core.pipeline_parallel import utils as schedule_utils
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    class Event:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, stream=None):
            pass

        def wait(self, stream=None):
            pass

        def synchronize(self):
            pass

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

        def record_event(self, event=None):
            return event or Event()

        def synchronize(self):
            pass

        @staticmethod
        def priority_range():
            return 0, -1

    zeros = torch.zeros

    def zeros_on_cpu(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return zeros(*args, **kwargs)

    current = Stream()
    saved = (torch.cuda.Stream, torch.cuda.Event, torch.cuda.stream, torch.cuda.current_stream,
             torch.Tensor.record_stream)
    torch.cuda.Stream, torch.cuda.Event = Stream, Event
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: current
    torch.Tensor.record_stream = lambda self, stream: None
    torch.zeros = zeros_on_cpu
    SharedExpertMLP.stream = None
    try:
        yield
    finally:
        (torch.cuda.Stream, torch.cuda.Event, torch.cuda.stream, torch.cuda.current_stream,
         torch.Tensor.record_stream) = saved
        torch.zeros = zeros
        SharedExpertMLP.stream = None
        schedule_utils._COMM_STREAM = None  # made once per process from torch.cuda.Stream


def moe_layer(dispatcher_type: str, num_experts: int, topk: int,
              params_dtype: torch.dtype = torch.float64, grouped: bool = False,
              **config_fields):
    """Megatron's MoELayer of its local spec (``grouped``: ``--moe-grouped-gemm``, nccl_ep's
    GroupedExperts once registered; else SequentialMLP)."""
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
        num_moe_experts=num_experts, moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher_type, use_cpu_initialization=True,
        add_bias_linear=False, params_dtype=params_dtype, hidden_dropout=0.0,
        attention_dropout=0.0, moe_grouped_gemm=grouped, **config_fields)
    spec = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=grouped)
    submodules = dataclasses.replace(spec.keywords["submodules"], router=DeviceLocalTopKRouter)
    return spec.func(config=config, submodules=submodules)


def run_layer(layer, x, grad_out):
    x = x.clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    out.backward(grad_out)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    return out.detach(), x.grad, grads


TIMEOUT_S = 37.0  # not the default: parity_case checks that it reaches the layer's group


def parity_case(num_experts: int, topk: int, seed: int, recv_mode: str = "exact", tp: int = 1,
                ep: int = 0, etp: int = 1, quantization_padding: bool = False,
                shared_expert_overlap: bool = False, ranks_per_node: int = 0,
                grouped: bool = False, **config_fields):
    """``grouped``: ours with GroupedExperts (the baseline keeps SequentialMLP: the same weights
    and checkpoints), which capacity mode hands the packed layout and device counts."""
    rank = torch.distributed.get_rank()
    ep = ep or torch.distributed.get_world_size()
    if tp > 1:
        config_fields.update(tensor_model_parallel_size=tp, sequence_parallel=True)
    if etp > 1:
        config_fields.update(expert_tensor_parallel_size=etp)
    streams = cuda_streams_on_cpu() if shared_expert_overlap else contextlib.nullcontext()
    with megatron_on_cpu(ep, etp=etp, tp=tp), streams:
        torch.manual_seed(seed)  # same weights on every rank and in both layers
        baseline = moe_layer("allgather", num_experts, topk, **config_fields)
        ours = moe_layer("nccl_ep", num_experts, topk, grouped=grouped, **config_fields,
                         **({"moe_shared_expert_overlap": True} if shared_expert_overlap else {}))
        ours.token_dispatcher.moe_layer = weakref.ref(ours)  # as register()'s branch sets it
        # (The packed budget above factor EP holds any routing, with rows to spare: a rank
        # receives at most every rank's tokens x top-k.)
        ours.config.nccl_ep_options = NcclEpOptions(backend="torch", recv_mode=recv_mode,
                                                    ranks_per_node=ranks_per_node,
                                                    timeout_s=TIMEOUT_S,
                                                    capacity_factor=ep + 0.5 if grouped else 2.0)
        ours.load_state_dict(baseline.state_dict())
        assert isinstance(ours.token_dispatcher, NcclEpTokenDispatcher)
        counts = []
        postprocess = ours.token_dispatcher.dispatch_postprocess
        if grouped:
            def record_layout(*args):
                rows, tokens_per_expert, probs = postprocess(*args)
                counts.append((rows.shape[0], tokens_per_expert.clone()))
                return rows, tokens_per_expert, probs

            ours.token_dispatcher.dispatch_postprocess = record_layout
        if quantization_padding:
            # FP8 training's padding flag, set after construction: TransformerConfig refuses
            # fp8 without transformer-engine, and the local experts here never quantize.
            ours.config.fp8, ours.config.moe_router_padding_for_quantization = "hybrid", True
            postprocess = ours.token_dispatcher.dispatch_postprocess

            def record_counts(*args):
                rows, tokens_per_expert, probs = postprocess(*args)
                counts.append((rows.shape[0], tokens_per_expert.tolist()))
                return rows, tokens_per_expert, probs

            ours.token_dispatcher.dispatch_postprocess = record_counts
        assert (ours.attn_tp_group.size(), ours.token_dispatcher.ep_size) == (tp, ep)

        torch.manual_seed(seed + rank + 1)  # each rank has its own tokens
        x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
        grad_out = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
        want_out, want_dx, want_grads = run_layer(baseline, x, grad_out)
        got_out, got_dx, got_grads = run_layer(ours, x, grad_out)

        torch.testing.assert_close(got_out, want_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_dx, want_dx, rtol=0, atol=1e-12)
        assert got_grads.keys() == want_grads.keys() and "router.weight" in got_grads
        # Not vacuous: the router and some local expert of this rank took part in the baseline.
        # (A random routing of these few tokens may leave an expert without any: its zero
        # gradient is compared like the others.)
        exercised = {name for name, g in want_grads.items() if g.abs().sum() > 0}
        assert "router.weight" in exercised and any("local_experts" in n for n in exercised), (
            f"the baseline's gradients are zero except for {sorted(exercised)}")
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=1e-12,
                                       msg=lambda m: f"{name}: {m}")

        from megatron_nccl_ep.dispatcher_common import GROUPS

        # The options reached the group the layer used.
        assert {(g.config.ranks_per_node, g.config.timeout_s)
                for g in GROUPS.cached("ht")} == {(ranks_per_node, TIMEOUT_S)}
        if grouped:  # the packed layout: the budget's rows, the counts of the rows used
            dispatcher = ours.token_dispatcher
            budget_rows = dispatcher.recv_rows(SEQ * BATCH // tp)
            for rows, tokens_per_expert in counts:
                if recv_mode == "capacity":
                    assert rows == budget_rows > int(tokens_per_expert.sum()), (rows, budget_rows)
                    assert dispatcher.check_over_budget() is not None
                else:
                    assert rows == int(tokens_per_expert.sum())
            assert counts
        else:
            for rows, tokens_per_expert in counts:  # FP8 alignment: 16 rows per expert block
                assert all(n % 16 == 0 for n in tokens_per_expert), tokens_per_expert
                assert sum(tokens_per_expert) == rows, (rows, tokens_per_expert)
            assert bool(counts) == quantization_padding

        # Rerun: bitwise the same.
        again_out, again_dx, again_grads = run_layer(ours, x, grad_out)
        assert torch.equal(again_out, got_out) and torch.equal(again_dx, got_dx)
        assert all(torch.equal(again_grads[n], got_grads[n]) for n in got_grads)
    return True


@pytest.mark.parametrize("ep,num_experts,topk", [(1, 4, 2), (2, 4, 2), (2, 8, 3), (4, 8, 2)])
def test_parity_with_allgather(ep, num_experts, topk, seed):
    assert all(dist.run(ep, parity_case, num_experts, topk, seed))


@pytest.mark.parametrize("ep", [2, 4])
def test_parity_with_tensor_and_sequence_parallel(ep, seed):
    # TP=2 with sequence parallelism: each rank holds its own slice of the sequence.
    assert all(dist.run(4, parity_case, 8, 2, seed, tp=2, ep=ep))


@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
@pytest.mark.parametrize("ep,num_experts,topk", [(1, 4, 2), (2, 8, 3), (4, 8, 2)])
def test_parity_with_grouped_experts(ep, num_experts, topk, recv_mode, seed):
    # GroupedExperts (float64: a matmul per expert) against allgather + SequentialMLP; capacity
    # mode hands them the packed layout: the budget's rows, device counts of the rows used.
    assert all(dist.run(ep, parity_case, num_experts, topk, seed, recv_mode=recv_mode,
                        grouped=True))


@pytest.mark.parametrize("num_experts", [2, 4])
def test_parity_capacity_mode(num_experts, seed):
    # The fixed layout: every local expert a block of R runs of its static budget (zero rows,
    # prob 0, past each run's tokens), the counts a host constant SequentialMLP splits by.
    assert all(dist.run(2, parity_case, num_experts, 2, seed, recv_mode="capacity"))


def test_parity_with_dropped_tokens(seed):
    # Megatron's capacity dropping leaves some tokens with fewer than top-k experts (-1 slots).
    assert all(dist.run(2, parity_case, 4, 2, seed, moe_expert_capacity_factor=0.5,
                        moe_router_load_balancing_type="aux_loss"))


@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
def test_parity_with_quantization_padding(recv_mode, seed):
    # moe_router_padding_for_quantization: each local expert's rows padded to FP8's 16 by the
    # layout (zero rows, prob 0, never combined); outputs and gradients as without padding.
    assert all(dist.run(2, parity_case, 4, 2, seed, recv_mode=recv_mode,
                        quantization_padding=True))


@pytest.mark.parametrize("ep,tp", [(2, 1), (2, 2)])
def test_parity_with_shared_expert_overlap(ep, tp, seed):
    # The baseline computes its shared expert in MoELayer (allgather has no overlap); ours runs it
    # in the pieces the dispatcher schedules around dispatch and combine: the same sums.
    assert all(dist.run(ep * tp, parity_case, 4, 2, seed, ep=ep, tp=tp,
                        shared_expert_overlap=True, moe_shared_expert_intermediate_size=FFN))


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_parity_with_nodes(ranks_per_node, seed):
    # Emulated nodes (the combine sums node by node): the same outputs and gradients.
    assert all(dist.run(4, parity_case, 8, 2, seed, ranks_per_node=ranks_per_node))


def handle_lifetime_case(seed: int):
    with megatron_on_cpu(torch.distributed.get_world_size()):
        torch.manual_seed(seed)
        layer = moe_layer("nccl_ep", 4, 2)
        layer.config.nccl_ep_options = NcclEpOptions(backend="torch")
        dispatcher = layer.token_dispatcher
        handles = []

        def token_combine(original, hidden_states):
            handles.append(weakref.ref(dispatcher._handle))
            return original(hidden_states)

        dispatcher.token_combine = functools.partial(token_combine, dispatcher.token_combine)
        x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, requires_grad=True)
        for _ in range(3):
            out, _ = layer(x)
            assert dispatcher._handle is None, "the dispatcher kept the handle after combine"
            assert handles[-1]() is not None, "the autograd graph must keep the handle"
            out.sum().backward()
            del out
            assert handles[-1]() is None, "the handle outlived its autograd graph"
    return len(handles)


def test_handle_lives_as_long_as_the_graph(seed):
    assert dist.run(2, handle_lifetime_case, seed) == [3, 3]


@pytest.mark.parametrize("ep,etp,tp", [(1, 2, 1), (2, 2, 1), (2, 2, 2)])
def test_parity_with_expert_tensor_parallel(ep, etp, tp, seed):
    # TP x EP folded into one group: each expert's two weight shards receive the same tokens,
    # combine sums their partial outputs (world: ep * etp ranks).
    assert all(dist.run(ep * etp, parity_case, 4, 2, seed, ep=ep, etp=etp, tp=tp))


@pytest.mark.parametrize("field,value", [("backend", "nccl"), ("recv_mode", "dropless"),
                                         ("capacity_factor", 0.0), ("num_sms", 0),
                                         ("max_tokens_per_rank", 0), ("ranks_per_node", -1),
                                         ("timeout_s", 0.0), ("capacity_overflow", "drop")])
def test_options_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        NcclEpOptions(**{field: value})


def preprocess_case(seed: int) -> bool:
    """The dispatcher makes its handle straight from Megatron's dense routing map: each token's
    routed experts fill its slots in ascending order (fewer than top-k here: a dropping router),
    the router's dense probs go to dispatch as they are (each row gets its expert's column), and
    the dense probs get exactly the gradients of their rows."""
    tokens, experts, topk = 40, 10, 4
    with megatron_on_cpu(1):
        torch.manual_seed(seed)
        layer = moe_layer("nccl_ep", experts, topk)
        layer.config.nccl_ep_options = NcclEpOptions(backend="torch")
        dispatcher = layer.token_dispatcher
        scores = torch.rand(tokens, experts, dtype=torch.float64)
        counts = torch.randint(0, topk + 1, (tokens,))
        routing_map = scores.argsort(dim=1, descending=True).argsort(dim=1) < counts[:, None]
        probs = (scores * routing_map).requires_grad_()
        hidden = torch.randn(tokens, 1, HIDDEN, dtype=torch.float64)
        h, dense_probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
        assert dense_probs.shape == (tokens, experts) and torch.equal(dense_probs, probs)
        dispatched = dispatcher.token_dispatch(h, dense_probs)
        topk_idx = dispatcher._handle.topk_idx
        for t in range(tokens):
            experts_t = routing_map[t].nonzero().flatten().tolist()
            assert topk_idx[t].tolist() == experts_t + [-1] * (topk - len(experts_t))
        rows, _, row_probs = dispatcher.dispatch_postprocess(*dispatched)
        weights = torch.randn(rows.shape[0], dtype=torch.float64)
        (row_probs * weights).sum().backward()
        # One rank: rows are expert-major, tokens in order within an expert.
        want = torch.zeros(tokens, experts, dtype=torch.float64)
        row = 0
        for e in range(experts):
            for t in range(tokens):
                if routing_map[t, e]:
                    assert row_probs[row].item() == probs[t, e].item(), (t, e)
                    want[t, e] = weights[row]
                    row += 1
        assert row == rows.shape[0]
        assert torch.equal(probs.grad, want)
    return True


def test_preprocess_routes_from_the_dense_map(seed):
    assert all(dist.run(1, preprocess_case, seed))


def build_graphed_layer(impl: str, modules, recv_mode: str = "exact", **fields) -> bool:
    with megatron_on_cpu(1):
        set_options(NcclEpOptions(backend="torch", recv_mode=recv_mode))
        try:
            moe_layer("nccl_ep", 4, 2, cuda_graph_impl=impl, cuda_graph_modules=modules, **fields)
        finally:
            options_module._options = None
    return True


@pytest.mark.parametrize("impl,modules", [("local", ["moe_router"]),
                                          ("local", ["moe_router", "moe_preprocess"]),
                                          ("transformer_engine",
                                           ["attn", "moe_router", "moe_preprocess"])])
def test_cuda_graph_scopes_up_to_preprocess_are_accepted(impl, modules):
    assert all(dist.run(1, build_graphed_layer, impl, modules))


DROP_AND_PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
WHOLE_LAYER_GRAPHS = [("local", []), ("transformer_engine", []), ("full_iteration", [])]


@pytest.mark.parametrize("impl,modules", WHOLE_LAYER_GRAPHS + [("local", ["moe"]),
                                                               ("local", ["attn", "moe"])])
def test_graphs_of_whole_moe_layers_are_accepted_with_drop_and_pad(impl, modules):
    assert all(dist.run(1, build_graphed_layer, impl, modules, **DROP_AND_PAD))


@pytest.mark.parametrize("impl,modules", WHOLE_LAYER_GRAPHS)
def test_graphs_of_whole_moe_layers_are_accepted_in_capacity_mode(impl, modules):
    # (Megatron itself refuses the moe module without drop-and-pad.)
    assert all(dist.run(1, build_graphed_layer, impl, modules, "capacity"))


@pytest.mark.parametrize("impl,modules", WHOLE_LAYER_GRAPHS)
def test_graphs_of_whole_moe_layers_are_refused_in_exact_mode(impl, modules):
    with pytest.raises(Exception, match=(
            f"cuda_graph_impl='{impl}' with cuda_graph_modules=\\[\\] captures token_dispatch, and "
            "the exact receive mode reads each layer's receive count on the host.*"
            "--moe-pad-expert-input-to-capacity.*--nccl-ep-recv-mode capacity.*"
            "capture only attn, moe_router and moe_preprocess")):
        dist.run(1, build_graphed_layer, impl, modules)


def over_budget_case(factor: float, seed: int, grouped: bool = False) -> str:
    """Capacity mode at EP 2: rank 0 routes every token to experts 0 and 1 (more than its budget
    of tokens x top-k / experts x factor for each; ``grouped``: the packed layout, rank 0 then
    receives more than tokens x top-k x factor rows), rank 1 spreads its tokens. check_budgets()
    raises on both ranks naming the layer, the rows needed and the factor that holds them; the
    counts reset, so a check after a step within the budget passes."""
    rank = torch.distributed.get_rank()
    tokens = SEQ * BATCH
    with megatron_on_cpu(2):
        torch.manual_seed(seed)
        layer = moe_layer("nccl_ep", 4, 2, grouped=grouped)
        layer.layer_number = 3
        dispatcher = layer.token_dispatcher
        dispatcher.moe_layer = weakref.ref(layer)
        layer.config.nccl_ep_options = NcclEpOptions(backend="torch", recv_mode="capacity",
                                                     capacity_factor=factor)
        hidden = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)

        def step(skewed: bool) -> None:
            routing_map = torch.zeros(tokens, 4, dtype=torch.bool)
            if skewed:
                routing_map[:, :2] = True  # every token to experts 0 and 1
            else:
                routing_map[torch.arange(tokens), torch.arange(tokens) % 4] = True
                routing_map[torch.arange(tokens), (torch.arange(tokens) + 2) % 4] = True
            probs = routing_map.double() / 2
            h, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
            rows, counts, _ = dispatcher.dispatch_postprocess(*dispatcher.token_dispatch(h, p))
            if grouped:  # the packed layout: the budget's rows, counts of every block whole
                assert rows.shape[0] == dispatcher.recv_rows(tokens)
            else:
                assert counts.device.type == "cpu" and rows.shape[0] == int(counts.sum())
            dispatcher.combine_postprocess(dispatcher.token_combine(
                dispatcher.combine_preprocess(rows)))

        from megatron.core.transformer import cuda_graphs

        # Megatron's local graphs flag their warm-ups; Transformer Engine's run eagerly under
        # Megatron's capture flag: both on made-up inputs, which no step's routing is.
        for flag in ("_IS_GRAPH_WARMUP", "_IS_GRAPH_CAPTURING"):
            setattr(cuda_graphs, flag, True)
            try:
                step(skewed=True)
            finally:
                setattr(cuda_graphs, flag, False)
        check_budgets()  # nothing counted
        step(skewed=rank == 0)
        assert bool(dispatcher.check_over_budget()) == (rank == 0), (rank, dispatcher._needed, dispatcher._budget)
        try:
            check_budgets()
        except NcclEpError as e:
            message = str(e)
        else:
            raise AssertionError("check_budgets() did not raise")
        step(skewed=False)
        check_budgets()  # within the budget: nothing to raise
        destroy_groups()
    return message


def test_capacity_budget_overflow_raises_on_every_rank_naming_the_layer(seed):
    # 4 experts, top-2: the budget is ceil(tokens x 2 / 4 x 1.0) = tokens / 2 rows per expert,
    # and rank 0 sends all its tokens to expert 0.
    tokens = SEQ * BATCH
    messages = dist.run(2, over_budget_case, 1.0, seed)
    assert messages[0] == messages[1], messages
    assert (f"MoE layer 3 needed {tokens} rows for one expert from one rank, over its static "
            f"budget of {tokens // 2} rows (--nccl-ep-capacity-factor 1 x {tokens} tokens x "
            "top-2 / 4 experts)") in messages[0], messages[0]
    assert "Raise --nccl-ep-capacity-factor to at least 2 " in messages[0], messages[0]


def test_packed_budget_overflow_raises_on_every_rank_naming_the_layer(seed):
    # The packed layout (grouped experts): rank 0 receives its own tokens x 2 rows and half of
    # rank 1's, 1.5 x its budget of tokens x 2 rows (factor 1); the rows past it were dropped.
    tokens = SEQ * BATCH
    messages = dist.run(2, over_budget_case, 1.0, seed, True)
    assert messages[0] == messages[1], messages
    assert (f"MoE layer 3 needed {3 * tokens} rows on one rank, over its static budget of "
            f"{2 * tokens} rows (--nccl-ep-capacity-factor 1 x {tokens} tokens x top-2)"
            ) in messages[0], messages[0]
    assert "Raise --nccl-ep-capacity-factor to at least 1.5 " in messages[0], messages[0]


def local_preprocess_case(seed: int) -> bool:
    """dispatch_preprocess communicates with no one (what a moe_preprocess CUDA graph needs):
    with every collective made to fail, it still runs, makes no handle, and leaves the routing
    map in its cudagraph_attrs; token_dispatch then makes the handle."""
    with megatron_on_cpu(torch.distributed.get_world_size()):
        torch.manual_seed(seed)
        layer = moe_layer("nccl_ep", 4, 2)
        layer.config.nccl_ep_options = NcclEpOptions(backend="torch")
        dispatcher = layer.token_dispatcher
        routing_map = torch.zeros(SEQ * BATCH, 4, dtype=torch.bool)
        routing_map[:, :2] = True
        probs = routing_map.double() / 2
        hidden = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
        names = ("all_gather", "all_gather_object", "all_to_all_single", "all_reduce",
                 "broadcast", "broadcast_object_list", "barrier")
        saved = {name: getattr(torch.distributed, name) for name in names}

        def no_collective(*args, **kwargs):
            raise AssertionError("dispatch_preprocess communicated")

        try:
            for name in names:
                setattr(torch.distributed, name, no_collective)
            h, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
        finally:
            for name, fn in saved.items():
                setattr(torch.distributed, name, fn)
        assert dispatcher._handle is None
        assert dispatcher.cudagraph_attrs == ["routing_map"]
        assert torch.equal(dispatcher.routing_map, routing_map)
        rows, _ = dispatcher.token_dispatch(h, p)
        assert dispatcher._handle is not None and dispatcher.routing_map is None
        assert rows.shape[1] == HIDDEN
    return True


def test_dispatch_preprocess_is_local(seed):
    assert all(dist.run(2, local_preprocess_case, seed))


def inference_optimized_case() -> bool:
    # Such layers keep the training dispatcher aside and swap it in at each training forward.
    with megatron_on_cpu(torch.distributed.get_world_size()):
        layer = moe_layer("nccl_ep", 4, 2, transformer_impl="inference_optimized",
                          inference_grouped_gemm_backend="torch", moe_router_dtype="fp32",
                          normalization="RMSNorm")
        assert isinstance(layer.token_dispatcher, NcclEpTokenDispatcher)
        assert layer._training_token_dispatcher is layer.token_dispatcher
    return True


def test_inference_optimized_layers_train_with_nccl_ep():
    assert all(dist.run(2, inference_optimized_case))


def construction_case() -> bool:
    """An nccl_ep MoELayer is built by the branch register() adds to Megatron's dispatcher
    choice: the shared config is never written and no other dispatcher is built on the way."""
    from megatron.core.transformer.moe import moe_layer as megatron_moe_layer

    writes, built = [], []
    original_setattr = TransformerConfig.__setattr__
    original_allgather = megatron_moe_layer.MoEAllGatherTokenDispatcher.__init__

    def record_write(self, name, value):
        # A write to a built config (its dataclass __init__ sets each field once, first).
        if name == "moe_token_dispatcher_type" and name in vars(self):
            writes.append(value)
        original_setattr(self, name, value)

    def record_build(self, *args, **kwargs):
        built.append(type(self).__name__)
        original_allgather(self, *args, **kwargs)

    with megatron_on_cpu(torch.distributed.get_world_size()):
        TransformerConfig.__setattr__ = record_write
        megatron_moe_layer.MoEAllGatherTokenDispatcher.__init__ = record_build
        try:
            layer = moe_layer("nccl_ep", 4, 2)
            baseline = moe_layer("allgather", 4, 2)  # the recorder itself works
        finally:
            TransformerConfig.__setattr__ = original_setattr
            megatron_moe_layer.MoEAllGatherTokenDispatcher.__init__ = original_allgather
    assert isinstance(layer.token_dispatcher, NcclEpTokenDispatcher)
    assert layer.config.moe_token_dispatcher_type == "nccl_ep"
    assert writes == [], writes
    assert built == ["MoEAllGatherTokenDispatcher"], built  # the baseline's, not ours
    assert type(baseline.token_dispatcher).__name__ == "MoEAllGatherTokenDispatcher"
    return True


def test_nccl_ep_layer_is_built_without_touching_the_config():
    assert all(dist.run(2, construction_case))


class _Chunk(torch.nn.Module):
    """A model chunk as Megatron's training loop holds it (zero_grad_buffer), around one layer."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def zero_grad_buffer(self):
        self.layer.zero_grad(set_to_none=True)


class _GraphWrapper:
    """Stands in for Megatron's FullCudaGraphWrapper: the schedule behind it, and the reset
    that drops its graph."""

    def __init__(self, forward_backward_func):
        self.forward_backward_func = forward_backward_func
        self.calls, self.resets = 0, []

    def __call__(self, **kwargs):
        self.calls += 1
        return self.forward_backward_func(**kwargs)

    def reset_cuda_graph(self, stage=None):
        self.resets.append(stage)


def _schedule(*, data_iterator, model, num_microbatches, **_):
    """Megatron's forward_backward_func, reduced: each micro-batch forward and backward."""
    losses = []
    for _ in range(num_microbatches):
        batch = next(data_iterator)
        out, _ = model[0].layer(batch["x"])
        loss = (out * batch["w"]).sum()
        loss.backward()
        losses.append(loss.detach())
    return losses


def redo_case(seed: int) -> tuple:
    """Capacity mode at EP 2, the packed layout at a budget (factor 0.5) every rank overflows:
    the step run through RedoOverflowedSteps is redone in exact mode (its losses and gradients
    bitwise those of the same step run in exact mode), the graph wrapper reset, the budget grown
    (one log line, on rank 0); the same step then fits and runs in capacity mode, with the same
    bits again."""
    import io
    from contextlib import redirect_stdout

    from megatron_nccl_ep import dispatcher as dispatcher_module
    from megatron_nccl_ep.dispatcher_common import GROUPS
    from megatron_nccl_ep.overflow import RedoOverflowedSteps

    rank = torch.distributed.get_rank()
    with megatron_on_cpu(2):
        layers = {}
        for mode in ("capacity", "exact"):
            torch.manual_seed(seed)
            layer = moe_layer("nccl_ep", 4, 2, grouped=True)
            layer.layer_number = 2
            layer.token_dispatcher.moe_layer = weakref.ref(layer)
            layer.config.nccl_ep_options = NcclEpOptions(backend="torch", recv_mode=mode,
                                                         capacity_factor=0.5)
            layers[mode] = [_Chunk(layer)]
        gen = torch.Generator().manual_seed(seed + 10 * rank)
        batches = [{"x": torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64),
                    "w": torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)}
                   for _ in range(2)]

        class Optimizer:
            zeroed = 0

            def zero_grad(self):
                Optimizer.zeroed += 1

        def step(model, fbf):
            losses = fbf(forward_step_func=None, data_iterator=iter(batches), model=model,
                         num_microbatches=len(batches), seq_length=SEQ, forward_only=False)
            grads = {n: p.grad.clone() for n, p in model[0].named_parameters()}
            model[0].zero_grad_buffer()
            return [float(l) for l in losses], grads

        want = step(layers["exact"], _schedule)
        wrapper = _GraphWrapper(_schedule)
        out = io.StringIO()
        with redirect_stdout(out):
            got = step(layers["capacity"],
                       RedoOverflowedSteps(wrapper, layers["capacity"], Optimizer(), 6))
        dispatcher = layers["capacity"][0].layer.token_dispatcher
        assert wrapper.calls == 1 and wrapper.resets == ["training"] and Optimizer.zeroed == 1
        assert got[0] == want[0] and all(torch.equal(got[1][n], want[1][n]) for n in want[1]), (
            "the redone step differs from exact mode")
        grown = dispatcher._route(torch.zeros(SEQ * BATCH, HIDDEN, dtype=torch.float64))[1]
        assert grown.rows > dispatcher.recv_rows(SEQ * BATCH)
        again = io.StringIO()
        with redirect_stdout(again):
            replay = step(layers["capacity"], RedoOverflowedSteps(
                _GraphWrapper(_schedule), layers["capacity"], Optimizer(), 7))
        assert replay[0] == want[0] and all(torch.equal(replay[1][n], want[1][n])
                                            for n in want[1])
        assert Optimizer.zeroed == 1 and not again.getvalue(), again.getvalue()
        group = dispatcher._route(torch.zeros(SEQ * BATCH, HIDDEN, dtype=torch.float64))[2]
        assert group.config.recv_mode == "capacity" and \
            group.config.max_recv_tokens_per_rank == grown.rows
        assert not [g for g in GROUPS.cached("ht")
                    if g.config.recv_mode == "exact"], "the redo's exact groups were kept"
        destroy_groups()
        dispatcher_module._grown.clear()
    return rank, out.getvalue(), grown.rows


def test_overflowed_step_redone_in_exact_mode_and_budget_grown(seed):
    (_, log0, rows), (_, log1, _) = dist.run(2, redo_case, seed)
    assert log1 == "", log1
    assert log0.startswith("nccl_ep capacity overflow in iteration 7: layer 2 needed "), log0
    assert (f"(rows per rank; budget {SEQ * BATCH}); budget now {rows} rows per rank "
            f"(--nccl-ep-capacity-factor ") in log0, log0
    assert log0.rstrip().endswith("the step was redone in exact mode (no token dropped)"), log0
    assert log0.count("\n") == 1, log0
