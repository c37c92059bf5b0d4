/*
 * api.cuh: the one seam between the host runtime (csrc/runtime, plain C++) and the kernels
 * (csrc/kernels, CUDA). Host code fills the POD argument structs below and calls the launch_*
 * functions; every launch is stream-ordered and returns the cudaError_t of the launch.
 *
 * NOTES:
 *  - Handle creation: pack (own routing -> a record in every rank's window, in the half of the
 *    parity of the barriers run so far) -> barrier -> layout kernels on the local copy of all
 *    records.
 *  - Every op (dispatch, combine, combine_probs) is ONE kernel of `channels` CTAs (the SM
 *    budget), of which an op uses min(budget, ceil(max T_s / 4)) (exchange.cuh plan_channels);
 *    the others exit at once. In each CTA of dispatch and combine_probs the first send_warps warps push this
 *    rank's chunks into the peers' rings and the others consume the chunks the peers pushed here;
 *    in the combine every warp does both, round r sending chunk r and summing chunk r - 1. Chunk
 *    by chunk, with ready / credit flags per (channel, peer) (exchange.cuh): the transfer of one
 *    chunk overlaps the expansion / reduction of the previous ones; nothing waits for a whole op.
 *  - Packed slot id: slot = (s * Tmax + t) * Kmax + k (int32; R * Tmax * Kmax < 2^31 is checked).
 *  - Placement never depends on atomics: rows come from per-tile counts and a stable sort per
 *    tile (layout.cu).
 *  - Groups that span nodes (G ranks per node < R): the engine runs over the node's G ranks, once
 *    per node of sources ("pass" m: node peer p stands for source m * G + p, whose tokens reached
 *    it over the rail), with recv_row / tokens_of offset to that node's sources and expert_base
 *    = this node's first expert; a remote source's tokens sit at their packed rows in the rail's
 *    message (rail_rows, from the layout's rail kernel); combine_nodes and merge_probs finish at
 *    the source (runtime/nodes.cc).
 */
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "../include/nccl_ep.h"
#include "protocol.cuh"

namespace nccl_ep {

// Warps per CTA of each op kernel (one CTA per channel, one CTA per SM). The combine's rows load
// by bulk copies into shared memory, not registers, so it too runs up to 16 warps: more warps in
// flight hide more copy latency than larger stages per warp save, so its staging shape
// (token_sum.cuh) trades warps for larger copies only where items have 8 sources.
constexpr int kMaxWarps = 16;
constexpr int kDispatchWarps = 16;
constexpr int kCombineWarps = 16;
constexpr int kCombineProbsWarps = 16;

struct PackArgs {
  const void* routing;    // topk_idx [T, K] int32/int64, or routing_map [T, E] 1-byte
  int kind;               // RecordKind
  int idx_is_64;
  long long stride0, stride1;
  int tokens, topk, num_experts;
  int header_tokens, header_topk;  // the caller's real shape (may exceed the bounds: kErrShape)
  void* const* peers;     // device [R] window bases, or nullptr: the record goes to own_record
  size_t record_off;      // this rank's record in half 0 of every window's routing area
  // The half is chosen on the device (so a replayed graph alternates too): half 1 when the
  // handle-creation barriers run so far are odd; nullptr: half 0 (one rank, or records
  // all-gathered over nodes).
  const unsigned long long* barrier_epoch;
  size_t half_bytes;
  void* own_record;       // groups that span nodes: this rank's place in the all-gather buffer
  int num_ranks;
  int* own_routing;       // the handle's own copy [tokens * topk]
  int* kept_routing;      // expert_capacity: a second copy, its drops masked by the layout
  // Per-handle scratch the layout expects reset, reset here (no memset launches):
  unsigned long long* err_key;  // = ~0
  int* hist;              // [num_experts] = 0
  ErrorInfo* meta_err;    // = 0
  unsigned* blocks_done;  // = 0 (validate's finished blocks)
  unsigned* rail_done;    // = 0 (the rail kernel's finished blocks; nullptr on one node)
  // Groups that span nodes: the record's `stopped` word from this rank's state (nullptr: 0).
  const DeviceState* state;
  const ErrorInfo* err;   // the group's error word
  int rank;               // this rank in the group
  int stop_base;          // its node's first rank (the engine numbers the node's ranks)
};

// The layout's tile: slots (t, k) of one source per validate block and per scatter block, a
// count of tokens per local expert each (host: the handle slot sizes the counts with it).
constexpr int kLayoutTileSlots = 2048;
__host__ __device__ inline int layout_tiles(long long max_tokens, int max_topk) {
  const long long tiles = (max_tokens * max_topk + kLayoutTileSlots - 1) / kLayoutTileSlots;
  return tiles > 1 ? (int)tiles : 1;
}

struct LayoutArgs {
  const int* gathered;    // [R][rec_ints]: every rank's record (half 0 of this rank's window)
  // As PackArgs: the half that this creation's pack wrote, read after its barrier counted it.
  const unsigned long long* barrier_epoch;
  size_t half_ints;
  int rec_ints;
  int num_ranks, rank, num_experts, num_local, max_tokens, max_topk, topk, align;
  long long capacity;     // rows of the dispatch output in capacity mode, -1 in exact mode
  int drops_overflow;     // capacity mode: rows past `capacity` are dropped, not an error (the
                          // ops skip them: compact_rows), so nothing checks every rank's rows
  int* cnt;               // [R * L] (set by the bases from the tiles' counts)
  int* tile_cnt;          // [R][tiles][L]: tokens of a tile naming l (validate), then the tile's
                          // first position among its source's tokens naming l (the bases)
  int tiles;              // layout_tiles(max_tokens, max_topk) per source
  int* off;               // [R * L] first row of (s, l)
  int* recv_row;          // [R * Tmax * Kmax], -1 = slot not owned here (written by validate)
  int* src_of_row;        // [src_rows], -1 = alignment padding (written by bases)
  long long src_rows;
  unsigned long long* err_key;  // min-key of the first bad routing entry
  int* hist;              // [E] slots per expert over all ranks: every rank checks every rank's
                          // capacity, so all ranks report an overflow together (checked
                          // capacity mode only: checks_capacity)
  unsigned* blocks_done;  // validate's finished blocks (its last sets the bases)
  LayoutMeta* meta;
  LayoutMeta* host_meta;  // exact mode: the pinned, mapped readback the bases publish the meta
                          // to (nullptr in capacity mode)
  ErrorInfo* err;         // where errors are reported (meta->err or the group's mapped word)
  // expert_capacity C > 0 (0: off): every (source, local expert) run is C rows at
  // off = l * block_rows + s * C, and each source's slots past the C-th per expert are dropped.
  int expert_capacity;
  long long block_rows;
  // The drop pass masks them in the routing the ops follow: this rank's (kept_routing) and,
  // over nodes, the records of the sources whose tokens the rail brings here (node_rank of every
  // node; records_rw: the all-gathered records, nullptr on one node).
  int* kept_routing;
  int* records_rw;
  int node_size, node_rank, num_nodes;
  // Groups that span nodes: the rail kernel (after validate, before the scatter and the drop
  // pass, so it reads the records as gathered, the same on every rank). Token t of source s is
  // in the message to node n != node(s) iff its record names an expert of n; its packed row is
  // the number of such tokens before it (ascending token order).
  int* rail_out;          // [N][Tmax]: this rank's token t's row in its message to node n, -1
  int* rail_in;           // [N][Tmax]: token t of source m * G + node_rank, its row in the
                          // message that source sends this node (row m), -1
  int* rail_counts;       // [R][N]: c(s, n), the tokens of s in its message to n (0 at node(s))
  unsigned* rail_done;    // the rail kernel's finished blocks (its last checks the budget)
  long long rail_capacity;  // capacity mode: B, the rows of every message (an error past it:
                            // a.err); -1 in exact mode
};

// Groups that span nodes, before the dispatch's rail step: per remote node n, this rank's tokens
// with a slot on n, at their packed rows (rail_out), and their weights as max_topk 8-byte slots
// (the prob's bits first, zero elsewhere and where the slot's expert is not on n).
struct RailPackArgs {
  const int* rail_out;      // [N][Tmax]
  const int* routing;       // [T][topk] this rank's routing as the ops follow it
  int tokens, topk, max_topk, max_tokens, num_nodes, node, experts_per_node, num_experts;
  long long rail_rows;      // rows per message (a row past it is never written)
  const void* x;
  size_t row_bytes;
  const void* probs;        // nullptr: no weights
  int prob_bytes, probs_dense;
  char* rows_out;           // per remote node (m < node ? m : m - 1): rail_rows rows
  char* probs_out;          // per remote node: rail_rows x max_topk 8-byte slots
};

struct BarrierArgs {
  void* const* peers;     // device array [R] of window bases
  DeviceState* state;
  size_t sync_off;
  int num_ranks, rank;
  long long timeout_ns;
  unsigned call;          // call_signature() (< 2^kCallBits)
  ErrorInfo* err;         // group word (host-mapped)
};

// An output of an op, as bytes: what a stopped op fills with 0xFF (a NaN in every float dtype,
// bfloat16 and float16 alike), so that a step enqueued before the host saw the error computes
// on NaN, not on stale memory.
struct OutputSpan {
  void* ptr;
  long long bytes;
};
constexpr int kMaxOutputs = 2;

// What every op's kernel arguments take from its group, filled in one place (group.cc,
// group_args): the node's ranks (an LL group is one node), the window, the state, the error word.
struct GroupArgs {
  void* const* peers;       // device array [R] of window bases (peers[rank] = own window)
  WindowLayout win;
  DeviceState* state;
  ErrorInfo* err;           // group word (host-mapped)
  long long timeout_ns;
  int num_ranks, rank, num_local, num_experts, max_tokens, max_topk, hidden;  // ranks of the node
};

struct ExchangeArgs : GroupArgs {  // shared by dispatch, combine and combine_probs
  unsigned call;            // call_signature() of this op
  int send_warps;           // warps per CTA that push (0 on one rank, and in the combine)
  int expert_base;          // the node's first expert (0 on one node)
  int zero_padding;         // dispatch: this call zeroes the rows of no slot (the first pass)
  // the handle
  int topk;
  const int* own_routing;   // [T][topk] this rank's expert ids
  const int* tokens_of;     // [R] T_s as the ops use it (LayoutMeta::tokens)
  const int* recv_row;      // [R * Tmax * Kmax]
  const int* src_of_row;    // [src_rows]
  const long long* num_rows_dev;  // LayoutMeta::num_rows (N_d)
  long long rows;           // rows of recv / expert_out: N_d (exact) or the capacity
  int vec;                  // 1: 16-byte path, 0: element path
  OutputSpan outputs[kMaxOutputs];  // poisoned when the op stops (unused: bytes = 0)
};

struct DispatchArgs {
  ExchangeArgs ex;
  int dtype;                // ncclDataType_t of tokens
  const void* x;
  const void* probs;        // nullptr = no probs
  int prob_bytes;           // 2, 4 or 8
  int probs_dense;          // 0: [T, K] in slot order; 1: dense [T, E] (the expert's column)
  void* recv_x;
  void* recv_probs;
  // Groups that span nodes, the pass of a remote node's source: x and probs are the rail's
  // message, token t at row rail_rows[t] (-1: not in it), probs as max_topk 8-byte slots per row
  // (probs_dense unused). nullptr: row t of x and probs.
  const int* rail_rows;
};

struct CombineArgs {
  ExchangeArgs ex;
  int dtype;
  const void* expert_out;
  void* y;
  // Groups that span nodes, the pass of a remote node's source: token t's node partial goes to
  // row rail_rows[t] of y (the rail's message), none for -1. nullptr: row t.
  const int* rail_rows;
};

// Groups that span nodes: every node's values for this rank's tokens, back at the source, and
// what the kernels that finish there need of the handle.
struct NodeParts {
  const int* own_routing;   // [T][topk]
  int tokens, topk;
  int experts_per_node;     // G * L
  int num_nodes;
  const void* parts[kMaxRanks];  // node n's values for this rank's tokens
  const int* rows[kMaxRanks];    // token t's row in parts[n]: rows[n][t] (-1: absent, only past
                                 // a rail overflow), nullptr: row t
  const DeviceState* state;      // a stopped group: the output is poisoned (0xFF), as every
                                 // op's output
};

// Step 2b of the combine at the source: y[t] = round(0 + acc(node partial n) + ... over the
// nodes n ascending that token t has a slot on); parts are [T, hidden].
struct CombineNodesArgs {
  NodeParts nodes;
  int dtype;
  int vec;                  // 1: 16-byte packs (rows and pointers aligned)
  int hidden;
  void* y;
};

// The probs' backward at the source: grad[t, k] = node(expert)'s value (parts are [T, topk] in
// slot order, each node's holding its experts' slots); dense [T, E]: in the expert's column.
struct MergeProbsArgs {
  NodeParts nodes;
  int prob_bytes;
  int grad_dense;
  int num_experts;
  void* grad;
};

struct CombineProbsArgs {
  ExchangeArgs ex;
  int prob_bytes;
  int grad_dense;           // 0: [T, K]; 1: dense [T, E], zero where unrouted
  const void* grad_recv;    // [rows]
  void* grad;
  // Groups that span nodes, the pass of a remote node's source: token t's values go to row
  // rail_rows[t] of grad (the rail's message), none for -1. nullptr: row t.
  const int* rail_rows;
};

// LL (docs/design.md section 9). One handle's device views: what its layout kernel computes
// from this rank's routing (send side), and what its dispatch records for the combine (receive
// side). Per-slot arrays are [Tmax][Kmax] (slots past the handle's K hold -1).
struct LLHandleViews {
  int* ids;            // [Tmax][Kmax] this rank's expert ids
  int* pos;            // [Tmax][Kmax] the slot's row in its (expert, this source) run, -1 masked
  int* jslot;          // [Tmax][Kmax] the token's message slot at the slot's destination
  int* dpos;           // [Tmax][Kmax] the slot's destination among the token's, ascending
  int* ndst;           // [Tmax] distinct destination ranks of the token
  int* own_dpos;       // [Tmax] this rank's place among them, -1 if none
  int* cnt;            // [E] this rank's tokens per expert
  int* ndest;          // [R] this rank's tokens per destination rank
  // Written by the dispatch's receive side, read by the combine's send side:
  int* rn;             // [R] messages received from each source
  int* rtok;           // [R][Tmax] the token index of message (s, j)
  int* rrow;           // [R][Tmax][Kmax] expert-major: the output row of slot k, -1
  int* rdpos;          // [R][Tmax] rank-major: the message's dest_pos
  int* roff;           // [R + 1] rank-major: first row of each source
  int* own_row;        // [Tmax][Kmax] rows of this rank's own slots (rank-major: [t][0])
  unsigned long long* epochs;  // [2] the epoch of the handle's last dispatch / combine send
  float* weights;      // [Tmax][K]: an expert-major combine's weights, kept by its send-only
                       // launch for ncclEpComplete (the caller's may change in between)
};

struct LLArgs : GroupArgs {
  int rank_major;           // layout: 0 expert-major, 1 rank-major
  int payload;              // the dispatch payload's ncclEpPayloadDtype_t
  int dtype;                // token ncclDataType_t
  int tokens, topk;         // this rank's T and K
  int send, recv;           // phases of this launch (both: one fused op)
  LLHandleViews h;
};

struct LLLayoutArgs {
  LLArgs a;                 // send/recv unused
  const void* topk_idx;     // [T, K] int32/int64 with strides
  int idx_is_64;
  long long stride0, stride1;
};

struct LLDispatchArgs {
  LLArgs a;
  const void* x;            // [T, H]
  const float* w;           // [T, K] or nullptr
  void* recv_x;
  float* recv_scales;       // a payload with scales (FP8) only
  int* recv_count;          // [L] or [1]
  int* recv_src;            // expert-major [L][R * Tmax]
  int* recv_topk_idx;       // rank-major [R * Tmax][Kmax]
  float* recv_topk_w;       // rank-major, or nullptr
};

struct LLCombineArgs {
  LLArgs a;
  const void* expert_out;   // the dispatch's layout: token dtype, or fp32 with expert_fp32
  const float* w;           // expert-major [T, K]
  void* y;                  // [T, H]
  bool expert_fp32;         // expert_out fp32, rounded to a 16-bit token dtype as read
};

// ll_layout.cu, ll_dispatch.cu, ll_combine.cu (their shared parts: ll_common.cuh)
cudaError_t launch_ll_layout(const LLLayoutArgs& args, cudaStream_t stream);
cudaError_t launch_ll_dispatch(const LLDispatchArgs& args, cudaStream_t stream);
cudaError_t launch_ll_combine(const LLCombineArgs& args, cudaStream_t stream);
cudaError_t preload_ll();  // every LL kernel, and the layout's shared-memory opt-in

// barrier.cu
cudaError_t launch_resolve_peers(void* window /* ncclWindow_t */, int num_ranks, void** out_dev,
                                 cudaStream_t stream);
int lsa_team_size(void* comm /* ncclComm_t */);
cudaError_t launch_barrier(const BarrierArgs& args, cudaStream_t stream);
// Stops the group on the device when the watchdog's stop word holds an error (ranks of the node).
cudaError_t launch_latch_error(const ErrorInfo* stop, void* const* peers, size_t sync_off,
                               int num_ranks, int rank, DeviceState* state, cudaStream_t stream);

// layout.cu
// Packs this rank's routing into its record (header: the caller's shape; ids as int32) in every
// window and in the handle, and resets the layout's scratch. A shape out of bounds packs no ids.
cudaError_t launch_pack(const PackArgs& args, cudaStream_t stream);
// published (may be null): recorded once the bases (validate's last block) have written
// args.host_meta.
cudaError_t launch_layout(const LayoutArgs& args, cudaEvent_t published, cudaStream_t stream);
// The ids of a record ([tokens * topk] int32) into a contiguous int32 or int64 tensor.
cudaError_t launch_copy_topk(const int* ids, long long count, void* out, int out_is_64,
                             cudaStream_t stream);

// Groups that span nodes: the dispatch's rail messages (RailPackArgs).
cudaError_t launch_rail_pack(const RailPackArgs& args, cudaStream_t stream);

// dispatch.cu, combine.cu: one kernel each (the ops).
cudaError_t launch_dispatch(const DispatchArgs& args, cudaStream_t stream);
cudaError_t launch_combine(const CombineArgs& args, cudaStream_t stream);
cudaError_t launch_combine_probs(const CombineProbsArgs& args, cudaStream_t stream);
cudaError_t launch_combine_nodes(const CombineNodesArgs& args, cudaStream_t stream);
cudaError_t launch_merge_probs(const MergeProbsArgs& args, cudaStream_t stream);

// Load every kernel of the library before any runs: under lazy module loading a first launch
// may wait for the device, which must not happen while a local team's peer spins in another
// kernel of the same process (its layout kernels are launched while its barrier waits).
cudaError_t preload_layout();
cudaError_t preload_barrier();
cudaError_t preload_dispatch();
cudaError_t preload_combine();

}  // namespace nccl_ep
