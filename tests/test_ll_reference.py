"""docs/design.md §9 on the reference backend: LL dispatch (both layouts, FP8 or not) and combine,
bitwise against an independent per-token computation written here from the contract, on 1, 2
and 4 gloo ranks; the one-process oracle (tests/ll_oracle.py: ll_dispatch_all / ll_combine_all)
equal to the distributed backend; the FP8 cast against an e4m3 table decoded here; staging
(send_only, complete) and every contract error, raised on every rank."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

import dist
import ep_cases
import ll_cases
import ll_oracle
import megatron_nccl_ep as ep
from megatron_nccl_ep import fp8
from megatron_nccl_ep.outputs import LLDispatchOutput

# ------------------------------------------------------------------------------------------------
# the independent FP8 cast: e4m3fn decoded from its bit patterns, nearest value, ties to even
# ------------------------------------------------------------------------------------------------


def e4m3_table() -> np.ndarray:
    """float64 value of every bit pattern 0..255 (NaN for 0x7f / 0xff: e4m3fn has no inf)."""
    values = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, mant = (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and mant == 0x7:
            values[code] = math.nan
        elif exp == 0:
            values[code] = sign * mant / 8 * 2.0 ** -6
        else:
            values[code] = sign * (1 + mant / 8) * 2.0 ** (exp - 7)
    return values


TABLE = e4m3_table()
POSITIVE = TABLE[:0x7F]  # 0x00 .. 0x7e: ascending, 0 .. 448


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """uint8 codes of float32 ``v``: nearest finite e4m3 value, ties to the even code (even
    mantissa), saturating at 448, the sign kept (negative values that round to 0 give -0)."""
    mag = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(POSITIVE, mag), 1, len(POSITIVE) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - POSITIVE[lo], POSITIVE[hi] - mag
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(mag >= POSITIVE[-1], len(POSITIVE) - 1, code)
    return (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def independent_fp8(x: torch.Tensor):
    """(codes uint8 [n, H], scales float32 [n, H/128]) of the §9 cast, in numpy float32."""
    v = x.to(torch.float32).numpy().reshape(x.shape[0], -1, 128)
    amax = np.max(np.abs(v), axis=-1)
    amax = np.maximum(amax, np.float32(1e-4))
    scales = amax / np.float32(448.0)  # float32 / float32: one IEEE division
    factor = np.float32(448.0) / amax
    product = v * factor[..., None]  # float32: one rounding
    assert product.dtype == np.float32 and scales.dtype == np.float32
    codes = e4m3_round(product).reshape(x.shape)
    return torch.from_numpy(codes), torch.from_numpy(scales)


def test_e4m3_table_is_float8_e4m3fn():
    """The decoded table is torch's float8_e4m3fn (an independent decoding, not its cast)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    assert np.array_equal(codes.numpy(), TABLE, equal_nan=True)
    assert POSITIVE[-1] == 448.0 and np.all(np.diff(POSITIVE) > 0)


def grid_block() -> torch.Tensor:
    """Rows of two blocks of 128 fp32 values, each with amax exactly 448 (factor 1, scale 1):
    every finite e4m3 magnitude, the midpoint of every neighbour pair (a tie) and one fp32 ulp either side of it,
    of both signs, and zeros of both signs."""
    pos = POSITIVE.astype(np.float32)
    mids = ((POSITIVE[:-1] + POSITIVE[1:]) / 2).astype(np.float32)
    values = [pos, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9))]
    values = np.concatenate(values)
    values = np.concatenate([values, -values, np.array([0.0, -0.0], dtype=np.float32)])
    pad = (-len(values)) % 127
    values = np.concatenate([values, np.zeros(pad, dtype=np.float32)])
    blocks = values.reshape(-1, 127)
    blocks = np.concatenate([np.full((len(blocks), 1), 448.0, dtype=np.float32), blocks], 1)
    if len(blocks) % 2:  # rows of two blocks, as the other inputs
        blocks = np.concatenate([blocks, blocks[:1]])
    return torch.from_numpy(blocks.reshape(-1, 256).copy())


def factor_sensitive_rows(seed: int, count: int = 32) -> torch.Tensor:
    """Rows of two blocks ``[amax, x, 0, ...]`` where the factor's rounding shows in the code:
    ``e4m3(x * (448 / amax))`` differs from what a factor computed as ``(1 / amax) * 448`` gives
    (the product then lands on the other side of an e4m3 midpoint)."""
    rng = np.random.default_rng(seed)
    amax = (rng.random(4096) * 2 + 1).astype(np.float32) * np.float32(2.0 ** rng.integers(-6, 6))
    right = np.float32(448) / amax
    wrong = (np.float32(1) / amax) * np.float32(448)
    mids = ((POSITIVE[1:-1] + POSITIVE[2:]) / 2).astype(np.float32)
    found = []
    for a, f1, f2 in zip(amax[right != wrong], right[right != wrong], wrong[right != wrong]):
        x = (mids / f1).astype(np.float32)
        for cand in (x, np.nextafter(x, np.float32(0)), np.nextafter(x, np.float32(1e9))):
            ok = (np.abs(cand) <= a) & (e4m3_round(cand * f1) != e4m3_round(cand * f2))
            found += [(a, v) for v in cand[ok]]
        if len(found) >= count:
            break
    assert len(found) >= count, "no factor-sensitive values found"
    rows = torch.zeros(count // 2, 256)
    for i, (a, v) in enumerate(found[:count]):
        rows[i // 2, 128 * (i % 2)] = float(a)
        rows[i // 2, 128 * (i % 2) + 1] = float(v)
    return rows


def fp8_inputs(seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(6, 256, generator=gen) * 2.0 ** torch.randint(-12, 12, (6, 1),
                                                                      generator=gen)]
    rows.append(torch.zeros(1, 256))  # amax 0: the floor
    rows.append(-torch.zeros(1, 256))  # negative zeros stay negative
    rows.append(torch.randn(2, 256, generator=gen) * 1e-6)  # amax below the 1e-4 floor
    rows.append(torch.randn(1, 256, generator=gen) * 3e-5)  # straddles the floor
    # Exact multiples of a block's amax: x * factor lands on and between e4m3 grid points.
    base = torch.randint(-448, 449, (3, 256), generator=gen).to(torch.float32) / 448
    base[:, 0] = 1.0
    rows.append(base * 2.0 ** torch.randint(-8, 8, (3, 1), generator=gen))
    out = torch.cat(rows).to(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_cast_bits(dtype, seed):
    x = fp8_inputs(seed, dtype)
    if dtype == torch.float32:
        x = torch.cat([x, grid_block(), factor_sensitive_rows(seed)])
    q, scales = fp8.fp8_cast(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (x.shape[0], x.shape[1] // 128)
    want_q, want_scales = independent_fp8(x)
    got = q.view(torch.uint8)
    bad = (got != want_q).nonzero()
    assert len(bad) == 0, (f"{len(bad)} codes differ, first at {bad[0].tolist()}: x="
                           f"{float(x[tuple(bad[0])])} got {int(got[tuple(bad[0])]):#x} want "
                           f"{int(want_q[tuple(bad[0])]):#x}")
    assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
    # The zero rows: scale = 1e-4 / 448, codes +0 / -0 as the input's sign.
    zero_rows = (x == 0).all(1).nonzero().flatten()
    assert len(zero_rows) == 2
    assert set(got[zero_rows].flatten().tolist()) == {0x00, 0x80}
    # Dequantized: within half the widest e4m3 spacing (32, near 448) of x, in scaled units.
    assert bool((fp8.fp8_dequant(q, scales) - x.float()).abs().le(
        scales.repeat_interleave(128, 1) * 16.01).all())


def test_fp8_cast_grid_codes():
    """With amax 448 (scale 1, factor 1) every grid value maps to its own code and every
    midpoint to the even one of its neighbours; products past 448 saturate (torch's plain cast
    gives NaN from 480 up)."""
    x = grid_block()
    q, scales = fp8.fp8_cast(x)
    assert bool((scales == 1).all())
    got = q.view(torch.uint8).to(torch.int64)
    want = torch.from_numpy(e4m3_round(x.numpy()).astype(np.int64))
    assert torch.equal(got, want)
    assert int((got & 0x7F).max()) == 0x7E  # 448, never the NaN pattern
    # Ties: 1 + 1/16 lies between 1 (mantissa 0) and 1 + 1/8 (mantissa 1): the even one, 1.
    tie = torch.full((1, 128), 448.0)
    tie[0, 1], tie[0, 2], tie[0, 3] = 1.0625, 1.1875, 3 * 2.0 ** -10
    assert fp8.fp8_cast(tie)[0][0, 1:4].float().tolist() == [1.0, 1.25, 2.0 ** -8]
    # Blocks whose amax times its factor rounds above 448 (amax * (448 / amax) > 448): saturated.
    amax = torch.linspace(1, 2, 4096)
    over = amax * torch.div(torch.full_like(amax, 448.0), amax) > 448
    assert bool(over.any())
    block = torch.zeros(int(over.sum()), 128)
    block[:, 0] = amax[over]
    assert bool((fp8.fp8_cast(block)[0][:, 0].float() == 448).all())


def test_fp8_cast_needs_whole_blocks():
    with pytest.raises(ValueError, match=r"multiple of 128"):
        fp8.fp8_cast(torch.ones(2, 100))


# ------------------------------------------------------------------------------------------------
# the independent dense LL computation (docs/design.md §9), per token
# ------------------------------------------------------------------------------------------------


def payload(problem, s: int, t: int, payload_dtype):
    """(row as sent, scales or None) of token t of rank s, in ``payload_dtype`` (None: the
    token dtype; else FP8, the payload this file has an independent cast of)."""
    x = problem.x[s][t:t + 1]
    if payload_dtype is None:
        return x[0], None
    assert payload_dtype == torch.float8_e4m3fn, payload_dtype
    codes, scales = independent_fp8(x)
    return codes[0].view(torch.float8_e4m3fn), scales[0]


def dense_received(problem, d: int):
    """Rank d's received tokens in (source, token) order, and per local expert its (s, t)."""
    return ll_oracle.received(problem.topk_idx, problem.num_local_experts * problem.world_size,
                              problem.world_size, d)


def dense_dispatch(problem, d: int, layout: str, payload_dtype, with_weights: bool):
    """Rank d's dispatch output with the undefined rows zero (only the defined ones compared)."""
    R, T_max, H, K = problem.world_size, problem.max_tokens, problem.hidden, problem.max_topk
    L = problem.num_local_experts
    dtype = problem.x[0].dtype if payload_dtype is None else payload_dtype
    tokens, per_expert = dense_received(problem, d)
    lead = (L, R * T_max) if layout == "expert_major" else (R * T_max,)
    x = torch.zeros(lead + (H,), dtype=torch.float32).to(dtype)
    scales = None if payload_dtype is None else torch.zeros(lead + (H // 128,))
    if layout == "expert_major":
        src = torch.zeros(lead, dtype=torch.int32)
        for l, rows in enumerate(per_expert):
            for i, (s, t) in enumerate(rows):
                row, sc = payload(problem, s, t, payload_dtype)
                x[l, i] = row
                if sc is not None:
                    scales[l, i] = sc
                src[l, i] = s * T_max + t
        count = torch.tensor([len(rows) for rows in per_expert], dtype=torch.int32)
        return LLDispatchOutput(x, count, scales, src=src)
    idx = torch.full((R * T_max, K), -1, dtype=torch.int32)
    w = torch.zeros((R * T_max, K), dtype=torch.float32) if with_weights else None
    for i, (s, t) in enumerate(tokens):
        row, sc = payload(problem, s, t, payload_dtype)
        x[i] = row
        if sc is not None:
            scales[i] = sc
        for k, e in enumerate(problem.topk_idx[s][t].tolist()):
            if e >= 0 and e // L == d:
                idx[i, k] = e
                if with_weights:
                    w[i, k] = problem.weights[s][t, k]
    return LLDispatchOutput(x, torch.tensor([len(tokens)], dtype=torch.int32), scales, topk_idx=idx,
                  topk_weights=w)


def dense_combine(problem, s: int, layout: str, expert_out, weights):
    """Rank s's y [T_s, H]: the ordered fp32 sums of §9, one add at a time, rounded once."""
    L, H = problem.num_local_experts, problem.hidden
    dtype = problem.x[0].dtype
    received = [dense_received(problem, d) for d in range(problem.world_size)]
    y = torch.empty((problem.x[s].shape[0], H), dtype=dtype)
    for t, slots in enumerate(problem.topk_idx[s].tolist()):
        acc = torch.zeros(H, dtype=torch.float32)
        if layout == "expert_major":
            for k, e in enumerate(slots):
                if e < 0:
                    continue
                d, l = e // L, e % L
                row = received[d][1][l].index((s, t))
                acc = acc + weights[s][t, k] * expert_out[d][l, row].to(torch.float32)
        else:
            for d in range(problem.world_size):
                if (s, t) in received[d][0]:
                    acc = acc + expert_out[d][received[d][0].index((s, t))].to(torch.float32)
        y[t] = acc.to(dtype)
    return y


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return ep_cases.count_mismatches(a, b) == 0


# ------------------------------------------------------------------------------------------------
# layouts and arithmetic, distributed against the dense computation and the one-process oracle
# ------------------------------------------------------------------------------------------------

# name -> make_ll_problem arguments (world size from the pool). E is a multiple of 4.
CASES = {
    "uneven_tokens": dict(tokens=(7, 12, 16, 3), hidden=128, num_experts=8, topk=3,
                          max_tokens=16),
    "rank_with_zero_tokens_masked": dict(tokens=(0, 9), hidden=256, num_experts=8, topk=2,
                                         routing="masked", idx_dtype=torch.int32),
    "all_to_one_expert": dict(tokens=10, hidden=128, num_experts=8, topk=2,
                              routing="one_expert"),
    "t_equal_t_max_topk4": dict(tokens=16, hidden=128, num_experts=16, topk=4, max_tokens=16),
    "masked_k_below_max_topk": dict(tokens=(11, 5, 8), hidden=128, num_experts=16,
                                    topk=(2, 4, 1), max_topk=4, routing="masked"),
}
FP8 = torch.float8_e4m3fn
DTYPES = [(torch.bfloat16, None), (torch.bfloat16, FP8), (torch.float16, None),
          (torch.float16, FP8), (torch.float32, None), (torch.float32, FP8)]


def problem_of(case_name: str, dtype, seed: int, world: int):
    return ll_cases.make_ll_problem(world, dtype=dtype, seed=seed, **CASES[case_name])


def check_ll_case(case_name: str, layout: str, dtype, payload_dtype, seed: int) -> None:
    rank, world = ep_cases.rank_and_size()
    problem = problem_of(case_name, dtype, seed, world)
    group = ep.Group(backend="torch", device="cpu",
                     **problem.group_fields(layout, payload_dtype))
    handle = group.create_handle(problem.topk_idx[rank].clone())
    out = handle.dispatch(problem.x[rank].clone(), problem.weights[rank].clone())
    # Rank-major outputs carry the dispatched weights; expert-major ones none.
    with_weights = layout == "rank_major"
    want = [dense_dispatch(problem, d, layout, payload_dtype, with_weights)
            for d in range(world)]
    bad = ll_cases.dispatch_mismatches(out, want[rank], layout)
    assert not bad, f"rank {rank} dispatch differs from the dense computation in {bad}"
    # Rows past the counts hold the documented poison (NaN), never data.
    tail = out.x.isnan() if payload_dtype is None else (out.x.view(torch.uint8) == 0x7F)
    if layout == "expert_major":
        for l, c in enumerate(out.count.tolist()):
            assert bool(tail[l, c:].all()) and bool((out.src[l, c:] == -1).all())
    else:
        assert bool(tail[int(out.count):].all())

    counts = [w.count for w in want]
    expert_out = ll_cases.expert_outputs(problem, layout, counts, seed + 11)
    cw = ll_cases.fresh_weights(problem, seed + 13)
    y = handle.combine(expert_out[rank].clone(),
                       cw[rank].clone() if layout == "expert_major" else None)
    want_y = dense_combine(problem, rank, layout, expert_out, cw)
    assert y.dtype == dtype and bits_equal(y, want_y), (
        f"rank {rank} combine: {ep_cases.count_mismatches(y, want_y)} elements differ")
    assert not bool(y.isnan().any())
    if dtype != torch.float32:  # fp32 rows: the combine of those rows rounded to dtype (§9)
        wide = ll_cases.widened_outputs(expert_out, seed + 17)
        y_wide = handle.combine(wide[rank].clone(),
                                cw[rank].clone() if layout == "expert_major" else None)
        want_wide = dense_combine(problem, rank, layout, [w.to(dtype) for w in wide], cw)
        assert y_wide.dtype == dtype and bits_equal(y_wide, want_wide), (
            f"rank {rank} combine of fp32 rows: "
            f"{ep_cases.count_mismatches(y_wide, want_wide)} elements differ")

    # The one-process oracle of the whole group gives this rank's bits too.
    cfg = group.config
    all_out = ll_oracle.ll_dispatch_all(cfg, world, problem.topk_idx, problem.x,
                                        problem.weights)
    assert not ll_cases.dispatch_mismatches(all_out[rank], out, layout)
    all_y = ll_oracle.ll_combine_all(cfg, world, problem.topk_idx, expert_out,
                                     cw if layout == "expert_major" else None)
    assert bits_equal(all_y[rank], y)
    group.destroy()


# Every case on 1, 2 and 4 ranks, except the rank with zero tokens: it needs a rank with tokens
# beside it (2 and 4).
CASE_WORLD_SIZES = [pytest.param(name, world_size, id=f"{name}-{world_size}")
                    for name in CASES for world_size in (1, 2, 4)
                    if world_size > 1 or name != "rank_with_zero_tokens_masked"]


@pytest.mark.parametrize("dtype,payload_dtype", DTYPES,
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
@pytest.mark.parametrize("case_name,world_size", CASE_WORLD_SIZES)
def test_ll_dispatch_combine_bitwise(case_name, layout, dtype, payload_dtype, world_size,
                                     seed):
    dist.run(world_size, check_ll_case, case_name, layout, dtype, payload_dtype, seed)


def check_empty_and_no_weights(layout: str, seed: int) -> None:
    """Dispatch without weights (rank-major: no weights out) and a dispatch where every slot is
    masked on every rank (counts 0, y = 0)."""
    rank, world = ep_cases.rank_and_size()
    problem = ll_cases.make_ll_problem(world, 6, 128, 8, 2, torch.bfloat16, seed=seed,
                                       weights=False)
    group = ep.Group(backend="torch", device="cpu", **problem.group_fields(layout))
    out = group.create_handle(problem.topk_idx[rank]).dispatch(problem.x[rank])
    assert out.topk_weights is None
    want = dense_dispatch(problem, rank, layout, None, False)
    assert not ll_cases.dispatch_mismatches(out, want, layout)
    masked = torch.full((5, 2), -1, dtype=torch.int64)
    handle = group.create_handle(masked)
    out = handle.dispatch(problem.x[rank][:5], None)
    assert int(out.count.sum()) == 0
    rows = out.x.shape[:-1]
    expert_out = torch.full(rows + (128,), math.nan, dtype=torch.bfloat16)
    y = handle.combine(expert_out, torch.ones(5, 2) if layout == "expert_major" else None)
    assert bits_equal(y, torch.zeros(5, 128, dtype=torch.bfloat16))  # +0.0, not -0.0


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_ll_no_weights_and_all_masked(layout, world_size, seed):
    dist.run(world_size, check_empty_and_no_weights, layout, seed)


# ------------------------------------------------------------------------------------------------
# staging: send_only and complete()
# ------------------------------------------------------------------------------------------------


def check_two_micro_batches(layout: str, payload_dtype, seed: int) -> None:
    """The two-micro-batch decode order gives the eager bits; outputs are poison until their
    complete(); a third op of a kind in flight raises (on every rank: each makes the same
    calls); complete() with nothing pending raises."""
    rank, world = ep_cases.rank_and_size()
    mbs = [ll_cases.make_ll_problem(world, (9, 4), 128, 8, 3, torch.bfloat16, seed=seed + i)
           for i in range(3)]
    group = ep.Group(backend="torch", device="cpu",
                     **mbs[0].group_fields(layout, payload_dtype))
    em = layout == "expert_major"

    def outputs(p, counts, i):
        return (ll_cases.expert_outputs(p, layout, counts, seed + 20 + i)[rank],
                ll_cases.fresh_weights(p, seed + 30 + i)[rank] if em else None)

    # Eager.
    eager = []
    for i, p in enumerate(mbs[:2]):
        h = group.create_handle(p.topk_idx[rank])
        out = h.dispatch(p.x[rank], p.weights[rank])
        counts = [dense_dispatch(p, d, layout, payload_dtype, not em).count
                  for d in range(world)]
        eo, cw = outputs(p, counts, i)
        eager.append((out, h.combine(eo, cw), eo, cw))
    # Staged: dispatch mb0, dispatch mb1, complete mb0, combine mb0, complete mb1, combine mb1,
    # complete both combines.
    h0, h1, h2 = (group.create_handle(p.topk_idx[rank]) for p in mbs)
    o0 = h0.dispatch(mbs[0].x[rank], mbs[0].weights[rank], send_only=True)
    o1 = h1.dispatch(mbs[1].x[rank], mbs[1].weights[rank], send_only=True)
    assert bool((o0.count == -1).all()) and bool((o1.count == -1).all()), "poison until complete"
    with pytest.raises(RuntimeError, match=r"2 dispatches are already in flight"):
        h2.dispatch(mbs[2].x[rank], mbs[2].weights[rank], send_only=True)
    with pytest.raises(RuntimeError, match=r"not completed: call complete\(\) first"):
        h0.combine(eager[0][2], eager[0][3])
    h0.complete()
    assert not ll_cases.dispatch_mismatches(o0, eager[0][0], layout)
    y0 = h0.combine(eager[0][2], eager[0][3], send_only=True)
    assert bool(y0.isnan().all()), "combine output is poison until complete"
    h1.complete()
    assert not ll_cases.dispatch_mismatches(o1, eager[1][0], layout)
    y1 = h1.combine(eager[1][2], eager[1][3], send_only=True)
    # A third combine while two are in flight: refused before anything is sent.
    p2 = mbs[2]
    o2 = h2.dispatch(p2.x[rank], p2.weights[rank])
    counts2 = [dense_dispatch(p2, d, layout, payload_dtype, not em).count
               for d in range(world)]
    eo2, cw2 = outputs(p2, counts2, 2)
    with pytest.raises(RuntimeError, match=r"2 combine\w* are already in flight"):
        h2.combine(eo2, cw2, send_only=True)
    h0.complete()
    h1.complete()
    assert bits_equal(y0, eager[0][1]) and bits_equal(y1, eager[1][1])
    with pytest.raises(RuntimeError, match=r"no op sent with send_only=True pending"):
        h1.complete()
    h3 = group.create_handle(p2.topk_idx[rank])
    with pytest.raises(RuntimeError, match=r"has not dispatched yet"):
        h3.combine(eo2, cw2)
    # The group still works after all of it, with the oracle's bits.
    cfg = group.config
    assert not ll_cases.dispatch_mismatches(o2, ll_oracle.ll_dispatch_all(
        cfg, world, p2.topk_idx, p2.x, p2.weights)[rank], layout)
    y2 = h2.combine(eo2, cw2)
    assert bits_equal(y2, ll_oracle.ll_combine_all(
        cfg, world, p2.topk_idx, ll_cases.expert_outputs(p2, layout, counts2, seed + 22),
        ll_cases.fresh_weights(p2, seed + 32) if em else None)[rank])


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("layout,payload_dtype", [("expert_major", None), ("rank_major", FP8)])
def test_ll_send_only_two_micro_batches(layout, payload_dtype, world_size, seed):
    dist.run(world_size, check_two_micro_batches, layout, payload_dtype, seed)


def check_op_two_behind_a_pending_one(layout: str, seed: int) -> None:
    """An op may not write the buffer set a pending op of its kind still holds: after a fused
    op, and after an out-of-order complete(), the next op is refused (on every rank) until the
    older one completes; then the group gives the oracle's bits."""
    rank, world = ep_cases.rank_and_size()
    ps = [ll_cases.make_ll_problem(world, (5, 6), 128, 8, 3, torch.bfloat16, seed=seed + i)
          for i in range(3)]
    group = ep.Group(backend="torch", device="cpu", **ps[0].group_fields(layout))
    hs = [group.create_handle(p.topk_idx[rank]) for p in ps]

    def dispatch(i, **kw):
        return hs[i].dispatch(ps[i].x[rank], ps[i].weights[rank], **kw)

    stale = r"the dispatch sent with send_only=True 2 dispatches before this one is not completed"
    dispatch(0, send_only=True)
    dispatch(1)  # one op behind the pending one: the other set
    with pytest.raises(RuntimeError, match=stale):
        dispatch(2)
    hs[0].complete()
    dispatch(0, send_only=True)
    dispatch(1, send_only=True)
    hs[1].complete()  # out of order: hs[0]'s op is still pending
    with pytest.raises(RuntimeError, match=stale):
        dispatch(2, send_only=True)
    hs[0].complete()
    out = dispatch(2)
    p = ps[2]
    assert not ll_cases.dispatch_mismatches(out, ll_oracle.ll_dispatch_all(
        group.config, world, p.topk_idx, p.x, p.weights)[rank], layout)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_ll_op_two_behind_a_pending_one_is_refused(layout, world_size, seed):
    dist.run(world_size, check_op_two_behind_a_pending_one, layout, seed)


# ------------------------------------------------------------------------------------------------
# errors, on every rank
# ------------------------------------------------------------------------------------------------

E, H, T_MAX, K_MAX = 8, 128, 6, 3


def error_setup(layout: str, seed: int, **fields):
    rank, world = ep_cases.rank_and_size()
    problem = ll_cases.make_ll_problem(world, (5, 6), H, E, K_MAX, torch.bfloat16, seed=seed,
                                       max_tokens=T_MAX)
    group = ep.Group(backend="torch", device="cpu",
                     **dict(problem.group_fields(layout), **fields))
    return rank, world, problem, group


def check_still_usable(group, problem, rank: int, world: int, layout: str, seed: int) -> None:
    """A correct dispatch and combine after the error, with the oracle's bits."""
    handle = group.create_handle(problem.topk_idx[rank])
    out = handle.dispatch(problem.x[rank], problem.weights[rank])
    cfg = group.config
    want = ll_oracle.ll_dispatch_all(cfg, world, problem.topk_idx, problem.x, problem.weights)
    assert not ll_cases.dispatch_mismatches(out, want[rank], layout)
    eo = ll_cases.expert_outputs(problem, layout, [w.count for w in want], seed + 5)
    cw = ll_cases.fresh_weights(problem, seed + 6) if layout == "expert_major" else None
    y = handle.combine(eo[rank], None if cw is None else cw[rank])
    assert bits_equal(y, ll_oracle.ll_combine_all(cfg, world, problem.topk_idx, eo, cw)[rank])


def edited_routing(kind: str, idx: torch.Tensor) -> torch.Tensor:
    idx = idx.clone()
    if kind == "out_of_range":
        idx[1, 0] = E
    elif kind == "below_minus_one":
        idx[1, 0] = -2
    else:  # repeated
        idx[1, 1] = idx[1, 0] if idx[1, 0] >= 0 else 3
        idx[1, 0] = idx[1, 1]
    return idx


ROUTING_ERRORS = {"out_of_range": rf"topk_idx\[1, 0\] = {E} is out of range",
                  "below_minus_one": r"topk_idx\[1, 0\] = -2 is out of range",
                  "repeated": r"token 1 names expert \d+ twice"}


def check_routing_value_error(kind: str, bad_rank: int, layout: str, seed: int) -> None:
    """No communication at creation: the handle is made on every rank; its dispatch raises on
    every rank, naming the bad rank; the group stays usable."""
    rank, world, problem, group = error_setup(layout, seed)
    idx = problem.topk_idx[rank]
    handle = group.create_handle(edited_routing(kind, idx) if rank == bad_rank else idx)
    where = "" if world == 1 else rf" \(rank {bad_rank}\)"
    with pytest.raises(ValueError, match=ROUTING_ERRORS[kind] + r".*" + where):
        handle.dispatch(problem.x[rank], problem.weights[rank])
    check_still_usable(group, problem, rank, world, layout, seed)


@pytest.mark.parametrize("world_size,bad_rank", [(1, 0), (2, 1), (4, 2)], ids=str)
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
@pytest.mark.parametrize("kind", list(ROUTING_ERRORS))
def test_ll_routing_value_error_on_every_rank(kind, layout, world_size, bad_rank, seed):
    dist.run(world_size, check_routing_value_error, kind, bad_rank, layout, seed, timeout=60)


def _rows(out):
    return torch.zeros(out.x.shape, dtype=torch.bfloat16)


# name -> (layout, op, the bad call(handle, x, w, expert_out rows, combine weights),
#          exception type, pattern)
ARGUMENT_ERRORS = {
    "x_wrong_dtype": ("expert_major", "LL dispatch",
                      lambda h, x, w, eo, cw: h.dispatch(x.float(), w), TypeError,
                      r"x must have dtype torch\.bfloat16, got torch\.float32"),
    "x_wrong_hidden": ("rank_major", "LL dispatch",
                       lambda h, x, w, eo, cw: h.dispatch(x[:, :-1], w), ValueError,
                       rf"x must have shape \(\d+, {H}\)"),
    "x_wrong_tokens": ("expert_major", "LL dispatch",
                       lambda h, x, w, eo, cw: h.dispatch(x[:-1], w), ValueError,
                       r"x must have shape"),
    "x_wrong_device": ("rank_major", "LL dispatch",
                       lambda h, x, w, eo, cw: h.dispatch(x.to("meta"), w), ValueError,
                       r"x must be on cpu, got meta"),
    "weights_wrong_shape": ("rank_major", "LL dispatch",
                            lambda h, x, w, eo, cw: h.dispatch(x, w[:, :1]), ValueError,
                            r"topk_weights must have shape"),
    "weights_integer": ("expert_major", "LL dispatch",
                        lambda h, x, w, eo, cw: h.dispatch(x, w.long()), TypeError,
                        r"topk_weights must have dtype"),
    "expert_out_wrong_shape": ("expert_major", "LL combine",
                               lambda h, x, w, eo, cw: h.combine(eo[:, :-1], cw), ValueError,
                               r"expert_out must have shape"),
    "expert_out_wrong_dtype": ("rank_major", "LL combine",
                               lambda h, x, w, eo, cw: h.combine(eo.half(), None), TypeError,
                               r"expert_out must have dtype"),
    "combine_weights_wrong_shape": ("expert_major", "LL combine",
                                    lambda h, x, w, eo, cw: h.combine(eo, cw[:-1]), ValueError,
                                    r"topk_weights must have shape"),
    "rank_major_combine_with_weights": ("rank_major", "LL combine",
                                        lambda h, x, w, eo, cw: h.combine(eo, w), TypeError,
                                        r"rank_major\): topk_weights must be None"),
    "expert_major_combine_without_weights": ("expert_major", "LL combine",
                                             lambda h, x, w, eo, cw: h.combine(eo, None),
                                             TypeError, r"topk_weights \[T, K\] is required"),
}


def check_argument_error(case_name: str, bad_rank: int, seed: int) -> None:
    """The bad rank raises its own error, every other rank a ValueError naming it; the group
    stays usable."""
    layout, op, call, exc, pattern = ARGUMENT_ERRORS[case_name]
    rank, world, problem, group = error_setup(layout, seed)
    x, w = problem.x[rank], problem.weights[rank]
    handle = group.create_handle(problem.topk_idx[rank])
    cw = ll_cases.fresh_weights(problem, seed + 1)[rank]
    good = {"LL dispatch": lambda eo: handle.dispatch(x, w),
            "LL combine": lambda eo: handle.combine(eo, cw if layout == "expert_major"
                                                    else None)}
    eo = None
    if op == "LL combine":
        eo = _rows(handle.dispatch(x, w))
    if rank == bad_rank:
        with pytest.raises(exc, match=pattern):
            call(handle, x, w, eo, cw)
    else:
        with pytest.raises(ValueError, match=rf"{op}: rank {bad_rank} passed wrong arguments "
                                             rf"\(.*\); every rank of the group raises"):
            good[op](eo)
    check_still_usable(group, problem, rank, world, layout, seed)


@pytest.mark.parametrize("world_size,bad_rank", [(1, 0), (2, 1), (4, 0)], ids=str)
@pytest.mark.parametrize("case_name", list(ARGUMENT_ERRORS))
def test_ll_argument_error_on_every_rank(case_name, world_size, bad_rank, seed):
    dist.run(world_size, check_argument_error, case_name, bad_rank, seed, timeout=60)


CREATE_ERRORS = {
    "too_many_tokens": (lambda i: torch.cat([i, i, i])[:T_MAX + 1], ValueError,
                        rf"{T_MAX + 1} tokens, more than max_tokens_per_rank \(T_max\)="
                        rf"{T_MAX}"),
    "topk_above_max_topk": (lambda i: torch.cat([i, i[:, :1]], 1), ValueError,
                            rf"top-k {K_MAX + 1}, expected 1 <= top-k <= max_topk={K_MAX}"),
    "topk_idx_float": (lambda i: i.float(), TypeError, r"topk_idx must have dtype"),
}


def check_create_handle_error(case_name: str, bad_rank: int, seed: int) -> dict:
    """Handle creation does not communicate: the bad rank raises and stops the group; each
    peer's next collective raises at once (well before timeout_s), naming the bad rank."""
    edit, exc, pattern = CREATE_ERRORS[case_name]
    rank, world, problem, group = error_setup("expert_major", seed, timeout_s=60.0)
    idx = problem.topk_idx[rank]
    if rank == bad_rank:
        with pytest.raises(exc, match=pattern):
            group.create_handle(edit(idx))
        if world > 1:  # the group is dead here too
            handle = group.create_handle(idx)
            with pytest.raises(ep.NcclEpError, match=r"stopped"):
                handle.dispatch(problem.x[rank], problem.weights[rank])
        return {}
    handle = group.create_handle(idx)
    start = time.monotonic()
    with pytest.raises(ep.NcclEpError, match=rf"rank {bad_rank} stopped this group"):
        handle.dispatch(problem.x[rank], problem.weights[rank])
    return {"waited_s": time.monotonic() - start}


@pytest.mark.parametrize("world_size,bad_rank", [(1, 0), (2, 0), (4, 3)], ids=str)
@pytest.mark.parametrize("case_name", list(CREATE_ERRORS))
def test_ll_create_handle_error_names_the_rank(case_name, world_size, bad_rank, seed):
    results = dist.run(world_size, check_create_handle_error, case_name, bad_rank, seed,
                       timeout=90)
    waited = [r["waited_s"] for r in results if r]
    assert len(waited) == world_size - 1 and all(w < 20 for w in waited), waited


def check_weights_on_some_ranks(seed: int) -> None:
    rank, world, problem, group = error_setup("rank_major", seed)
    handle = group.create_handle(problem.topk_idx[rank])
    with pytest.raises(ValueError, match=r"topk_weights given on ranks \[0\] but not on the "
                                         r"others"):
        handle.dispatch(problem.x[rank], problem.weights[rank] if rank == 0 else None)
    check_still_usable(group, problem, rank, world, "rank_major", seed)


def test_ll_weights_on_some_ranks_only(seed):
    dist.run(2, check_weights_on_some_ranks, seed, timeout=60)


def check_fp8_hidden(hidden: int) -> None:
    with pytest.raises(ValueError, match=rf"payload_dtype torch.float8_e4m3fn casts blocks of "
                                         rf"128 columns: hidden must be a multiple of 128, "
                                         rf"got {hidden}"):
        ep.Group(mode="ll", payload_dtype=FP8, num_experts=8, hidden=hidden,
                 max_tokens_per_rank=4, max_topk=2, backend="torch", device="cpu")


@pytest.mark.parametrize("world_size", [1, 2])
def test_ll_fp8_needs_hidden_multiple_of_128(world_size):
    dist.run(world_size, check_fp8_hidden, 128 + 8 * world_size)


def test_one_process_oracle_checks_its_inputs(seed):
    problem = ll_cases.make_ll_problem(2, 4, H, E, 2, torch.bfloat16, seed=seed)
    cfg = ep.GroupConfig(**{k: v for k, v in problem.group_fields("rank_major").items()})
    idx = [problem.topk_idx[0], edited_routing("repeated", problem.topk_idx[1])]
    with pytest.raises(ValueError, match=r"names expert \d+ twice.*\(rank 1\)"):
        ll_oracle.ll_dispatch_all(cfg, 2, idx, problem.x, problem.weights)
    with pytest.raises(ValueError, match=r"topk_weights given on ranks \[1\]"):
        ll_oracle.ll_dispatch_all(cfg, 2, problem.topk_idx, problem.x,
                                  [None, problem.weights[1]])
