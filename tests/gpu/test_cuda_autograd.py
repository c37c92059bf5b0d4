"""Autograd on the cuda backend (EP=1): the bindings attach the backward to an op's outputs
(csrc/bindings/py_backward.h) instead of a torch.autograd.Function wrapping the op. The two ways
must give the same bits (outputs and every gradient, the reference backend's Functions being
checked against the same kernels in test_cuda_parity.py), keep the handle alive exactly as long as
the graph, materialize a missing gradient as zeros, and raise the backward's errors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import megatron_nccl_ep as ep
from gpu_common import dense_probs_of, poison_allocator, requires_gpus, this_device
from megatron_nccl_ep import autograd

pytestmark = requires_gpus

E, H, T, K = 16, 256, 37, 4


def setup(seed: int, recv_mode: str = "exact"):
    device = this_device()
    gen = torch.Generator(device=device).manual_seed(seed)
    extra = dict(recv_mode="capacity", max_recv_tokens_per_rank=T * K + 5) \
        if recv_mode == "capacity" else {}
    group = ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                     dtype=torch.bfloat16, backend="cuda", device=device, **extra)
    idx = torch.stack([torch.randperm(E, device=device, generator=gen)[:K] for _ in range(T)])
    idx[3, 1] = -1  # a masked slot
    x = torch.randn(T, H, device=device, generator=gen).bfloat16()
    probs = torch.rand(T, K, device=device, generator=gen)
    return group, idx, x, probs


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def step(handle, x, probs, dense, via_function: bool, use_probs_grad: bool = True):
    """dispatch -> weighted rows -> combine -> backward; every output and gradient."""
    poison_allocator(x.device)
    xg, pg = leaf(x), leaf(probs)
    if via_function:
        recv_x, recv_probs = autograd._Dispatch.apply(handle, xg, pg,
                                                      handle._settle_dense(pg, dense))
    else:
        recv_x, recv_probs = ep.dispatch(handle, xg, pg, dense=dense)
    rows = recv_x * recv_probs.unsqueeze(-1).to(recv_x.dtype) \
        if pg is not None and use_probs_grad else recv_x * 2
    y = autograd._Combine.apply(handle, rows) if via_function else ep.combine(handle, rows)
    grad_y = torch.randn(y.shape, device=y.device,
                         generator=torch.Generator(device=y.device).manual_seed(7)).to(y.dtype)
    y.backward(grad_y)
    torch.cuda.synchronize()
    return {"recv_x": recv_x, "recv_probs": recv_probs, "y": y, "grad_x": xg.grad,
            "grad_probs": None if pg is None else pg.grad,
            "grad_fns": (recv_x.grad_fn.name(), y.grad_fn.name())}


def assert_same_bits(a: dict, b: dict) -> None:
    for name in ("recv_x", "recv_probs", "y", "grad_x", "grad_probs"):
        if a[name] is None or b[name] is None:
            assert a[name] is None and b[name] is None, name
            continue
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.mark.parametrize("probs_form", ["slot_order", "dense", "none"])
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
def test_recorded_backward_gives_the_bits_of_the_function(probs_form, recv_mode, seed):
    group, idx, x, probs = setup(seed, recv_mode)
    handle = group.create_handle(idx)
    dense = probs_form == "dense"
    p = None if probs_form == "none" else dense_probs_of(idx, probs, E) if dense else probs
    recorded = step(handle, x, p, dense, via_function=False)
    function = step(handle, x, p, dense, via_function=True)
    assert recorded["grad_fns"] == ("NcclEpDispatchBackward", "NcclEpCombineBackward")
    assert_same_bits(recorded, function)
    group.destroy()


def test_an_unused_output_gets_a_zero_gradient(seed):
    """recv_probs outside the loss: the backward runs with zeros for it (every rank runs the
    same collectives), so the probs' gradient is all zeros, as through the Function."""
    group, idx, x, probs = setup(seed)
    handle = group.create_handle(idx)
    recorded = step(handle, x, probs, False, via_function=False, use_probs_grad=False)
    function = step(handle, x, probs, False, via_function=True, use_probs_grad=False)
    assert torch.count_nonzero(recorded["grad_probs"]) == 0
    assert_same_bits(recorded, function)
    group.destroy()


def test_the_graph_holds_the_handle(seed):
    """The handle lives while the outputs' grad_fn needs it, and is freed with the graph."""
    group, idx, x, probs = setup(seed)
    xg = leaf(x)
    handle = group.create_handle(idx)
    alive = weakref.ref(handle)
    recv_x, _ = ep.dispatch(handle, xg, None)
    y = ep.combine(handle, recv_x * 3)
    del handle, recv_x
    gc.collect()
    assert alive() is not None
    y.sum().backward()
    torch.cuda.synchronize()
    # Each token's rows come back as 3 x its live slots' count of ones.
    live = (idx >= 0).sum(1, keepdim=True)
    assert torch.equal(xg.grad, (3 * live).to(xg.dtype).expand(T, H))
    del y
    gc.collect()
    assert alive() is None
    group.destroy()


def test_a_destroyed_handle_raises_in_backward(seed):
    group, idx, x, probs = setup(seed)
    handle = group.create_handle(idx)
    xg = leaf(x)
    recv_x, _ = ep.dispatch(handle, xg, None)
    handle.destroy()
    with pytest.raises(RuntimeError, match="this Handle was destroyed"):
        recv_x.sum().backward()
    group.destroy()


def test_a_gradient_for_the_probs_alone(seed):
    """``torch.autograd.grad`` for the probs only (x not a leaf that wants one): the same bits as
    through the Function."""
    group, idx, x, probs = setup(seed)
    handle = group.create_handle(idx)
    grads = []
    for via_function in (False, True):
        pg = leaf(probs)
        if via_function:
            recv_x, recv_probs = autograd._Dispatch.apply(handle, x, pg, False)
        else:
            recv_x, recv_probs = ep.dispatch(handle, x, pg)
        weighted = recv_x * recv_probs.unsqueeze(-1).to(recv_x.dtype)
        y = ep.combine(handle, weighted) if not via_function else \
            autograd._Combine.apply(handle, weighted)
        grads.append(torch.autograd.grad(y.float().square().sum(), [pg])[0])
    torch.cuda.synchronize()
    assert torch.equal(grads[0], grads[1])
    group.destroy()


def test_without_grad_nothing_is_recorded(seed):
    group, idx, x, probs = setup(seed)
    handle = group.create_handle(idx)
    with torch.no_grad():
        recv_x, recv_probs = ep.dispatch(handle, leaf(x), leaf(probs))
        y = ep.combine(handle, recv_x)
    assert recv_x.grad_fn is None and recv_probs.grad_fn is None and y.grad_fn is None
    assert not (recv_x.requires_grad or y.requires_grad)
    group.destroy()


def test_the_backward_error_keeps_its_type(seed, monkeypatch):
    """An exception raised by the backward (here a stand-in for the dispatch that the combine's
    backward calls) reaches backward()'s caller as itself."""

    class Refused(Exception):
        pass

    def refuse(handle, thread, grad_y):
        raise Refused("from the combine's backward")

    monkeypatch.setattr(autograd, "_combine_backward", refuse)
    group, idx, x, probs = setup(seed)
    handle = group.create_handle(idx)
    recv_x, _ = ep.dispatch(handle, leaf(x), None)
    y = ep.combine(handle, recv_x)
    with pytest.raises(Refused, match="^from the combine's backward$"):
        y.sum().backward()
    group.destroy()
