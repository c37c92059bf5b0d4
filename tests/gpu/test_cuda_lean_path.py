"""The ops' checks on the cuda backend (EP=1; the bindings check each call, the front end only
the calls they refuse): the cases of tests/test_lean_path.py, whose wrong calls after valid ones
must raise the front end's errors, and whose out= outputs must hold
the bits of fresh ones (the library writes into them, and its own checks see their shapes)."""

from __future__ import annotations

import pytest

import test_lean_path as cases
from gpu_common import requires_gpus, this_device

pytestmark = requires_gpus


@pytest.mark.parametrize("case_name", list(cases.HT_WRONG))
def test_ht_wrong_call_after_valid_calls_raises(case_name, seed):
    cases.check_ht_wrong_after_valid(case_name, seed, this_device())


def test_ht_strided_input_after_contiguous_is_copied(seed):
    cases.check_ht_strided_after_contiguous(seed, this_device())


def test_ht_strided_routing_makes_the_same_handle(seed):
    cases.check_ht_strided_routing(seed, this_device())


@pytest.mark.parametrize("case_name", list(cases.LL_WRONG))
def test_ll_wrong_call_after_valid_calls_raises(case_name, seed):
    cases.check_ll_wrong_after_valid(case_name, seed, this_device())


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_ll_strided_x_and_bf16_weights_after_valid_calls(layout, seed):
    cases.check_ll_strided_and_bf16_after_valid(layout, seed, this_device())


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_ll_out_gets_the_bits_of_fresh_outputs(layout, seed):
    cases.check_ll_out_reused(layout, seed, this_device())


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_ll_out_of_a_pending_op_is_refused(layout, seed):
    cases.check_ll_out_of_pending_op(layout, seed, this_device())
