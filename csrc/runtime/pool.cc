/*
 * pool.cc: device memory through the user's callbacks, and the per-group pool of handle slots.
 *
 * NOTES:
 *  - A slot is one device allocation laid out by a BufferPlan (typed views, no hand-computed
 *    offsets), plus a pinned host LayoutMeta and an event for the exact-mode readback. Slots are
 *    made on demand and reused; group destroy frees them all.
 *  - Nothing in a slot needs clearing between handles: the pack and layout kernels reset what
 *    they read (layout.cu).
 */
#include <cstdint>
#include <memory>

#include "internal.h"
#include "pool.h"

namespace nccl_ep {

namespace {

// An LL handle's views (LLHandleViews, kernels/api.cuh).
size_t plan_ll_slot(const ncclEpGroup* g, HandleSlot* s, void* base) {
  const size_t R = g->nranks, E = g->cfg.num_experts;
  const size_t Tm = (size_t)g->cfg.max_tokens_per_rank, Km = (size_t)g->cfg.max_topk;
  BufferPlan plan;
  for (View<int>* v : {&s->ll_ids, &s->ll_pos, &s->ll_jslot, &s->ll_dpos, &s->ll_own_row})
    plan.add(v, Tm * Km);
  plan.add(&s->ll_ndst, Tm);
  plan.add(&s->ll_own_dpos, Tm);
  plan.add(&s->ll_cnt, E);
  plan.add(&s->ll_ndest, R);
  plan.add(&s->ll_rn, R);
  plan.add(&s->ll_rtok, R * Tm);
  plan.add(&s->ll_rrow, g->cfg.layout == ncclEpLayoutExpertMajor ? R * Tm * Km : 0);
  plan.add(&s->ll_rdpos, g->cfg.layout == ncclEpLayoutRankMajor ? R * Tm : 0);
  plan.add(&s->ll_roff, R + 1);
  plan.add(&s->ll_epochs, 2);
  plan.add(&s->ll_weights, g->cfg.layout == ncclEpLayoutExpertMajor ? Tm * Km : 0);
  if (base != nullptr) plan.bind(base);
  return plan.bytes();
}

// The slot's views for this group's sizes; base == nullptr only sizes them.
size_t plan_slot(const ncclEpGroup* g, HandleSlot* s, void* base) {
  if (g->cfg.mode == ncclEpModeLowLatency) return plan_ll_slot(g, s, base);
  const int R = g->nranks, L = g->num_local;
  const size_t Tm = (size_t)g->cfg.max_tokens_per_rank, Km = (size_t)g->cfg.max_topk;
  BufferPlan plan;
  plan.add(&s->own_routing, Tm * Km);
  plan.add(&s->kept_routing, g->block_rows > 0 ? Tm * Km : 0);
  plan.add(&s->recv_row, (size_t)R * Tm * Km);
  plan.add(&s->src_of_row, (size_t)g->src_rows);
  plan.add(&s->cnt, (size_t)R * L);
  plan.add(&s->off, (size_t)R * L);
  plan.add(&s->tile_cnt, (size_t)R * layout_tiles((long long)Tm, (int)Km) * L);
  plan.add(&s->hist, (size_t)g->cfg.num_experts);
  plan.add(&s->err_key, 1);
  plan.add(&s->blocks_done, 1);
  plan.add_bytes(&s->meta, layout_meta_bytes(L));
  plan.add(&s->records, g->num_nodes > 1 ? (size_t)R * g->win.rec_ints : 0);
  const size_t N = g->num_nodes > 1 ? (size_t)g->num_nodes : 0;
  plan.add(&s->rail_out, N * Tm);
  plan.add(&s->rail_in, N * Tm);
  plan.add(&s->rail_counts, (size_t)R * N);
  plan.add(&s->rail_done, N > 0 ? 1 : 0);
  if (base != nullptr) plan.bind(base);
  return plan.bytes();
}

void delete_slot(ncclEpGroup* g, HandleSlot* s) {
  free_device(g, s->base);
  if (s->host_meta != nullptr) cudaFreeHost(s->host_meta);
  if (s->meta_ready != nullptr) cudaEventDestroy(s->meta_ready);
  delete s;
}

}  // namespace

ncclResult_t alloc_device(ncclEpGroup* g, void** ptr, size_t bytes) {
  *ptr = nullptr;
  if (bytes == 0) bytes = 16;
  if (g->cfg.alloc_fn != nullptr) {
    EP_CHECK(g->cfg.alloc_fn(ptr, bytes, g->cfg.alloc_ctx) == 0 && *ptr != nullptr,
             ncclSystemError, "alloc_fn failed to allocate %zu bytes", bytes);
    // The buffers' views start at multiples of 256 bytes from the allocation (BufferPlan),
    // and the kernels read and write them in 16-byte vectors.
    if (reinterpret_cast<uintptr_t>(*ptr) % 256 != 0) {
      void* bad = *ptr;
      *ptr = nullptr;
      g->cfg.free_fn(bad, g->cfg.alloc_ctx);
      EP_CHECK(false, ncclInvalidArgument,
               "alloc_fn returned %p for %zu bytes: it must return 256-byte aligned memory (as "
               "cudaMalloc does)",
               bad, bytes);
    }
    return ncclSuccess;
  }
  // A handle created inside a stream capture (a CUDA graph of decode steps) may grow the pool:
  // relaxed mode lets cudaMalloc run then, as PyTorch's caching allocator does.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  EP_CUDA(cudaThreadExchangeStreamCaptureMode(&mode));
  const cudaError_t ce = cudaMalloc(ptr, bytes);
  cudaThreadExchangeStreamCaptureMode(&mode);
  EP_CUDA(ce);
  return ncclSuccess;
}

void free_device(ncclEpGroup* g, void* ptr) {
  if (ptr == nullptr) return;
  if (g->cfg.free_fn != nullptr) {
    g->cfg.free_fn(ptr, g->cfg.alloc_ctx);
  } else {
    cudaFree(ptr);
  }
}

size_t slot_device_bytes(const ncclEpGroup* g) {
  HandleSlot probe;
  return plan_slot(g, &probe, nullptr);
}

namespace {

// Slots whose last graph went (release_graph_ref) back into the pool. Caller holds g->mu.
void take_returned(ncclEpGroup* g) {
  if (g->graph_owner == nullptr) return;
  std::lock_guard<std::mutex> lock(g->graph_owner->mu);
  for (HandleSlot* s : g->graph_owner->returned) g->free_slots.push_back(s);
  g->graph_owner->returned.clear();
}

}  // namespace

ncclResult_t acquire_slot(ncclEpGroup* g, HandleSlot** out) {
  take_returned(g);
  if (!g->free_slots.empty()) {
    *out = g->free_slots.back();
    g->free_slots.pop_back();
    return ncclSuccess;
  }
  HandleSlot* s = new HandleSlot();
  const size_t bytes = plan_slot(g, s, nullptr);
  ncclResult_t res = alloc_device(g, &s->base, bytes);
  if (res == ncclSuccess && g->cfg.mode == ncclEpModeLowLatency) {
    plan_slot(g, s, s->base);  // LL reads nothing back to the host
  } else if (res == ncclSuccess) {
    plan_slot(g, s, s->base);
    // Relaxed capture mode, as for cudaMalloc (alloc_device): a handle made during a capture.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaError_t ce = cudaThreadExchangeStreamCaptureMode(&mode);
    if (ce == cudaSuccess) {
      ce = cudaHostAlloc(reinterpret_cast<void**>(&s->host_meta), layout_meta_bytes(g->num_local),
                         cudaHostAllocMapped);
      cudaThreadExchangeStreamCaptureMode(&mode);
    }
    if (ce == cudaSuccess)
      ce = cudaHostGetDevicePointer(reinterpret_cast<void**>(&s->host_meta_dev), s->host_meta, 0);
    if (ce == cudaSuccess) ce = cudaEventCreateWithFlags(&s->meta_ready, cudaEventDisableTiming);
    if (ce != cudaSuccess) {
      set_error("allocating a handle's readback buffer failed: %s", cudaGetErrorString(ce));
      res = ncclUnhandledCudaError;
    }
  }
  if (res != ncclSuccess) {
    delete_slot(g, s);
    return res;
  }
  g->all_slots.push_back(s);
  *out = s;
  return ncclSuccess;
}

ncclResult_t reserve_slot(ncclEpGroup* g) {
  take_returned(g);
  if (!g->free_slots.empty()) return ncclSuccess;
  HandleSlot* s = nullptr;
  EP_RETURN_IF(acquire_slot(g, &s));
  release_slot(g, s);
  return ncclSuccess;
}

void release_slot(ncclEpGroup* g, HandleSlot* slot) {
  if (slot == nullptr) return;
  if (g->graph_owner != nullptr) {
    std::lock_guard<std::mutex> lock(g->graph_owner->mu);
    if (slot->graph_refs > 0) {
      slot->handle_gone = true;  // the last graph's destructor gives it back
      return;
    }
  }
  g->free_slots.push_back(slot);
}

namespace {

struct GraphSlotRef {
  std::shared_ptr<GraphSlotOwner> owner;
  HandleSlot* slot;
};

// One graph reference fewer (caller holds owner.mu).
void drop_graph_ref(GraphSlotOwner& owner, HandleSlot* s) {
  if (--s->graph_refs == 0 && s->handle_gone) {
    s->handle_gone = false;
    owner.returned.push_back(s);
  }
}

// A graph's reference is gone: CUDA calls this when the graph and its executables are destroyed
// and their launches have finished, maybe on its own thread; it may call no CUDA API.
void release_graph_ref(void* p) {
  std::unique_ptr<GraphSlotRef> ref(static_cast<GraphSlotRef*>(p));
  std::lock_guard<std::mutex> lock(ref->owner->mu);
  if (ref->owner->group_alive) drop_graph_ref(*ref->owner, ref->slot);
}

}  // namespace

ncclResult_t retain_slot_for_graph(ncclEpGroup* g, HandleSlot* slot, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  cudaGraph_t graph = nullptr;
  EP_CUDA(cudaStreamGetCaptureInfo(stream, &capture, &id, &graph));
  if (capture != cudaStreamCaptureStatusActive) return ncclSuccess;
  std::shared_ptr<GraphSlotOwner> owner;
  {
    std::lock_guard<std::mutex> lock(g->mu);
    if (g->graph_owner == nullptr) g->graph_owner = std::make_shared<GraphSlotOwner>();
    owner = g->graph_owner;
  }
  {
    std::lock_guard<std::mutex> lock(owner->mu);
    if (slot->capture_id == id) return ncclSuccess;  // this capture holds it already
    slot->capture_id = id;
    ++slot->graph_refs;
  }
  auto* ref = new GraphSlotRef{owner, slot};
  cudaUserObject_t object = nullptr;
  cudaError_t ce =
      cudaUserObjectCreate(&object, ref, release_graph_ref, 1, cudaUserObjectNoDestructorSync);
  if (ce == cudaSuccess) {
    ce = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
    if (ce == cudaSuccess) return ncclSuccess;
    cudaUserObjectRelease(object, 1);  // its destructor (now or later) drops the count
  } else {
    delete ref;
    std::lock_guard<std::mutex> lock(owner->mu);
    drop_graph_ref(*owner, slot);
  }
  {
    std::lock_guard<std::mutex> lock(owner->mu);
    slot->capture_id = 0;
  }
  EP_CUDA(ce);
  return ncclSuccess;
}

void forget_graph_slots(ncclEpGroup* g) {
  std::shared_ptr<GraphSlotOwner> owner;
  {
    std::lock_guard<std::mutex> lock(g->mu);
    owner = g->graph_owner;
  }
  if (owner == nullptr) return;
  std::lock_guard<std::mutex> lock(owner->mu);
  owner->group_alive = false;
  owner->returned.clear();
}

void free_slots(ncclEpGroup* g) {
  for (HandleSlot* s : g->all_slots) delete_slot(g, s);
  g->all_slots.clear();
  g->free_slots.clear();
}

}  // namespace nccl_ep
