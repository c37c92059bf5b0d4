/*
 * ops.cc: ncclEpDispatch, ncclEpCombine, ncclEpCombineTopkWeights: argument checks, then per
 * chunk of C staged tokens: entry barrier -> push kernel -> barrier -> local kernel, all on the
 * caller's stream, no host synchronization. The barriers carry the call's signature (operation,
 * handle, probs or not), so ranks that are not making the same call fail with a clear error.
 *
 * NOTES:
 *  - The number of chunks comes from the group config (max_tokens_per_rank / C), never from
 *    this rank's T, so every rank runs the same barriers in the same order.
 *  - The entry barrier guarantees every peer finished reading its staging from the previous
 *    operation (its local kernel precedes its entry barrier in stream order) before anyone
 *    overwrites it. Double buffering could remove it later.
 */
#include <stdint.h>

#include "internal.h"

namespace nccl_ep {

namespace {

bool is_float_dtype(ncclDataType_t d) {
  return d == ncclFloat16 || d == ncclBfloat16 || d == ncclFloat32 || d == ncclFloat64;
}

// A contiguous row-major tensor of the given shape (d1 < 0: 1-D).
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

bool aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }

void fill_exchange(const ncclEpHandle* h, int chunk_index, ExchangeArgs* e) {
  const ncclEpGroup* g = h->group;
  const ncclEpHandleSlot* s = h->slot;
  e->peers = g->d_peers;
  e->tok_off = g->tok_off;
  e->prob_off = g->prob_off;
  e->stage_row_bytes = g->stage_row_bytes;
  e->chunk = g->chunk;
  e->c0 = chunk_index * g->chunk;
  e->first_chunk = chunk_index == 0;
  e->num_ranks = g->nranks;
  e->rank = g->rank;
  e->num_local = g->num_local;
  e->max_tokens = g->cfg.max_tokens_per_rank;
  e->max_topk = g->cfg.max_topk;
  e->topk = h->topk;
  e->num_tokens = h->num_tokens;
  e->gathered = s->gathered;
  e->rec_ints = g->rec_ints;
  e->own_routing = s->gathered + (size_t)g->rank * g->rec_ints + kRecordHeader;
  e->recv_row = s->recv_row;
  e->src_of_row = s->src_of_row;
  e->src_rows = g->src_rows;
  e->rows = h->num_recv;
  e->hidden = g->cfg.hidden;
  e->vec = 0;
  e->num_sms = g->num_sms;
  e->failed = g->d_epoch + 1;
}

ncclResult_t check_entry(ncclEpHandle_t handle, const ncclEpOpConfig_t* config, const char* fn) {
  EP_CHECK(handle != nullptr, ncclInvalidArgument, "%s: handle is NULL", fn);
  EP_RETURN_IF(check_op_config(config, fn));
  return check_group_errors(handle->group);
}

}  // namespace

}  // namespace nccl_ep

using namespace nccl_ep;

extern "C" ncclResult_t ncclEpDispatch(ncclEpHandle_t handle, const ncclEpDispatchInputs_t* inputs,
                                       ncclEpDispatchOutputs_t* outputs,
                                       const ncclEpOpConfig_t* config, cudaStream_t stream) {
  EP_RETURN_IF(check_entry(handle, config, "ncclEpDispatch"));
  EP_CHECK(inputs != nullptr && outputs != nullptr, ncclInvalidArgument,
           "ncclEpDispatch: inputs or outputs is NULL");
  ncclEpGroup* g = handle->group;
  const long long T = handle->num_tokens, H = g->cfg.hidden, N = handle->num_recv;
  EP_RETURN_IF(check_tensor(inputs->tokens, "x", T, H, g->cfg.token_dtype));
  EP_RETURN_IF(check_tensor(outputs->recv_tokens, "recv_x", N, H, g->cfg.token_dtype));
  // Presence is ndim, not data: a rank with no tokens passes an empty probs tensor (data may be
  // NULL) and must still write the probs of the rows it receives.
  const bool with_probs = inputs->topk_weights.ndim != 0;
  int prob_bytes = 4;
  if (with_probs) {
    const ncclDataType_t pd = inputs->topk_weights.dtype;
    EP_CHECK(is_float_dtype(pd), ncclInvalidArgument,
             "probs must have a floating dtype (float16, bfloat16, float32, float64), got %s",
             dtype_name(pd));
    EP_RETURN_IF(check_tensor(inputs->topk_weights, "probs", T, handle->topk, pd));
    EP_RETURN_IF(check_tensor(outputs->recv_topk_weights, "recv_probs", N, -1, pd));
    prob_bytes = dtype_bytes(pd);
  }
  DispatchArgs a;
  a.dtype = (int)g->cfg.token_dtype;
  a.x = inputs->tokens.data;
  a.probs = with_probs ? inputs->topk_weights.data : nullptr;
  a.prob_bytes = prob_bytes;
  a.recv_x = outputs->recv_tokens.data;
  a.recv_probs = with_probs ? outputs->recv_topk_weights.data : nullptr;
  const int vec = g->row_bytes % 16 == 0 && aligned16(a.x) && aligned16(a.recv_x);
  for (int c = 0; c < g->num_chunks; ++c) {
    fill_exchange(handle, c, &a.ex);
    a.ex.vec = vec;
    EP_RETURN_IF(barrier(g, call_signature(1, with_probs, handle->seq), stream));
    EP_CUDA(launch_dispatch_send(a, stream));
    EP_RETURN_IF(barrier(g, call_signature(2, with_probs, handle->seq), stream));
    EP_CUDA(launch_dispatch_expand(a, stream));
  }
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpCombine(ncclEpHandle_t handle, const ncclEpCombineInputs_t* inputs,
                                      ncclEpCombineOutputs_t* outputs,
                                      const ncclEpOpConfig_t* config, cudaStream_t stream) {
  EP_RETURN_IF(check_entry(handle, config, "ncclEpCombine"));
  EP_CHECK(inputs != nullptr && outputs != nullptr, ncclInvalidArgument,
           "ncclEpCombine: inputs or outputs is NULL");
  ncclEpGroup* g = handle->group;
  const long long T = handle->num_tokens, H = g->cfg.hidden, N = handle->num_recv;
  EP_RETURN_IF(check_tensor(inputs->expert_tokens, "expert_out", N, H, g->cfg.token_dtype));
  EP_RETURN_IF(check_tensor(outputs->tokens, "y", T, H, g->cfg.token_dtype));
  CombineArgs a;
  a.dtype = (int)g->cfg.token_dtype;
  a.expert_out = inputs->expert_tokens.data;
  a.y = outputs->tokens.data;
  const int vec = g->row_bytes % 16 == 0 && aligned16(a.expert_out) && aligned16(a.y);
  for (int c = 0; c < g->num_chunks; ++c) {
    fill_exchange(handle, c, &a.ex);
    a.ex.vec = vec;
    EP_RETURN_IF(barrier(g, call_signature(3, false, handle->seq), stream));
    EP_CUDA(launch_combine_reduce(a, stream));
    EP_RETURN_IF(barrier(g, call_signature(4, false, handle->seq), stream));
    EP_CUDA(launch_combine_gather(a, stream));
  }
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpCombineTopkWeights(ncclEpHandle_t handle,
                                                 const ncclEpTensor_t* grad_recv_topk_weights,
                                                 ncclEpTensor_t* grad_topk_weights,
                                                 cudaStream_t stream) {
  EP_RETURN_IF(check_entry(handle, nullptr, "ncclEpCombineTopkWeights"));
  EP_CHECK(grad_recv_topk_weights != nullptr && grad_topk_weights != nullptr,
           ncclInvalidArgument, "ncclEpCombineTopkWeights: a tensor argument is NULL");
  ncclEpGroup* g = handle->group;
  const ncclDataType_t pd = grad_recv_topk_weights->dtype;
  EP_CHECK(is_float_dtype(pd), ncclInvalidArgument,
           "grad_recv_probs must have a floating dtype (float16, bfloat16, float32, float64), "
           "got %s",
           dtype_name(pd));
  EP_RETURN_IF(check_tensor(*grad_recv_topk_weights, "grad_recv_probs", handle->num_recv, -1, pd));
  EP_RETURN_IF(check_tensor(*grad_topk_weights, "grad_probs", handle->num_tokens, handle->topk,
                            pd));
  CombineProbsArgs a;
  a.prob_bytes = dtype_bytes(pd);
  a.grad_recv = grad_recv_topk_weights->data;
  a.grad = grad_topk_weights->data;
  for (int c = 0; c < g->num_chunks; ++c) {
    fill_exchange(handle, c, &a.ex);
    EP_RETURN_IF(barrier(g, call_signature(5, false, handle->seq), stream));
    EP_CUDA(launch_combine_probs_send(a, stream));
    EP_RETURN_IF(barrier(g, call_signature(6, false, handle->seq), stream));
    EP_CUDA(launch_combine_probs_gather(a, stream));
  }
  return ncclSuccess;
}
