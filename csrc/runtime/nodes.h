/*
 * nodes.h: what group.cc, handle.cc and ops.cc call of the path between nodes (nodes.cc), for
 * groups of G ranks per node < R ranks; and the one engine driver nodes.cc calls back (ops.cc).
 * Those of group destroy run for every group (nothing to do on one node); the others only for a
 * group that spans nodes (num_nodes > 1).
 */
#pragma once

#include <stddef.h>

#include <string>

#include "../include/nccl_ep.h"
#include "../kernels/api.cuh"
#include "errors.h"

struct ncclEpGroup;
struct ncclEpHandle;

namespace nccl_ep {

// An error kept for later: a group that spans nodes still makes an op's NCCL calls after a
// device-side error (its rail peers would wait for them forever) and returns it afterwards.
struct DeferredError {
  ncclResult_t res = ncclSuccess;
  std::string message;
  void take(ncclResult_t r) {
    if (r != ncclSuccess && res == ncclSuccess) {
      res = r;
      message = ncclEpGetLastError();
    }
  }
  // The kept error (its message restored), else ncclSuccess.
  ncclResult_t result() const {
    if (res != ncclSuccess) set_error("%s", message.c_str());
    return res;
  }
};

// Group creation, in this order (group.cc):
// The node, rail and op communicators split from the caller's comm (collective), and the rail
// buffers; a failed allocation or a node that is not one LSA team fails every rank together.
ncclResult_t split_nodes(ncclEpGroup* g, cudaStream_t stream);
// After a step that may fail on some ranks only (`mine`: this rank's result): every rank returns
// an error when one rank failed (collective over comm).
ncclResult_t fail_together(ncclEpGroup* g, ncclResult_t mine, const char* step,
                           cudaStream_t stream);
// The watchdog started, the rail and the routing all-gather connected (synchronizes the stream).
ncclResult_t connect_nodes(ncclEpGroup* g, cudaStream_t stream);

// Group destroy (also for a one-node group: nothing to do there):
void stop_watchdog(ncclEpGroup* g);  // first: its thread may abort the communicators
// The communicators split at creation (aborted when `failed` or in asynchronous error) and the
// rail buffers.
void release_nodes(ncclEpGroup* g, bool failed);
size_t rail_buffer_bytes(const ncclEpGroup* g);  // ncclEpGroupGetInfo (0 on one node)

// Handle creation: every rank's record into records[R][rec_ints] over op_comm, as a step of the
// watchdog.
ncclResult_t gather_routing(ncclEpGroup* g, const int* own_record, int* records,
                            cudaStream_t stream);
// Waits on the host for `ready`, an event behind the routing all-gather; ends with the group's
// error timeout_ms after the watchdog stopped the communicators, at the latest.
ncclResult_t wait_behind_gather(ncclEpGroup* g, cudaEvent_t ready);
bool nodes_stopped(ncclEpGroup* g);  // the watchdog stopped the communicators

// The ops between nodes: the engine once per node of sources, with the rail around it. `a` is
// the op as ops.cc checked and filled it for one node.
ncclResult_t dispatch_nodes(ncclEpHandle* h, DispatchArgs a, bool with_probs,
                            cudaStream_t stream);
ncclResult_t combine_nodes(ncclEpHandle* h, const CombineArgs& a, cudaStream_t stream);
ncclResult_t combine_probs_nodes(ncclEpHandle* h, const CombineProbsArgs& a, cudaStream_t stream);

// ops.cc: the engine's arguments for one op of handle h over this rank's node (everything but
// the op's tensors), for the sources of node `pass` (groups that span nodes; 0 on one node).
ExchangeArgs exchange_args(const ncclEpHandle* h, OpKind op, int prob_bytes, bool vec,
                           int pass = 0);

}  // namespace nccl_ep
