/*
 * py_backward.h: an op's outputs made differentiable in the op's own call: a C++ autograd node
 * whose backward is a Python callable (megatron_nccl_ep.autograd), in place of a
 * torch.autograd.Function around the op, whose Python machinery costs the forward more host time
 * than the op's binding itself.
 *
 * NOTES:
 *  - The node holds `backward` (and through it the handle) as long as the autograd graph holds
 *    the node, as a Function's ctx would; it calls it with one gradient per output, undefined
 *    gradients materialized as zeros (so every rank runs the backward's collectives), None for an
 *    output the op did not make; it returns one gradient (or None) per input.
 *  - An exception raised by `backward` reaches the caller of backward() as it would from a
 *    Function's backward (the engine's python_error).
 *  - Call with the GIL held.
 */
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <initializer_list>

namespace nccl_ep_py {

// `inputs`: the op's differentiable inputs (undefined: none given), each an edge of the node;
// `outputs`: the op's outputs (undefined: not made), each given the node as its grad_fn.
void attach_backward(const pybind11::object& backward, std::initializer_list<at::Tensor> inputs,
                     std::initializer_list<at::Tensor> outputs);

}  // namespace nccl_ep_py
