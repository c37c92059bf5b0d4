/*
 * nccl_ep_py.cc: the Python module megatron_nccl_ep._C over nccl_ep.h, a torch extension (the C
 * library itself stays torch-free). Groups, handles and communicators travel as Python ints;
 * tensors as torch tensors, each checked to be on the group's CUDA device (the one thing the C
 * library cannot check) and passed with its real sizes and strides, so the C library's checks of
 * shape, dtype and layout are the checks of a call. One binding per C entry point and mode where
 * the calls differ (ncclEpDispatch: HT's dispatch and LL's ll_dispatch, whose outputs differ;
 * ncclEpCombine: combine and ll_combine, whose arguments do), so no binding takes arguments of
 * the other mode; an op allocates its outputs (from the caching allocator, on the current stream
 * of the group's device) and launches in this one call. Beside each op, a check_* binding runs
 * the same argument checks (csrc/runtime/call_checks.cc) over the same glue without a group or
 * a GPU, so the lean path's refusals are tested on CPU machines (tests/test_lean_path.py).
 *
 * NOTES:
 *  - An op refuses bad arguments before it enqueues anything (the C library checks every
 *    argument before its first launch; outputs allocated before a refusal are freed unused), so
 *    a caller may check and retry a refused call (megatron_nccl_ep's front end does, for its own
 *    messages).
 *  - An op runs without the GIL from its arguments' conversion to its launch (it may wait: the
 *    local team's gate, exact mode's count read): nothing between touches a Python object. A
 *    backward given to dispatch or combine is attached after the launch, with the GIL.
 *  - Failures raise ValueError (ncclInvalidArgument / ncclInvalidUsage, or an argument this file
 *    refuses) or megatron_nccl_ep.errors.NcclEpError (others, a RuntimeError) with
 *    ncclEpGetLastError()'s text. Calls that may block (the local team's gate, exact mode's
 *    count read, communicator and group setup) release the GIL.
 */
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../include/nccl_ep.h"
#include "../runtime/call_checks.h"
#include "py_backward.h"

namespace py = pybind11;

namespace {

using OptTensor = std::optional<at::Tensor>;

// std::invalid_argument becomes ValueError (pybind11's standard translation), RuntimeErrorEx
// NcclEpError (the translator registered below); both are translated once the GIL is back, so
// throwing inside gil_scoped_release is fine.
struct ValueErrorEx : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
struct RuntimeErrorEx : std::runtime_error {
  using std::runtime_error::runtime_error;
};
PyObject* nccl_ep_error = nullptr;  // megatron_nccl_ep.errors.NcclEpError, held for the process

void check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  std::string msg = ncclEpGetLastError();
  if (msg.empty()) msg = std::string(what) + " failed: " + ncclGetErrorString(r);
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) throw ValueErrorEx(msg);
  throw RuntimeErrorEx(msg);
}

void check_nccl(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  const char* last = ncclGetLastError(nullptr);
  throw RuntimeErrorEx(std::string(what) + " failed: " + ncclGetErrorString(r) +
                       (last != nullptr && *last ? std::string(": ") + last : std::string()));
}

template <typename T>
T* as_ptr(uintptr_t v) {
  return reinterpret_cast<T*>(v);
}

// The current stream of CUDA device `device` (torch's, as every torch op on it uses).
cudaStream_t current_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

// An op's binding: its body runs without the GIL (module NOTES).
using NoGil = py::call_guard<py::gil_scoped_release>;

// An op's span in torch.profiler's trace (a row of its own, as torch's ops have): a thread-local
// check when no profiler runs.
#define EP_RECORD_OP(name) RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>())

ncclDataType_t nccl_dtype(at::ScalarType s) {
  switch (s) {
    case at::kBool: return ncclUint8;  // routing maps (no other 8-bit integer tensor passes)
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kFloat8_e4m3fn: return ncclFloat8e4m3;
    default:
      throw ValueErrorEx(std::string("dtype ") + c10::toString(s) +
                         " has no NCCL EP data type");
  }
}

// A tensor as the C API takes it, its sizes and strides as they are. `device`: the group's CUDA
// device, where every tensor of an op must be; -1: a host tensor (tokens per expert read to the
// host). Touches no Python object (ops call it without the GIL).
ncclEpTensor_t tensor(const at::Tensor& t, ncclEpTensorTag_t tag, int device, const char* name) {
  const bool placed = device < 0 ? t.device().is_cpu() : t.is_cuda() && t.get_device() == device;
  if (!placed)
    throw ValueErrorEx(std::string(name) + " must be on " +
                       (device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device)) +
                       ", got " + t.device().str());
  ncclEpTensor_t c{};
  if (t.dim() > NCCL_EP_MAX_NDIM)
    throw ValueErrorEx(std::string(name) + " has " + std::to_string(t.dim()) +
                       " dimensions, more than " + std::to_string(NCCL_EP_MAX_NDIM));
  c.data = t.data_ptr();
  c.ndim = (int)t.dim();
  for (int i = 0; i < c.ndim; ++i) {
    c.sizes[i] = t.size(i);
    c.strides[i] = t.stride(i);
  }
  c.dtype = nccl_dtype(t.scalar_type());
  c.tag = tag;
  return c;
}

// An optional tensor: absent is ndim 0.
ncclEpTensor_t tensor(const OptTensor& t, ncclEpTensorTag_t tag, int device, const char* name) {
  return t.has_value() ? tensor(*t, tag, device, name) : ncclEpTensor_t{};
}

// An op's output (device -1: a host tensor, for a Target's checks): the tensor at::empty
// returns, straight from the caching allocator (an op's host time is mostly per allocation; the
// dispatcher's part is skipped), except where torch's deterministic mode fills new memory:
// at::empty does that.
at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype, int device) {
  if (device < 0) return at::empty(sizes, at::TensorOptions().dtype(dtype));  // a Target's checks
  const at::Device where(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  const at::Context& ctx = at::globalContext();
  if (ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory())
    return at::empty(sizes, at::TensorOptions().dtype(dtype).device(where));
  return at::detail::empty_cuda(sizes, dtype, where, std::nullopt);
}

// Routing weights: [T, K] in slot order, or a router's dense [T, E].
ncclEpTensorTag_t weights_tag(bool dense) {
  return dense ? NCCL_EP_TENSOR_ROUTING_PROBS : NCCL_EP_TENSOR_TOPK_WEIGHTS;
}

// A Python payload dtype (None: the token dtype) as the library's ncclEpPayloadDtype_t.
ncclEpPayloadDtype_t payload_of(const std::optional<at::ScalarType>& dtype) {
  if (!dtype.has_value()) return ncclEpPayloadTokenDtype;
  if (*dtype == at::kFloat8_e4m3fn) return ncclEpPayloadFloat8e4m3;
  throw ValueErrorEx(std::string("payload_dtype ") + c10::toString(*dtype) +
                     " is not an LL payload of the library (None: the token dtype, or "
                     "torch.float8_e4m3fn)");
}

ncclEpOpConfig_t op_config(bool send_only) {
  ncclEpOpConfig_t c = NCCL_EP_OP_CONFIG_INITIALIZER;
  c.send_only = send_only ? 1 : 0;
  return c;
}

// Where each LL dispatch output goes in ncclEpDispatchOutputs_t, with its tag, by the name of
// its megatron_nccl_ep.outputs.LLDispatchOutput field. The fields' order is outputs.py's alone:
// LLOutputs takes the names in that order, and the bindings return the tensors in it.
struct LLSlot {
  const char* name;
  ncclEpTensor_t ncclEpDispatchOutputs_t::*slot;
  ncclEpTensorTag_t tag;
};
const LLSlot kLLSlots[] = {
    {"x", &ncclEpDispatchOutputs_t::recv_tokens, NCCL_EP_TENSOR_TOKENS},
    {"count", &ncclEpDispatchOutputs_t::recv_count, NCCL_EP_TENSOR_RECV_COUNT},
    {"scales", &ncclEpDispatchOutputs_t::recv_scales, NCCL_EP_TENSOR_SCALES},
    {"src", &ncclEpDispatchOutputs_t::recv_src, NCCL_EP_TENSOR_RECV_SRC},
    {"topk_idx", &ncclEpDispatchOutputs_t::recv_topk_idx, NCCL_EP_TENSOR_TOPK_IDX},
    {"topk_weights", &ncclEpDispatchOutputs_t::recv_topk_weights, NCCL_EP_TENSOR_TOPK_WEIGHTS},
};
constexpr int kLLFields = (int)(sizeof(kLLSlots) / sizeof(kLLSlots[0]));

std::string ll_slot_names() {
  std::string names;
  for (const LLSlot& s : kLLSlots) names += std::string(names.empty() ? "" : ", ") + s.name;
  return names;
}

// The shapes and dtypes of one LL group's dispatch outputs (outputs.ll_dispatch_fields: one
// statement of them), held once per group and kind of dispatch (with or without weights), in
// LLDispatchOutput's field order, and where each lies in the one allocation that holds them all.
struct LLOutputs {
  std::array<const LLSlot*, kLLFields> slots{};  // field i's slot
  std::array<bool, kLLFields> present{};
  std::array<std::vector<int64_t>, kLLFields> sizes;
  std::array<at::ScalarType, kLLFields> dtypes{};
  std::array<int64_t, kLLFields> offsets{};  // bytes, each a multiple of kAlign
  int64_t bytes = 0;
  static constexpr int64_t kAlign = 256;
};

// fields: (name, (shape, dtype) or None) per LLDispatchOutput field, in its order.
LLOutputs ll_outputs(const py::sequence& fields) {
  if (py::len(fields) != kLLFields)
    throw ValueErrorEx("LLOutputs: expected one (name, (shape, dtype) or None) per LL dispatch "
                       "output (" + ll_slot_names() + "), got " +
                       std::to_string(py::len(fields)));
  LLOutputs o;
  for (int i = 0; i < kLLFields; ++i) {
    const auto field = fields[i].cast<std::pair<std::string, py::object>>();
    for (const LLSlot& s : kLLSlots)
      if (field.first == s.name) o.slots[i] = &s;
    if (o.slots[i] == nullptr)
      throw ValueErrorEx("LLOutputs: no LL dispatch output is named '" + field.first +
                         "' (the library's: " + ll_slot_names() + ")");
    for (int j = 0; j < i; ++j)
      if (o.slots[j] == o.slots[i])
        throw ValueErrorEx("LLOutputs: the output '" + field.first + "' is named twice");
    const py::object& f = field.second;
    if (f.is_none()) continue;
    const auto spec = f.cast<std::pair<std::vector<int64_t>, at::ScalarType>>();
    o.present[i] = true;
    o.sizes[i] = spec.first;
    o.dtypes[i] = spec.second;
    int64_t bytes = (int64_t)c10::elementSize(spec.second);
    for (const int64_t n : spec.first) bytes *= n;
    o.offsets[i] = o.bytes;
    o.bytes += (bytes + LLOutputs::kAlign - 1) / LLOutputs::kAlign * LLOutputs::kAlign;
  }
  return o;
}

// A new LL dispatch's outputs: one call of the caching allocator for all of them (the host cost
// of an op is mostly per allocation), each field a tensor of its own (not a view) at its offset
// in that storage, as at::empty builds one.
void allocate(const LLOutputs& o, int device, std::array<OptTensor, kLLFields>& made) {
  const at::Tensor block = empty({o.bytes}, at::kByte, device);
  for (int i = 0; i < kLLFields; ++i) {
    if (!o.present[i]) continue;
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(block.storage()),
        c10::DispatchKeySet(device < 0 ? c10::DispatchKey::CPU : c10::DispatchKey::CUDA),
        c10::scalarTypeToTypeMeta(o.dtypes[i]));
    t.unsafeGetTensorImpl()->set_sizes_contiguous(o.sizes[i]);
    t.unsafeGetTensorImpl()->set_storage_offset(o.offsets[i] /
                                                (int64_t)c10::elementSize(o.dtypes[i]));
    made[i] = std::move(t);
  }
}

// The LLDispatchOutput fields, in order: tensors or None.
py::tuple as_fields(const std::array<OptTensor, kLLFields>& made) {
  py::tuple result(kLLFields);
  for (int i = 0; i < kLLFields; ++i) result[i] = py::cast(made[i]);
  return result;
}

// A field of a given LLDispatchOutput: its tensor, or None.
OptTensor out_field(const py::handle& out, const char* name) {
  const py::object v = out.attr(name);
  if (v.is_none()) return std::nullopt;
  if (!THPVariable_Check(v.ptr()))
    throw py::type_error(std::string("out.") + name + " must be a torch.Tensor or None");
  return THPVariable_Unpack(v.ptr());
}


// Where an op binding's C call goes: the op on `ptr` (its handle, or its group for handle
// creation), its tensors on CUDA device `device`; or, with `shape`, the library's checks of the
// same call (call_checks.h: those the op runs before it enqueues anything) on host tensors
// (device -1), its outputs allocated on the host. Everything else an op binding does (the
// tensors' conversion and device check, its own refusals, the outputs it allocates) is the same
// code for both, so the check_* bindings refuse a call exactly where the op would.
struct Target {
  uintptr_t ptr = 0;
  const nccl_ep::CallShape* shape = nullptr;
  int device = -1;
};

// A CallShape for the check_* bindings, holding the configuration it points to.
struct HostShape {
  ncclEpGroupConfig_t cfg{};
  nccl_ep::CallShape shape;
  HostShape(const ncclEpGroupConfig_t& c, int nranks, long long num_tokens, long long topk,
            long long num_recv)
      : cfg(c) {
    shape.cfg = &cfg;
    shape.nranks = nranks;
    shape.num_tokens = num_tokens;
    shape.topk = topk;
    shape.num_recv = num_recv;
  }
  HostShape(const HostShape&) = delete;  // shape points into this object
  HostShape& operator=(const HostShape&) = delete;
};

// routing: topk_idx [T, K] (is_map false) or a routing map [T, E], contiguous (the library reads
// strides too; the package hands it contiguous copies, as it always has). Returns the handle (0
// for a Target's checks).
uintptr_t create_handle_call(const Target& to, const at::Tensor& routing, bool is_map) {
  const char* name = is_map ? "routing_map" : "topk_idx";
  const ncclEpTensor_t r = tensor(
      routing, is_map ? NCCL_EP_TENSOR_ROUTING_MAP : NCCL_EP_TENSOR_TOPK_IDX, to.device, name);
  if (!routing.is_contiguous()) throw ValueErrorEx(std::string(name) + " must be contiguous");
  if (to.shape != nullptr) {
    check(megatron_nccl_ep_check_routing(to.shape, &r), "ncclEpCreateHandle");
    return 0;
  }
  ncclEpHandle_t h = nullptr;
  check(ncclEpCreateHandle(&h, as_ptr<ncclEpGroup>(to.ptr), &r, nullptr,
                           current_stream(to.device)),
        "ncclEpCreateHandle");
  return reinterpret_cast<uintptr_t>(h);
}

// HT dispatch without the GIL: x [T, H]; probs [T, K] in slot order, or dense [T, E]; None:
// no probs. Returns (recv_x [N, H] of x's dtype, recv_probs [N] of the probs' dtype or None).
std::pair<at::Tensor, OptTensor> dispatch_call(const Target& to, const at::Tensor& x,
                                               const OptTensor& probs, bool dense) {
  ncclEpDispatchInputs_t in{};
  ncclEpDispatchOutputs_t out{};
  in.tokens = tensor(x, NCCL_EP_TENSOR_TOKENS, to.device, "x");
  in.topk_weights = tensor(probs, weights_tag(dense), to.device, "probs");
  if (x.dim() != 2) throw ValueErrorEx("x must be 2-D [T, H]");
  int64_t n = 0;  // exact mode: the handle's first call waits here for its layout
  if (to.shape != nullptr)
    n = to.shape->num_recv;
  else
    check(ncclEpHandleGetNumRecvTokens(as_ptr<ncclEpHandle>(to.ptr), &n),
          "ncclEpHandleGetNumRecvTokens");
  at::Tensor recv_x = empty({n, x.size(1)}, x.scalar_type(), to.device);
  OptTensor recv_probs;
  if (probs.has_value()) recv_probs = empty({n}, probs->scalar_type(), to.device);
  out.recv_tokens = tensor(recv_x, NCCL_EP_TENSOR_TOKENS, to.device, "recv_x");
  out.recv_topk_weights = tensor(recv_probs, NCCL_EP_TENSOR_TOPK_WEIGHTS, to.device,
                                 "recv_probs");
  const ncclEpOpConfig_t cfg = op_config(false);
  check(to.shape != nullptr
            ? megatron_nccl_ep_check_dispatch(to.shape, &in, &out)
            : ncclEpDispatch(as_ptr<ncclEpHandle>(to.ptr), &in, &out, &cfg,
                             current_stream(to.device)),
        "ncclEpDispatch");
  return {recv_x, recv_probs};
}

// HT combine without the GIL: expert_out [N, H] -> y [num_tokens, H] of y_dtype.
at::Tensor combine_call(const Target& to, const at::Tensor& expert_out, int64_t num_tokens,
                        at::ScalarType y_dtype) {
  ncclEpCombineInputs_t in{};
  ncclEpCombineOutputs_t out{};
  in.expert_tokens = tensor(expert_out, NCCL_EP_TENSOR_TOKENS, to.device, "expert_out");
  if (expert_out.dim() < 1) throw ValueErrorEx("expert_out must have a hidden dimension");
  at::Tensor y = empty({num_tokens, expert_out.size(-1)}, y_dtype, to.device);
  out.tokens = tensor(y, NCCL_EP_TENSOR_TOKENS, to.device, "y");
  const ncclEpOpConfig_t cfg = op_config(false);
  check(to.shape != nullptr
            ? megatron_nccl_ep_check_combine(to.shape, &in, &out)
            : ncclEpCombine(as_ptr<ncclEpHandle>(to.ptr), &in, &out, &cfg,
                            current_stream(to.device)),
        "ncclEpCombine");
  return y;
}

// grad_recv [N] -> [num_tokens, cols] of its dtype: cols K in slot order, or E dense.
at::Tensor combine_topk_weights_call(const Target& to, const at::Tensor& grad_recv,
                                     int64_t num_tokens, int64_t cols, bool dense) {
  ncclEpTensor_t in = tensor(grad_recv, NCCL_EP_TENSOR_TOPK_WEIGHTS, to.device,
                             "grad_recv_probs");
  at::Tensor grad = empty({num_tokens, cols}, grad_recv.scalar_type(), to.device);
  ncclEpTensor_t out = tensor(grad, weights_tag(dense), to.device, "grad_probs");
  check(to.shape != nullptr
            ? megatron_nccl_ep_check_combine_probs(to.shape, &in, &out)
            : ncclEpCombineTopkWeights(as_ptr<ncclEpHandle>(to.ptr), &in, &out,
                                       current_stream(to.device)),
        "ncclEpCombineTopkWeights");
  return grad;
}

// LL dispatch: x [T, H]; topk_weights [T, K] fp32 or None. given: None, to allocate `outputs`
// (returns the LLDispatchOutput fields, in order, tensors or None); or an LLDispatchOutput with
// exactly the fields `outputs` has, written in place (returns None). Takes the GIL as it comes
// (it reads `given`'s fields) and releases it for the rest.
py::object ll_dispatch_call(const Target& to, const at::Tensor& x,
                            const OptTensor& topk_weights, bool send_only,
                            const LLOutputs& outputs, const py::object& given) {
  const bool fresh = given.is_none();
  std::array<OptTensor, kLLFields> made;
  for (int i = 0; i < kLLFields && !fresh; ++i) {
    const char* name = outputs.slots[i]->name;
    made[i] = out_field(given, name);
    if (made[i].has_value() != outputs.present[i])
      throw ValueErrorEx(std::string("out.") + name +
                         (outputs.present[i] ? " is required" : " must be None") +
                         " for this group's layout and weights");
  }
  {
    py::gil_scoped_release nogil;
    ncclEpDispatchInputs_t in{};
    ncclEpDispatchOutputs_t out{};
    in.tokens = tensor(x, NCCL_EP_TENSOR_TOKENS, to.device, "x");
    in.topk_weights = tensor(topk_weights, NCCL_EP_TENSOR_TOPK_WEIGHTS, to.device,
                             "topk_weights");
    if (fresh) allocate(outputs, to.device, made);
    for (int i = 0; i < kLLFields; ++i) {
      const LLSlot& f = *outputs.slots[i];
      out.*f.slot = tensor(made[i], f.tag, to.device, f.name);
    }
    const ncclEpOpConfig_t cfg = op_config(send_only);
    check(to.shape != nullptr
              ? megatron_nccl_ep_check_dispatch(to.shape, &in, &out)
              : ncclEpDispatch(as_ptr<ncclEpHandle>(to.ptr), &in, &out, &cfg,
                               current_stream(to.device)),
          "ncclEpDispatch");
  }
  if (!fresh) return py::object(py::none());
  return py::object(as_fields(made));
}

// LL combine without the GIL: expert_out in the dispatch's layout (the token dtype or fp32);
// topk_weights: expert-major [T, K] fp32, rank-major None; given: None, or a [num_tokens, H]
// tensor of y_dtype to write. Returns y [num_tokens, H] of y_dtype (`given` when given).
at::Tensor ll_combine_call(const Target& to, const at::Tensor& expert_out,
                           const OptTensor& topk_weights, bool send_only, const OptTensor& given,
                           int64_t num_tokens, at::ScalarType y_dtype) {
  ncclEpCombineInputs_t in{};
  ncclEpCombineOutputs_t out{};
  in.expert_tokens = tensor(expert_out, NCCL_EP_TENSOR_TOKENS, to.device, "expert_out");
  in.topk_weights = tensor(topk_weights, NCCL_EP_TENSOR_TOPK_WEIGHTS, to.device, "topk_weights");
  if (expert_out.dim() < 1) throw ValueErrorEx("expert_out must have a hidden dimension");
  const at::Tensor y = given.has_value()
                           ? *given
                           : empty({num_tokens, expert_out.size(-1)}, y_dtype, to.device);
  out.tokens = tensor(y, NCCL_EP_TENSOR_TOKENS, to.device, "out");
  const ncclEpOpConfig_t cfg = op_config(send_only);
  check(to.shape != nullptr
            ? megatron_nccl_ep_check_combine(to.shape, &in, &out)
            : ncclEpCombine(as_ptr<ncclEpHandle>(to.ptr), &in, &out, &cfg,
                            current_stream(to.device)),
        "ncclEpCombine");
  return y;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "megatron_nccl_ep CUDA backend: bindings of the nccl_ep.h C API";
  m.attr("API_VERSION") = NCCL_EP_API_VERSION;
  // The C API's enum values that megatron_nccl_ep/cuda_backend.py sets by its words.
  m.attr("MODE_HIGH_THROUGHPUT") = (int)ncclEpModeHighThroughput;
  m.attr("MODE_LOW_LATENCY") = (int)ncclEpModeLowLatency;
  m.attr("RECV_COUNT_EXACT") = (int)ncclEpRecvCountExact;
  m.attr("RECV_COUNT_CAPACITY") = (int)ncclEpRecvCountCapacity;
  m.attr("RECV_COUNT_CAPACITY_DROP") = (int)ncclEpRecvCountCapacityDrop;
  m.attr("LAYOUT_EXPERT_MAJOR") = (int)ncclEpLayoutExpertMajor;
  m.attr("LAYOUT_RANK_MAJOR") = (int)ncclEpLayoutRankMajor;
  m.attr("NCCL_BUILD_VERSION") = NCCL_VERSION_CODE;
  nccl_ep_error =
      py::object(py::module_::import("megatron_nccl_ep.errors").attr("NcclEpError")).release().ptr();
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const RuntimeErrorEx& e) {
      PyErr_SetString(nccl_ep_error, e.what());
    }
  });

  m.def("get_last_error", []() { return std::string(ncclEpGetLastError()); });
  m.def("nccl_version", []() {
    int v = 0;
    check_nccl(ncclGetVersion(&v), "ncclGetVersion");
    return v;
  });

  // --- the communicator the library runs on --------------------------------------------------
  m.def("get_unique_id", []() {
    ncclUniqueId id;
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    return py::bytes(id.internal, sizeof(id.internal));
  });
  m.def(
      "comm_init_rank",
      [](int nranks, py::bytes id_bytes, int rank) {
        std::string s = id_bytes;
        if (s.size() != sizeof(ncclUniqueId))
          throw ValueErrorEx("comm_init_rank: the unique id must be " +
                             std::to_string(sizeof(ncclUniqueId)) + " bytes");
        ncclUniqueId id;
        memcpy(id.internal, s.data(), sizeof(id.internal));
        ncclComm_t comm = nullptr;
        {
          py::gil_scoped_release nogil;
          check_nccl(ncclCommInitRank(&comm, nranks, id, rank), "ncclCommInitRank");
        }
        return reinterpret_cast<uintptr_t>(comm);
      },
      py::arg("nranks"), py::arg("unique_id"), py::arg("rank"));
  m.def(
      "comm_destroy",
      [](uintptr_t comm) { check_nccl(ncclCommDestroy(as_ptr<ncclComm>(comm)), "ncclCommDestroy"); },
      py::arg("comm"), NoGil());

  // --- group ---------------------------------------------------------------------------------
  // The group configuration: NCCL_EP_GROUP_CONFIG_INITIALIZER, fields set by name (token_dtype
  // as a torch.dtype).
  py::class_<ncclEpGroupConfig_t>(m, "GroupConfig")
      .def(py::init([]() {
        ncclEpGroupConfig_t cfg = NCCL_EP_GROUP_CONFIG_INITIALIZER;
        return cfg;
      }))
      .def_readwrite("num_experts", &ncclEpGroupConfig_t::num_experts)
      .def_readwrite("hidden", &ncclEpGroupConfig_t::hidden)
      .def_readwrite("max_tokens_per_rank", &ncclEpGroupConfig_t::max_tokens_per_rank)
      .def_readwrite("max_topk", &ncclEpGroupConfig_t::max_topk)
      .def_property(
          "token_dtype", [](const ncclEpGroupConfig_t& c) { return (int)c.token_dtype; },
          [](ncclEpGroupConfig_t& c, at::ScalarType v) { c.token_dtype = nccl_dtype(v); })
      .def_property(
          "recv_count_mode", [](const ncclEpGroupConfig_t& c) { return (int)c.recv_count_mode; },
          [](ncclEpGroupConfig_t& c, int v) {
            c.recv_count_mode = static_cast<ncclEpRecvCountMode_t>(v);
          })
      .def_readwrite("max_recv_tokens_per_rank", &ncclEpGroupConfig_t::max_recv_tokens_per_rank)
      .def_readwrite("expert_alignment", &ncclEpGroupConfig_t::expert_alignment)
      .def_readwrite("num_sms", &ncclEpGroupConfig_t::num_sms)
      .def_readwrite("timeout_ms", &ncclEpGroupConfig_t::timeout_ms)
      .def_readwrite("staging_chunk_tokens", &ncclEpGroupConfig_t::staging_chunk_tokens)
      .def_readwrite("staging_depth", &ncclEpGroupConfig_t::staging_depth)
      .def_readwrite("ranks_per_node", &ncclEpGroupConfig_t::ranks_per_node)
      .def_readwrite("expert_capacity", &ncclEpGroupConfig_t::expert_capacity)
      .def_readwrite("rail_capacity", &ncclEpGroupConfig_t::rail_capacity)
      .def_property(
          "mode", [](const ncclEpGroupConfig_t& c) { return (int)c.mode; },
          [](ncclEpGroupConfig_t& c, int v) { c.mode = static_cast<ncclEpMode_t>(v); })
      .def_property(
          "layout", [](const ncclEpGroupConfig_t& c) { return (int)c.layout; },
          [](ncclEpGroupConfig_t& c, int v) { c.layout = static_cast<ncclEpLayout_t>(v); })
      .def_property(
          "payload_dtype", [](const ncclEpGroupConfig_t& c) { return (int)c.payload_dtype; },
          [](ncclEpGroupConfig_t& c, const std::optional<at::ScalarType>& v) {
            c.payload_dtype = payload_of(v);
          });
  m.def(
      "check_config",
      // The library's checks of a group configuration for nranks ranks (ncclEpGetMemorySize's,
      // which are group creation's): no GPU, no communicator. Raises ValueError with the reason.
      [](const ncclEpGroupConfig_t& cfg, int nranks) {
        ncclEpMemorySize_t sz = NCCL_EP_MEMORY_SIZE_INITIALIZER;
        check(ncclEpGetMemorySize(&cfg, nranks, &sz), "ncclEpGetMemorySize");
      },
      py::arg("config"), py::arg("nranks"));
  m.def(
      "memory_size",
      [](const ncclEpGroupConfig_t& cfg, int nranks) {
        ncclEpMemorySize_t sz = NCCL_EP_MEMORY_SIZE_INITIALIZER;
        check(ncclEpGetMemorySize(&cfg, nranks, &sz), "ncclEpGetMemorySize");
        py::dict d;
        d["window_bytes"] = sz.window_bytes;
        d["device_bytes"] = sz.device_bytes;
        d["handle_bytes"] = sz.handle_bytes;
        d["total_bytes"] = sz.total_bytes;
        return d;
      },
      py::arg("config"), py::arg("nranks"));
  // Group setup takes its stream as an int (cudaStream_t; 0 = the legacy default stream), so
  // that its configuration checks, which come before any CUDA call, run without a GPU.
  m.def(
      "create_group",
      [](uintptr_t comm, const ncclEpGroupConfig_t& cfg, uintptr_t stream) {
        ncclEpGroup_t g = nullptr;
        py::gil_scoped_release nogil;
        check(ncclEpCreateGroup(&g, as_ptr<ncclComm>(comm), &cfg,
                                reinterpret_cast<cudaStream_t>(stream)),
              "ncclEpCreateGroup");
        return reinterpret_cast<uintptr_t>(g);
      },
      py::arg("comm"), py::arg("config"), py::arg("stream"));
  m.def(
      "create_local_team",
      [](int nranks, const ncclEpGroupConfig_t& cfg, uintptr_t stream) {
        std::vector<ncclEpGroup_t> groups(nranks > 0 ? nranks : 1, nullptr);
        {
          py::gil_scoped_release nogil;
          check(ncclEpCreateLocalTeam(groups.data(), nranks, &cfg,
                                      reinterpret_cast<cudaStream_t>(stream)),
                "ncclEpCreateLocalTeam");
        }
        py::list out;
        for (int r = 0; r < nranks; ++r) out.append(reinterpret_cast<uintptr_t>(groups[r]));
        return out;
      },
      py::arg("nranks"), py::arg("config"), py::arg("stream"));
  m.def(
      "group_info",
      [](uintptr_t group) {
        ncclEpGroupInfo_t info = NCCL_EP_GROUP_INFO_INITIALIZER;
        check(ncclEpGroupGetInfo(as_ptr<ncclEpGroup>(group), &info), "ncclEpGroupGetInfo");
        py::dict d;
        d["num_ranks"] = info.num_ranks;
        d["rank"] = info.rank;
        d["channels"] = info.channels;
        d["staging_chunk_tokens"] = info.staging_chunk_tokens;
        d["staging_depth"] = info.staging_depth;
        d["window_bytes"] = info.window_bytes;
        d["staging_bytes"] = info.staging_bytes;
        d["routing_bytes"] = info.routing_bytes;
        d["handle_bytes"] = info.handle_bytes;
        d["ranks_per_node"] = info.ranks_per_node;
        d["rail_bytes"] = info.rail_bytes;
        // What the rail carried from this rank, per op (ncclEpGroupInfo_t's order).
        py::dict rows, bytes;
        const char* ops[3] = {"dispatch", "combine", "combine_probs"};
        for (int op = 0; op < 3; ++op) {
          rows[ops[op]] = info.rail_rows_sent[op];
          bytes[ops[op]] = info.rail_bytes_sent[op];
        }
        d["rail_rows_sent"] = rows;
        d["rail_bytes_sent"] = bytes;
        return d;
      },
      py::arg("group"));
  m.def(
      "group_destroy",
      [](uintptr_t group) {
        check(ncclEpGroupDestroy(as_ptr<ncclEpGroup>(group)), "ncclEpGroupDestroy");
      },
      py::arg("group"), NoGil());
  m.def(
      "group_check_errors",
      [](uintptr_t group) {
        check(ncclEpGroupCheckErrors(as_ptr<ncclEpGroup>(group)), "ncclEpGroupCheckErrors");
      },
      py::arg("group"), NoGil());

  // --- handle --------------------------------------------------------------------------------
  m.def(
      "create_handle",
      [](uintptr_t group, const at::Tensor& routing, bool is_map, int device) {
        EP_RECORD_OP("nccl_ep::create_handle");
        return create_handle_call(Target{group, nullptr, device}, routing, is_map);
      },
      py::arg("group"), py::arg("routing"), py::arg("is_map"), py::arg("device"), NoGil());
  m.def(
      "handle_topk_idx",
      // [T, K] int64 on `device`.
      [](uintptr_t handle, int64_t num_tokens, int64_t topk, int device) {
        at::Tensor out = empty({num_tokens, topk}, at::kLong, device);
        ncclEpTensor_t t = tensor(out, NCCL_EP_TENSOR_TOPK_IDX, device, "topk_idx");
        check(ncclEpHandleGetTopkIdx(as_ptr<ncclEpHandle>(handle), &t, current_stream(device)),
              "ncclEpHandleGetTopkIdx");
        return out;
      },
      py::arg("handle"), py::arg("num_tokens"), py::arg("topk"), py::arg("device"), NoGil());
  m.def(
      "handle_destroy",
      [](uintptr_t handle) {
        check(ncclEpHandleDestroy(as_ptr<ncclEpHandle>(handle)), "ncclEpHandleDestroy");
      },
      py::arg("handle"), NoGil());
  m.def(
      "handle_num_recv_tokens",
      [](uintptr_t handle) {
        int64_t n = 0;
        check(ncclEpHandleGetNumRecvTokens(as_ptr<ncclEpHandle>(handle), &n),
              "ncclEpHandleGetNumRecvTokens");
        return n;
      },
      py::arg("handle"), NoGil());
  m.def(
      "handle_tokens_per_expert",
      // [L] int64: in host memory (exact mode: the count read), or on `device` in stream order.
      [](uintptr_t handle, int64_t num_local_experts, bool on_device, int device) {
        at::Tensor out = on_device ? empty({num_local_experts}, at::kLong, device)
                                   : at::empty({num_local_experts}, at::kLong);
        ncclEpTensor_t t = tensor(out, on_device ? NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_DEVICE
                                                 : NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_HOST,
                                  on_device ? device : -1, "tokens_per_expert");
        check(ncclEpHandleGetTokensPerExpert(as_ptr<ncclEpHandle>(handle), &t,
                                             current_stream(device)),
              "ncclEpHandleGetTokensPerExpert");
        return out;
      },
      py::arg("handle"), py::arg("num_local_experts"), py::arg("on_device"), py::arg("device"),
      NoGil());

  // --- HT operations (docs/design.md sections 3 and 4) ----------------------------------------
  m.def(
      "dispatch",
      // dispatch_call's; backward: None, or (grad recv_x, grad recv_probs) -> (grad x, grad
      // probs), the outputs' grad_fn where autograd records (py_backward.h).
      [](uintptr_t handle, const at::Tensor& x, const OptTensor& probs, bool dense, int device,
         const py::object& backward) {
        EP_RECORD_OP("nccl_ep::dispatch");
        const bool record =
            nccl_ep_py::records_backward(backward, {x, probs.value_or(at::Tensor())});
        std::pair<at::Tensor, OptTensor> recv;
        {
          py::gil_scoped_release nogil;
          recv = dispatch_call(Target{handle, nullptr, device}, x, probs, dense);
        }
        if (record)
          nccl_ep_py::attach_backward("NcclEpDispatchBackward", backward,
                                      {x, probs.value_or(at::Tensor())},
                                      {recv.first, recv.second.value_or(at::Tensor())});
        return py::make_tuple(recv.first, recv.second);
      },
      py::arg("handle"), py::arg("x"), py::arg("probs"), py::arg("dense"), py::arg("device"),
      py::arg("backward") = py::none());
  m.def(
      "combine",
      // combine_call's; y_dtype: the group's token dtype. backward: None, or (grad y) -> (grad
      // expert_out,), y's grad_fn where autograd records (py_backward.h).
      [](uintptr_t handle, const at::Tensor& expert_out, int64_t num_tokens,
         at::ScalarType y_dtype, int device, const py::object& backward) {
        EP_RECORD_OP("nccl_ep::combine");
        const bool record = nccl_ep_py::records_backward(backward, {expert_out});
        at::Tensor y;
        {
          py::gil_scoped_release nogil;
          y = combine_call(Target{handle, nullptr, device}, expert_out, num_tokens, y_dtype);
        }
        if (record)
          nccl_ep_py::attach_backward("NcclEpCombineBackward", backward, {expert_out}, {y});
        return y;
      },
      py::arg("handle"), py::arg("expert_out"), py::arg("num_tokens"), py::arg("y_dtype"),
      py::arg("device"), py::arg("backward") = py::none());
  m.def(
      "combine_topk_weights",
      [](uintptr_t handle, const at::Tensor& grad_recv, int64_t num_tokens, int64_t cols,
         bool dense, int device) {
        EP_RECORD_OP("nccl_ep::combine_topk_weights");
        return combine_topk_weights_call(Target{handle, nullptr, device}, grad_recv, num_tokens,
                                         cols, dense);
      },
      py::arg("handle"), py::arg("grad_recv"), py::arg("num_tokens"), py::arg("cols"),
      py::arg("dense"), py::arg("device"), NoGil());

  // --- LL operations (docs/design.md section 9) -----------------------------------------------
  py::class_<LLOutputs>(m, "LLOutputs")
      .def(py::init(&ll_outputs), py::arg("fields"),
           "One LL group's dispatch outputs: (name, outputs.ll_dispatch_fields' (shape, dtype) "
           "or None) per field of LLDispatchOutput, in its order (the order the bindings return "
           "them in).")
      .def_property_readonly("names", [](const LLOutputs& o) {
        py::list names;
        for (const LLSlot* s : o.slots) names.append(s->name);
        return py::tuple(names);
      });
  m.def(
      "ll_dispatch",
      [](uintptr_t handle, const at::Tensor& x, const OptTensor& topk_weights, bool send_only,
         const LLOutputs& outputs, const py::object& given, int device) {
        EP_RECORD_OP("nccl_ep::ll_dispatch");
        return ll_dispatch_call(Target{handle, nullptr, device}, x, topk_weights, send_only,
                                outputs, given);
      },
      py::arg("handle"), py::arg("x"), py::arg("topk_weights"), py::arg("send_only"),
      py::arg("outputs"), py::arg("out"), py::arg("device"));
  m.def(
      "ll_combine",
      [](uintptr_t handle, const at::Tensor& expert_out, const OptTensor& topk_weights,
         bool send_only, const OptTensor& given, int64_t num_tokens, at::ScalarType y_dtype,
         int device) {
        EP_RECORD_OP("nccl_ep::ll_combine");
        return ll_combine_call(Target{handle, nullptr, device}, expert_out, topk_weights,
                               send_only, given, num_tokens, y_dtype);
      },
      py::arg("handle"), py::arg("expert_out"), py::arg("topk_weights"), py::arg("send_only"),
      py::arg("out"), py::arg("num_tokens"), py::arg("y_dtype"), py::arg("device"), NoGil());
  m.def(
      "ll_new_outputs",
      // New `outputs`, allocated as ll_dispatch allocates its own (one allocation): the
      // LLDispatchOutput fields, in order, tensors or None (an `out` to fill in part).
      [](const LLOutputs& outputs, int device) {
        std::array<OptTensor, kLLFields> made;
        allocate(outputs, device, made);
        return as_fields(made);
      },
      py::arg("outputs"), py::arg("device"));
  m.def(
      "complete",
      [](uintptr_t handle, int device) {
        EP_RECORD_OP("nccl_ep::complete");
        check(ncclEpComplete(as_ptr<ncclEpHandle>(handle), current_stream(device)),
              "ncclEpComplete");
      },
      py::arg("handle"), py::arg("device"), NoGil());

  // --- the ops' argument checks on host tensors (call_checks.h) -------------------------------
  // Each check_* binding is its op's binding run to the library's checks of the call, with
  // host tensors (device -1) and the handle's shape given instead of a handle: the same
  // conversions, refusals and messages, and nothing enqueued. Returns None; raises as the op.
  py::class_<HostShape>(m, "CallShape")
      .def(py::init<const ncclEpGroupConfig_t&, int, long long, long long, long long>(),
           py::arg("config"), py::arg("nranks"), py::arg("num_tokens") = 0,
           py::arg("topk") = 0, py::arg("num_recv") = 0,
           "What an op's arguments are checked against: the group's configuration and size, "
           "the handle's T, K and (HT) dispatch rows.");
  m.def(
      "check_create_handle",
      [](const HostShape& s, const at::Tensor& routing, bool is_map) {
        create_handle_call(Target{0, &s.shape, -1}, routing, is_map);
      },
      py::arg("shape"), py::arg("routing"), py::arg("is_map"));
  m.def(
      "check_dispatch",
      [](const HostShape& s, const at::Tensor& x, const OptTensor& probs, bool dense) {
        dispatch_call(Target{0, &s.shape, -1}, x, probs, dense);
      },
      py::arg("shape"), py::arg("x"), py::arg("probs"), py::arg("dense"));
  m.def(
      "check_combine",
      [](const HostShape& s, const at::Tensor& expert_out, at::ScalarType y_dtype) {
        combine_call(Target{0, &s.shape, -1}, expert_out, s.shape.num_tokens, y_dtype);
      },
      py::arg("shape"), py::arg("expert_out"), py::arg("y_dtype"));
  m.def(
      "check_combine_topk_weights",
      [](const HostShape& s, const at::Tensor& grad_recv, bool dense) {
        const int64_t cols = dense ? s.cfg.num_experts : s.shape.topk;
        combine_topk_weights_call(Target{0, &s.shape, -1}, grad_recv, s.shape.num_tokens, cols,
                                  dense);
      },
      py::arg("shape"), py::arg("grad_recv"), py::arg("dense"));
  m.def(
      "check_ll_dispatch",
      [](const HostShape& s, const at::Tensor& x, const OptTensor& topk_weights, bool send_only,
         const LLOutputs& outputs, const py::object& given) {
        ll_dispatch_call(Target{0, &s.shape, -1}, x, topk_weights, send_only, outputs, given);
      },
      py::arg("shape"), py::arg("x"), py::arg("topk_weights"), py::arg("send_only"),
      py::arg("outputs"), py::arg("out"));
  m.def(
      "check_ll_combine",
      [](const HostShape& s, const at::Tensor& expert_out, const OptTensor& topk_weights,
         bool send_only, const OptTensor& given, at::ScalarType y_dtype) {
        ll_combine_call(Target{0, &s.shape, -1}, expert_out, topk_weights, send_only, given,
                        s.shape.num_tokens, y_dtype);
      },
      py::arg("shape"), py::arg("expert_out"), py::arg("topk_weights"), py::arg("send_only"),
      py::arg("out"), py::arg("y_dtype"));
}
