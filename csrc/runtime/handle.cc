/*
 * handle.cc: ncclEpCreateHandle and the handle getters.
 *
 * Creation (collective, stream-ordered, no host wait): pack this rank's routing (top-k ids or a
 * routing map) into its record in every rank's window -> the group's timed barrier -> layout
 * kernels (layout.cu) on the local copy of all records. A group that spans nodes packs into the
 * handle's record buffer instead and all-gathers it with NCCL over the whole group (nodes.cc,
 * gather_routing). In exact
 * mode the layout's bases (validate's last block) write [error, N_d, tokens_per_expert] into
 * the slot's pinned, mapped buffer (over nodes the rail kernel adds the rail's message sizes),
 * and an event follows (the scatter runs on behind it): the
 * first call that needs the count waits for that event (read_layout), as late as the caller
 * allows. Capacity mode reports errors through the group's mapped error word (a rank whose own
 * shape is out of bounds waits for it and raises at once).
 *
 * NOTES:
 *  - Every rank validates the routing of every rank (it has them all after the exchange), so in
 *    exact mode all ranks return the same error together: nobody is left in a collective.
 *  - Records are double buffered by the parity of the creation's number, counted on the device
 *    (the barriers run so far, DeviceState::barrier_epoch), so that a CUDA graph replays the
 *    alternation whatever number of creations it holds: creation n writes half n mod 2 of the
 *    peers' routing areas right away, because every peer finished reading that half (creation
 *    n - 2's layout) before it entered creation n - 1's barrier, which this rank passed.
 *  - Inside a stream capture (a CUDA graph): exact mode, groups that span nodes and shapes out
 *    of bounds are refused before anything is launched; a slot is kept out of the pool while
 *    any graph that replays work on it exists (pool.h, retain_slot_for_graph: taken before the
 *    first launch on the slot, by creation, every op and the device-side getters), also after
 *    the handle is destroyed. A group's graphs must be destroyed before the group: its
 *    destruction frees every slot (a replay after it writes freed memory).
 *  - The halves alternate per creation in stream order: creations of one group on two streams
 *    must be ordered by the caller (as every use of a group's handles, pool.h).
 */
#include <string.h>

#include "call_checks.h"
#include "internal.h"
#include "nodes.h"
#include "pool.h"

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

ncclResult_t check_ht_handle(const ncclEpHandle* h, const char* fn) {
  EP_CHECK(!is_ll(h->group), ncclInvalidUsage,
           "%s: an HT handle's call, given a handle of an LL group (LL outputs carry their "
           "counts on the device: docs/design.md section 9)",
           fn);
  return ncclSuccess;
}

CallShape call_shape(const ncclEpHandle* h) {
  const ncclEpGroup* g = h->group;
  CallShape s;
  s.cfg = &g->cfg;
  s.nranks = g->nranks;
  s.num_tokens = h->num_tokens;
  s.topk = h->topk;
  s.num_recv = h->num_recv;
  return s;
}

// Caller holds g->mu.
static void destroy_handle_state(ncclEpHandle* h) {
  ncclEpGroup* g = h->group;
  for (size_t i = 0; i < g->live.size(); ++i) {
    if (g->live[i] == h) {
      g->live.erase(g->live.begin() + i);
      break;
    }
  }
  ll_forget(h);
  release_slot(g, h->slot);
  delete h;
}

// Waits for the count (the bases' write into the slot's host_meta). Inside a node every wait
// before it is a device-side wait with a timeout. Over nodes it sits behind the routing
// all-gather, whose stop by the watchdog ends the wait (nodes.cc).
static ncclResult_t wait_layout(ncclEpGroup* g, cudaEvent_t ready) {
  if (g->num_nodes == 1) {
    EP_CUDA(cudaEventSynchronize(ready));
    return ncclSuccess;
  }
  return wait_behind_gather(g, ready);
}

ncclResult_t read_layout(ncclEpHandle* h) {
  ncclEpGroup* g = h->group;
  if (g->capacity >= 0) return ncclSuccess;  // nothing to read: the count is the capacity
  if (!h->layout_read) {
    EP_RETURN_IF(wait_layout(g, h->slot->meta_ready));
    // A group error (a failed barrier: the records may be stale) explains any layout error. (A
    // group that spans nodes has no barrier here, and its ops defer group errors: DeferredError;
    // but an aborted all-gather left the records unwritten.)
    if (g->num_nodes == 1 || nodes_stopped(g)) EP_RETURN_IF(check_group_errors(g));
    const LayoutMeta* m = h->slot->host_meta;
    if (m->err.code != kErrNone) {
      h->layout_result = report_error(g, m->err, m);
      h->layout_error = ncclEpGetLastError();
    } else {
      h->num_recv = m->num_rows;
      h->tokens_per_expert.assign(m->tokens_per_expert, m->tokens_per_expert + g->num_local);
    }
    h->layout_read = true;
  }
  EP_CHECK(h->layout_result == ncclSuccess, h->layout_result, "%s", h->layout_error.c_str());
  return ncclSuccess;
}

static ncclResult_t create_handle(ncclEpHandle* h, const ncclEpTensor_t* routing,
                                  cudaStream_t stream) {
  ncclEpGroup* g = h->group;
  const ncclEpGroupConfig_t& c = g->cfg;
  const bool from_map = routing->tag == NCCL_EP_TENSOR_ROUTING_MAP;
  const char* name = from_map ? "routing_map" : "topk_idx";
  const CallShape shape{&c, g->nranks};
  EP_RETURN_IF(megatron_nccl_ep_check_routing(&shape, routing));
  // A routing map fills max_topk slots per token.
  const long long T = routing->sizes[0], K = from_map ? c.max_topk : routing->sizes[1];
  // NOTES: T or K beyond the group's bounds still joins the exchange, with an empty record
  // whose header holds the real shape, so every rank reports the error together (kErrShape)
  // instead of leaving its peers in the collective.
  const bool fits = T <= c.max_tokens_per_rank && K >= 1 && K <= c.max_topk;
  // Inside a capture nothing runs until a replay: what capture cannot hold is refused here,
  // before anything is launched. Exact mode and groups over nodes are the group's, so every
  // rank refuses alike; a shape out of bounds is this rank's own: its peers capture a barrier
  // it never joins, and their replays time out naming it (an eager creation reports the shape
  // on every rank instead).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EP_CUDA(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    EP_CHECK(g->capacity >= 0, ncclInvalidUsage,
             "ncclEpCreateHandle: a handle of an exact-mode group cannot be created inside a CUDA "
             "graph capture (its receive count is read on the host); use capacity mode "
             "(recv_count_mode = ncclEpRecvCountCapacity, recv_mode=\"capacity\" in Python), "
             "whose handles, dispatch and combine capture and replay");
    EP_CHECK(g->num_nodes == 1, ncclInvalidUsage,
             "ncclEpCreateHandle of a group that spans nodes cannot be captured into a CUDA graph "
             "(its NCCL steps are watched from the host); capture the layers around it, or use "
             "one node");
    EP_CHECK(fits, ncclInvalidArgument,
             "%s of shape (%lld, %lld) is out of the group's bounds (max_tokens_per_rank=%d, "
             "1 <= top-k <= max_topk=%d)",
             name, T, K, c.max_tokens_per_rank, c.max_topk);
  }
  h->num_tokens = fits ? (int)T : 0;
  h->topk = fits ? (int)K : 1;

  {
    std::lock_guard<std::mutex> lock(g->mu);
    EP_RETURN_IF(acquire_slot(g, &h->slot));
    h->seq = g->handles_created++;  // every rank counts the same collective creations
  }
  EP_RETURN_IF(retain_slot_for_graph(g, h->slot, stream));  // a capture holds it from here
  HandleSlot* s = h->slot;
  const int R = g->nranks, G = g->node_size;
  const size_t half = sizeof(int) * (size_t)G * g->win.rec_ints;
  const size_t area = g->win.routing_off;  // half 0; the kernels pick the creation's half
  const bool one_node = g->num_nodes == 1;
  // One rank reads its own record in stream order: half 0 always (no barrier counts).
  const unsigned long long* barriers = one_node && G > 1 ? &g->d_state->barrier_epoch : nullptr;

  PackArgs p;
  p.routing = routing->data;
  p.kind = from_map ? kRecordRoutingMap : kRecordTopkIdx;
  p.idx_is_64 = routing->dtype == ncclInt64;
  p.stride0 = routing->strides[0];
  p.stride1 = routing->strides[1];
  p.tokens = h->num_tokens;
  p.topk = h->topk;
  p.num_experts = c.num_experts;
  p.header_tokens = (int)(T < 0x7fffffff ? T : 0x7fffffff);
  p.header_topk = (int)(K < 0x7fffffff ? K : 0x7fffffff);
  int* own_record = s->records.ptr + (size_t)g->rank * g->win.rec_ints;
  p.peers = one_node ? g->d_peers : nullptr;
  p.record_off = area + sizeof(int) * (size_t)g->node_rank * g->win.rec_ints;
  p.barrier_epoch = barriers;
  p.half_bytes = half;
  p.own_record = one_node ? nullptr : own_record;
  p.num_ranks = one_node ? G : 1;
  p.own_routing = s->own_routing.ptr;
  p.kept_routing = s->kept_routing.count > 0 ? s->kept_routing.ptr : nullptr;
  p.err_key = s->err_key.ptr;
  p.hist = s->hist.ptr;
  p.meta_err = &s->meta.ptr->err;
  p.blocks_done = s->blocks_done.ptr;
  p.rail_done = one_node ? nullptr : s->rail_done.ptr;
  p.state = one_node ? nullptr : g->d_state;  // one node: its barrier carries errors
  p.err = g->d_err;
  p.rank = g->rank;
  p.stop_base = g->node * G;
  EP_CUDA(launch_pack(p, stream));
  const int* gathered = s->records.ptr;
  if (one_node) {
    EP_RETURN_IF(barrier(g, call_signature(kOpCreateHandle, 0, h->seq), stream));
    gathered = reinterpret_cast<const int*>(
        reinterpret_cast<const char*>(g->peers[g->node_rank]) + area);
  } else {
    EP_RETURN_IF(gather_routing(g, own_record, s->records.ptr, stream));
  }

  LayoutArgs a;
  a.gathered = gathered;
  a.barrier_epoch = barriers;
  a.half_ints = half / sizeof(int);
  a.rec_ints = g->win.rec_ints;
  a.num_ranks = R;
  a.rank = g->rank;
  a.num_experts = c.num_experts;
  a.num_local = g->num_local;
  a.max_tokens = c.max_tokens_per_rank;
  a.max_topk = c.max_topk;
  a.topk = h->topk;
  a.align = c.expert_alignment;
  a.capacity = g->capacity;
  a.drops_overflow = g->drops_overflow ? 1 : 0;
  a.cnt = s->cnt.ptr;
  a.tile_cnt = s->tile_cnt.ptr;
  a.tiles = layout_tiles(c.max_tokens_per_rank, c.max_topk);
  a.off = s->off.ptr;
  a.recv_row = s->recv_row.ptr;
  a.src_of_row = s->src_of_row.ptr;
  a.src_rows = g->src_rows;
  a.err_key = s->err_key.ptr;
  a.hist = s->hist.ptr;
  a.blocks_done = s->blocks_done.ptr;
  a.meta = s->meta.ptr;
  a.host_meta = g->capacity < 0 ? s->host_meta_dev : nullptr;
  a.err = g->capacity >= 0 ? g->d_err : &s->meta.ptr->err;
  a.expert_capacity = c.expert_capacity;
  a.block_rows = g->block_rows;
  a.kept_routing = p.kept_routing;
  a.records_rw = one_node ? nullptr : s->records.ptr;
  a.node_size = G;
  a.node_rank = g->node_rank;
  a.num_nodes = g->num_nodes;
  a.rail_out = s->rail_out.ptr;
  a.rail_in = s->rail_in.ptr;
  a.rail_counts = s->rail_counts.ptr;
  a.rail_done = s->rail_done.ptr;
  a.rail_capacity = g->capacity >= 0 ? g->rail.rows : -1;
  // Exact mode: meta_ready follows the bases, which write the count into host_meta; the
  // scatter runs on meanwhile (read_layout waits for the count only).
  EP_CUDA(launch_layout(a, g->capacity < 0 ? s->meta_ready : nullptr, stream));

  if (g->capacity >= 0) {
    h->num_recv = g->capacity;
    h->layout_read = true;
    if (fits) return ncclSuccess;
    // This rank knows it failed: an error path may wait for the layout, whose error word holds
    // the error all ranks agree on (the lowest failing rank's, maybe not this one's).
    EP_CUDA(cudaStreamSynchronize(stream));
    EP_RETURN_IF(check_group_errors(g));
    EP_CHECK(false, ncclInternalError, "%s shape out of bounds but no error was recorded", name);
  }
  h->layout_read = false;
  return ncclSuccess;
}

// A new handle of `group` from `routing`, or an error with nothing left behind.
static ncclResult_t new_handle(ncclEpHandle_t* handle, ncclEpGroup_t group,
                               const ncclEpTensor_t* routing, cudaStream_t stream) {
  // A group that spans nodes makes its NCCL calls also after a device-side error
  // (DeferredError) and returns the error after them.
  DeferredError sticky;
  if (group->num_nodes == 1) {
    EP_RETURN_IF(check_group_errors(group));
  } else {
    sticky.take(check_group_errors(group));
  }
  ncclEpHandle* h = new ncclEpHandle();
  h->group = group;
  {
    std::lock_guard<std::mutex> lock(group->mu);
    group->live.push_back(h);
  }
  ncclResult_t res =
      is_ll(group) ? ll_create_handle(h, routing, stream) : create_handle(h, routing, stream);
  if (res == ncclSuccess) res = sticky.result();
  if (res != ncclSuccess) {
    std::lock_guard<std::mutex> lock(group->mu);
    destroy_handle_state(h);
    return res;
  }
  *handle = h;
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
  // An LL handle is made without communication; an HT handle's creation is collective. Its slot
  // exists before a local team's gate: a new slot is a device allocation, which may wait for
  // the whole device, so it never happens between the gate's meetings (team_gate.h).
  if (is_ll(group)) return new_handle(handle, group, routing, stream);
  {
    std::lock_guard<std::mutex> lock(group->mu);
    EP_RETURN_IF(reserve_slot(group));
  }
  const ncclResult_t res = gated_call(group, "handle creation",
                                      [&] { return new_handle(handle, group, routing, stream); });
  if (res != ncclSuccess && *handle != nullptr) {  // made, but the gate stopped as it left
    std::lock_guard<std::mutex> lock(group->mu);
    destroy_handle_state(*handle);
    *handle = nullptr;
  }
  return res;
}

extern "C" ncclResult_t ncclEpHandleDestroy(ncclEpHandle_t handle) {
  if (handle == nullptr) return ncclSuccess;
  std::lock_guard<std::mutex> lock(handle->group->mu);
  destroy_handle_state(handle);
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpHandleGetNumRecvTokens(ncclEpHandle_t handle,
                                                     int64_t* num_recv_tokens) {
  EP_CHECK(handle != nullptr && num_recv_tokens != nullptr, ncclInvalidArgument,
           "ncclEpHandleGetNumRecvTokens: handle or num_recv_tokens is NULL");
  EP_RETURN_IF(check_ht_handle(handle, "ncclEpHandleGetNumRecvTokens"));
  EP_RETURN_IF(read_layout(handle));
  // Over nodes a device-side error comes with the next op, after its NCCL calls.
  if (handle->group->num_nodes == 1) EP_RETURN_IF(check_group_errors(handle->group));
  *num_recv_tokens = handle->num_recv;
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpHandleGetTokensPerExpert(ncclEpHandle_t handle, ncclEpTensor_t* out,
                                                       cudaStream_t stream) {
  EP_CHECK(handle != nullptr && out != nullptr, ncclInvalidArgument,
           "ncclEpHandleGetTokensPerExpert: handle or out is NULL");
  EP_RETURN_IF(check_ht_handle(handle, "ncclEpHandleGetTokensPerExpert"));
  ncclEpGroup* g = handle->group;
  EP_CHECK(out->ndim == 1 && out->sizes[0] == g->num_local && out->dtype == ncclInt64 &&
               out->data != nullptr,
           ncclInvalidArgument,
           "tokens_per_expert must be a 1-D int64 tensor of %d elements (local experts)",
           g->num_local);
  const size_t bytes = sizeof(long long) * g->num_local;
  const void* dev = handle->slot->meta.ptr->tokens_per_expert;
  if (out->tag == NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_HOST) {
    if (g->capacity < 0) {
      EP_RETURN_IF(read_layout(handle));
      memcpy(out->data, handle->tokens_per_expert.data(), bytes);
    } else {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      EP_CUDA(cudaStreamIsCapturing(stream, &capture));
      EP_CHECK(capture == cudaStreamCaptureStatusNone, ncclInvalidUsage,
               "ncclEpHandleGetTokensPerExpert: the host tag reads the device and waits, which "
               "a CUDA graph capture cannot; use RECV_EXPERT_COUNTER_DEVICE");
      EP_CUDA(cudaMemcpyAsync(out->data, dev, bytes, cudaMemcpyDeviceToHost, stream));
      EP_CUDA(cudaStreamSynchronize(stream));
    }
    return ncclSuccess;
  }
  EP_CHECK(out->tag == NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_DEVICE ||
               out->tag == NCCL_EP_TENSOR_TOKENS_PER_EXPERT,
           ncclInvalidArgument,
           "tokens_per_expert tag must be RECV_EXPERT_COUNTER_DEVICE/_HOST or TOKENS_PER_EXPERT");
  EP_RETURN_IF(retain_slot_for_graph(g, handle->slot, stream));  // a captured read holds it too
  EP_CUDA(cudaMemcpyAsync(out->data, dev, bytes, cudaMemcpyDeviceToDevice, stream));
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpHandleGetTopkIdx(ncclEpHandle_t handle, ncclEpTensor_t* out,
                                              cudaStream_t stream) {
  EP_CHECK(handle != nullptr && out != nullptr, ncclInvalidArgument,
           "ncclEpHandleGetTopkIdx: handle or out is NULL");
  EP_RETURN_IF(check_ht_handle(handle, "ncclEpHandleGetTopkIdx"));
  const long long T = handle->num_tokens, K = handle->topk;
  EP_CHECK(out->ndim == 2 && out->sizes[0] == T && out->sizes[1] == K &&
               (out->dtype == ncclInt32 || out->dtype == ncclInt64) &&
               (T * K == 0 || (out->data != nullptr && out->strides[1] == 1 &&
                               (T <= 1 || out->strides[0] == K))),
           ncclInvalidArgument,
           "topk_idx output must be a contiguous int32 or int64 tensor of shape (%lld, %lld)", T,
           K);
  EP_RETURN_IF(retain_slot_for_graph(handle->group, handle->slot, stream));
  EP_CUDA(launch_copy_topk(handle->slot->own_routing.ptr, T * K, out->data,
                           out->dtype == ncclInt64, stream));
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpComplete(ncclEpHandle_t handle, cudaStream_t stream) {
  EP_CHECK(handle != nullptr, ncclInvalidArgument, "ncclEpComplete: handle is NULL");
  if (!is_ll(handle->group)) return ncclSuccess;
  EP_RETURN_IF(retain_slot_for_graph(handle->group, handle->slot, stream));
  return gated_call(handle->group, "LL complete", [&] { return ll_complete(handle, stream); });
}
