/*
 * window.cc: the symmetric window of an NCCL group: allocation, registration, zeroing, the check
 * that every rank got a real one, and the peer pointers the kernels use.
 *
 * NOTES:
 *  - Order matters for collectives: ncclMemAlloc + ncclCommWindowRegister (collective); zero the
 *    window, then an all-gather (which also tells every rank whether every rank got a window), so
 *    that no rank writes into a peer's window before that peer zeroed it; then resolve the peer
 *    pointers with a one-thread-per-peer kernel over ncclGetPeerPointer (device API, the same in
 *    NCCL 2.28 and 2.30).
 *  - NCCL may register no window (and say success) when symmetric memory is unavailable
 *    (NCCL_CUMEM_ENABLE=0, no P2P), or hand back pointers that are not device memory: both are
 *    refused on every rank with the reason, before any kernel touches them.
 *  - peers[rank] is this rank's buffer in NCCL's flat LSA mapping, an alias of win_buf at another
 *    virtual address; kernels use peers[] only.
 *  - The window spans the node (node_comm, its node_size ranks, indexed by node_rank): the whole
 *    group on one node.
 */
#include "internal.h"
#include "pool.h"

namespace nccl_ep {

namespace {

// True when p is device memory (of any device): what a window and its peer mappings must be.
bool is_device_memory(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // a failed query leaves a (non-sticky) error behind: clear it
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

}  // namespace

ncclResult_t open_nccl_window(ncclEpGroup* g, cudaStream_t stream) {
  const int R = g->node_size, me = g->node_rank;
  const int base = g->node * g->node_size;  // messages name ranks of the group
  EP_NCCL(ncclMemAlloc(&g->win_buf, g->win.bytes));
  EP_NCCL(ncclCommWindowRegister(g->node_comm, g->win_buf, g->win.bytes, &g->nccl_win,
                                 NCCL_WIN_COLL_SYMMETRIC));
  EP_CUDA(cudaMemsetAsync(g->win_buf, 0, g->win.bytes, stream));
  std::vector<int> window_ok(R);
  // The handle is a device pointer to NCCL's window descriptor (read by ncclGetPeerPointer).
  const int mine_ok = g->nccl_win != nullptr && is_device_memory(g->nccl_win);
  EP_RETURN_IF(host_all_gather(g->node_comm, R, me, &mine_ok, sizeof(mine_ok), window_ok.data(),
                               stream));
  for (int r = 0; r < R; ++r) {
    EP_CHECK(window_ok[r], ncclInvalidUsage,
             "NCCL registered no usable symmetric memory window on rank %d (symmetric memory is "
             "unavailable there: NCCL_CUMEM_ENABLE=0, NCCL_WIN_ENABLE=0 or no GPU peer access); "
             "the nccl_ep CUDA backend needs it between the ranks of a node (ranks_per_node=1: "
             "every transfer over NCCL send/receive instead)",
             base + r);
  }
  EP_RETURN_IF(alloc_device(g, reinterpret_cast<void**>(&g->d_peers), sizeof(void*) * R));
  g->peers.assign(R, nullptr);
  EP_CUDA(launch_resolve_peers(g->nccl_win, R, g->d_peers, stream));
  EP_CUDA(cudaMemcpyAsync(g->peers.data(), g->d_peers, sizeof(void*) * R, cudaMemcpyDeviceToHost,
                          stream));
  EP_CUDA(cudaStreamSynchronize(stream));
  // Every rank checks its own view of every peer, then the verdicts are shared, so that all
  // ranks fail together.
  std::vector<int> mapped(R), all_mapped((size_t)R * R);
  for (int r = 0; r < R; ++r) mapped[r] = g->peers[r] != nullptr && is_device_memory(g->peers[r]);
  EP_RETURN_IF(host_all_gather(g->node_comm, R, me, mapped.data(), sizeof(int) * R,
                               all_mapped.data(), stream));
  for (int a = 0; a < R; ++a) {
    for (int r = 0; r < R; ++r) {
      EP_CHECK(all_mapped[(size_t)a * R + r], ncclInvalidUsage,
               "rank %d cannot reach rank %d's symmetric window as device memory (NCCL returned "
               "%s pointer: symmetric memory is unavailable, e.g. NCCL_CUMEM_ENABLE=0 on NCCL "
               "2.28); the nccl_ep CUDA backend needs NVLink load/store access between the ranks "
               "of a node (ranks_per_node=1: every transfer over NCCL send/receive instead)",
               base + a, base + r, a == me && g->peers[r] == nullptr ? "no" : "a non-device");
    }
  }
  return ncclSuccess;
}

void close_window(ncclEpGroup* g) {
  if (g->nccl_win != nullptr) ncclCommWindowDeregister(g->node_comm, g->nccl_win);
  g->nccl_win = nullptr;
  if (g->win_buf != nullptr && g->team == nullptr) ncclMemFree(g->win_buf);
  g->win_buf = nullptr;
  if (g->d_peers != nullptr) free_device(g, g->d_peers);
  g->d_peers = nullptr;
}

LocalTeam::~LocalTeam() {
  for (void* w : windows) {
    if (w == nullptr) continue;
    if (free_fn != nullptr) {
      free_fn(w, alloc_ctx);
    } else {
      cudaFree(w);
    }
  }
}

}  // namespace nccl_ep
