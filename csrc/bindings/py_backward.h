/*
 * py_backward.h: an op's outputs made differentiable in the op's own call: a C++ autograd node
 * whose backward is a Python callable (megatron_nccl_ep.autograd), in place of a
 * torch.autograd.Function around the op, whose Python machinery costs the forward more host time
 * than the op's binding itself.
 *
 * NOTES:
 *  - An op asks records_backward before it launches (so that a refusal leaves nothing enqueued)
 *    and calls attach_backward after, only where the answer was true.
 *  - The node holds `backward` (and through it the handle) as long as the autograd graph holds
 *    the node, as a Function's ctx would; it calls it with one gradient per output, undefined
 *    gradients materialized as zeros (so every rank runs the backward's collectives), None for an
 *    output the op did not make; it takes back a tuple of one gradient (a tensor or None) per
 *    input, else raises TypeError.
 *  - An exception raised by `backward` reaches the caller of backward() as it would from a
 *    Function's backward (the engine's python_error), its type kept.
 *  - Not supported, as by the Function it replaces: forward-mode AD (refused), double backward
 *    (the gradients carry no graph); torch's compiled autograd does not take the node.
 *  - Call both with the GIL held.
 */
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <initializer_list>

namespace nccl_ep_py {

// Whether an op given `backward` records it: `backward` is not None, grad mode is on, inference
// mode is off and one of `inputs` (undefined: not given) requires grad. An input with a
// forward-mode gradient: std::invalid_argument (ValueError).
bool records_backward(const pybind11::object& backward, std::initializer_list<at::Tensor> inputs);

// `inputs`: the op's differentiable inputs (undefined: none given), each an edge of the node;
// `outputs`: the op's outputs (undefined: not made), each given the node as its grad_fn; `name`:
// the node's, for anomaly traces and profiles.
void attach_backward(const char* name, const pybind11::object& backward,
                     std::initializer_list<at::Tensor> inputs,
                     std::initializer_list<at::Tensor> outputs);

}  // namespace nccl_ep_py
