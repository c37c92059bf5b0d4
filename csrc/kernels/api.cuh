/*
 * api.cuh: the one seam between the host runtime (csrc/runtime, plain C++) and the kernels
 * (csrc/kernels, CUDA). Host code fills the POD argument structs below and calls the launch_*
 * functions; every launch is stream-ordered, launches no grid of zero blocks, and returns the
 * cudaError_t of the launch.
 *
 * NOTES:
 *  - Window layout (one ncclMemAlloc buffer per rank, registered NCCL_WIN_COLL_SYMMETRIC, so every
 *    offset below is the same on every rank):
 *      [flags_off,  +4096)                      barrier flags: uint64 flags[kMaxRanks], slot p
 *                                               written by rank p with st.release.sys
 *      [tok_off,    +R * C * stage_row_bytes)   token staging: dispatch [src s][t - c0] rows,
 *                                               combine partials [dst d][t - c0] rows
 *      [prob_off,   +R * C * Kmax * 8)          prob staging: 8-byte slots [s][t - c0][k];
 *                                               combine_probs uses [0][t - c0][k]
 *  - Each operation (per chunk): entry barrier -> push kernel (writes into peers) -> barrier ->
 *    local kernel (reads own window). The entry barrier is the handshake that keeps a peer from
 *    overwriting staging this rank is still reading from the previous operation.
 *  - Packed slot id: slot = (s * Tmax + t) * Kmax + k (int32; R * Tmax * Kmax < 2^31 is checked).
 *  - Placement never depends on atomics: rows come from per-(s, l) block scans (layout.cu).
 */
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace nccl_ep {

constexpr int kMaxRanks = 64;   // barrier flags and per-token destination masks (uint64)
constexpr int kMaxTopk = 32;    // one lane per slot in the warp-level kernels
constexpr int kRecordHeader = 4;  // routing record: [T_s, K_s, kind, 0] + Tmax * Kmax int32
// Record kinds (header word 2): how rank s gave its routing, for the wording of its errors.
constexpr int kRecordTopkIdx = 0;
// From a routing map [T, E]: a token's routed experts, ascending, fill its K slots (-1 after the
// last). A token with n > K routed experts holds -1 - n (< -1: a range error) in slot K - 1.
constexpr int kRecordRoutingMap = 1;
constexpr size_t kFlagsBytes = 4096;

enum ErrorCode : int {
  kErrNone = 0,
  kErrExpertRange = 1,     // rank, token, slot, value
  kErrDuplicateExpert = 2, // rank, token, value (expert)
  kErrTopkMismatch = 3,    // value = this rank's K; LayoutMeta::ks holds every rank's K
  kErrCapacity = 4,        // rank, value = rows needed, extra = capacity
  kErrTimeout = 5,         // rank (waiter), token = peer waited for, value = epoch, extra = ms
  kErrShape = 6,           // rank, slot = 0 (tokens) / 1 (top-k), value = T or K, extra = bound
  kErrPeerAbort = 7,       // rank (this one), token = the rank whose error stopped the group
  kErrCallMismatch = 8,    // rank (this one), token = peer, value = this rank's call signature,
                           // extra = the peer's (barrier flags carry them; see BarrierArgs)
};

// flags[kAbortSlot] of a rank's window: written (origin rank + 1) by any rank that gave up after
// a device-side error, so that every peer stops waiting and reports it (errors are sticky).
constexpr int kAbortSlot = kMaxRanks;
static_assert((kAbortSlot + 1) * sizeof(unsigned long long) <= kFlagsBytes, "flags area");

// Written once per error word: the single winner of `claim` fills the fields, then publishes
// `code` last (system-scope fence in between), so a host reader that sees code != 0 sees the rest.
struct ErrorInfo {
  int code;
  int claim;
  int rank;
  int token;
  int slot;
  int aux;                 // kErrExpertRange / kErrShape: the record kind of the failing rank
  long long value;
  long long extra;
  long long pad;
};
static_assert(sizeof(ErrorInfo) == 48, "ErrorInfo layout");

// Per-handle results of the layout, copied to the host once in exact mode.
struct LayoutMeta {
  ErrorInfo err;           // exact mode: layout errors land here (capacity: the group's word)
  long long num_rows;      // N_d including alignment padding
  int ks[kMaxRanks];       // K of every rank (for the top-k mismatch message)
  int ts[kMaxRanks];       // T of every rank
  long long tokens_per_expert[1];  // [L], flexible tail
};

inline size_t layout_meta_bytes(int num_local_experts) {
  return offsetof(LayoutMeta, tokens_per_expert) + sizeof(long long) * (size_t)num_local_experts;
}

struct LayoutArgs {
  int* gathered;          // [R][rec_ints]
  int rec_ints;           // kRecordHeader + Tmax * Kmax
  int num_ranks, rank, num_experts, num_local, max_tokens, max_topk, topk, align;
  long long capacity;     // rows of the dispatch output in capacity mode, -1 in exact mode
  int* cnt;               // [R * L]
  int* off;               // [R * L] first row of (s, l)
  int* recv_row;          // [R * Tmax * Kmax], -1 = slot not owned here (memset by the host)
  int* src_of_row;        // [src_rows], -1 = padding (memset by the host)
  long long src_rows;
  unsigned long long* err_key;  // min-key of the first bad routing entry (memset 0xff)
  int* hist;              // [E] slots per expert over all ranks (memset 0): every rank checks
                          // every rank's capacity, so all ranks report an overflow together
  LayoutMeta* meta;
  ErrorInfo* err;         // where errors are reported (meta->err or the group's mapped word)
};

// A barrier flag holds (epoch << kCallBits) | call signature: a waiter that sees a peer at its
// own epoch with another signature knows the ranks are not making the same call.
constexpr int kCallBits = 16;
// Signature of one operation's barriers: which barrier (tag, 3 bits), whether dispatch moves
// probs (1 bit), and which handle (its creation number on this rank, 12 bits: creation is
// collective, so the same handle has the same number on every rank).
__host__ __device__ inline unsigned call_signature(int tag, bool with_probs, unsigned handle_seq) {
  return ((unsigned)tag & 7u) | ((with_probs ? 1u : 0u) << 3) | ((handle_seq & 0xfffu) << 4);
}

struct BarrierArgs {
  void* const* peers;     // device array [R] of window bases
  unsigned long long* epoch;  // device counter, local memory, bumped by every barrier
  unsigned long long* failed; // device word, set (never cleared) once the group holds an error
  size_t flags_off;
  int num_ranks, rank;
  long long timeout_ns;
  int tag;                // which barrier, for the error message
  unsigned call;          // call_signature() of the operation (< 2^kCallBits)
  ErrorInfo* err;         // group word (host-mapped)
};

struct ExchangeArgs {       // shared by dispatch, combine and combine_probs
  void* const* peers;       // device array [R] of window bases (peers[rank] = own window)
  size_t tok_off, prob_off, stage_row_bytes;
  int chunk;                // C: tokens per source in staging
  int c0;                   // first token of this chunk
  int first_chunk;          // 1 for the chunk that also writes padding rows / zero tails
  int num_ranks, rank, num_local, max_tokens, max_topk, topk;
  int num_tokens;           // own T
  const int* own_routing;   // gathered + rank * rec_ints + kRecordHeader, stride topk
  const int* gathered;      // all records (T_s in the headers)
  int rec_ints;
  const int* recv_row;      // [R * Tmax * Kmax]
  const int* src_of_row;
  long long src_rows;
  long long rows;           // rows of recv/expert_out: N_d (exact) or capacity
  int hidden;
  int vec;                  // 1: 16-byte path, 0: element path
  int num_sms;
  const unsigned long long* failed;  // BarrierArgs::failed: push kernels write nothing once set
};

struct DispatchArgs {
  ExchangeArgs ex;
  int dtype;                // ncclDataType_t of tokens
  const void* x;
  const void* probs;        // nullptr = no probs
  int prob_bytes;           // 2, 4 or 8
  void* recv_x;
  void* recv_probs;
};

struct CombineArgs {
  ExchangeArgs ex;
  int dtype;
  const void* expert_out;
  void* y;
};

struct CombineProbsArgs {
  ExchangeArgs ex;
  int prob_bytes;
  const void* grad_recv;    // [rows]
  void* grad;               // [T, K]
};

// runtime.cu
cudaError_t launch_resolve_peers(void* window /* ncclWindow_t */, int num_ranks, void** out_dev,
                                 cudaStream_t stream);
int lsa_team_size(void* comm /* ncclComm_t */);
cudaError_t launch_barrier(const BarrierArgs& args, cudaStream_t stream);

// layout.cu
// Copies `tokens` x `topk` ids; the header carries the caller's real shape (header_tokens,
// header_topk), which may exceed the group's bounds: every rank then reports it (kErrShape).
cudaError_t launch_pack_routing(const void* topk_idx, int idx_is_64, long long stride0,
                                long long stride1, int tokens, int topk, int header_tokens,
                                int header_topk, int* record, cudaStream_t stream);
// The same record from a routing map [T, E] (1-byte elements, nonzero = routed), K = topk slots.
cudaError_t launch_pack_routing_map(const void* routing_map, long long stride0, long long stride1,
                                    int tokens, int num_experts, int topk, int header_tokens,
                                    int header_topk, int* record, cudaStream_t stream);
cudaError_t launch_layout(const LayoutArgs& args, cudaStream_t stream);
// The ids of a record ([tokens * topk] int32) into a contiguous int32 or int64 tensor.
cudaError_t launch_copy_topk(const int* ids, long long count, void* out, int out_is_64,
                             cudaStream_t stream);

// dispatch.cu
cudaError_t launch_dispatch_send(const DispatchArgs& args, cudaStream_t stream);
cudaError_t launch_dispatch_expand(const DispatchArgs& args, cudaStream_t stream);

// combine.cu
cudaError_t launch_combine_reduce(const CombineArgs& args, cudaStream_t stream);
cudaError_t launch_combine_gather(const CombineArgs& args, cudaStream_t stream);
cudaError_t launch_combine_probs_send(const CombineProbsArgs& args, cudaStream_t stream);
cudaError_t launch_combine_probs_gather(const CombineProbsArgs& args, cudaStream_t stream);

}  // namespace nccl_ep
