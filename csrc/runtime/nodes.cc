/*
 * nodes.cc: groups that span nodes (G ranks per node < R ranks), docs/design.md section 4: the
 * node, rail and op communicators and the rail buffers (group creation and destroy), the first
 * use of the rail and of the routing all-gather (connect_nodes), handle creation's routing
 * all-gather, and the ops' transfers between nodes around the exchange engine's node passes.
 *
 * NOTES:
 *  - Communicators, all split from the caller's comm: node_comm joins the G ranks of a node (the
 *    window, its barriers and the exchange engine span it), rail_comm the ranks of the same index
 *    in every node, op_comm the whole group (the routing all-gather). rail_comm and op_comm share
 *    nothing with comm (splitShare = 0): the watchdog may abort them.
 *  - Every NCCL call between nodes is a step of the group's watchdog (watchdog.cc), which takes
 *    the place of the device-side timeout: a peer that never calls makes every rank raise within
 *    the group's timeout, never hang.
 *  - The ops:
 *      dispatch  rail_pack: per other node, this rank's tokens with a slot there (packed in
 *                token order, the layout's rail_out) and their weights as max_topk 8-byte
 *                slots; rail: each to the rank of its index on that node, theirs here; then one
 *                engine pass per node m of sources, ascending: node peer p sends the tokens of
 *                source m * G + p (its own, or what its rail brought, read at packed rows).
 *      combine   one engine pass per node m: the node partials (step 2a) of source m * G +
 *                node_rank's tokens, here (a remote source's at their packed rows); rail: each
 *                to its source; combine_nodes (step 2b) reads them at the packed rows.
 *      probs     passes as combine's, [rows, K] per node; rail; merge_probs.
 *    Rail messages have sizes both sides compute alike: exact mode the layout's counts of every
 *    pair (from the all-gathered records, read with the layout), capacity mode rail_capacity
 *    rows, so no rank can wait for bytes that never come; weights travel as max_topk 8-byte
 *    slots per token whatever their dtype.
 *  - A device-side error does not skip this rank's NCCL calls (DeferredError, nodes.h): its
 *    kernels stop and poison their outputs, the calls are made, the error is returned after them.
 */
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "internal.h"
#include "nodes.h"
#include "pool.h"
#include "watchdog.h"

namespace nccl_ep {

namespace {

// One message each way with the rail peer of remote node `node`.
struct RailMessage {
  int node;
  const void* send;
  size_t send_bytes;
  void* recv;
  size_t recv_bytes;
};

// The slot of remote node m in the rail buffers.
size_t remote_node_index(const ncclEpGroup* g, int m) {
  return (size_t)(m < g->node ? m : m - 1);
}

// Enqueues every message as one NCCL group on the stream (both sides list a node's messages in
// the same order); callers make it a step of the watchdog.
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

// Frees a communicator of the group. One with an asynchronous error (a peer's process gone, its
// sockets closed), or any of a group that holds an error (`failed`: a peer may be gone before
// NCCL noticed), is aborted: ncclCommDestroy would wait for that peer.
void release_comm(ncclComm_t c, const char* name, int rank, bool failed) {
  if (c == nullptr) return;
  const bool abort = failed || comm_async_error(c) != ncclSuccess;
  debug_log("rank %d: group destroy: %s %s", rank, abort ? "aborting" : "destroying", name);
  if (abort) ncclCommAbort(c);
  else ncclCommDestroy(c);
  debug_log("rank %d: group destroy: %s released", rank, name);
}

// One buffer per remote node for what the rail brings in (tokens and weights, or node partials
// and probs' gradients) and what it takes out, of `rows` tokens each, and this node's own
// values for this rank's tokens (combine, probs' backward).
ncclResult_t alloc_rail(ncclEpGroup* g) {
  RailBuffers& b = g->rail;
  const size_t T = (size_t)g->cfg.max_tokens_per_rank, remote = (size_t)g->num_nodes - 1;
  b.rows = g->capacity >= 0 && g->cfg.rail_capacity > 0 ? g->cfg.rail_capacity : (long long)T;
  const size_t M = (size_t)b.rows;
  b.row_bytes = g->row_bytes;
  b.prob_row_bytes = 8 * (size_t)g->cfg.max_topk;
  BufferPlan plan;
  plan.add(&b.rows_in, remote * M * b.row_bytes);
  plan.add(&b.rows_out, remote * M * b.row_bytes);
  plan.add(&b.rows_own, T * b.row_bytes);
  plan.add(&b.probs_in, remote * M * b.prob_row_bytes);
  plan.add(&b.probs_out, remote * M * b.prob_row_bytes);
  plan.add(&b.probs_own, T * b.prob_row_bytes);
  EP_RETURN_IF(alloc_device(g, &b.base, plan.bytes()));
  plan.bind(b.base);
  return ncclSuccess;
}

// Tokens in this rank's message to remote node n, and in the message that the rank of its index
// on node n sends here: exact mode the layout's counts (read with it), capacity mode the budget
// (no host read; rows past the selected ones are never used).
long long rail_send_tokens(const ncclEpHandle* h, int n) {
  const ncclEpGroup* g = h->group;
  return g->capacity >= 0 ? g->rail.rows : h->slot->host_meta->rail_send[n];
}
long long rail_recv_tokens(const ncclEpHandle* h, int n) {
  const ncclEpGroup* g = h->group;
  return g->capacity >= 0 ? g->rail.rows : h->slot->host_meta->rail_recv[n];
}

// Counts what an op hands to NCCL (ncclEpGroupGetInfo).
void count_sent(ncclEpGroup* g, OpKind op, long long rows, long long bytes) {
  const int i = op == kOpDispatch ? 0 : (op == kOpCombine ? 1 : 2);
  g->rail.rows_sent[i] += (unsigned long long)rows;
  g->rail.bytes_sent[i] += (unsigned long long)bytes;
}

// What the kernels that finish an op at the source read of handle h.
NodeParts node_parts(const ncclEpHandle* h) {
  const ncclEpGroup* g = h->group;
  NodeParts p;
  p.own_routing = h->slot->op_routing();
  p.tokens = h->num_tokens;
  p.topk = h->topk;
  p.experts_per_node = g->node_size * g->num_local;
  p.num_nodes = g->num_nodes;
  p.state = g->d_state;
  for (int n = 0; n < kMaxRanks; ++n) p.rows[n] = nullptr;
  return p;
}

// Where an op that sends values back to their sources keeps them: this node's values for this
// rank's tokens (own, row t), per remote node the values computed here for its source (out) and
// those it computed for this rank (in), at the tokens' packed rows, `token_bytes` of message per
// token.
struct ReturnBuffers {
  char* own;
  char* out;
  size_t out_stride;  // bytes per remote node
  char* in;
  size_t in_stride;
  size_t token_bytes;
};

// The ops whose values go back to the sources (combine, the probs' backward): run_pass(m, dst,
// rows) computes node m's sources' values here (the source m * G + node_rank's, into dst, token
// t at rows[t]; nullptr: row t); the rail takes each to its source and brings this rank's from
// every node; parts[n] = node n's values for this rank's tokens, token t at rows[n][t].
template <typename RunPass>
ncclResult_t return_to_sources(ncclEpHandle* h, OpKind op, const ReturnBuffers& b,
                               RunPass run_pass, NodeParts* parts, cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  const size_t Tm = (size_t)g->cfg.max_tokens_per_rank;
  std::vector<RailMessage> msgs;
  long long rows = 0;
  for (int m = 0; m < g->num_nodes; ++m) {
    const size_t i = remote_node_index(g, m);
    const bool own = m == g->node;
    char* dst = own ? b.own : b.out + i * b.out_stride;
    EP_RETURN_IF(run_pass(m, dst, own ? nullptr : h->slot->rail_in.ptr + m * Tm));
    parts->parts[m] = dst;
    if (own) continue;
    const long long sent = rail_recv_tokens(h, m);  // the tokens source m * G + q sent here
    msgs.push_back({m, dst, sent * b.token_bytes, b.in + i * b.in_stride,
                    rail_send_tokens(h, m) * b.token_bytes});
    rows += sent;
    parts->parts[m] = b.in + i * b.in_stride;
    parts->rows[m] = h->slot->rail_out.ptr + m * Tm;
  }
  EP_RETURN_IF(watched_rail(g, op, msgs, stream));
  count_sent(g, op, rows, rows * (long long)b.token_bytes);
  return ncclSuccess;
}

}  // namespace

// ---- group creation and destroy --------------------------------------------------------------

ncclResult_t split_nodes(ncclEpGroup* g, cudaStream_t stream) {
  ncclComm_t comm = g->comm;
  const int rank = g->rank;
  // Collective over comm, in the same order on every rank (all agreed on the node size).
  if (g->node_size > 1) EP_NCCL(ncclCommSplit(comm, g->node, rank, &g->node_comm, nullptr));
  // The watchdog's communicators must share nothing with the user's: a shared abort flag
  // would stop the user's collectives with them. NCCL shares a split's resources (and abort
  // flag) when the parent was made to share them, whatever the split's own config says; the
  // parent's config cannot be read back, its environment default can.
  const char* share = getenv("NCCL_COMM_SPLIT_SHARE_RESOURCES");
  EP_CHECK(share == nullptr || atoi(share) == 0, ncclInvalidUsage,
           "ncclEpCreateGroup: NCCL_COMM_SPLIT_SHARE_RESOURCES=%s makes NCCL share a split's "
           "abort flag with its parent, so stopping this group between nodes would also stop "
           "the caller's communicator; unset it (and create comm with splitShare = 0)",
           share);
  ncclConfig_t own = NCCL_CONFIG_INITIALIZER;
  own.splitShare = 0;
  EP_NCCL(ncclCommSplit(comm, g->node_rank, rank, &g->rail_comm, &own));
  EP_NCCL(ncclCommSplit(comm, 0, rank, &g->op_comm, &own));
  ncclResult_t res = alloc_rail(g);
  if (res == ncclSuccess && g->node_size > 1) {
    const int node_lsa = lsa_team_size(g->node_comm);
    if (node_lsa != g->node_size) {
      set_error("ncclEpCreateGroup: the node of rank %d (ranks %d..%d) is not one NVLink (LSA) "
                "team: NCCL gives it a team of %d ranks; set ranks_per_node to a divisor of "
                "the LSA team size",
                rank, g->node * g->node_size, (g->node + 1) * g->node_size - 1, node_lsa);
      res = ncclInvalidUsage;
    }
  }
  return fail_together(g, res, "the node communicators or the rail buffers", stream);
}

// A step that may fail on some ranks only (a node's window, an allocation) is followed by this,
// so that every rank of the group fails together, never one node waiting in a collective for
// another that gave up.
ncclResult_t fail_together(ncclEpGroup* g, ncclResult_t mine, const char* step,
                           cudaStream_t stream) {
  const std::string reason = mine != ncclSuccess ? ncclEpGetLastError() : "";
  std::vector<int> all(g->nranks);
  const int code = (int)mine;
  EP_RETURN_IF(host_all_gather(g->comm, g->nranks, g->rank, &code, sizeof(code), all.data(),
                               stream));
  if (mine != ncclSuccess) {
    set_error("%s", reason.c_str());
    return mine;
  }
  for (int r = 0; r < g->nranks; ++r) {
    EP_CHECK(all[r] == (int)ncclSuccess, (ncclResult_t)all[r],
             "ncclEpCreateGroup: rank %d failed at %s (its error says why); every rank of the "
             "group fails with it",
             r, step);
  }
  return ncclSuccess;
}

// The watchdog, then one exchange over the rail and one routing all-gather over op_comm of the
// very size the handles gather (NCCL connects an all-gather's algorithm when it is first chosen,
// which depends on the size), so that no op's enqueue waits on the host for a peer later.
// Followed by the watchdog like any step; no allocation that could fail on one rank only (a
// preallocated slot's records, the rail buffers).
ncclResult_t connect_nodes(ncclEpGroup* g, cudaStream_t stream) {
  try {
    g->watchdog = std::make_unique<NcclWatchdog>(g);
  } catch (const std::exception& e) {
    EP_CHECK(false, ncclSystemError, "ncclEpCreateGroup: starting the watchdog failed: %s",
             e.what());
  }
  int* records = g->free_slots.front()->records.ptr;  // [R][rec_ints]
  const size_t rec_ints = (size_t)g->win.rec_ints;
  std::vector<RailMessage> msgs;
  for (int m = 0; m < g->num_nodes; ++m) {
    if (m == g->node) continue;
    msgs.push_back({m, g->rail.rows_own.ptr, 1,
                    g->rail.rows_in.ptr + remote_node_index(g, m) * (size_t)g->rail.rows *
                                              g->rail.row_bytes,
                    1});
  }
  EP_RETURN_IF(g->watchdog->run(kOpCreateHandle, kStepConnect, stream, [&]() -> ncclResult_t {
    EP_RETURN_IF(rail_exchange(g, msgs, stream));
    EP_NCCL(ncclAllGather(records + (size_t)g->rank * rec_ints, records, rec_ints, ncclInt32,
                          g->op_comm, stream));
    return ncclSuccess;
  }));
  EP_CUDA(cudaStreamSynchronize(stream));
  if (g->watchdog->aborted()) return check_group_errors(g);
  return ncclSuccess;
}

void stop_watchdog(ncclEpGroup* g) {
  if (g->watchdog != nullptr) g->watchdog->shutdown();
  g->watchdog.reset();
}

void release_nodes(ncclEpGroup* g, bool failed) {
  if (g->node_comm != g->comm) release_comm(g->node_comm, "node_comm", g->rank, failed);
  release_comm(g->rail_comm, "rail_comm", g->rank, failed);  // null once the watchdog aborted
  release_comm(g->op_comm, "op_comm", g->rank, failed);
  free_device(g, g->rail.base);
}

size_t rail_buffer_bytes(const ncclEpGroup* g) {
  return g->rail.rows_in.bytes() + g->rail.rows_out.bytes() + g->rail.rows_own.bytes() +
         g->rail.probs_in.bytes() + g->rail.probs_out.bytes() + g->rail.probs_own.bytes();
}

// ---- handle creation ---------------------------------------------------------------------------

// NOTES: an NCCL collective, followed by the group's watchdog in place of the device-side
// timeout; a rank whose shape is out of bounds still joins it (its record's header names the
// error).
ncclResult_t gather_routing(ncclEpGroup* g, const int* own_record, int* records,
                            cudaStream_t stream) {
  return g->watchdog->run(kOpCreateHandle, kStepRoutingGather, stream, [&]() -> ncclResult_t {
    EP_NCCL(ncclAllGather(own_record, records, (size_t)g->win.rec_ints, ncclInt32, g->op_comm,
                          stream));
    return ncclSuccess;
  });
}

// Polled: a spin first, as cudaEventSynchronize would, then short sleeps, so that a stop of the
// watchdog ends the wait whether or not the stream moves again.
ncclResult_t wait_behind_gather(ncclEpGroup* g, cudaEvent_t ready) {
  using Clock = std::chrono::steady_clock;
  const auto spin_until = Clock::now() + std::chrono::milliseconds(1);
  for (;;) {
    const cudaError_t q = cudaEventQuery(ready);
    if (q == cudaSuccess) return ncclSuccess;
    EP_CHECK(q == cudaErrorNotReady, ncclUnhandledCudaError, "CUDA error: %s",
             cudaGetErrorString(q));
    const auto now = Clock::now();
    if (now < spin_until) continue;
    const auto stopped = g->watchdog->stopped_at();
    if (stopped != Clock::time_point{} &&
        now - stopped > std::chrono::milliseconds(g->cfg.timeout_ms)) {
      EP_RETURN_IF(check_group_errors(g));
      EP_CHECK(false, ncclSystemError, "the layout never arrived after the group's stop");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

bool nodes_stopped(ncclEpGroup* g) { return g->watchdog->aborted(); }

// ---- ops ---------------------------------------------------------------------------------------

// Dispatch over nodes: the messages packed, the rail, then the engine once per node of sources.
ncclResult_t dispatch_nodes(ncclEpHandle* h, DispatchArgs a, bool with_probs, cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  const RailBuffers& r = g->rail;
  const size_t Tm = (size_t)g->cfg.max_tokens_per_rank, M = (size_t)r.rows;
  const size_t row_bytes = r.row_bytes + (with_probs ? r.prob_row_bytes : 0);  // per token sent
  RailPackArgs pack;
  pack.rail_out = h->slot->rail_out.ptr;
  pack.routing = h->slot->op_routing();
  pack.tokens = h->num_tokens;
  pack.topk = h->topk;
  pack.max_topk = g->cfg.max_topk;
  pack.max_tokens = g->cfg.max_tokens_per_rank;
  pack.num_nodes = g->num_nodes;
  pack.node = g->node;
  pack.experts_per_node = g->node_size * g->num_local;
  pack.num_experts = g->cfg.num_experts;
  pack.rail_rows = r.rows;
  pack.x = a.x;
  pack.row_bytes = r.row_bytes;
  pack.probs = with_probs ? a.probs : nullptr;
  pack.prob_bytes = a.prob_bytes;
  pack.probs_dense = a.probs_dense;
  pack.rows_out = r.rows_out.ptr;
  pack.probs_out = r.probs_out.ptr;
  EP_CUDA(launch_rail_pack(pack, stream));
  std::vector<RailMessage> msgs;
  long long rows = 0;
  for (int m = 0; m < g->num_nodes; ++m) {
    if (m == g->node) continue;
    const long long mine = rail_send_tokens(h, m), theirs = rail_recv_tokens(h, m);
    const size_t i = remote_node_index(g, m);
    msgs.push_back({m, r.rows_out.ptr + i * M * r.row_bytes, mine * r.row_bytes,
                    r.rows_in.ptr + i * M * r.row_bytes, theirs * r.row_bytes});
    if (with_probs)
      msgs.push_back({m, r.probs_out.ptr + i * M * r.prob_row_bytes, mine * r.prob_row_bytes,
                      r.probs_in.ptr + i * M * r.prob_row_bytes, theirs * r.prob_row_bytes});
    rows += mine;
  }
  EP_RETURN_IF(watched_rail(g, kOpDispatch, msgs, stream));
  count_sent(g, kOpDispatch, rows, rows * (long long)row_bytes);
  for (int m = 0; m < g->num_nodes; ++m) {
    DispatchArgs pass = a;
    if (m != g->node) {
      const size_t i = remote_node_index(g, m);
      pass.x = r.rows_in.ptr + i * M * r.row_bytes;
      if (with_probs) pass.probs = r.probs_in.ptr + i * M * r.prob_row_bytes;
      pass.rail_rows = h->slot->rail_in.ptr + m * Tm;
    }
    pass.ex = exchange_args(h, kOpDispatch, with_probs ? a.prob_bytes : 0, a.ex.vec != 0, m);
    pass.ex.outputs[0] = a.ex.outputs[0];
    pass.ex.outputs[1] = a.ex.outputs[1];
    EP_CUDA(launch_dispatch(pass, stream));
  }
  return ncclSuccess;
}

// Combine over nodes: the node partials (2a) of every node's sources, the rail, then 2b here.
ncclResult_t combine_nodes(ncclEpHandle* h, const CombineArgs& a, cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  const RailBuffers& r = g->rail;
  const size_t node_bytes = (size_t)r.rows * r.row_bytes;  // a message's buffer
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
      [&](int m, char* dst, const int* rows) -> ncclResult_t {
        CombineArgs pass = a;
        pass.y = dst;
        pass.rail_rows = rows;
        pass.ex = exchange_args(h, kOpCombine, 0, a.ex.vec != 0, m);
        // (this node's own: T_max rows; a message's: rows)
        const size_t bytes = rows == nullptr ? r.rows_own.bytes() : node_bytes;
        pass.ex.outputs[0] = OutputSpan{dst, (long long)bytes};
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
  const size_t node_bytes = (size_t)r.rows * r.prob_row_bytes;  // a message's buffer
  MergeProbsArgs fin;
  fin.nodes = node_parts(h);
  fin.prob_bytes = a.prob_bytes;
  fin.grad_dense = a.grad_dense;
  fin.num_experts = g->cfg.num_experts;
  fin.grad = a.grad;
  const ReturnBuffers b{r.probs_own.ptr, r.probs_out.ptr, node_bytes, r.probs_in.ptr,
                        node_bytes, r.prob_row_bytes};
  EP_RETURN_IF(return_to_sources(
      h, kOpCombineProbs, b,
      [&](int m, char* dst, const int* rows) -> ncclResult_t {
        CombineProbsArgs pass = a;
        pass.grad = dst;
        pass.grad_dense = 0;  // [rows, K] per node; merged into the caller's layout at the end
        pass.rail_rows = rows;
        pass.ex = exchange_args(h, kOpCombineProbs, a.prob_bytes, false, m);
        const size_t bytes = rows == nullptr ? r.probs_own.bytes() : node_bytes;
        pass.ex.outputs[0] = OutputSpan{dst, (long long)bytes};
        EP_CUDA(launch_combine_probs(pass, stream));
        return ncclSuccess;
      },
      &fin.nodes, stream));
  EP_CUDA(launch_merge_probs(fin, stream));
  return ncclSuccess;
}

}  // namespace nccl_ep
