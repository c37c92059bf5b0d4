/*
 * group.cc: group lifecycle: ncclEpCreateGroup (over an NCCL communicator), ncclEpCreateLocalTeam
 * (every rank in this process), ncclEpGroupDestroy, ncclEpGroupCheckErrors, ncclEpGroupGetInfo,
 * and the handle-creation barrier.
 *
 * NOTES:
 *  - Creation order over NCCL: (1) the config checks and the all-gathered agreement on it (plus
 *    LSA team size, the resolved ranks per node and NCCL version), so every rank fails the same
 *    way before anything else collective happens; (2) groups that span nodes: the node, rail and
 *    op communicators (ncclCommSplit) and the rail buffers (nodes.cc, split_nodes); (3) the
 *    window over the node (window.cc); (4) groups that span nodes: the watchdog started, the rail
 *    and op_comm connected (nodes.cc, connect_nodes). The error word and device state come with
 *    the config checks.
 *  - A local team runs the same kernels over windows that are plain device allocations of this
 *    process; no NCCL call is made.
 *  - The device code reads NCCL's ncclWindow_vidmem layout through the headers it was compiled
 *    against, so the runtime NCCL must have the same major.minor as the headers (checked).
 */
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "internal.h"
#include "nodes.h"
#include "pool.h"
#include "watchdog.h"  // a group owns its watchdog: creating and deleting one needs it whole

namespace nccl_ep {

namespace {

void destroy_group_state(ncclEpGroup* g) {
  if (g == nullptr) return;
  // The watchdog's thread first: it may abort (and free) the communicators below.
  debug_log("rank %d: group destroy: stopping the watchdog", g->rank);
  stop_watchdog(g);
  forget_graph_slots(g);  // graphs that outlive the group give nothing back
  {
    std::lock_guard<std::mutex> lock(g->mu);
    for (ncclEpHandle* h : g->live) delete h;
    g->live.clear();
    free_slots(g);
  }
  close_window(g);
  const bool failed = g->h_err != nullptr && (__atomic_load_n(&g->h_err->code, __ATOMIC_ACQUIRE) ||
                                              __atomic_load_n(&g->h_stop->code, __ATOMIC_ACQUIRE));
  release_nodes(g, failed);
  if (g->d_state != nullptr) free_device(g, g->d_state);
  if (g->h_err != nullptr) cudaFreeHost(g->h_err);
  delete g;
}

// Handle slots made at group creation, so that the first handles allocate nothing: a device or
// pinned allocation may wait for the whole device, which a local team's peer may keep busy.
constexpr int kPreallocatedSlots = 4;

ncclResult_t preallocate_slots(ncclEpGroup* g) {
  std::lock_guard<std::mutex> lock(g->mu);
  std::vector<HandleSlot*> made;
  for (int i = 0; i < kPreallocatedSlots; ++i) {
    HandleSlot* s = nullptr;
    EP_RETURN_IF(acquire_slot(g, &s));
    made.push_back(s);
  }
  for (HandleSlot* s : made) release_slot(g, s);
  return ncclSuccess;
}

// The op kernels wait for their peers' CTAs: every CTA of every rank on this GPU (a local team
// puts `ranks_here` ranks on it) must be resident at once, one per SM.
ncclResult_t check_residency(const ncclEpGroupConfig_t& c, int ranks_here) {
  int device = 0, sms = 0;
  EP_CUDA(cudaGetDevice(&device));
  EP_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int channels = default_channels(c);
  EP_CHECK((long long)channels * ranks_here <= sms, ncclInvalidArgument,
           "num_sms=%d x %d rank(s) on this GPU needs %lld CTAs resident at once, but the GPU "
           "has %d SMs; lower num_sms%s",
           channels, ranks_here, (long long)channels * ranks_here, sms,
           ranks_here > 1 ? " or the team size" : "");
  return ncclSuccess;
}

// Everything a group needs besides its window: checked config, sizes, error word, state.
// node_size: its ranks per node (G); ranks_here: the ranks of the group on this GPU (1, or the
// size of a local team).
// The sizes a checked config implies for rank `rank` (nothing allocated).
void size_group(ncclEpGroup* g, const ncclEpGroupConfig_t* config, int nranks, int rank,
                int node_size) {
  g->cfg = *config;
  const ncclEpGroupConfig_t& c = g->cfg;
  g->nranks = nranks;
  g->rank = rank;
  g->node_size = node_size;
  g->node = rank / node_size;
  g->node_rank = rank % node_size;
  g->num_nodes = nranks / node_size;
  g->num_local = c.num_experts / nranks;
  g->row_bytes = (size_t)c.hidden * dtype_bytes(c.token_dtype);
  g->capacity = is_capacity_mode(c) ? (long long)c.max_recv_tokens_per_rank : -1;
  g->drops_overflow = c.recv_count_mode == ncclEpRecvCountCapacityDrop;
  const long long bound = (long long)nranks * c.max_tokens_per_rank *
                              std::min(c.max_topk, g->num_local) +
                          (long long)g->num_local * (c.expert_alignment - 1);
  g->src_rows = g->capacity >= 0 ? std::min(bound, g->capacity) : bound;
  if (c.expert_capacity > 0) {  // every row of the fixed layout, filled or zero
    g->block_rows = expert_block_rows(c, nranks);
    g->src_rows = g->block_rows * g->num_local;
  }
  g->win = plan_window(c, node_size);
}

ncclResult_t init_group(ncclEpGroup* g, const ncclEpGroupConfig_t* config, int nranks, int rank,
                        int node_size, int ranks_here, cudaStream_t stream) {
  EP_RETURN_IF(check_config(config, nranks, node_size));
  EP_RETURN_IF(check_residency(*config, ranks_here));
  size_group(g, config, nranks, rank, node_size);
  EP_CUDA(cudaGetDevice(&g->device));
  EP_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&g->h_err), 2 * sizeof(ErrorInfo),
                        cudaHostAllocMapped));
  memset(g->h_err, 0, 2 * sizeof(ErrorInfo));
  EP_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&g->d_err), g->h_err, 0));
  g->h_stop = g->h_err + 1;
  g->d_stop = g->d_err + 1;
  EP_RETURN_IF(alloc_device(g, reinterpret_cast<void**>(&g->d_state), sizeof(DeviceState)));
  EP_CUDA(cudaMemsetAsync(g->d_state, 0, sizeof(DeviceState), stream));
  // Every kernel loaded and granted its staging on this device now, not at its first launch:
  // under lazy module loading a first launch may wait for the device (a local team's peer may
  // be spinning in an op kernel), and the ops' launches then make no attribute calls.
  cudaError_t ce = preload_layout();
  if (ce == cudaSuccess) ce = preload_barrier();
  if (ce == cudaSuccess) ce = preload_dispatch();
  if (ce == cudaSuccess) ce = preload_combine();
  if (ce == cudaSuccess) ce = preload_ll();
  EP_CHECK(ce == cudaSuccess, ncclUnhandledCudaError,
           "ncclEpCreateGroup: loading the kernels failed: %s", cudaGetErrorString(ce));
  return preallocate_slots(g);
}

// The window of a node of one rank: a plain device buffer (no peer to map; no NCCL symmetric
// registration, which some NCCL versions skip or refuse on a single-rank communicator).
ncclResult_t open_single_window(ncclEpGroup* g, cudaStream_t stream) {
  auto team = std::make_shared<LocalTeam>();
  team->alloc_fn = g->cfg.alloc_fn;
  team->free_fn = g->cfg.free_fn;
  team->alloc_ctx = g->cfg.alloc_ctx;
  team->windows.assign(1, nullptr);
  EP_RETURN_IF(alloc_device(g, &team->windows[0], g->win.bytes));
  g->team = team;
  g->win_buf = team->windows[0];
  g->peers.assign(1, g->win_buf);
  EP_CUDA(cudaMemsetAsync(g->win_buf, 0, g->win.bytes, stream));
  EP_RETURN_IF(alloc_device(g, reinterpret_cast<void**>(&g->d_peers), sizeof(void*)));
  EP_CUDA(cudaMemcpyAsync(g->d_peers, g->peers.data(), sizeof(void*), cudaMemcpyHostToDevice,
                          stream));
  return ncclSuccess;
}

// The window over this rank's node: a plain device buffer for a node of one rank, else NCCL's
// symmetric window over node_comm.
ncclResult_t open_node_window(ncclEpGroup* g, cudaStream_t stream) {
  return g->node_size == 1 ? open_single_window(g, stream) : open_nccl_window(g, stream);
}

ncclResult_t create_nccl_group(ncclEpGroup* g, ncclComm_t comm, const ncclEpGroupConfig_t* config,
                               cudaStream_t stream) {
  g->comm = comm;
  int nranks = 0, rank = 0;
  EP_NCCL(ncclCommCount(comm, &nranks));
  EP_NCCL(ncclCommUserRank(comm, &rank));
  EP_RETURN_IF(check_config_version(config));
  const int lsa = lsa_team_size(comm);
  // Ranks per node: as asked (checked with the config), or the LSA team. An LSA team that does
  // not divide the group is refused by the agreement below, on every rank together.
  int node_size = config->ranks_per_node > 0 ? config->ranks_per_node : lsa;
  if (config->ranks_per_node == 0 && (lsa < 1 || nranks % lsa != 0)) node_size = nranks;
  EP_RETURN_IF(init_group(g, config, nranks, rank, node_size, 1, stream));
  int runtime_version = 0;
  EP_NCCL(ncclGetVersion(&runtime_version));
  EP_CHECK(runtime_version / 100 == NCCL_VERSION_CODE / 100, ncclInvalidUsage,
           "ncclEpCreateGroup: built against NCCL %d but the process loaded NCCL %d: the device "
           "API structures differ across minor versions; rebuild against the loaded NCCL",
           NCCL_VERSION_CODE, runtime_version);
  EP_RETURN_IF(agree_config(g, lsa, runtime_version, stream));
  g->node_comm = comm;
  if (g->num_nodes == 1) {
    EP_RETURN_IF(open_node_window(g, stream));
  } else {
    EP_RETURN_IF(split_nodes(g, stream));
    EP_RETURN_IF(fail_together(g, open_node_window(g, stream), "its node's window", stream));
    EP_RETURN_IF(connect_nodes(g, stream));
  }
  EP_CUDA(cudaStreamSynchronize(stream));
  return ncclSuccess;
}

}  // namespace

// NOTES: a device-side error is sticky. After it, ranks may have run different numbers of
// waits (some returned early, some waited), so the epochs no longer agree and the group can
// never synchronize correctly again: it must be destroyed and created anew.
// Two words (internal.h): the kernels' first, it names the token or peer, unless it only echoes
// the watchdog's stop (the latch kernel stops the group with this rank as origin, so the next
// kernels record a peer abort naming this rank itself).
// A local team's stopped gate (team_gate.h) comes last: a device-side error names its cause.
ncclResult_t check_group_errors(ncclEpGroup* g) {
  const bool device = __atomic_load_n(&g->h_err->code, __ATOMIC_ACQUIRE) != kErrNone;
  const bool host = __atomic_load_n(&g->h_stop->code, __ATOMIC_ACQUIRE) != kErrNone;
  if (!device && !host) return team_gate(g) != nullptr ? team_gate(g)->check() : ncclSuccess;
  ErrorInfo word;
  memcpy(&word, device ? g->h_err : g->h_stop, sizeof(word));
  if (device && host && word.code == kErrPeerAbort && word.token == g->node_rank)
    memcpy(&word, g->h_stop, sizeof(word));
  return report_error(g, word, nullptr);
}

GroupArgs group_args(const ncclEpGroup* g) {
  GroupArgs a;
  a.peers = g->d_peers;
  a.win = g->win;
  a.state = g->d_state;
  a.err = g->d_err;
  a.timeout_ns = (long long)g->cfg.timeout_ms * 1000000ll;
  a.num_ranks = g->node_size;
  a.rank = g->node_rank;
  a.num_local = g->num_local;
  a.num_experts = g->cfg.num_experts;
  a.max_tokens = g->cfg.max_tokens_per_rank;
  a.max_topk = g->cfg.max_topk;
  a.hidden = g->cfg.hidden;
  return a;
}

ncclResult_t barrier(ncclEpGroup* g, unsigned call, cudaStream_t stream) {
  if (g->node_size == 1) return ncclSuccess;  // stream order is enough on one rank
  BarrierArgs a;
  a.peers = g->d_peers;
  a.state = g->d_state;
  a.sync_off = g->win.sync_off;
  a.num_ranks = g->node_size;
  a.rank = g->node_rank;
  a.timeout_ns = (long long)g->cfg.timeout_ms * 1000000ll;
  a.call = call;
  a.err = g->d_err;
  EP_CUDA(launch_barrier(a, stream));
  return ncclSuccess;
}

}  // namespace nccl_ep

using namespace nccl_ep;

extern "C" ncclResult_t ncclEpCreateGroup(ncclEpGroup_t* group, ncclComm_t comm,
                                          const ncclEpGroupConfig_t* config, cudaStream_t stream) {
  EP_CHECK(group != nullptr, ncclInvalidArgument, "ncclEpCreateGroup: group is NULL");
  *group = nullptr;
  EP_CHECK(comm != nullptr, ncclInvalidArgument, "ncclEpCreateGroup: comm is NULL");
  EP_CHECK(config != nullptr, ncclInvalidArgument, "ncclEpCreateGroup: config is NULL");
  ncclEpGroup* g = new ncclEpGroup();
  ncclResult_t res = create_nccl_group(g, comm, config, stream);
  if (res != ncclSuccess) {
    cudaStreamSynchronize(stream);
    destroy_group_state(g);
    return res;
  }
  *group = g;
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpCreateLocalTeam(ncclEpGroup_t* groups, int nranks,
                                              const ncclEpGroupConfig_t* config,
                                              cudaStream_t stream) {
  EP_CHECK(groups != nullptr, ncclInvalidArgument, "ncclEpCreateLocalTeam: groups is NULL");
  EP_CHECK(config != nullptr, ncclInvalidArgument, "ncclEpCreateLocalTeam: config is NULL");
  EP_CHECK(nranks >= 1 && nranks <= kMaxRanks, ncclInvalidArgument,
           "ncclEpCreateLocalTeam: nranks must be in [1, %d], got %d", kMaxRanks, nranks);
  for (int r = 0; r < nranks; ++r) groups[r] = nullptr;
  EP_RETURN_IF(check_config_version(config));
  EP_CHECK(config->ranks_per_node == 0 || config->ranks_per_node == nranks, ncclInvalidUsage,
           "ncclEpCreateLocalTeam: a local team is one node (ranks_per_node 0 or %d), got %d",
           nranks, config->ranks_per_node);
  // The ranks' kernels wait for each other: their streams must reach the GPU through separate
  // hardware queues, or one rank's kernel queues behind a peer's waiting one (a deadlock until
  // the timeout). CUDA gives a context CUDA_DEVICE_MAX_CONNECTIONS queues (default 8).
  const char* conn = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int connections = conn != nullptr ? atoi(conn) : 8;
  EP_CHECK(connections >= 2 * nranks, ncclInvalidUsage,
           "ncclEpCreateLocalTeam: %d ranks need at least %d CUDA hardware queues, the process "
           "has %d (CUDA_DEVICE_MAX_CONNECTIONS%s); set CUDA_DEVICE_MAX_CONNECTIONS=32 before "
           "CUDA starts",
           nranks, 2 * nranks, connections, conn != nullptr ? "" : " unset: default 8");
  auto team = std::make_shared<LocalTeam>();
  team->alloc_fn = config->alloc_fn;
  team->free_fn = config->free_fn;
  team->alloc_ctx = config->alloc_ctx;
  team->windows.assign(nranks, nullptr);
  if (nranks > 1) team->gate = std::make_unique<TeamGate>(nranks);
  ncclResult_t res = ncclSuccess;
  for (int r = 0; r < nranks && res == ncclSuccess; ++r) {
    ncclEpGroup* g = new ncclEpGroup();
    groups[r] = g;
    g->team = team;
    res = init_group(g, config, nranks, r, nranks, nranks, stream);
    if (res == ncclSuccess) res = alloc_device(g, &team->windows[r], g->win.bytes);
    if (res == ncclSuccess && cudaMemsetAsync(team->windows[r], 0, g->win.bytes, stream) !=
                                  cudaSuccess) {
      set_error("ncclEpCreateLocalTeam: zeroing rank %d's window failed", r);
      res = ncclUnhandledCudaError;
    }
    if (res == ncclSuccess) g->win_buf = team->windows[r];
  }
  for (int r = 0; r < nranks && res == ncclSuccess; ++r) {
    ncclEpGroup* g = groups[r];
    g->peers = team->windows;
    res = alloc_device(g, reinterpret_cast<void**>(&g->d_peers), sizeof(void*) * nranks);
    if (res == ncclSuccess &&
        cudaMemcpyAsync(g->d_peers, g->peers.data(), sizeof(void*) * nranks,
                        cudaMemcpyHostToDevice, stream) != cudaSuccess) {
      set_error("ncclEpCreateLocalTeam: copying rank %d's peer table failed", r);
      res = ncclUnhandledCudaError;
    }
  }
  if (res == ncclSuccess && cudaStreamSynchronize(stream) != cudaSuccess) {
    set_error("ncclEpCreateLocalTeam: the setup copies failed");
    res = ncclUnhandledCudaError;
  }
  if (res != ncclSuccess) {
    cudaStreamSynchronize(stream);
    for (int r = 0; r < nranks; ++r) {
      destroy_group_state(groups[r]);
      groups[r] = nullptr;
    }
  }
  return res;
}

extern "C" ncclResult_t ncclEpGroupDestroy(ncclEpGroup_t group) {
  if (group == nullptr) return ncclSuccess;
  // Work still queued on any stream may use the buffers: wait for the device first.
  debug_log("rank %d: group destroy: waiting for the device", group->rank);
  cudaError_t ce = cudaDeviceSynchronize();
  destroy_group_state(group);
  EP_CUDA(ce);
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpGetMemorySize(const ncclEpGroupConfig_t* config, int nranks,
                                            ncclEpMemorySize_t* size) {
  EP_CHECK(config != nullptr && size != nullptr, ncclInvalidArgument,
           "ncclEpGetMemorySize: config or size is NULL");
  EP_CHECK(size->size >= sizeof(ncclEpMemorySize_t) && size->version == NCCL_EP_API_VERSION,
           ncclInvalidArgument,
           "ncclEpGetMemorySize: size.size/version do not match this library; initialize it "
           "with NCCL_EP_MEMORY_SIZE_INITIALIZER");
  // One node, unless ranks_per_node says otherwise (the rail buffers of HT groups that span
  // nodes are not counted); nranks is checked with the config (check_config).
  const int node_size = config->ranks_per_node > 0 ? config->ranks_per_node : nranks;
  EP_RETURN_IF(check_config(config, nranks, node_size));
  ncclEpGroup probe;
  size_group(&probe, config, nranks, 0, node_size);
  size->window_bytes = probe.win.bytes;
  size->handle_bytes = slot_device_bytes(&probe);
  size->device_bytes = sizeof(DeviceState) + sizeof(void*) * node_size +
                       kPreallocatedSlots * size->handle_bytes;
  size->total_bytes = size->window_bytes + size->device_bytes;
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpGroupCheckErrors(ncclEpGroup_t group) {
  EP_CHECK(group != nullptr, ncclInvalidArgument, "ncclEpGroupCheckErrors: group is NULL");
  return check_group_errors(group);
}

extern "C" ncclResult_t ncclEpGroupGetInfo(ncclEpGroup_t group, ncclEpGroupInfo_t* info) {
  EP_CHECK(group != nullptr && info != nullptr, ncclInvalidArgument,
           "ncclEpGroupGetInfo: group or info is NULL");
  EP_CHECK(info->size >= sizeof(ncclEpGroupInfo_t) && info->version == NCCL_EP_API_VERSION,
           ncclInvalidArgument,
           "ncclEpGroupGetInfo: info.size/version do not match this library; initialize it with "
           "NCCL_EP_GROUP_INFO_INITIALIZER");
  const WindowLayout& w = group->win;
  info->num_ranks = group->nranks;
  info->rank = group->rank;
  info->channels = w.channels;
  info->staging_chunk_tokens = w.chunk;
  info->staging_depth = w.depth;
  info->window_bytes = w.bytes;
  info->staging_bytes = (size_t)w.channels * (w.num_ranks - 1) * w.depth * w.chunk *
                        (w.row_stride + (size_t)w.max_topk * 8);
  info->routing_bytes = w.ring_off - w.routing_off;
  info->handle_bytes = slot_device_bytes(group);
  info->ranks_per_node = group->node_size;
  info->rail_bytes = rail_buffer_bytes(group);
  for (int op = 0; op < 3; ++op) {
    info->rail_rows_sent[op] = group->rail.rows_sent[op].load();
    info->rail_bytes_sent[op] = group->rail.bytes_sent[op].load();
  }
  return ncclSuccess;
}
