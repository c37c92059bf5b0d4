/*
 * ll.cc: the LL mode (docs/design.md section 9) behind ncclEpCreateHandle, ncclEpDispatch,
 * ncclEpCombine and ncclEpComplete: argument checks (call_checks.h), the double-buffering rule,
 * then one kernel per call (kernels/ll_*.cu). No call synchronizes the host or communicates outside its kernel.
 *
 * NOTES:
 *  - Ops of one kind cycle through kLLSets buffer sets by a device-side epoch, and a send waits
 *    on the device until every peer consumed the set's op of kLLSets epochs before (a rank's own
 *    consumption is ordered by its stream). So an op may not be issued while one of its kind
 *    issued kLLSets or more ops before it is pending (sent with send_only, not completed): it
 *    would wait for a receive that only a later call can start, and overwrite this rank's own
 *    rows of it. That covers an op while kLLSets are pending, an op after a fused one, and one
 *    after an out-of-order ncclEpComplete. It is refused here (check_op), before anything is
 *    enqueued; the calls are collective, so every rank refuses it alike.
 *  - send_only keeps the op's launch arguments in the handle: ncclEpComplete relaunches the
 *    kernel with only its receive phase.
 */
#include <stdint.h>

#include <algorithm>

#include "call_checks.h"
#include "internal.h"
#include "pool.h"

namespace nccl_ep {

namespace {

const char* const kKind[2] = {"ncclEpDispatch", "ncclEpCombine"};

LLHandleViews views_of(const HandleSlot* s) {
  LLHandleViews v;
  v.ids = s->ll_ids.ptr;
  v.pos = s->ll_pos.ptr;
  v.jslot = s->ll_jslot.ptr;
  v.dpos = s->ll_dpos.ptr;
  v.ndst = s->ll_ndst.ptr;
  v.own_dpos = s->ll_own_dpos.ptr;
  v.cnt = s->ll_cnt.ptr;
  v.ndest = s->ll_ndest.ptr;
  v.rn = s->ll_rn.ptr;
  v.rtok = s->ll_rtok.ptr;
  v.rrow = s->ll_rrow.ptr;
  v.rdpos = s->ll_rdpos.ptr;
  v.roff = s->ll_roff.ptr;
  v.own_row = s->ll_own_row.ptr;
  v.epochs = s->ll_epochs.ptr;
  v.weights = s->ll_weights.ptr;
  return v;
}

LLArgs ll_args(const ncclEpHandle* h) {
  const ncclEpGroup* g = h->group;
  LLArgs a;
  static_cast<GroupArgs&>(a) = group_args(g);  // one node: the group's ranks
  a.rank_major = g->cfg.layout == ncclEpLayoutRankMajor;
  a.payload = (int)g->cfg.payload_dtype;
  a.dtype = (int)g->cfg.token_dtype;
  a.tokens = h->num_tokens;
  a.topk = h->topk;
  a.send = a.recv = 1;
  a.h = views_of(h->slot);
  return a;
}

// The checks every LL op starts with: its config, the group's errors, the handle's state and
// the double-buffering rule. kind 0: dispatch, 1: combine.
ncclResult_t check_op(ncclEpHandle* h, const ncclEpOpConfig_t* config, int kind, bool* send_only) {
  const char* fn = kKind[kind];
  ncclEpGroup* g = h->group;
  if (config != nullptr)
    EP_CHECK(config->size >= sizeof(ncclEpOpConfig_t) && config->version == NCCL_EP_API_VERSION,
             ncclInvalidArgument,
             "%s: config.size/version do not match this library; use "
             "NCCL_EP_OP_CONFIG_INITIALIZER",
             fn);
  *send_only = config != nullptr && config->send_only != 0;
  EP_RETURN_IF(check_group_errors(g));
  EP_CHECK(h->ll_pending < 0, ncclInvalidUsage,
           "%s: this handle's %s was sent with send_only and not completed: call "
           "ncclEpComplete first",
           fn, h->ll_pending == 0 ? "dispatch" : "combine");
  EP_CHECK(kind == 0 || h->ll_dispatched, ncclInvalidUsage,
           "ncclEpCombine: this LL handle has not dispatched (the combine returns the rows its "
           "dispatch placed)");
  std::lock_guard<std::mutex> lock(g->mu);
  const char* ops = kind == 0 ? "dispatche" : "combine";
  EP_CHECK(g->ll_pending_ops[kind].size() < (size_t)kLLSets, ncclInvalidUsage,
           "%s: %d LL %ss are already in flight on this group (sent with send_only, not "
           "completed); all %d buffer sets are taken: complete the oldest one first",
           fn, kLLSets, ops, kLLSets);
  for (const unsigned long long op : g->ll_pending_ops[kind])
    EP_CHECK(op + kLLSets > g->ll_issued[kind], ncclInvalidUsage,
             "%s: the LL %s sent with send_only %llu %ss before this one is not completed, and "
             "this one would write the buffer set it still holds (the ops of a kind cycle "
             "through %d): call ncclEpComplete on that handle first",
             fn, kind == 0 ? "dispatch" : "combine", g->ll_issued[kind] - op, ops, kLLSets);
  return ncclSuccess;
}

// After a launch: the op's number; a send_only op is pending until ncclEpComplete.
void mark_sent(ncclEpHandle* h, int kind, bool send_only) {
  ncclEpGroup* g = h->group;
  std::lock_guard<std::mutex> lock(g->mu);
  if (send_only) {
    h->ll_pending = kind;
    h->ll_op = g->ll_issued[kind];
    g->ll_pending_ops[kind].push_back(h->ll_op);
  }
  ++g->ll_issued[kind];
}

}  // namespace

ncclResult_t ll_create_handle(ncclEpHandle* h, const ncclEpTensor_t* routing,
                              cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  const CallShape shape{&g->cfg, g->nranks};
  EP_RETURN_IF(megatron_nccl_ep_check_routing(&shape, routing));
  const long long T = routing->sizes[0], K = routing->sizes[1];
  h->num_tokens = (int)T;
  h->topk = (int)K;
  {
    std::lock_guard<std::mutex> lock(g->mu);
    EP_RETURN_IF(acquire_slot(g, &h->slot));
    h->seq = g->handles_created++;
  }
  EP_RETURN_IF(retain_slot_for_graph(g, h->slot, stream));  // a capture holds it from here
  LLLayoutArgs la;
  la.a = ll_args(h);
  la.topk_idx = routing->data;
  la.idx_is_64 = routing->dtype == ncclInt64;
  la.stride0 = routing->strides[0];
  la.stride1 = routing->strides[1];
  EP_CUDA(launch_ll_layout(la, stream));
  return ncclSuccess;
}

ncclResult_t ll_dispatch(ncclEpHandle* h, const ncclEpDispatchInputs_t* in,
                         ncclEpDispatchOutputs_t* out, const ncclEpOpConfig_t* config,
                         cudaStream_t stream) {
  bool send_only = false;
  EP_RETURN_IF(check_op(h, config, 0, &send_only));
  const ncclEpGroupConfig_t& c = h->group->cfg;
  const CallShape shape = call_shape(h);
  EP_RETURN_IF(megatron_nccl_ep_check_dispatch(&shape, in, out));
  const bool rank_major = c.layout == ncclEpLayoutRankMajor;
  const bool scaled = payload_format(c).scale_block > 0;
  const bool weights = in->topk_weights.ndim != 0;
  LLDispatchArgs d;
  d.a = ll_args(h);
  d.a.recv = !send_only;
  d.x = in->tokens.data;
  d.w = weights ? static_cast<const float*>(in->topk_weights.data) : nullptr;
  d.recv_x = out->recv_tokens.data;
  d.recv_scales = scaled ? static_cast<float*>(out->recv_scales.data) : nullptr;
  d.recv_count = static_cast<int*>(out->recv_count.data);
  d.recv_src = rank_major ? nullptr : static_cast<int*>(out->recv_src.data);
  d.recv_topk_idx = rank_major ? static_cast<int*>(out->recv_topk_idx.data) : nullptr;
  d.recv_topk_w =
      rank_major && weights ? static_cast<float*>(out->recv_topk_weights.data) : nullptr;
  EP_CUDA(launch_ll_dispatch(d, stream));
  h->ll_dispatched = true;
  h->ll_dispatch = d;
  mark_sent(h, 0, send_only);
  return ncclSuccess;
}

ncclResult_t ll_combine(ncclEpHandle* h, const ncclEpCombineInputs_t* in,
                        ncclEpCombineOutputs_t* out, const ncclEpOpConfig_t* config,
                        cudaStream_t stream) {
  bool send_only = false;
  EP_RETURN_IF(check_op(h, config, 1, &send_only));
  const ncclEpGroupConfig_t& c = h->group->cfg;
  const CallShape shape = call_shape(h);
  EP_RETURN_IF(megatron_nccl_ep_check_combine(&shape, in, out));
  const bool rank_major = c.layout == ncclEpLayoutRankMajor;
  LLCombineArgs cb;
  cb.a = ll_args(h);
  cb.a.recv = !send_only;
  cb.expert_out = in->expert_tokens.data;
  cb.w = rank_major ? nullptr : static_cast<const float*>(in->topk_weights.data);
  cb.y = out->tokens.data;
  cb.expert_fp32 = in->expert_tokens.dtype != c.token_dtype;  // fp32 rows (checked)
  EP_CUDA(launch_ll_combine(cb, stream));
  h->ll_combine = cb;
  mark_sent(h, 1, send_only);
  return ncclSuccess;
}

ncclResult_t ll_complete(ncclEpHandle* h, cudaStream_t stream) {
  EP_CHECK(h->ll_pending >= 0, ncclInvalidUsage,
           "ncclEpComplete: this LL handle has no dispatch or combine sent with send_only "
           "pending");
  EP_RETURN_IF(check_group_errors(h->group));
  const int kind = h->ll_pending;
  if (kind == 0) {
    LLDispatchArgs d = h->ll_dispatch;
    d.a.send = 0;
    d.a.recv = 1;
    EP_CUDA(launch_ll_dispatch(d, stream));
  } else {
    LLCombineArgs cb = h->ll_combine;
    cb.a.send = 0;
    cb.a.recv = 1;
    EP_CUDA(launch_ll_combine(cb, stream));
  }
  std::lock_guard<std::mutex> lock(h->group->mu);
  ll_forget(h);
  return ncclSuccess;
}

void ll_forget(ncclEpHandle* h) {
  if (h->ll_pending >= 0) {
    std::vector<unsigned long long>& ops = h->group->ll_pending_ops[h->ll_pending];
    ops.erase(std::find(ops.begin(), ops.end(), h->ll_op));
  }
  h->ll_pending = -1;
}

}  // namespace nccl_ep
