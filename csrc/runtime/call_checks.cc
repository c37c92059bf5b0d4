/*
 * call_checks.cc: each op's argument checks (call_checks.h): what a call's tensors must be for
 * its group and handle, compared on the host before anything is enqueued.
 */
#include "call_checks.h"

#include <stdint.h>

#include <initializer_list>
#include <string>

#include "config_traits.h"  // is_ll, payload_format: the configuration alone, no group state
#include "errors.h"

namespace nccl_ep {

namespace {

bool is_float_dtype(ncclDataType_t d) {
  return d == ncclFloat16 || d == ncclBfloat16 || d == ncclFloat32 || d == ncclFloat64;
}

// HT: a contiguous row-major tensor of the given shape (d1 < 0: 1-D).
ncclResult_t check_tensor(const ncclEpTensor_t& t, const char* name, long long d0, long long d1,
                          ncclDataType_t dtype) {
  const int ndim = d1 < 0 ? 1 : 2;
  EP_CHECK(t.ndim == ndim, ncclInvalidArgument, "%s must be %d-D, got %d dimensions", name, ndim,
           t.ndim);
  if (ndim == 1) {
    EP_CHECK(t.sizes[0] == d0, ncclInvalidArgument, "%s must have shape (%lld,), got (%lld,)",
             name, d0, (long long)t.sizes[0]);
    EP_CHECK(t.sizes[0] <= 1 || t.strides[0] == 1, ncclInvalidArgument,
             "%s must be contiguous", name);
  } else {
    EP_CHECK(t.sizes[0] == d0 && t.sizes[1] == d1, ncclInvalidArgument,
             "%s must have shape (%lld, %lld), got (%lld, %lld)", name, d0, d1,
             (long long)t.sizes[0], (long long)t.sizes[1]);
    EP_CHECK((t.sizes[1] <= 1 || t.strides[1] == 1) && (t.sizes[0] <= 1 || t.strides[0] == d1),
             ncclInvalidArgument, "%s must be contiguous (row-major)", name);
  }
  EP_CHECK(t.dtype == dtype, ncclInvalidArgument, "%s must have dtype %s, got %s", name,
           dtype_name(dtype), dtype_name(t.dtype));
  const long long n = d0 * (d1 < 0 ? 1 : d1);
  EP_CHECK(t.data != nullptr || n == 0, ncclInvalidArgument, "%s data is NULL", name);
  return ncclSuccess;
}

// HT routing weights in slot order [T, K] (TOPK_WEIGHTS) or dense [T, E] (ROUTING_PROBS).
ncclResult_t check_weights(const ncclEpTensor_t& t, const char* name, const CallShape& s) {
  EP_CHECK(is_float_dtype(t.dtype), ncclInvalidArgument,
           "%s must have a floating dtype (float16, bfloat16, float32, float64), got %s", name,
           dtype_name(t.dtype));
  EP_CHECK(t.tag == NCCL_EP_TENSOR_TOPK_WEIGHTS || t.tag == NCCL_EP_TENSOR_ROUTING_PROBS,
           ncclInvalidArgument, "%s must be tagged TOPK_WEIGHTS [T, K] or ROUTING_PROBS [T, E]",
           name);
  const bool dense = t.tag == NCCL_EP_TENSOR_ROUTING_PROBS;
  return check_tensor(t, name, s.num_tokens, dense ? s.cfg->num_experts : s.topk, t.dtype);
}

std::string shape_text(int ndim, const long long* sizes) {
  std::string text = "(";
  for (int i = 0; i < ndim; ++i)
    text += std::to_string(sizes[i]) + (i + 1 < ndim ? ", " : ndim == 1 ? ",)" : ")");
  return text;
}

// LL: a contiguous row-major tensor of `ndim` dimensions `sizes`, of `dtype`, 16-byte aligned.
// A valid call's checks are integer compares: the expected shape is written out only for a
// message.
ncclResult_t check_nd(const ncclEpTensor_t& t, const char* name, int ndim, const long long* sizes,
                      ncclDataType_t dtype) {
  EP_CHECK(t.ndim == ndim, ncclInvalidArgument, "%s must be %d-D %s, got %d dimensions", name,
           ndim, shape_text(ndim, sizes).c_str(), t.ndim);
  long long stride = 1, n = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    EP_CHECK(t.sizes[i] == sizes[i], ncclInvalidArgument, "%s must have shape %s, got size %lld "
             "in dimension %d", name, shape_text(ndim, sizes).c_str(), (long long)t.sizes[i], i);
    EP_CHECK(t.sizes[i] <= 1 || t.strides[i] == stride, ncclInvalidArgument,
             "%s must be contiguous (row-major)", name);
    stride *= sizes[i];
    n *= sizes[i];
  }
  EP_CHECK(t.dtype == dtype, ncclInvalidArgument, "%s must have dtype %s, got %s", name,
           dtype_name(dtype), dtype_name(t.dtype));
  EP_CHECK(t.data != nullptr || n == 0, ncclInvalidArgument, "%s data is NULL", name);
  EP_CHECK(((uintptr_t)t.data & 15u) == 0, ncclInvalidArgument,
           "%s must be 16-byte aligned (its rows move in 16-byte packs)", name);
  return ncclSuccess;
}

ncclResult_t check_nd(const ncclEpTensor_t& t, const char* name,
                      std::initializer_list<long long> sizes, ncclDataType_t dtype) {
  return check_nd(t, name, (int)sizes.size(), sizes.begin(), dtype);
}

// HT: topk_idx [T, K] (int32/int64) or a routing map [T, E] (bool), by its tag. T and K beyond
// the group's bounds pass here: the collective creation reports them on every rank (handle.cc).
ncclResult_t check_ht_routing(const CallShape& s, const ncclEpTensor_t& r) {
  const bool from_map = r.tag == NCCL_EP_TENSOR_ROUTING_MAP;
  const char* name = from_map ? "routing_map" : "topk_idx";
  EP_CHECK(r.ndim == 2, ncclInvalidArgument, "%s must be 2-D, got %d dimensions", name, r.ndim);
  if (from_map) {
    EP_CHECK(r.dtype == ncclUint8 || r.dtype == ncclInt8, ncclInvalidArgument,
             "routing_map must be bool (uint8/int8 elements), got %s", dtype_name(r.dtype));
    EP_CHECK(r.sizes[1] == s.cfg->num_experts, ncclInvalidArgument,
             "routing_map must have num_experts=%d columns, got %lld", s.cfg->num_experts,
             (long long)r.sizes[1]);
  } else {
    EP_CHECK(r.dtype == ncclInt32 || r.dtype == ncclInt64, ncclInvalidArgument,
             "topk_idx must be int32 or int64, got %s", dtype_name(r.dtype));
  }
  const long long T = r.sizes[0], K = from_map ? s.cfg->max_topk : r.sizes[1];
  EP_CHECK(T >= 0 && K >= 0, ncclInvalidArgument, "%s sizes must be >= 0", name);
  EP_CHECK(r.strides[0] >= 0 && r.strides[1] >= 0, ncclInvalidArgument,
           "%s strides must be >= 0", name);
  EP_CHECK(r.data != nullptr || T == 0, ncclInvalidArgument, "%s data is NULL", name);
  return ncclSuccess;
}

// LL: topk_idx [T, K] within the group's bounds (no collective reports them later).
ncclResult_t check_ll_routing(const CallShape& s, const ncclEpTensor_t& r) {
  const ncclEpGroupConfig_t& c = *s.cfg;
  EP_CHECK(r.tag == NCCL_EP_TENSOR_TOPK_IDX, ncclInvalidArgument,
           "an LL handle is made from topk_idx [T, K] (tag TOPK_IDX), got tag %d", (int)r.tag);
  EP_CHECK(r.ndim == 2, ncclInvalidArgument, "topk_idx must be 2-D, got %d dimensions", r.ndim);
  EP_CHECK(r.dtype == ncclInt32 || r.dtype == ncclInt64, ncclInvalidArgument,
           "topk_idx must be int32 or int64, got %s", dtype_name(r.dtype));
  const long long T = r.sizes[0], K = r.sizes[1];
  EP_CHECK(T >= 0 && T <= c.max_tokens_per_rank, ncclInvalidArgument,
           "topk_idx has %lld tokens, expected 0 <= T <= max_tokens_per_rank (T_max)=%d of this "
           "LL group",
           T, c.max_tokens_per_rank);
  EP_CHECK(K >= 1 && K <= c.max_topk, ncclInvalidArgument,
           "topk_idx has top-k %lld, expected 1 <= top-k <= max_topk=%d", K, c.max_topk);
  EP_CHECK(r.strides[0] >= 0 && r.strides[1] >= 0, ncclInvalidArgument,
           "topk_idx strides must be >= 0");
  EP_CHECK(r.data != nullptr || T == 0, ncclInvalidArgument, "topk_idx data is NULL");
  return ncclSuccess;
}

ncclResult_t check_ht_dispatch(const CallShape& s, const ncclEpDispatchInputs_t& in,
                               const ncclEpDispatchOutputs_t& out) {
  const ncclEpGroupConfig_t& c = *s.cfg;
  const long long T = s.num_tokens, H = c.hidden, N = s.num_recv;
  EP_RETURN_IF(check_tensor(in.tokens, "x", T, H, c.token_dtype));
  EP_RETURN_IF(check_tensor(out.recv_tokens, "recv_x", N, H, c.token_dtype));
  // Presence is ndim, not data: a rank with no tokens passes an empty probs tensor (data may be
  // NULL) and must still write the probs of the rows it receives.
  if (in.topk_weights.ndim != 0) {
    EP_RETURN_IF(check_weights(in.topk_weights, "probs", s));
    EP_RETURN_IF(
        check_tensor(out.recv_topk_weights, "recv_probs", N, -1, in.topk_weights.dtype));
  }
  return ncclSuccess;
}

ncclResult_t check_ll_dispatch(const CallShape& s, const ncclEpDispatchInputs_t& in,
                               const ncclEpDispatchOutputs_t& out) {
  const ncclEpGroupConfig_t& c = *s.cfg;
  const long long T = s.num_tokens, K = s.topk, H = c.hidden, L = c.num_experts / s.nranks,
                  Km = c.max_topk, RT = (long long)s.nranks * c.max_tokens_per_rank;
  const bool rank_major = c.layout == ncclEpLayoutRankMajor;
  const PayloadFormat payload = payload_format(c);
  const ncclDataType_t x_type = payload.dtype;
  const bool scaled = payload.scale_block > 0;
  const long long blocks = scaled ? H / payload.scale_block : 0;
  EP_RETURN_IF(check_nd(in.tokens, "x", {T, H}, c.token_dtype));
  const bool weights = in.topk_weights.ndim != 0;
  if (weights) EP_RETURN_IF(check_nd(in.topk_weights, "topk_weights", {T, K}, ncclFloat32));
  if (rank_major) {
    EP_RETURN_IF(check_nd(out.recv_tokens, "recv_x", {RT, H}, x_type));
    EP_RETURN_IF(check_nd(out.recv_count, "recv_count", {1}, ncclInt32));
    EP_RETURN_IF(check_nd(out.recv_topk_idx, "recv_topk_idx", {RT, Km}, ncclInt32));
    if (weights)
      EP_RETURN_IF(check_nd(out.recv_topk_weights, "recv_topk_weights", {RT, Km}, ncclFloat32));
    EP_CHECK(weights || out.recv_topk_weights.ndim == 0, ncclInvalidArgument,
             "recv_topk_weights must be absent (ndim 0) when the dispatch has no topk_weights");
    if (scaled)
      EP_RETURN_IF(check_nd(out.recv_scales, "recv_scales", {RT, blocks}, ncclFloat32));
  } else {
    EP_RETURN_IF(check_nd(out.recv_tokens, "recv_x", {L, RT, H}, x_type));
    EP_RETURN_IF(check_nd(out.recv_count, "recv_count", {L}, ncclInt32));
    EP_RETURN_IF(check_nd(out.recv_src, "recv_src", {L, RT}, ncclInt32));
    if (scaled)
      EP_RETURN_IF(check_nd(out.recv_scales, "recv_scales", {L, RT, blocks}, ncclFloat32));
  }
  EP_CHECK(scaled || out.recv_scales.ndim == 0, ncclInvalidArgument,
           "recv_scales must be absent (ndim 0): this group's payload_dtype has no scales");
  return ncclSuccess;
}

ncclResult_t check_ht_combine(const CallShape& s, const ncclEpCombineInputs_t& in,
                              const ncclEpCombineOutputs_t& out) {
  const ncclEpGroupConfig_t& c = *s.cfg;
  EP_RETURN_IF(check_tensor(in.expert_tokens, "expert_out", s.num_recv, c.hidden, c.token_dtype));
  return check_tensor(out.tokens, "y", s.num_tokens, c.hidden, c.token_dtype);
}

ncclResult_t check_ll_combine(const CallShape& s, const ncclEpCombineInputs_t& in,
                              const ncclEpCombineOutputs_t& out) {
  const ncclEpGroupConfig_t& c = *s.cfg;
  const long long T = s.num_tokens, K = s.topk, H = c.hidden, L = c.num_experts / s.nranks,
                  RT = (long long)s.nranks * c.max_tokens_per_rank;
  // fp32 rows are rounded to the token dtype as the kernel reads them (design section 9).
  const ncclDataType_t given = in.expert_tokens.dtype;
  const ncclDataType_t rows = given == ncclFloat32 ? ncclFloat32 : c.token_dtype;
  EP_CHECK(given == rows || c.token_dtype == ncclFloat32, ncclInvalidArgument,
           "expert_out must have dtype %s or float32 (rounded to %s as read), got %s",
           dtype_name(c.token_dtype), dtype_name(c.token_dtype), dtype_name(given));
  if (c.layout == ncclEpLayoutRankMajor) {
    EP_RETURN_IF(check_nd(in.expert_tokens, "expert_out", {RT, H}, rows));
    EP_CHECK(in.topk_weights.ndim == 0, ncclInvalidArgument,
             "topk_weights must be absent (ndim 0) in a rank-major LL combine: each rank's "
             "partial rows are already weighted");
  } else {
    EP_RETURN_IF(check_nd(in.expert_tokens, "expert_out", {L, RT, H}, rows));
    EP_RETURN_IF(check_nd(in.topk_weights, "topk_weights", {T, K}, ncclFloat32));
  }
  return check_nd(out.tokens, "y", {T, H}, c.token_dtype);
}

ncclResult_t check_combine_probs(const CallShape& s, const ncclEpTensor_t* grad_recv,
                                 const ncclEpTensor_t* grad) {
  EP_CHECK(grad_recv != nullptr && grad != nullptr, ncclInvalidArgument,
           "ncclEpCombineTopkWeights: a tensor argument is NULL");
  const ncclDataType_t pd = grad_recv->dtype;
  EP_CHECK(is_float_dtype(pd), ncclInvalidArgument,
           "grad_recv_probs must have a floating dtype (float16, bfloat16, float32, float64), "
           "got %s",
           dtype_name(pd));
  EP_RETURN_IF(check_tensor(*grad_recv, "grad_recv_probs", s.num_recv, -1, pd));
  EP_RETURN_IF(check_weights(*grad, "grad_probs", s));
  EP_CHECK(grad->dtype == pd, ncclInvalidArgument,
           "grad_probs must have the dtype of grad_recv_probs (%s), got %s", dtype_name(pd),
           dtype_name(grad->dtype));
  return ncclSuccess;
}

}  // namespace

}  // namespace nccl_ep

using namespace nccl_ep;

extern "C" ncclResult_t megatron_nccl_ep_check_routing(const CallShape* s,
                                                       const ncclEpTensor_t* routing) {
  EP_CHECK(s != nullptr && s->cfg != nullptr && routing != nullptr, ncclInvalidArgument,
           "megatron_nccl_ep_check_routing: an argument is NULL");
  return is_ll(*s->cfg) ? check_ll_routing(*s, *routing) : check_ht_routing(*s, *routing);
}

extern "C" ncclResult_t megatron_nccl_ep_check_dispatch(const CallShape* s,
                                                        const ncclEpDispatchInputs_t* inputs,
                                                        const ncclEpDispatchOutputs_t* outputs) {
  EP_CHECK(s != nullptr && s->cfg != nullptr && inputs != nullptr && outputs != nullptr,
           ncclInvalidArgument, "megatron_nccl_ep_check_dispatch: an argument is NULL");
  return is_ll(*s->cfg) ? check_ll_dispatch(*s, *inputs, *outputs)
                        : check_ht_dispatch(*s, *inputs, *outputs);
}

extern "C" ncclResult_t megatron_nccl_ep_check_combine(const CallShape* s,
                                                       const ncclEpCombineInputs_t* inputs,
                                                       const ncclEpCombineOutputs_t* outputs) {
  EP_CHECK(s != nullptr && s->cfg != nullptr && inputs != nullptr && outputs != nullptr,
           ncclInvalidArgument, "megatron_nccl_ep_check_combine: an argument is NULL");
  return is_ll(*s->cfg) ? check_ll_combine(*s, *inputs, *outputs)
                        : check_ht_combine(*s, *inputs, *outputs);
}

extern "C" ncclResult_t megatron_nccl_ep_check_combine_probs(
    const CallShape* s, const ncclEpTensor_t* grad_recv_topk_weights,
    const ncclEpTensor_t* grad_topk_weights) {
  EP_CHECK(s != nullptr && s->cfg != nullptr, ncclInvalidArgument,
           "megatron_nccl_ep_check_combine_probs: an argument is NULL");
  return check_combine_probs(*s, grad_recv_topk_weights, grad_topk_weights);
}
