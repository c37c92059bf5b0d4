/*
 * handle.cc: ncclEpCreateHandle and the handle getters.
 *
 * Creation (collective, stream-ordered): pack own routing -> ncclAllGather of the fixed-size
 * records -> layout kernels (layout.cu). Exact mode then copies [error, N_d, tokens_per_expert]
 * to pinned memory once and synchronizes the stream; capacity mode returns at once and reports
 * errors through the group's mapped error word.
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

static ncclResult_t create_handle(ncclEpHandle* h, const ncclEpTensor_t* idx,
                                  cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  const ncclEpGroupConfig_t& c = g->cfg;
  EP_CHECK(idx->ndim == 2, ncclInvalidArgument, "topk_idx must be 2-D, got %d dimensions",
           idx->ndim);
  EP_CHECK(idx->dtype == ncclInt32 || idx->dtype == ncclInt64, ncclInvalidArgument,
           "topk_idx must be int32 or int64, got %s", dtype_name(idx->dtype));
  const long long T = idx->sizes[0], K = idx->sizes[1];
  EP_CHECK(T >= 0 && K >= 0, ncclInvalidArgument, "topk_idx sizes must be >= 0");
  EP_CHECK(idx->strides[0] >= 0 && idx->strides[1] >= 0, ncclInvalidArgument,
           "topk_idx strides must be >= 0");
  EP_CHECK(idx->data != nullptr || T == 0, ncclInvalidArgument, "topk_idx data is NULL");
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
  EP_CUDA(launch_pack_routing(idx->data, idx->dtype == ncclInt64, idx->strides[0],
                              idx->strides[1], h->num_tokens, h->topk, header_tokens,
                              header_topk, own, stream));
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
    // The peers learn it from the group's error word; this rank can say it now.
    ErrorInfo e = {};
    e.code = kErrShape;
    e.rank = g->rank;
    e.slot = T > c.max_tokens_per_rank ? 0 : 1;
    e.value = e.slot == 0 ? T : K;
    e.extra = e.slot == 0 ? c.max_tokens_per_rank : c.max_topk;
    return report_error(g, e, nullptr);
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
                                           const ncclEpTensor_t* topk_idx,
                                           const ncclEpOpConfig_t* config, cudaStream_t stream) {
  EP_CHECK(handle != nullptr, ncclInvalidArgument, "ncclEpCreateHandle: handle is NULL");
  *handle = nullptr;
  EP_CHECK(group != nullptr, ncclInvalidArgument, "ncclEpCreateHandle: group is NULL");
  EP_CHECK(topk_idx != nullptr, ncclInvalidArgument, "ncclEpCreateHandle: topk_idx is NULL");
  EP_RETURN_IF(check_op_config(config, "ncclEpCreateHandle"));
  EP_RETURN_IF(check_group_errors(group));
  ncclEpHandle* h = new ncclEpHandle();
  h->group = group;
  group->live.push_back(h);
  ncclResult_t res = create_handle(h, topk_idx, stream);
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

extern "C" ncclResult_t ncclEpComplete(ncclEpHandle_t handle, cudaStream_t stream) {
  (void)stream;
  EP_CHECK(handle != nullptr, ncclInvalidArgument, "ncclEpComplete: handle is NULL");
  return ncclSuccess;
}
