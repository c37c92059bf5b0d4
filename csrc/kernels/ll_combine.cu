/*
 * ll_combine.cu: the LL combine (docs/design.md section 9). Send: each received message's expert
 * rows (expert-major: one per slot here; rank-major: the partial row) into its source's combine
 * area, then one ready flag per source. Receive: each (token, column chunk) summed in the fixed
 * order (expert-major: slots ascending, weighted; rank-major: destination ranks ascending).
 *
 * NOTES: expert_out is the token dtype T, or fp32 (In = float) where T is 16-bit: each element is
 * rounded to T (nearest even) as it is read, so every later step sees the rows a cast to T
 * first would give, bitwise (the window holds T either way).
 */
#include "ll_common.cuh"

namespace nccl_ep {

namespace {

template <typename T, typename In>
struct CombineOp {
  static constexpr int kB = kLLGroupElems * sizeof(T);
  static constexpr int kIn = kLLGroupElems * sizeof(In);  // a pack of expert_out

  // Rows whose loads are in flight together (their registers: kBatch x 2 packs per lane).
  static constexpr int kBatch = sizeof(T) == 4 ? 2 : 4;
  static constexpr int kSteps = kChunkGroups / 32;

  // Pack g of an expert_out row, in T.
  static EP_DEVICE Raw<kB> ld_expert(const char* row, int g) {
    if constexpr (kIn == kB) {
      return ld_raw<kB, false>(row + (size_t)g * kB);
    } else {
      float f[kLLGroupElems];
      raw_to_float<In>(ld_raw<kIn, false>(row + (size_t)g * kIn), f);
      return float_to_raw<T>(f);
    }
  }

  // Loads chunk c of the rows src[b] that `take` names (window rows through L2 where `window`
  // says so, else expert_out rows), every load issued before any is used.
  template <typename Take, typename Window>
  static EP_DEVICE void load_chunks(Raw<kB> (&v)[kBatch][kSteps],
                                    const char* const (&src)[kBatch], Take take, Window window,
                                    int c, int H8, int lane) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        const int g = c * kChunkGroups + step * 32 + lane;
        if (take(b) && g < H8)
          v[b][step] = window(b) ? ld_raw<kB, true>(src[b] + (size_t)g * kB)
                                 : ld_expert(src[b], g);
      }
  }

  // Copies chunk c of up to kBatch expert_out rows src[b] to window rows dst[b] (b < n): every
  // load issued before the first store.
  static EP_DEVICE void copy_chunks(char* const (&dst)[kBatch], const char* const (&src)[kBatch],
                                    int n, int c, int H8, int lane) {
    Raw<kB> v[kBatch][kSteps];
    load_chunks(v, src, [&](int b) { return b < n; }, [](int) { return false; }, c, H8, lane);
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        const int g = c * kChunkGroups + step * 32 + lane;
        if (b < n && g < H8) st_raw<kB>(dst[b] + (size_t)g * kB, v[b][step]);
      }
  }

  // The expert rows of one received message back into its source's combine area.
  static EP_DEVICE void send_item(const LLCombineArgs& cb, int set, int s, int j, int c,
                                  int lane, void* const* s_peers) {
    const LLArgs& a = cb.a;
    const int Km = a.max_topk, H8 = a.hidden / kLLGroupElems;
    const size_t sj = (size_t)s * a.max_tokens + j;
    const size_t row_bytes = (size_t)a.hidden * sizeof(In);
    const char* out = reinterpret_cast<const char*>(cb.expert_out);
    const int t = a.h.rtok[sj];
    char* dst[kBatch];
    const char* src[kBatch];
    if (!a.rank_major) {
      const int row = lane < Km ? a.h.rrow[sj * Km + lane] : -1;
      unsigned slots = __ballot_sync(0xffffffffu, row >= 0);
      while (slots != 0) {  // warp-uniform
        int n = 0;
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (slots == 0) break;
          const int k = __ffs(slots) - 1;
          dst[b] = ll_comb(s_peers[s], a, set, t, k);
          src[b] = out + (size_t)__shfl_sync(0xffffffffu, row, k) * row_bytes;
          slots &= slots - 1;
          n = b + 1;
        }
        copy_chunks(dst, src, n, c, H8, lane);
      }
    } else {
      dst[0] = ll_comb(s_peers[s], a, set, t, a.h.rdpos[sj]);
      src[0] = out + (size_t)(a.h.roff[s] + j) * row_bytes;
      copy_chunks(dst, src, 1, c, H8, lane);
    }
  }

  // y[t] chunk c: the fixed-order sum of the token's rows (design section 9). Rows are loaded
  // kBatch at a time and added in order, so the batching changes no bit.
  static EP_DEVICE void recv_item(const LLCombineArgs& cb, int set, int t, int c, int lane,
                                  bool direct, void* const* s_peers) {
    const LLArgs& a = cb.a;
    const int Km = a.max_topk, H8 = a.hidden / kLLGroupElems, me = a.rank;
    const size_t row_bytes = (size_t)a.hidden * sizeof(In);
    const char* out = reinterpret_cast<const char*>(cb.expert_out);
    float acc[kSteps][kLLGroupElems];
#pragma unroll
    for (int step = 0; step < kSteps; ++step)
#pragma unroll
      for (int q = 0; q < kLLGroupElems; ++q) acc[step][q] = 0.f;
    // The token's routing, loaded together (own_row is used only where the row is this rank's).
    const int n = a.rank_major ? a.h.ndst[t] : a.topk;
    const int own = a.rank_major ? a.h.own_dpos[t] : -1;
    const int own_row0 = a.rank_major ? a.h.own_row[t * Km] : 0;
    // A send-only combine's weights were kept by its send (the caller's may have changed).
    const float* weights = a.send ? cb.w : a.h.weights;
    for (int k0 = 0; k0 < n; k0 += kBatch) {
      const char* src[kBatch];
      float w[kBatch];
      bool live[kBatch], from_window[kBatch];
      int e[kBatch], orow[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int k = k0 + b;
        e[b] = 0;
        w[b] = 1.f;
        orow[b] = own_row0;
        if (!a.rank_major && k < n) {
          e[b] = a.h.ids[t * Km + k];
          w[b] = weights[(size_t)t * a.topk + k];
          orow[b] = a.h.own_row[t * Km + k];
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int k = k0 + b;
        live[b] = k < n && e[b] >= 0;
        from_window[b] = !(direct && (a.rank_major ? k == own : e[b] / a.num_local == me));
        src[b] = from_window[b] ? ll_comb(s_peers[me], a, set, t, k)
                                : out + (size_t)orow[b] * row_bytes;
      }
      Raw<kB> v[kBatch][kSteps];
      load_chunks(v, src, [&](int b) { return live[b]; }, [&](int b) { return from_window[b]; },
                  c, H8, lane);
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (!live[b]) continue;
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
          if (c * kChunkGroups + step * 32 + lane >= H8) continue;
          float f[kLLGroupElems];
          raw_to_float<T>(v[b][step], f);
#pragma unroll
          for (int q = 0; q < kLLGroupElems; ++q)
            acc[step][q] = a.rank_major ? __fadd_rn(acc[step][q], f[q])
                                        : __fadd_rn(acc[step][q], __fmul_rn(w[b], f[q]));
        }
      }
    }
    char* y = reinterpret_cast<char*>(cb.y) + (size_t)t * a.hidden * sizeof(T);
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
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

template <typename T, typename In>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_kernel(const LLCombineArgs cb) {
  using Op = CombineOp<T, In>;
  const LLArgs& a = cb.a;
  __shared__ int s_moff[kMaxRanks + 1];
  __shared__ void* s_peers[kMaxRanks];
  const int R = a.num_ranks, me = a.rank;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int H8 = a.hidden / kLLGroupElems;
  const int nchunks = (H8 + kChunkGroups - 1) / kChunkGroups;
  const unsigned long long epoch = op_epoch(a, 1);
  const int set = ll_set(epoch);
  // One launch (send_only = 0): this rank's own rows are read from expert_out directly, so it
  // waits for no flag of its own.
  const bool direct = a.send && a.recv;
  if (threadIdx.x < R) s_peers[threadIdx.x] = a.peers[threadIdx.x];
  bool bad = threadIdx.x == 0 && ld_volatile_u64(&a.state->failed) != 0;
  if (a.send && epoch > kLLSets)
    bad |= wait_peers(a, kLLCombCredit, set, epoch - kLLSets, kOpLLCombine, kWaitCredit, me);
  if (__syncthreads_or(bad)) return poison_combine(cb, sizeof(T));

  if (a.send) {
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
      Op::send_item(cb, set, s, j, i % nchunks, lane, s_peers);
    }
    if (!a.recv && !a.rank_major)  // send-only: ncclEpComplete sums with these weights
      for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.tokens * a.topk;
           i += gridDim.x * blockDim.x)
        a.h.weights[i] = cb.w[i];
    sent(a, 1, epoch);
    arrive(a, kLLCombReady, set, direct ? kOwnCountOnly : kOwnRelease);
  }
  if (!a.recv) return;

  if (__syncthreads_or(
          wait_peers(a, kLLCombReady, set, epoch, kOpLLCombine, kWaitReady, direct ? me : -1)))
    return poison_combine(cb, sizeof(T));
  const int items = a.tokens * nchunks;
  for (int i = blockIdx.x * kWarps + warp; i < items; i += gridDim.x * kWarps)
    Op::recv_item(cb, set, i / nchunks, i % nchunks, lane, direct, s_peers);
  arrive(a, kLLCombCredit, set, kOwnNone);
}

template <typename T, typename In>
cudaError_t launch_combine_as(const LLCombineArgs& cb, cudaStream_t stream) {
  ll_combine_kernel<T, In><<<cb.a.win.channels, kThreads, 0, stream>>>(cb);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_combine_of(const LLCombineArgs& cb, cudaStream_t stream) {
  return cb.expert_fp32 ? launch_combine_as<T, float>(cb, stream)
                        : launch_combine_as<T, T>(cb, stream);
}


}  // namespace

cudaError_t launch_ll_combine(const LLCombineArgs& cb, cudaStream_t stream) {
  switch (cb.a.dtype) {
    case ncclBfloat16: return launch_combine_of<__nv_bfloat16>(cb, stream);
    case ncclFloat16: return launch_combine_of<__half>(cb, stream);
    default: return launch_combine_as<float, float>(cb, stream);
  }
}

cudaError_t preload_ll_combine() {
  cudaError_t e = preload(ll_combine_kernel<__nv_bfloat16, __nv_bfloat16>);
  if (e == cudaSuccess) e = preload(ll_combine_kernel<__nv_bfloat16, float>);
  if (e == cudaSuccess) e = preload(ll_combine_kernel<__half, __half>);
  if (e == cudaSuccess) e = preload(ll_combine_kernel<__half, float>);
  if (e == cudaSuccess) e = preload(ll_combine_kernel<float, float>);
  return e;
}

}  // namespace nccl_ep
