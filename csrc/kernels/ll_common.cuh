/*
 * ll_common.cuh: what the LL kernels (docs/design.md section 9) share: the window's LL areas,
 * packs of kLLGroupElems elements as raw bytes, the timed waits and the grid's phase ends. The
 * kernels: a handle's local layout (ll_layout.cu), the dispatch (ll_dispatch.cu) and the combine
 * (ll_combine.cu); dispatch and combine are one kernel each whose send and receive phases run
 * fused (send_only = 0) or as two launches (the send; then ncclEpComplete's receive).
 *
 * NOTES:
 *  - Work items are (message, column chunk): a row is split into chunks of kChunkGroups packs of
 *    kLLGroupElems elements, so that a few tokens still spread over every warp of the grid.
 *  - A phase ends with every CTA's arrival at each peer's flag (a release add of 1, after a
 *    barrier; a rank's own slot as OwnArrival says): ready flags after the sends, credits after
 *    the receives. A waiter needs the arrivals of all of the peer's CTAs (every CTA of an op is
 *    resident: channels x ranks on a GPU <= its SMs); no CTA counts for the others.
 *  - A rank never waits for its own credit, so none is added: its ops are ordered on its
 *    stream, and at most kLLSets of a kind are in flight (ll.cc), so op i - kLLSets' receive is
 *    done before op i's send starts.
 *  - A receive knows each source's message count with its ready flag: the source writes it,
 *    tagged with the op's epoch, before its sends, and the wait polls both.
 *  - Rows never depend on arrival order or atomics: positions come from the handle's layout (the
 *    sender's per-expert runs, in token order) and the per-source counts; sums run in a fixed
 *    order with one rounding per operation (__fmul_rn / __fadd_rn: never contracted).
 *  - Window data written by peers is read with ld.global.cg (L2): an SM's L1 may still hold the
 *    same addresses from the op two epochs earlier.
 *  - A wait that times out, or sees a peer's abort, stops the group; a stopped group's dispatch
 *    writes counts of 0 and its combine NaN rows (0xFF bytes), and both return.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "api.cuh"
#include "device.cuh"

namespace nccl_ep {

// Loads every dispatch / combine kernel (ll_dispatch.cu, ll_combine.cu; preload_ll calls them).
cudaError_t preload_ll_dispatch();
cudaError_t preload_ll_combine();

namespace {

constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kChunkGroups = 64;  // packs per work item: 512 columns

// -- the window ---------------------------------------------------------------------------------
EP_DEVICE unsigned long long* ll_flag(void* base, const LLArgs& a, int kind, int set, int r) {
  return reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(base) +
                                               a.win.ll.flag_off) +
         ((size_t)kind * kLLSets + set) * a.num_ranks + r;
}
EP_DEVICE char* ll_msg(void* base, const LLArgs& a, int set, int src, int j) {
  return reinterpret_cast<char*>(base) + a.win.ll.msg_off +
         (((size_t)set * a.num_ranks + src) * a.max_tokens + j) * a.win.ll.msg_bytes;
}
EP_DEVICE unsigned long long* ll_count_word(void* base, const LLArgs& a, int set, int src) {
  return reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(base) +
                                               a.win.ll.count_word_off) +
         (size_t)set * a.num_ranks + src;
}
EP_DEVICE unsigned long long count_word(unsigned long long epoch, int messages) {
  return ((unsigned long long)(unsigned)epoch << 32) | (unsigned)messages;
}
EP_DEVICE int* ll_counts(void* base, const LLArgs& a, int set, int src) {
  return reinterpret_cast<int*>(reinterpret_cast<char*>(base) + a.win.ll.count_off) +
         ((size_t)set * a.num_ranks + src) * a.win.ll.count_stride;
}
EP_DEVICE char* ll_comb(void* base, const LLArgs& a, int set, int t, int k) {
  return reinterpret_cast<char*>(base) + a.win.ll.comb_off +
         (((size_t)set * a.max_tokens + t) * a.max_topk + k) * a.win.ll.comb_row;
}

// -- packs of kLLGroupElems elements as raw bytes (B = 8: FP8; 16: bf16 / fp16; 32: fp32) ------
template <int B>
struct Raw {
  uint4 v[B / 16];
};
template <>
struct Raw<8> {
  uint2 v;
};

template <int B, bool kFromWindow>
EP_DEVICE Raw<B> ld_raw(const void* p) {
  Raw<B> r;
  if constexpr (B == 8) {
    r.v = kFromWindow ? __ldcg(reinterpret_cast<const uint2*>(p)) : *reinterpret_cast<const uint2*>(p);
  } else {
#pragma unroll
    for (int i = 0; i < B / 16; ++i)
      r.v[i] = kFromWindow ? __ldcg(reinterpret_cast<const uint4*>(p) + i)
                           : reinterpret_cast<const uint4*>(p)[i];
  }
  return r;
}

template <int B>
EP_DEVICE void st_raw(void* p, const Raw<B>& r) {
  if constexpr (B == 8) {
    *reinterpret_cast<uint2*>(p) = r.v;
  } else {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) reinterpret_cast<uint4*>(p)[i] = r.v[i];
  }
}

// A pack of 1-byte elements (FP8) is one uint2, wider packs whole uint4 words.
static_assert(kLLGroupElems == 8 || kLLGroupElems % 16 == 0, "Raw packs of 1-byte elements");

template <typename T>
EP_DEVICE void raw_to_float(const Raw<kLLGroupElems * sizeof(T)>& r, float (&f)[kLLGroupElems]) {
  const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
  for (int q = 0; q < kLLGroupElems; ++q) f[q] = to_float<T>(e[q]);
}

template <typename T>
EP_DEVICE Raw<kLLGroupElems * sizeof(T)> float_to_raw(const float (&f)[kLLGroupElems]) {
  Raw<kLLGroupElems * sizeof(T)> r;
  T* e = reinterpret_cast<T*>(&r);
#pragma unroll
  for (int q = 0; q < kLLGroupElems; ++q) e[q] = from_float<T>(f[q]);
  return r;
}

// -- waits and phases ---------------------------------------------------------------------------
// The arrivals a set's flag holds once op `epoch` of its kind (epochs from 1; set ll_set(epoch))
// and every earlier op of that set are done at the peer: one per CTA of each.
EP_DEVICE unsigned long long arrivals(const LLArgs& a, unsigned long long epoch) {
  return (unsigned long long)a.win.channels * ((epoch + kLLSets - 1) / kLLSets);
}


// Waits until *flag reaches `target` arrivals and, where `word` is given, until the count word
// there names `epoch` (its message count into *messages); false once the group stopped (a
// peer's abort, or this wait's timeout, which stops the group itself). `epoch` names the op in
// the error. The word's load goes first, so the flag's acquire does not hold it back: both are
// in flight together. A word read before its writer's store names an older epoch; the next
// read follows the acquire that saw the writer's release (its CTA 0 stores the word before its
// arrival), so it holds the op's.
EP_DEVICE bool ll_wait(const unsigned long long* flag, unsigned long long target,
                       unsigned long long epoch, const LLArgs& a, int peer, int op, int kind,
                       const unsigned long long* word = nullptr, int* messages = nullptr) {
  auto ready = [&]() {
    const unsigned long long w = word != nullptr ? ld_relaxed_sys(word) : 0;
    if (ld_acquire_sys(flag) < target) return false;
    if (word == nullptr) return true;
    if ((unsigned)(w >> 32) != (unsigned)epoch) return false;
    *messages = (int)(unsigned)w;
    return true;
  };
  if (ready()) return true;
  const unsigned long long* abort_slot =
      reinterpret_cast<const unsigned long long*>(reinterpret_cast<char*>(a.peers[a.rank]) +
                                                  a.win.sync_off) + kAbortSlot;
  const unsigned long long start = global_timer_ns();
  int spins = 0;
  while (!ready()) {
    if (++spins < 256) continue;
    spins = 0;
    const unsigned long long by = ld_acquire_sys(abort_slot);
    if (by != 0) {
      raise_error(a.err, kErrPeerAbort, a.rank, (int)by - 1, op, 0, 0);
      atomicCAS(&a.state->failed, 0ull, by);
      return false;
    }
    if ((long long)(global_timer_ns() - start) > a.timeout_ns) {
      raise_error(a.err, kErrTimeout, a.rank, peer, op, (long long)epoch,
                  a.timeout_ns / 1000000, kind);
      stop_group(a.peers, a.win.sync_off, a.num_ranks, &a.state->failed,
                 (unsigned long long)a.rank + 1);
      return false;
    }
  }
  return true;
}

// Threads 0..R-1 (but `skip`) wait for flag `kind` of set `set` from every peer to hold op
// `epoch`'s arrivals; true in a thread whose wait ended on a stopped group. With `messages`,
// thread r also waits for source r's count word of the op and returns its count there.
EP_DEVICE bool wait_peers(const LLArgs& a, int kind, int set, unsigned long long epoch, int op,
                          int wait_kind, int skip = -1, int* messages = nullptr) {
  const int r = threadIdx.x;
  if (r >= a.num_ranks || r == skip) return false;
  void* mine = a.peers[a.rank];
  return !ll_wait(ll_flag(mine, a, kind, set, r), arrivals(a, epoch), epoch, a, r, op, wait_kind,
                  messages != nullptr ? ll_count_word(mine, a, set, r) : nullptr, messages);
}

// How a phase end counts this rank's own slot: as every peer's (a release the receive waits
// for), as a count only (an arrival no read of this op depends on, which later ops' targets
// still count: a fused combine's own ready flag), or not at all (a rank's own credit: never
// waited for).
enum OwnArrival : int { kOwnRelease, kOwnCountOnly, kOwnNone };

// After a phase's writes, by every thread of every CTA: this CTA's arrival at flag `kind` of set
// `set` of every peer (this rank's slot). The barrier orders the CTA's writes before each
// release, which is cumulative over them; with no release to make it is left out.
EP_DEVICE void arrive(const LLArgs& a, int kind, int set, OwnArrival own) {
  const int r = threadIdx.x, me = a.rank;
  if (a.num_ranks > 1 || own == kOwnRelease) __syncthreads();
  if (r >= a.num_ranks) return;
  unsigned long long* flag = ll_flag(a.peers[r], a, kind, set, me);
  if (r != me || own == kOwnRelease)
    red_add_release_sys(flag, 1ull);
  else if (own == kOwnCountOnly)
    red_add_relaxed_sys(flag, 1ull);
}

// The op's epoch at its start: a send advances this CTA's own count, a receive-only launch
// (ncclEpComplete) takes the one its send recorded in the handle.
EP_DEVICE unsigned long long op_epoch(const LLArgs& a, int kind) {
  return a.send ? ld_volatile_u64(&a.state->ll_epoch[kind][blockIdx.x]) + 1
                : ld_volatile_u64(&a.h.epochs[kind]);
}

// After the send phase: the CTA's count advances; the handle records the epoch (every CTA
// writes the same value) for ncclEpComplete.
EP_DEVICE void sent(const LLArgs& a, int kind, unsigned long long epoch) {
  if (threadIdx.x == 0) {
    a.state->ll_epoch[kind][blockIdx.x] = epoch;
    a.h.epochs[kind] = epoch;
  }
}

// Message of source s, slot j <- (s, j) of the flat message index m, from the sources' first
// indices (s_moff[R] = all messages).
EP_DEVICE void message_of(int m, const int* s_moff, int* s, int* j) {
  int src = 0;
  while (m >= s_moff[src + 1]) ++src;
  *s = src;
  *j = m - s_moff[src];
}

// The lanes of set bits of a warp-uniform mask, lowest first.
#define EP_FOR_EACH_LANE(mask, f) \
  for (unsigned rest_ = (mask), f = 0; rest_ != 0 && ((f = __ffs(rest_) - 1), true); rest_ &= rest_ - 1)

template <typename F>
cudaError_t preload(F kernel) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, kernel);
}

}  // namespace

}  // namespace nccl_ep
