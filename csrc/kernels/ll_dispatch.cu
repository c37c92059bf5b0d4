/*
 * ll_dispatch.cu: the LL dispatch (docs/design.md section 9). Send: each destination's message
 * count (its count word), then each (token, column chunk) loaded once (cast to the payload
 * dtype: FP8 per kFp8Block columns with ncclEpPayloadFloat8e4m3) and stored into its message at
 * every destination rank, then the per-expert counts (expert-major) and one ready flag per
 * destination. Receive: every source's flag and count word, the rows' offsets from the counts,
 * each (message, chunk) into its rows.
 */
#include "ll_common.cuh"

namespace nccl_ep {

namespace {

static_assert(kChunkGroups % 32 == 0 && kChunkGroups % kFp8BlockPacks == 0,
              "a work item is whole warp passes and whole FP8 blocks");

template <typename T, bool kFp8>
struct DispatchOp {
  static constexpr int kIn = kLLGroupElems * sizeof(T);  // bytes of an input pack
  static constexpr int kOut = kFp8 ? kLLGroupElems : kIn;  // bytes of a payload / output pack
  static constexpr int kSteps = kChunkGroups / 32;  // packs per lane of a work item

  // What one (token, chunk) reads, all independent of each other: the chunk and the token's
  // slots (their ids and message slots; with the chunk 0, what its header needs). A warp loads
  // its first item before the op's start checks, so those loads and the checks overlap.
  struct Loaded {
    Raw<kIn> in[kSteps];
    int e, jslot, pos, dpos;
    float w;
  };

  static EP_DEVICE void load_item(const LLDispatchArgs& d, int t, int c, int lane, Loaded& l) {
    const LLArgs& a = d.a;
    const int Km = a.max_topk, H8 = a.hidden / kLLGroupElems;
    const char* xrow = reinterpret_cast<const char*>(d.x) + (size_t)t * a.hidden * sizeof(T);
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const int g = c * kChunkGroups + step * 32 + lane;
      if (g < H8) l.in[step] = ld_raw<kIn, false>(xrow + (size_t)g * kIn);
    }
    l.e = l.jslot = l.pos = l.dpos = -1;
    l.w = 0.f;
    if (lane < a.topk) {
      const int i = t * Km + lane;
      l.e = a.h.ids[i];
      l.jslot = a.h.jslot[i];
      if (c == 0) {
        l.pos = a.h.pos[i];
        l.dpos = a.h.dpos[i];
        if (d.w != nullptr) l.w = d.w[(size_t)t * a.topk + lane];
      }
    }
  }

  // One loaded (token, chunk): cast once, stored into the message of every destination; the
  // peers' window bases come from shared memory (s_peers).
  static EP_DEVICE void send_item(const LLDispatchArgs& d, int set, int t, int c, int lane,
                                  const Loaded& l, void* const* s_peers) {
    const LLArgs& a = d.a;
    const int Km = a.max_topk, H8 = a.hidden / kLLGroupElems;
    const size_t hdr = a.win.ll.hdr_bytes;
    const Raw<kIn>(&in)[kSteps] = l.in;
    const int e = l.e;
    const int dest = e >= 0 ? e / a.num_local : -1;
    const unsigned same = __match_any_sync(0xffffffffu, dest);
    const bool first = dest >= 0 && (int)(__ffs(same) - 1) == lane;
    const unsigned firsts = __ballot_sync(0xffffffffu, first);
    if (firsts == 0) return;  // warp-uniform: every slot masked
    unsigned long long mine = 0;  // lane f's destination message
    if (first)
      mine = reinterpret_cast<unsigned long long>(ll_msg(s_peers[dest], a, set, a.rank, l.jslot));
    if constexpr (kFp8) {
      Raw<kOut> q8[kSteps];
      float scale[kSteps];
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        const bool valid = c * kChunkGroups + step * 32 + lane < H8;
        float f[kLLGroupElems];
        if (valid) {
          raw_to_float<T>(in[step], f);
        } else {
#pragma unroll
          for (int q = 0; q < kLLGroupElems; ++q) f[q] = 0.f;
        }
        float amax = 0.f;
#pragma unroll
        for (int q = 0; q < kLLGroupElems; ++q) amax = fmaxf(amax, fabsf(f[q]));
        // The kFp8BlockPacks lanes of one block of kFp8Block columns (blocks start at multiples
        // of kFp8BlockPacks packs).
#pragma unroll
        for (int o = kFp8BlockPacks / 2; o >= 1; o >>= 1)
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float floor_amax = fmaxf(amax, kFp8AmaxFloor);
        scale[step] = __fdiv_rn(floor_amax, kFp8Max);
        const float factor = __fdiv_rn(kFp8Max, floor_amax);
        unsigned char* qb = reinterpret_cast<unsigned char*>(&q8[step]);
#pragma unroll
        for (int q = 0; q < kLLGroupElems; ++q)
          qb[q] = (unsigned char)__nv_cvt_float_to_fp8(__fmul_rn(f[q], factor), __NV_SATFINITE,
                                                       __NV_E4M3);
      }
      EP_FOR_EACH_LANE(firsts, f_lane) {
        char* msg = reinterpret_cast<char*>(__shfl_sync(0xffffffffu, mine, f_lane));
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
          const int g = c * kChunkGroups + step * 32 + lane;
          if (g >= H8) continue;
          st_raw<kOut>(msg + hdr + (size_t)g * kOut, q8[step]);
          if ((lane & (kFp8BlockPacks - 1)) == 0)
            *reinterpret_cast<float*>(msg + hdr + a.hidden + (size_t)(g / kFp8BlockPacks) * 4) =
                scale[step];
        }
      }
    } else {
      EP_FOR_EACH_LANE(firsts, f_lane) {
        char* msg = reinterpret_cast<char*>(__shfl_sync(0xffffffffu, mine, f_lane));
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
          const int g = c * kChunkGroups + step * 32 + lane;
          if (g < H8) st_raw<kOut>(msg + hdr + (size_t)g * kOut, in[step]);
        }
      }
    }
    if (c != 0) return;
    // The header: the token, its ids, per slot its row position at that destination, weights.
    EP_FOR_EACH_LANE(firsts, f_lane) {
      char* msg = reinterpret_cast<char*>(__shfl_sync(0xffffffffu, mine, f_lane));
      const int dest_f = __shfl_sync(0xffffffffu, dest, f_lane);
      const int dest_pos = __shfl_sync(0xffffffffu, l.dpos, f_lane);
      int* ids = reinterpret_cast<int*>(msg + sizeof(LLHeader));
      if (lane < Km) {
        ids[lane] = e;
        ids[Km + lane] = e >= 0 && dest == dest_f ? l.pos : -1;
        reinterpret_cast<float*>(ids + 2 * Km)[lane] = l.w;
      }
      if (lane == 0) {
        LLHeader hd;
        hd.token = t;
        hd.dest_pos = dest_pos;
        hd.topk = a.topk;
        hd.pad = 0;
        *reinterpret_cast<LLHeader*>(msg) = hd;
      }
    }
  }

  // One (message, chunk) into its rows: expert-major every slot of this rank, rank-major one row.
  static EP_DEVICE void recv_item(const LLDispatchArgs& d, int set, int s, int j, int c, int lane,
                                  const int* s_off, const int* s_moff, void* const* s_peers) {
    const LLArgs& a = d.a;
    const int Km = a.max_topk, H8 = a.hidden / kLLGroupElems, me = a.rank;
    const long long RT = (long long)a.num_ranks * a.max_tokens;
    const char* msg = ll_msg(s_peers[me], a, set, s, j);
    // The payload's loads first: they do not wait for the header's.
    const size_t hdr = a.win.ll.hdr_bytes;
    Raw<kOut> v[kSteps];
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const int g = c * kChunkGroups + step * 32 + lane;
      if (g < H8) v[step] = ld_raw<kOut, true>(msg + hdr + (size_t)g * kOut);
    }
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
    const size_t out_row = (size_t)a.hidden * (kFp8 ? 1 : sizeof(T));
    char* out = reinterpret_cast<char*>(d.recv_x);
    EP_FOR_EACH_LANE(rows, f_lane) {
      const int r = __shfl_sync(0xffffffffu, row, f_lane);
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        const int g = c * kChunkGroups + step * 32 + lane;
        if (g < H8) st_raw<kOut>(out + (size_t)r * out_row + (size_t)g * kOut, v[step]);
      }
    }
    if constexpr (kFp8) {
      const int blocks = a.hidden / kFp8Block;
      const int b = c * (kChunkGroups / kFp8BlockPacks) + lane;  // a chunk's blocks
      const bool valid = lane < kChunkGroups / kFp8BlockPacks && b < blocks;
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
  __shared__ int s_moff[kMaxRanks + 1];
  __shared__ void* s_peers[kMaxRanks];
  const int R = a.num_ranks, L = a.num_local, me = a.rank;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H8 = a.hidden / kLLGroupElems;
  const int nchunks = (H8 + kChunkGroups - 1) / kChunkGroups;
  const unsigned long long epoch = op_epoch(a, 0);
  const int set = ll_set(epoch);
  if (threadIdx.x < R) s_peers[threadIdx.x] = a.peers[threadIdx.x];
  // What each destination gets told, loaded ahead of the checks with this warp's first item:
  // expert-major its tokens per local expert, [R][L] over the grid's threads; from CTA 0's
  // thread d, destination d's message count (its count word).
  const int send_items = a.send ? a.tokens * nchunks : 0;
  const int count_first = blockIdx.x * blockDim.x + threadIdx.x;
  const int counts = a.send && !a.rank_major ? R * L : 0;
  int count = count_first < counts ? a.h.cnt[count_first] : 0;
  const bool announces = a.send && blockIdx.x == 0 && threadIdx.x < R;
  const int messages = announces ? a.h.ndest[threadIdx.x] : 0;
  int item = blockIdx.x * kWarps + warp;
  typename Op::Loaded loaded;
  if (item < send_items) Op::load_item(d, item / nchunks, item % nchunks, lane, loaded);
  // A stopped group; for a send, set `set` is free at every destination once it consumed op
  // epoch - kLLSets (the group's state and the credits are read together).
  bool bad = threadIdx.x == 0 && ld_volatile_u64(&a.state->failed) != 0;
  if (a.send && epoch > kLLSets)
    bad |= wait_peers(a, kLLDispCredit, set, epoch - kLLSets, kOpLLDispatch, kWaitCredit, me);
  if (__syncthreads_or(bad)) return poison_dispatch(d);

  if (a.send) {
    if (announces)
      st_relaxed_sys(ll_count_word(s_peers[threadIdx.x], a, set, me), count_word(epoch, messages));
    for (bool first = true; item < send_items; item += gridDim.x * kWarps, first = false) {
      if (!first) Op::load_item(d, item / nchunks, item % nchunks, lane, loaded);
      Op::send_item(d, set, item / nchunks, item % nchunks, lane, loaded, s_peers);
    }
    for (int i = count_first; i < counts; i += gridDim.x * blockDim.x) {
      const int dst = i / L;
      if (i != count_first) count = a.h.cnt[i];
      ll_counts(s_peers[dst], a, set, me)[i - dst * L] = count;
    }
    sent(a, 0, epoch);
    arrive(a, kLLDispReady, set, kOwnRelease);
  }
  if (!a.recv) return;

  int received = 0;  // thread s: source s's messages
  const bool stopped =
      wait_peers(a, kLLDispReady, set, epoch, kOpLLDispatch, kWaitReady, -1, &received);
  if (threadIdx.x < R) s_moff[threadIdx.x] = received;
  if (__syncthreads_or(stopped)) return poison_dispatch(d);
  if (warp == 0) {  // the sources' first message indices: a scan of their counts, in place
    int run = 0;
    for (int s0 = 0; s0 < R; s0 += 32) {
      const int s = s0 + lane;
      const int n = s < R ? s_moff[s] : 0;
      int incl = n;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      if (s < R) s_moff[s] = run + incl - n;
      run += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) s_moff[R] = run;
  }
  if (!a.rank_major) {
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      int run = 0;
      for (int s = 0; s < R; ++s) {
        s_off[l * R + s] = run;
        run += __ldcg(ll_counts(s_peers[me], a, set, s) + l);
      }
      if (blockIdx.x == 0) d.recv_count[l] = run;
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    if (threadIdx.x < R) a.h.rn[threadIdx.x] = s_moff[threadIdx.x + 1] - s_moff[threadIdx.x];
    if (a.rank_major && threadIdx.x <= R) a.h.roff[threadIdx.x] = s_moff[threadIdx.x];
    if (a.rank_major && threadIdx.x == 0) d.recv_count[0] = s_moff[R];
  }
  const int items = s_moff[R] * nchunks;
  for (int i = blockIdx.x * kWarps + warp; i < items; i += gridDim.x * kWarps) {
    int s, j;
    message_of(i / nchunks, s_moff, &s, &j);
    Op::recv_item(d, set, s, j, i % nchunks, lane, s_off, s_moff, s_peers);
  }
  if (a.rank_major) {  // rows past the count: no routing
    const long long Km = a.max_topk, rows = (long long)R * a.max_tokens;
    for (long long i = (long long)s_moff[R] * Km + blockIdx.x * blockDim.x + threadIdx.x;
         i < rows * Km; i += (long long)gridDim.x * blockDim.x) {
      d.recv_topk_idx[i] = -1;
      if (d.recv_topk_w != nullptr) d.recv_topk_w[i] = 0.f;
    }
  }
  arrive(a, kLLDispCredit, set, kOwnNone);
}

template <typename T, bool kFp8>
cudaError_t launch_dispatch_as(const LLDispatchArgs& d, cudaStream_t stream) {
  const size_t smem = d.a.rank_major ? 0 : sizeof(int) * (size_t)d.a.num_local * d.a.num_ranks;
  ll_dispatch_kernel<T, kFp8><<<d.a.win.channels, kThreads, smem, stream>>>(d);
  return cudaGetLastError();
}


}  // namespace

cudaError_t launch_ll_dispatch(const LLDispatchArgs& d, cudaStream_t stream) {
  const bool fp8 = d.a.payload == ncclEpPayloadFloat8e4m3;
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

cudaError_t preload_ll_dispatch() {
  cudaError_t e = preload(ll_dispatch_kernel<__nv_bfloat16, false>);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<__nv_bfloat16, true>);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<__half, false>);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<__half, true>);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<float, false>);
  if (e == cudaSuccess) e = preload(ll_dispatch_kernel<float, true>);
  return e;
}

}  // namespace nccl_ep
