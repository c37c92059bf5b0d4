"""The lean path on the cuda backend: the cases of tests/test_lean_path.py (the bindings and the C
library check each call against the handle, the front end only the calls they refuse) on local
teams of 1 and 2 ranks (``Group.local_team``: every rank a thread of this process with its own
stream), HT in exact and capacity mode and LL in both layouts. Each wrong call after valid ones
must reach the backend op and be refused there, and raise exactly the front end's error for its
arguments (``test_lean_path.assert_layer``); out= outputs must hold the bits of fresh ones (the
library writes into them, and its own checks see their shapes)."""

from __future__ import annotations

import pytest

import megatron_nccl_ep as ep
import test_lean_path as cases
from gpu_common import requires_gpus, this_device

pytestmark = requires_gpus

WORLDS = (1, 2)


def on_team(world: int, fields: dict, check, *args) -> None:
    """``check(*args, rank, world, group)`` on every rank of a local team of ``world``."""
    groups = ep.Group.local_team(world, device=this_device(), num_sms=8, timeout_s=20.0,
                                 **fields)
    try:
        ep.run_local_team(groups, lambda rank, group: check(*args, rank, world, group),
                          timeout_s=120.0)
    finally:
        for group in groups:
            group.destroy()


@pytest.mark.parametrize("mode", cases.HT_MODES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case_name", list(cases.HT_WRONG))
def test_ht_wrong_call_after_valid_calls_raises(case_name, world, mode, seed):
    on_team(world, cases.ht_fields(mode, world), cases.check_ht_wrong_after_valid, case_name,
            seed)


@pytest.mark.parametrize("mode", cases.HT_MODES)
@pytest.mark.parametrize("world", WORLDS)
def test_ht_strided_input_after_contiguous_is_copied(world, mode, seed):
    on_team(world, cases.ht_fields(mode, world), cases.check_ht_strided_after_contiguous, seed)


@pytest.mark.parametrize("mode", cases.HT_MODES)
@pytest.mark.parametrize("world", WORLDS)
def test_ht_strided_routing_makes_the_same_handle(world, mode, seed):
    on_team(world, cases.ht_fields(mode, world), cases.check_ht_strided_routing, seed)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case_name", list(cases.LL_WRONG))
def test_ll_wrong_call_after_valid_calls_raises(case_name, world, seed):
    on_team(world, cases.ll_fields(cases.LL_WRONG[case_name][0]),
            cases.check_ll_wrong_after_valid, case_name, seed)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", cases.LAYOUTS)
def test_ll_strided_x_and_bf16_weights_after_valid_calls(layout, world, seed):
    on_team(world, cases.ll_fields(layout), cases.check_ll_strided_and_bf16_after_valid, seed)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", cases.LAYOUTS)
def test_ll_out_gets_the_bits_of_fresh_outputs(layout, world, seed):
    on_team(world, cases.ll_fields(layout), cases.check_ll_out_reused, seed)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("layout", cases.LAYOUTS)
def test_ll_out_of_a_pending_op_is_refused(layout, world, seed):
    on_team(world, cases.ll_fields(layout), cases.check_ll_out_of_pending_op, seed)
