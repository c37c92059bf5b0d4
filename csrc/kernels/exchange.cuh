/*
 * exchange.cuh: the exchange engine, written once for every op (dispatch, combine,
 * combine_probs): channels, chunks, ring slots, and the ready / credit protocol with timeouts.
 *
 *   channel b   CTA b of every rank. An op uses A channels of the budget C (the grid): one per
 *               kMinChannelTokens tokens of the largest rank's T, at most C (plan_channels; every
 *               rank computes the same A from the same T_s). Channel b < A of a rank's T tokens is
 *               [T * b / A, T * (b+1) / A); it moves in chunks of `chunk` tokens, chunk j to ring
 *               slot j mod depth of the receiving rank's ring for (channel b, this sender). CTAs
 *               b >= A exit at once, after freeing their rings for the next op (idle_channel).
 *   senders     warps [0, send_warps) of the CTA: for each round j, wait until every peer freed
 *               the slot (credit), write the chunk (Op::send_round), then post ready(j + 1)
 *               (kAllChunks for the last chunk, or at once when there is none).
 *   interleaved (Op::kInterleaved, the combine) every warp sends and receives: round r is the
 *               send of chunk r and the receive of chunk r - lag (lag 1; 0 for a CTA that sends
 *               nothing), one list of items over all warps, between two __syncthreads.
 *   receivers   the other warps: Op::recv_prologue once; per round j, Op::recv_local (work that
 *               needs no peer), wait for every peer's ready(j + 1), Op::recv_remote, then give the
 *               slot back (credit j + 1; the last one (op epoch + 1, 0): the whole ring is free for
 *               the next op). A peer with no chunk still posts its ready (the call signature is
 *               checked on every channel of every op).
 *
 * NOTES:
 *  - Who owns the tokens of a channel: dispatch sends this rank's tokens and receives the peers';
 *    combine sends partial sums of the peers' tokens and receives its own tokens' partials
 *    (Op::kSendsOwnTokens). Both sides compute the same chunks from the all-gathered T_s.
 *  - No deadlock: every wait points back to earlier work of the peers (split roles: credits for
 *    chunk j - depth and ready for chunk j, sent by senders that need only credits; interleaved:
 *    see interleaved_role), and every CTA of every rank is resident (grid <= SMs, one CTA per SM).
 *  - Memory order: a role's warps write, meet at a barrier (named, or __syncthreads when every
 *    warp has both roles), then one thread fences at system scope and release-stores the flag;
 *    the peer's acquire-load of the flag precedes its reads (the barrier carries it to the other
 *    warps).
 *  - Waits time out (global timer) into kErrTimeout, see a peer's abort, and stop when another
 *    CTA of this rank failed: every error stops the whole group (sticky), and every role leaves
 *    its loop together (the stop flag is read after the role's barrier).
 *  - What an op costs per CTA is what grows with the budget, so nothing a CTA does alone at its
 *    start may take long: the group's error word is host-mapped, and its reads over PCIe queue
 *    one behind another, so one CTA reads it per op and the others take its verdict from device
 *    memory (start_verdict); the work picks the channels, not the budget (plan_channels).
 */
#pragma once

#include <cstdio>

#include "api.cuh"
#include "device.cuh"

// Per-role timers (EP_TRACE builds, device.cuh): each role's leader sums per op the time it
// waited for peers and the time its warps worked, ops add their items' phases (ItemTimers: the
// combine's token sums), and CTA 0 and the op's last active channel of every rank print one
// line per op ("EP_TRACE op=...").

namespace nccl_ep {

constexpr int kSendBarrier = 1;  // named barrier ids (0 is __syncthreads)
constexpr int kRecvBarrier = 2;

// How an op splits every rank's tokens: `channels` active channels (CTAs [0, channels)) of
// chunks of `chunk` tokens. It depends on the T_s alone, so every rank plans the same.
struct ChannelPlan {
  int channels, chunk;
};

struct ExchangeShared {
  unsigned long long epoch;   // this op's epoch
  ChannelPlan plan;
  int tokens[kMaxRanks];      // T_s of every rank
  int send_chunks[kMaxRanks]; // chunks this CTA's channel sends to / receives from each peer
  int recv_chunks[kMaxRanks]; // (0 for this rank itself)
  int send_rounds, recv_rounds;  // the most of each, over the peers (receive: this rank too)
  int send_stop, recv_stop;   // set by a role's leader when a wait failed
  int start_stop;             // the group already held an error when the op started
  int end_stop;               // ... or holds one when this CTA's roles are done
  int claimed;                // items of the current round claimed by warps (RoundTokens)
  int rows_sh[kMaxWarps][kMaxTopk];   // per warp: the rows of the current item
  int slots_sh[kMaxWarps][kMaxTopk];  // and their slots k
  // EP_TRACE: ns per op, summed over rounds by each role's leader; the token sums' phases
  unsigned long long send_wait_ns, send_work_ns, recv_local_ns, recv_wait_ns, recv_remote_ns;
  ItemTimers phases;
};

__device__ __forceinline__ unsigned long long trace_clock() {
  return kTrace ? global_timer_ns() : 0ull;
}

// *sum += now - since, in trace builds.
__device__ __forceinline__ void trace_add(unsigned long long* sum, unsigned long long since) {
  if (kTrace) *sum += global_timer_ns() - since;
}

struct ChunkRange {
  int begin, end;  // tokens [begin, end); empty when begin >= end
  __device__ int size() const { return end > begin ? end - begin : 0; }
};

// Tokens a channel carries at the least before an op takes one more channel of the budget.
constexpr int kMinChannelTokens = 4;

// The op's plan from every rank's T (tokens[0, num_ranks)). A group of one rank has no ring: its
// channel is one round (chunks only pace the peers' transfers).
__device__ __forceinline__ ChannelPlan plan_channels(const int* tokens, const ExchangeArgs& e) {
  int most = 0;
  for (int s = 0; s < e.num_ranks; ++s) most = max(most, tokens[s]);
  const int channels =
      max(1, min(e.win.channels, (most + kMinChannelTokens - 1) / kMinChannelTokens));
  const int chunk = e.num_ranks == 1 ? max(1, (most + channels - 1) / channels) : e.win.chunk;
  return {channels, chunk};
}

// Channel b's tokens of a rank's `tokens` (none on an idle channel).
__device__ __forceinline__ void channel_tokens(int tokens, const ChannelPlan& c, int b,
                                               int* begin, int* end) {
  if (b >= c.channels) {
    *begin = *end = 0;
    return;
  }
  *begin = (int)((long long)tokens * b / c.channels);
  *end = (int)((long long)tokens * (b + 1) / c.channels);
}

__device__ __forceinline__ int chunks_of(int tokens, const ChannelPlan& c, int b) {
  int cb, ce;
  channel_tokens(tokens, c, b, &cb, &ce);
  return (ce - cb + c.chunk - 1) / c.chunk;
}

__device__ __forceinline__ ChunkRange chunk_of(int tokens, const ChannelPlan& c, int b, int j) {
  int cb, ce;
  channel_tokens(tokens, c, b, &cb, &ce);
  const int begin = cb + j * c.chunk;
  return {begin, min(ce, begin + c.chunk)};
}

// The ring of sender `from` at rank `at` (a rank keeps no ring for itself).
__device__ __forceinline__ int ring_index(int from, int at, int num_ranks) {
  return (from - at - 1 + num_ranks) % num_ranks;
}

__device__ __forceinline__ char* ring_row(void* base, const WindowLayout& w, int b, int q, int j,
                                          int i) {
  return reinterpret_cast<char*>(base) + w.ring_off +
         (w.ring_items(b, q, j % w.depth) + i) * w.row_stride;
}

__device__ __forceinline__ char* ring_prob(void* base, const WindowLayout& w, int b, int q, int j,
                                           int i, int k) {
  return reinterpret_cast<char*>(base) + w.ring_prob_off +
         ((w.ring_items(b, q, j % w.depth) + i) * w.max_topk + k) * 8;
}

// Flags of (channel b, peer p) in the window at `base`.
__device__ __forceinline__ ChannelFlags* channel_flags(void* base, const WindowLayout& w, int b,
                                                       int p) {
  return reinterpret_cast<ChannelFlags*>(reinterpret_cast<char*>(base) + w.channel_off) +
         (size_t)b * w.num_ranks + p;
}

// The slot rows of token (s, t) on this rank: recv_row[s][t][0 .. max_topk).
__device__ __forceinline__ const int* token_rows(const ExchangeArgs& e, int s, int t) {
  return e.recv_row + ((size_t)s * e.max_tokens + t) * e.max_topk;
}

// Lane k's row here of token (s, t), of its first 32 slots (-1: none, or past top-k).
__device__ __forceinline__ int slot_row(const ExchangeArgs& e, int s, int t, int lane) {
  return lane < e.topk ? token_rows(e, s, t)[lane] : -1;
}

// The rows here of a token, compacted in ascending k into rows_out[] (and their slots k into
// slots_out[]), skipping rows past the output (capacity overflow, already reported): `row` is
// lane k's of slot k (slot_row), later slots (top-k > 32: routing maps) are read from `rows`
// (token_rows) 32 a pass. At most kMaxTopk rows: a token has min(top-k, local experts) slots
// on a rank, which the group's config bounds. Returns how many, or -1 when the token has no slot
// here at all. Warp-wide.
__device__ __forceinline__ int compact_rows(const ExchangeArgs& e, const int* rows, int row,
                                            int lane, int* rows_out, int* slots_out) {
  int n = 0;
  bool any = false;
  for (int k0 = 0;;) {
    any |= __ballot_sync(0xffffffffu, row >= 0) != 0;
    const unsigned usable = __ballot_sync(0xffffffffu, row >= 0 && row < e.rows);
    if ((usable >> lane) & 1u) {
      const int j = n + __popc(usable & ((1u << lane) - 1u));
      rows_out[j] = row;
      slots_out[j] = k0 + lane;
    }
    n += __popc(usable);
    k0 += 32;
    if (k0 >= e.topk) break;
    row = k0 + lane < e.topk ? rows[k0 + lane] : -1;
  }
  __syncwarp();
  return any ? n : -1;
}

__device__ __forceinline__ int collect_rows(const ExchangeArgs& e, int s, int t, int lane,
                                            int* rows_out, int* slots_out) {
  return compact_rows(e, token_rows(e, s, t), slot_row(e, s, t, lane), lane, rows_out,
                      slots_out);
}

// Records an error of this rank and stops the group (every peer is told).
__device__ __forceinline__ void fail(const ExchangeArgs& e, int code, int token, int slot,
                                     long long value, long long extra, int aux, long long where) {
  raise_error(e.err, code, e.rank, token, slot, value, extra, aux, where);
  stop_group(e.peers, e.win.sync_off, e.num_ranks, &e.state->failed,
             (unsigned long long)e.rank + 1);
}

// Spins (one thread) until ok(*word) holds. False when the group stopped meanwhile: a timeout or
// call mismatch here (recorded), a peer's abort (recorded), or another CTA's failure.
// `mismatch(v)` returns the peer's call signature when the word shows another call, else -1.
template <typename Ok, typename Mismatch>
__device__ bool wait_word(const ExchangeArgs& e, const unsigned long long* word, Ok ok,
                          Mismatch mismatch, WaitKind kind, int peer, int b, int j,
                          unsigned long long epoch) {
  const unsigned long long* abort_word = reinterpret_cast<const unsigned long long*>(
      reinterpret_cast<const char*>(e.peers[e.rank]) + e.win.sync_off) + kAbortSlot;
  const unsigned long long start = global_timer_ns();
  for (int spins = 0;; ++spins) {
    const unsigned long long v = ld_acquire_sys(word);
    const long long other = mismatch(v);
    if (other >= 0) {
      fail(e, kErrCallMismatch, peer, (int)call_op(e.call), (long long)e.call, other, 0, -1);
      return false;
    }
    if (ok(v)) return true;
    if ((spins & 255) != 255) continue;
    if (ld_volatile_u64(&e.state->failed) != 0) return false;
    const unsigned long long by = ld_acquire_sys(abort_word);
    if (by != 0) {
      raise_error(e.err, kErrPeerAbort, e.rank, (int)by - 1, (int)call_op(e.call), 0, 0);
      stop_group(e.peers, e.win.sync_off, e.num_ranks, &e.state->failed, by);
      return false;
    }
    if ((long long)(global_timer_ns() - start) > e.timeout_ns) {
      fail(e, kErrTimeout, peer, (int)call_op(e.call), (long long)epoch,
           e.timeout_ns / 1000000, (int)kind, ((long long)b << 32) | (unsigned)j);
      return false;
    }
  }
}

// Waits for peer p's chunks [0, need) of this op on channel b (need = kAllChunks: all of them).
__device__ __forceinline__ bool wait_ready(const ExchangeArgs& e, unsigned long long epoch,
                                           int b, int p, unsigned need) {
  const unsigned long long* word = &channel_flags(e.peers[e.rank], e.win, b, p)->ready;
  const unsigned call = e.call & 0xffffu;
  return wait_word(
      e, word,
      [&](unsigned long long v) {
        // A peer already in a later op has finished this one (it saw this rank's sends).
        return (v >> 32) > epoch || ((v >> 32) == epoch && (unsigned)(v & 0xffffu) >= need);
      },
      [&](unsigned long long v) -> long long {
        // Every posted ready counts >= 1: a count of 0 is a word nobody wrote yet (op epoch 0 on
        // a fresh window), not another call.
        const unsigned other = (unsigned)(v >> 16) & 0xffffu;
        const bool posted = (v & 0xffffu) != 0;
        return posted && (v >> 32) == epoch && other != call ? (long long)other : -1;
      },
      kWaitReady, p, b, (int)need - 1, epoch);
}

// Waits until peer d freed the ring slot of chunk j (its chunk j - depth of this op, or its whole
// ring at the end of the previous op).
__device__ __forceinline__ bool wait_credit(const ExchangeArgs& e, unsigned long long epoch,
                                            int b, int d, int j) {
  const unsigned long long* word = &channel_flags(e.peers[e.rank], e.win, b, d)->credit;
  const unsigned long long need =
      credit_word(epoch, j < e.win.depth ? 0u : (unsigned)(j - e.win.depth + 1));
  return wait_word(
      e, word, [&](unsigned long long v) { return v >= need; },
      [](unsigned long long) -> long long { return -1; }, kWaitCredit, d, b, j, epoch);
}

__device__ __forceinline__ void post_ready(const ExchangeArgs& e, unsigned long long epoch, int b,
                                           int p, unsigned count) {
  st_release_sys(&channel_flags(e.peers[p], e.win, b, e.rank)->ready,
                 ready_word(epoch, e.call, count));
}

__device__ __forceinline__ void post_credit(const ExchangeArgs& e, int b, int p,
                                            unsigned long long value) {
  st_release_sys(&channel_flags(e.peers[p], e.win, b, e.rank)->credit, value);
}

// This channel's chunk counts per peer, from the tokens of whoever owns them: dispatch sends this
// rank's tokens and receives the peers'; combine sends for the peers' tokens and receives its
// own. Thread p of the CTA fills entry p (after sh.tokens is filled).
template <class Op>
__device__ __forceinline__ void count_chunks(ExchangeShared& sh, const ExchangeArgs& e, int p) {
  const int mine = sh.tokens[e.rank], theirs = sh.tokens[p];
  sh.send_chunks[p] =
      p == e.rank ? 0 : chunks_of(Op::kSendsOwnTokens ? mine : theirs, sh.plan, blockIdx.x);
  sh.recv_chunks[p] = chunks_of(Op::kSendsOwnTokens ? theirs : mine, sh.plan, blockIdx.x);
}

// The receiving leader's last step: peers that sent nothing on this channel have their call
// checked, then their ring freed for the next op (peers with chunks got that with their last
// chunk's credit).
__device__ __forceinline__ void free_idle_rings(const ExchangeArgs& e, const ExchangeShared& sh,
                                                unsigned long long epoch, int b) {
  for (int p = 0; p < e.num_ranks; ++p) {
    if (p == e.rank || sh.recv_chunks[p] != 0) continue;
    if (!wait_ready(e, epoch, b, p, kAllChunks)) return;
    post_credit(e, b, p, credit_word(epoch + 1, 0));
  }
}

template <class Op>
__device__ void sender_role(const typename Op::Args& a, ExchangeShared& sh, int warp, int nwarps,
                            int lane) {
  const ExchangeArgs& e = Op::ex(a);
  const int b = blockIdx.x, threads = nwarps * 32;
  const bool leader = threadIdx.x == 0;  // senders are warps [0, send_warps)
  const unsigned long long epoch = sh.epoch;
  if (leader) {
    for (int p = 0; p < e.num_ranks; ++p)
      if (p != e.rank && sh.send_chunks[p] == 0) post_ready(e, epoch, b, p, kAllChunks);
  }
  for (int j = 0; j < sh.send_rounds; ++j) {
    unsigned long long since = trace_clock();
    if (leader) {
      sh.claimed = 0;
      bool ok = true;
      for (int p = 0; p < e.num_ranks && ok; ++p)
        if (j < sh.send_chunks[p]) ok = wait_credit(e, epoch, b, p, j);
      if (!ok) sh.send_stop = 1;
      trace_add(&sh.send_wait_ns, since);
    }
    named_barrier(kSendBarrier, threads);
    if (*(volatile int*)&sh.send_stop) break;
    since = trace_clock();
    Op::send_round(a, sh, b, j, warp, nwarps, lane);
    named_barrier(kSendBarrier, threads);
    if (leader) {
      trace_add(&sh.send_work_ns, since);
      fence_acq_rel_sys();
      for (int p = 0; p < e.num_ranks; ++p) {
        const int n = sh.send_chunks[p];
        if (j < n) post_ready(e, epoch, b, p, j + 1 == n ? kAllChunks : (unsigned)j + 1);
      }
    }
  }
}

// Both roles on every warp (Op::kInterleaved, the combine): round r sends chunk r and receives
// chunk r - lag as one list of items spread over all the CTA's warps (Op::round), so no warp idles
// while the other role waits or has less to do. lag = 1 while this CTA sends (a peer's ready for
// chunk r - 1 was posted at the end of its round r - 1); 0 when it sends nothing.
// NOTES: no wait cycle. Order round r of a CTA by 2r - lag. Ready(j) is posted at the end of
// the sender's round j (lag 1, as it sends): 2j - 1, below the waiting round's 2(j + lag) - lag.
// The credit for slot reuse of chunk r comes from the receiver's round r - depth + lag':
// 2(r - depth + lag') - lag' <= 2r - 3 < 2r - 1 for depth >= 2 (group creation refuses 1).
// Every wait points to a strictly earlier step, so every round runs.
template <class Op>
__device__ void interleaved_role(const typename Op::Args& a, ExchangeShared& sh, int warp,
                                 int nwarps, int lane) {
  const ExchangeArgs& e = Op::ex(a);
  const int b = blockIdx.x;
  const bool leader = threadIdx.x == 0;
  const unsigned long long epoch = sh.epoch;
  const int lag = sh.send_rounds > 0 ? 1 : 0;
  const int rounds = max(sh.send_rounds, sh.recv_rounds + lag);
  if (leader) {
    for (int p = 0; p < e.num_ranks; ++p)
      if (p != e.rank && sh.send_chunks[p] == 0) post_ready(e, epoch, b, p, kAllChunks);
  }
  for (int r = 0; r < rounds; ++r) {
    const int js = r < sh.send_rounds ? r : -1;
    const int jr = r - lag >= 0 && r - lag < sh.recv_rounds ? r - lag : -1;
    unsigned long long since = trace_clock();
    if (leader) {
      sh.claimed = 0;
      bool ok = true;
      for (int p = 0; p < e.num_ranks && ok; ++p) {
        if (p == e.rank) continue;
        if (js >= 0 && js < sh.send_chunks[p]) ok = wait_credit(e, epoch, b, p, js);
        if (ok && jr >= 0 && jr < sh.recv_chunks[p])
          ok = wait_ready(e, epoch, b, p, (unsigned)jr + 1);
      }
      if (!ok) sh.recv_stop = 1;
      trace_add(&sh.recv_wait_ns, since);
    }
    __syncthreads();
    if (*(volatile int*)&sh.recv_stop) break;
    since = trace_clock();
    Op::round(a, sh, b, js, jr, warp, nwarps, lane);
    __syncthreads();
    if (leader) {
      trace_add(&sh.recv_remote_ns, since);
      fence_acq_rel_sys();
      for (int p = 0; p < e.num_ranks; ++p) {
        if (p == e.rank) continue;
        const int ns = sh.send_chunks[p], nr = sh.recv_chunks[p];
        if (js >= 0 && js < ns) post_ready(e, epoch, b, p, js + 1 == ns ? kAllChunks : (unsigned)js + 1);
        if (jr >= 0 && jr + 1 < nr) post_credit(e, b, p, credit_word(epoch, (unsigned)jr + 1));
        else if (jr >= 0 && jr + 1 == nr) post_credit(e, b, p, credit_word(epoch + 1, 0));
      }
    }
  }
  if (leader && !sh.recv_stop) free_idle_rings(e, sh, epoch, b);
}

template <class Op>
__device__ void receiver_role(const typename Op::Args& a, ExchangeShared& sh, int warp,
                              int nwarps, int lane) {
  const ExchangeArgs& e = Op::ex(a);
  const int b = blockIdx.x, threads = nwarps * 32;
  const bool leader = warp == 0 && lane == 0;
  const unsigned long long epoch = sh.epoch;
  Op::recv_prologue(a, sh, b, warp, nwarps, lane);
  for (int j = 0; j < sh.recv_rounds; ++j) {
    unsigned long long since = trace_clock();
    Op::recv_local(a, sh, b, j, warp, nwarps, lane);
    if (leader) {
      trace_add(&sh.recv_local_ns, since);  // the leader's own share of the local work
      since = trace_clock();
      bool ok = true;
      for (int p = 0; p < e.num_ranks && ok; ++p)
        if (p != e.rank && j < sh.recv_chunks[p]) ok = wait_ready(e, epoch, b, p, (unsigned)j + 1);
      if (!ok) sh.recv_stop = 1;
      trace_add(&sh.recv_wait_ns, since);
    }
    named_barrier(kRecvBarrier, threads);
    if (*(volatile int*)&sh.recv_stop) return;
    since = trace_clock();
    Op::recv_remote(a, sh, b, j, warp, nwarps, lane);
    named_barrier(kRecvBarrier, threads);
    if (leader) {
      trace_add(&sh.recv_remote_ns, since);
      for (int p = 0; p < e.num_ranks; ++p) {
        if (p == e.rank) continue;
        const int n = sh.recv_chunks[p];
        if (j + 1 < n) post_credit(e, b, p, credit_word(epoch, (unsigned)j + 1));
        else if (j + 1 == n) post_credit(e, b, p, credit_word(epoch + 1, 0));
      }
    }
  }
  if (leader) free_idle_rings(e, sh, epoch, b);
}

// Fills every output of the op with 0xFF bytes (NaN), all of it from this CTA: the error path
// only, where a CTA that sees the group stopped cannot know which rows the others will write.
__device__ inline void poison_outputs(const ExchangeArgs& e) {
  for (int o = 0; o < kMaxOutputs; ++o) {
    unsigned char* p = static_cast<unsigned char*>(e.outputs[o].ptr);
    const long long n = e.outputs[o].bytes;
    if (n <= 0) continue;
    // Bytes up to the first 16-byte boundary, 16-byte stores, then the tail.
    const long long head = min(n, (long long)((16 - ((uintptr_t)p & 15)) & 15));
    const long long vecs = (n - head) / 16;
    for (long long i = threadIdx.x; i < head; i += blockDim.x) p[i] = 0xFF;
    uint4* v = reinterpret_cast<uint4*>(p + head);
    for (long long i = threadIdx.x; i < vecs; i += blockDim.x)
      v[i] = make_uint4(~0u, ~0u, ~0u, ~0u);
    for (long long i = head + vecs * 16 + threadIdx.x; i < n; i += blockDim.x) p[i] = 0xFF;
  }
}

// Whether the group's error word (host-mapped) holds an error at the op's start, read once per op:
// the first CTA to arrive claims the read and publishes its verdict in the group's device state
// (DeviceState::pad: the epoch's tag << 2 | 1 claimed, | 2 no error, | 3 an error), the other
// CTAs wait for it there. One thread per CTA. Every CTA of the op takes the same verdict.
// NOTES: a read of mapped host memory is a PCIe round trip, and the reads of many CTAs queue one
// behind another: a read per CTA made a fixed cost that grew with the budget, at every batch
// size. The claimer is running and waits for nothing, so the wait ends; should it not (in
// timeout_ns), the CTA reads the word itself.
__device__ __forceinline__ bool start_verdict(const ExchangeArgs& e, unsigned long long epoch) {
  unsigned* word = &e.state->start_verdict;
  const unsigned tag = (unsigned)((epoch + 1) & 0x3fffffffull) << 2;  // != the last op's, != 0
  unsigned v = *(volatile unsigned*)word;
  if ((v & ~3u) != tag && atomicCAS(word, v, tag | 1u) == v) {
    const bool pending = ld_volatile_int(&e.err->code) != kErrNone;
    atomicExch(word, tag | (pending ? 3u : 2u));
    return pending;
  }
  const unsigned long long start = global_timer_ns();
  for (int spins = 0;; ++spins) {
    v = *(volatile unsigned*)word;
    if ((v & ~3u) == tag && (v & 2u) != 0) return (v & 1u) != 0;
    if ((spins & 255) == 255 && (long long)(global_timer_ns() - start) > e.timeout_ns)
      return ld_volatile_int(&e.err->code) != kErrNone;
  }
}

// A channel the op does not use (b >= the plan's channels, on every rank): nothing to send or
// receive, but the peers' next op that uses it waits for this rank's credit of the ring's end
// (credit_word(epoch + 1, 0), exchange's only wait for an earlier op). This rank is in op
// `epoch`, so its earlier ops are done with every ring: it posts that credit at once. No flag
// of this op is posted on the channel, and nobody waits for one (the plan is the same on every
// rank). A peer that reads the credit is in op epoch + 1 or later, and no rank runs more than
// one op ahead of another (channel 0 is active in every op, and its receivers wait for every
// peer's ready), so the credit is never read by an op it does not belong to. One thread.
__device__ __forceinline__ void idle_channel(const ExchangeArgs& e, unsigned long long epoch) {
  for (int p = 0; p < e.num_ranks; ++p)
    if (p != e.rank) post_credit(e, blockIdx.x, p, credit_word(epoch + 1, 0));
}

// The CTA's last step: the last CTA of the grid to finish moves the op epoch on (every CTA read
// it at its start) and resets the op's counters. One thread.
__device__ __forceinline__ void finish_cta(const ExchangeArgs& e, unsigned long long epoch) {
  __threadfence();
  if (atomicAdd(&e.state->done_ctas, 1u) == gridDim.x - 1) {
    e.state->done_ctas = 0;
    e.state->own_claimed = 0;
    e.state->op_epoch = epoch + 1;
    __threadfence();
  }
}

// The whole op: one CTA of Op::kWarps warps per channel; warps [0, send_warps) send, the rest
// receive (interleaved ops: every warp does both).
template <class Op>
__device__ void run_exchange(const typename Op::Args& a) {
  const ExchangeArgs& e = Op::ex(a);
  __shared__ ExchangeShared sh;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned long long start_ns = trace_clock();
  const unsigned long long start_cycles = kTrace ? sm_cycles() : 0;
  if (kTrace && threadIdx.x == 0) {
    sh.send_wait_ns = sh.send_work_ns = sh.recv_local_ns = sh.recv_wait_ns = sh.recv_remote_ns = 0;
    sh.phases = ItemTimers{};
  }
  if (threadIdx.x < e.num_ranks) sh.tokens[threadIdx.x] = e.tokens_of[threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) {
    sh.plan = plan_channels(sh.tokens, e);
    sh.epoch = ld_volatile_u64(&e.state->op_epoch);
  }
  __syncthreads();
  if (blockIdx.x >= sh.plan.channels) {  // (block-uniform)
    if (threadIdx.x == 0) {
      idle_channel(e, sh.epoch);
      finish_cta(e, sh.epoch);
    }
    return;
  }
  Op::warp_setup(lane);  // the op's per-warp state (combine: its staging barriers)
  if (threadIdx.x < e.num_ranks) count_chunks<Op>(sh, e, threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    sh.send_rounds = sh.recv_rounds = 0;
    for (int p = 0; p < e.num_ranks; ++p) {
      sh.send_rounds = max(sh.send_rounds, sh.send_chunks[p]);
      sh.recv_rounds = max(sh.recv_rounds, sh.recv_chunks[p]);
    }
    sh.send_stop = sh.recv_stop = 0;
    // A pending error (a capacity-mode routing error or overflow, a peer's abort) stops the op
    // before it writes anything into a peer; the peers are told so that none waits for us.
    const unsigned long long failed = ld_volatile_u64(&e.state->failed);
    const unsigned long long by = ld_acquire_sys(reinterpret_cast<const unsigned long long*>(
        reinterpret_cast<const char*>(e.peers[e.rank]) + e.win.sync_off) + kAbortSlot);
    const bool pending = start_verdict(e, sh.epoch);
    sh.start_stop = failed != 0 || by != 0 || pending;
    if (sh.start_stop) {
      if (by != 0) raise_error(e.err, kErrPeerAbort, e.rank, (int)by - 1, (int)call_op(e.call), 0, 0);
      const unsigned long long origin = failed != 0 ? failed : (by != 0 ? by : e.rank + 1ull);
      stop_group(e.peers, e.win.sync_off, e.num_ranks, &e.state->failed, origin);
    }
  }
  __syncthreads();
  if (!sh.start_stop) {
    if constexpr (Op::kInterleaved) {
      interleaved_role<Op>(a, sh, warp, Op::kWarps, lane);
    } else if (warp < e.send_warps) {
      sender_role<Op>(a, sh, warp, e.send_warps, lane);
    } else {
      receiver_role<Op>(a, sh, warp - e.send_warps, Op::kWarps - e.send_warps, lane);
    }
  }
  __syncthreads();
  // Errors raised during an op stop the group (state->failed, device memory); the host-mapped
  // error word was read at the start already.
  if (threadIdx.x == 0)
    sh.end_stop = sh.start_stop || sh.send_stop || sh.recv_stop ||
                  ld_volatile_u64(&e.state->failed) != 0;
  __syncthreads();
  if (sh.end_stop) poison_outputs(e);
  if (kTrace && threadIdx.x == 0 && (blockIdx.x == 0 || blockIdx.x == sh.plan.channels - 1)) {
    const double total_ns = (double)(global_timer_ns() - start_ns);
    // Item phases: SM cycles summed over warps: us per warp at this CTA's clock rate.
    const double us_per_warp_cycle =
        total_ns / 1e3 / (double)(sm_cycles() - start_cycles) / Op::kWarps;
    const ItemTimers& t = sh.phases;
    printf("EP_TRACE op=%d rank=%d cta=%d rounds=%d/%d send_warps=%d | send wait %.1f work %.1f "
           "| recv local %.1f wait %.1f remote %.1f | total %.1f us | %u items %u segments, per "
           "warp: setup %.1f fill %.1f wait %.1f work %.1f us\n",
           (int)call_op(e.call), e.rank, blockIdx.x, sh.send_rounds, sh.recv_rounds,
           e.send_warps, sh.send_wait_ns / 1e3, sh.send_work_ns / 1e3, sh.recv_local_ns / 1e3,
           sh.recv_wait_ns / 1e3, sh.recv_remote_ns / 1e3, total_ns / 1e3, t.items, t.segments,
           t.cycles[kPhaseSetup] * us_per_warp_cycle, t.cycles[kPhaseFill] * us_per_warp_cycle,
           t.cycles[kPhaseWait] * us_per_warp_cycle, t.cycles[kPhaseWork] * us_per_warp_cycle);
  }
  if (threadIdx.x == 0) finish_cta(e, sh.epoch);
}

template <class Op>
__global__ void __launch_bounds__(Op::kWarps * 32, 1) exchange_kernel(const typename Op::Args a) {
  run_exchange<Op>(a);
}

// Lets the kernel use the op's dynamic shared memory (Op::kStagingBytes may exceed the default
// 48 KiB). A per-device function attribute, set once per group (preload_exchange).
template <class Op>
cudaError_t grant_staging() {
  if (Op::kStagingBytes == 0) return cudaSuccess;
  return cudaFuncSetAttribute(exchange_kernel<Op>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              (int)Op::kStagingBytes);
}

// Loads the kernel and grants its staging on the current device (group creation, init_group):
// under lazy module loading a first launch may wait for the device, which must not happen while
// a peer of a local team spins in another op kernel; and launches then need no attribute call.
template <class Op>
cudaError_t preload_exchange() {
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, exchange_kernel<Op>);
  return e == cudaSuccess ? grant_staging<Op>() : e;
}

// NOTES: the kernel's staging was granted when its group was created (preload_exchange).
template <class Op>
cudaError_t launch_exchange(const typename Op::Args& a, cudaStream_t stream) {
  exchange_kernel<Op><<<Op::ex(a).win.channels, Op::kWarps * 32, Op::kStagingBytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace nccl_ep
