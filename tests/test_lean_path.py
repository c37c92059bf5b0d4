"""No wrong call gets through after valid ones, on the lean path (backend.checked_call): a
backend that checks its calls gets each call as given, and the front end's checks run only on a
call it refused. After valid calls of every op, a call with another shape, dtype or device, a
non-tensor, a destroyed handle or group, a wrong routing for a new handle, or (LL) a wrong
``out=`` raises exactly the error the front end's own check raises for those arguments, and the
group stays usable with the oracle's bits.

Each case proves the path it took (``Spy``): a call that reaches the backend is refused there
(the op was called with the wrong arguments and raised), and what the caller gets is the front
end's error, not that refusal (its message, where the two layers' texts differ, and in any case
another exception object); a call the front end refuses first (a destroyed handle, an ``out``
that is no LLDispatchOutput) never reaches the backend.

Here the backend is ``CheckedReference``: the reference backend whose ops first run the C
library's own checks of the call (``_C.check_*``: csrc/runtime/call_checks.h, the checks each
cuda op runs before it enqueues anything, on host tensors), at world sizes 1 and 2, HT in exact
and capacity mode and LL in both layouts; it needs the library built (not a GPU).
tests/gpu/test_cuda_lean_path.py runs the same cases on the cuda backend (local teams of 1 and 2
ranks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dense
import dist
import ep_cases
import ll_cases
import ll_oracle
import megatron_nccl_ep as ep
from megatron_nccl_ep import build_info
from megatron_nccl_ep.api import Group, Handle
from megatron_nccl_ep.config import GroupConfig
from megatron_nccl_ep.ll import LLHandle
from megatron_nccl_ep.outputs import FIELDS, LLDispatchOutput, ll_dispatch_fields
from megatron_nccl_ep.reference import ReferenceBackend

NOT_BUILT = build_info.not_built_reason()
needs_library = pytest.mark.skipif(NOT_BUILT is not None, reason=NOT_BUILT or "")

E, H, T, K = 8, 16, 6, 3
HT_MODES = ("exact", "capacity")


class CheckedReference(ReferenceBackend):
    """The reference backend as a backend that checks its calls (``checks_calls``): each op runs
    its binding's ``_C.check_*`` first (the cuda op's binding glue and the C library's checks of
    the call against the handle's shape, on host tensors), which refuses a call the cuda backend
    would refuse, with the same error; then the reference op."""

    checks_calls = True

    def __init__(self, config: GroupConfig, process_group, device=None):
        super().__init__(config, process_group, device)
        from megatron_nccl_ep import _C, cuda_backend

        self._C, self._c_config = _C, cuda_backend._c_config(config)
        self._ll_outputs = (tuple(
            _C.LLOutputs(list(zip(FIELDS, ll_dispatch_fields(config, self.world_size, w))))
            for w in (False, True)) if config.mode == "ll" else None)

    def _shape(self, state=None):
        if state is None:  # handle creation: the group's alone
            return self._C.CallShape(self._c_config, self.world_size)
        tokens, topk = state.topk_idx.shape
        return self._C.CallShape(self._c_config, self.world_size, tokens, topk,
                                 state.num_recv_tokens)

    def create_handle(self, routing, from_map):
        self._C.check_create_handle(self._shape(), routing, from_map)
        return super().create_handle(routing, from_map)

    def dispatch(self, state, x, probs, dense, backward=None):
        self._C.check_dispatch(self._shape(state), x, probs, dense)
        return super().dispatch(state, x, probs, dense, backward)

    def combine(self, state, expert_out, backward=None):
        self._C.check_combine(self._shape(state), expert_out, self.config.dtype)
        return super().combine(state, expert_out, backward)

    def combine_probs(self, state, grad_recv_probs, dense):
        self._C.check_combine_topk_weights(self._shape(state), grad_recv_probs, dense)
        return super().combine_probs(state, grad_recv_probs, dense)

    def ll_create_handle(self, topk_idx):
        self._C.check_create_handle(self._shape(), topk_idx, False)
        return super().ll_create_handle(topk_idx)

    def ll_dispatch(self, state, x, topk_weights, send_only, out=None):
        self._C.check_ll_dispatch(self._shape(state), x, topk_weights, send_only,
                                  self._ll_outputs[topk_weights is not None], out)
        return super().ll_dispatch(state, x, topk_weights, send_only, out)

    def ll_combine(self, state, expert_out, topk_weights, send_only, out=None):
        self._C.check_ll_combine(self._shape(state), expert_out, topk_weights, send_only, out,
                                 self.config.dtype)
        return super().ll_combine(state, expert_out, topk_weights, send_only, out)


def checked_group(**fields) -> Group:
    """This rank's group (torch.distributed's, or one rank) on ``CheckedReference``, on the CPU."""
    rank, world = ep_cases.rank_and_size()
    config = GroupConfig.build(world, **fields)
    config.check_rules(world)
    process_group = torch.distributed.group.WORLD if world > 1 else None
    cpu = torch.device("cpu")
    group = Group.__new__(Group)  # no rendezvous: every rank builds the same configuration
    group._set_up(process_group, rank, world, cpu, config, CheckedReference(config,
                                                                            process_group, cpu))
    return group


@dataclasses.dataclass
class Call:
    op: str
    args: tuple
    error: Exception | None


class Spy:
    """Records every call of the backend ops of ``group``'s backend (this instance's), with the
    exception each raised."""

    OPS = ("create_handle", "dispatch", "combine", "combine_probs", "ll_create_handle",
           "ll_dispatch", "ll_combine")

    def __init__(self, group: Group):
        self.calls: list = []
        backend = group._backend
        for op in self.OPS:
            setattr(backend, op, self._wrap(op, getattr(backend, op)))

    def _wrap(self, op, method):
        def call(*args):
            try:
                result = method(*args)
            except Exception as exc:
                self.calls.append(Call(op, args, exc))
                raise
            self.calls.append(Call(op, args, None))
            return result
        return call


# The front end's own check of each op's arguments (what checked_call runs on a refusal), by
# op, and whose method it is.
FRONT_CHECKS = {
    "create_handle": ("group", Group._check_routing),
    "ll_create_handle": ("group", Group._check_ll_routing),
    "dispatch": ("handle", Handle._check_dispatch),
    "combine": ("handle", Handle._check_combine),
    "combine_probs": ("handle", Handle._check_combine_probs),
    "ll_dispatch": ("handle", LLHandle._check_dispatch),
    "ll_combine": ("handle", LLHandle._check_combine),
}


def front_end_error(call: Call, handle, group) -> Exception:
    """The error the front end's own check raises for the arguments of ``call``, called
    directly (collective where the backend agrees on arguments: every rank calls it)."""
    owner, check = FRONT_CHECKS[call.op]
    try:
        check(handle if owner == "handle" else group, *call.args)
    except (TypeError, ValueError) as exc:
        return exc
    raise AssertionError(f"the front end's check of {call.op} passed its arguments")


def assert_layer(spy: Spy, raised: Exception, op, handle, group) -> None:
    """``op`` None: the call never reached the backend. Else it reached the backend's ``op``
    once, with the wrong arguments, which refused it; and what was raised is the front end's
    error for those arguments (type and message), another object than the refusal."""
    if op is None:
        assert spy.calls == [], [c.op for c in spy.calls]
        return
    assert [c.op for c in spy.calls] == [op], [c.op for c in spy.calls]
    refused = spy.calls[0]
    assert isinstance(refused.error, (TypeError, ValueError)), refused.error
    assert raised is not refused.error, f"the backend's refusal got through: {raised}"
    front = front_end_error(refused, handle, group)
    assert (type(raised), str(raised)) == (type(front), str(front))


def raises(exc, pattern: str, group):
    return pytest.raises(exc, match=pattern.replace("<device>", str(group.device)))


# ------------------------------------------------------------------------------------------------
# HT, exact and capacity mode
# ------------------------------------------------------------------------------------------------

def ht_fields(mode: str, world: int) -> dict:
    """A group's fields; capacity mode with room for every row a rank can receive."""
    fields = dict(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                  dtype=torch.bfloat16)
    if mode == "capacity":
        fields.update(recv_mode="capacity", max_recv_tokens_per_rank=world * T * K)
    return fields


def ht_setup(seed: int, rank: int, world: int, group: Group):
    problem = dense.make_problem(seed, world, tokens=T, hidden=H, num_experts=E, topk=K,
                                 dtype=torch.bfloat16)
    x, idx, probs = ep_cases.share(problem, rank, device=group.device)
    return problem, x, idx, probs


def ht_oracle(problem, rank: int, group: Group):
    """This rank's expected (recv_x, recv_probs) on the CPU."""
    capacity = (group.config.max_recv_tokens_per_rank if group.config.recv_mode == "capacity"
                else None)
    want_x, want_p, _, _ = dense.dispatch(problem, rank, capacity=capacity)
    return want_x, want_p


def rows_like(handle, **kw):
    return torch.ones(handle.num_recv_tokens, H, dtype=kw.get("dtype", torch.bfloat16),
                      device=kw.get("device", handle.group.device))


# name -> (the wrong call (handle, group, x, probs), exception type, pattern), each made after
# valid calls of every op on the same handle. HT_OP: the backend op each reaches (None: none).
HT_WRONG = {
    "x_wrong_hidden": (lambda h, g, x, p: h.dispatch(x[:, :-1], p), ValueError,
                       rf"x must have shape \({T}, {H}\), got \({T}, {H - 1}\)"),
    "x_wrong_tokens": (lambda h, g, x, p: h.dispatch(torch.cat([x, x[:1]]), p), ValueError,
                       rf"x must have shape \({T}, {H}\), got \({T + 1}, {H}\)"),
    "x_wrong_dtype": (lambda h, g, x, p: h.dispatch(x.float(), p), TypeError,
                      r"x must have dtype .*bfloat16.*got torch\.float32"),
    "x_wrong_device": (lambda h, g, x, p: h.dispatch(x.to("meta"), p), ValueError,
                       r"x must be on <device>, got meta"),
    "x_3d": (lambda h, g, x, p: h.dispatch(x[None], p), ValueError, r"x must be 2-D"),
    "x_not_a_tensor": (lambda h, g, x, p: h.dispatch(x.tolist(), p), TypeError,
                       r"x must be a torch\.Tensor, got list"),
    "probs_wrong_shape": (lambda h, g, x, p: h.dispatch(x, p[:, :1]), ValueError,
                          rf"probs must have shape \({T}, {K}\)"),
    "probs_integer": (lambda h, g, x, p: h.dispatch(x, (p * 10).long()), TypeError,
                      r"probs must have dtype .*got torch\.int64"),
    "expert_out_wrong_rows": (lambda h, g, x, p: h.combine(rows_like(h)[:-1]), ValueError,
                              r"expert_out must have shape"),
    "expert_out_wrong_dtype": (lambda h, g, x, p: h.combine(rows_like(h, dtype=torch.float16)),
                               TypeError, r"expert_out must have dtype"),
    "expert_out_wrong_device": (lambda h, g, x, p: h.combine(rows_like(h, device="meta")),
                                ValueError, r"expert_out must be on <device>, got meta"),
    "grad_recv_probs_wrong_shape": (
        lambda h, g, x, p: h.combine_probs(p.new_ones(h.num_recv_tokens + 2)), ValueError,
        r"grad_recv_probs must have shape"),
    "grad_recv_probs_integer": (
        lambda h, g, x, p: h.combine_probs(p.new_ones(h.num_recv_tokens, dtype=torch.int32)),
        TypeError, r"grad_recv_probs must have dtype in"),
    "create_routing_map_uint8": (
        lambda h, g, x, p: g.create_handle(routing_map=torch.ones(T, E, dtype=torch.uint8,
                                                                  device=g.device)),
        TypeError, r"routing_map must have dtype torch\.bool, got torch\.uint8"),
    "create_routing_map_wrong_experts": (
        lambda h, g, x, p: g.create_handle(routing_map=torch.ones(T, E + 1, dtype=torch.bool,
                                                                  device=g.device)),
        ValueError, rf"routing_map must have shape \('\*', {E}\), got \({T}, {E + 1}\)"),
    "create_topk_idx_float": (lambda h, g, x, p: g.create_handle(h.topk_idx.float()), TypeError,
                              r"topk_idx must have dtype"),
    "create_topk_idx_not_a_tensor": (lambda h, g, x, p: g.create_handle(h.topk_idx.tolist()),
                                     TypeError, r"topk_idx must be a torch\.Tensor, got list"),
    "create_topk_idx_wrong_device": (lambda h, g, x, p: g.create_handle(h.topk_idx.to("meta")),
                                     ValueError, r"topk_idx must be on <device>, got meta"),
    "destroyed_handle": (lambda h, g, x, p: (h.destroy(), h.dispatch(x, p)), RuntimeError,
                         r"this Handle was destroyed"),
    "destroyed_group": (lambda h, g, x, p: (g.destroy(), h.combine(rows_like(h))), RuntimeError,
                        r"this Group was destroyed"),
}


HT_OP = {name: next((op for prefix, op in (("x_", "dispatch"), ("probs_", "dispatch"),
                                            ("expert_out_", "combine"),
                                            ("grad_recv_probs_", "combine_probs"),
                                            ("create_", "create_handle"))
                       if name.startswith(prefix)), None) for name in HT_WRONG}


def check_ht_wrong_after_valid(case_name: str, seed: int, rank: int, world: int,
                               group: Group) -> None:
    wrong, exc, pattern = HT_WRONG[case_name]
    problem, x, idx, probs = ht_setup(seed, rank, world, group)
    handle = group.create_handle(idx)
    for _ in range(2):  # the signature of a valid call, twice
        recv_x, recv_p = handle.dispatch(x, probs)
        handle.combine(recv_x)
        handle.combine_probs(recv_p)
    spy = Spy(group)
    with raises(exc, pattern, group) as raised:
        wrong(handle, group, x, probs)
    assert_layer(spy, raised.value, HT_OP[case_name], handle, group)
    if case_name.startswith("destroyed"):
        return
    recv_x, recv_p = handle.dispatch(x, probs)  # still usable, with the oracle's bits
    want_x, want_p = ht_oracle(problem, rank, group)
    dense.assert_bitwise_equal(recv_x.cpu(), want_x, "recv_x after the wrong call")
    dense.assert_bitwise_equal(recv_p.cpu(), want_p, "recv_probs after the wrong call")


def on_checked_reference(check, fields: dict, *args) -> None:
    """``check(*args, rank, world, group)`` on this rank's ``CheckedReference`` group."""
    rank, world = ep_cases.rank_and_size()
    group = checked_group(**fields)
    try:
        check(*args, rank, world, group)
    finally:
        group.destroy()


def run_ht(world: int, mode: str, check, *args) -> None:
    dist.run(world, on_checked_reference, check, ht_fields(mode, world), *args, timeout=60)


@needs_library
@pytest.mark.parametrize("mode", HT_MODES)
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("case_name", list(HT_WRONG))
def test_ht_wrong_call_after_valid_calls_raises(case_name, world_size, mode, seed):
    run_ht(world_size, mode, check_ht_wrong_after_valid, case_name, seed)


def check_ht_strided_after_contiguous(seed: int, rank: int, world: int, group: Group) -> None:
    """A strided input after a contiguous one is copied, not read as if contiguous."""
    _, x, idx, probs = ht_setup(seed, rank, world, group)
    handle = group.create_handle(idx)
    recv_x, recv_p = handle.dispatch(x, probs)
    y = handle.combine(recv_x)
    strided_x = x.t().contiguous().t()
    strided_rows = recv_x.t().contiguous().t()
    assert not strided_x.is_contiguous() and not strided_rows.is_contiguous()
    again_x, again_p = handle.dispatch(strided_x, probs.t().contiguous().t())
    dense.assert_bitwise_equal(again_x, recv_x, "recv_x of a strided x")
    dense.assert_bitwise_equal(again_p, recv_p, "recv_probs of strided probs")
    dense.assert_bitwise_equal(handle.combine(strided_rows), y, "y of strided rows")


@needs_library
@pytest.mark.parametrize("mode", HT_MODES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_ht_strided_input_after_contiguous_is_copied(world_size, mode, seed):
    run_ht(world_size, mode, check_ht_strided_after_contiguous, seed)


def check_ht_strided_routing(seed: int, rank: int, world: int, group: Group) -> None:
    """A strided routing (top-k ids, a routing map) gives the handle its contiguous copy gives
    (the cuda backend's binding refuses it, and the front end passes a contiguous copy)."""
    _, x, idx, probs = ht_setup(seed, rank, world, group)
    want_x, want_p = group.create_handle(idx).dispatch(x, probs)
    strided = idx.t().contiguous().t()
    assert not strided.is_contiguous()
    got_x, got_p = group.create_handle(strided).dispatch(x, probs)
    dense.assert_bitwise_equal(got_x, want_x, "recv_x of a strided topk_idx")
    dense.assert_bitwise_equal(got_p, want_p, "recv_probs of a strided topk_idx")
    routing_map = torch.zeros(idx.shape[0], E, dtype=torch.bool, device=idx.device)
    routing_map.scatter_(1, idx.clamp(min=0), idx >= 0)
    want_rows = group.create_handle(routing_map=routing_map).dispatch(x)[0]
    strided_map = routing_map.t().contiguous().t()
    assert not strided_map.is_contiguous()
    got_rows = group.create_handle(routing_map=strided_map).dispatch(x)[0]
    dense.assert_bitwise_equal(got_rows, want_rows, "recv_x of a strided routing_map")


@needs_library
@pytest.mark.parametrize("mode", HT_MODES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_ht_strided_routing_makes_the_same_handle(world_size, mode, seed):
    run_ht(world_size, mode, check_ht_strided_routing, seed)


# ------------------------------------------------------------------------------------------------
# LL: the same, and out=
# ------------------------------------------------------------------------------------------------

T_MAX, K_MAX, LL_H = 6, 3, 128


LAYOUTS = ("expert_major", "rank_major")


def ll_problem(world: int, seed: int):
    return ll_cases.make_ll_problem(world, (5, 6), LL_H, E, K_MAX, torch.bfloat16, seed=seed,
                                    max_tokens=T_MAX)


def ll_fields(layout: str) -> dict:
    return ll_problem(1, 0).group_fields(layout)


def run_ll(world: int, layout: str, check, *args) -> None:
    dist.run(world, on_checked_reference, check, ll_fields(layout), *args, timeout=60)


def bits_equal(a, b) -> bool:
    return ep_cases.count_mismatches(a.cpu(), b.cpu()) == 0


def other_out(out: LLDispatchOutput, **fields) -> LLDispatchOutput:
    kept = {name: getattr(out, name) for name in ("x", "count", "scales", "src", "topk_idx",
                                                  "topk_weights")}
    kept.update(fields)
    return LLDispatchOutput(**kept)


def ll_inputs(problem, rank: int, layout: str, seed: int, world: int, group):
    """This rank's tokens and weights, every rank's expected dispatch (CPU), this rank's expert
    outputs and combine weights, on the group's device."""
    dev = group.device
    x, w = problem.x[rank].to(dev), problem.weights[rank].to(dev)
    want = ll_oracle.ll_dispatch_all(group.config, world, problem.topk_idx, problem.x,
                                     problem.weights)
    eo = ll_cases.expert_outputs(problem, layout, [d.count for d in want], seed + 5)
    cw = ll_cases.fresh_weights(problem, seed + 6) if layout == "expert_major" else None
    return x, w, want, eo[rank].to(dev), None if cw is None else cw[rank].to(dev)


# name -> (layout, the wrong call (handle, x, w, out, expert_out, combine weights), exception,
# pattern), each after valid dispatches and combines of the same handle.
LL_WRONG = {
    "x_wrong_shape": ("rank_major", lambda h, x, w, o, eo, cw: h.dispatch(x[:, :-8], w),
                      ValueError, r"x must have shape"),
    "x_wrong_dtype": ("expert_major", lambda h, x, w, o, eo, cw: h.dispatch(x.half(), w),
                      TypeError, r"x must have dtype"),
    "x_wrong_device": ("rank_major", lambda h, x, w, o, eo, cw: h.dispatch(x.to("meta"), w),
                       ValueError, r"x must be on <device>, got meta"),
    "weights_wrong_shape": ("rank_major", lambda h, x, w, o, eo, cw: h.dispatch(x, w[:, :1]),
                            ValueError, r"topk_weights must have shape"),
    "weights_integer": ("expert_major", lambda h, x, w, o, eo, cw: h.dispatch(x, w.long()),
                        TypeError, r"topk_weights must have dtype"),
    "expert_out_wrong_shape": ("expert_major",
                               lambda h, x, w, o, eo, cw: h.combine(eo[:, :-1], cw),
                               ValueError, r"expert_out must have shape"),
    "expert_out_wrong_dtype": ("rank_major", lambda h, x, w, o, eo, cw: h.combine(eo.half()),
                               TypeError, r"expert_out must have dtype"),
    "combine_weights_wrong_shape": ("expert_major",
                                    lambda h, x, w, o, eo, cw: h.combine(eo, cw[:-1]),
                                    ValueError, r"topk_weights must have shape"),
    "out_not_an_output": ("rank_major", lambda h, x, w, o, eo, cw: h.dispatch(x, w, out=o.x),
                          TypeError, r"out must be an LLDispatchOutput"),
    "out_x_wrong_shape": ("expert_major", lambda h, x, w, o, eo, cw: h.dispatch(
        x, w, out=other_out(o, x=o.x[:, :-1])), ValueError, r"out\.x must have shape"),
    "out_count_wrong_dtype": ("rank_major", lambda h, x, w, o, eo, cw: h.dispatch(
        x, w, out=other_out(o, count=o.count.long())), TypeError, r"out\.count must have dtype"),
    "out_without_weights": ("rank_major", lambda h, x, w, o, eo, cw: h.dispatch(
        x, w, out=other_out(o, topk_weights=None)), ValueError,
        r"out\.topk_weights is required"),
    "out_with_weights_not_sent": ("rank_major", lambda h, x, w, o, eo, cw: h.dispatch(
        x, None, out=o), ValueError, r"out\.topk_weights must be None"),
    "out_strided": ("rank_major", lambda h, x, w, o, eo, cw: h.dispatch(
        x, w, out=other_out(o, topk_idx=o.topk_idx.t().contiguous().t())), ValueError,
        r"out\.topk_idx must be contiguous"),
    "combine_out_wrong_shape": ("rank_major", lambda h, x, w, o, eo, cw: h.combine(
        eo, out=x.new_empty((x.shape[0] + 1, LL_H))), ValueError, r"out must have shape"),
    "combine_out_wrong_dtype": ("expert_major", lambda h, x, w, o, eo, cw: h.combine(
        eo, cw, out=x.new_empty(x.shape, dtype=torch.float32)), TypeError,
        r"out must have dtype"),
    "create_too_many_tokens": ("rank_major", lambda h, x, w, o, eo, cw: h.group.create_handle(
        torch.zeros(T_MAX + 1, K_MAX, dtype=torch.int64, device=x.device)), ValueError,
        rf"topk_idx has {T_MAX + 1} tokens, more than max_tokens_per_rank"),
    "create_topk_idx_float": ("expert_major", lambda h, x, w, o, eo, cw: h.group.create_handle(
        torch.zeros(T_MAX, K_MAX, device=x.device)), TypeError, r"topk_idx must have dtype"),
    "create_topk_idx_3d": ("rank_major", lambda h, x, w, o, eo, cw: h.group.create_handle(
        torch.zeros(1, T_MAX, K_MAX, dtype=torch.int64, device=x.device)), ValueError,
        r"topk_idx must be 2-D"),
    "create_topk_idx_not_a_tensor": (
        "rank_major", lambda h, x, w, o, eo, cw: h.group.create_handle([[0] * K_MAX] * T_MAX),
        TypeError, r"topk_idx must be a torch\.Tensor, got list"),
    "create_topk_idx_wrong_device": (
        "rank_major", lambda h, x, w, o, eo, cw: h.group.create_handle(
            torch.zeros(T_MAX, K_MAX, dtype=torch.int64, device="meta")), ValueError,
        r"topk_idx must be on <device>, got meta"),
    "destroyed_handle": ("rank_major", lambda h, x, w, o, eo, cw: (h.destroy(), h.dispatch(x, w)),
                         RuntimeError, r"this LLHandle was destroyed"),
    "destroyed_group": ("expert_major", lambda h, x, w, o, eo, cw: (h.group.destroy(),
                                                                    h.combine(eo, cw)),
                        RuntimeError, r"this Group was destroyed"),
    "destroyed_group_new_output": ("rank_major", lambda h, x, w, o, eo, cw: (
        h.group.destroy(), h.new_output(count=o.count)), RuntimeError, r"this Group was destroyed"),
}


# The backend op each LL case reaches (None: the front end refuses it first: a destroyed handle
# or group, or an out that is no LLDispatchOutput, which the lean path never takes).
LL_OP = {name: None if name.startswith("destroyed") or name == "out_not_an_output" else
         "ll_create_handle" if name.startswith("create_") else
         "ll_combine" if name.startswith(("expert_out", "combine")) else "ll_dispatch"
         for name in LL_WRONG}


def check_ll_wrong_after_valid(case_name: str, seed: int, rank: int, world: int,
                               group: Group) -> None:
    layout, wrong, exc, pattern = LL_WRONG[case_name]
    assert group.config.ll_layout == layout
    problem = ll_problem(world, seed)
    x, w, want, eo, cw = ll_inputs(problem, rank, layout, seed, world, group)
    handle = group.create_handle(problem.topk_idx[rank].to(group.device))
    for _ in range(2):  # the signature of a valid call, twice
        out = handle.dispatch(x, w)
        handle.combine(eo, cw)
    spy = Spy(group)
    with raises(exc, pattern, group) as raised:
        wrong(handle, x, w, out, eo, cw)
    assert_layer(spy, raised.value, LL_OP[case_name], handle, group)
    # A refused LL handle stops a reference group (no collective to agree in: its peers' next
    # one raises naming the rank), as a destroyed one ends its use.
    if case_name.startswith(("destroyed", "create_")):
        return
    out = handle.dispatch(x, w)  # still usable, with the oracle's bits
    assert not ll_cases.dispatch_mismatches(out, want[rank], layout)


@needs_library
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("case_name", list(LL_WRONG))
def test_ll_wrong_call_after_valid_calls_raises(case_name, world_size, seed):
    run_ll(world_size, LL_WRONG[case_name][0], check_ll_wrong_after_valid, case_name, seed)


def check_ll_strided_and_bf16_after_valid(seed: int, rank: int, world: int, group: Group) -> None:
    """After valid calls, a strided x is copied and bf16 weights are taken as the fp32 they are
    sent as: the bits of the same call with a contiguous x and those weights in fp32; a strided
    topk_idx makes the same handle."""
    layout, problem = group.config.ll_layout, ll_problem(world, seed)
    x, w, want, eo, cw = ll_inputs(problem, rank, layout, seed, world, group)
    handle = group.create_handle(problem.topk_idx[rank].to(group.device))
    for _ in range(2):
        handle.dispatch(x, w)
        handle.combine(eo, cw)
    w16 = w.bfloat16()
    exact = handle.dispatch(x, w16.float())
    strided = handle.dispatch(x.t().contiguous().t(), w16)
    assert not ll_cases.dispatch_mismatches(strided, exact, layout)
    # A strided topk_idx makes the same handle.
    idx = problem.topk_idx[rank].to(group.device)
    again = group.create_handle(idx.t().contiguous().t()).dispatch(x, w16.float())
    assert not ll_cases.dispatch_mismatches(again, exact, layout)


@needs_library
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ll_strided_x_and_bf16_weights_after_valid_calls(layout, world_size, seed):
    run_ll(world_size, layout, check_ll_strided_and_bf16_after_valid, seed)


def check_new_output(handle, fresh: LLDispatchOutput, with_weights: bool) -> LLDispatchOutput:
    """``new_output(count=...)``: the count given is kept as it is, every other field is a tensor
    of its own of the fresh output's shape and dtype (None where the layout has none), in memory
    no other field shares; an unknown field name is refused."""
    count = torch.full_like(fresh.count, -7)
    made = handle.new_output(with_weights, count=count)
    assert made.count is count
    spans = []
    for name, got, want in zip(FIELDS, vars(made).values(), vars(fresh).values()):
        assert (got is None) == (want is None), name
        if got is not None:
            assert (got.shape, got.dtype, got.device) == (want.shape, want.dtype, want.device)
            assert got.is_contiguous(), name
            spans.append((got.data_ptr(), got.data_ptr() + got.numel() * got.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans
    with pytest.raises(TypeError, match="no LLDispatchOutput field named 'counts'"):
        handle.new_output(with_weights, counts=count)
    return made


def check_ll_out_reused(seed: int, rank: int, world: int, group: Group) -> None:
    """out= gets the bits of fresh outputs (a new routing and new tokens each time), and is the
    object returned; bf16 weights are taken as the fp32 they are sent as."""
    layout, problem = group.config.ll_layout, ll_problem(world, seed)
    out, y = None, None
    for step in range(3):
        step_problem = ll_cases.make_ll_problem(world, (5, 6), LL_H, E, K_MAX, torch.bfloat16,
                                                seed=seed + 100 * step, max_tokens=T_MAX)
        x, w, want, eo, cw = ll_inputs(step_problem, rank, layout, seed + step, world, group)
        handle = group.create_handle(step_problem.topk_idx[rank].to(group.device))
        fresh = handle.dispatch(x, w)
        y_fresh = handle.combine(eo, cw)
        if out is None:  # the first step writes into new_output(count=...): another's tensor
            out = check_new_output(handle, fresh, w is not None)
        got = handle.dispatch(x, w, out=out)
        assert got is out
        assert not ll_cases.dispatch_mismatches(out, want[rank], layout)
        assert not ll_cases.dispatch_mismatches(out, fresh, layout)
        if y is None or y.shape != y_fresh.shape:
            y = torch.full_like(y_fresh, float("nan"))
        assert handle.combine(eo, cw, out=y) is y and bits_equal(y, y_fresh)
        if cw is not None:  # weights of another float dtype: converted, as without out=
            exact = cw.bfloat16().float()
            y_bf16 = handle.combine(eo, cw.bfloat16())
            assert bits_equal(y_bf16, handle.combine(eo, exact))


@needs_library
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ll_out_gets_the_bits_of_fresh_outputs(layout, world_size, seed):
    run_ll(world_size, layout, check_ll_out_reused, seed)


def check_ll_out_of_pending_op(seed: int, rank: int, world: int, group: Group) -> None:
    """An output that shares memory with one a send_only op still writes at complete() (any of
    its tensors, either kind) may not be given to another op: refused on every rank (a
    ValueError naming the rule); after complete() it may."""
    layout, problem = group.config.ll_layout, ll_problem(world, seed)
    x, w, want, eo, cw = ll_inputs(problem, rank, layout, seed, world, group)
    first, second = (group.create_handle(problem.topk_idx[rank].to(group.device))
                     for _ in range(2))
    pending = first.dispatch(x, w, send_only=True)
    shared = r"out shares memory with the output of a {} sent with send_only=True"
    with pytest.raises(ValueError, match=shared.format("dispatch")):
        second.dispatch(x, w, out=pending)
    with pytest.raises(ValueError, match=shared.format("dispatch")):  # its count only
        second.dispatch(x, w, out=other_out(pending, x=torch.empty_like(pending.x)))
    second.dispatch(x, w)
    y_shape = (x.shape[0], LL_H)
    inside_rows = pending.x.view(-1)[:x.shape[0] * LL_H].view(y_shape)  # a y inside its rows
    with pytest.raises(ValueError, match=shared.format("dispatch")):
        second.combine(eo, cw, out=inside_rows)
    first.complete()
    assert second.dispatch(x, w, out=pending) is pending
    assert not ll_cases.dispatch_mismatches(pending, want[rank], layout)
    y = first.combine(eo, cw, send_only=True)
    with pytest.raises(ValueError, match=shared.format("combine")):
        second.combine(eo, cw, out=y)
    first.complete()
    assert bits_equal(second.combine(eo, cw, out=y), first.combine(eo, cw))


@needs_library
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ll_out_of_a_pending_op_is_refused(layout, world_size, seed):
    run_ll(world_size, layout, check_ll_out_of_pending_op, seed)
