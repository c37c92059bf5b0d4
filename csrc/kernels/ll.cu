/*
 * ll.cu: the LL kernels (docs/design.md section 9): a handle's local layout, the dispatch and the
 * combine. Dispatch and combine are one kernel each whose send and receive phases run fused
 * (send_only = 0) or as two launches (the send; then ncclEpComplete's receive).
 *
 * NOTES:
 *  - Work items are (message, column chunk): a row is split into chunks of kChunkGroups packs of
 *    8 elements, so that a few tokens still spread over every warp of the grid.
 *  - A phase ends with the grid's last CTA (a counter in DeviceState that it resets) publishing
 *    it with one release store per peer: ready flags after the sends, credits after the
 *    receives. Every thread fences its writes at system scope before its CTA counts itself.
 *  - Rows never depend on arrival order or atomics: positions come from the handle's layout (the
 *    sender's per-expert runs, in token order) and the per-source counts; sums run in a fixed
 *    order with one rounding per operation (__fmul_rn / __fadd_rn: never contracted).
 *  - Window data written by peers is read with ld.global.cg (L2): an SM's L1 may still hold the
 *    same addresses from the op two epochs earlier.
 *  - A wait that times out, or sees a peer's abort, stops the group; a stopped group's dispatch
 *    writes counts of 0 and its combine NaN rows (0xFF bytes), and both return.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "api.cuh"
#include "device.cuh"

namespace nccl_ep {

namespace {

constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kChunkGroups = 64;  // packs per work item: 512 columns
constexpr int kLayoutThreads = 1024;
constexpr size_t kLayoutSmemMax = 160 * 1024;  // T_max x max_topk ids at the LL bounds

// -- the window ---------------------------------------------------------------------------------
EP_DEVICE unsigned long long* ll_flag(void* base, const LLArgs& a, int kind, int set, int r) {
  return reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(base) +
                                               a.win.ll.flag_off) +
         ((size_t)kind * 2 + set) * a.num_ranks + r;
}
EP_DEVICE char* ll_msg(void* base, const LLArgs& a, int set, int src, int j) {
  return reinterpret_cast<char*>(base) + a.win.ll.msg_off +
         (((size_t)set * a.num_ranks + src) * a.max_tokens + j) * a.win.ll.msg_bytes;
}
EP_DEVICE int* ll_counts(void* base, const LLArgs& a, int set, int src) {
  return reinterpret_cast<int*>(reinterpret_cast<char*>(base) + a.win.ll.count_off) +
         ((size_t)set * a.num_ranks + src) * a.win.ll.count_stride;
}
EP_DEVICE char* ll_comb(void* base, const LLArgs& a, int set, int t, int k) {
  return reinterpret_cast<char*>(base) + a.win.ll.comb_off +
         (((size_t)set * a.max_tokens + t) * a.max_topk + k) * a.win.ll.comb_row;
}

// -- packs of 8 elements as raw bytes (B = 8, 16 or 32) ------------------------------------------
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

template <typename T>
EP_DEVICE void raw_to_float(const Raw<8 * sizeof(T)>& r, float (&f)[8]) {
  const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
  for (int q = 0; q < 8; ++q) f[q] = to_float<T>(e[q]);
}

template <typename T>
EP_DEVICE Raw<8 * sizeof(T)> float_to_raw(const float (&f)[8]) {
  Raw<8 * sizeof(T)> r;
  T* e = reinterpret_cast<T*>(&r);
#pragma unroll
  for (int q = 0; q < 8; ++q) e[q] = from_float<T>(f[q]);
  return r;
}

// -- waits and phases ---------------------------------------------------------------------------
// Waits until *flag's epoch (its high 32 bits) reaches `epoch`; false once the group stopped (a
// peer's abort, or this wait's timeout, which stops the group itself).
EP_DEVICE bool ll_wait(const unsigned long long* flag, unsigned long long epoch,
                       unsigned long long* seen, const LLArgs& a, int peer, int op, int kind) {
  const unsigned long long* abort_slot =
      reinterpret_cast<const unsigned long long*>(reinterpret_cast<char*>(a.peers[a.rank]) +
                                                  a.win.sync_off) + kAbortSlot;
  const unsigned long long start = global_timer_ns();
  int spins = 0;
  unsigned long long v;
  while (((v = ld_acquire_sys(flag)) >> 32) < epoch) {
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
  *seen = v;
  return true;
}

// Every thread of every CTA calls it after its phase's writes; true (in every thread of the CTA)
// in the grid's last CTA, once all of them are counted (and the counter is reset for the next).
EP_DEVICE bool last_cta(unsigned* counter, int* s_last) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned prev = atomicAdd(counter, 1u);
    *s_last = prev == gridDim.x - 1;
    if (*s_last) {
      *counter = 0;
      fence_acq_rel_sys();
    }
  }
  __syncthreads();
  return *s_last != 0;
}

// Waits (threads 0..R-1) for flag `kind` of set `set` from every peer to reach `epoch`; counts
// (the flag's low 16 bits) into s_n when given. False in every thread once the group stopped.
EP_DEVICE bool wait_all(const LLArgs& a, int kind, int set, unsigned long long epoch, int op,
                        int wait_kind, int* s_n, int* s_fail) {
  if (threadIdx.x < a.num_ranks) {
    unsigned long long seen = 0;
    if (!ll_wait(ll_flag(a.peers[a.rank], a, kind, set, threadIdx.x), epoch, &seen, a,
                 threadIdx.x, op, wait_kind))
      *s_fail = 1;
    else if (s_n != nullptr)
      s_n[threadIdx.x] = (int)(seen & 0xffffu);
  }
  __syncthreads();
  return *s_fail == 0;
}

// Releases flag `kind` of set `set` at every peer (this rank's slot) with epoch and count.
EP_DEVICE void publish(const LLArgs& a, int kind, int set, unsigned long long epoch,
                       const int* counts) {
  if (threadIdx.x < a.num_ranks)
    st_release_sys(ll_flag(a.peers[threadIdx.x], a, kind, set, a.rank),
                   (epoch << 32) | (counts != nullptr ? (unsigned)counts[threadIdx.x] : 0u));
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

// -- handle layout ------------------------------------------------------------------------------
__global__ void __launch_bounds__(kLayoutThreads, 1) ll_layout_kernel(const LLLayoutArgs la) {
  const LLArgs& a = la.a;
  extern __shared__ int s_ids[];  // [T][Kmax]
  __shared__ unsigned long long bad_range, bad_repeat;
  const int T = a.tokens, K = a.topk, Km = a.max_topk, E = a.num_experts, L = a.num_local,
            R = a.num_ranks;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  if (threadIdx.x == 0) {
    bad_range = ~0ull;
    bad_repeat = ~0ull;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < T * Km; i += blockDim.x) {
    const int t = i / Km, k = i - t * Km;
    long long v = -1;
    if (k < K) {
      const long long off = t * la.stride0 + k * la.stride1;
      v = la.idx_is_64 ? reinterpret_cast<const long long*>(la.topk_idx)[off]
                       : (long long)reinterpret_cast<const int*>(la.topk_idx)[off];
    }
    const bool ok = v >= -1 && v < E;
    if (!ok) atomicMin(&bad_range, (unsigned long long)i);
    s_ids[i] = ok ? (int)v : -1;
    a.h.ids[i] = s_ids[i];
    a.h.pos[i] = -1;
    a.h.jslot[i] = -1;
    a.h.dpos[i] = -1;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < T; t += blockDim.x) {
    for (int k = 1; k < K; ++k) {
      const int e = s_ids[t * Km + k];
      bool repeat = false;
      for (int k2 = 0; k2 < k; ++k2) repeat |= e >= 0 && s_ids[t * Km + k2] == e;
      if (repeat) {
        atomicMin(&bad_repeat, (unsigned long long)(t * Km + k));
        break;
      }
    }
  }
  __syncthreads();
  if (bad_range != ~0ull || bad_repeat != ~0ull) {
    if (threadIdx.x == 0) {
      if (bad_range != ~0ull) {
        const int t = (int)(bad_range / Km), k = (int)(bad_range % Km);
        const long long off = t * la.stride0 + k * la.stride1;
        const long long v = la.idx_is_64
                                ? reinterpret_cast<const long long*>(la.topk_idx)[off]
                                : (long long)reinterpret_cast<const int*>(la.topk_idx)[off];
        raise_error(a.err, kErrExpertRange, a.rank, t, k, v, E, kRecordTopkIdx);
      } else {
        const int t = (int)(bad_repeat / Km), k = (int)(bad_repeat % Km);
        raise_error(a.err, kErrDuplicateExpert, a.rank, t, k, s_ids[t * Km + k], 0);
      }
      stop_group(a.peers, a.win.sync_off, R, &a.state->failed, (unsigned long long)a.rank + 1);
    }
    return;
  }
  // Each slot's row in its (expert, this source) run: the tokens before it naming the expert.
  for (int e = warp; e < E; e += warps) {
    int run = 0;
    for (int t0 = 0; t0 < T; t0 += 32) {
      const int t = t0 + lane;
      int kk = -1;
      if (t < T)
        for (int k = 0; k < K; ++k) kk = s_ids[t * Km + k] == e ? k : kk;
      const unsigned m = __ballot_sync(0xffffffffu, kk >= 0);
      if (kk >= 0) a.h.pos[t * Km + kk] = run + __popc(m & ((1u << lane) - 1));
      run += __popc(m);
    }
    if (lane == 0) a.h.cnt[e] = run;
  }
  // Each token's message slot at each destination: the tokens before it sent there.
  for (int d = warp; d < R; d += warps) {
    int run = 0;
    for (int t0 = 0; t0 < T; t0 += 32) {
      const int t = t0 + lane;
      bool has = false;
      if (t < T)
        for (int k = 0; k < K; ++k) {
          const int e = s_ids[t * Km + k];
          has |= e >= 0 && e / L == d;
        }
      const unsigned m = __ballot_sync(0xffffffffu, has);
      if (has) {
        const int j = run + __popc(m & ((1u << lane) - 1));
        for (int k = 0; k < K; ++k) {
          const int e = s_ids[t * Km + k];
          if (e >= 0 && e / L == d) a.h.jslot[t * Km + k] = j;
        }
      }
      run += __popc(m);
    }
    if (lane == 0) a.h.ndest[d] = run;
  }
  // Each token's destination ranks, ascending.
  for (int t = threadIdx.x; t < T; t += blockDim.x) {
    unsigned long long mask = 0;
    for (int k = 0; k < K; ++k) {
      const int e = s_ids[t * Km + k];
      if (e >= 0) mask |= 1ull << (e / L);
    }
    for (int k = 0; k < K; ++k) {
      const int e = s_ids[t * Km + k];
      if (e >= 0) a.h.dpos[t * Km + k] = __popcll(mask & ((1ull << (e / L)) - 1));
    }
    a.h.ndst[t] = __popcll(mask);
    a.h.own_dpos[t] = (mask >> a.rank) & 1 ? __popcll(mask & ((1ull << a.rank) - 1)) : -1;
  }
}

// -- dispatch -----------------------------------------------------------------------------------
template <typename T, bool kFp8>
struct DispatchOp {
  static constexpr int kIn = 8 * sizeof(T);      // bytes of an input pack
  static constexpr int kOut = kFp8 ? 8 : kIn;    // bytes of a payload / output pack

  // One (token, chunk): loaded once, cast once, stored into the message of every destination.
  static EP_DEVICE void send_item(const LLDispatchArgs& d, int set, int t, int c, int lane) {
    const LLArgs& a = d.a;
    const int Km = a.max_topk, H8 = a.hidden / kLLGroupElems;
    int dest = -1;
    if (lane < a.topk) {
      const int e = a.h.ids[t * Km + lane];
      dest = e >= 0 ? e / a.num_local : -1;
    }
    const unsigned same = __match_any_sync(0xffffffffu, dest);
    const bool first = dest >= 0 && (int)(__ffs(same) - 1) == lane;
    const unsigned firsts = __ballot_sync(0xffffffffu, first);
    if (firsts == 0) return;  // warp-uniform: every slot masked
    unsigned long long mine = 0;  // lane f's destination message
    if (first)
      mine = reinterpret_cast<unsigned long long>(
          ll_msg(a.peers[dest], a, set, a.rank, a.h.jslot[t * Km + lane]));
    const size_t hdr = a.win.ll.hdr_bytes;
    const char* xrow = reinterpret_cast<const char*>(d.x) + (size_t)t * a.hidden * sizeof(T);
#pragma unroll
    for (int step = 0; step < kChunkGroups / 32; ++step) {
      const int g = c * kChunkGroups + step * 32 + lane;
      const bool valid = g < H8;
      Raw<kIn> in;
      if (valid) in = ld_raw<kIn, false>(xrow + (size_t)g * kIn);
      if constexpr (kFp8) {
        float f[8];
        if (valid) {
          raw_to_float<T>(in, f);
        } else {
#pragma unroll
          for (int q = 0; q < 8; ++q) f[q] = 0.f;
        }
        float amax = 0.f;
#pragma unroll
        for (int q = 0; q < 8; ++q) amax = fmaxf(amax, fabsf(f[q]));
        // The 16 lanes of one block of 128 columns (blocks start at multiples of 16 packs).
#pragma unroll
        for (int o = 8; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float floor_amax = fmaxf(amax, 1e-4f);
        const float scale = __fdiv_rn(floor_amax, 448.0f);
        const float factor = __fdiv_rn(448.0f, floor_amax);
        Raw<8> q8;
        unsigned char* qb = reinterpret_cast<unsigned char*>(&q8);
#pragma unroll
        for (int q = 0; q < 8; ++q)
          qb[q] = (unsigned char)__nv_cvt_float_to_fp8(__fmul_rn(f[q], factor), __NV_SATFINITE,
                                                       __NV_E4M3);
        EP_FOR_EACH_LANE(firsts, f_lane) {
          char* msg = reinterpret_cast<char*>(__shfl_sync(0xffffffffu, mine, f_lane));
          if (valid) {
            st_raw<8>(msg + hdr + (size_t)g * 8, q8);
            if ((lane & 15) == 0)
              *reinterpret_cast<float*>(msg + hdr + a.hidden + (size_t)(g / 16) * 4) = scale;
          }
        }
      } else {
        EP_FOR_EACH_LANE(firsts, f_lane) {
          char* msg = reinterpret_cast<char*>(__shfl_sync(0xffffffffu, mine, f_lane));
          if (valid) st_raw<kOut>(msg + hdr + (size_t)g * kOut, in);
        }
      }
    }
    if (c != 0) return;
    // The header: the token, its ids, per slot its row position at that destination, weights.
    EP_FOR_EACH_LANE(firsts, f_lane) {
      char* msg = reinterpret_cast<char*>(__shfl_sync(0xffffffffu, mine, f_lane));
      const int dest_f = __shfl_sync(0xffffffffu, dest, f_lane);
      int* ids = reinterpret_cast<int*>(msg + sizeof(LLHeader));
      if (lane < Km) {
        const bool live = lane < a.topk;
        ids[lane] = live ? a.h.ids[t * Km + lane] : -1;
        ids[Km + lane] = live && dest == dest_f ? a.h.pos[t * Km + lane] : -1;
        reinterpret_cast<float*>(ids + 2 * Km)[lane] =
            live && d.w != nullptr ? d.w[(size_t)t * a.topk + lane] : 0.f;
      }
      if (lane == 0) {
        LLHeader hd;
        hd.token = t;
        hd.dest_pos = a.h.dpos[t * Km + f_lane];
        hd.topk = a.topk;
        hd.pad = 0;
        *reinterpret_cast<LLHeader*>(msg) = hd;
      }
    }
  }

  // One (message, chunk) into its rows: expert-major every slot of this rank, rank-major one row.
  static EP_DEVICE void recv_item(const LLDispatchArgs& d, int set, int s, int j, int c, int lane,
                                  const int* s_off, const int* s_moff) {
    const LLArgs& a = d.a;
    const int Km = a.max_topk, H8 = a.hidden / kLLGroupElems, me = a.rank;
    const long long RT = (long long)a.num_ranks * a.max_tokens;
    const char* msg = ll_msg(a.peers[me], a, set, s, j);
    const int* ids = reinterpret_cast<const int*>(msg + sizeof(LLHeader));
    const int t = __ldcg(&reinterpret_cast<const LLHeader*>(msg)->token);
    int id = -1, row = -1;
    if (lane < Km) id = __ldcg(ids + lane);
    if (!a.rank_major) {
      if (lane < Km) {
        const int p = __ldcg(ids + Km + lane);
        if (p >= 0) {
          const int l = id - me * a.num_local;
          row = (int)(l * RT) + s_off[l * a.num_ranks + s] + p;
        }
      }
    } else if (lane == 0) {
      row = s_moff[s] + j;
    }
    const unsigned rows = __ballot_sync(0xffffffffu, row >= 0);
    const size_t hdr = a.win.ll.hdr_bytes;
    const size_t out_row = (size_t)a.hidden * (kFp8 ? 1 : sizeof(T));
    char* out = reinterpret_cast<char*>(d.recv_x);
#pragma unroll
    for (int step = 0; step < kChunkGroups / 32; ++step) {
      const int g = c * kChunkGroups + step * 32 + lane;
      const bool valid = g < H8;
      Raw<kOut> v;
      if (valid) v = ld_raw<kOut, true>(msg + hdr + (size_t)g * kOut);
      EP_FOR_EACH_LANE(rows, f_lane) {
        const int r = __shfl_sync(0xffffffffu, row, f_lane);
        if (valid) st_raw<kOut>(out + (size_t)r * out_row + (size_t)g * kOut, v);
      }
    }
    if constexpr (kFp8) {
      const int blocks = a.hidden / kFp8Block;
      const int b = c * (kChunkGroups / 16) + lane;  // a chunk holds 4 blocks
      const bool valid = lane < kChunkGroups / 16 && b < blocks;
      float sc = 0.f;
      if (valid) sc = __ldcg(reinterpret_cast<const float*>(msg + hdr + a.hidden) + b);
      EP_FOR_EACH_LANE(rows, f_lane) {
        const int r = __shfl_sync(0xffffffffu, row, f_lane);
        if (valid) d.recv_scales[(size_t)r * blocks + b] = sc;
      }
    }
    if (c != 0) return;
    // What the combine needs, and the routing outputs.
    const size_t sj = (size_t)s * a.max_tokens + j;
    if (!a.rank_major) {
      if (row >= 0) d.recv_src[row] = s * a.max_tokens + t;
      if (lane < Km) a.h.rrow[sj * Km + lane] = row;
      if (s == me && lane < Km && row >= 0) a.h.own_row[t * Km + lane] = row;
    } else {
      const int r = s_moff[s] + j;
      if (lane < Km) {
        const bool here = id >= 0 && id / a.num_local == me;
        d.recv_topk_idx[(size_t)r * Km + lane] = here ? id : -1;
        if (d.recv_topk_w != nullptr)
          d.recv_topk_w[(size_t)r * Km + lane] =
              here ? __ldcg(reinterpret_cast<const float*>(ids + 2 * Km) + lane) : 0.f;
      }
      if (lane == 0) {
        a.h.rdpos[sj] = __ldcg(&reinterpret_cast<const LLHeader*>(msg)->dest_pos);
        if (s == me) a.h.own_row[t * Km] = r;
      }
    }
    if (lane == 0) a.h.rtok[sj] = t;
  }
};

// A stopped group's dispatch: no rows.
EP_DEVICE void poison_dispatch(const LLDispatchArgs& d) {
  if (blockIdx.x != 0) return;
  const int n = d.a.rank_major ? 1 : d.a.num_local;
  for (int i = threadIdx.x; i < n; i += blockDim.x) d.recv_count[i] = 0;
}

template <typename T, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) ll_dispatch_kernel(const LLDispatchArgs d) {
  using Op = DispatchOp<T, kFp8>;
  const LLArgs& a = d.a;
  extern __shared__ int s_off[];  // expert-major: [L][R] first row of (local expert, source)
  __shared__ int s_fail, s_last;
  __shared__ int s_n[kMaxRanks];
  __shared__ int s_moff[kMaxRanks + 1];
  const int R = a.num_ranks, L = a.num_local, me = a.rank;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H8 = a.hidden / kLLGroupElems;
  const int nchunks = (H8 + kChunkGroups - 1) / kChunkGroups;
  const unsigned long long epoch =
      a.send ? ld_volatile_u64(&a.state->ll_epoch[0]) + 1 : ld_volatile_u64(&a.h.epochs[0]);
  const int set = (int)(epoch & 1);
  if (threadIdx.x == 0) s_fail = ld_volatile_u64(&a.state->failed) != 0;
  __syncthreads();
  if (s_fail) return poison_dispatch(d);

  if (a.send) {
    // Set `set` is free at every destination once it consumed op epoch - 2.
    if (epoch > 2 &&
        !wait_all(a, kLLDispCredit, set, epoch - 2, kOpLLDispatch, kWaitCredit, nullptr, &s_fail))
      return poison_dispatch(d);
    const int items = a.tokens * nchunks;
    for (int i = blockIdx.x * kWarps + warp; i < items; i += gridDim.x * kWarps)
      Op::send_item(d, set, i / nchunks, i % nchunks, lane);
    if (blockIdx.x == 0)
      for (int i = threadIdx.x; i < R * L; i += blockDim.x)
        ll_counts(a.peers[i / L], a, set, me)[i % L] = a.h.cnt[i];
    if (last_cta(&a.state->ll_done[0], &s_last)) {
      publish(a, kLLDispReady, set, epoch, a.h.ndest);
      if (threadIdx.x == 0) {
        a.state->ll_epoch[0] = epoch;
        a.h.epochs[0] = epoch;
      }
    }
  }
  if (!a.recv) return;

  if (!wait_all(a, kLLDispReady, set, epoch, kOpLLDispatch, kWaitReady, s_n, &s_fail))
    return poison_dispatch(d);
  if (threadIdx.x == 0) {
    int m = 0;
    for (int s = 0; s < R; ++s) {
      s_moff[s] = m;
      m += s_n[s];
    }
    s_moff[R] = m;
  }
  if (!a.rank_major) {
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      int run = 0;
      for (int s = 0; s < R; ++s) {
        s_off[l * R + s] = run;
        run += __ldcg(ll_counts(a.peers[me], a, set, s) + l);
      }
      if (blockIdx.x == 0) d.recv_count[l] = run;
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    if (threadIdx.x < R) a.h.rn[threadIdx.x] = s_n[threadIdx.x];
    if (a.rank_major && threadIdx.x <= R) a.h.roff[threadIdx.x] = s_moff[threadIdx.x];
    if (a.rank_major && threadIdx.x == 0) d.recv_count[0] = s_moff[R];
  }
  const int items = s_moff[R] * nchunks;
  for (int i = blockIdx.x * kWarps + warp; i < items; i += gridDim.x * kWarps) {
    int s, j;
    message_of(i / nchunks, s_moff, &s, &j);
    Op::recv_item(d, set, s, j, i % nchunks, lane, s_off, s_moff);
  }
  if (a.rank_major) {  // rows past the count: no routing
    const long long Km = a.max_topk, rows = (long long)R * a.max_tokens;
    for (long long i = (long long)s_moff[R] * Km + blockIdx.x * blockDim.x + threadIdx.x;
         i < rows * Km; i += (long long)gridDim.x * blockDim.x) {
      d.recv_topk_idx[i] = -1;
      if (d.recv_topk_w != nullptr) d.recv_topk_w[i] = 0.f;
    }
  }
  if (last_cta(&a.state->ll_done[1], &s_last)) publish(a, kLLDispCredit, set, epoch, nullptr);
}

// -- combine ------------------------------------------------------------------------------------
template <typename T>
struct CombineOp {
  static constexpr int kB = 8 * sizeof(T);

  // Copies chunk c of a row (token dtype) from src to dst.
  template <bool kFromWindow>
  static EP_DEVICE void copy_chunk(char* dst, const char* src, int c, int H8, int lane) {
#pragma unroll
    for (int step = 0; step < kChunkGroups / 32; ++step) {
      const int g = c * kChunkGroups + step * 32 + lane;
      if (g < H8) st_raw<kB>(dst + (size_t)g * kB, ld_raw<kB, kFromWindow>(src + (size_t)g * kB));
    }
  }

  // The expert rows of one received message back into its source's combine area.
  static EP_DEVICE void send_item(const LLCombineArgs& cb, int set, int s, int j, int c,
                                  int lane) {
    const LLArgs& a = cb.a;
    const int Km = a.max_topk, H8 = a.hidden / kLLGroupElems;
    const size_t sj = (size_t)s * a.max_tokens + j;
    const size_t row_bytes = (size_t)a.hidden * sizeof(T);
    const char* out = reinterpret_cast<const char*>(cb.expert_out);
    const int t = a.h.rtok[sj];
    if (!a.rank_major) {
      const int row = lane < Km ? a.h.rrow[sj * Km + lane] : -1;
      const unsigned slots = __ballot_sync(0xffffffffu, row >= 0);
      EP_FOR_EACH_LANE(slots, k) {
        const int r = __shfl_sync(0xffffffffu, row, k);
        copy_chunk<false>(ll_comb(a.peers[s], a, set, t, k), out + (size_t)r * row_bytes, c, H8,
                          lane);
      }
    } else {
      const int r = a.h.roff[s] + j;
      copy_chunk<false>(ll_comb(a.peers[s], a, set, t, a.h.rdpos[sj]),
                        out + (size_t)r * row_bytes, c, H8, lane);
    }
  }

  // y[t] chunk c: the fixed-order sum of the token's rows (design section 9).
  static EP_DEVICE void recv_item(const LLCombineArgs& cb, int set, int t, int c, int lane,
                                  bool direct) {
    const LLArgs& a = cb.a;
    const int Km = a.max_topk, H8 = a.hidden / kLLGroupElems, me = a.rank;
    const size_t row_bytes = (size_t)a.hidden * sizeof(T);
    const char* out = reinterpret_cast<const char*>(cb.expert_out);
    float acc[kChunkGroups / 32][8];
#pragma unroll
    for (int step = 0; step < kChunkGroups / 32; ++step)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[step][q] = 0.f;
    const int n = a.rank_major ? a.h.ndst[t] : a.topk;
    const int own = a.rank_major ? a.h.own_dpos[t] : -1;
    // A send-only combine's weights were kept by its send (the caller's may have changed).
    const float* weights = a.send ? cb.w : a.h.weights;
    for (int k = 0; k < n; ++k) {
      const char* src;
      float w = 1.f;
      bool from_window = true;
      if (!a.rank_major) {
        const int e = a.h.ids[t * Km + k];
        if (e < 0) continue;
        w = weights[(size_t)t * a.topk + k];
        from_window = !(direct && e / a.num_local == me);
        src = from_window ? ll_comb(a.peers[me], a, set, t, k)
                          : out + (size_t)a.h.own_row[t * Km + k] * row_bytes;
      } else {
        from_window = !(direct && k == own);
        src = from_window ? ll_comb(a.peers[me], a, set, t, k)
                          : out + (size_t)a.h.own_row[t * Km] * row_bytes;
      }
#pragma unroll
      for (int step = 0; step < kChunkGroups / 32; ++step) {
        const int g = c * kChunkGroups + step * 32 + lane;
        if (g >= H8) continue;
        float f[8];
        raw_to_float<T>(from_window ? ld_raw<kB, true>(src + (size_t)g * kB)
                                    : ld_raw<kB, false>(src + (size_t)g * kB),
                        f);
#pragma unroll
        for (int q = 0; q < 8; ++q)
          acc[step][q] = a.rank_major ? __fadd_rn(acc[step][q], f[q])
                                      : __fadd_rn(acc[step][q], __fmul_rn(w, f[q]));
      }
    }
    char* y = reinterpret_cast<char*>(cb.y) + (size_t)t * row_bytes;
#pragma unroll
    for (int step = 0; step < kChunkGroups / 32; ++step) {
      const int g = c * kChunkGroups + step * 32 + lane;
      if (g < H8) st_raw<kB>(y + (size_t)g * kB, float_to_raw<T>(acc[step]));
    }
  }
};

// A stopped group's combine: NaN rows (0xFF bytes in every float dtype).
EP_DEVICE void poison_combine(const LLCombineArgs& cb, int elt) {
  const size_t words = (size_t)cb.a.tokens * cb.a.hidden * elt / 4;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words;
       i += (size_t)gridDim.x * blockDim.x)
    reinterpret_cast<unsigned*>(cb.y)[i] = 0xffffffffu;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_kernel(const LLCombineArgs cb) {
  using Op = CombineOp<T>;
  const LLArgs& a = cb.a;
  __shared__ int s_fail, s_last;
  __shared__ int s_moff[kMaxRanks + 1];
  const int R = a.num_ranks, me = a.rank;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H8 = a.hidden / kLLGroupElems;
  const int nchunks = (H8 + kChunkGroups - 1) / kChunkGroups;
  const unsigned long long epoch =
      a.send ? ld_volatile_u64(&a.state->ll_epoch[1]) + 1 : ld_volatile_u64(&a.h.epochs[1]);
  const int set = (int)(epoch & 1);
  // One launch (send_only = 0): this rank's own rows are read from expert_out directly.
  const bool direct = a.send && a.recv;
  if (threadIdx.x == 0) s_fail = ld_volatile_u64(&a.state->failed) != 0;
  __syncthreads();
  if (s_fail) return poison_combine(cb, sizeof(T));

  if (a.send) {
    if (epoch > 2 &&
        !wait_all(a, kLLCombCredit, set, epoch - 2, kOpLLCombine, kWaitCredit, nullptr, &s_fail))
      return poison_combine(cb, sizeof(T));
    if (threadIdx.x == 0) {
      int m = 0;
      for (int s = 0; s < R; ++s) {
        s_moff[s] = m;
        m += a.h.rn[s];
      }
      s_moff[R] = m;
    }
    __syncthreads();
    const int items = s_moff[R] * nchunks;
    for (int i = blockIdx.x * kWarps + warp; i < items; i += gridDim.x * kWarps) {
      int s, j;
      message_of(i / nchunks, s_moff, &s, &j);
      if (direct && s == me) continue;
      Op::send_item(cb, set, s, j, i % nchunks, lane);
    }
    if (!a.recv && !a.rank_major)  // send-only: ncclEpComplete sums with these weights
      for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.tokens * a.topk;
           i += gridDim.x * blockDim.x)
        a.h.weights[i] = cb.w[i];
    if (last_cta(&a.state->ll_done[0], &s_last)) {
      publish(a, kLLCombReady, set, epoch, nullptr);
      if (threadIdx.x == 0) {
        a.state->ll_epoch[1] = epoch;
        a.h.epochs[1] = epoch;
      }
    }
  }
  if (!a.recv) return;

  if (!wait_all(a, kLLCombReady, set, epoch, kOpLLCombine, kWaitReady, nullptr, &s_fail))
    return poison_combine(cb, sizeof(T));
  const int items = a.tokens * nchunks;
  for (int i = blockIdx.x * kWarps + warp; i < items; i += gridDim.x * kWarps)
    Op::recv_item(cb, set, i / nchunks, i % nchunks, lane, direct);
  if (last_cta(&a.state->ll_done[1], &s_last)) publish(a, kLLCombCredit, set, epoch, nullptr);
}

template <typename T, bool kFp8>
cudaError_t launch_dispatch_as(const LLDispatchArgs& d, cudaStream_t stream) {
  const size_t smem = d.a.rank_major ? 0 : sizeof(int) * (size_t)d.a.num_local * d.a.num_ranks;
  ll_dispatch_kernel<T, kFp8><<<d.a.win.channels, kThreads, smem, stream>>>(d);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_combine_as(const LLCombineArgs& cb, cudaStream_t stream) {
  ll_combine_kernel<T><<<cb.a.win.channels, kThreads, 0, stream>>>(cb);
  return cudaGetLastError();
}

template <typename F>
cudaError_t preload(F kernel) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, kernel);
}

}  // namespace

size_t ll_layout_smem(int max_tokens, int max_topk, int num_experts) {
  (void)num_experts;
  return sizeof(int) * (size_t)max_tokens * max_topk;
}

cudaError_t launch_ll_layout(const LLLayoutArgs& la, cudaStream_t stream) {
  const size_t smem = ll_layout_smem(la.a.tokens, la.a.max_topk, la.a.num_experts);
  ll_layout_kernel<<<1, kLayoutThreads, smem, stream>>>(la);
  return cudaGetLastError();
}

cudaError_t launch_ll_dispatch(const LLDispatchArgs& d, cudaStream_t stream) {
  const bool fp8 = d.a.fp8 != 0;
  switch (d.a.dtype) {
    case ncclBfloat16:
      return fp8 ? launch_dispatch_as<__nv_bfloat16, true>(d, stream)
                 : launch_dispatch_as<__nv_bfloat16, false>(d, stream);
    case ncclFloat16:
      return fp8 ? launch_dispatch_as<__half, true>(d, stream)
                 : launch_dispatch_as<__half, false>(d, stream);
    default:
      return fp8 ? launch_dispatch_as<float, true>(d, stream)
                 : launch_dispatch_as<float, false>(d, stream);
  }
}

cudaError_t launch_ll_combine(const LLCombineArgs& cb, cudaStream_t stream) {
  switch (cb.a.dtype) {
    case ncclBfloat16: return launch_combine_as<__nv_bfloat16>(cb, stream);
    case ncclFloat16: return launch_combine_as<__half>(cb, stream);
    default: return launch_combine_as<float>(cb, stream);
  }
}

cudaError_t preload_ll() {
  cudaError_t e = cudaFuncSetAttribute(ll_layout_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)kLayoutSmemMax);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<__nv_bfloat16, false>);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<__nv_bfloat16, true>);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<__half, false>);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<__half, true>);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<float, false>);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<float, true>);
  if (e == cudaSuccess) e = preload(ll_combine_kernel<__nv_bfloat16>);
  if (e == cudaSuccess) e = preload(ll_combine_kernel<__half>);
  if (e == cudaSuccess) e = preload(ll_combine_kernel<float>);
  return e;
}

}  // namespace nccl_ep
