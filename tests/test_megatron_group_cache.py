"""One group specification and one cache for both Megatron dispatchers (training's
``NcclEpTokenDispatcher``, inference's ``NcclEpInferenceDispatcher``), on gloo with the reference
backend: each layer's Group is ``GROUPS.get(group_spec(...))``, layers whose specs are equal share
it whichever options brought them there, and each role's destroy leaves the other's groups."""

from __future__ import annotations

import dataclasses

import torch

import dist
import megatron_nccl_ep
from megatron_nccl_ep.dispatcher import NcclEpTokenDispatcher, destroy_groups
from megatron_nccl_ep.dispatcher_common import GROUPS, group_spec
from megatron_nccl_ep.inference import (NcclEpInferenceDispatcher, _shared_outputs,
                                        destroy_inference_groups)
from megatron_nccl_ep.options import NcclEpOptions
from test_megatron_inference import (HIDDEN, T_MAX, combine, dispatch, dispatchers,
                                     random_routing)

megatron_nccl_ep.register()


def shared_cache_case(seed: int) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T_MAX, 1, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = random_routing(T_MAX, 4, 2, gen)
    probs = torch.rand(T_MAX, 2, generator=gen)

    def decode(dispatcher) -> None:
        dispatch(dispatcher, x, ids, probs)
        combine(dispatcher, torch.zeros(T_MAX, HIDDEN))

    with dispatchers(4, 2, False, False, "torch", torch.device("cpu")) as (_, inference):
        pg = ProcessGroupCollection.use_mpu_process_groups()
        options = inference.config.nccl_ep_options

        def config_with(layer_options: NcclEpOptions):
            config = dataclasses.replace(inference.config)
            config.nccl_ep_options = layer_options
            return config

        def training_layer(layer_options: NcclEpOptions) -> NcclEpTokenDispatcher:
            return NcclEpTokenDispatcher(4, list(range(4)), config=config_with(layer_options),
                                         pg_collection=pg)

        training = training_layer(options)
        tokens = x.view(T_MAX, HIDDEN)
        ht = training._route(tokens)[2]
        decode(inference)
        assert [g.config.mode for g in GROUPS.cached()] == ["ht", "ll"]
        ll = GROUPS.cached("ll")[0]

        # The cache's keys are the specs the one mapping gives for each role, which differ in
        # the mode and layout only (on the CPU the LL SM budget is the HT one).
        ht_spec = group_spec(options, pg.ep, tokens, num_experts=4, max_topk=2,
                             max_tokens_per_rank=T_MAX)
        ll_spec = group_spec(options, pg.ep, tokens, num_experts=4, max_topk=2,
                             max_tokens_per_rank=T_MAX, ll=True)
        assert list(GROUPS.groups.items()) == [(ht_spec, ht), (ll_spec, ll)]
        assert dataclasses.replace(ht_spec, mode="ll", ll_layout="rank_major") == ll_spec
        assert (ht.config.timeout_s, ll.config.timeout_s) == (options.timeout_s,) * 2
        assert GROUPS.get(dataclasses.replace(ll_spec)) is ll

        # Options that do not reach a group's arguments: the same groups for other layers.
        others = dataclasses.replace(options, capacity_factor=3.0, capacity_overflow="error",
                                     ll_num_sms=12)
        assert training_layer(others)._route(tokens)[2] is ht
        second = NcclEpInferenceDispatcher(4, list(range(4)), config=config_with(
            dataclasses.replace(options, recv_mode="capacity", capacity_factor=3.0)),
            pg_collection=pg)
        decode(second)
        assert GROUPS.cached() == [ht, ll]
        # One that does reaches it: a group of its own.
        slower = training_layer(dataclasses.replace(options, timeout_s=31.0))._route(tokens)[2]
        assert slower is not ht and slower.config.timeout_s == 31.0
        assert GROUPS.cached("ht") == [ht, slower]

        # Each role's destroy leaves the other's groups; a layer's memo is looked up again
        # after any destroy and finds what is still cached.
        assert _shared_outputs and list(_shared_outputs) == [ll]
        destroy_inference_groups()
        assert GROUPS.cached() == [ht, slower] and not _shared_outputs
        assert training._route(tokens)[2] is ht
        decode(inference)
        fresh = GROUPS.cached("ll")
        assert len(fresh) == 1 and fresh[0] is not ll
        destroy_groups()
        assert GROUPS.cached() == fresh and list(_shared_outputs) == fresh
        assert training._route(tokens)[2] is not ht
        GROUPS.destroy()  # both roles': the shared outputs go with their group
        assert not GROUPS.groups and not _shared_outputs
    return {"groups": 5}


def test_training_and_inference_share_one_spec_and_cache(seed):
    assert dist.run(1, shared_cache_case, seed) == [{"groups": 5}]
