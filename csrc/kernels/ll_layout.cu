/*
 * ll_layout.cu: an LL handle's layout (docs/design.md section 9), one CTA on this rank's routing
 * alone: the ids checked (range, repeats: an error stops the group), and for each slot its row
 * in its (expert, this source) run and its token's message slot at the destination, for each
 * token its destination ranks in ascending order, the counts per expert and per destination.
 * Positions count the tokens before in token order, so no atomics decide a row.
 */
#include "ll_common.cuh"

namespace nccl_ep {

namespace {

constexpr int kLayoutThreads = 1024;
constexpr size_t kLayoutSmemMax = 160 * 1024;  // T_max x max_topk ids at the LL bounds

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

}  // namespace

cudaError_t launch_ll_layout(const LLLayoutArgs& la, cudaStream_t stream) {
  const size_t smem = sizeof(int) * (size_t)la.a.tokens * la.a.max_topk;  // its ids
  ll_layout_kernel<<<1, kLayoutThreads, smem, stream>>>(la);
  return cudaGetLastError();
}

cudaError_t preload_ll() {
  cudaError_t e = cudaFuncSetAttribute(ll_layout_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)kLayoutSmemMax);
  if (e == cudaSuccess) e = preload_ll_dispatch();
  if (e == cudaSuccess) e = preload_ll_combine();
  return e;
}

}  // namespace nccl_ep
