"""The megatron section: Megatron-Core token dispatchers driven as ``MoELayer`` drives them.

Per dispatcher (``NcclEpTokenDispatcher`` as ``nccl_ep``, Megatron's own ``alltoall`` and
``allgather``), end to end from lined-up hosts (runner: ``e2e`` on GPUs, ``host wall`` on cpu):
dispatch = ``dispatch_preprocess`` + ``token_dispatch`` + ``dispatch_postprocess``; combine =
``combine_preprocess`` + ``token_combine`` + ``combine_postprocess``; fwd_bwd = dispatch ->
stand-in expert (rows x probs) -> combine -> backward; expert_fwd_bwd = that stand-in expert's own
forward and backward on the dispatched rows (torch's work, the same whichever dispatcher moved
the rows: fwd_bwd minus expert_fwd_bwd is the dispatcher's share).
"""

from __future__ import annotations

from .runner import Rank, e2e_mode


def _moe_config(me: Rank, **fields):
    """The run's MoE layer as a TransformerConfig (``fields``: the dispatcher's settings), and
    this rank's local expert count and indices."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = me.args
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=1,
        ffn_hidden_size=args.hidden, num_moe_experts=args.experts, moe_router_topk=args.topk,
        expert_model_parallel_size=me.world,
        bf16=me.dtype == torch.bfloat16, fp16=me.dtype == torch.float16, params_dtype=me.dtype,
        # Fused permutes need transformer-engine: without it, Megatron's unfused permutes.
        moe_permute_fusion=False, add_bias_linear=False, use_cpu_initialization=not me.cuda,
        **fields)
    local = args.experts // me.world
    return config, local, list(range(me.rank * local, (me.rank + 1) * local))


def build_dispatcher(me: Rank, name: str, pg_collection, tokens: int):
    """Dispatcher ``name`` for a batch of ``tokens`` tokens per rank, built as MoELayer builds
    it (``nccl_ep``: its groups sized for ``tokens``)."""
    args = me.args
    config, local, indices = _moe_config(me, moe_token_dispatcher_type=name)
    if name == "nccl_ep":
        import megatron_nccl_ep

        megatron_nccl_ep.register()
        from megatron_nccl_ep.options import NcclEpOptions

        # The flags our own groups take (kernels.group_fields) where the plugin has them.
        options = {"backend": args.backend, "recv_mode": args.recv_mode,
                   "max_tokens_per_rank": tokens, "timeout_s": args.device_timeout,
                   "ranks_per_node": args.ranks_per_node}
        if args.num_sms is not None:
            options["num_sms"] = args.num_sms
        if args.capacity_factor is not None:
            options["capacity_factor"] = args.capacity_factor
        # The dispatcher reads its plugin options from the config it is built with.
        config.nccl_ep_options = NcclEpOptions(**options)
        cls = megatron_nccl_ep.NcclEpTokenDispatcher
    else:
        from megatron.core.transformer.moe import token_dispatcher as td

        cls = {"alltoall": td.MoEAlltoAllTokenDispatcher,
               "allgather": td.MoEAllGatherTokenDispatcher}[name]
    return cls(local, indices, config, pg_collection=pg_collection)


def build_inference_dispatcher(me: Rank, pg_collection, tokens: int):
    """``NcclEpInferenceDispatcher`` (``inference_moe_token_dispatcher_type="nccl_ep"``) for
    decode steps of at most ``tokens`` tokens per rank: its LL group on every SM, as Megatron's
    inference MoE layer builds it (the valid-rows tensor allocated first, as the inference
    context does)."""
    import megatron_nccl_ep
    from megatron.core.transformer.moe.token_dispatcher_inference import (
        InferenceAllGatherDispatcherBase)
    from megatron_nccl_ep.inference import NcclEpInferenceDispatcher
    from megatron_nccl_ep.options import NcclEpOptions

    megatron_nccl_ep.register()
    config, local, indices = _moe_config(me)
    config.nccl_ep_options = NcclEpOptions(backend=me.args.backend, max_tokens_per_rank=tokens,
                                           timeout_s=me.args.device_timeout)
    InferenceAllGatherDispatcherBase._valid_tokens_tensor = me.torch.zeros(
        1, dtype=me.torch.int32, device=me.device)
    return NcclEpInferenceDispatcher(local, indices, config, pg_collection=pg_collection)


class InferenceDriver:
    """An inference dispatcher driven as Megatron's inference ``MoELayer`` drives it on input
    set ``i`` of ``--rotate`` (top-k ids ``[T, K]``, fp32 probs ``[T, K]``, tokens ``[T, H]``);
    the fused experts' output is a fixed fp32 ``[R*T_max, H]`` (what they return)."""

    def __init__(self, dispatcher, me: Rank, tokens: int):
        self.dispatcher = dispatcher
        self.sets = [me.input_set(s, tokens) for s in range(me.args.rotate)]
        rows = me.world * dispatcher.max_tokens_per_rank()
        self.expert_out = me.random_tokens(rows, seed=77 + me.rank).float()

    def dispatch(self, i: int):
        """``dispatch_preprocess`` + ``token_dispatch`` + ``dispatch_postprocess``."""
        d = self.dispatcher
        topk, probs, x = self.sets[i % len(self.sets)]
        h, p = d.dispatch_preprocess(x, topk, probs)
        h, p = d.token_dispatch(h, p)
        return d.dispatch_postprocess(h, p)

    def combine(self):
        """``combine_preprocess`` + ``token_combine`` + ``combine_postprocess`` of the experts'
        fixed output."""
        d = self.dispatcher
        return d.combine_postprocess(d.token_combine(d.combine_preprocess(self.expert_out)))


def megatron_inputs(me: Rank, tokens: int) -> list:
    """``--rotate`` input sets of ``tokens`` tokens as MoELayer hands them to a dispatcher: the
    dense routing map and probs ``[T, E]``, hidden states ``[T, 1, H]``, an output gradient."""
    torch, args = me.torch, me.args
    sets = []
    for s in range(args.rotate):
        topk, weights, x = me.input_set(s, tokens)
        routing_map = torch.zeros(tokens, args.experts, dtype=torch.bool, device=me.device)
        routing_map.scatter_(1, topk, True)
        probs = torch.zeros(tokens, args.experts, device=me.device).scatter_(1, topk, weights)
        grad_out = me.random_tokens(tokens, 900 + 10 * s + me.rank).unsqueeze(1)
        sets.append({"routing_map": routing_map, "probs": probs, "hidden": x.unsqueeze(1),
                     "grad_out": grad_out})
    return sets


class MethodDriver:
    """A dispatcher driven as ``MoELayer`` drives it, on the input set of iteration ``i``; a
    method with a ``setup`` counterpart reads what that left in ``state``."""

    def __init__(self, dispatcher, sets: list):
        self.dispatcher, self.sets, self.state = dispatcher, sets, {}

    def pick(self, i: int) -> dict:
        return self.sets[i % len(self.sets)]

    def leaf_inputs(self, i: int) -> None:
        """Setup: the hidden states and probs as fresh leaves (they get gradients)."""
        st = self.pick(i)
        self.state["hidden"] = st["hidden"].detach().requires_grad_(True)
        self.state["probs"] = st["probs"].detach().requires_grad_(True)

    def dispatch(self, i: int):
        """``dispatch_preprocess`` + ``token_dispatch`` + ``dispatch_postprocess``."""
        d = self.dispatcher
        h, p = d.dispatch_preprocess(self.state["hidden"], self.pick(i)["routing_map"],
                                     self.state["probs"])
        h, p = d.token_dispatch(h, p)
        rows, tokens_per_expert, rows_probs = d.dispatch_postprocess(h, p)
        return rows, rows_probs

    @staticmethod
    def expert_stand_in(rows, rows_probs):
        """What the experts would do to the rows at the least: weight them by their prob."""
        return rows * rows_probs.unsqueeze(-1).to(rows.dtype)

    def combine(self, expert_out):
        """``combine_preprocess`` + ``token_combine`` + ``combine_postprocess``."""
        d = self.dispatcher
        return d.combine_postprocess(d.token_combine(d.combine_preprocess(expert_out)))

    def dispatched_rows(self, i: int) -> None:
        """Setup of ``combine_kept``: a dispatch's rows through the stand-in expert."""
        self.leaf_inputs(i)
        self.state["expert_out"] = self.expert_stand_in(*self.dispatch(i))

    def combine_kept(self, i: int):
        return self.combine(self.state["expert_out"])

    def fwd_bwd(self, i: int) -> None:
        out = self.combine(self.expert_stand_in(*self.dispatch(i)))
        out.backward(self.pick(i)["grad_out"])

    def expert_leaves(self, i: int) -> None:
        """Setup of ``expert_fwd_bwd``: a dispatch's rows and probs as leaves, a gradient."""
        self.leaf_inputs(i)
        rows, rows_probs = self.dispatch(i)
        self.state["rows"] = rows.detach().requires_grad_(True)
        self.state["rows_probs"] = rows_probs.detach().requires_grad_(True)
        self.state["grad_rows"] = rows.detach().clone().normal_()

    def expert_fwd_bwd(self, i: int) -> None:
        self.expert_stand_in(self.state["rows"], self.state["rows_probs"]).backward(
            self.state["grad_rows"])


def section(me: Rank) -> None:
    args = me.args
    mode = e2e_mode(args.device)
    try:
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
    except Exception as exc:  # noqa: BLE001
        me.emit("error", "import", error=f"megatron-core does not import: {exc}")
        return
    parallel_state.initialize_model_parallel(expert_model_parallel_size=me.world)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    sets = megatron_inputs(me, args.tokens)
    for name in args.megatron_dispatchers:
        drive = None

        def build():
            nonlocal drive
            drive = MethodDriver(build_dispatcher(me, name, pg_collection, args.tokens), sets)

        if not me.attempt(f"{name}.build", build):
            continue
        me.attempt(f"{name}.dispatch", lambda: me.measure(
            f"{name}.dispatch", drive.dispatch, mode=mode, setup=drive.leaf_inputs))
        me.attempt(f"{name}.combine", lambda: me.measure(
            f"{name}.combine", drive.combine_kept, mode=mode, setup=drive.dispatched_rows))
        me.attempt(f"{name}.fwd_bwd", lambda: me.measure(
            f"{name}.fwd_bwd", drive.fwd_bwd, mode=mode, setup=drive.leaf_inputs))
        me.attempt(f"{name}.expert_fwd_bwd", lambda: me.measure(
            f"{name}.expert_fwd_bwd", drive.expert_fwd_bwd, mode=mode, setup=drive.expert_leaves))
        drive = None  # noqa: F841 - drop it (and its handles) before the next one
    if "nccl_ep" in args.megatron_dispatchers:
        from megatron_nccl_ep.dispatcher import destroy_groups

        destroy_groups()  # collective, while every rank is still here
    parallel_state.destroy_model_parallel()
