/*
 * dispatch.cu: HT dispatch (DESIGN §3), push style.
 *
 *   send    (source rank s, up to num_sms CTAs, one warp per token): token t is read once and
 *           written once into the staging of every other destination rank d it has a slot on,
 *           at [s][t - c0] through the peer pointer, together with its K probabilities. A token
 *           crosses NVLink once per destination rank, never once per expert.
 *   (barrier)
 *   expand  (destination rank d, one warp per token (s, t) of the chunk): the token is read once
 *           (from x when s == d, else from the staging) and written to each of its rows here
 *           (recv_row[s][t][k]), with its prob; padding rows and the capacity tail get zeros
 *           (prob 0), written by the first chunk.
 *
 * NOTES:
 *  - Rows come from recv_row / src_of_row (layout.cu); nothing here decides placement.
 *  - The vector path moves 16-byte packs; the host picks it only when the row size and every
 *    pointer are 16-byte aligned (staging rows always are), else the element path is used.
 */
#include "api.cuh"
#include "transport.cuh"

namespace nccl_ep {


template <typename U>
__global__ void __launch_bounds__(kThreads) dispatch_send_kernel(DispatchArgs a) {
  const ExchangeArgs& e = a.ex;
  if (group_failed(e.failed)) return;
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * kWarps) + (threadIdx.x >> 5);
  const int num_warps = gridDim.x * kWarps;
  const int row_bytes = e.hidden * elt_bytes(a.dtype);
  int end = e.c0 + e.chunk;
  if (end > e.num_tokens) end = e.num_tokens;
  for (int t = e.c0 + warp; t < end; t += num_warps) {
    const int* routing = e.own_routing + (size_t)t * e.topk;
    // This rank's own rows are expanded straight from x: no staging round trip.
    unsigned long long mask =
        dest_mask(routing, e.topk, e.num_local, e.num_ranks) & ~(1ull << e.rank);
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
  __shared__ int rows_sh[kWarps][kMaxTopk];
  __shared__ int slot_sh[kWarps][kMaxTopk];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const long long warp = (long long)blockIdx.x * kWarps + wid;
  const long long num_warps = (long long)gridDim.x * kWarps;
  const int row_bytes = e.hidden * elt_bytes(a.dtype);
  const int units = row_bytes / (int)sizeof(U);
  char* const recv_x = reinterpret_cast<char*>(a.recv_x);
  void* self = e.peers[e.rank];
  // One warp per staged token (s, t): read it once, write it to each of its rows here.
  const long long items = (long long)e.num_ranks * e.chunk;
  for (long long i = warp; i < items; i += num_warps) {
    int s, t;
    if (!staged_token(e, i, &s, &t)) continue;  // warp-uniform
    const int n = collect_rows(e, s, t, lane, rows_sh[wid], slot_sh[wid]);
    if (n <= 0) continue;
    // Own tokens come straight from x and probs, the others' from the staging.
    const bool own = s == e.rank;
    const long long sidx = (long long)s * e.chunk + (t - e.c0);
    const U* src = reinterpret_cast<const U*>(
        own ? reinterpret_cast<const char*>(a.x) + (size_t)t * row_bytes
            : stage_row(self, e.tok_off, e.stage_row_bytes, sidx));
    constexpr int kUnroll = 4;
    for (int j0 = lane; j0 < units; j0 += 32 * kUnroll) {
      U v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (j0 + 32 * u < units) v[u] = src[j0 + 32 * u];
      for (int k = 0; k < n; ++k) {
        U* dst = reinterpret_cast<U*>(recv_x + (size_t)rows_sh[wid][k] * row_bytes);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (j0 + 32 * u < units) dst[j0 + 32 * u] = v[u];
      }
    }
    if (a.recv_probs != nullptr && lane < n) {
      const int k = slot_sh[wid][lane];
      copy_prob(reinterpret_cast<char*>(a.recv_probs) + (size_t)rows_sh[wid][lane] * a.prob_bytes,
                own ? reinterpret_cast<const char*>(a.probs) + ((size_t)t * e.topk + k) * a.prob_bytes
                    : stage_prob(self, e.prob_off, sidx * e.max_topk + k),
                a.prob_bytes);
    }
    __syncwarp();  // rows_sh / slot_sh are rewritten by the next item
  }
  if (!e.first_chunk) return;
  // Rows of no slot (alignment padding, capacity tail): zero, prob 0. 32 rows per warp step.
  for (long long r0 = warp * 32; r0 < e.rows; r0 += num_warps * 32) {
    const long long r = r0 + lane;
    const bool pad = r < e.rows && (r >= e.src_rows || e.src_of_row[r] < 0);
    for (unsigned m = __ballot_sync(0xffffffffu, pad); m; m &= m - 1) {
      const long long pr = r0 + __ffs((int)m) - 1;
      warp_zero<U>(recv_x + (size_t)pr * row_bytes, row_bytes, lane);
    }
    if (pad && a.recv_probs != nullptr)
      zero_prob(reinterpret_cast<char*>(a.recv_probs) + (size_t)r * a.prob_bytes, a.prob_bytes);
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
  const long long n = chunk_own_tokens(a.ex);
  if (n <= 0) return cudaSuccess;
  const int grid = grid_for(n, a.ex.num_sms);
  EP_LAUNCH_BY_UNIT(dispatch_send_kernel, a.ex.vec, a.dtype, grid, stream, a);
  return cudaGetLastError();
}

cudaError_t launch_dispatch_expand(const DispatchArgs& a, cudaStream_t stream) {
  const long long items = chunk_staged_items(a.ex);
  const long long pad_steps = a.ex.first_chunk ? (a.ex.rows + 31) / 32 : 0;
  if (items <= 0 && pad_steps <= 0) return cudaSuccess;
  const int grid = grid_for(items > pad_steps ? items : pad_steps, a.ex.num_sms);
  EP_LAUNCH_BY_UNIT(dispatch_expand_kernel, a.ex.vec, a.dtype, grid, stream, a);
  return cudaGetLastError();
}

}  // namespace nccl_ep
