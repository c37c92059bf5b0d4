/*
 * protocol.cuh: the wire format shared by every rank of a group: where things live in the
 * symmetric window, what the flag words hold, and the error word. Host and device code both
 * include it; nothing here depends on CUDA beyond __host__ __device__.
 *
 * NOTES:
 *  - Window (one buffer per rank, the same offsets on every rank; WindowLayout):
 *      sync     barrier flags u64 [kMaxRanks] (slot p written by rank p) + the abort slot
 *      channel  u64 {ready, credit} [channels][R]: ready[b][p] is written by p when its sends to
 *               this rank on channel b are in the ring; credit[b][p] by p when it has consumed
 *               this rank's sends on channel b (so the ring slots may be refilled)
 *      routing  int32 [2][R][rec_ints]: the routing records of handle creation, by the parity of
 *               the creation's number counted on the device (double buffered: see handle.cc)
 *      ring     rows [channels][R - 1][depth][chunk] of row_stride bytes, and 8-byte prob slots
 *               [channels][R - 1][depth][chunk][max_topk]: the staging of sender p at this rank
 *               is ring index q = (p - rank - 1) mod R, so a rank keeps no ring for itself
 *  - Flag words only grow, so nothing is ever reset and a CUDA graph replays correctly:
 *      barrier  (barrier epoch << kCallBits) | call signature
 *      ready    (op epoch << 32) | (call signature << 16) | chunks ready (kAllChunks = the last)
 *      credit   (op epoch << 32) | chunks consumed; ((op epoch + 1) << 32) at the end of an op,
 *               or at its start on a channel the op leaves idle
 *    Op epochs count dispatch/combine/combine_probs calls on the group (the same count on every
 *    rank, since the calls are collective); barrier epochs count handle creations.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "../include/nccl_ep_limits.h"

namespace nccl_ep {

constexpr int kMaxRanks = NCCL_EP_MAX_RANKS;  // barrier flags, per-token destination masks
static_assert(kMaxRanks <= 64, "a token's destination ranks are the bits of one uint64");
constexpr int kMaxChannels = NCCL_EP_MAX_NUM_SMS;  // num_sms: the CTAs of one op
// Slots of one token on one rank, min(top-k, local experts): one lane each in the warp-level
// kernels (top-k itself may be larger: they take a token's slots 32 a pass).
constexpr int kMaxTopk = NCCL_EP_MAX_SLOTS_PER_RANK;
static_assert(kMaxTopk == 32, "a token's slots on one rank are a lane each of one warp");
// Routing record: [T_s, K_s, kind, stopped] + Tmax * Kmax int32. stopped (groups that span nodes):
// 0, or the group rank + 1 whose device-side error stopped the sender's node, so that the next
// routing exchange tells every rank of every node.
constexpr int kRecordHeader = 4;
constexpr size_t kSyncBytes = 4096;

// Record kinds (header word 2): how rank s gave its routing, for the wording of its errors.
// From a routing map [T, E]: a token's routed experts, ascending, fill its K slots (-1 after the
// last). A token with n > K routed experts holds -1 - n (< -1: a range error) in slot K - 1.
enum RecordKind : int { kRecordTopkIdx = 0, kRecordRoutingMap = 1 };

// flags[kAbortSlot] of a rank's window: written (origin rank + 1) by any rank that gave up after
// a device-side error, so that every peer stops waiting and reports it (errors are sticky).
constexpr int kAbortSlot = kMaxRanks;
static_assert((kAbortSlot + 1) * sizeof(unsigned long long) <= kSyncBytes, "sync area");

// The collective calls of a group: what a wait belongs to, in signatures and messages.
enum OpKind : int {
  kOpCreateHandle = 1,
  kOpDispatch = 2,
  kOpCombine = 3,
  kOpCombineProbs = 4,
  kOpLLDispatch = 5,  // LL (docs/design.md section 9)
  kOpLLCombine = 6,
  kOpLLHandle = 7,    // an LL handle's local layout kernel (routing errors)
};

// What a rank was waiting for when a wait failed.
enum WaitKind : int {
  kWaitBarrier = 0,  // the handle-creation barrier
  kWaitReady = 1,    // a peer's sends of one chunk (the data this rank reads)
  kWaitCredit = 2,   // a peer's consumption of a ring slot (the space this rank writes)
};

// A call signature: which call (op kind, 3 bits), the element size of the probs it moves (2
// bits: 0 none, 1/2/3 for 2/4/8 bytes; ranks must agree on it, since a prob slot is copied as
// bytes), and which handle (its creation number on this rank, 11 bits: creation is collective,
// so the same handle has the same number on every rank). Flags carry it, so that a waiter that
// meets a peer in another call knows the ranks are not making the same calls.
constexpr int kCallBits = 16;
__host__ __device__ inline unsigned call_signature(OpKind op, int prob_bytes, unsigned handle_seq) {
  const unsigned size_code = prob_bytes == 2 ? 1u : prob_bytes == 4 ? 2u : prob_bytes == 8 ? 3u : 0u;
  return ((unsigned)op & 7u) | (size_code << 3) | ((handle_seq & 0x7ffu) << 5);
}
__host__ __device__ inline OpKind call_op(unsigned call) { return (OpKind)(call & 7u); }
// Bytes per prob the call moves: 0 (none), 2, 4 or 8.
__host__ __device__ inline int call_prob_bytes(unsigned call) {
  const unsigned code = (call >> 3) & 3u;
  return code == 0 ? 0 : 1 << code;
}
__host__ __device__ inline unsigned call_handle(unsigned call) { return (call >> 5) & 0x7ffu; }

constexpr unsigned kAllChunks = 0xffffu;  // ready count of a sender's last chunk (or of none)
constexpr int kMaxChunksPerChannel = (int)kAllChunks - 1;

__host__ __device__ inline unsigned long long ready_word(unsigned long long epoch, unsigned call,
                                                         unsigned count) {
  return (epoch << 32) | ((unsigned long long)(call & 0xffffu) << 16) | (count & 0xffffu);
}
__host__ __device__ inline unsigned long long credit_word(unsigned long long epoch,
                                                          unsigned count) {
  return (epoch << 32) | (count & 0xffffu);
}

struct ChannelFlags {
  unsigned long long ready;
  unsigned long long credit;
};

// LL groups (docs/design.md section 9): the window past the sync area. Flags u64
// [kLLFlagKinds][2 sets][R], each a count of arrivals: every CTA of a phase adds 1 to the flag
// of each peer it worked for, so set b's flag from rank p holds channels x (p's set-b ops done);
// a rank's own slot of a credit flag gets no adds (it is never waited for), and its own combine
// ready slot a relaxed add from a fused combine (ll_common.cuh, OwnArrival).
// In the receiver's window kLLDispReady[b][s] (source s's dispatch sends of set b are in) and
// kLLCombCredit[b][s] (source s consumed its combine set b); in the source's window
// kLLDispCredit[b][d] (d consumed its dispatch set b) and kLLCombReady[b][d] (d's combine rows
// for this source are in set b). Then, per set b:
//   count words u64 [2][R]: (epoch << 32) | the messages source s sent this rank in set b's
//            latest dispatch, written after the source's credit wait (so op epoch - 2's receive
//            has read it) and before its sends: a receiver polls it with the ready flag (in
//            flight together) and takes it once its epoch is the op's
//   counts   int32 [2][R][count_stride]: source s's tokens per local expert of this rank
//            (expert-major only)
//   messages [2][R][Tmax] of msg_bytes: header (LLHeader + ids, positions, weights [Kmax]) and
//            the payload (token row, or FP8 row + its scales)
//   combine  [2][Tmax][Kmax] rows of comb_row bytes, at the source
// Flags only grow (device-side counts: a replayed graph counts on).
enum LLFlagKind : int { kLLDispReady = 0, kLLDispCredit = 1, kLLCombReady = 2, kLLCombCredit = 3 };
constexpr int kLLFlagKinds = 4;
constexpr int kLLGroupElems = NCCL_EP_LL_PACK_ELEMS;  // elements per lane access (16 bytes of
                                                      // bf16; ll_common.cuh's Raw packs)
// The LL buffer sets (nccl_ep_limits.h): the i-th op of a kind (epochs count from 1) uses set
// i mod kLLSets, and its send waits until every peer consumed op i - kLLSets (the set's previous
// op). The window holds kLLSets of every LL area; the host allows as many ops of a kind in flight
// (ll.cc, check_op).
constexpr int kLLSets = NCCL_EP_LL_BUFFER_SETS;
__host__ __device__ inline int ll_set(unsigned long long epoch) {
  return (int)(epoch % kLLSets);
}
constexpr int kFp8Block = NCCL_EP_FP8_BLOCK;  // columns per FP8 scale
constexpr int kFp8BlockPacks = kFp8Block / kLLGroupElems;  // lanes of one block's packs
static_assert(kFp8Block % kLLGroupElems == 0 && kFp8BlockPacks <= 32 &&
                  (kFp8BlockPacks & (kFp8BlockPacks - 1)) == 0,
              "an FP8 block's packs are a power-of-two group of a warp's lanes");
constexpr float kFp8Max = NCCL_EP_FP8_MAX;             // the largest finite float8 e4m3
constexpr float kFp8AmaxFloor = NCCL_EP_FP8_AMAX_FLOOR;  // a block's amax is at least this

struct LLHeader {
  int token;      // the token's index at its source
  int dest_pos;   // this receiver's place among the token's destination ranks, ascending
  int topk;       // the source's K
  int pad;
  // then int ids[Kmax], int pos[Kmax] (row in the (expert, source) run for slots of this
  // receiver, else -1), float weights[Kmax]
};

struct LLWindow {
  size_t flag_off, count_word_off, count_off, msg_off, comb_off;
  size_t msg_bytes;   // header + payload, a multiple of 16
  size_t hdr_bytes;   // LLHeader and its three [Kmax] arrays, rounded up to 16
  size_t comb_row;    // bytes of a combine row (hidden x token element), rounded up to 16
  int count_stride;   // local experts, rounded up to 4
  int max_tokens;     // T_max
};

// Offsets of the window, the same on every rank (computed once at group creation).
struct WindowLayout {
  size_t sync_off;       // barrier flags + abort slot
  size_t channel_off;    // ChannelFlags [channels][R]
  size_t routing_off;    // int32 [2][R][rec_ints]
  size_t ring_off;       // rows [channels][R - 1][depth][chunk]
  size_t ring_prob_off;  // 8-byte slots [channels][R - 1][depth][chunk][max_topk]
  size_t bytes;          // the whole window
  size_t row_stride;     // bytes of a ring row: a token row rounded up to 16
  int channels;          // one per CTA of an op: the SM budget
  int depth;             // ring slots per (channel, peer)
  int chunk;             // tokens per ring slot
  int rec_ints;          // kRecordHeader + Tmax * Kmax, rounded up to a multiple of 4
  int num_ranks, max_topk;
  LLWindow ll;           // LL groups only (the HT fields above are then unused)

  __host__ __device__ size_t ring_items(int b, int q, int slot) const {
    return (((size_t)b * (num_ranks - 1) + q) * depth + slot) * chunk;
  }
};

// Device-side state of a group, in its local device memory (never in the window).
struct DeviceState {
  unsigned long long own_claimed;    // the dispatch's own tokens claimed so far by this rank's
                                     // receivers (a pool of the whole grid; the last CTA resets it)
  unsigned long long barrier_epoch;  // handle-creation barriers run so far
  unsigned long long op_epoch;       // dispatch/combine/combine_probs calls run so far
  unsigned long long failed;         // set (origin rank + 1) once the group holds an error
  unsigned int done_ctas;            // CTAs of the running op that finished (the last resets it)
  unsigned int start_verdict;         // the op's start check of the host-mapped error word, read
                                     // by one CTA per op (exchange.cuh start_verdict): (epoch +
                                     // 1) tag << 2 | 1 claimed, 2 no error, 3 an error
  // LL: per CTA of an op, the dispatches / combines it sent so far (each CTA reads and advances
  // its own: no CTA waits for the others to have read it).
  unsigned long long ll_epoch[2][kMaxChannels];
};

enum ErrorCode : int {
  kErrNone = 0,
  kErrExpertRange = 1,     // rank, token, slot, value
  kErrDuplicateExpert = 2, // rank, token, value (expert)
  kErrTopkMismatch = 3,    // value = this rank's K; LayoutMeta::ks holds every rank's K
  kErrCapacity = 4,        // rank, value = rows needed, extra = capacity
  kErrTimeout = 5,         // rank (waiter), token = peer, slot = OpKind, aux = WaitKind,
                           // value = epoch, extra = ms, where = (channel << 32) | chunk
  kErrShape = 6,           // rank, slot = 0 (tokens) / 1 (top-k), value = T or K, extra = bound
  kErrPeerAbort = 7,       // rank (this one), token = the rank whose error stopped the group,
                           // slot = OpKind
  kErrCallMismatch = 8,    // rank (this one), token = peer, value = this rank's call signature,
                           // extra = the peer's (flags carry them)
  kErrRemoteAbort = 9,     // groups that span nodes: rank (this one), token = the group rank whose
                           // error stopped a node, value = the rank whose record said so
  kErrNcclTimeout = 10,    // groups that span nodes, in the host watchdog's own word: rank (this
                           // one), slot = OpKind, aux = NcclStep, value = the timeout in ms
  kErrNcclFailed = 11,     // the same, when NCCL reported an asynchronous error (a peer's
                           // process gone, its sockets closed) first: value = the ncclResult_t
  kErrRailCapacity = 12,   // groups that span nodes, capacity mode: rank = the source, token =
                           // the remote node, value = its tokens with a slot there, extra =
                           // rail_capacity
};

// Written once per error word: the single winner of `claim` fills the fields, then publishes
// `code` last (system-scope fence in between), so a host reader that sees code != 0 sees the rest.
struct ErrorInfo {
  int code;
  int claim;
  int rank;
  int token;
  int slot;
  int aux;                 // kErrExpertRange / kErrShape: the record kind; kErrTimeout: WaitKind
  long long value;
  long long extra;
  long long where;         // kErrTimeout: (channel << 32) | chunk, -1 when not in a channel
};
static_assert(sizeof(ErrorInfo) == 48, "ErrorInfo layout");

// Per-handle results of the layout; in exact mode the bases also write them into the
// handle's mapped host buffer (read once by the host).
struct LayoutMeta {
  ErrorInfo err;           // exact mode: layout errors land here (capacity: the group's word)
  long long num_rows;      // N_d including alignment padding
  int ks[kMaxRanks];       // K of every rank (for the top-k mismatch message)
  int ts[kMaxRanks];       // T of every rank as given (may be out of bounds: an error)
  int tokens[kMaxRanks];   // T of every rank that the ops use (0 for a record out of bounds)
  // Groups that span nodes (the rail kernel, layout.cu): per node n, the tokens of this rank
  // with a slot on n (rail_send[n]), and those of source n * G + node_rank with a slot on this
  // rank's node (rail_recv[n]): exact mode's message sizes. 0 at this rank's own node.
  int rail_send[kMaxRanks];
  int rail_recv[kMaxRanks];
  long long tokens_per_expert[1];  // [L], flexible tail
};

__host__ __device__ inline size_t layout_meta_bytes(int num_local_experts) {
  return offsetof(LayoutMeta, tokens_per_expert) + sizeof(long long) * (size_t)num_local_experts;
}

}  // namespace nccl_ep
