/*
 * nccl_ep_py.cc: the pybind11 module megatron_nccl_ep._C, a thin wrapper of nccl_ep.h.
 * Pointers, communicators, groups, handles and streams travel as Python ints; no torch here.
 * Failures raise ValueError (ncclInvalidArgument / ncclInvalidUsage) or RuntimeError (others)
 * with ncclEpGetLastError()'s text. Blocking calls release the GIL.
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

// std::invalid_argument becomes ValueError, std::runtime_error RuntimeError (pybind11's standard
// translation, done once the GIL is back, so throwing inside gil_scoped_release is fine).
struct ValueErrorEx : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

void check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  std::string msg = ncclEpGetLastError();
  if (msg.empty()) msg = std::string(what) + " failed: " + ncclGetErrorString(r);
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) throw ValueErrorEx(msg);
  throw std::runtime_error(msg);
}

void check_nccl(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  const char* last = ncclGetLastError(nullptr);
  throw std::runtime_error(std::string(what) + " failed: " + ncclGetErrorString(r) +
                           (last != nullptr && *last ? std::string(": ") + last : std::string()));
}

template <typename T>
T* as_ptr(uintptr_t v) {
  return reinterpret_cast<T*>(v);
}

cudaStream_t as_stream(uintptr_t v) { return reinterpret_cast<cudaStream_t>(v); }

ncclEpTensor_t tensor1d(uintptr_t data, int64_t n, int dtype, ncclEpTensorTag_t tag) {
  ncclEpTensor_t t{};
  t.data = reinterpret_cast<void*>(data);
  t.ndim = 1;
  t.sizes[0] = n;
  t.strides[0] = 1;
  t.dtype = static_cast<ncclDataType_t>(dtype);
  t.tag = tag;
  return t;
}

ncclEpTensor_t tensor2d(uintptr_t data, int64_t rows, int64_t cols, int dtype,
                        ncclEpTensorTag_t tag) {
  ncclEpTensor_t t{};
  t.data = reinterpret_cast<void*>(data);
  t.ndim = 2;
  t.sizes[0] = rows;
  t.sizes[1] = cols;
  t.strides[0] = cols;
  t.strides[1] = 1;
  t.dtype = static_cast<ncclDataType_t>(dtype);
  t.tag = tag;
  return t;
}

// Routing weights: [T, K] in slot order, or [T, E] dense.
ncclEpTensor_t weights2d(uintptr_t data, int64_t rows, int64_t cols, int dtype, bool dense) {
  return tensor2d(data, rows, cols, dtype,
                  dense ? NCCL_EP_TENSOR_ROUTING_PROBS : NCCL_EP_TENSOR_TOPK_WEIGHTS);
}

// A contiguous tensor from (data, shape, dtype); None: absent (ndim 0).
ncclEpTensor_t tensor_nd(const py::object& spec, ncclEpTensorTag_t tag) {
  ncclEpTensor_t t{};
  if (spec.is_none()) return t;
  const py::tuple tup = spec.cast<py::tuple>();
  const std::vector<int64_t> shape = tup[1].cast<std::vector<int64_t>>();
  if (shape.size() > NCCL_EP_MAX_NDIM) throw ValueErrorEx("tensor_nd: too many dimensions");
  t.data = reinterpret_cast<void*>(tup[0].cast<uintptr_t>());
  t.ndim = (int)shape.size();
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.sizes[i] = shape[i];
    t.strides[i] = stride;
    stride *= shape[i];
  }
  t.dtype = static_cast<ncclDataType_t>(tup[2].cast<int>());
  t.tag = tag;
  return t;
}

ncclEpTensor_t entry(const py::dict& d, const char* name, ncclEpTensorTag_t tag) {
  return d.contains(name) ? tensor_nd(d[name], tag) : ncclEpTensor_t{};
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
      // routing: topk_idx [num_tokens, cols] (is_map false) or routing_map [num_tokens, E].
      [](uintptr_t group, uintptr_t routing, int64_t num_tokens, int64_t cols, int dtype,
         bool is_map, uintptr_t stream) {
        ncclEpTensor_t r = tensor2d(routing, num_tokens, cols, dtype,
                                    is_map ? NCCL_EP_TENSOR_ROUTING_MAP : NCCL_EP_TENSOR_TOPK_IDX);
        ncclEpHandle_t h = nullptr;
        check(ncclEpCreateHandle(&h, as_ptr<ncclEpGroup>(group), &r, nullptr, as_stream(stream)),
              "ncclEpCreateHandle");
        return reinterpret_cast<uintptr_t>(h);
      },
      py::arg("group"), py::arg("routing"), py::arg("num_tokens"), py::arg("cols"),
      py::arg("dtype"), py::arg("is_map"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "handle_topk_idx",
      [](uintptr_t handle, uintptr_t out, int64_t num_tokens, int64_t topk, int dtype,
         uintptr_t stream) {
        ncclEpTensor_t t = tensor2d(out, num_tokens, topk, dtype, NCCL_EP_TENSOR_TOPK_IDX);
        check(ncclEpHandleGetTopkIdx(as_ptr<ncclEpHandle>(handle), &t, as_stream(stream)),
              "ncclEpHandleGetTopkIdx");
      },
      py::arg("handle"), py::arg("out"), py::arg("num_tokens"), py::arg("topk"), py::arg("dtype"),
      py::arg("stream"), py::call_guard<py::gil_scoped_release>());
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
      [](uintptr_t handle, uintptr_t out, int64_t num_local_experts, bool on_device,
         uintptr_t stream) {
        ncclEpTensor_t t = tensor1d(out, num_local_experts, (int)ncclInt64,
                                    on_device ? NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_DEVICE
                                              : NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_HOST);
        check(ncclEpHandleGetTokensPerExpert(as_ptr<ncclEpHandle>(handle), &t, as_stream(stream)),
              "ncclEpHandleGetTokensPerExpert");
      },
      py::arg("handle"), py::arg("out"), py::arg("num_local_experts"), py::arg("on_device"),
      py::arg("stream"), py::call_guard<py::gil_scoped_release>());

  // --- operations ----------------------------------------------------------------------------
  m.def(
      "dispatch",
      // probs: [num_tokens, probs_cols], dense ([T, E]) or in slot order ([T, K]).
      [](uintptr_t handle, uintptr_t x, int64_t num_tokens, int64_t hidden, int dtype,
         bool has_probs, uintptr_t probs, int probs_dtype, int64_t probs_cols, bool dense,
         uintptr_t recv_x, int64_t num_recv, uintptr_t recv_probs, uintptr_t stream) {
        ncclEpDispatchInputs_t in{};  // topk_weights / recv_topk_weights: ndim 0 = no probs
        ncclEpDispatchOutputs_t out{};
        in.tokens = tensor2d(x, num_tokens, hidden, dtype, NCCL_EP_TENSOR_TOKENS);
        out.recv_tokens = tensor2d(recv_x, num_recv, hidden, dtype, NCCL_EP_TENSOR_TOKENS);
        if (has_probs) {
          in.topk_weights = weights2d(probs, num_tokens, probs_cols, probs_dtype, dense);
          out.recv_topk_weights = tensor1d(recv_probs, num_recv, probs_dtype,
                                           NCCL_EP_TENSOR_TOPK_WEIGHTS);
        }
        check(ncclEpDispatch(as_ptr<ncclEpHandle>(handle), &in, &out, nullptr, as_stream(stream)),
              "ncclEpDispatch");
      },
      py::arg("handle"), py::arg("x"), py::arg("num_tokens"), py::arg("hidden"), py::arg("dtype"),
      py::arg("has_probs"), py::arg("probs"), py::arg("probs_dtype"), py::arg("probs_cols"),
      py::arg("dense"), py::arg("recv_x"),
      py::arg("num_recv"), py::arg("recv_probs"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "combine",
      [](uintptr_t handle, uintptr_t expert_out, int64_t num_recv, int64_t hidden, int dtype,
         uintptr_t y, int64_t num_tokens, uintptr_t stream) {
        ncclEpCombineInputs_t in{};
        ncclEpCombineOutputs_t out{};
        in.expert_tokens = tensor2d(expert_out, num_recv, hidden, dtype, NCCL_EP_TENSOR_TOKENS);
        out.tokens = tensor2d(y, num_tokens, hidden, dtype, NCCL_EP_TENSOR_TOKENS);
        check(ncclEpCombine(as_ptr<ncclEpHandle>(handle), &in, &out, nullptr, as_stream(stream)),
              "ncclEpCombine");
      },
      py::arg("handle"), py::arg("expert_out"), py::arg("num_recv"), py::arg("hidden"),
      py::arg("dtype"), py::arg("y"), py::arg("num_tokens"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "combine_topk_weights",
      [](uintptr_t handle, uintptr_t grad_recv, int64_t num_recv, int dtype, uintptr_t grad,
         int64_t num_tokens, int64_t cols, bool dense, uintptr_t stream) {
        ncclEpTensor_t in = tensor1d(grad_recv, num_recv, dtype, NCCL_EP_TENSOR_TOPK_WEIGHTS);
        ncclEpTensor_t out = weights2d(grad, num_tokens, cols, dtype, dense);
        check(ncclEpCombineTopkWeights(as_ptr<ncclEpHandle>(handle), &in, &out, as_stream(stream)),
              "ncclEpCombineTopkWeights");
      },
      py::arg("handle"), py::arg("grad_recv"), py::arg("num_recv"), py::arg("dtype"),
      py::arg("grad"), py::arg("num_tokens"), py::arg("cols"), py::arg("dense"),
      py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());
  // --- LL (docs/design.md section 9): tensors as {name: (data, shape, dtype)} ------------------
  m.def(
      "ll_dispatch",
      [](uintptr_t handle, const py::dict& tensors, bool send_only, uintptr_t stream) {
        ncclEpDispatchInputs_t in{};
        ncclEpDispatchOutputs_t out{};
        in.tokens = entry(tensors, "x", NCCL_EP_TENSOR_TOKENS);
        in.topk_weights = entry(tensors, "topk_weights", NCCL_EP_TENSOR_TOPK_WEIGHTS);
        out.recv_tokens = entry(tensors, "recv_x", NCCL_EP_TENSOR_TOKENS);
        out.recv_scales = entry(tensors, "recv_scales", NCCL_EP_TENSOR_SCALES);
        out.recv_count = entry(tensors, "recv_count", NCCL_EP_TENSOR_RECV_COUNT);
        out.recv_src = entry(tensors, "recv_src", NCCL_EP_TENSOR_RECV_SRC);
        out.recv_topk_idx = entry(tensors, "recv_topk_idx", NCCL_EP_TENSOR_TOPK_IDX);
        out.recv_topk_weights = entry(tensors, "recv_topk_weights", NCCL_EP_TENSOR_TOPK_WEIGHTS);
        const ncclEpOpConfig_t cfg = op_config(send_only);
        py::gil_scoped_release nogil;
        check(ncclEpDispatch(as_ptr<ncclEpHandle>(handle), &in, &out, &cfg, as_stream(stream)),
              "ncclEpDispatch");
      },
      py::arg("handle"), py::arg("tensors"), py::arg("send_only"), py::arg("stream"));
  m.def(
      "ll_combine",
      [](uintptr_t handle, const py::dict& tensors, bool send_only, uintptr_t stream) {
        ncclEpCombineInputs_t in{};
        ncclEpCombineOutputs_t out{};
        in.expert_tokens = entry(tensors, "expert_out", NCCL_EP_TENSOR_TOKENS);
        in.topk_weights = entry(tensors, "topk_weights", NCCL_EP_TENSOR_TOPK_WEIGHTS);
        out.tokens = entry(tensors, "y", NCCL_EP_TENSOR_TOKENS);
        const ncclEpOpConfig_t cfg = op_config(send_only);
        py::gil_scoped_release nogil;
        check(ncclEpCombine(as_ptr<ncclEpHandle>(handle), &in, &out, &cfg, as_stream(stream)),
              "ncclEpCombine");
      },
      py::arg("handle"), py::arg("tensors"), py::arg("send_only"), py::arg("stream"));
  m.def(
      "complete",
      [](uintptr_t handle, uintptr_t stream) {
        check(ncclEpComplete(as_ptr<ncclEpHandle>(handle), as_stream(stream)), "ncclEpComplete");
      },
      py::arg("handle"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
}
