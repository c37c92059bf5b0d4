/*
 * config.cc: the group configuration: its checks, the window it implies, and the agreement of
 * every rank on it.
 *
 * NOTES:
 *  - The window's shape (channels, ring depth and chunk, routing records) follows from the config
 *    alone, so ranks that agree on the config agree on every offset.
 *  - Default chunk: the power of two of tokens whose rows, once per rank of the node, fill
 *    ~2 MiB (at least 8, at most 256 tokens). A combine round is R x chunk tokens over a CTA's
 *    warps: the chunk must give enough items to keep every warp busy between the round's
 *    barriers (small chunks leave warps idle at each barrier), while the ring stays
 *    ~channels x 2 x 2 MiB per group whatever R. Default depth NCCL_EP_DEFAULT_STAGING_DEPTH
 *    (double buffering).
 */
#include <string.h>

#include <algorithm>

#include "config_traits.h"
#include "internal.h"

namespace nccl_ep {

namespace {

constexpr int kDefaultSms = NCCL_EP_DEFAULT_NUM_SMS;
constexpr int kDefaultDepth = NCCL_EP_DEFAULT_STAGING_DEPTH;
constexpr size_t kChunkTargetBytes = 2 << 20;  // chunk x R x row

struct ConfigRecord {  // all-gathered at creation; int64 fields so the compare is trivial
  long long magic, version, mode, num_experts, hidden, max_tokens, max_topk, token_dtype,
      recv_mode, capacity, align, num_sms, timeout_ms, chunk, depth, expert_capacity, layout,
      payload_dtype, rail_capacity, nccl_version, node_size, lsa_size;
};
const char* kConfigFields[] = {"magic", "version", "mode", "num_experts", "hidden",
                               "max_tokens_per_rank", "max_topk", "token_dtype",
                               "recv_count_mode", "max_recv_tokens_per_rank", "expert_alignment",
                               "num_sms", "timeout_ms", "staging_chunk_tokens", "staging_depth",
                               "expert_capacity", "layout", "payload_dtype", "rail_capacity",
                               "nccl_version",
                               "ranks_per_node (as resolved)",
                               "lsa_size"};
constexpr int kConfigFieldCount = (int)(sizeof(ConfigRecord) / sizeof(long long));
static_assert(sizeof(kConfigFields) / sizeof(kConfigFields[0]) == kConfigFieldCount, "fields");
constexpr int kLsaField = kConfigFieldCount - 1;  // checked with its own message

int chunk_tokens(const ncclEpGroupConfig_t& c, size_t row_stride, int nranks) {
  if (c.staging_chunk_tokens > 0) return c.staging_chunk_tokens;
  int chunk = 8;
  while (chunk < 256 && (size_t)chunk * 2 * nranks * row_stride <= kChunkTargetBytes) chunk *= 2;
  return chunk;
}

}  // namespace

long long expert_block_rows(const ncclEpGroupConfig_t& c, int nranks) {
  return (long long)align_up((size_t)nranks * c.expert_capacity, c.expert_alignment);
}

int default_channels(const ncclEpGroupConfig_t& c) {
  return c.num_sms > 0 ? c.num_sms : kDefaultSms;
}

PayloadFormat payload_format(const ncclEpGroupConfig_t& c) {
  switch (c.payload_dtype) {
    case ncclEpPayloadTokenDtype: return {c.token_dtype, dtype_bytes(c.token_dtype), 0};
    case ncclEpPayloadFloat8e4m3: return {ncclFloat8e4m3, 1, kFp8Block};
  }
  return {c.token_dtype, 0, 0};  // not a payload type: refused by check_ll_config
}

// LL (protocol.cuh, LLWindow): sync area, flags, count words, per-expert counts (expert-major),
// kLLSets sets of R x T_max messages and of T_max x max_topk combine rows. The HT fields stay 0.
static WindowLayout plan_ll_window(const ncclEpGroupConfig_t& c, int nranks) {
  WindowLayout w{};
  const size_t elt = dtype_bytes(c.token_dtype), H = c.hidden, R = nranks;
  const size_t Tm = c.max_tokens_per_rank, Km = c.max_topk;
  w.num_ranks = nranks;
  w.max_topk = c.max_topk;
  w.channels = default_channels(c);
  LLWindow& l = w.ll;
  l.max_tokens = c.max_tokens_per_rank;
  l.count_stride = (int)align_up((size_t)(c.num_experts / nranks), 4);
  l.hdr_bytes = align_up(sizeof(LLHeader) + 3 * sizeof(int) * Km, 16);
  const PayloadFormat p = payload_format(c);
  const size_t payload =
      H * p.elem_bytes + (p.scale_block > 0 ? H / p.scale_block * sizeof(float) : 0);
  l.msg_bytes = l.hdr_bytes + align_up(payload, 16);
  l.comb_row = align_up(H * elt, 16);
  size_t o = 0;
  w.sync_off = o;
  o += kSyncBytes;
  l.flag_off = o;
  o = align_up(o + sizeof(unsigned long long) * kLLFlagKinds * kLLSets * R, 256);
  l.count_word_off = o;
  o = align_up(o + sizeof(unsigned long long) * kLLSets * R, 256);
  l.count_off = o;
  if (c.layout != ncclEpLayoutRankMajor)
    o = align_up(o + sizeof(int) * kLLSets * R * l.count_stride, 256);
  l.msg_off = o;
  o = align_up(o + kLLSets * R * Tm * l.msg_bytes, 256);
  l.comb_off = o;
  o = align_up(o + kLLSets * Tm * Km * l.comb_row, 256);
  w.channel_off = w.routing_off = w.ring_off = w.ring_prob_off = o;
  w.bytes = align_up(o, 1 << 21);
  return w;
}

// LL groups: the bounds of docs/design.md section 9 (nccl_ep_limits.h).
static ncclResult_t check_ll_config(const ncclEpGroupConfig_t* c, int nranks, int node_size) {
  EP_CHECK(c->layout == ncclEpLayoutExpertMajor || c->layout == ncclEpLayoutRankMajor,
           ncclInvalidArgument, "ncclEpCreateGroup: layout %d is invalid (expert-major 0, "
           "rank-major 1)", (int)c->layout);
  EP_CHECK(c->max_tokens_per_rank <= NCCL_EP_LL_MAX_TOKENS && c->max_topk <= NCCL_EP_LL_MAX_TOPK &&
               c->num_experts <= NCCL_EP_LL_MAX_EXPERTS,
           ncclInvalidArgument,
           "ncclEpCreateGroup: LL needs max_tokens_per_rank (T_max) <= %d, max_topk <= %d and "
           "num_experts <= %d, got %d, %d and %d",
           NCCL_EP_LL_MAX_TOKENS, NCCL_EP_LL_MAX_TOPK, NCCL_EP_LL_MAX_EXPERTS,
           c->max_tokens_per_rank, c->max_topk, c->num_experts);
  EP_CHECK(c->hidden % kLLGroupElems == 0, ncclInvalidArgument,
           "ncclEpCreateGroup: LL moves rows in packs of %d elements: hidden must be a multiple "
           "of %d, got %d",
           kLLGroupElems, kLLGroupElems, c->hidden);
  const PayloadFormat p = payload_format(*c);
  EP_CHECK(p.elem_bytes > 0, ncclInvalidArgument,
           "ncclEpCreateGroup: payload_dtype %d is invalid (ncclEpPayloadTokenDtype %d, "
           "ncclEpPayloadFloat8e4m3 %d)",
           (int)c->payload_dtype, (int)ncclEpPayloadTokenDtype, (int)ncclEpPayloadFloat8e4m3);
  EP_CHECK(p.scale_block == 0 || c->hidden % p.scale_block == 0, ncclInvalidArgument,
           "ncclEpCreateGroup: payload_dtype %s casts blocks of %d columns: hidden must be a "
           "multiple of %d, got %d",
           dtype_name(p.dtype), p.scale_block, p.scale_block, c->hidden);
  EP_CHECK(c->recv_count_mode == ncclEpRecvCountExact && c->expert_alignment == 1 &&
               c->expert_capacity == 0 && c->staging_chunk_tokens == 0 && c->staging_depth == 0,
           ncclInvalidArgument,
           "ncclEpCreateGroup: LL has its own layouts and buffers: recv_count_mode, "
           "expert_alignment, expert_capacity and the staging fields keep their initializer "
           "values (exact, 1, 0, 0, 0)");
  EP_CHECK(node_size == nranks, ncclInvalidUsage,
           "ncclEpCreateGroup: LL runs on one node (every rank reaches every peer's window over "
           "NVLink, or a local team); this group has %d ranks in nodes of %d "
           "(docs/internode.md, \"LL across nodes over the rail\": designed, not built)",
           nranks, node_size);
  return ncclSuccess;
}

WindowLayout plan_window(const ncclEpGroupConfig_t& c, int nranks /* of the node */) {
  if (c.mode == ncclEpModeLowLatency) return plan_ll_window(c, nranks);
  WindowLayout w{};
  const int elt = dtype_bytes(c.token_dtype);
  w.num_ranks = nranks;
  w.max_topk = c.max_topk;
  w.row_stride = align_up((size_t)c.hidden * elt, 16);
  w.channels = default_channels(c);
  w.depth = c.staging_depth > 0 ? c.staging_depth : kDefaultDepth;
  // One rank has no ring: its channel is one round (chunks only pace the peers' transfers).
  w.chunk = nranks == 1 ? std::max(1, (c.max_tokens_per_rank + w.channels - 1) / w.channels)
                        : chunk_tokens(c, w.row_stride, nranks);
  // A multiple of 4: every record 16-byte aligned (the layout's scans read ids 4 a load).
  w.rec_ints = (int)align_up(
      (size_t)kRecordHeader + (size_t)c.max_tokens_per_rank * c.max_topk, 4);
  const size_t ring_items = (size_t)w.channels * (nranks - 1) * w.depth * w.chunk;
  size_t o = 0;
  w.sync_off = o;
  o += kSyncBytes;
  w.channel_off = o;
  o = align_up(o + sizeof(ChannelFlags) * w.channels * nranks, 256);
  w.routing_off = o;
  o = align_up(o + sizeof(int) * 2 * (size_t)nranks * w.rec_ints, 256);
  w.ring_off = o;
  o = align_up(o + ring_items * w.row_stride, 256);
  w.ring_prob_off = o;
  o = align_up(o + ring_items * c.max_topk * 8, 256);
  w.bytes = align_up(o, 1 << 21);
  return w;
}

ncclResult_t check_config_version(const ncclEpGroupConfig_t* c) {
  EP_CHECK(c->size >= sizeof(ncclEpGroupConfig_t) && c->version == NCCL_EP_API_VERSION,
           ncclInvalidArgument,
           "ncclEpCreateGroup: config.size/version (%zu/%u) do not match this library (%zu/%d); "
           "initialize the config with NCCL_EP_GROUP_CONFIG_INITIALIZER",
           c->size, c->version, sizeof(ncclEpGroupConfig_t), NCCL_EP_API_VERSION);
  return ncclSuccess;
}

ncclResult_t check_config(const ncclEpGroupConfig_t* c, int nranks, int node_size) {
  EP_RETURN_IF(check_config_version(c));
  EP_CHECK(c->mode == ncclEpModeHighThroughput || c->mode == ncclEpModeLowLatency,
           ncclInvalidArgument,
           "ncclEpCreateGroup: mode %d is invalid (ncclEpModeHighThroughput or "
           "ncclEpModeLowLatency)",
           (int)c->mode);
  EP_CHECK(nranks >= 1 && nranks <= kMaxRanks, ncclInvalidUsage,
           "ncclEpCreateGroup: the group has %d ranks, 1 to %d are supported", nranks, kMaxRanks);
  EP_CHECK(c->num_experts > 0 && c->num_experts % nranks == 0, ncclInvalidArgument,
           "ncclEpCreateGroup: num_experts (%d) must be > 0 and a multiple of the group size (%d)",
           c->num_experts, nranks);
  EP_CHECK(c->num_experts <= NCCL_EP_MAX_EXPERTS, ncclInvalidArgument,
           "ncclEpCreateGroup: num_experts must be <= %d, got %d", NCCL_EP_MAX_EXPERTS,
           c->num_experts);
  EP_CHECK(c->hidden > 0, ncclInvalidArgument, "ncclEpCreateGroup: hidden must be > 0, got %d",
           c->hidden);
  EP_CHECK(c->max_tokens_per_rank >= 1, ncclInvalidArgument,
           "ncclEpCreateGroup: max_tokens_per_rank must be >= 1, got %d", c->max_tokens_per_rank);
  EP_CHECK(c->max_topk >= 1 && c->max_topk <= c->num_experts, ncclInvalidArgument,
           "ncclEpCreateGroup: max_topk must be in [1, num_experts=%d], got %d", c->num_experts,
           c->max_topk);
  // A token's slots on one rank, min(top-k, local experts), are what a warp holds at once.
  EP_CHECK(std::min(c->max_topk, c->num_experts / nranks) <= kMaxTopk, ncclInvalidArgument,
           "ncclEpCreateGroup: a token may have min(max_topk=%d, local experts=%d) slots on one "
           "rank, at most %d are supported (a drop-and-pad routing map, which may name every "
           "expert, has max_topk = num_experts): lower max_topk or spread the experts over more "
           "ranks",
           c->max_topk, c->num_experts / nranks, kMaxTopk);
  EP_CHECK(c->token_dtype == ncclBfloat16 || c->token_dtype == ncclFloat16 ||
               c->token_dtype == ncclFloat32,
           ncclInvalidArgument,
           "ncclEpCreateGroup: token dtype %s is not supported by the cuda backend, which "
           "supports bfloat16, float16 and float32 tokens",
           dtype_name(c->token_dtype));
  EP_CHECK(c->recv_count_mode == ncclEpRecvCountExact || is_capacity_mode(*c),
           ncclInvalidArgument, "ncclEpCreateGroup: recv_count_mode %d is invalid",
           (int)c->recv_count_mode);
  if (is_capacity_mode(*c)) {
    EP_CHECK(c->max_recv_tokens_per_rank >= 0 && c->max_recv_tokens_per_rank < (1ll << 31),
             ncclInvalidArgument,
             "ncclEpCreateGroup: capacity mode needs 0 <= max_recv_tokens_per_rank < 2^31, "
             "got %lld",
             (long long)c->max_recv_tokens_per_rank);
  }
  EP_CHECK(c->expert_alignment >= 1 && c->expert_alignment <= NCCL_EP_MAX_EXPERT_ALIGNMENT,
           ncclInvalidArgument, "ncclEpCreateGroup: expert_alignment must be in [1, %d], got %d",
           NCCL_EP_MAX_EXPERT_ALIGNMENT, c->expert_alignment);
  EP_CHECK(c->num_sms >= 0 && c->num_sms <= kMaxChannels, ncclInvalidArgument,
           "ncclEpCreateGroup: num_sms must be in [0, %d] (0 = default %d), got %d",
           kMaxChannels, kDefaultSms, c->num_sms);
  EP_CHECK(c->timeout_ms > 0, ncclInvalidArgument,
           "ncclEpCreateGroup: timeout_ms must be > 0, got %lld", (long long)c->timeout_ms);
  // The least depth: the combine sends chunk j while it sums chunk j - 1 (exchange.cuh).
  EP_CHECK(c->staging_chunk_tokens >= 0 &&
               c->staging_chunk_tokens <= NCCL_EP_MAX_STAGING_CHUNK_TOKENS &&
               (c->staging_depth == 0 || (c->staging_depth >= NCCL_EP_MIN_STAGING_DEPTH &&
                                          c->staging_depth <= NCCL_EP_MAX_STAGING_DEPTH)),
           ncclInvalidArgument,
           "ncclEpCreateGroup: staging_chunk_tokens must be in [0, %d] and staging_depth 0 or "
           "in [%d, %d] (0 = default), got %d and %d",
           NCCL_EP_MAX_STAGING_CHUNK_TOKENS, NCCL_EP_MIN_STAGING_DEPTH, NCCL_EP_MAX_STAGING_DEPTH,
           c->staging_chunk_tokens, c->staging_depth);
  const long long slots = (long long)nranks * c->max_tokens_per_rank * c->max_topk;
  const long long rows = (long long)nranks * c->max_tokens_per_rank *
                             std::min(c->max_topk, c->num_experts / nranks) +
                         (long long)(c->num_experts / nranks) * (c->expert_alignment - 1);
  // (+ 3: records round up to a multiple of 4 ints)
  const long long record_ints = slots + (long long)(kRecordHeader + 3) * nranks;
  EP_CHECK(record_ints < (1ll << 31) && rows < (1ll << 31), ncclInvalidArgument,
           "ncclEpCreateGroup: group size x max_tokens_per_rank x max_topk (%lld), plus %d per "
           "rank for the routing records' headers, must stay below 2^31",
           slots, kRecordHeader + 3);
  EP_CHECK(c->expert_capacity >= 0, ncclInvalidArgument,
           "ncclEpCreateGroup: expert_capacity must be >= 0 (0 = off), got %d",
           c->expert_capacity);
  if (c->expert_capacity > 0) {
    const long long block = expert_block_rows(*c, nranks);
    const long long fixed = block * (c->num_experts / nranks);
    EP_CHECK(fixed < (1ll << 31), ncclInvalidArgument,
             "ncclEpCreateGroup: expert_capacity=%d gives %lld rows per rank (local experts x "
             "roundup(group size x capacity, expert_alignment)), which must stay below 2^31",
             c->expert_capacity, fixed);
    EP_CHECK(!is_capacity_mode(*c) ||
                 c->max_recv_tokens_per_rank == fixed,
             ncclInvalidArgument,
             "ncclEpCreateGroup: expert_capacity=%d fixes every dispatch output at %lld rows "
             "(%d local experts x %lld); in capacity mode max_recv_tokens_per_rank must be "
             "that, got %lld",
             c->expert_capacity, fixed, c->num_experts / nranks, block,
             (long long)c->max_recv_tokens_per_rank);
  }
  EP_CHECK(c->alloc_fn == nullptr || c->free_fn != nullptr, ncclInvalidArgument,
           "alloc_fn and free_fn must be given together");
  // The rail's budget per (source, remote node) message: capacity mode's fixed message size;
  // exact mode sizes every message to its tokens (docs/internode.md).
  EP_CHECK(c->rail_capacity >= 0 && c->rail_capacity <= c->max_tokens_per_rank &&
               (c->rail_capacity == 0 || is_capacity_mode(*c)),
           ncclInvalidArgument,
           "ncclEpCreateGroup: rail_capacity must be in [0, max_tokens_per_rank=%d] (0 = "
           "max_tokens_per_rank) and 0 in exact mode (its rail messages have the size of their "
           "tokens), got %d",
           c->max_tokens_per_rank, c->rail_capacity);
  if (c->mode == ncclEpModeLowLatency) return check_ll_config(c, nranks, node_size);
  EP_CHECK(c->layout == ncclEpLayoutExpertMajor && c->payload_dtype == ncclEpPayloadTokenDtype,
           ncclInvalidArgument,
           "ncclEpCreateGroup: layout and payload_dtype are LL options (mode "
           "ncclEpModeLowLatency); HT keeps their initializer values");
  const WindowLayout w = plan_window(*c, node_size);
  const long long per_channel = (c->max_tokens_per_rank + w.channels - 1) / w.channels;
  EP_CHECK((per_channel + w.chunk - 1) / w.chunk <= kMaxChunksPerChannel, ncclInvalidArgument,
           "ncclEpCreateGroup: max_tokens_per_rank=%d needs more than %d chunks of %d tokens per "
           "channel; raise staging_chunk_tokens or num_sms",
           c->max_tokens_per_rank, kMaxChunksPerChannel, w.chunk);
  EP_CHECK((c->alloc_fn == nullptr) == (c->free_fn == nullptr), ncclInvalidArgument,
           "alloc_fn and free_fn must be given together");
  EP_CHECK(c->ranks_per_node >= 0 && c->ranks_per_node <= nranks &&
               (c->ranks_per_node == 0 || nranks % c->ranks_per_node == 0),
           ncclInvalidArgument,
           "ncclEpCreateGroup: ranks_per_node must be 0 (NCCL's LSA team) or a divisor of the "
           "group size %d, got %d",
           nranks, c->ranks_per_node);
  return ncclSuccess;
}

// All-gathers one small host record per rank into all[n] over comm (n ranks, this one `rank`;
// collective, synchronizes the stream).
ncclResult_t host_all_gather(ncclComm_t comm, int n, int rank, const void* mine, size_t bytes,
                             void* all, cudaStream_t stream) {
  void* tmp = nullptr;
  EP_CUDA(cudaMalloc(&tmp, bytes * n));
  char* d_all = reinterpret_cast<char*>(tmp);
  cudaError_t ce = cudaMemcpyAsync(d_all + bytes * rank, mine, bytes, cudaMemcpyHostToDevice,
                                   stream);
  ncclResult_t nr = ncclSuccess;
  if (ce == cudaSuccess)
    nr = ncclAllGather(d_all + bytes * rank, d_all, bytes, ncclUint8, comm, stream);
  if (ce == cudaSuccess && nr == ncclSuccess)
    ce = cudaMemcpyAsync(all, d_all, bytes * n, cudaMemcpyDeviceToHost, stream);
  if (ce == cudaSuccess && nr == ncclSuccess) ce = cudaStreamSynchronize(stream);
  cudaFree(tmp);
  EP_CUDA(ce);
  EP_NCCL(nr);
  return ncclSuccess;
}

ncclResult_t agree_config(ncclEpGroup* g, int lsa_size, int nccl_version, cudaStream_t stream) {
  const ncclEpGroupConfig_t& c = g->cfg;
  const ConfigRecord mine = {0x4e43434c4550ll, NCCL_EP_API_VERSION, (long long)c.mode,
                             c.num_experts, c.hidden, c.max_tokens_per_rank, c.max_topk,
                             (long long)c.token_dtype, (long long)c.recv_count_mode,
                             g->capacity, c.expert_alignment, c.num_sms, (long long)c.timeout_ms,
                             c.staging_chunk_tokens, c.staging_depth, c.expert_capacity,
                             (long long)c.layout, (long long)c.payload_dtype, c.rail_capacity,
                             nccl_version,
                             g->node_size,
                             lsa_size};
  const int R = g->nranks;
  std::vector<ConfigRecord> all(R);
  EP_RETURN_IF(host_all_gather(g->comm, R, g->rank, &mine, sizeof(mine), all.data(), stream));
  for (int r = 0; r < R && c.ranks_per_node == 0; ++r) {
    EP_CHECK(all[r].lsa_size >= 1 && R % all[r].lsa_size == 0, ncclInvalidUsage,
             "ncclEpCreateGroup: rank %d sees an LSA team (the ranks that reach each other over "
             "NVLink) of %lld ranks, which does not divide the group of %d ranks into nodes; set "
             "ranks_per_node",
             r, all[r].lsa_size, R);
  }
  for (int r = 0; r < R; ++r) {
    const long long* a = reinterpret_cast<const long long*>(&all[r]);
    const long long* b = reinterpret_cast<const long long*>(&mine);
    for (int f = 0; f < kLsaField; ++f) {
      EP_CHECK(a[f] == b[f], ncclInvalidArgument,
               "inconsistent configuration across ranks: %s=%lld on rank %d but %lld on rank %d; "
               "every rank of the EP group must create its group with the same configuration",
               kConfigFields[f], a[f], r, b[f], g->rank);
    }
  }
  const int G = g->node_size;
  // NCCL's LSA teams are aligned blocks of consecutive ranks: a node of G ranks lies inside one
  // exactly when G divides the team size.
  for (int r = 0; r < R; ++r) {
    EP_CHECK(G == 1 || all[r].lsa_size % G == 0, ncclInvalidUsage,
             "peers not NVLink-connected: rank %d sees an LSA (load/store accessible) team of %lld "
             "ranks, but its node has ranks_per_node=%d; set ranks_per_node to the LSA team size "
             "or a divisor of it (1: every transfer over NCCL send/receive)",
             r, all[r].lsa_size, G);
  }
  return ncclSuccess;
}

}  // namespace nccl_ep
