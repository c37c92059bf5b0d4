/*
 * combine.cu: HT combine (the design's section 4) and the reverse of the probs dispatch, on the
 * exchange engine (exchange.cuh).
 *
 * combine
 *   send    (rank d, one warp per peer token (s, t) of chunk j with a slot here): partial =
 *           round(0.0f + acc(row k0) + acc(row k1) + ... in ascending k), into s's ring.
 *   recv    (rank s, one warp per own token of chunk j): y[t] = round(0.0f + acc(partial[d0]) +
 *           ... over the ranks d ascending that token t has a slot on; this rank's partial is
 *           computed right here from its rows, the same arithmetic); a zero row when none.
 * combine_nodes (groups that span nodes, step 2b at the source), merge_probs (their probs'
 *   backward): plain kernels after the node passes and the rail transfer (ops.cc).
 * combine_probs
 *   send    grad[t, k] = grad_recv[row(s, t, k)] of the peer tokens, into s's ring prob slots;
 *   recv    the own tokens' values (local rows read directly), 0 at masked slots; with a dense
 *           [T, E] output, 0 at every unrouted expert.
 *
 * NOTES:
 *  - acc = float32 for bf16/fp16/fp32 tokens; round = __float2bfloat16_rn / __float2half_rn
 *    (nearest even). Every sum starts from +0.0f (so -0.0 inputs give +0.0 like the reference)
 *    and is a chain of single adds in the contract's order; nothing is reordered or fused.
 *  - Rows >= rows (capacity overflow, already reported) are skipped, never read.
 */
#include "exchange.cuh"
#include "launch.cuh"
#include "token_sum.cuh"

namespace nccl_ep {

// The tokens c.begin + i of chunk j of every peer p (their tokens: the combine side sends for
// the peers' tokens) that one warp handles: the numbering is continued across peers, so that
// small chunks balance over the warps.
struct PeerTokens {
  const ExchangeArgs& e;
  const ExchangeShared& sh;
  int b, j, nwarps;
  int p = -1, i = 0, first, n = 0;  // the current peer, item, and the peers' items before it
  ChunkRange c{0, 0};

  EP_DEVICE PeerTokens(const ExchangeArgs& e_, const ExchangeShared& sh_, int b_, int j_,
                       int warp, int nwarps_)
      : e(e_), sh(sh_), b(b_), j(j_), nwarps(nwarps_), first(-warp) {}

  // Moves to this warp's next item; false after the last.
  EP_DEVICE bool next() {
    i += nwarps;
    while (i >= n) {
      // Next peer: its first item of this warp continues the numbering.
      do {
        if (++p >= e.num_ranks) return false;
      } while (p == e.rank);
      first += n;
      c = chunk_of(sh.tokens[p], e.win, b, j);
      n = c.size();
      i = ((-first) % nwarps + nwarps) % nwarps;
    }
    return true;
  }
};

template <typename T, int N>
struct CombineOp {
  using Args = CombineArgs;
  using P = Pack<T, N>;
  static constexpr bool kSendsOwnTokens = false;
  static constexpr int kWarps = kCombineWarps;
  static constexpr size_t kStagingBytes = kCombineStagingBytes;
  static_assert(kWarps <= kCombineWarps, "warp_staging() sizes its arrays by kCombineWarps");
  // Host and device: the launch reads the channel count through it.
  static __host__ __device__ const ExchangeArgs& ex(const Args& a) { return a.ex; }

  static __device__ void warp_setup(int lane) {
    const WarpStaging ws = warp_staging();
    if (lane == 0) {
      for (int i = 0; i < kStages; ++i) mbar_init(&ws.bar[i]);
      *ws.phase = 0;
    }
  }

  // Stage 1 for the peers' tokens: their partials go to the owner's ring.
  static __device__ void send_round(const Args& a, ExchangeShared& sh, int b, int j, int warp,
                                    int nwarps, int lane) {
    const ExchangeArgs& e = a.ex;
    const int w = threadIdx.x >> 5;
    const size_t row_bytes = (size_t)e.hidden * sizeof(T);
    PeerTokens items(e, sh, b, j, warp, nwarps);
    sum_tokens<T, N, false>(warp_staging(), e.hidden / N, e.vec, lane,
                            [&](const char** src, TokenJob* job) {
      while (items.next()) {
        const int p = items.p, i = items.i;
        const int n = collect_rows(e, p, items.c.begin + i, lane, sh.rows_sh[w], sh.slots_sh[w]);
        if (n < 0) continue;  // no slot of (p, t) here: nothing to send
        point_at_rows(src, a.expert_out, row_bytes, sh.rows_sh[w], n, lane);
        job->dst = ring_row(e.peers[p], e.win, b, ring_index(e.rank, p, e.num_ranks), j, i);
        job->n_rows = n;
        job->n_parts = 0;
        job->own_at = 0;
        return true;
      }
      return false;
    });
  }

  static __device__ void recv_prologue(const Args&, ExchangeShared&, int, int, int, int) {}
  static __device__ void recv_local(const Args&, ExchangeShared&, int, int, int, int, int) {}

  // Stage 2 for this rank's tokens of chunk j, once every peer's partials are in the ring.
  static __device__ void recv_remote(const Args& a, ExchangeShared& sh, int b, int j, int warp,
                                     int nwarps, int lane) {
    const ExchangeArgs& e = a.ex;
    const int w = threadIdx.x >> 5, packs = e.hidden / N;
    const size_t row_bytes = (size_t)e.hidden * sizeof(T);
    if (lane == 0) fence_proxy_async_global();  // the peers' partials, acquired, go to bulk copies
    const ChunkRange c = chunk_of(sh.tokens[e.rank], e.win, b, j);
    // The peers' partials of this chunk sit one ring apart: ring q's row i at
    // partials + q * ring_stride + i * row_stride.
    const char* partials = ring_row(e.peers[e.rank], e.win, b, 0, j, 0);
    const size_t ring_stride = (size_t)e.win.depth * e.win.chunk * e.win.row_stride;
    int t = c.begin + warp - nwarps;
    sum_tokens<T, N, true>(warp_staging(), packs, e.vec, lane,
                           [&](const char** src, TokenJob* job) {
      t += nwarps;
      if (t >= c.end) return false;
      const unsigned long long mask =
          dest_mask(e.own_routing + (size_t)t * e.topk, e.topk, e.expert_base, e.num_local,
                    e.num_ranks, lane);
      const bool has_own = (mask >> e.rank) & 1ull;
      int n_own = 0;  // mask is warp-uniform, so collect_rows runs on the whole warp
      if (has_own) {
        n_own = max(0, collect_rows(e, e.rank, t, lane, sh.rows_sh[w], sh.slots_sh[w]));
        point_at_rows(src, a.expert_out, row_bytes, sh.rows_sh[w], n_own, lane);
      }
      // The peers' partials after the rows, ascending rank: lane d points partial d.
      const unsigned long long others = mask & ~(1ull << e.rank);
      for (int d = lane; d < e.num_ranks; d += 32) {
        if (((others >> d) & 1ull) == 0) continue;
        const int i = __popcll(others & ((1ull << d) - 1ull));
        src[n_own + i] = partials + (size_t)ring_index(d, e.rank, e.num_ranks) * ring_stride +
                         (size_t)(t - c.begin) * e.win.row_stride;
      }
      job->dst = reinterpret_cast<Pack<T, N>*>(a.y) + (size_t)t * packs;
      job->n_rows = n_own;
      job->n_parts = __popcll(others);
      job->own_at = has_own ? __popcll(others & ((1ull << e.rank) - 1ull)) : -1;
      return true;
    });
  }
};

// One token's row of the probs' gradient, warp-wide: lane k's value (from, nullptr: 0) at slot k
// ([T, K]), or in its expert's column with 0 in every other column (dense [T, E]).
EP_DEVICE void write_slot_probs(char* row_out, int cols, bool dense, int topk, int expert,
                                const char* from, int prob_bytes, int lane) {
  if (dense) {
    for (int col = lane; col < cols; col += 32)
      zero_prob(row_out + (size_t)col * prob_bytes, prob_bytes);
    __syncwarp();  // the routed columns below overwrite these zeros
    if (from != nullptr) copy_prob(row_out + (size_t)expert * prob_bytes, from, prob_bytes);
  } else if (lane < topk) {
    char* out = row_out + (size_t)lane * prob_bytes;
    if (from != nullptr) copy_prob(out, from, prob_bytes);
    else zero_prob(out, prob_bytes);
  }
}

struct CombineProbsOp {
  using Args = CombineProbsArgs;
  static constexpr bool kSendsOwnTokens = false;
  static constexpr int kWarps = kCombineProbsWarps;
  static constexpr size_t kStagingBytes = 0;
  // Host and device: the launch reads the channel count through it.
  static __host__ __device__ const ExchangeArgs& ex(const Args& a) { return a.ex; }
  static __device__ void warp_setup(int) {}

  static __device__ const char* grad_recv_at(const Args& a, int row) {
    return reinterpret_cast<const char*>(a.grad_recv) + (size_t)row * a.prob_bytes;
  }

  static __device__ void send_round(const Args& a, ExchangeShared& sh, int b, int j, int warp,
                                    int nwarps, int lane) {
    const ExchangeArgs& e = a.ex;
    for (PeerTokens items(e, sh, b, j, warp, nwarps); items.next();) {
      if (lane >= e.topk) continue;
      const int p = items.p, i = items.i;
      const int row = token_rows(e, p, items.c.begin + i)[lane];
      if (row < 0 || row >= e.rows) continue;
      copy_prob(ring_prob(e.peers[p], e.win, b, ring_index(e.rank, p, e.num_ranks), j, i, lane),
                grad_recv_at(a, row), a.prob_bytes);
    }
  }

  static __device__ void recv_prologue(const Args&, ExchangeShared&, int, int, int, int) {}
  static __device__ void recv_local(const Args&, ExchangeShared&, int, int, int, int, int) {}

  static __device__ void recv_remote(const Args& a, ExchangeShared& sh, int b, int j, int warp,
                                     int nwarps, int lane) {
    const ExchangeArgs& e = a.ex;
    void* self = e.peers[e.rank];
    const ChunkRange c = chunk_of(sh.tokens[e.rank], e.win, b, j);
    const int cols = a.grad_dense ? e.num_experts : e.topk;
    for (int t = c.begin + warp; t < c.end; t += nwarps) {
      const int expert = lane < e.topk ? e.own_routing[(size_t)t * e.topk + lane] : -1;
      const int d = rank_of_expert(expert, e.expert_base, e.num_local, e.num_ranks);
      const char* from = nullptr;  // nullptr: 0 (also for an expert of another node)
      if (d == e.rank) {
        const int row = token_rows(e, e.rank, t)[lane];
        if (row >= 0 && row < e.rows) from = grad_recv_at(a, row);
      } else if (d >= 0) {
        from = ring_prob(self, e.win, b, ring_index(d, e.rank, e.num_ranks), j, t - c.begin,
                         lane);
      }
      write_slot_probs(reinterpret_cast<char*>(a.grad) + (size_t)t * cols * a.prob_bytes, cols,
                       a.grad_dense, e.topk, expert, from, a.prob_bytes, lane);
    }
  }
};

// True when the group stopped (a device-side error here, or a peer's of this node): the outputs
// of the op are poisoned, as the engine's are. Lane 0 reads, the warp agrees (warp-wide).
__device__ __forceinline__ bool group_stopped(const DeviceState* state, const ErrorInfo* err,
                                              int lane) {
  int stopped = 0;
  if (lane == 0)
    stopped = ld_volatile_u64(&state->failed) != 0 || ld_volatile_int(&err->code) != kErrNone;
  return __shfl_sync(0xffffffffu, stopped, 0) != 0;
}

// One warp fills `bytes` at p with 0xFF (NaN in every float dtype).
__device__ __forceinline__ void poison_row(void* p, size_t bytes, int lane) {
  for (size_t i = lane; i < bytes; i += 32) reinterpret_cast<unsigned char*>(p)[i] = 0xFF;
}

// Token t's expert of slot `lane` (-1 past top-k) and the node that holds it (-1: none).
__device__ __forceinline__ int slot_node(const NodeParts& p, long long t, int lane, int* expert) {
  *expert = lane < p.topk ? p.own_routing[t * p.topk + lane] : -1;
  const int node = *expert >= 0 ? *expert / p.experts_per_node : -1;
  return node < p.num_nodes ? node : -1;
}

// Step 2b (groups that span nodes): one warp per token; lane k finds slot k's node, the warp
// the set of nodes, then each lane sums its packs over those nodes in ascending order.
template <typename T, int N>
__global__ void combine_nodes_kernel(const CombineNodesArgs a) {
  using P = Pack<T, N>;
  const NodeParts& p = a.nodes;
  const int lane = threadIdx.x & 31;
  const long long t = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (t >= p.tokens) return;
  if (group_stopped(p.state, p.err, lane)) {
    poison_row(reinterpret_cast<char*>(a.y) + t * a.hidden * sizeof(T), a.hidden * sizeof(T),
               lane);
    return;
  }
  int expert;
  const int node = slot_node(p, t, lane, &expert);
  const bool ok = node >= 0;
  const unsigned long long nodes =
      ((unsigned long long)__reduce_or_sync(0xffffffffu, ok && node >= 32 ? 1u << (node - 32) : 0u)
       << 32) |
      __reduce_or_sync(0xffffffffu, ok && node < 32 ? 1u << node : 0u);
  const int packs = a.hidden / N;
  P* out = reinterpret_cast<P*>(a.y) + t * packs;
  for (int j = lane; j < packs; j += 32) {
    float acc[N];
#pragma unroll
    for (int q = 0; q < N; ++q) acc[q] = 0.0f;
    for (unsigned long long m = nodes; m; m &= m - 1) {
      const int n = __ffsll((long long)m) - 1;
      const P v = reinterpret_cast<const P*>(p.parts[n])[t * packs + j];
#pragma unroll
      for (int q = 0; q < N; ++q) acc[q] = acc[q] + to_float<T>(v.v[q]);
    }
    P r;
#pragma unroll
    for (int q = 0; q < N; ++q) r.v[q] = from_float<T>(acc[q]);
    out[j] = r;
  }
}

// The probs' backward at the source (groups that span nodes): slot k's value from the node of
// its expert, 0 at masked slots (and, dense, at every unrouted expert).
__global__ void merge_probs_kernel(const MergeProbsArgs a) {
  const NodeParts& p = a.nodes;
  const int lane = threadIdx.x & 31;
  const long long t = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (t >= p.tokens) return;
  const int cols = a.grad_dense ? a.num_experts : p.topk;
  char* row_out = reinterpret_cast<char*>(a.grad) + (size_t)t * cols * a.prob_bytes;
  if (group_stopped(p.state, p.err, lane)) {
    poison_row(row_out, (size_t)cols * a.prob_bytes, lane);
    return;
  }
  int expert;
  const int node = slot_node(p, t, lane, &expert);
  const char* from = node >= 0 ? reinterpret_cast<const char*>(p.parts[node]) +
                                     ((size_t)t * p.topk + lane) * a.prob_bytes
                               : nullptr;
  write_slot_probs(row_out, cols, a.grad_dense, p.topk, expert, from, a.prob_bytes, lane);
}

constexpr int kNodeThreads = 256;  // 8 tokens per block

// One warp per token.
static int node_grid(const NodeParts& p) {
  return (int)(((long long)p.tokens * 32 + kNodeThreads - 1) / kNodeThreads);
}

cudaError_t launch_combine_nodes(const CombineNodesArgs& a, cudaStream_t stream) {
  if (a.nodes.tokens <= 0) return cudaSuccess;
  const int grid = node_grid(a.nodes);
  EP_LAUNCH_BY_DTYPE(a.vec, a.dtype, T, N,
                     combine_nodes_kernel<T, N><<<grid, kNodeThreads, 0, stream>>>(a));
  return cudaGetLastError();
}

cudaError_t launch_merge_probs(const MergeProbsArgs& a, cudaStream_t stream) {
  if (a.nodes.tokens <= 0) return cudaSuccess;
  const int grid = node_grid(a.nodes);
  merge_probs_kernel<<<grid, kNodeThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_combine(const CombineArgs& a, cudaStream_t stream) {
  EP_LAUNCH_BY_DTYPE(a.ex.vec, a.dtype, T, N, return launch_exchange<CombineOp<T, N>>(a, stream));
}

cudaError_t launch_combine_probs(const CombineProbsArgs& a, cudaStream_t stream) {
  return launch_exchange<CombineProbsOp>(a, stream);
}

cudaError_t preload_combine() {
  for (int vec = 0; vec < 2; ++vec) {
    for (int dtype : {(int)ncclBfloat16, (int)ncclFloat16, (int)ncclFloat32}) {
      cudaError_t e;
      EP_LAUNCH_BY_DTYPE(vec, dtype, T, N, e = preload_exchange<CombineOp<T, N>>());
      if (e != cudaSuccess) return e;
    }
  }
  return preload_exchange<CombineProbsOp>();
}

}  // namespace nccl_ep
