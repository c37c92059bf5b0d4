/*
 * combine.cu: HT combine (DESIGN §4) and the reverse of the probs dispatch.
 *
 *   reduce  (rank d, one warp per (s, t), s != d, with a slot on d): partial = round(0.0f +
 *           acc(row k0) + acc(row k1) + ... in ascending k), written into s's staging at
 *           [d][t - c0].
 *   (barrier)
 *   gather  (rank s, one warp per token): y[t] = round(0.0f + acc(partial[d0][t]) + ... over the
 *           ranks d ascending that token t has a slot on; partial[s] is computed right here from
 *           the local rows, the same arithmetic); a zero row when there is none.
 *   probs_send / probs_gather: grad[t, k] = grad_recv[row(s, t, k)] written by the owner rank into
 *           s's prob staging at [t - c0][k]; s copies it out, 0 at masked slots.
 *
 * NOTES:
 *  - acc = float32 for bf16/fp16/fp32 tokens; round = __float2bfloat16_rn / __float2half_rn
 *    (nearest even). Every sum starts from +0.0f (so -0.0 inputs give +0.0 like the reference)
 *    and is a chain of single adds in the contract's order; nothing is reordered or fused.
 *  - Rows >= rows (capacity overflow, already reported) are skipped, never read.
 */
#include "api.cuh"
#include "transport.cuh"

namespace nccl_ep {

constexpr int kLoadsInFlight = 8;  // rows of one token loaded before they are summed
constexpr int kPacksPerLane = 2;   // packs j, j + 32 of those rows, loaded together

// DESIGN §4 stage 1 for the packs j0 + 32 * p (p < kPacksPerLane, those < packs) of one token:
// out[p] = round(0 + acc(row 0) + acc(row 1) + ...), rows in ascending k. Up to kLoadsInFlight x
// kPacksPerLane loads are issued before their adds (the combine is bound by loads in flight per
// SM); the adds of each element stay one chain in the contract's order.
template <typename T, int N>
EP_DEVICE void rows_partial(const Pack<T, N>* src, const int* rows, int n, int packs, int j0,
                            Pack<T, N> (&out)[kPacksPerLane]) {
  float acc[kPacksPerLane][N];
#pragma unroll
  for (int p = 0; p < kPacksPerLane; ++p)
#pragma unroll
    for (int q = 0; q < N; ++q) acc[p][q] = 0.0f;
  int live = 0;  // packs of this lane that exist (the row's last step may hold fewer)
#pragma unroll
  for (int p = 0; p < kPacksPerLane; ++p) live += j0 + 32 * p < packs;
  for (int k0 = 0; k0 < n; k0 += kLoadsInFlight) {
    Pack<T, N> v[kLoadsInFlight][kPacksPerLane];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      if (k0 + u >= n) break;
      const Pack<T, N>* row = src + (size_t)rows[k0 + u] * packs + j0;
#pragma unroll
      for (int p = 0; p < kPacksPerLane; ++p)
        if (p < live) v[u][p] = row[32 * p];
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      if (k0 + u >= n) break;
#pragma unroll
      for (int p = 0; p < kPacksPerLane; ++p)
#pragma unroll
        for (int q = 0; q < N; ++q) acc[p][q] = acc[p][q] + to_float<T>(v[u][p].v[q]);
    }
  }
#pragma unroll
  for (int p = 0; p < kPacksPerLane; ++p)
#pragma unroll
    for (int q = 0; q < N; ++q) out[p].v[q] = from_float<T>(acc[p][q]);
}

// Stage 1 for the tokens of the other ranks: their partials go to the owner's staging. This
// rank's own tokens are reduced by the gather kernel itself (no staging round trip).
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) combine_reduce_kernel(CombineArgs a) {
  using P = Pack<T, N>;
  const ExchangeArgs& e = a.ex;
  if (group_failed(e.failed)) return;
  __shared__ int rows_sh[kWarps][kMaxTopk];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const long long warp = (long long)blockIdx.x * kWarps + wid;
  const long long num_warps = (long long)gridDim.x * kWarps;
  const int packs = e.hidden / N;
  const P* src = reinterpret_cast<const P*>(a.expert_out);
  const long long items = chunk_staged_items(e);
  for (long long i = warp; i < items; i += num_warps) {
    int s, t;
    if (!staged_token(e, i, &s, &t) || s == e.rank) continue;  // warp-uniform
    const int n = collect_rows(e, s, t, lane, rows_sh[wid], nullptr);
    if (n < 0) continue;  // no slot of (s, t) here: nothing to send
    P* dst = reinterpret_cast<P*>(stage_row(e.peers[s], e.tok_off, e.stage_row_bytes,
                                            (long long)e.rank * e.chunk + (t - e.c0)));
    for (int j0 = lane; j0 < packs; j0 += 32 * kPacksPerLane) {
      P v[kPacksPerLane];
      rows_partial<T, N>(src, rows_sh[wid], n, packs, j0, v);
#pragma unroll
      for (int p = 0; p < kPacksPerLane; ++p)
        if (j0 + 32 * p < packs) dst[j0 + 32 * p] = v[p];
    }
    __syncwarp();  // rows_sh is rewritten by the next item
  }
  __threadfence_system();
}

// Stage 2: y[t] = round(0 + acc(partial[d0]) + acc(partial[d1]) + ...) over the ranks d
// ascending that token t has a slot on; this rank's partial is computed here (stage 1 rounding
// included), the others' come from the staging.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) combine_gather_kernel(CombineArgs a) {
  using P = Pack<T, N>;
  const ExchangeArgs& e = a.ex;
  __shared__ int rows_sh[kWarps][kMaxTopk];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const long long warp = (long long)blockIdx.x * kWarps + wid;
  const long long num_warps = (long long)gridDim.x * kWarps;
  const int packs = e.hidden / N;
  const P* src = reinterpret_cast<const P*>(a.expert_out);
  void* self = e.peers[e.rank];
  const long long end = e.c0 + chunk_own_tokens(e);
  for (long long t = e.c0 + warp; t < end; t += num_warps) {
    const unsigned long long mask =
        dest_mask(e.own_routing + (size_t)t * e.topk, e.topk, e.num_local, e.num_ranks);
    int n_own = 0;  // mask is warp-uniform, so collect_rows runs on the whole warp
    if ((mask >> e.rank) & 1ull)
      n_own = max(0, collect_rows(e, e.rank, (int)t, lane, rows_sh[wid], nullptr));
    P* dst = reinterpret_cast<P*>(a.y) + (size_t)t * packs;
    for (int j0 = lane; j0 < packs; j0 += 32 * kPacksPerLane) {
      float acc[kPacksPerLane][N];
#pragma unroll
      for (int p = 0; p < kPacksPerLane; ++p)
#pragma unroll
        for (int q = 0; q < N; ++q) acc[p][q] = 0.0f;
      for (unsigned long long m = mask; m; m &= m - 1) {
        const int d = __ffsll((long long)m) - 1;  // ascending rank order
        P v[kPacksPerLane];
        if (d == e.rank) {
          rows_partial<T, N>(src, rows_sh[wid], n_own, packs, j0, v);
        } else {
          const P* partial = reinterpret_cast<const P*>(
              stage_row(self, e.tok_off, e.stage_row_bytes, (long long)d * e.chunk + (t - e.c0)));
#pragma unroll
          for (int p = 0; p < kPacksPerLane; ++p)
            if (j0 + 32 * p < packs) v[p] = partial[j0 + 32 * p];
        }
#pragma unroll
        for (int p = 0; p < kPacksPerLane; ++p)
#pragma unroll
          for (int q = 0; q < N; ++q) acc[p][q] = acc[p][q] + to_float<T>(v[p].v[q]);
      }
#pragma unroll
      for (int p = 0; p < kPacksPerLane; ++p) {
        if (j0 + 32 * p >= packs) continue;
        P out;
#pragma unroll
        for (int q = 0; q < N; ++q) out.v[q] = from_float<T>(acc[p][q]);
        dst[j0 + 32 * p] = out;
      }
    }
    __syncwarp();  // rows_sh is rewritten by the next token
  }
}

__global__ void __launch_bounds__(kThreads) combine_probs_send_kernel(CombineProbsArgs a) {
  const ExchangeArgs& e = a.ex;
  if (group_failed(e.failed)) return;
  const int lane = threadIdx.x & 31;
  const long long warp = (long long)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const long long num_warps = (long long)gridDim.x * kWarps;
  const long long items = (long long)e.num_ranks * e.chunk;
  for (long long i = warp; i < items; i += num_warps) {
    int s, t;
    if (!staged_token(e, i, &s, &t) || lane >= e.topk) continue;
    const int row = staged_rows(e, s, t)[lane];
    if (row < 0 || row >= e.rows) continue;
    copy_prob(stage_prob(e.peers[s], e.prob_off, (long long)(t - e.c0) * e.max_topk + lane),
              reinterpret_cast<const char*>(a.grad_recv) + (size_t)row * a.prob_bytes,
              a.prob_bytes);
  }
  __threadfence_system();
}

__global__ void __launch_bounds__(kThreads) combine_probs_gather_kernel(CombineProbsArgs a) {
  const ExchangeArgs& e = a.ex;
  const int lane = threadIdx.x & 31;
  const long long warp = (long long)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const long long num_warps = (long long)gridDim.x * kWarps;
  void* self = e.peers[e.rank];
  int end = e.c0 + e.chunk;
  if (end > e.num_tokens) end = e.num_tokens;
  for (long long t = e.c0 + warp; t < end; t += num_warps) {
    if (lane >= e.topk) continue;
    const int ex = e.own_routing[(size_t)t * e.topk + lane];
    char* dst = reinterpret_cast<char*>(a.grad) + ((size_t)t * e.topk + lane) * a.prob_bytes;
    if (ex >= 0 && ex / e.num_local < e.num_ranks) {
      copy_prob(dst, stage_prob(self, e.prob_off, (t - e.c0) * e.max_topk + lane), a.prob_bytes);
    } else {
      zero_prob(dst, a.prob_bytes);
    }
  }
}

// Maps the runtime token dtype and path to the (T, N) template: N elements per 16 bytes on the
// vector path, 1 on the element path.
#define EP_LAUNCH_BY_DTYPE(kernel, vec, dtype, grid, stream, args)                          \
  do {                                                                                       \
    if (dtype == (int)ncclBfloat16) {                                                        \
      if (vec) kernel<__nv_bfloat16, 8><<<grid, kThreads, 0, stream>>>(args);                \
      else kernel<__nv_bfloat16, 1><<<grid, kThreads, 0, stream>>>(args);                   \
    } else if (dtype == (int)ncclFloat16) {                                                  \
      if (vec) kernel<__half, 8><<<grid, kThreads, 0, stream>>>(args);                       \
      else kernel<__half, 1><<<grid, kThreads, 0, stream>>>(args);                           \
    } else {                                                                                 \
      if (vec) kernel<float, 4><<<grid, kThreads, 0, stream>>>(args);                        \
      else kernel<float, 1><<<grid, kThreads, 0, stream>>>(args);                            \
    }                                                                                        \
  } while (0)

cudaError_t launch_combine_reduce(const CombineArgs& a, cudaStream_t stream) {
  const long long items = chunk_staged_items(a.ex);
  if (items <= 0) return cudaSuccess;
  const int grid = grid_for(items, a.ex.num_sms);
  EP_LAUNCH_BY_DTYPE(combine_reduce_kernel, a.ex.vec, a.dtype, grid, stream, a);
  return cudaGetLastError();
}

cudaError_t launch_combine_gather(const CombineArgs& a, cudaStream_t stream) {
  const long long n = chunk_own_tokens(a.ex);
  if (n <= 0) return cudaSuccess;
  const int grid = grid_for(n, a.ex.num_sms);
  EP_LAUNCH_BY_DTYPE(combine_gather_kernel, a.ex.vec, a.dtype, grid, stream, a);
  return cudaGetLastError();
}

cudaError_t launch_combine_probs_send(const CombineProbsArgs& a, cudaStream_t stream) {
  const long long items = chunk_staged_items(a.ex);
  if (items <= 0) return cudaSuccess;
  combine_probs_send_kernel<<<grid_for(items, a.ex.num_sms), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_combine_probs_gather(const CombineProbsArgs& a, cudaStream_t stream) {
  const long long n = chunk_own_tokens(a.ex);
  if (n <= 0) return cudaSuccess;
  combine_probs_gather_kernel<<<grid_for(n, a.ex.num_sms), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace nccl_ep
