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


def _dispatcher(me: Rank, name: str, pg_collection):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = me.args
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=1,
        ffn_hidden_size=args.hidden, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_token_dispatcher_type=name, expert_model_parallel_size=me.world,
        bf16=me.dtype == torch.bfloat16, fp16=me.dtype == torch.float16, params_dtype=me.dtype,
        # Fused permutes need transformer-engine: without it, Megatron's unfused permutes.
        moe_permute_fusion=False, add_bias_linear=False, use_cpu_initialization=not me.cuda)
    local = args.experts // me.world
    indices = list(range(me.rank * local, (me.rank + 1) * local))
    if name == "nccl_ep":
        import megatron_nccl_ep

        megatron_nccl_ep.register()
        from megatron_nccl_ep.options import NcclEpOptions

        # The flags our own groups take (kernels.group_fields) where the plugin has them.
        options = {"backend": args.backend, "recv_mode": args.recv_mode,
                   "max_tokens_per_rank": args.tokens, "timeout_s": args.device_timeout,
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


def section(me: Rank) -> None:
    torch, args = me.torch, me.args
    mode = e2e_mode(args.device)
    try:
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
    except Exception as exc:  # noqa: BLE001
        me.emit("error", "import", error=f"megatron-core does not import: {exc}")
        return
    parallel_state.initialize_model_parallel(expert_model_parallel_size=me.world)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()

    sets = []
    for s in range(args.rotate):
        topk, weights, x = me.input_set(s)
        routing_map = torch.zeros(args.tokens, args.experts, dtype=torch.bool, device=me.device)
        routing_map.scatter_(1, topk, True)
        probs = torch.zeros(args.tokens, args.experts, device=me.device).scatter_(1, topk, weights)
        # [sequence, batch, hidden], as MoELayer hands it over
        hidden = x.unsqueeze(1)
        grad_out = me.random_tokens(args.tokens, 900 + 10 * s + me.rank).unsqueeze(1)
        sets.append({"routing_map": routing_map, "probs": probs, "hidden": hidden,
                     "grad_out": grad_out})
    pick = lambda i: sets[i % len(sets)]  # noqa: E731

    for name in args.megatron_dispatchers:
        dispatcher = None

        def build():
            nonlocal dispatcher
            dispatcher = _dispatcher(me, name, pg_collection)

        if not me.attempt(f"{name}.build", build):
            continue
        state = {}

        def leaf_inputs(i):
            st = pick(i)
            state["hidden"] = st["hidden"].detach().requires_grad_(True)
            state["probs"] = st["probs"].detach().requires_grad_(True)

        def dispatch(i):
            st = pick(i)
            h, p = dispatcher.dispatch_preprocess(state["hidden"], st["routing_map"],
                                                  state["probs"])
            h, p = dispatcher.token_dispatch(h, p)
            rows, tokens_per_expert, rows_probs = dispatcher.dispatch_postprocess(h, p)
            return rows, rows_probs

        def expert_stand_in(rows, rows_probs):
            # What the experts would do to the rows at the least: weight them by their prob.
            return rows * rows_probs.unsqueeze(-1).to(rows.dtype)

        def combine(expert_out):
            out = dispatcher.combine_preprocess(expert_out)
            out = dispatcher.token_combine(out)
            return dispatcher.combine_postprocess(out)

        def dispatched_rows(i):
            leaf_inputs(i)
            state["expert_out"] = expert_stand_in(*dispatch(i))

        def fwd_bwd(i):
            out = combine(expert_stand_in(*dispatch(i)))
            out.backward(pick(i)["grad_out"])
            return None

        def expert_leaves(i):
            leaf_inputs(i)
            rows, rows_probs = dispatch(i)
            state["rows"] = rows.detach().requires_grad_(True)
            state["rows_probs"] = rows_probs.detach().requires_grad_(True)
            state["grad_rows"] = torch.randn_like(rows)

        def expert_fwd_bwd(i):
            expert_stand_in(state["rows"], state["rows_probs"]).backward(state["grad_rows"])

        me.attempt(f"{name}.dispatch", lambda: me.measure(
            f"{name}.dispatch", dispatch, mode=mode, setup=leaf_inputs))
        me.attempt(f"{name}.combine", lambda: me.measure(
            f"{name}.combine", lambda i: combine(state["expert_out"]), mode=mode,
            setup=dispatched_rows))
        me.attempt(f"{name}.fwd_bwd", lambda: me.measure(
            f"{name}.fwd_bwd", fwd_bwd, mode=mode, setup=leaf_inputs))
        me.attempt(f"{name}.expert_fwd_bwd", lambda: me.measure(
            f"{name}.expert_fwd_bwd", expert_fwd_bwd, mode=mode, setup=expert_leaves))
        state.clear()
        dispatcher = None  # noqa: F841 - drop it (and its handles) before the next one
    if "nccl_ep" in args.megatron_dispatchers:
        from megatron_nccl_ep.dispatcher import destroy_groups

        destroy_groups()  # collective, while every rank is still here
    parallel_state.destroy_model_parallel()
