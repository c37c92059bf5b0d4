/*
 * handle.cc: ncclEpCreateHandle and the handle getters.
 *
 * Creation (collective, stream-ordered): pack own routing (top-k ids or a routing map) ->
 * ncclAllGather of the fixed-size records -> layout kernels (layout.cu). Exact mode then copies
 * [error, N_d, tokens_per_expert] to pinned memory once and synchronizes the stream; capacity mode
 * returns at once and reports errors through the group's mapped error word (a rank whose own
 * shape is out of bounds waits for it and raises at once).
 *
 * NOTES:
 *  - Every rank validates the routing of every rank (it has them all after the all-gather), so in
 *    exact mode all ranks return the same error together: nobody is left in a collective.
 */
#include <string.h>

#include "internal.h"

namespace nccl_ep {

ncclResult_t check_op_config(const ncclEpOpConfig_t* config, const char* fn) {
  if (config == nullptr) return ncclSuccess;
  EP_CHECK(config->size >= sizeof(ncclEpOpConfig_t) && config->version == NCCL_EP_API_VERSION,
           ncclInvalidArgument,
           "%s: config.size/version do not match this library; use NCCL_EP_OP_CONFIG_INITIALIZER",
           fn);
  EP_CHECK(config->send_only == 0, ncclInvalidUsage,
           "%s: send_only (LL staged mode) is not implemented in HT mode", fn);
  return ncclSuccess;
}

void destroy_handle_state(ncclEpHandle* h) {
  ncclEpGroup* g = h->group;
  for (size_t i = 0; i < g->live.size(); ++i) {
    if (g->live[i] == h) {
      g->live.erase(g->live.begin() + i);
      break;
    }
  }
  release_slot(g, h->slot);
  delete h;
}

static ncclResult_t create_handle(ncclEpHandle* h, const ncclEpTensor_t* routing,
                                  cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  const ncclEpGroupConfig_t& c = g->cfg;
  const bool from_map = routing->tag == NCCL_EP_TENSOR_ROUTING_MAP;
  const char* name = from_map ? "routing_map" : "topk_idx";
  EP_CHECK(routing->ndim == 2, ncclInvalidArgument, "%s must be 2-D, got %d dimensions", name,
           routing->ndim);
  if (from_map) {
    EP_CHECK(routing->dtype == ncclUint8 || routing->dtype == ncclInt8, ncclInvalidArgument,
             "routing_map must be bool (uint8/int8 elements), got %s",
             dtype_name(routing->dtype));
    EP_CHECK(routing->sizes[1] == c.num_experts, ncclInvalidArgument,
             "routing_map must have num_experts=%d columns, got %lld", c.num_experts,
             (long long)routing->sizes[1]);
  } else {
    EP_CHECK(routing->dtype == ncclInt32 || routing->dtype == ncclInt64, ncclInvalidArgument,
             "topk_idx must be int32 or int64, got %s", dtype_name(routing->dtype));
  }
  // A routing map fills max_topk slots per token.
  const long long T = routing->sizes[0], K = from_map ? c.max_topk : routing->sizes[1];
  EP_CHECK(T >= 0 && K >= 0, ncclInvalidArgument, "%s sizes must be >= 0", name);
  EP_CHECK(routing->strides[0] >= 0 && routing->strides[1] >= 0, ncclInvalidArgument,
           "%s strides must be >= 0", name);
  EP_CHECK(routing->data != nullptr || T == 0, ncclInvalidArgument, "%s data is NULL", name);
  // NOTES: T or K beyond the group's bounds still joins the all-gather, with an empty record
  // whose header holds the real shape, so every rank reports the error together (kErrShape)
  // instead of leaving its peers in the collective.
  const bool fits = T <= c.max_tokens_per_rank && K >= 1 && K <= c.max_topk;
  const int header_tokens = (int)(T < 0x7fffffff ? T : 0x7fffffff);
  const int header_topk = (int)(K < 0x7fffffff ? K : 0x7fffffff);
  h->num_tokens = fits ? (int)T : 0;
  h->topk = fits ? (int)K : 1;

  EP_RETURN_IF(acquire_slot(g, &h->slot));
  ncclEpHandleSlot* s = h->slot;
  EP_CUDA(cudaMemsetAsync(s->recv_row, 0xff, s->ff_bytes, stream));
  EP_CUDA(cudaMemsetAsync(s->meta, 0, s->zero_bytes, stream));
  int* own = s->gathered + (size_t)g->rank * g->rec_ints;
  if (from_map) {
    EP_CUDA(launch_pack_routing_map(routing->data, routing->strides[0], routing->strides[1],
                                    h->num_tokens, c.num_experts, h->topk, header_tokens,
                                    header_topk, own, stream));
  } else {
    EP_CUDA(launch_pack_routing(routing->data, routing->dtype == ncclInt64, routing->strides[0],
                                routing->strides[1], h->num_tokens, h->topk, header_tokens,
                                header_topk, own, stream));
  }
  h->seq = g->handles_created++;  // every rank counts the same collective creations
  EP_NCCL(ncclAllGather(own, s->gathered, (size_t)g->rec_ints, ncclInt32, g->comm, stream));

  LayoutArgs a;
  a.gathered = s->gathered;
  a.rec_ints = g->rec_ints;
  a.num_ranks = g->nranks;
  a.rank = g->rank;
  a.num_experts = c.num_experts;
  a.num_local = g->num_local;
  a.max_tokens = c.max_tokens_per_rank;
  a.max_topk = c.max_topk;
  a.topk = h->topk;
  a.align = c.expert_alignment;
  a.capacity = g->capacity;
  a.cnt = s->cnt;
  a.off = s->off;
  a.recv_row = s->recv_row;
  a.src_of_row = s->src_of_row;
  a.src_rows = g->src_rows;
  a.err_key = s->err_key;
  a.hist = s->hist;
  a.meta = s->meta;
  a.err = g->capacity >= 0 ? g->d_err : &s->meta->err;
  EP_CUDA(launch_layout(a, stream));

  if (g->capacity >= 0) {
    h->num_recv = g->capacity;
    if (fits) return ncclSuccess;
    // This rank knows it failed: an error path may wait for the layout, whose error word holds
    // the error all ranks agree on (the lowest failing rank's, maybe not this one's).
    EP_CUDA(cudaStreamSynchronize(stream));
    EP_RETURN_IF(check_group_errors(g));
    EP_CHECK(false, ncclInternalError, "%s shape out of bounds but no error was recorded", name);
  }
  // Exact mode: the one device-to-host copy of the handle.
  EP_CUDA(cudaMemcpyAsync(g->h_meta, s->meta, g->meta_bytes, cudaMemcpyDeviceToHost, stream));
  EP_CUDA(cudaStreamSynchronize(stream));
  const LayoutMeta* m = reinterpret_cast<const LayoutMeta*>(g->h_meta);
  if (m->err.code != kErrNone) return report_error(g, m->err, m);
  h->num_recv = m->num_rows;
  h->tokens_per_expert.assign(m->tokens_per_expert, m->tokens_per_expert + g->num_local);
  return ncclSuccess;
}

}  // namespace nccl_ep

using namespace nccl_ep;

extern "C" ncclResult_t ncclEpCreateHandle(ncclEpHandle_t* handle, ncclEpGroup_t group,
                                           const ncclEpTensor_t* routing,
                                           const ncclEpOpConfig_t* config, cudaStream_t stream) {
  EP_CHECK(handle != nullptr, ncclInvalidArgument, "ncclEpCreateHandle: handle is NULL");
  *handle = nullptr;
  EP_CHECK(group != nullptr, ncclInvalidArgument, "ncclEpCreateHandle: group is NULL");
  EP_CHECK(routing != nullptr, ncclInvalidArgument, "ncclEpCreateHandle: routing is NULL");
  EP_RETURN_IF(check_op_config(config, "ncclEpCreateHandle"));
  EP_RETURN_IF(check_group_errors(group));
  ncclEpHandle* h = new ncclEpHandle();
  h->group = group;
  group->live.push_back(h);
  ncclResult_t res = create_handle(h, routing, stream);
  if (res != ncclSuccess) {
    destroy_handle_state(h);
    return res;
  }
  *handle = h;
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpHandleDestroy(ncclEpHandle_t handle) {
  if (handle == nullptr) return ncclSuccess;
  destroy_handle_state(handle);
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpHandleGetNumRecvTokens(ncclEpHandle_t handle,
                                                     int64_t* num_recv_tokens) {
  EP_CHECK(handle != nullptr && num_recv_tokens != nullptr, ncclInvalidArgument,
           "ncclEpHandleGetNumRecvTokens: handle or num_recv_tokens is NULL");
  EP_RETURN_IF(check_group_errors(handle->group));
  *num_recv_tokens = handle->num_recv;
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpHandleGetTokensPerExpert(ncclEpHandle_t handle, ncclEpTensor_t* out,
                                                       cudaStream_t stream) {
  EP_CHECK(handle != nullptr && out != nullptr, ncclInvalidArgument,
           "ncclEpHandleGetTokensPerExpert: handle or out is NULL");
  ncclEpGroup* g = handle->group;
  EP_CHECK(out->ndim == 1 && out->sizes[0] == g->num_local && out->dtype == ncclInt64 &&
               out->data != nullptr,
           ncclInvalidArgument,
           "tokens_per_expert must be a 1-D int64 tensor of %d elements (local experts)",
           g->num_local);
  const size_t bytes = sizeof(long long) * g->num_local;
  const void* dev = handle->slot->meta->tokens_per_expert;
  if (out->tag == NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_HOST) {
    if (g->capacity < 0) {
      memcpy(out->data, handle->tokens_per_expert.data(), bytes);
    } else {
      EP_CUDA(cudaMemcpyAsync(out->data, dev, bytes, cudaMemcpyDeviceToHost, stream));
      EP_CUDA(cudaStreamSynchronize(stream));
    }
    return ncclSuccess;
  }
  EP_CHECK(out->tag == NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_DEVICE ||
               out->tag == NCCL_EP_TENSOR_TOKENS_PER_EXPERT,
           ncclInvalidArgument,
           "tokens_per_expert tag must be RECV_EXPERT_COUNTER_DEVICE/_HOST or TOKENS_PER_EXPERT");
  EP_CUDA(cudaMemcpyAsync(out->data, dev, bytes, cudaMemcpyDeviceToDevice, stream));
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpHandleGetTopkIdx(ncclEpHandle_t handle, ncclEpTensor_t* out,
                                              cudaStream_t stream) {
  EP_CHECK(handle != nullptr && out != nullptr, ncclInvalidArgument,
           "ncclEpHandleGetTopkIdx: handle or out is NULL");
  ncclEpGroup* g = handle->group;
  const long long T = handle->num_tokens, K = handle->topk;
  EP_CHECK(out->ndim == 2 && out->sizes[0] == T && out->sizes[1] == K &&
               (out->dtype == ncclInt32 || out->dtype == ncclInt64) &&
               (T * K == 0 || (out->data != nullptr && out->strides[1] == 1 &&
                               (T <= 1 || out->strides[0] == K))),
           ncclInvalidArgument,
           "topk_idx output must be a contiguous int32 or int64 tensor of shape (%lld, %lld)", T,
           K);
  const int* ids = handle->slot->gathered + (size_t)g->rank * g->rec_ints + kRecordHeader;
  EP_CUDA(launch_copy_topk(ids, T * K, out->data, out->dtype == ncclInt64, stream));
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpComplete(ncclEpHandle_t handle, cudaStream_t stream) {
  (void)stream;
  EP_CHECK(handle != nullptr, ncclInvalidArgument, "ncclEpComplete: handle is NULL");
  return ncclSuccess;
}
