/*
 * py_backward.cc: the autograd node of py_backward.h.
 */
#include "py_backward.h"

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
  explicit PyBackward(py::object fn) : fn_(std::move(fn)) {}

  ~PyBackward() override {
    // The graph may be freed on autograd's worker thread, or at exit after the interpreter.
    if (!Py_IsInitialized() || finalizing()) {
      fn_.release();  // leaked at exit, as the interpreter's own objects are
      return;
    }
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }

  std::string name() const override { return "NcclEpBackward"; }

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
    if (result == nullptr) {
      python_error err;
      err.persist();
      throw std::move(err);
    }
    const py::tuple returned = py::reinterpret_steal<py::tuple>(result);
    variable_list out;
    out.reserve(returned.size());
    for (const py::handle g : returned)
      out.push_back(g.is_none() ? at::Tensor() : THPVariable_Unpack(g.ptr()));
    return out;
  }

 private:
  py::object fn_;
};

// What an autograd edge holds a node by: std::shared_ptr in older torch, c10::intrusive_ptr in
// newer (the node type is a template parameter so that only the branch of this torch compiles).
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename N>
NodePtr make_node(py::object fn) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    // torch's own deleter, which frees a long chain of nodes without deep recursion.
    return std::shared_ptr<N>(new N(std::move(fn)), [](N* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<N>(std::move(fn));
  }
}

}  // namespace

void attach_backward(const py::object& backward, std::initializer_list<at::Tensor> inputs,
                     std::initializer_list<at::Tensor> outputs) {
  const NodePtr node = make_node<PyBackward>(backward);
  torch::autograd::edge_list edges;
  edges.reserve(inputs.size());
  for (const at::Tensor& t : inputs)
    edges.push_back(t.defined() ? torch::autograd::impl::gradient_edge(t) : torch::autograd::Edge());
  node->set_next_edges(std::move(edges));
  for (const at::Tensor& t : outputs) torch::autograd::set_history(t, node);
}

}  // namespace nccl_ep_py
