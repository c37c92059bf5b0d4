/*
 * group.cc: ncclEpCreateGroup / ncclEpGroupDestroy / ncclEpGroupCheckErrors, the symmetric
 * window, peer pointers, the device error word, the barrier helper and the handle-slot pool.
 *
 * NOTES:
 *  - Creation order matters for collectives: (1) all-gather a POD view of the config (plus each
 *    rank's LSA team size and NCCL version) and compare on every rank, so every rank fails the same
 *    way before anything else collective happens; (2) ncclMemAlloc + ncclCommWindowRegister
 *    (collective); (3) zero the barrier flags, then a second small all-gather so no rank can write
 *    a peer's flags before that peer zeroed them; (4) resolve peer pointers with a one-thread-per-
 *    peer kernel over ncclGetPeerPointer (device API, same in NCCL 2.28 and 2.30).
 *  - Every rank of the communicator must be in the LSA team (NVLink / same node); otherwise
 *    ncclInvalidUsage: there is no PCIe / host fallback yet.
 *  - The device code reads NCCL's ncclWindow_vidmem layout through the headers it was compiled
 *    against, so the runtime NCCL must have the same major.minor as the headers (checked).
 */
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "internal.h"

namespace nccl_ep {

namespace {

struct ConfigRecord {  // all-gathered at creation; int64 fields so the compare is trivial
  long long magic, version, mode, num_experts, hidden, max_tokens, max_topk, token_dtype,
      recv_mode, capacity, align, num_sms, timeout_ms, lsa_size, nccl_version, staging_tokens;
};
const char* kConfigFields[] = {"magic", "version", "mode", "num_experts", "hidden",
                               "max_tokens_per_rank", "max_topk", "token_dtype",
                               "recv_count_mode", "max_recv_tokens_per_rank", "expert_alignment",
                               "num_sms", "timeout_ms", "lsa_size", "nccl_version",
                               "staging tokens (NCCL_EP_STAGING_TOKENS)"};
constexpr int kConfigFieldCount = (int)(sizeof(ConfigRecord) / sizeof(long long));
static_assert(sizeof(kConfigFields) / sizeof(kConfigFields[0]) == kConfigFieldCount, "fields");

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

void destroy_group_state(ncclEpGroup* g) {
  if (g == nullptr) return;
  for (ncclEpHandle* h : g->live) delete h;
  g->live.clear();
  for (ncclEpHandleSlot* s : g->all_slots) {
    free_device(g, s->base);
    delete s;
  }
  g->all_slots.clear();
  g->free_slots.clear();
  if (g->win != nullptr) ncclCommWindowDeregister(g->comm, g->win);
  if (g->win_buf != nullptr) {
    if (g->win_is_local) {
      free_device(g, g->win_buf);
    } else {
      ncclMemFree(g->win_buf);
    }
  }
  if (g->d_peers != nullptr) free_device(g, g->d_peers);
  if (g->d_epoch != nullptr) free_device(g, g->d_epoch);
  if (g->h_err != nullptr) cudaFreeHost(g->h_err);
  if (g->h_meta != nullptr) cudaFreeHost(g->h_meta);
  delete g;
}

ncclResult_t check_config(const ncclEpGroupConfig_t* c, int nranks) {
  EP_CHECK(c->size >= sizeof(ncclEpGroupConfig_t) && c->version == NCCL_EP_API_VERSION,
           ncclInvalidArgument,
           "ncclEpCreateGroup: config.size/version (%zu/%u) do not match this library (%zu/%d); "
           "initialize the config with NCCL_EP_GROUP_CONFIG_INITIALIZER",
           c->size, c->version, sizeof(ncclEpGroupConfig_t), NCCL_EP_API_VERSION);
  EP_CHECK(c->mode == ncclEpModeHighThroughput, ncclInvalidUsage,
           "ncclEpCreateGroup: mode %d is not implemented (only ncclEpModeHighThroughput)",
           (int)c->mode);
  EP_CHECK(nranks <= kMaxRanks, ncclInvalidUsage,
           "ncclEpCreateGroup: the group has %d ranks, at most %d are supported", nranks,
           kMaxRanks);
  EP_CHECK(c->num_experts > 0 && c->num_experts % nranks == 0, ncclInvalidArgument,
           "ncclEpCreateGroup: num_experts (%d) must be > 0 and a multiple of the group size (%d)",
           c->num_experts, nranks);
  EP_CHECK(c->num_experts <= 65535, ncclInvalidArgument,
           "ncclEpCreateGroup: num_experts must be <= 65535, got %d", c->num_experts);
  EP_CHECK(c->hidden > 0, ncclInvalidArgument, "ncclEpCreateGroup: hidden must be > 0, got %d",
           c->hidden);
  EP_CHECK(c->max_tokens_per_rank >= 0, ncclInvalidArgument,
           "ncclEpCreateGroup: max_tokens_per_rank must be >= 0, got %d", c->max_tokens_per_rank);
  EP_CHECK(c->max_topk >= 1 && c->max_topk <= c->num_experts && c->max_topk <= kMaxTopk,
           ncclInvalidArgument,
           "ncclEpCreateGroup: max_topk must be in [1, min(num_experts=%d, %d)], got %d",
           c->num_experts, kMaxTopk, c->max_topk);
  EP_CHECK(c->token_dtype == ncclBfloat16 || c->token_dtype == ncclFloat16 ||
               c->token_dtype == ncclFloat32,
           ncclInvalidArgument,
           "ncclEpCreateGroup: token dtype %s is not supported: the cuda backend supports "
           "bfloat16, float16 and float32 tokens",
           dtype_name(c->token_dtype));
  EP_CHECK(c->recv_count_mode == ncclEpRecvCountExact ||
               c->recv_count_mode == ncclEpRecvCountCapacity,
           ncclInvalidArgument, "ncclEpCreateGroup: recv_count_mode %d is invalid",
           (int)c->recv_count_mode);
  if (c->recv_count_mode == ncclEpRecvCountCapacity) {
    EP_CHECK(c->max_recv_tokens_per_rank >= 0 && c->max_recv_tokens_per_rank < (1ll << 31),
             ncclInvalidArgument,
             "ncclEpCreateGroup: capacity mode needs 0 <= max_recv_tokens_per_rank < 2^31, "
             "got %lld",
             (long long)c->max_recv_tokens_per_rank);
  }
  EP_CHECK(c->expert_alignment >= 1 && c->expert_alignment <= (1 << 20), ncclInvalidArgument,
           "ncclEpCreateGroup: expert_alignment must be in [1, 2^20], got %d",
           c->expert_alignment);
  EP_CHECK(c->num_sms >= 0, ncclInvalidArgument,
           "ncclEpCreateGroup: num_sms must be >= 0 (0 = default), got %d", c->num_sms);
  EP_CHECK(c->timeout_ms > 0, ncclInvalidArgument,
           "ncclEpCreateGroup: timeout_ms must be > 0, got %lld", (long long)c->timeout_ms);
  const long long slots = (long long)nranks * c->max_tokens_per_rank * c->max_topk;
  const long long rows = (long long)nranks * c->max_tokens_per_rank *
                             std::min(c->max_topk, c->num_experts / nranks) +
                         (long long)(c->num_experts / nranks) * (c->expert_alignment - 1);
  EP_CHECK(slots + kRecordHeader * nranks < (1ll << 31) && rows < (1ll << 31),
           ncclInvalidArgument,
           "ncclEpCreateGroup: group size x max_tokens_per_rank x max_topk (%lld) must stay "
           "below 2^31",
           slots);
  EP_CHECK((c->alloc_fn == nullptr) == (c->free_fn == nullptr), ncclInvalidArgument,
           "ncclEpCreateGroup: alloc_fn and free_fn must be given together");
  return ncclSuccess;
}

}  // namespace

ncclResult_t alloc_device(ncclEpGroup* g, void** ptr, size_t bytes) {
  *ptr = nullptr;
  if (bytes == 0) bytes = 16;
  if (g->cfg.alloc_fn != nullptr) {
    EP_CHECK(g->cfg.alloc_fn(ptr, bytes, g->cfg.alloc_ctx) == 0 && *ptr != nullptr,
             ncclSystemError, "alloc_fn failed to allocate %zu bytes", bytes);
    return ncclSuccess;
  }
  EP_CUDA(cudaMalloc(ptr, bytes));
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

ncclResult_t acquire_slot(ncclEpGroup* g, ncclEpHandleSlot** out) {
  if (!g->free_slots.empty()) {
    *out = g->free_slots.back();
    g->free_slots.pop_back();
    return ncclSuccess;
  }
  const int R = g->nranks, L = g->num_local;
  const size_t Tm = (size_t)g->cfg.max_tokens_per_rank, Km = (size_t)g->cfg.max_topk;
  size_t o = 0;
  const size_t o_gathered = o;
  o = align_up(o + (size_t)R * g->rec_ints * sizeof(int), 256);
  const size_t o_recv_row = o;
  o = align_up(o + (size_t)R * Tm * Km * sizeof(int), 256);
  const size_t o_src = o;
  o = align_up(o + (size_t)g->src_rows * sizeof(int), 8);
  const size_t o_key = o;
  o = align_up(o + sizeof(unsigned long long), 256);
  const size_t o_cnt = o;
  o = align_up(o + (size_t)R * L * sizeof(int), 256);
  const size_t o_off = o;
  o = align_up(o + (size_t)R * L * sizeof(int), 256);
  const size_t o_meta = o;
  o = align_up(o + layout_meta_bytes(L), 16);
  const size_t o_hist = o;
  o = align_up(o + sizeof(int) * (size_t)g->cfg.num_experts, 256);

  ncclEpHandleSlot* s = new ncclEpHandleSlot();
  ncclResult_t res = alloc_device(g, &s->base, o);
  if (res != ncclSuccess) {
    delete s;
    return res;
  }
  char* b = reinterpret_cast<char*>(s->base);
  s->bytes = o;
  s->gathered = reinterpret_cast<int*>(b + o_gathered);
  s->recv_row = reinterpret_cast<int*>(b + o_recv_row);
  s->src_of_row = reinterpret_cast<int*>(b + o_src);
  s->err_key = reinterpret_cast<unsigned long long*>(b + o_key);
  s->cnt = reinterpret_cast<int*>(b + o_cnt);
  s->off = reinterpret_cast<int*>(b + o_off);
  s->meta = reinterpret_cast<LayoutMeta*>(b + o_meta);
  s->hist = reinterpret_cast<int*>(b + o_hist);
  s->zero_bytes = o_hist + sizeof(int) * (size_t)g->cfg.num_experts - o_meta;
  s->ff_bytes = o_key + sizeof(unsigned long long) - o_recv_row;
  g->all_slots.push_back(s);
  *out = s;
  return ncclSuccess;
}

void release_slot(ncclEpGroup* g, ncclEpHandleSlot* slot) {
  if (slot != nullptr) g->free_slots.push_back(slot);
}

// NOTES: a device-side error is sticky. After it, ranks may have run different numbers of
// barriers (some returned early, some waited), so the epochs no longer agree and the group can
// never synchronize correctly again: it must be destroyed and created anew.
ncclResult_t check_group_errors(ncclEpGroup* g) {
  volatile ErrorInfo* w = g->h_err;
  if (w->code == 0) return ncclSuccess;
  ErrorInfo copy;
  memcpy(&copy, const_cast<ErrorInfo*>(g->h_err), sizeof(copy));
  return report_error(g, copy, nullptr);
}

ncclResult_t barrier(ncclEpGroup* g, unsigned call, cudaStream_t stream) {
  if (g->nranks == 1) return ncclSuccess;  // stream order is enough on one rank
  BarrierArgs a;
  a.peers = g->d_peers;
  a.epoch = g->d_epoch;
  a.failed = g->d_epoch + 1;
  a.flags_off = g->flags_off;
  a.num_ranks = g->nranks;
  a.rank = g->rank;
  a.timeout_ns = (long long)g->cfg.timeout_ms * 1000000ll;
  a.tag = (int)(call & 7u);
  a.call = call;
  a.err = g->d_err;
  EP_CUDA(launch_barrier(a, stream));
  return ncclSuccess;
}

// All-gathers one small host record per rank into all[R] over the group's communicator
// (collective, synchronizes the stream).
static ncclResult_t host_all_gather(ncclEpGroup* g, const void* mine, size_t bytes, void* all,
                                    cudaStream_t stream) {
  void* tmp = nullptr;
  EP_CUDA(cudaMalloc(&tmp, bytes * g->nranks));
  char* d_all = reinterpret_cast<char*>(tmp);
  cudaError_t ce = cudaMemcpyAsync(d_all + bytes * g->rank, mine, bytes, cudaMemcpyHostToDevice,
                                   stream);
  ncclResult_t nr = ncclSuccess;
  if (ce == cudaSuccess)
    nr = ncclAllGather(d_all + bytes * g->rank, d_all, bytes, ncclUint8, g->comm, stream);
  if (ce == cudaSuccess && nr == ncclSuccess)
    ce = cudaMemcpyAsync(all, d_all, bytes * g->nranks, cudaMemcpyDeviceToHost, stream);
  if (ce == cudaSuccess && nr == ncclSuccess) ce = cudaStreamSynchronize(stream);
  cudaFree(tmp);
  EP_CUDA(ce);
  EP_NCCL(nr);
  return ncclSuccess;
}

static ncclResult_t create_group(ncclEpGroup* g, ncclComm_t comm, const ncclEpGroupConfig_t* config,
                                 cudaStream_t stream) {
  g->comm = comm;
  EP_NCCL(ncclCommCount(comm, &g->nranks));
  EP_NCCL(ncclCommUserRank(comm, &g->rank));
  EP_RETURN_IF(check_config(config, g->nranks));
  g->cfg = *config;
  const ncclEpGroupConfig_t& c = g->cfg;
  const int R = g->nranks;
  g->num_local = c.num_experts / R;
  g->elt = dtype_bytes(c.token_dtype);
  g->row_bytes = (size_t)c.hidden * g->elt;
  g->stage_row_bytes = align_up(g->row_bytes, 16);
  g->num_sms = c.num_sms > 0 ? c.num_sms : 24;
  g->capacity = c.recv_count_mode == ncclEpRecvCountCapacity ? (long long)c.max_recv_tokens_per_rank
                                                             : -1;
  g->rec_ints = kRecordHeader + c.max_tokens_per_rank * c.max_topk;
  const long long bound = (long long)R * c.max_tokens_per_rank *
                              std::min(c.max_topk, g->num_local) +
                          (long long)g->num_local * (c.expert_alignment - 1);
  g->src_rows = g->capacity >= 0 ? std::min(bound, g->capacity) : bound;

  int runtime_version = 0;
  EP_NCCL(ncclGetVersion(&runtime_version));
  EP_CHECK(runtime_version / 100 == NCCL_VERSION_CODE / 100, ncclInvalidUsage,
           "ncclEpCreateGroup: built against NCCL %d but the process loaded NCCL %d: the device "
           "API structures differ across minor versions; rebuild against the loaded NCCL",
           NCCL_VERSION_CODE, runtime_version);

  // Staging tokens per source rank: the chunk decides the staging layout and the number of
  // barriers of every operation, so it is part of the configuration every rank must share.
  long long chunk = std::max(c.max_tokens_per_rank, 1);
  if (const char* env = getenv("NCCL_EP_STAGING_TOKENS")) {  // testing / memory-limited runs
    const long long v = atoll(env);
    if (v > 0 && v < chunk) chunk = v;
  }

  // (1) configuration agreement, collective.
  ConfigRecord mine = {0x4e43434c4550ll, NCCL_EP_API_VERSION, (long long)c.mode,
                       c.num_experts, c.hidden, c.max_tokens_per_rank, c.max_topk,
                       (long long)c.token_dtype, (long long)c.recv_count_mode,
                       g->capacity, c.expert_alignment, c.num_sms, (long long)c.timeout_ms,
                       (long long)lsa_team_size(comm), runtime_version, chunk};
  std::vector<ConfigRecord> all(R);
  EP_RETURN_IF(host_all_gather(g, &mine, sizeof(mine), all.data(), stream));
  for (int r = 0; r < R; ++r) {
    const long long* a = reinterpret_cast<const long long*>(&all[r]);
    const long long* b = reinterpret_cast<const long long*>(&mine);
    for (int f = 0; f < kConfigFieldCount; ++f) {
      if (f == 13) continue;  // lsa_size: checked below with its own message
      EP_CHECK(a[f] == b[f], ncclInvalidArgument,
               "inconsistent configuration across ranks: %s=%lld on rank %d but %lld on rank %d; "
               "every rank of the EP group must create its group with the same configuration",
               kConfigFields[f], a[f], r, b[f], g->rank);
    }
  }
  for (int r = 0; r < R; ++r) {
    EP_CHECK(R == 1 || all[r].lsa_size == R, ncclInvalidUsage,
             "peers not NVLink-connected: rank %d sees an LSA (load/store accessible) team of %lld "
             "of the %d ranks; the PCIe / host fallback is not implemented",
             r, all[r].lsa_size, R);
  }

  // (2) symmetric window: flags | token staging | prob staging.
  g->chunk = (int)chunk;
  g->num_chunks = std::max(1, (c.max_tokens_per_rank + g->chunk - 1) / g->chunk);
  g->flags_off = 0;
  g->tok_off = kFlagsBytes;
  g->prob_off = align_up(g->tok_off + (size_t)R * g->chunk * g->stage_row_bytes, 256);
  g->win_bytes = align_up(g->prob_off + (size_t)R * g->chunk * c.max_topk * 8, 1 << 21);
  if (R > 1) {
    EP_NCCL(ncclMemAlloc(&g->win_buf, g->win_bytes));
    EP_NCCL(ncclCommWindowRegister(comm, g->win_buf, g->win_bytes, &g->win,
                                   NCCL_WIN_COLL_SYMMETRIC));
  } else {
    // One rank: no peer to map; a plain device buffer plays the window (no NCCL symmetric
    // registration, which some NCCL versions skip or refuse on a single-rank communicator).
    EP_RETURN_IF(alloc_device(g, &g->win_buf, g->win_bytes));
    g->win_is_local = true;
  }

  // Error word (host-mapped), epoch counter, readback buffer.
  EP_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&g->h_err), sizeof(ErrorInfo),
                        cudaHostAllocMapped));
  memset(g->h_err, 0, sizeof(ErrorInfo));
  EP_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&g->d_err), g->h_err, 0));
  g->meta_bytes = layout_meta_bytes(g->num_local);
  EP_CUDA(cudaHostAlloc(&g->h_meta, g->meta_bytes, cudaHostAllocDefault));
  EP_RETURN_IF(alloc_device(g, reinterpret_cast<void**>(&g->d_epoch),
                            2 * sizeof(unsigned long long)));
  EP_CUDA(cudaMemsetAsync(g->d_epoch, 0, 2 * sizeof(unsigned long long), stream));

  // (3) zero the flags, then make sure every rank did before anyone signals. The same
  // all-gather tells every rank whether every rank got a window: NCCL may register none (and
  // say success) when symmetric memory is unavailable (NCCL_CUMEM_ENABLE=0, no P2P).
  EP_CUDA(cudaMemsetAsync(reinterpret_cast<char*>(g->win_buf) + g->flags_off, 0, kFlagsBytes,
                          stream));
  std::vector<int> window_ok(R);
  const int mine_ok = g->win_is_local || g->win != nullptr;
  EP_RETURN_IF(host_all_gather(g, &mine_ok, sizeof(mine_ok), window_ok.data(), stream));
  for (int r = 0; r < R; ++r) {
    EP_CHECK(window_ok[r], ncclInvalidUsage,
             "NCCL registered no symmetric memory window on rank %d (symmetric memory is "
             "unavailable there: NCCL_CUMEM_ENABLE=0, NCCL_WIN_ENABLE=0 or no GPU peer access); "
             "the nccl_ep CUDA backend needs it",
             r);
  }

  // (4) peer pointers.
  EP_RETURN_IF(alloc_device(g, reinterpret_cast<void**>(&g->d_peers), sizeof(void*) * R));
  g->peers.resize(R);
  if (g->win_is_local) {
    g->peers[0] = g->win_buf;
    EP_CUDA(cudaMemcpyAsync(g->d_peers, g->peers.data(), sizeof(void*), cudaMemcpyHostToDevice,
                            stream));
  } else {
    EP_CUDA(launch_resolve_peers(g->win, R, g->d_peers, stream));
    EP_CUDA(cudaMemcpyAsync(g->peers.data(), g->d_peers, sizeof(void*) * R,
                            cudaMemcpyDeviceToHost, stream));
  }
  EP_CUDA(cudaStreamSynchronize(stream));
  // NOTE: peers[rank] is this rank's buffer in NCCL's flat LSA mapping, an alias of win_buf at
  // another virtual address; kernels use peers[] only, the host uses win_buf (same memory).
  for (int r = 0; r < R; ++r) {
    EP_CHECK(g->peers[r] != nullptr, ncclInternalError,
             "ncclEpCreateGroup: NCCL returned no load/store pointer for rank %d's window", r);
  }
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
  ncclResult_t res = create_group(g, comm, config, stream);
  if (res != ncclSuccess) {
    cudaStreamSynchronize(stream);
    destroy_group_state(g);
    return res;
  }
  *group = g;
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpGroupDestroy(ncclEpGroup_t group) {
  if (group == nullptr) return ncclSuccess;
  // Work still queued on any stream may use the buffers: wait for the device first.
  cudaError_t ce = cudaDeviceSynchronize();
  destroy_group_state(group);
  EP_CUDA(ce);
  return ncclSuccess;
}

extern "C" ncclResult_t ncclEpGroupCheckErrors(ncclEpGroup_t group) {
  EP_CHECK(group != nullptr, ncclInvalidArgument, "ncclEpGroupCheckErrors: group is NULL");
  return check_group_errors(group);
}
