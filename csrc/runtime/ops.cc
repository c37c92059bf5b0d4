/*
 * ops.cc: ncclEpDispatch, ncclEpCombine, ncclEpCombineTopkWeights: argument checks
 * (call_checks.h), then one kernel on the exchange engine (kernels/exchange.cuh), filled by one
 * driver (exchange_args):
 * no host synchronization (exact mode: the handle's first op waits for its layout, once).
 * Groups that span nodes run the engine once per node of sources, with the rail around it
 * (nodes.cc).
 *
 * NOTES:
 *  - The op's call signature (op, handle, size of the probs it moves) travels in its ready flags,
 *    so ranks that are not making the same call fail with a clear error instead of exchanging
 *    garbage.
 *  - Warps that push, per op (send_warps): dispatch pushes each row once per peer while its
 *    receivers write each row ~K/R times, so a minority of the warps; the combine's warps do both
 *    roles in interleaved rounds (exchange.cuh); combine_probs moves a few bytes per token.
 */
#include <stdint.h>

#include "call_checks.h"
#include "internal.h"
#include "nodes.h"
#include "pool.h"

namespace nccl_ep {

namespace {

bool aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }

// Warps per CTA that only send: none on one rank, none in the combine (its warps do both).
// NOTES: the dispatch's 5 of 16: with fewer, its senders are the op's long pole (the receivers
// wait for chunks); with more, the receivers are.
int send_warps(OpKind op, int num_ranks) {
  if (num_ranks == 1 || op == kOpCombine) return 0;
  return op == kOpDispatch ? 5 : 4;
}

// A group's device-side error is returned before anything is launched, or, over nodes, kept in
// `sticky` and returned after the op's NCCL calls: the op's kernels stop at once and poison
// their outputs, and no rail peer is left waiting for this rank's messages.
ncclResult_t check_entry(ncclEpHandle_t handle, const ncclEpOpConfig_t* config, const char* fn,
                         DeferredError* sticky) {
  EP_RETURN_IF(check_op_config(config, fn));
  if (handle->group->num_nodes == 1) {
    EP_RETURN_IF(check_group_errors(handle->group));
  } else {
    sticky->take(check_group_errors(handle->group));
  }
  return read_layout(handle);  // exact mode: N_d (and the handle's routing errors)
}

}  // namespace

// The engine's arguments for one op of handle h over this rank's node (everything but the op's
// tensors), for the sources of node `pass` (groups that span nodes; 0 on one node).
ExchangeArgs exchange_args(const ncclEpHandle* h, OpKind op, int prob_bytes, bool vec,
                           int pass) {
  const ncclEpGroup* g = h->group;
  const HandleSlot* s = h->slot;
  const size_t first = (size_t)pass * g->node_size;  // the first source of that node
  const size_t Tm = (size_t)g->cfg.max_tokens_per_rank, Km = (size_t)g->cfg.max_topk;
  ExchangeArgs e;
  static_cast<GroupArgs&>(e) = group_args(g);
  e.call = call_signature(op, prob_bytes, h->seq);
  e.send_warps = send_warps(op, g->node_size);
  e.expert_base = g->node * g->node_size * g->num_local;
  e.zero_padding = pass == 0;
  e.topk = h->topk;
  // The routing of source first + node_rank: this rank's own, or its record.
  e.own_routing = pass == g->node ? s->op_routing()
                                  : s->records.ptr + (first + g->node_rank) * g->win.rec_ints +
                                        kRecordHeader;
  e.tokens_of = s->meta.ptr->tokens + first;
  e.recv_row = s->recv_row.ptr + first * Tm * Km;
  e.src_of_row = s->src_of_row.ptr;
  e.num_rows_dev = &s->meta.ptr->num_rows;
  e.rows = h->num_recv;
  e.vec = vec ? 1 : 0;
  for (OutputSpan& o : e.outputs) o = OutputSpan{nullptr, 0};
  return e;
}

}  // namespace nccl_ep

using namespace nccl_ep;

namespace {

// The HT ops behind the entry points below (LL: ll.cc); the entry points put them inside a
// local team's gate.
ncclResult_t ht_dispatch(ncclEpHandle_t handle, const ncclEpDispatchInputs_t* inputs,
                         ncclEpDispatchOutputs_t* outputs, const ncclEpOpConfig_t* config,
                         cudaStream_t stream) {
  DeferredError sticky;
  EP_RETURN_IF(check_entry(handle, config, "ncclEpDispatch", &sticky));
  ncclEpGroup* g = handle->group;
  const long long N = handle->num_recv;
  const CallShape shape = call_shape(handle);
  EP_RETURN_IF(megatron_nccl_ep_check_dispatch(&shape, inputs, outputs));
  const bool with_probs = inputs->topk_weights.ndim != 0;  // presence is ndim (call_checks.cc)
  DispatchArgs a;
  a.prob_bytes = with_probs ? dtype_bytes(inputs->topk_weights.dtype) : 4;
  a.probs_dense = with_probs && inputs->topk_weights.tag == NCCL_EP_TENSOR_ROUTING_PROBS;
  a.dtype = (int)g->cfg.token_dtype;
  a.x = inputs->tokens.data;
  a.probs = with_probs ? inputs->topk_weights.data : nullptr;
  a.recv_x = outputs->recv_tokens.data;
  a.recv_probs = with_probs ? outputs->recv_topk_weights.data : nullptr;
  a.rail_rows = nullptr;
  const bool vec = g->row_bytes % 16 == 0 && aligned16(a.x) && aligned16(a.recv_x);
  a.ex = exchange_args(handle, kOpDispatch, with_probs ? a.prob_bytes : 0, vec);
  a.ex.outputs[0] = OutputSpan{a.recv_x, N * (long long)g->row_bytes};
  if (with_probs) a.ex.outputs[1] = OutputSpan{a.recv_probs, N * a.prob_bytes};
  if (g->num_nodes > 1) {
    EP_RETURN_IF(dispatch_nodes(handle, a, with_probs, stream));
    return sticky.result();
  }
  EP_CUDA(launch_dispatch(a, stream));
  return ncclSuccess;
}

ncclResult_t ht_combine(ncclEpHandle_t handle, const ncclEpCombineInputs_t* inputs,
                        ncclEpCombineOutputs_t* outputs, const ncclEpOpConfig_t* config,
                        cudaStream_t stream) {
  DeferredError sticky;
  EP_RETURN_IF(check_entry(handle, config, "ncclEpCombine", &sticky));
  ncclEpGroup* g = handle->group;
  const long long T = handle->num_tokens;
  const CallShape shape = call_shape(handle);
  EP_RETURN_IF(megatron_nccl_ep_check_combine(&shape, inputs, outputs));
  CombineArgs a;
  a.dtype = (int)g->cfg.token_dtype;
  a.expert_out = inputs->expert_tokens.data;
  a.y = outputs->tokens.data;
  a.rail_rows = nullptr;
  const bool vec = g->row_bytes % 16 == 0 && aligned16(a.expert_out) && aligned16(a.y);
  a.ex = exchange_args(handle, kOpCombine, 0, vec);
  a.ex.outputs[0] = OutputSpan{a.y, T * (long long)g->row_bytes};
  if (g->num_nodes > 1) {
    EP_RETURN_IF(combine_nodes(handle, a, stream));
    return sticky.result();
  }
  EP_CUDA(launch_combine(a, stream));
  return ncclSuccess;
}

ncclResult_t ht_combine_probs(ncclEpHandle_t handle,
                              const ncclEpTensor_t* grad_recv_topk_weights,
                              ncclEpTensor_t* grad_topk_weights, cudaStream_t stream) {
  DeferredError sticky;
  EP_RETURN_IF(check_entry(handle, nullptr, "ncclEpCombineTopkWeights", &sticky));
  const CallShape shape = call_shape(handle);
  EP_RETURN_IF(
      megatron_nccl_ep_check_combine_probs(&shape, grad_recv_topk_weights, grad_topk_weights));
  const ncclDataType_t pd = grad_recv_topk_weights->dtype;
  CombineProbsArgs a;
  a.grad_dense = grad_topk_weights->tag == NCCL_EP_TENSOR_ROUTING_PROBS;
  a.prob_bytes = dtype_bytes(pd);
  a.grad_recv = grad_recv_topk_weights->data;
  a.grad = grad_topk_weights->data;
  a.rail_rows = nullptr;
  a.ex = exchange_args(handle, kOpCombineProbs, a.prob_bytes, false);
  const long long cols = a.grad_dense ? handle->group->cfg.num_experts : handle->topk;
  a.ex.outputs[0] = OutputSpan{a.grad, handle->num_tokens * cols * a.prob_bytes};
  if (handle->group->num_nodes > 1) {
    EP_RETURN_IF(combine_probs_nodes(handle, a, stream));
    return sticky.result();
  }
  EP_CUDA(launch_combine_probs(a, stream));
  return ncclSuccess;
}

}  // namespace

extern "C" ncclResult_t ncclEpDispatch(ncclEpHandle_t handle, const ncclEpDispatchInputs_t* inputs,
                                       ncclEpDispatchOutputs_t* outputs,
                                       const ncclEpOpConfig_t* config, cudaStream_t stream) {
  EP_CHECK(handle != nullptr, ncclInvalidArgument, "ncclEpDispatch: handle is NULL");
  EP_CHECK(inputs != nullptr && outputs != nullptr, ncclInvalidArgument,
           "ncclEpDispatch: inputs or outputs is NULL");
  const bool ll = is_ll(handle->group);  // ll_: docs/design.md section 9
  EP_RETURN_IF(retain_slot_for_graph(handle->group, handle->slot, stream));
  return gated_call(handle->group, ll ? "LL dispatch" : "dispatch", [&] {
    return ll ? ll_dispatch(handle, inputs, outputs, config, stream)
              : ht_dispatch(handle, inputs, outputs, config, stream);
  });
}

extern "C" ncclResult_t ncclEpCombine(ncclEpHandle_t handle, const ncclEpCombineInputs_t* inputs,
                                      ncclEpCombineOutputs_t* outputs,
                                      const ncclEpOpConfig_t* config, cudaStream_t stream) {
  EP_CHECK(handle != nullptr, ncclInvalidArgument, "ncclEpCombine: handle is NULL");
  EP_CHECK(inputs != nullptr && outputs != nullptr, ncclInvalidArgument,
           "ncclEpCombine: inputs or outputs is NULL");
  const bool ll = is_ll(handle->group);  // ll_: docs/design.md section 9
  EP_RETURN_IF(retain_slot_for_graph(handle->group, handle->slot, stream));
  return gated_call(handle->group, ll ? "LL combine" : "combine", [&] {
    return ll ? ll_combine(handle, inputs, outputs, config, stream)
              : ht_combine(handle, inputs, outputs, config, stream);
  });
}

extern "C" ncclResult_t ncclEpCombineTopkWeights(ncclEpHandle_t handle,
                                                 const ncclEpTensor_t* grad_recv_topk_weights,
                                                 ncclEpTensor_t* grad_topk_weights,
                                                 cudaStream_t stream) {
  EP_CHECK(handle != nullptr, ncclInvalidArgument, "ncclEpCombineTopkWeights: handle is NULL");
  EP_RETURN_IF(check_ht_handle(handle, "ncclEpCombineTopkWeights"));
  EP_RETURN_IF(retain_slot_for_graph(handle->group, handle->slot, stream));
  return gated_call(handle->group, "combine_probs", [&] {
    return ht_combine_probs(handle, grad_recv_topk_weights, grad_topk_weights, stream);
  });
}
