/*
 * ll_combine.cu: the LL combine (docs/design.md section 9). Send: each received message's expert
 * rows (expert-major: one per slot here; rank-major: the partial row) into its source's combine
 * area, then one ready flag per source. Receive: each (token, column chunk) summed in the fixed
 * order (expert-major: slots ascending, weighted; rank-major: destination ranks ascending).
 */
#include "ll_common.cuh"

namespace nccl_ep {

namespace {

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


template <typename T>
cudaError_t launch_combine_as(const LLCombineArgs& cb, cudaStream_t stream) {
  ll_combine_kernel<T><<<cb.a.win.channels, kThreads, 0, stream>>>(cb);
  return cudaGetLastError();
}


}  // namespace

cudaError_t launch_ll_combine(const LLCombineArgs& cb, cudaStream_t stream) {
  switch (cb.a.dtype) {
    case ncclBfloat16: return launch_combine_as<__nv_bfloat16>(cb, stream);
    case ncclFloat16: return launch_combine_as<__half>(cb, stream);
    default: return launch_combine_as<float>(cb, stream);
  }
}

cudaError_t preload_ll_combine() {
  cudaError_t e = preload(ll_combine_kernel<__nv_bfloat16>);
  if (e == cudaSuccess) e = preload(ll_combine_kernel<__half>);
  if (e == cudaSuccess) e = preload(ll_combine_kernel<float>);
  return e;
}

}  // namespace nccl_ep
