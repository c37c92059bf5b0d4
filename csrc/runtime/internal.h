/*
 * internal.h: host-side state of groups and handles, and the declarations that several runtime
 * files share. Parts that serve a few files have their own header: errors.h (the check macros),
 * config_traits.h (what a configuration implies by itself), buffer_plan.h (View, BufferPlan),
 * pool.h (HandleSlot, device memory), watchdog.h (NcclWatchdog), call_checks.h (CallShape and
 * the argument checks), nodes.h (the path between nodes).
 *
 * NOTES:
 *  - A group's host state is guarded by its mutex: handles may be destroyed from another thread
 *    (a garbage collector, autograd's thread) while this one creates handles or runs ops.
 *  - HandleSlot, NcclWatchdog and CallShape are only named here: a file that reads a slot
 *    includes pool.h; group.cc, which creates and deletes groups (and so their watchdog),
 *    includes watchdog.h; a file that runs the argument checks includes call_checks.h.
 */
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../include/nccl_ep.h"
#include "../kernels/api.cuh"
#include "buffer_plan.h"
#include "config_traits.h"
#include "errors.h"
#include "team_gate.h"

namespace nccl_ep {

struct HandleSlot;    // pool.h
struct GraphSlotOwner;  // pool.h
class NcclWatchdog;   // watchdog.h
struct CallShape;     // call_checks.h

// Windows of a local team (ncclEpCreateLocalTeam): freed when the last member goes. A team of
// several members has a gate that its collective calls pass (team_gate.h).
struct LocalTeam {
  std::vector<void*> windows;
  std::unique_ptr<TeamGate> gate;
  ncclEpAllocFn_t alloc_fn = nullptr;
  ncclEpFreeFn_t free_fn = nullptr;
  void* alloc_ctx = nullptr;
  ~LocalTeam();
};

// Groups that span nodes: what travels between rail peers (ranks with the same index in their
// node), one buffer per remote node of Tmax token rows / prob rows, plus this rank's own.
// A message holds at most `rows` tokens (packed: only those with a slot on the receiving node).
struct RailBuffers {
  void* base = nullptr;
  View<char> rows_in;            // [nodes - 1][rows]: dispatch tokens / combine partials in
  View<char> rows_out;           // [nodes - 1][rows]: dispatch tokens / combine partials out
  View<char> rows_own;           // [Tmax rows]: own node's combine partials
  View<char> probs_in;           // [nodes - 1][rows][Kmax] 8-byte slots: weights / gradients in
  View<char> probs_out;          // [nodes - 1][rows][Kmax] 8-byte slots: weights / gradients out
  View<char> probs_own;          // [Tmax][Kmax] 8-byte slots: own node's probs' gradients
  long long rows = 0;            // per message: rail_capacity (capacity mode), else Tmax
  size_t row_bytes = 0, prob_row_bytes = 0;  // per token: a row; Kmax 8-byte slots
  // What the ops handed to NCCL, per OpKind (dispatch, combine, combine_probs): rows, bytes
  // (ncclEpGroupGetInfo).
  std::atomic<unsigned long long> rows_sent[3] = {}, bytes_sent[3] = {};
};

}  // namespace nccl_ep

struct ncclEpGroup {
  std::mutex mu;                 // guards the pool and the live handles
  ncclComm_t comm = nullptr;     // null for a local team
  std::shared_ptr<nccl_ep::LocalTeam> team;
  ncclEpGroupConfig_t cfg{};
  int rank = 0, nranks = 1, num_local = 0;
  // Nodes: G consecutive ranks each (G = nranks: one node). The window, its barriers and the
  // exchange engine span the node (node_comm, split from comm when G < nranks); rail_comm joins
  // the ranks of the same index in every node (G < nranks only).
  int node_size = 1, node = 0, node_rank = 0, num_nodes = 1;
  ncclComm_t node_comm = nullptr;  // == comm on one node (not owned then)
  ncclComm_t rail_comm = nullptr;
  ncclComm_t op_comm = nullptr;    // G < nranks: split from comm for the routing all-gather
  std::unique_ptr<nccl_ep::NcclWatchdog> watchdog;  // G < nranks: follows the two above
  nccl_ep::RailBuffers rail;
  size_t row_bytes = 0;          // hidden * token element bytes
  long long capacity = -1;       // capacity mode rows, -1 in exact mode
  bool drops_overflow = false;   // ncclEpRecvCountCapacityDrop: rows past `capacity` dropped
  long long src_rows = 0;        // rows that src_of_row covers
  long long block_rows = 0;      // expert_capacity: rows of each local expert's block (0: off)
  int device = 0;
  // symmetric window
  nccl_ep::WindowLayout win{};
  void* win_buf = nullptr;       // NCCL: ncclMemAlloc'd; local team: the team's window
  ncclWindow_t nccl_win = nullptr;
  void** d_peers = nullptr;      // device [R]
  std::vector<void*> peers;      // host copy
  nccl_ep::DeviceState* d_state = nullptr;
  // Two host-mapped pinned error words of one allocation: h_err the kernels' (device atomics
  // claim it), h_stop the watchdog's (host only). Host and device atomics on mapped memory are
  // not atomic with each other, so no word has writers on both sides.
  nccl_ep::ErrorInfo* h_err = nullptr;
  nccl_ep::ErrorInfo* d_err = nullptr;   // h_err's device alias
  nccl_ep::ErrorInfo* h_stop = nullptr;  // h_err + 1
  nccl_ep::ErrorInfo* d_stop = nullptr;  // its device alias (read by the latch kernel)
  // handle pool
  std::vector<nccl_ep::HandleSlot*> free_slots;
  std::vector<nccl_ep::HandleSlot*> all_slots;
  std::vector<ncclEpHandle*> live;
  // Made by the first capture that holds a slot (pool.h, retain_slot_for_graph).
  std::shared_ptr<nccl_ep::GraphSlotOwner> graph_owner;
  unsigned handles_created = 0;  // the next handle's creation number (ncclEpHandle::seq)
  // LL (ll.cc): dispatches, combines issued so far, and the number of each sent with send_only
  // and not completed (at most two of a kind).
  unsigned long long ll_issued[2] = {0, 0};
  std::vector<unsigned long long> ll_pending_ops[2];
};

struct ncclEpHandle {
  ncclEpGroup* group = nullptr;
  nccl_ep::HandleSlot* slot = nullptr;
  int num_tokens = 0, topk = 0;
  unsigned seq = 0;              // creation number in its group: the same on every rank
  // Exact mode: filled from the readback at the first call that needs it (read_layout).
  bool layout_read = false;
  ncclResult_t layout_result = ncclSuccess;
  std::string layout_error;
  long long num_recv = 0;        // rows of dispatch outputs (capacity: the capacity)
  std::vector<long long> tokens_per_expert;
  // LL (ll.cc): the op sent with send_only that ncclEpComplete finishes (-1: none, 0: dispatch,
  // 1: combine), with its launch arguments; whether the handle dispatched (its combine's rows).
  int ll_pending = -1;
  unsigned long long ll_op = 0;  // the pending op's number among its kind's (ncclEpGroup)
  bool ll_dispatched = false;
  nccl_ep::LLDispatchArgs ll_dispatch{};
  nccl_ep::LLCombineArgs ll_combine{};
};

namespace nccl_ep {

// config.cc
ncclResult_t check_config_version(const ncclEpGroupConfig_t* c);  // size and version only
ncclResult_t check_config(const ncclEpGroupConfig_t* c, int nranks, int node_size);
// Sizes and offsets of the window for this config (the same on every rank of a node of nranks).
WindowLayout plan_window(const ncclEpGroupConfig_t& c, int nranks);
int default_channels(const ncclEpGroupConfig_t& c);
// Checks that every rank of an NCCL group has the same configuration (collective).
ncclResult_t agree_config(ncclEpGroup* g, int lsa_size, int nccl_version, cudaStream_t stream);
// All-gathers one small host record per rank into all[n] over comm (n ranks, this one `rank`;
// collective, synchronizes the stream).
ncclResult_t host_all_gather(ncclComm_t comm, int n, int rank, const void* mine, size_t bytes,
                             void* all, cudaStream_t stream);

// window.cc
ncclResult_t open_nccl_window(ncclEpGroup* g, cudaStream_t stream);
void close_window(ncclEpGroup* g);

// group.cc
// The group's device-side error (the kernels' word, else the watchdog's stop word), or
// ncclSuccess. Non-blocking.
ncclResult_t check_group_errors(ncclEpGroup* g);
// The handle-creation barrier; `call` is its call_signature().
ncclResult_t barrier(ncclEpGroup* g, unsigned call, cudaStream_t stream);
// What every op's kernel arguments take from the group (kernels/api.cuh GroupArgs).
GroupArgs group_args(const ncclEpGroup* g);

// The gate of g's local team; null for any other group.
inline TeamGate* team_gate(const ncclEpGroup* g) {
  return g->team != nullptr ? g->team->gate.get() : nullptr;
}

// A collective call of group g: `body` (its checks and launches) between the two meetings of a
// local team's gate (team_gate.h); on any other group, `body` alone. `call` names it in errors.
// The C entry points (ops.cc, handle.cc) wrap every collective call, HT and LL, in it.
template <class Body>
ncclResult_t gated_call(ncclEpGroup* g, const char* call, Body&& body) {
  TeamGate* gate = team_gate(g);
  if (gate == nullptr) return body();
  EP_RETURN_IF(gate->meet(g->rank, call, g->cfg.timeout_ms, false, false));
  const ncclResult_t res = body();
  // Whatever the body did, this member leaves with the others. If it failed before enqueuing,
  // its peers' kernels time out on the device naming it, as across processes.
  const ncclResult_t left = gate->meet(g->rank, call, g->cfg.timeout_ms, true, res != ncclSuccess);
  return res != ncclSuccess ? res : left;
}

// handle.cc
ncclResult_t check_op_config(const ncclEpOpConfig_t* config, const char* fn);
// ncclInvalidUsage for a handle of an LL group given to an HT-only call.
ncclResult_t check_ht_handle(const ncclEpHandle* h, const char* fn);
// Exact mode: waits for the handle's layout readback (once) and returns its result.
ncclResult_t read_layout(ncclEpHandle* h);
// What handle h's ops check their tensors against (call_checks.h, which its callers include).
CallShape call_shape(const ncclEpHandle* h);

// ll.cc: the LL mode (docs/design.md section 9) behind the public entry points.
ncclResult_t ll_create_handle(ncclEpHandle* h, const ncclEpTensor_t* routing, cudaStream_t stream);
ncclResult_t ll_dispatch(ncclEpHandle* h, const ncclEpDispatchInputs_t* inputs,
                         ncclEpDispatchOutputs_t* outputs, const ncclEpOpConfig_t* config,
                         cudaStream_t stream);
ncclResult_t ll_combine(ncclEpHandle* h, const ncclEpCombineInputs_t* inputs,
                        ncclEpCombineOutputs_t* outputs, const ncclEpOpConfig_t* config,
                        cudaStream_t stream);
ncclResult_t ll_complete(ncclEpHandle* h, cudaStream_t stream);
// Forgets a destroyed handle's pending op (caller holds g->mu).
void ll_forget(ncclEpHandle* h);
inline bool is_ll(const ncclEpGroup* g) { return is_ll(g->cfg); }

// error_words.cc
// Formats a device error word into the thread-local message and returns its ncclResult_t.
ncclResult_t report_error(const ncclEpGroup* g, const ErrorInfo& e, const LayoutMeta* meta);

}  // namespace nccl_ep
