/*
 * ops.cc: ncclEpDispatch, ncclEpCombine, ncclEpCombineTopkWeights: argument checks, then one
 * kernel on the exchange engine (kernels/exchange.cuh), filled by one driver (exchange_args):
 * no host synchronization (exact mode: the handle's first op waits for its layout, once).
 *
 * NOTES:
 *  - The op's call signature (op, handle, size of the probs it moves) travels in its ready flags,
 *    so ranks that are not making the same call fail with a clear error instead of exchanging
 *    garbage.
 *  - Warps that push, per op: dispatch pushes each row once per peer while its receivers write
 *    each row ~K/R times, so a quarter of the warps; combine reads rows on both sides (senders
 *    the peers' rows, receivers their own plus the partials), split by the peers' share of rows;
 *    combine_probs moves a few bytes per token.
 *  - Groups that span nodes (G < R ranks per node), docs/design.md section 4:
 *      dispatch  rail: this rank's tokens (and probs) to the rank of its index in every other
 *                node, theirs here; then one engine pass per node m of sources, ascending: node
 *                peer p sends the tokens of source m * G + p (its own, or what its rail brought).
 *      combine   one engine pass per node m: the node partials (step 2a) of source m * G +
 *                node_rank's tokens, here; rail: each to its source; combine_nodes (step 2b).
 *      probs     passes as combine's, [T, K] per node; rail; merge_probs.
 *    Rail messages have sizes every rank knows: exact mode the all-gathered token counts (read
 *    with the layout), capacity mode max_tokens_per_rank rows (sent from a staging copy), so no
 *    rank can wait for bytes that never come; probs travel as max(E, max_topk) x 8 bytes per
 *    token whatever their dtype. They are NCCL send/receive calls on the op's stream, followed
 *    by the group's watchdog (watchdog.cc): a rail peer that never sends makes every rank raise
 *    within the group's timeout.
 */
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "internal.h"

namespace nccl_ep {

ncclResult_t rail_exchange(const ncclEpGroup* g, const std::vector<RailMessage>& messages,
                           cudaStream_t stream) {
  EP_NCCL(ncclGroupStart());
  ncclResult_t res = ncclSuccess;
  for (size_t k = 0; k < messages.size() && res == ncclSuccess; ++k) {
    const RailMessage& msg = messages[k];
    res = ncclSend(msg.send, msg.send_bytes, ncclInt8, msg.node, g->rail_comm, stream);
    if (res == ncclSuccess)
      res = ncclRecv(msg.recv, msg.recv_bytes, ncclInt8, msg.node, g->rail_comm, stream);
  }
  const ncclResult_t end = ncclGroupEnd();
  EP_NCCL(res);
  EP_NCCL(end);
  return ncclSuccess;
}

namespace {

// The rail's messages of one op, followed by the group's watchdog, then the latch of its error
// (a stopped step's kernels end without their data: what runs after must poison).
ncclResult_t watched_rail(ncclEpGroup* g, OpKind op, const std::vector<RailMessage>& messages,
                          cudaStream_t stream) {
  EP_RETURN_IF(g->watchdog->run(op, kStepRail, stream,
                                [&] { return rail_exchange(g, messages, stream); }));
  EP_CUDA(launch_latch_error(g->d_stop, g->d_peers, g->win.sync_off, g->node_size, g->node_rank,
                             g->d_state, stream));
  return ncclSuccess;
}

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

// Routing weights in slot order [T, K] (TOPK_WEIGHTS) or dense [T, E] (ROUTING_PROBS).
ncclResult_t check_weights(const ncclEpTensor_t& t, const char* name, const ncclEpHandle* h,
                           int* dense) {
  const ncclEpGroup* g = h->group;
  EP_CHECK(is_float_dtype(t.dtype), ncclInvalidArgument,
           "%s must have a floating dtype (float16, bfloat16, float32, float64), got %s", name,
           dtype_name(t.dtype));
  EP_CHECK(t.tag == NCCL_EP_TENSOR_TOPK_WEIGHTS || t.tag == NCCL_EP_TENSOR_ROUTING_PROBS,
           ncclInvalidArgument, "%s must be tagged TOPK_WEIGHTS [T, K] or ROUTING_PROBS [T, E]",
           name);
  *dense = t.tag == NCCL_EP_TENSOR_ROUTING_PROBS;
  return check_tensor(t, name, h->num_tokens, *dense ? g->cfg.num_experts : h->topk, t.dtype);
}

bool aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }

// Warps per CTA that only send: none on one rank, none in the combine (its warps do both).
// NOTES: the dispatch's senders were its long pole with 4 of 16 warps (EP=2 as a local team on
// one H200, bench shape, 2026-12-01, EP_TRACE: senders' work 365 us, receivers waiting 115 us for
// chunks). With 8 loads in flight per sender lane, 5 senders: 470 us; 6: 487; 7, 8: 502; 4: 494
// (4 with 4 loads in flight: 521; 2: 708).
int send_warps(OpKind op, int num_ranks) {
  if (num_ranks == 1 || op == kOpCombine) return 0;
  return op == kOpDispatch ? 5 : 4;
}

// A group's device-side error is returned before anything is launched, or, over nodes, kept in
// `sticky` and returned after the op's NCCL calls: the op's kernels stop at once and poison
// their outputs, and no rail peer is left waiting for this rank's messages.
ncclResult_t check_entry(ncclEpHandle_t handle, const ncclEpOpConfig_t* config, const char* fn,
                         DeferredError* sticky) {
  EP_CHECK(handle != nullptr, ncclInvalidArgument, "%s: handle is NULL", fn);
  EP_RETURN_IF(check_op_config(config, fn));
  if (handle->group->num_nodes == 1) {
    EP_RETURN_IF(check_group_errors(handle->group));
  } else {
    sticky->take(check_group_errors(handle->group));
  }
  return read_layout(handle);  // exact mode: N_d (and the handle's routing errors)
}

// The engine's arguments for one op of handle h over this rank's node (everything but the op's
// tensors), for the sources of node `pass` (groups that span nodes; 0 on one node).
ExchangeArgs exchange_args(const ncclEpHandle* h, OpKind op, int prob_bytes, bool vec,
                           int pass = 0) {
  const ncclEpGroup* g = h->group;
  const HandleSlot* s = h->slot;
  const size_t first = (size_t)pass * g->node_size;  // the first source of that node
  const size_t Tm = (size_t)g->cfg.max_tokens_per_rank, Km = (size_t)g->cfg.max_topk;
  ExchangeArgs e;
  e.peers = g->d_peers;
  e.win = g->win;
  e.state = g->d_state;
  e.err = g->d_err;
  e.timeout_ns = (long long)g->cfg.timeout_ms * 1000000ll;
  e.call = call_signature(op, prob_bytes, h->seq);
  e.send_warps = send_warps(op, g->node_size);
  e.num_ranks = g->node_size;
  e.rank = g->node_rank;
  e.num_local = g->num_local;
  e.num_experts = g->cfg.num_experts;
  e.max_tokens = g->cfg.max_tokens_per_rank;
  e.max_topk = g->cfg.max_topk;
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
  e.hidden = g->cfg.hidden;
  e.vec = vec ? 1 : 0;
  for (OutputSpan& o : e.outputs) o = OutputSpan{nullptr, 0};
  return e;
}

// Tokens of source s as the rail moves them: exact mode the all-gathered count (the layout was
// read), capacity mode max_tokens_per_rank (no host read; the tail is never used).
long long rail_tokens(const ncclEpHandle* h, int s) {
  const ncclEpGroup* g = h->group;
  return g->capacity >= 0 ? g->cfg.max_tokens_per_rank : h->slot->host_meta->tokens[s];
}

// Dispatch over nodes: the rail, then the engine once per node of sources.
ncclResult_t dispatch_nodes(ncclEpHandle* h, DispatchArgs a, bool with_probs, int probs_cols,
                            cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  const RailBuffers& r = g->rail;
  const size_t Tm = (size_t)g->cfg.max_tokens_per_rank, T = (size_t)h->num_tokens;
  const size_t prob_bytes = (size_t)probs_cols * a.prob_bytes;  // of one token's probs
  const long long mine = rail_tokens(h, g->rank);
  const void* x = a.x != nullptr ? a.x : r.rows_own.ptr;  // (no tokens: a valid, empty send)
  const void* probs = a.probs;
  if (g->capacity >= 0) {  // fixed-size messages: from staging copies
    if (T > 0)
      EP_CUDA(cudaMemcpyAsync(r.rows_own.ptr, x, T * g->row_bytes, cudaMemcpyDeviceToDevice,
                              stream));
    x = r.rows_own.ptr;
  }
  if (with_probs && T > 0) {  // always staged: the message has the fixed size max(E, Kmax) x 8
    EP_CUDA(cudaMemcpyAsync(r.probs_own.ptr, probs, T * prob_bytes, cudaMemcpyDeviceToDevice,
                            stream));
  }
  std::vector<RailMessage> msgs;
  for (int m = 0; m < g->num_nodes; ++m) {
    if (m == g->node) continue;
    const long long theirs = rail_tokens(h, m * g->node_size + g->node_rank);
    const size_t i = remote_node_index(g, m);
    msgs.push_back({m, x, mine * g->row_bytes, r.rows_in.ptr + i * Tm * r.row_bytes,
                    theirs * g->row_bytes});
    if (with_probs)
      msgs.push_back({m, r.probs_own.ptr, mine * r.prob_row_bytes,
                      r.probs_in.ptr + i * Tm * r.prob_row_bytes, theirs * r.prob_row_bytes});
  }
  EP_RETURN_IF(watched_rail(g, kOpDispatch, msgs, stream));
  for (int m = 0; m < g->num_nodes; ++m) {
    DispatchArgs pass = a;
    if (m != g->node) {
      const size_t i = remote_node_index(g, m);
      pass.x = r.rows_in.ptr + i * Tm * r.row_bytes;
      if (with_probs) pass.probs = r.probs_in.ptr + i * Tm * r.prob_row_bytes;
    }
    pass.ex = exchange_args(h, kOpDispatch, with_probs ? a.prob_bytes : 0, a.ex.vec != 0, m);
    pass.ex.outputs[0] = a.ex.outputs[0];
    pass.ex.outputs[1] = a.ex.outputs[1];
    EP_CUDA(launch_dispatch(pass, stream));
  }
  return ncclSuccess;
}

// What the kernels that finish an op at the source read of handle h (groups that span nodes).
NodeParts node_parts(const ncclEpHandle* h) {
  const ncclEpGroup* g = h->group;
  NodeParts p;
  p.own_routing = h->slot->op_routing();
  p.tokens = h->num_tokens;
  p.topk = h->topk;
  p.experts_per_node = g->node_size * g->num_local;
  p.num_nodes = g->num_nodes;
  p.state = g->d_state;
  return p;
}

// Where an op that sends values back to their sources keeps them: this node's values for this
// rank's tokens (own), per remote node the values computed here for its source (out) and those
// it computed for this rank (in), `token_bytes` of message per token.
struct ReturnBuffers {
  char* own;
  char* out;
  size_t out_stride;  // bytes per remote node
  char* in;
  size_t in_stride;
  size_t token_bytes;
};

// The ops whose values go back to the sources (combine, the probs' backward): run_pass(m, dst)
// computes node m's sources' values here (the source m * G + node_rank's, into dst); the rail
// takes each to its source and brings this rank's from every node; parts[n] = node n's values
// for this rank's tokens.
template <typename RunPass>
ncclResult_t return_to_sources(ncclEpHandle* h, OpKind op, const ReturnBuffers& b,
                               RunPass run_pass, NodeParts* parts, cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  std::vector<RailMessage> msgs;
  for (int m = 0; m < g->num_nodes; ++m) {
    const size_t i = remote_node_index(g, m);
    char* dst = m == g->node ? b.own : b.out + i * b.out_stride;
    EP_RETURN_IF(run_pass(m, dst));
    parts->parts[m] = dst;
    if (m == g->node) continue;
    char* in = b.in + i * b.in_stride;
    msgs.push_back({m, dst, rail_tokens(h, m * g->node_size + g->node_rank) * b.token_bytes, in,
                    rail_tokens(h, g->rank) * b.token_bytes});
    parts->parts[m] = in;
  }
  return watched_rail(g, op, msgs, stream);
}

// Combine over nodes: the node partials (2a) of every node's sources, the rail, then 2b here.
ncclResult_t combine_nodes(ncclEpHandle* h, const CombineArgs& a, cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  const RailBuffers& r = g->rail;
  const size_t node_bytes = (size_t)g->cfg.max_tokens_per_rank * r.row_bytes;
  CombineNodesArgs fin;
  fin.nodes = node_parts(h);
  fin.dtype = a.dtype;
  fin.vec = a.ex.vec;
  fin.hidden = g->cfg.hidden;
  fin.y = a.y;
  const ReturnBuffers b{r.rows_own.ptr, r.rows_out.ptr, node_bytes, r.rows_in.ptr, node_bytes,
                        r.row_bytes};
  EP_RETURN_IF(return_to_sources(
      h, kOpCombine, b,
      [&](int m, char* dst) -> ncclResult_t {
        CombineArgs pass = a;
        pass.y = dst;
        pass.ex = exchange_args(h, kOpCombine, 0, a.ex.vec != 0, m);
        pass.ex.outputs[0] = OutputSpan{dst, (long long)node_bytes};
        EP_CUDA(launch_combine(pass, stream));
        return ncclSuccess;
      },
      &fin.nodes, stream));
  EP_CUDA(launch_combine_nodes(fin, stream));
  return ncclSuccess;
}

// The probs' backward over nodes: every node's values in slot order, the rail, the merge here.
ncclResult_t combine_probs_nodes(ncclEpHandle* h, const CombineProbsArgs& a,
                                 cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  const RailBuffers& r = g->rail;
  const size_t Tm = (size_t)g->cfg.max_tokens_per_rank;
  MergeProbsArgs fin;
  fin.nodes = node_parts(h);
  fin.prob_bytes = a.prob_bytes;
  fin.grad_dense = a.grad_dense;
  fin.num_experts = g->cfg.num_experts;
  fin.grad = a.grad;
  const ReturnBuffers b{r.probs_own.ptr, r.probs_out.ptr, Tm * r.grad_row_bytes, r.probs_in.ptr,
                        Tm * r.prob_row_bytes, r.grad_row_bytes};
  EP_RETURN_IF(return_to_sources(
      h, kOpCombineProbs, b,
      [&](int m, char* dst) -> ncclResult_t {
        CombineProbsArgs pass = a;
        pass.grad = dst;
        pass.grad_dense = 0;  // [T, K] per node; merged into the caller's layout at the end
        pass.ex = exchange_args(h, kOpCombineProbs, a.prob_bytes, false, m);
        pass.ex.outputs[0] = OutputSpan{dst, (long long)(Tm * r.grad_row_bytes)};
        EP_CUDA(launch_combine_probs(pass, stream));
        return ncclSuccess;
      },
      &fin.nodes, stream));
  EP_CUDA(launch_merge_probs(fin, stream));
  return ncclSuccess;
}

}  // namespace

}  // namespace nccl_ep

using namespace nccl_ep;

extern "C" ncclResult_t ncclEpDispatch(ncclEpHandle_t handle, const ncclEpDispatchInputs_t* inputs,
                                       ncclEpDispatchOutputs_t* outputs,
                                       const ncclEpOpConfig_t* config, cudaStream_t stream) {
  DeferredError sticky;
  EP_RETURN_IF(check_entry(handle, config, "ncclEpDispatch", &sticky));
  EP_CHECK(inputs != nullptr && outputs != nullptr, ncclInvalidArgument,
           "ncclEpDispatch: inputs or outputs is NULL");
  ncclEpGroup* g = handle->group;
  const long long T = handle->num_tokens, H = g->cfg.hidden, N = handle->num_recv;
  EP_RETURN_IF(check_tensor(inputs->tokens, "x", T, H, g->cfg.token_dtype));
  EP_RETURN_IF(check_tensor(outputs->recv_tokens, "recv_x", N, H, g->cfg.token_dtype));
  // Presence is ndim, not data: a rank with no tokens passes an empty probs tensor (data may be
  // NULL) and must still write the probs of the rows it receives.
  const bool with_probs = inputs->topk_weights.ndim != 0;
  DispatchArgs a;
  a.prob_bytes = 4;
  a.probs_dense = 0;
  if (with_probs) {
    EP_RETURN_IF(check_weights(inputs->topk_weights, "probs", handle, &a.probs_dense));
    EP_RETURN_IF(check_tensor(outputs->recv_topk_weights, "recv_probs", N, -1,
                              inputs->topk_weights.dtype));
    a.prob_bytes = dtype_bytes(inputs->topk_weights.dtype);
  }
  a.dtype = (int)g->cfg.token_dtype;
  a.x = inputs->tokens.data;
  a.probs = with_probs ? inputs->topk_weights.data : nullptr;
  a.recv_x = outputs->recv_tokens.data;
  a.recv_probs = with_probs ? outputs->recv_topk_weights.data : nullptr;
  const bool vec = g->row_bytes % 16 == 0 && aligned16(a.x) && aligned16(a.recv_x);
  a.ex = exchange_args(handle, kOpDispatch, with_probs ? a.prob_bytes : 0, vec);
  a.ex.outputs[0] = OutputSpan{a.recv_x, N * (long long)g->row_bytes};
  if (with_probs) a.ex.outputs[1] = OutputSpan{a.recv_probs, N * a.prob_bytes};
  if (g->num_nodes > 1) {
    EP_RETURN_IF(dispatch_nodes(handle, a, with_probs,
                                a.probs_dense ? g->cfg.num_experts : handle->topk, stream));
    return sticky.result();
  }
  EP_CUDA(launch_dispatch(a, stream));
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpCombine(ncclEpHandle_t handle, const ncclEpCombineInputs_t* inputs,
                                      ncclEpCombineOutputs_t* outputs,
                                      const ncclEpOpConfig_t* config, cudaStream_t stream) {
  DeferredError sticky;
  EP_RETURN_IF(check_entry(handle, config, "ncclEpCombine", &sticky));
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

extern "C" ncclResult_t ncclEpCombineTopkWeights(ncclEpHandle_t handle,
                                                 const ncclEpTensor_t* grad_recv_topk_weights,
                                                 ncclEpTensor_t* grad_topk_weights,
                                                 cudaStream_t stream) {
  DeferredError sticky;
  EP_RETURN_IF(check_entry(handle, nullptr, "ncclEpCombineTopkWeights", &sticky));
  EP_CHECK(grad_recv_topk_weights != nullptr && grad_topk_weights != nullptr,
           ncclInvalidArgument, "ncclEpCombineTopkWeights: a tensor argument is NULL");
  const ncclDataType_t pd = grad_recv_topk_weights->dtype;
  EP_CHECK(is_float_dtype(pd), ncclInvalidArgument,
           "grad_recv_probs must have a floating dtype (float16, bfloat16, float32, float64), "
           "got %s",
           dtype_name(pd));
  EP_RETURN_IF(check_tensor(*grad_recv_topk_weights, "grad_recv_probs", handle->num_recv, -1, pd));
  CombineProbsArgs a;
  EP_RETURN_IF(check_weights(*grad_topk_weights, "grad_probs", handle, &a.grad_dense));
  EP_CHECK(grad_topk_weights->dtype == pd, ncclInvalidArgument,
           "grad_probs must have the dtype of grad_recv_probs (%s), got %s", dtype_name(pd),
           dtype_name(grad_topk_weights->dtype));
  a.prob_bytes = dtype_bytes(pd);
  a.grad_recv = grad_recv_topk_weights->data;
  a.grad = grad_topk_weights->data;
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
