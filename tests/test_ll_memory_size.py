"""The size query (``ncclEpGetMemorySize`` through ``ll_memory_size``), docs/design.md §9: it
needs no communicator and no GPU, so it runs wherever the library is built; it checks the config
as group creation does."""

import pytest
import torch

from megatron_nccl_ep import cuda_backend
from megatron_nccl_ep.config import GroupConfig

pytestmark = pytest.mark.skipif(not cuda_backend.available(),
                                reason=f"CUDA library not built: {cuda_backend.unavailable_reason()}")


def ll_config(world: int, **fields) -> GroupConfig:
    base = dict(mode="ll", num_experts=256, hidden=7168, max_tokens_per_rank=128, max_topk=8)
    base.update(fields)
    return GroupConfig.build(world, **base)


def test_decode_shape_at_ep64_fits_in_0_3_gb_per_rank():
    for layout in ("expert_major", "rank_major"):
        size = cuda_backend.ll_memory_size(ll_config(64, ll_layout=layout), 64)
        assert size["total_bytes"] == size["window_bytes"] + size["device_bytes"]
        assert size["total_bytes"] <= 0.3e9, (layout, size)
        # The receive area alone: two sets of R x T_max messages of at least a bf16 row each.
        assert size["window_bytes"] >= 2 * 64 * 128 * 7168 * 2


def test_window_grows_with_ranks_and_tokens_not_with_experts():
    small = cuda_backend.ll_memory_size(ll_config(8), 8)["window_bytes"]
    assert cuda_backend.ll_memory_size(ll_config(16), 16)["window_bytes"] > small
    assert cuda_backend.ll_memory_size(ll_config(8, max_tokens_per_rank=256), 8)[
        "window_bytes"] > small
    more_experts = cuda_backend.ll_memory_size(ll_config(8, num_experts=512), 8)["window_bytes"]
    assert more_experts - small < 1 << 21  # counts per expert only, not rows per expert


def test_fp8_payload_shrinks_the_window():
    bf16 = cuda_backend.ll_memory_size(ll_config(8), 8)["window_bytes"]
    fp8 = cuda_backend.ll_memory_size(ll_config(8, payload_dtype=torch.float8_e4m3fn),
                                      8)["window_bytes"]
    assert fp8 < bf16


def test_expert_major_handles_hold_the_row_map():
    em = cuda_backend.ll_memory_size(ll_config(8, ll_layout="expert_major"), 8)
    rm = cuda_backend.ll_memory_size(ll_config(8, ll_layout="rank_major"), 8)
    assert em["handle_bytes"] > rm["handle_bytes"] > 0


def test_ht_configs_are_sized_too():
    ht = GroupConfig.build(8, num_experts=256, hidden=7168, max_tokens_per_rank=4096, max_topk=8,
                           dtype=torch.bfloat16)
    size = cuda_backend.ll_memory_size(ht, 8)
    assert size["window_bytes"] > 0 and size["handle_bytes"] > 0


def test_the_library_checks_the_config_it_sizes():
    """The size query checks the configuration's rules in the library (Python checks only its
    fields: GroupConfig.check_fields), with the library's message."""
    bad = ll_config(8, max_tokens_per_rank=2048)
    with pytest.raises(ValueError, match=r"ncclEpCreateGroup: LL needs max_tokens_per_rank "
                                         r"\(T_max\) <= 1024"):
        cuda_backend.ll_memory_size(bad, 8)
