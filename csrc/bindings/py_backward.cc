/*
 * py_backward.cc: the autograd node of py_backward.h.
 */
#include "py_backward.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace py = pybind11;
using torch::autograd::variable_list;

namespace nccl_ep_py {

namespace {

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

struct PyBackward : torch::autograd::Node {
  PyBackward(const char* name, py::object fn) : name_(name), fn_(std::move(fn)) {}

  ~PyBackward() override {
    // The graph may be freed on autograd's worker thread, or at exit after the interpreter.
    if (!Py_IsInitialized() || finalizing()) {
      fn_.release();  // leaked at exit, as the interpreter's own objects are
      return;
    }
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }

  std::string name() const override { return name_; }

  variable_list apply(variable_list&& grads) override {
    py::gil_scoped_acquire gil;
    py::tuple args(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      const auto& meta = input_metadata(i);
      if (meta.was_default_constructed()) {
        args[i] = py::none();  // an output the op did not make
      } else {
        args[i] = py::reinterpret_steal<py::object>(
            THPVariable_Wrap(grads[i].defined() ? grads[i] : meta.zeros_like()));
      }
    }
    PyObject* result = PyObject_CallObject(fn_.ptr(), args.ptr());
    if (result == nullptr) throw_python_error();
    const py::object owned = py::reinterpret_steal<py::object>(result);  // released on return
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != (Py_ssize_t)num_outputs()) {
      PyErr_Format(PyExc_TypeError, "%s: the backward must return a tuple of %d gradients, got %R",
                   name_.c_str(), (int)num_outputs(), result);
      throw_python_error();
    }
    variable_list out;
    out.reserve(num_outputs());
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(result); ++i) {
      PyObject* g = PyTuple_GET_ITEM(result, i);
      if (g != Py_None && !THPVariable_Check(g)) {
        PyErr_Format(PyExc_TypeError, "%s: gradient %d must be a tensor or None, got %s",
                     name_.c_str(), (int)i, Py_TYPE(g)->tp_name);
        throw_python_error();
      }
      out.push_back(g == Py_None ? at::Tensor() : THPVariable_Unpack(g));
    }
    return out;
  }

 private:
  // The pending Python error, as the engine carries a Function's.
  [[noreturn]] static void throw_python_error() {
    python_error err;
    err.persist();
    throw std::move(err);
  }

  std::string name_;
  py::object fn_;
};

// What an autograd edge holds a node by: std::shared_ptr in older torch, c10::intrusive_ptr in
// newer (the node type is a template parameter so that only the branch of this torch compiles).
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename N>
NodePtr make_node(const char* name, py::object fn) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    // torch's own deleter, which frees a long chain of nodes without deep recursion.
    return std::shared_ptr<N>(new N(name, std::move(fn)), [](N* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<N>(name, std::move(fn));
  }
}

}  // namespace

bool records_backward(const py::object& backward, std::initializer_list<at::Tensor> inputs) {
  if (backward.is_none() || !at::GradMode::is_enabled() || c10::InferenceMode::is_enabled())
    return false;
  bool wanted = false;
  for (const at::Tensor& t : inputs) {
    if (!t.defined()) continue;
    if (t._fw_grad(/*level=*/0).defined())
      throw std::invalid_argument(
          "forward-mode AD (a dual tensor) through dispatch or combine is not supported");
    wanted = wanted || t.requires_grad();
  }
  return wanted;
}

void attach_backward(const char* name, const py::object& backward,
                     std::initializer_list<at::Tensor> inputs,
                     std::initializer_list<at::Tensor> outputs) {
  const NodePtr node = make_node<PyBackward>(name, backward);
  torch::autograd::edge_list edges;
  edges.reserve(inputs.size());
  for (const at::Tensor& t : inputs)
    edges.push_back(t.defined() ? torch::autograd::impl::gradient_edge(t)
                                : torch::autograd::Edge());
  node->set_next_edges(std::move(edges));
  for (const at::Tensor& t : outputs) torch::autograd::set_history(t, node);
}

}  // namespace nccl_ep_py
