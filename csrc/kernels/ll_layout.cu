/*
 * ll_layout.cu: an LL handle's layout (docs/design.md section 9) on this rank's routing alone:
 * the ids checked (range, repeats: an error stops the group), and for each slot its row in its
 * (expert, this source) run and its token's message slot at the destination, for each token its
 * destination ranks in ascending order, the counts per expert and per destination. Positions
 * count the tokens before in token order, so no atomics decide a row.
 *
 * NOTES:
 *  - Every CTA loads and checks all of the routing (a few KB), so each reaches the same verdict
 *    with no grid-wide exchange; CTA 0 raises the error. The scans are then split: one warp per
 *    expert and per destination rank, the per-token pass grid-strided.
 *  - Shared memory holds the ids and their destination ranks k-major ([K][T]): a warp's 32
 *    consecutive tokens read 32 banks.
 *  - Each output element has one writer: the grid-strided pass writes every slot's id and the -1
 *    of masked slots, the scans the positions of the live ones.
 */
#include <algorithm>

#include "ll_common.cuh"

namespace nccl_ep {

namespace {

constexpr int kLayoutThreads = 512;
constexpr int kLayoutWarps = kLayoutThreads / 32;
// The ids (int32) and their destination ranks (int8) of T_max x max_topk slots at the LL bounds.
constexpr size_t kLayoutSmemMax = 160 * 1024;

__global__ void __launch_bounds__(kLayoutThreads, 1) ll_layout_kernel(const LLLayoutArgs la) {
  const LLArgs& a = la.a;
  extern __shared__ int s_ids[];  // [K][T], then signed char s_dst[K][T]
  __shared__ unsigned long long bad_range, bad_repeat;
  const int T = a.tokens, K = a.topk, Km = a.max_topk, E = a.num_experts, L = a.num_local,
            R = a.num_ranks;
  signed char* s_dst = reinterpret_cast<signed char*>(s_ids + (size_t)T * K);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gthread = blockIdx.x * blockDim.x + threadIdx.x, gthreads = gridDim.x * blockDim.x;
  if (threadIdx.x == 0) {
    bad_range = ~0ull;
    bad_repeat = ~0ull;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < T * K; i += blockDim.x) {
    const int t = i / K, k = i - t * K;
    const long long off = t * la.stride0 + k * la.stride1;
    const long long v = la.idx_is_64 ? reinterpret_cast<const long long*>(la.topk_idx)[off]
                                     : (long long)reinterpret_cast<const int*>(la.topk_idx)[off];
    const bool ok = v >= -1 && v < E;
    if (!ok) atomicMin(&bad_range, (unsigned long long)(t * Km + k));
    s_ids[k * T + t] = ok ? (int)v : -1;
    s_dst[k * T + t] = ok && v >= 0 ? (signed char)(v / L) : (signed char)-1;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < T; t += blockDim.x) {
    for (int k = 1; k < K; ++k) {
      const int e = s_ids[k * T + t];
      bool repeat = false;
      for (int k2 = 0; k2 < k; ++k2) repeat |= e >= 0 && s_ids[k2 * T + t] == e;
      if (repeat) {
        atomicMin(&bad_repeat, (unsigned long long)(t * Km + k));
        break;
      }
    }
  }
  __syncthreads();
  if (bad_range != ~0ull || bad_repeat != ~0ull) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      if (bad_range != ~0ull) {
        const int t = (int)(bad_range / Km), k = (int)(bad_range % Km);
        const long long off = t * la.stride0 + k * la.stride1;
        const long long v = la.idx_is_64
                                ? reinterpret_cast<const long long*>(la.topk_idx)[off]
                                : (long long)reinterpret_cast<const int*>(la.topk_idx)[off];
        raise_error(a.err, kErrExpertRange, a.rank, t, k, v, E, kRecordTopkIdx);
      } else {
        const int t = (int)(bad_repeat / Km), k = (int)(bad_repeat % Km);
        raise_error(a.err, kErrDuplicateExpert, a.rank, t, k, s_ids[k * T + t], 0);
      }
      stop_group(a.peers, a.win.sync_off, R, &a.state->failed, (unsigned long long)a.rank + 1);
    }
    return;
  }
  // Every slot's id; masked slots (and those past K) have no row, message slot or destination.
  for (int i = gthread; i < T * Km; i += gthreads) {
    const int t = i / Km, k = i - t * Km;
    const int e = k < K ? s_ids[k * T + t] : -1;
    a.h.ids[i] = e;
    if (e < 0) {
      a.h.pos[i] = -1;
      a.h.jslot[i] = -1;
      a.h.dpos[i] = -1;
    }
  }
  // One warp per expert (its slots' rows in its run: the tokens before naming it), then one per
  // destination rank (its tokens' message slots: the tokens before sent there).
  for (int task = blockIdx.x * kLayoutWarps + warp; task < E + R;
       task += gridDim.x * kLayoutWarps) {
    const bool expert = task < E;
    const int target = expert ? task : task - E;
    int run = 0;
    for (int t0 = 0; t0 < T; t0 += 32) {
      const int t = t0 + lane;
      int kk = -1;  // expert: the slot naming it; destination: whether any slot goes there
      if (t < T)
        for (int k = 0; k < K; ++k)
          if (expert ? s_ids[k * T + t] == target : s_dst[k * T + t] == target) kk = k;
      const unsigned m = __ballot_sync(0xffffffffu, kk >= 0);
      if (kk >= 0) {
        const int j = run + __popc(m & ((1u << lane) - 1));
        if (expert) {
          a.h.pos[t * Km + kk] = j;
        } else {
          for (int k = 0; k < K; ++k)
            if (s_dst[k * T + t] == target) a.h.jslot[t * Km + k] = j;
        }
      }
      run += __popc(m);
    }
    if (lane == 0) (expert ? a.h.cnt : a.h.ndest)[target] = run;
  }
  // Each token's destination ranks, ascending.
  for (int t = gthread; t < T; t += gthreads) {
    unsigned long long mask = 0;
    for (int k = 0; k < K; ++k) {
      const int d = s_dst[k * T + t];
      if (d >= 0) mask |= 1ull << d;
    }
    for (int k = 0; k < K; ++k) {
      const int d = s_dst[k * T + t];
      if (d >= 0) a.h.dpos[t * Km + k] = __popcll(mask & ((1ull << d) - 1));
    }
    a.h.ndst[t] = __popcll(mask);
    a.h.own_dpos[t] = (mask >> a.rank) & 1 ? __popcll(mask & ((1ull << a.rank) - 1)) : -1;
  }
}

}  // namespace

cudaError_t launch_ll_layout(const LLLayoutArgs& la, cudaStream_t stream) {
  const size_t slots = (size_t)la.a.tokens * la.a.topk;
  const size_t smem = slots * (sizeof(int) + sizeof(signed char));
  const int tasks = la.a.num_experts + la.a.num_ranks;
  const int ctas = std::max(1, std::min(la.a.win.channels, (tasks + kLayoutWarps - 1) / kLayoutWarps));
  ll_layout_kernel<<<ctas, kLayoutThreads, smem, stream>>>(la);
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
