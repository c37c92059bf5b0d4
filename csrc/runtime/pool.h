/*
 * pool.h: device memory through the user's callbacks, and the per-group pool of handle slots
 * (pool.cc).
 *
 * NOTES:
 *  - Handle buffers come from a per-group pool of equal-sized slots (allocated once through
 *    alloc_fn/cudaMalloc, reused by later handles, freed at group destroy), so creating and
 *    destroying handles never calls cudaMalloc/cudaFree in steady state. A slot returned by
 *    ncclEpHandleDestroy is reused by the next handle in stream order: handles of one group must
 *    be used on one stream (or the caller orders the streams).
 *  - The pool's functions that take or return slots run under the group's mutex (g->mu).
 *  - A slot that CUDA graphs replay into (its handle was created during a capture) belongs to
 *    them too: it returns to the pool when its handle and those graphs are all destroyed, so no
 *    later handle, eager or captured, writes the buffers a graph replays.
 */
#pragma once

#include <stddef.h>

#include <mutex>
#include <vector>

#include "../include/nccl_ep.h"
#include "../kernels/api.cuh"
#include "buffer_plan.h"

struct ncclEpGroup;

namespace nccl_ep {

// One handle's device buffers (a pool slot) and its host readback.
struct HandleSlot {
  void* base = nullptr;          // one device allocation for every view below
  View<int> own_routing;         // [Tmax * Kmax] this rank's expert ids (the caller's)
  View<int> kept_routing;        // expert_capacity: the same with dropped slots -1, what the
                                 // ops follow ([Tmax * Kmax]; empty without expert_capacity)
  View<int> recv_row;            // [R * Tmax * Kmax]
  View<int> src_of_row;          // [src_rows]
  View<int> cnt, off;            // [R * L]
  View<int> tile_cnt;            // [R][layout_tiles][L]
  View<int> hist;                // [E]
  View<unsigned long long> err_key;
  View<unsigned> blocks_done;    // validate's finished blocks
  View<LayoutMeta> meta;         // LayoutMeta with its [L] tokens_per_expert tail
  View<int> records;             // groups that span nodes: [R][rec_ints], the all-gathered
                                 // routing records (one node: they sit in the window)
  // Groups that span nodes (the layout's rail kernel, LayoutArgs): packed rows of this rank's
  // tokens per node [N][Tmax] and of the tokens the rail brings from each node [N][Tmax], every
  // pair's count [R][N], the kernel's finished blocks.
  View<int> rail_out, rail_in, rail_counts;
  View<unsigned> rail_done;
  LayoutMeta* host_meta = nullptr;  // pinned, mapped: the exact-mode readback
  LayoutMeta* host_meta_dev = nullptr;  // its device address (the bases write it)
  cudaEvent_t meta_ready = nullptr; // recorded after the bases (validate_kernel)
  // LL groups: the handle's views instead of the HT ones above (kernels/api.cuh).
  View<int> ll_ids, ll_pos, ll_jslot, ll_dpos, ll_ndst, ll_own_dpos, ll_cnt, ll_ndest, ll_rn,
      ll_rtok, ll_rrow, ll_rdpos, ll_roff, ll_own_row;
  View<unsigned long long> ll_epochs;
  View<float> ll_weights;

  // CUDA graphs that replay work on this slot (captured with its handle's creation or ops),
  // whether its handle was destroyed while some did (the slot returns to the pool when both are
  // gone), and the last capture that took a reference (one per capture). GraphSlotOwner::mu.
  int graph_refs = 0;
  bool handle_gone = false;
  unsigned long long capture_id = 0;

  // This rank's routing as the ops follow it (its dropped slots masked under expert_capacity).
  int* op_routing() const { return kept_routing.count > 0 ? kept_routing.ptr : own_routing.ptr; }
};

// What the graphs' references to a group's slots share. A graph's destructor (CUDA may run it on
// its own thread) takes only this mutex, never the group's: a slot whose last reference goes
// waits in `returned` until the group's next acquire. Lock order: g->mu, then mu.
struct GraphSlotOwner {
  std::mutex mu;                      // guards these fields and every slot's graph fields
  bool group_alive = true;            // false from group destroy on (it frees every slot)
  std::vector<HandleSlot*> returned;  // back to the pool at the next acquire_slot
};

// Device memory of the group: alloc_fn/free_fn when given (alloc_fn's must be 256-byte
// aligned: checked), else cudaMalloc/cudaFree. 0 bytes allocate 16.
ncclResult_t alloc_device(ncclEpGroup* g, void** ptr, size_t bytes);
void free_device(ncclEpGroup* g, void* ptr);
// A free slot of the pool, or a new one.
ncclResult_t acquire_slot(ncclEpGroup* g, HandleSlot** out);
// Makes sure the next acquire_slot allocates nothing (a free slot exists). Caller holds g->mu.
ncclResult_t reserve_slot(ncclEpGroup* g);
// Back to the pool, or (a graph still replays work on it) once the last such graph is destroyed.
// Caller holds g->mu.
void release_slot(ncclEpGroup* g, HandleSlot* slot);
// When `stream` is capturing a CUDA graph: the graph keeps `slot` out of the pool until the graph
// (and every executable made from it) is destroyed, through a CUDA user object whose destructor
// gives the slot back; once per capture. Call it before launching anything on the slot. Caller
// does not hold g->mu. Nothing to do outside a capture.
ncclResult_t retain_slot_for_graph(ncclEpGroup* g, HandleSlot* slot, cudaStream_t stream);
// Group destroy: graphs destroyed from now on leave the group's slots alone.
void forget_graph_slots(ncclEpGroup* g);
void free_slots(ncclEpGroup* g);  // every slot of the group (group destroy)
size_t slot_device_bytes(const ncclEpGroup* g);

}  // namespace nccl_ep
