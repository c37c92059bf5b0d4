/*
 * nccl_ep_py.cc: the pybind11 module megatron_nccl_ep._C, a thin wrapper of nccl_ep.h.
 * Pointers, communicators, groups, handles and streams travel as Python ints; no torch here.
 * Tensors travel as specs (data_ptr, shape, dtype code) or None (tensor() below), positionally in
 * the order of the C structs' fields; one binding per C entry point (dispatch and combine serve
 * HT and LL, as ncclEpDispatch and ncclEpCombine do).
 * Failures raise ValueError (ncclInvalidArgument / ncclInvalidUsage) or
 * megatron_nccl_ep.errors.NcclEpError (others, a RuntimeError) with ncclEpGetLastError()'s
 * text, so that the package calls the bindings directly. Blocking calls release the GIL.
 */
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../include/nccl_ep.h"

namespace py = pybind11;

namespace {

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

cudaStream_t as_stream(uintptr_t v) { return reinterpret_cast<cudaStream_t>(v); }

// A tensor as every op binding takes it: a spec (data_ptr, shape, dtype code) of a contiguous
// tensor (shape: a tuple, e.g. torch.Size), or None for an absent one (ndim 0). Called with the
// GIL held.
ncclEpTensor_t tensor(const py::handle& spec, ncclEpTensorTag_t tag) {
  ncclEpTensor_t t{};
  if (spec.is_none()) return t;
  if (!py::isinstance<py::tuple>(spec) || py::len(spec) != 3 ||
      !py::isinstance<py::tuple>(py::reinterpret_borrow<py::tuple>(spec)[1]))
    throw ValueErrorEx("a tensor must be given as (data_ptr, shape tuple, dtype code) or None");
  const py::tuple tup = py::reinterpret_borrow<py::tuple>(spec);
  const py::tuple shape = py::reinterpret_borrow<py::tuple>(tup[1]);
  if (shape.size() > NCCL_EP_MAX_NDIM) throw ValueErrorEx("tensor: too many dimensions");
  t.data = reinterpret_cast<void*>(tup[0].cast<uintptr_t>());
  t.ndim = (int)shape.size();
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.sizes[i] = shape[(size_t)i].cast<int64_t>();
    t.strides[i] = stride;
    stride *= t.sizes[i];
  }
  t.dtype = static_cast<ncclDataType_t>(tup[2].cast<int>());
  t.tag = tag;
  return t;
}

// Routing weights: [T, K] in slot order, or a router's dense [T, E].
ncclEpTensorTag_t weights_tag(bool dense) {
  return dense ? NCCL_EP_TENSOR_ROUTING_PROBS : NCCL_EP_TENSOR_TOPK_WEIGHTS;
}

ncclEpOpConfig_t op_config(bool send_only) {
  ncclEpOpConfig_t c = NCCL_EP_OP_CONFIG_INITIALIZER;
  c.send_only = send_only ? 1 : 0;
  return c;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "megatron_nccl_ep CUDA backend: bindings of the nccl_ep.h C API";
  m.attr("API_VERSION") = NCCL_EP_API_VERSION;
  m.attr("NCCL_BUILD_VERSION") = NCCL_VERSION_CODE;
  py::dict dtypes;
  dtypes["bool"] = (int)ncclUint8;
  dtypes["int32"] = (int)ncclInt32;
  dtypes["int64"] = (int)ncclInt64;
  dtypes["float16"] = (int)ncclFloat16;
  dtypes["bfloat16"] = (int)ncclBfloat16;
  dtypes["float32"] = (int)ncclFloat32;
  dtypes["float64"] = (int)ncclFloat64;
  dtypes["float8_e4m3fn"] = (int)ncclFloat8e4m3;
  m.attr("DTYPES") = dtypes;
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
      py::arg("comm"), py::call_guard<py::gil_scoped_release>());

  // --- group ---------------------------------------------------------------------------------
  // The group configuration: NCCL_EP_GROUP_CONFIG_INITIALIZER, fields set by name.
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
          [](ncclEpGroupConfig_t& c, int v) { c.token_dtype = static_cast<ncclDataType_t>(v); })
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
      .def_property(
          "mode", [](const ncclEpGroupConfig_t& c) { return (int)c.mode; },
          [](ncclEpGroupConfig_t& c, int v) { c.mode = static_cast<ncclEpMode_t>(v); })
      .def_property(
          "layout", [](const ncclEpGroupConfig_t& c) { return (int)c.layout; },
          [](ncclEpGroupConfig_t& c, int v) { c.layout = static_cast<ncclEpLayout_t>(v); })
      .def_readwrite("dispatch_fp8", &ncclEpGroupConfig_t::dispatch_fp8);
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
  m.def(
      "create_group",
      [](uintptr_t comm, const ncclEpGroupConfig_t& cfg, uintptr_t stream) {
        ncclEpGroup_t g = nullptr;
        check(ncclEpCreateGroup(&g, as_ptr<ncclComm>(comm), &cfg, as_stream(stream)),
              "ncclEpCreateGroup");
        return reinterpret_cast<uintptr_t>(g);
      },
      py::arg("comm"), py::arg("config"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "create_local_team",
      [](int nranks, const ncclEpGroupConfig_t& cfg, uintptr_t stream) {
        std::vector<ncclEpGroup_t> groups(nranks > 0 ? nranks : 1, nullptr);
        {
          py::gil_scoped_release nogil;
          check(ncclEpCreateLocalTeam(groups.data(), nranks, &cfg, as_stream(stream)),
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
        return d;
      },
      py::arg("group"));
  m.def(
      "group_destroy",
      [](uintptr_t group) {
        check(ncclEpGroupDestroy(as_ptr<ncclEpGroup>(group)), "ncclEpGroupDestroy");
      },
      py::arg("group"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "group_check_errors",
      [](uintptr_t group) {
        check(ncclEpGroupCheckErrors(as_ptr<ncclEpGroup>(group)), "ncclEpGroupCheckErrors");
      },
      py::arg("group"), py::call_guard<py::gil_scoped_release>());

  // --- handle --------------------------------------------------------------------------------
  m.def(
      "create_handle",
      // routing: topk_idx [T, K] (is_map false) or a routing map [T, E].
      [](uintptr_t group, const py::object& routing, bool is_map, uintptr_t stream) {
        const ncclEpTensor_t r =
            tensor(routing, is_map ? NCCL_EP_TENSOR_ROUTING_MAP : NCCL_EP_TENSOR_TOPK_IDX);
        ncclEpHandle_t h = nullptr;
        py::gil_scoped_release nogil;
        check(ncclEpCreateHandle(&h, as_ptr<ncclEpGroup>(group), &r, nullptr, as_stream(stream)),
              "ncclEpCreateHandle");
        return reinterpret_cast<uintptr_t>(h);
      },
      py::arg("group"), py::arg("routing"), py::arg("is_map"), py::arg("stream"));
  m.def(
      "handle_topk_idx",
      [](uintptr_t handle, const py::object& out, uintptr_t stream) {
        ncclEpTensor_t t = tensor(out, NCCL_EP_TENSOR_TOPK_IDX);
        py::gil_scoped_release nogil;
        check(ncclEpHandleGetTopkIdx(as_ptr<ncclEpHandle>(handle), &t, as_stream(stream)),
              "ncclEpHandleGetTopkIdx");
      },
      py::arg("handle"), py::arg("out"), py::arg("stream"));
  m.def(
      "handle_destroy",
      [](uintptr_t handle) {
        check(ncclEpHandleDestroy(as_ptr<ncclEpHandle>(handle)), "ncclEpHandleDestroy");
      },
      py::arg("handle"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "handle_num_recv_tokens",
      [](uintptr_t handle) {
        int64_t n = 0;
        check(ncclEpHandleGetNumRecvTokens(as_ptr<ncclEpHandle>(handle), &n),
              "ncclEpHandleGetNumRecvTokens");
        return n;
      },
      py::arg("handle"), py::call_guard<py::gil_scoped_release>());
  m.def(
      "handle_tokens_per_expert",
      [](uintptr_t handle, const py::object& out, bool on_device, uintptr_t stream) {
        ncclEpTensor_t t = tensor(out, on_device ? NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_DEVICE
                                                 : NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_HOST);
        py::gil_scoped_release nogil;
        check(ncclEpHandleGetTokensPerExpert(as_ptr<ncclEpHandle>(handle), &t, as_stream(stream)),
              "ncclEpHandleGetTokensPerExpert");
      },
      py::arg("handle"), py::arg("out"), py::arg("on_device"), py::arg("stream"));

  // --- operations (HT and LL: docs/design.md sections 3, 4 and 9) ------------------------------
  m.def(
      "dispatch",
      // topk_weights: [T, K] in slot order, or dense [T, E] (HT); None: no weights.
      [](uintptr_t handle, const py::object& x, const py::object& topk_weights, bool dense,
         const py::object& recv_x, const py::object& recv_topk_weights,
         const py::object& recv_scales, const py::object& recv_count,
         const py::object& recv_src, const py::object& recv_topk_idx, bool send_only,
         uintptr_t stream) {
        ncclEpDispatchInputs_t in{};
        ncclEpDispatchOutputs_t out{};
        in.tokens = tensor(x, NCCL_EP_TENSOR_TOKENS);
        in.topk_weights = tensor(topk_weights, weights_tag(dense));
        out.recv_tokens = tensor(recv_x, NCCL_EP_TENSOR_TOKENS);
        out.recv_topk_weights = tensor(recv_topk_weights, NCCL_EP_TENSOR_TOPK_WEIGHTS);
        out.recv_scales = tensor(recv_scales, NCCL_EP_TENSOR_SCALES);
        out.recv_count = tensor(recv_count, NCCL_EP_TENSOR_RECV_COUNT);
        out.recv_src = tensor(recv_src, NCCL_EP_TENSOR_RECV_SRC);
        out.recv_topk_idx = tensor(recv_topk_idx, NCCL_EP_TENSOR_TOPK_IDX);
        const ncclEpOpConfig_t cfg = op_config(send_only);
        py::gil_scoped_release nogil;
        check(ncclEpDispatch(as_ptr<ncclEpHandle>(handle), &in, &out, &cfg, as_stream(stream)),
              "ncclEpDispatch");
      },
      py::arg("handle"), py::arg("x"), py::arg("topk_weights"), py::arg("dense"),
      py::arg("recv_x"), py::arg("recv_topk_weights"), py::arg("recv_scales"),
      py::arg("recv_count"), py::arg("recv_src"), py::arg("recv_topk_idx"), py::arg("send_only"),
      py::arg("stream"));
  m.def(
      "combine",
      // topk_weights: LL expert-major's weights of the sum; None otherwise.
      [](uintptr_t handle, const py::object& expert_out, const py::object& topk_weights,
         const py::object& y, bool send_only, uintptr_t stream) {
        ncclEpCombineInputs_t in{};
        ncclEpCombineOutputs_t out{};
        in.expert_tokens = tensor(expert_out, NCCL_EP_TENSOR_TOKENS);
        in.topk_weights = tensor(topk_weights, NCCL_EP_TENSOR_TOPK_WEIGHTS);
        out.tokens = tensor(y, NCCL_EP_TENSOR_TOKENS);
        const ncclEpOpConfig_t cfg = op_config(send_only);
        py::gil_scoped_release nogil;
        check(ncclEpCombine(as_ptr<ncclEpHandle>(handle), &in, &out, &cfg, as_stream(stream)),
              "ncclEpCombine");
      },
      py::arg("handle"), py::arg("expert_out"), py::arg("topk_weights"), py::arg("y"),
      py::arg("send_only"), py::arg("stream"));
  m.def(
      "combine_topk_weights",
      // grad: [T, K] in slot order, or dense [T, E].
      [](uintptr_t handle, const py::object& grad_recv, const py::object& grad, bool dense,
         uintptr_t stream) {
        ncclEpTensor_t in = tensor(grad_recv, NCCL_EP_TENSOR_TOPK_WEIGHTS);
        ncclEpTensor_t out = tensor(grad, weights_tag(dense));
        py::gil_scoped_release nogil;
        check(ncclEpCombineTopkWeights(as_ptr<ncclEpHandle>(handle), &in, &out, as_stream(stream)),
              "ncclEpCombineTopkWeights");
      },
      py::arg("handle"), py::arg("grad_recv"), py::arg("grad"), py::arg("dense"),
      py::arg("stream"));
  m.def(
      "complete",
      [](uintptr_t handle, uintptr_t stream) {
        check(ncclEpComplete(as_ptr<ncclEpHandle>(handle), as_stream(stream)), "ncclEpComplete");
      },
      py::arg("handle"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
}
