/*
 * dispatch.cu: HT dispatch (DESIGN §3), push style.
 *
 *   send    (source rank s, up to num_sms CTAs, one warp per token): token t is read once and
 *           written once into the staging of every destination rank d it has a slot on, at
 *           [s][t - c0] (through the peer pointer; the local window when d == s), together with
 *           its K probabilities. A token crosses NVLink once per destination rank, never once
 *           per expert.
 *   (barrier)
 *   expand  (destination rank d, one warp per output row): row r takes staging[s][t - c0] of its
 *           slot (s, t, k) and prob [s][t - c0][k]; padding rows and the capacity tail get zeros
 *           (prob 0), written by the first chunk only.
 *
 * NOTES:
 *  - Rows come from src_of_row (layout.cu); nothing here decides placement.
 *  - The vector path moves 16-byte packs; the host picks it only when the row size and every
 *    pointer are 16-byte aligned (staging rows always are), else the element path is used.
 */
#include "api.cuh"
#include "transport.cuh"

namespace nccl_ep {


template <typename U>
__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(DispatchArgs a) {
  const ExchangeArgs& e = a.ex;
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * kWarps) + (threadIdx.x >> 5);
  const int num_warps = gridDim.x * kWarps;
  const int row_bytes = e.hidden * elt_bytes(a.dtype);
  int end = e.c0 + e.chunk;
  if (end > e.num_tokens) end = e.num_tokens;
  for (int t = e.c0 + warp; t < end; t += num_warps) {
    const int* routing = e.own_routing + (size_t)t * e.topk;
    unsigned long long mask = dest_mask(routing, e.topk, e.num_local, e.num_ranks);
    const char* src = reinterpret_cast<const char*>(a.x) + (size_t)t * row_bytes;
    const long long slot = (long long)e.rank * e.chunk + (t - e.c0);
    while (mask) {
      const int d = __ffsll((long long)mask) - 1;
      mask &= mask - 1;
      void* peer = e.peers[d];
      warp_copy<U>(stage_row(peer, e.tok_off, e.stage_row_bytes, slot), src, row_bytes, lane);
      if (a.probs != nullptr && lane < e.topk) {
        copy_prob(stage_prob(peer, e.prob_off, slot * e.max_topk + lane),
                  reinterpret_cast<const char*>(a.probs) + ((size_t)t * e.topk + lane) * a.prob_bytes,
                  a.prob_bytes);
      }
    }
  }
  __threadfence_system();
}

template <typename U>
__global__ void __launch_bounds__(kThreads) dispatch_expand_kernel(DispatchArgs a) {
  const ExchangeArgs& e = a.ex;
  const int lane = threadIdx.x & 31;
  const long long warp = (long long)(blockIdx.x * kWarps) + (threadIdx.x >> 5);
  const long long num_warps = (long long)gridDim.x * kWarps;
  const int row_bytes = e.hidden * elt_bytes(a.dtype);
  void* self = e.peers[e.rank];
  for (long long r = warp; r < e.rows; r += num_warps) {
    const int slot = r < e.src_rows ? e.src_of_row[r] : -1;
    char* dst = reinterpret_cast<char*>(a.recv_x) + (size_t)r * row_bytes;
    if (slot < 0) {
      if (e.first_chunk) {
        warp_zero<U>(dst, row_bytes, lane);
        if (a.recv_probs != nullptr && lane == 0)
          zero_prob(reinterpret_cast<char*>(a.recv_probs) + (size_t)r * a.prob_bytes, a.prob_bytes);
      }
      continue;
    }
    const int k = slot % e.max_topk;
    const int st = slot / e.max_topk;
    const int s = st / e.max_tokens, t = st % e.max_tokens;
    if (t < e.c0 || t >= e.c0 + e.chunk) continue;
    const long long sidx = (long long)s * e.chunk + (t - e.c0);
    warp_copy<U>(dst, stage_row(self, e.tok_off, e.stage_row_bytes, sidx), row_bytes, lane);
    if (a.recv_probs != nullptr && lane == 0) {
      copy_prob(reinterpret_cast<char*>(a.recv_probs) + (size_t)r * a.prob_bytes,
                stage_prob(self, e.prob_off, sidx * e.max_topk + k), a.prob_bytes);
    }
  }
}

// Element unit of the scalar path: the token element size (2 or 4 bytes).
#define EP_LAUNCH_BY_UNIT(kernel, vec, dtype, grid, stream, args)                    \
  do {                                                                                \
    if (vec) {                                                                        \
      kernel<uint4><<<grid, kThreads, 0, stream>>>(args);                             \
    } else if (elt_bytes(dtype) == 2) {                                               \
      kernel<unsigned short><<<grid, kThreads, 0, stream>>>(args);                    \
    } else {                                                                          \
      kernel<unsigned int><<<grid, kThreads, 0, stream>>>(args);                      \
    }                                                                                 \
  } while (0)

cudaError_t launch_dispatch_send(const DispatchArgs& a, cudaStream_t stream) {
  long long n = (long long)a.ex.num_tokens - a.ex.c0;
  if (n > a.ex.chunk) n = a.ex.chunk;
  if (n <= 0) return cudaSuccess;
  const int grid = grid_for(n, a.ex.num_sms);
  EP_LAUNCH_BY_UNIT(dispatch_send_kernel, a.ex.vec, a.dtype, grid, stream, a);
  return cudaGetLastError();
}

cudaError_t launch_dispatch_expand(const DispatchArgs& a, cudaStream_t stream) {
  if (a.ex.rows <= 0) return cudaSuccess;
  const int grid = grid_for(a.ex.rows, a.ex.num_sms);
  EP_LAUNCH_BY_UNIT(dispatch_expand_kernel, a.ex.vec, a.dtype, grid, stream, a);
  return cudaGetLastError();
}

}  // namespace nccl_ep
