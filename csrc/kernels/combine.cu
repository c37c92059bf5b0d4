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
 *   backward): plain kernels after the node passes and the rail transfer (runtime/nodes.cc).
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

// The tokens of a round, claimed one at a time by whichever warp is free (items differ in size:
// a fixed share per warp would leave the round to its slowest warp): c.begin + i of chunk
// `j_peers` of every peer p (the peers' tokens, whose partials the combine sends), then, with
// j_own >= 0, c.begin + i of this rank's chunk j_own (its own tokens, summed here). An item's
// number runs on across the lists, so the sends are claimed first. A chunk index < 0: that part
// is empty. With `split_tail`, the round's last `split_tail` items are claimed as halves (half 0:
// the first columns, 1: the rest), so that the round, which ends at a barrier, waits for half an
// item rather than a whole one. `claimed` (shared) counts the round's claims; the role's leader
// zeroes it before the round's opening barrier.
struct RoundTokens {
  const ExchangeArgs& e;
  const ExchangeShared& sh;
  int* claimed;
  int b, j_peers, j_own, lane;
  int whole = 0, split = 0;  // the round's items claimed whole, then in halves
  int k = -1, p = -1, j = -1, i = 0, first = 0, n = 0;  // list k (peer p, chunk j), item i
  int half = -1;  // -1: the whole item; else which half
  ChunkRange c{0, 0};

  EP_DEVICE RoundTokens(const ExchangeArgs& e_, ExchangeShared& sh_, int b_, int j_peers_,
                        int j_own_, int lane_, int split_tail = 0)
      : e(e_), sh(sh_), claimed(&sh_.claimed), b(b_), j_peers(j_peers_), j_own(j_own_),
        lane(lane_) {
    if (split_tail > 0) {
      int items = 0;
      for (int q = 0; q < e.num_ranks; ++q) {
        const int jq = q == e.rank ? j_own : j_peers;
        if (jq >= 0) items += chunk_of(sh.tokens[q], sh.plan, b, jq).size();
      }
      split = min(items, split_tail);
      whole = items - split;
    }
  }

  EP_DEVICE bool own() const { return p == e.rank; }

  // Columns [*begin, *begin + *count) of `packs` that this claim covers.
  EP_DEVICE void columns(int packs, int* begin, int* count) const {
    // Halves end on whole 128-byte lines of 16-byte packs where the row has them.
    const int mid = packs >= 16 ? (packs / 2) & ~7 : packs / 2;
    *begin = half == 1 ? mid : 0;
    *count = half < 0 ? packs : half == 0 ? mid : packs - mid;
  }

  // Claims this warp's next item; false when the round has none left. Warp-wide.
  EP_DEVICE bool next() {
    int ticket = 0;
    if (lane == 0) ticket = atomicAdd(claimed, 1);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    int item = ticket;
    half = -1;
    if (split > 0 && ticket >= whole) {
      if (ticket >= whole + 2 * split) return false;
      item = whole + (ticket - whole) / 2;
      half = (ticket - whole) & 1;
    }
    while (item >= first + n) {
      // Next list: the peers in ascending rank, then this rank.
      if (++k >= e.num_ranks) return false;
      first += n;
      p = k < e.num_ranks - 1 ? (k < e.rank ? k : k + 1) : e.rank;
      j = p == e.rank ? j_own : j_peers;
      c = j >= 0 ? chunk_of(sh.tokens[p], sh.plan, b, j) : ChunkRange{0, 0};
      n = c.size();
    }
    i = item - first;
    return true;
  }
};

// Shape: the CTA's warps and staging (token_sum.cuh), by the sources an item has.
template <typename T, int N, typename Shape>
struct CombineOp {
  using Args = CombineArgs;
  using P = Pack<T, N>;
  static constexpr bool kSendsOwnTokens = false;
  static constexpr bool kInterleaved = true;
  static constexpr int kWarps = Shape::kWarps;
  static constexpr size_t kStagingBytes = Shape::kBytes;
  // Host and device: the launch reads the channel count through it.
  static __host__ __device__ const ExchangeArgs& ex(const Args& a) { return a.ex; }

  static __device__ void warp_setup(int lane) { init_warp_staging(warp_staging<Shape>(), lane); }

  // Round r of the combine on every warp: stage 1 for the peers' tokens of chunk js (their
  // partials go to the owner's ring), stage 2 for this rank's tokens of chunk jr (every peer's
  // partial of that chunk is in the ring).
  static __device__ void round(const Args& a, ExchangeShared& sh, int b, int js, int jr, int,
                               int nwarps, int lane) {
    const ExchangeArgs& e = a.ex;
    const int w = threadIdx.x >> 5, packs = e.hidden / N;
    const size_t row_bytes = (size_t)e.hidden * sizeof(T);
    WarpStaging ws = warp_staging<Shape>();
    ws.timers = &sh.phases;
    const char** src = ws.src;
    if (jr >= 0) fence_proxy_async_global();  // acquired partials go to every lane's bulk copies
    // The peers' partials of chunk jr sit one ring apart: ring q's row i at
    // partials + q * ring_stride + i * row_stride.
    const char* partials = ring_row(e.peers[e.rank], e.win, b, 0, max(jr, 0), 0);
    const size_t ring_stride = (size_t)e.win.depth * e.win.chunk * e.win.row_stride;
    PhaseClock clock(ws.timers, lane);  // an item's setup: its claim until its sums start
    for (RoundTokens items(e, sh, b, js, jr, lane, nwarps); items.next();) {
      const int t = items.c.begin + items.i;
      int col, cols;  // this claim's packs of the token
      items.columns(packs, &col, &cols);
      if (!items.own()) {
        const int p = items.p;
        const int n = collect_rows(e, p, t, lane, sh.rows_sh[w], sh.slots_sh[w]);
        if (n >= 0) {  // else no slot of (p, t) here: nothing to send
          point_at_rows(src, a.expert_out, row_bytes, sh.rows_sh[w], n, lane);
          __syncwarp();
          P* dst = reinterpret_cast<P*>(
              ring_row(e.peers[p], e.win, b, ring_index(e.rank, p, e.num_ranks), js, items.i));
          clock.lap(kPhaseSetup);
          clock.count_item();
          sum_token<T, N, false>({src, n, 0, 0}, ws, dst, col, cols, e.vec, lane);
          clock.restart();
        }
        __syncwarp();  // rows_sh and the sources are rewritten by the next item
        continue;
      }
      // A remote source's node partial goes to the token's row in the rail's message; a token
      // not in it has no slot on this node (its source reads no partial from here).
      const long long out_row = a.rail_rows != nullptr ? a.rail_rows[t] : t;
      if (out_row < 0) continue;  // (warp-uniform)
      // The row map's and the routing's loads are independent: both in flight at once.
      const int row = slot_row(e, e.rank, t, lane);
      const unsigned long long mask =
          dest_mask(e.own_routing + (size_t)t * e.topk, e.topk, e.expert_base, e.num_local,
                    e.num_ranks, lane);
      const bool has_own = (mask >> e.rank) & 1ull;
      int n_own = 0;  // mask is warp-uniform, so compact_rows runs on the whole warp
      if (has_own) {
        n_own = max(0, compact_rows(e, token_rows(e, e.rank, t), row, lane, sh.rows_sh[w],
                                    sh.slots_sh[w]));
        point_at_rows(src, a.expert_out, row_bytes, sh.rows_sh[w], n_own, lane);
      }
      // The peers' partials after the rows, ascending rank: lane d points partial d.
      const unsigned long long others = mask & ~(1ull << e.rank);
      for (int d = lane; d < e.num_ranks; d += 32) {
        if (((others >> d) & 1ull) == 0) continue;
        const int i = __popcll(others & ((1ull << d) - 1ull));
        src[n_own + i] = partials + (size_t)ring_index(d, e.rank, e.num_ranks) * ring_stride +
                         (size_t)items.i * e.win.row_stride;
      }
      __syncwarp();
      const int own_at = has_own ? __popcll(others & ((1ull << e.rank) - 1ull)) : -1;
      clock.lap(kPhaseSetup);
      clock.count_item();
      sum_token<T, N, true>({src, n_own, __popcll(others), own_at}, ws,
                            reinterpret_cast<P*>(a.y) + out_row * packs, col, cols, e.vec,
                            lane);
      clock.restart();
      __syncwarp();  // rows_sh and the sources are rewritten by the next item
    }
  }
};

// The rows of the probs' gradient of n tokens (m < n: row_out_of(m), nullptr: none;
// routing_of(m)), warp-wide:
// slot k's value (value_of(m, k, expert): where it is, nullptr: 0) at column k ([T, K]), or in
// its expert's column with 0 in every other column (dense [T, E]).
// NOTES: the lanes take the slots of all n tokens flat (lane i: slot i % topk of token i / topk),
// so that at top-k 8 a pass runs the dependent loads (routing, row, value) of 4 tokens at once
// rather than of one token on 8 lanes.
template <typename RowOutOf, typename RoutingOf, typename ValueOf>
EP_DEVICE void write_slot_probs(int n, RowOutOf row_out_of, int cols, bool dense,
                                RoutingOf routing_of, int topk, int prob_bytes, int lane,
                                ValueOf value_of) {
  if (dense) {
    for (int m = 0; m < n; ++m) {
      char* row_out = row_out_of(m);
      if (row_out == nullptr) continue;
      for (int col = lane; col < cols; col += 32)
        zero_prob(row_out + (size_t)col * prob_bytes, prob_bytes);
    }
    __syncwarp();  // the routed columns below overwrite these zeros
  }
  for (int i = lane; i < n * topk; i += 32) {
    const int m = i / topk, k = i - m * topk;
    char* row_out = row_out_of(m);
    if (row_out == nullptr) continue;
    const int expert = routing_of(m)[k];
    const char* from = value_of(m, k, expert);
    if (dense) {
      if (from != nullptr) copy_prob(row_out + (size_t)expert * prob_bytes, from, prob_bytes);
    } else {
      char* out = row_out + (size_t)k * prob_bytes;
      if (from != nullptr) copy_prob(out, from, prob_bytes);
      else zero_prob(out, prob_bytes);
    }
  }
}

struct CombineProbsOp {
  using Args = CombineProbsArgs;
  static constexpr bool kSendsOwnTokens = false;
  static constexpr bool kInterleaved = false;
  static constexpr int kWarps = kCombineProbsWarps;
  static constexpr size_t kStagingBytes = 0;
  // Host and device: the launch reads the channel count through it.
  static __host__ __device__ const ExchangeArgs& ex(const Args& a) { return a.ex; }
  static __device__ void warp_setup(int) {}

  static __device__ const char* grad_recv_at(const Args& a, int row) {
    return reinterpret_cast<const char*>(a.grad_recv) + (size_t)row * a.prob_bytes;
  }

  static __device__ void send_round(const Args& a, ExchangeShared& sh, int b, int j, int,
                                    int, int lane) {
    const ExchangeArgs& e = a.ex;
    for (RoundTokens items(e, sh, b, j, -1, lane); items.next();) {
      const int p = items.p, i = items.i;
      const int* rows = token_rows(e, p, items.c.begin + i);
      for (int k = lane; k < e.topk; k += 32) {
        const int row = rows[k];
        if (row < 0) continue;  // not a slot here: the source reads no value of it from here
        char* to = ring_prob(e.peers[p], e.win, b, ring_index(e.rank, p, e.num_ranks), j, i, k);
        // A row past the output (dropped by a dropping capacity mode) has gradient 0.
        if (row < e.rows) copy_prob(to, grad_recv_at(a, row), a.prob_bytes);
        else zero_prob(to, a.prob_bytes);
      }
    }
  }

  static __device__ void recv_prologue(const Args&, ExchangeShared&, int, int, int, int) {}
  static __device__ void recv_local(const Args&, ExchangeShared&, int, int, int, int, int) {}

  static __device__ void recv_remote(const Args& a, ExchangeShared& sh, int b, int j, int warp,
                                     int nwarps, int lane) {
    const ExchangeArgs& e = a.ex;
    void* self = e.peers[e.rank];
    const ChunkRange c = chunk_of(sh.tokens[e.rank], sh.plan, b, j);
    const int cols = a.grad_dense ? e.num_experts : e.topk;
    // The warp's tokens of the chunk: c.begin + warp + m * nwarps.
    const int first = c.begin + warp;
    const int n = c.end > first ? (c.end - first + nwarps - 1) / nwarps : 0;
    auto token = [&](int m) { return first + m * nwarps; };
    write_slot_probs(
        n,
        [&](int m) -> char* {
          // A remote source's values go to the token's row in the rail's message (none: -1).
          const long long r = a.rail_rows != nullptr ? a.rail_rows[token(m)] : token(m);
          return r >= 0 ? reinterpret_cast<char*>(a.grad) + r * cols * a.prob_bytes : nullptr;
        },
        cols, a.grad_dense, [&](int m) { return e.own_routing + (size_t)token(m) * e.topk; },
        e.topk, a.prob_bytes, lane, [&](int m, int k, int expert) -> const char* {
          // nullptr: 0 (also for an expert of another node)
          const int t = token(m);
          const int d = rank_of_expert(expert, e.expert_base, e.num_local, e.num_ranks);
          if (d == e.rank) {
            const int row = token_rows(e, e.rank, t)[k];
            return row >= 0 && row < e.rows ? grad_recv_at(a, row) : nullptr;
          }
          return d >= 0 ? ring_prob(self, e.win, b, ring_index(d, e.rank, e.num_ranks), j,
                                    t - c.begin, k)
                        : nullptr;
        });
  }
};

// True when the group stopped (a device-side error here, or a peer's of this node): the outputs
// of the op are poisoned, as the engine's are. Lane 0 reads, the warp agrees (warp-wide).
// NOTES: only the device-memory flag. The error word is host-mapped: read by every warp it would
// cost a PCIe round trip per token. Every error reaches `failed` before these kernels run: the
// node passes run first on the stream, an error pending at a pass's start stops the group there,
// and one raised during a pass does too.
__device__ __forceinline__ bool group_stopped(const DeviceState* state, int lane) {
  int stopped = 0;
  if (lane == 0) stopped = ld_volatile_u64(&state->failed) != 0;
  return __shfl_sync(0xffffffffu, stopped, 0) != 0;
}

// One warp fills `bytes` at p with 0xFF (NaN in every float dtype).
__device__ __forceinline__ void poison_row(void* p, size_t bytes, int lane) {
  for (size_t i = lane; i < bytes; i += 32) reinterpret_cast<unsigned char*>(p)[i] = 0xFF;
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
  if (group_stopped(p.state, lane)) {
    poison_row(reinterpret_cast<char*>(a.y) + t * a.hidden * sizeof(T), a.hidden * sizeof(T),
               lane);
    return;
  }
  // The nodes token t has a slot on: the destination mask of its routing over nodes, a node
  // standing for a rank of experts_per_node experts.
  const unsigned long long nodes = dest_mask(p.own_routing + t * p.topk, p.topk, 0,
                                             p.experts_per_node, p.num_nodes, lane);
  const int packs = a.hidden / N;
  P* out = reinterpret_cast<P*>(a.y) + t * packs;
  for (int j = lane; j < packs; j += 32) {
    float acc[N];
#pragma unroll
    for (int q = 0; q < N; ++q) acc[q] = 0.0f;
    for (unsigned long long m = nodes; m; m &= m - 1) {
      const int n = __ffsll((long long)m) - 1;
      const long long r = p.rows[n] != nullptr ? p.rows[n][t] : t;
      if (r >= 0) accumulate(acc, reinterpret_cast<const P*>(p.parts[n])[r * packs + j]);
    }
    out[j] = round_pack<T>(acc);
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
  if (group_stopped(p.state, lane)) {
    poison_row(row_out, (size_t)cols * a.prob_bytes, lane);
    return;
  }
  write_slot_probs(
      1, [&](int) { return row_out; }, cols, a.grad_dense,
      [&](int) { return p.own_routing + t * p.topk; }, p.topk, a.prob_bytes, lane,
      [&](int, int k, int expert) -> const char* {
        const int node = rank_of_expert(expert, 0, p.experts_per_node, p.num_nodes);
        if (node < 0) return nullptr;
        const long long r = p.rows[node] != nullptr ? p.rows[node][t] : t;
        return r >= 0 ? reinterpret_cast<const char*>(p.parts[node]) +
                            ((size_t)r * p.topk + k) * a.prob_bytes
                      : nullptr;
      });
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

// The wide staging where every one of a token's top-k (>= 8) slots is a row here (every expert
// local: a group of one rank): items of 8 or more sources, which make 768-byte copies from the
// narrow staging. Bulk copies (the 16-byte path) only.
static bool wide_staging(const ExchangeArgs& e) {
  return e.vec && e.num_local == e.num_experts && e.topk >= 8;
}

cudaError_t launch_combine(const CombineArgs& a, cudaStream_t stream) {
  EP_LAUNCH_BY_DTYPE(a.ex.vec, a.dtype, T, N, {
    if constexpr (N > 1) {
      if (wide_staging(a.ex)) return launch_exchange<CombineOp<T, N, WideStaging>>(a, stream);
    }
    return launch_exchange<CombineOp<T, N, NarrowStaging>>(a, stream);
  });
}

cudaError_t launch_combine_probs(const CombineProbsArgs& a, cudaStream_t stream) {
  return launch_exchange<CombineProbsOp>(a, stream);
}

cudaError_t preload_combine() {
  for (int vec = 0; vec < 2; ++vec) {
    for (int dtype : {(int)ncclBfloat16, (int)ncclFloat16, (int)ncclFloat32}) {
      cudaError_t e;
      EP_LAUNCH_BY_DTYPE(vec, dtype, T, N, {
        e = preload_exchange<CombineOp<T, N, NarrowStaging>>();
        if constexpr (N > 1) {
          if (e == cudaSuccess) e = preload_exchange<CombineOp<T, N, WideStaging>>();
        }
      });
      if (e != cudaSuccess) return e;
    }
  }
  return preload_exchange<CombineProbsOp>();
}

}  // namespace nccl_ep
