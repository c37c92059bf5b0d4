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
 *  - Two implementations of the same arithmetic: the vector path (16-byte aligned rows, the usual
 *    case) moves row segments into shared memory with bulk copies, many in flight per warp; the
 *    element path (unaligned rows) loads into registers. Same sources, same order of adds.
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

// --- Vector path: a token's rows travel through shared memory by bulk copies ----------------------
// Each warp owns kBulkStages stages of kBulkSlots row segments of kBulkSeg bytes; lane 0 fills the
// next stage while the warp sums the current one, so ~190 KB per SM are in flight (the register
// path holds at most 128 KB, and combine is bound by bytes in flight per SM).
constexpr int kBulkWarps = 12;
constexpr int kBulkThreads = kBulkWarps * 32;
constexpr int kBulkSeg = 1024;   // bytes of one row per slot: 64 packs, 2 per lane
constexpr int kBulkSlots = 8;    // row segments per stage
constexpr int kBulkStages = 2;
constexpr int kMaxSources = kMaxTopk + kMaxRanks;  // rows here + partials of the other ranks
constexpr int kBulkPacks = kBulkSeg / 16 / 32;     // 16-byte packs per lane per segment

struct BulkWarp {
  char buf[kBulkStages][kBulkSlots][kBulkSeg];
  unsigned long long bar[kBulkStages];
  const char* src[kMaxSources];  // rows first (ascending k), then partials (ascending rank)
  int rows[kMaxTopk];
};

inline size_t bulk_smem_bytes() { return sizeof(BulkWarp) * kBulkWarps; }

// The sources of one token. Stage 1 (chain == false): out = round(0 + rows...). Stage 2 (chain
// == true): out = round(0 + P_d...) over the ranks d ascending, where this rank's P (if has_own)
// is the stage-1 sum of the rows, inserted before partial own_pos. Segment by segment; units of
// up to kBulkSlots sources; unit i + 1 is loading while unit i is summed.
template <typename T, int N>
EP_DEVICE void bulk_combine_token(BulkWarp& w, uint32_t& parity, unsigned& stage, int row_bytes,
                                  int n_own, int n_rem, bool has_own, int own_pos, bool chain,
                                  char* out, int lane) {
  using P = Pack<T, N>;
  const int sources = n_own + n_rem;
  const int segs = (row_bytes + kBulkSeg - 1) / kBulkSeg;
  if (sources == 0) {  // no row anywhere: a zero row
    for (int j = lane; j < row_bytes / 16; j += 32) reinterpret_cast<P*>(out)[j] = P{};
    return;
  }
  const int per_seg = (sources + kBulkSlots - 1) / kBulkSlots;
  const int units = segs * per_seg;
  auto issue = [&](int u, unsigned st) {
    const int seg = u / per_seg, first = (u % per_seg) * kBulkSlots;
    const int off = seg * kBulkSeg;
    const uint32_t bytes = (uint32_t)min(kBulkSeg, row_bytes - off);
    const int count = min(kBulkSlots, sources - first);
    mbar_expect_bytes(&w.bar[st], bytes * (uint32_t)count);
    for (int i = 0; i < count; ++i) bulk_load(w.buf[st][i], w.src[first + i] + off, bytes, &w.bar[st]);
  };
  if (lane == 0) issue(0, stage);
  float own[kBulkPacks][N], acc[kBulkPacks][N];
  for (int u = 0; u < units; ++u) {
    const unsigned st = stage;
    if (u + 1 < units && lane == 0) issue(u + 1, st ^ 1u);
    mbar_wait(&w.bar[st], (parity >> st) & 1u);
    parity ^= 1u << st;
    const int seg = u / per_seg, first = (u % per_seg) * kBulkSlots;
    const int count = min(kBulkSlots, sources - first);
    const int packs = min(kBulkSeg, row_bytes - seg * kBulkSeg) / 16;
    if (first == 0) {
#pragma unroll
      for (int p = 0; p < kBulkPacks; ++p)
#pragma unroll
        for (int q = 0; q < N; ++q) own[p][q] = acc[p][q] = 0.0f;
    }
#pragma unroll
    for (int p = 0; p < kBulkPacks; ++p) {
      const int j = lane + 32 * p;
      if (j >= packs) continue;
      for (int i = 0; i < count; ++i) {
        const P v = reinterpret_cast<const P*>(w.buf[st][i])[j];
        const int src = first + i;
        if (src < n_own) {
#pragma unroll
          for (int q = 0; q < N; ++q) own[p][q] = own[p][q] + to_float<T>(v.v[q]);
          continue;
        }
        if (src - n_own == own_pos && has_own) {  // this rank's partial comes before partial d
#pragma unroll
          for (int q = 0; q < N; ++q) acc[p][q] = acc[p][q] + to_float<T>(from_float<T>(own[p][q]));
        }
#pragma unroll
        for (int q = 0; q < N; ++q) acc[p][q] = acc[p][q] + to_float<T>(v.v[q]);
      }
    }
    if (first + count == sources) {  // last unit of this segment: round and store
#pragma unroll
      for (int p = 0; p < kBulkPacks; ++p) {
        const int j = lane + 32 * p;
        if (j >= packs) continue;
        P o;
#pragma unroll
        for (int q = 0; q < N; ++q) {
          float v = own[p][q];
          if (chain) {
            if (has_own && own_pos == n_rem) acc[p][q] = acc[p][q] + to_float<T>(from_float<T>(own[p][q]));
            v = acc[p][q];
          }
          o.v[q] = from_float<T>(v);
        }
        reinterpret_cast<P*>(out + (size_t)seg * kBulkSeg)[j] = o;
      }
    }
    fence_proxy_async_smem();
    __syncwarp();  // every lane is done with stage st before lane 0 refills it
    stage ^= 1u;
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kBulkThreads, 1) combine_reduce_bulk_kernel(CombineArgs a) {
  const ExchangeArgs& e = a.ex;
  if (group_failed(e.failed)) return;
  extern __shared__ __align__(128) char smem[];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  BulkWarp& w = reinterpret_cast<BulkWarp*>(smem)[wid];
  if (lane < kBulkStages) mbar_init(&w.bar[lane]);
  __syncwarp();
  uint32_t parity = 0;
  unsigned stage = 0;
  const int row_bytes = e.hidden * (int)sizeof(T);
  const char* expert_out = reinterpret_cast<const char*>(a.expert_out);
  const long long warp = (long long)blockIdx.x * kBulkWarps + wid;
  const long long num_warps = (long long)gridDim.x * kBulkWarps;
  const long long items = chunk_staged_items(e);
  for (long long i = warp; i < items; i += num_warps) {
    int s, t;
    if (!staged_token(e, i, &s, &t) || s == e.rank) continue;  // warp-uniform
    const int n = collect_rows(e, s, t, lane, w.rows, nullptr);
    if (n < 0) continue;  // no slot of (s, t) here: nothing to send
    if (lane < n) w.src[lane] = expert_out + (size_t)w.rows[lane] * row_bytes;
    __syncwarp();
    char* dst = stage_row(e.peers[s], e.tok_off, e.stage_row_bytes,
                          (long long)e.rank * e.chunk + (t - e.c0));
    bulk_combine_token<T, N>(w, parity, stage, row_bytes, n, 0, true, 0, false, dst, lane);
  }
  __threadfence_system();
}

template <typename T, int N>
__global__ void __launch_bounds__(kBulkThreads, 1) combine_gather_bulk_kernel(CombineArgs a) {
  const ExchangeArgs& e = a.ex;
  extern __shared__ __align__(128) char smem[];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  BulkWarp& w = reinterpret_cast<BulkWarp*>(smem)[wid];
  if (lane < kBulkStages) mbar_init(&w.bar[lane]);
  __syncwarp();
  uint32_t parity = 0;
  unsigned stage = 0;
  const int row_bytes = e.hidden * (int)sizeof(T);
  const char* expert_out = reinterpret_cast<const char*>(a.expert_out);
  void* self = e.peers[e.rank];
  const long long warp = (long long)blockIdx.x * kBulkWarps + wid;
  const long long num_warps = (long long)gridDim.x * kBulkWarps;
  const long long end = e.c0 + chunk_own_tokens(e);
  for (long long t = e.c0 + warp; t < end; t += num_warps) {
    const unsigned long long mask =
        dest_mask(e.own_routing + (size_t)t * e.topk, e.topk, e.num_local, e.num_ranks);
    const bool has_own = (mask >> e.rank) & 1ull;
    int n_own = 0;  // mask is warp-uniform, so collect_rows runs on the whole warp
    if (has_own) n_own = max(0, collect_rows(e, e.rank, (int)t, lane, w.rows, nullptr));
    if (lane < n_own) w.src[lane] = expert_out + (size_t)w.rows[lane] * row_bytes;
    // The other ranks' partials, ascending rank, after the rows.
    const unsigned long long others = mask & ~(1ull << e.rank);
    for (int d = lane; d < e.num_ranks; d += 32) {
      if ((others >> d) & 1ull)
        w.src[n_own + __popcll(others & ((1ull << d) - 1ull))] =
            stage_row(self, e.tok_off, e.stage_row_bytes, (long long)d * e.chunk + (t - e.c0));
    }
    __syncwarp();
    const int own_pos = __popcll(others & ((1ull << e.rank) - 1ull));
    bulk_combine_token<T, N>(w, parity, stage, row_bytes, n_own, __popcll(others), has_own,
                             own_pos, true, reinterpret_cast<char*>(a.y) + (size_t)t * row_bytes,
                             lane);
  }
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

// The vector path's bulk kernels need more than the default 48 KB of dynamic shared memory.
template <typename Kernel>
cudaError_t launch_bulk(Kernel kernel, long long warp_items, const CombineArgs& a,
                        cudaStream_t stream) {
  const size_t smem = bulk_smem_bytes();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid_for(warp_items, a.ex.num_sms, kBulkWarps), kBulkThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

#define EP_LAUNCH_COMBINE(name, items, a, stream)                                             \
  do {                                                                                         \
    const int grid = grid_for(items, a.ex.num_sms);                                            \
    if (!a.ex.vec) {                                                                           \
      if (a.dtype == (int)ncclBfloat16)                                                        \
        name##_kernel<__nv_bfloat16, 1><<<grid, kThreads, 0, stream>>>(a);                     \
      else if (a.dtype == (int)ncclFloat16)                                                    \
        name##_kernel<__half, 1><<<grid, kThreads, 0, stream>>>(a);                            \
      else                                                                                     \
        name##_kernel<float, 1><<<grid, kThreads, 0, stream>>>(a);                             \
      return cudaGetLastError();                                                               \
    }                                                                                          \
    if (a.dtype == (int)ncclBfloat16)                                                          \
      return launch_bulk(name##_bulk_kernel<__nv_bfloat16, 8>, items, a, stream);              \
    if (a.dtype == (int)ncclFloat16)                                                           \
      return launch_bulk(name##_bulk_kernel<__half, 8>, items, a, stream);                     \
    return launch_bulk(name##_bulk_kernel<float, 4>, items, a, stream);                        \
  } while (0)

cudaError_t launch_combine_reduce(const CombineArgs& a, cudaStream_t stream) {
  const long long items = chunk_staged_items(a.ex);
  if (items <= 0) return cudaSuccess;
  EP_LAUNCH_COMBINE(combine_reduce, items, a, stream);
}

cudaError_t launch_combine_gather(const CombineArgs& a, cudaStream_t stream) {
  const long long n = chunk_own_tokens(a.ex);
  if (n <= 0) return cudaSuccess;
  EP_LAUNCH_COMBINE(combine_gather, n, a, stream);
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
