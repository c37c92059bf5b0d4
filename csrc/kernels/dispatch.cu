/*
 * dispatch.cu: HT dispatch into the expert-major layout (the design's section 3), on the exchange
 * engine (exchange.cuh).
 *
 *   send    (this rank's tokens of chunk j, one warp per token): the token is read once and
 *           written once into the ring of every other rank it has a slot on, with its K probs.
 *           A token crosses NVLink once per destination rank, never once per expert.
 *   recv    (tokens of chunk j of every source, one warp per token (s, t)): the token is read
 *           once (from x when s is this rank, before any wait, drawn from one pool of the grid;
 *           else from the ring) and written to each of its rows here (recv_row[s][t][k]) with
 *           its prob. Rows of no slot (alignment padding, the capacity tail) get zeros (prob 0),
 *           spread over the op's active CTAs.
 *
 * rail_pack (groups that span nodes): this rank's tokens with a slot on each remote node, packed
 *   into the rail's messages with their weights as max_topk 8-byte slots (runtime/nodes.cc); a
 *   node pass of a remote source reads token t at its packed row (rail_rows).
 *
 * NOTES:
 *  - Rows come from recv_row / src_of_row (layout.cu); nothing here decides placement.
 *  - The vector path moves 16-byte packs; the host picks it only when the row size and every
 *    pointer are 16-byte aligned (ring rows always are), else the element path is used.
 *  - Probs: [T, K] in slot order, or dense [T, E] (probs_dense): slot k's prob is the column of
 *    its expert. Ring prob slots always hold slot order.
 */
#include "exchange.cuh"
#include "launch.cuh"

namespace nccl_ep {

template <typename U>
struct DispatchOp {
  using Args = DispatchArgs;
  static constexpr bool kSendsOwnTokens = true;
  static constexpr bool kInterleaved = false;
  static constexpr int kWarps = kDispatchWarps;
  static constexpr size_t kStagingBytes = 0;  // dynamic shared memory
  // Host and device: the launch reads the channel count through it.
  static __host__ __device__ const ExchangeArgs& ex(const Args& a) { return a.ex; }
  static __device__ void warp_setup(int) {}

  static __device__ int row_units(const Args& a) {
    return a.ex.hidden * elt_bytes(a.dtype) / (int)sizeof(U);
  }

  // This rank's prob of slot k of its token t (routing[k] >= 0); a remote source's from the
  // rail's message (8-byte slots at the token's packed row, its bits first).
  static __device__ const char* own_prob(const Args& a, int t, int k, int expert) {
    if (a.rail_rows != nullptr)
      return reinterpret_cast<const char*>(a.probs) +
             ((size_t)a.rail_rows[t] * a.ex.max_topk + k) * 8;
    const size_t at = a.probs_dense ? (size_t)t * a.ex.num_experts + expert
                                    : (size_t)t * a.ex.topk + k;
    return reinterpret_cast<const char*>(a.probs) + at * a.prob_bytes;
  }

  // Token t's row in x: row t, or a remote source's packed row in the rail's message (nullptr:
  // not in it, which a token with a slot here only is past a rail overflow, an error that stops
  // the op). Warp-uniform.
  static __device__ const char* own_row(const Args& a, long long t, int row_bytes) {
    const long long r = a.rail_rows != nullptr ? a.rail_rows[t] : t;
    return r >= 0 ? reinterpret_cast<const char*>(a.x) + r * row_bytes : nullptr;
  }

  static __device__ void send_round(const Args& a, ExchangeShared& sh, int b, int j, int warp,
                                    int nwarps, int lane) {
    const ExchangeArgs& e = a.ex;
    const ChunkRange c = chunk_of(sh.tokens[e.rank], sh.plan, b, j);
    const int units = row_units(a), row_bytes = units * (int)sizeof(U);
    for (int t = c.begin + warp; t < c.end; t += nwarps) {
      const int* routing = e.own_routing + (size_t)t * e.topk;
      // This rank's own rows are expanded straight from x by its receivers.
      unsigned long long mask =
          dest_mask(routing, e.topk, e.expert_base, e.num_local, e.num_ranks, lane) &
          ~(1ull << e.rank);
      const char* src = mask != 0 ? own_row(a, t, row_bytes) : nullptr;
      if (src == nullptr) continue;
      for (; mask; mask &= mask - 1) {
        const int d = __ffsll((long long)mask) - 1;
        const int q = ring_index(e.rank, d, e.num_ranks);
        char* dst = ring_row(e.peers[d], e.win, b, q, j, t - c.begin);
        // 8 loads in flight per lane: a sender's copy (one load, one store) is latency-bound
        // with 4. The receivers keep 4: each load feeds ~K / R row stores, which keep the
        // memory busy between loads.
        warp_copy_rows<U, 8>(src, units, lane, 1, [&](int) { return dst; });
        if (a.probs == nullptr) continue;
        for (int k = lane; k < e.topk; k += 32) {  // every slot's prob (top-k may exceed 32)
          const int expert = routing[k];
          if (expert >= 0)
            copy_prob(ring_prob(e.peers[d], e.win, b, q, j, t - c.begin, k),
                      own_prob(a, t, k, expert), a.prob_bytes);
        }
      }
    }
  }

  // Rows of no slot: zero, prob 0 (once per op: the first pass). Every receiver warp of every
  // active CTA takes 32 rows at a time.
  static __device__ void recv_prologue(const Args& a, ExchangeShared& sh, int b, int warp,
                                       int nwarps, int lane) {
    const ExchangeArgs& e = a.ex;
    if (!e.zero_padding) return;
    const long long num_rows = *e.num_rows_dev;
    const int units = row_units(a), row_bytes = units * (int)sizeof(U);
    char* const recv_x = reinterpret_cast<char*>(a.recv_x);
    const long long gw = (long long)b * nwarps + warp, gn = (long long)sh.plan.channels * nwarps;
    for (long long r0 = gw * 32; r0 < e.rows; r0 += gn * 32) {
      const long long r = r0 + lane;
      const bool pad = r < e.rows && (r >= num_rows || e.src_of_row[r] < 0);
      for (unsigned m = __ballot_sync(0xffffffffu, pad); m; m &= m - 1)
        warp_zero<U>(recv_x + (size_t)(r0 + __ffs((int)m) - 1) * row_bytes, units, lane);
      if (pad && a.recv_probs != nullptr)
        zero_prob(reinterpret_cast<char*>(a.recv_probs) + (size_t)r * a.prob_bytes, a.prob_bytes);
    }
  }

  // Writes token (s, t), whose row is at src and slot probs at prob(k), to its rows here.
  template <typename ProbOf>
  static __device__ void expand(const Args& a, ExchangeShared& sh, int s, int t, const char* src,
                                ProbOf prob, int lane) {
    const ExchangeArgs& e = a.ex;
    const int w = threadIdx.x >> 5;
    const int n = collect_rows(e, s, t, lane, sh.rows_sh[w], sh.slots_sh[w]);
    if (n > 0) {
      const int units = row_units(a), row_bytes = units * (int)sizeof(U);
      char* const recv_x = reinterpret_cast<char*>(a.recv_x);
      const int* rows = sh.rows_sh[w];
      warp_copy_rows<U>(src, units, lane, n,
                        [&](int k) { return recv_x + (size_t)rows[k] * row_bytes; });
      if (a.recv_probs != nullptr && lane < n)
        copy_prob(reinterpret_cast<char*>(a.recv_probs) + (size_t)rows[lane] * a.prob_bytes,
                  prob(sh.slots_sh[w][lane]), a.prob_bytes);
    }
    __syncwarp();  // rows_sh / slots_sh are rewritten by the next item
  }

  // This rank's own tokens, straight from x (no peer involved), claimed one at a time by each
  // warp from one pool of the whole grid. Round j stops claiming past the tokens that j + 1
  // chunks of every channel hold (the pace at which the peers' chunks come in; a warp finishes
  // the token it drew past that mark); the CTA's last round drains the pool. (The active CTAs
  // draw: an idle one has exited.)
  // NOTES: a pool, not this channel's range, because CTAs write at different speeds (some SMs
  // reach memory slower than others): with equal ranges the op waits for its slowest CTA, with a
  // pool the faster ones take over the rest. The counter is DeviceState::own_claimed, reset by
  // the op's last CTA. A CTA draws with at most ceil(T / channels) warps: an SM's store rate,
  // not a warp's, bounds the expansion, and with every warp drawing, the first CTAs to start
  // would take all tokens of a small op (one per warp) and leave the others idle.
  static __device__ void recv_local(const Args& a, ExchangeShared& sh, int, int j, int warp,
                                    int, int lane) {
    const ExchangeArgs& e = a.ex;
    const int tokens = sh.tokens[e.rank];
    if (warp >= (tokens + sh.plan.channels - 1) / sh.plan.channels) return;
    const long long paced = (long long)(j + 1) * sh.plan.chunk * sh.plan.channels;
    const long long stop = j + 1 >= sh.recv_rounds ? tokens : min((long long)tokens, paced);
    const int row_bytes = row_units(a) * (int)sizeof(U);
    for (;;) {
      unsigned long long drawn = 0;
      if (lane == 0) drawn = atomicAdd(&e.state->own_claimed, 1ull);
      const long long t = (long long)__shfl_sync(0xffffffffu, drawn, 0);
      if (t >= tokens) return;
      const int* routing = e.own_routing + t * e.topk;
      const char* src = own_row(a, t, row_bytes);
      if (src != nullptr)
        expand(a, sh, e.rank, (int)t, src,
               [&](int k) { return own_prob(a, (int)t, k, routing[k]); }, lane);
      if (t + 1 >= stop) return;
    }
  }

  // The peers' tokens of chunk j, from the ring; items (p, t) over the peers in rank order.
  static __device__ void recv_remote(const Args& a, ExchangeShared& sh, int b, int j, int warp,
                                     int nwarps, int lane) {
    const ExchangeArgs& e = a.ex;
    void* self = e.peers[e.rank];
    int first = 0;  // flat index of the current peer's first token
    for (int p = 0; p < e.num_ranks; ++p) {
      if (p == e.rank) continue;
      const ChunkRange c = chunk_of(sh.tokens[p], sh.plan, b, j);
      const int n = c.size();
      const int q = ring_index(p, e.rank, e.num_ranks);
      // Warps continue the flat item numbering across peers, so small chunks balance.
      int i = ((warp - first) % nwarps + nwarps) % nwarps;
      for (; i < n; i += nwarps) {
        expand(a, sh, p, c.begin + i, ring_row(self, e.win, b, q, j, i),
               [&](int k) -> const char* { return ring_prob(self, e.win, b, q, j, i, k); }, lane);
      }
      first += n;
    }
  }
};

// The dispatch's rail messages (RailPackArgs): one warp per token, for every remote node n
// whose message holds it: the row (16-byte packs where row, x and buffers allow, else bytes),
// then lane k < max_topk writes slot k's 8 bytes.
__global__ void rail_pack_kernel(const RailPackArgs a, int vec) {
  const int lane = threadIdx.x & 31;
  const long long t = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (t >= a.tokens) return;
  const char* src = reinterpret_cast<const char*>(a.x) + t * a.row_bytes;
  const int* routing = a.routing + t * a.topk;
  for (int n = 0; n < a.num_nodes; ++n) {
    if (n == a.node) continue;
    const long long j = a.rail_out[(size_t)n * a.max_tokens + t];
    if (j < 0 || j >= a.rail_rows) continue;  // (warp-uniform)
    const size_t i = (size_t)(n < a.node ? n : n - 1);
    char* dst = a.rows_out + (i * a.rail_rows + j) * a.row_bytes;
    if (vec) {
      const uint4* from = reinterpret_cast<const uint4*>(src);
      uint4* to = reinterpret_cast<uint4*>(dst);
      for (size_t u = lane; u < a.row_bytes / 16; u += 32) to[u] = from[u];
    } else {
      for (size_t b = lane; b < a.row_bytes; b += 32) dst[b] = src[b];
    }
    if (a.probs == nullptr) continue;
    for (int k = lane; k < a.max_topk; k += 32) {
      unsigned long long slot = 0;  // the prob's bits in its first bytes
      const int expert = k < a.topk ? routing[k] : -1;
      if (expert >= 0 && expert / a.experts_per_node == n) {
        const size_t at = a.probs_dense ? (size_t)t * a.num_experts + expert
                                        : (size_t)t * a.topk + k;
        const char* p = reinterpret_cast<const char*>(a.probs) + at * a.prob_bytes;
        for (int b = 0; b < a.prob_bytes; ++b)
          reinterpret_cast<char*>(&slot)[b] = p[b];
      }
      reinterpret_cast<unsigned long long*>(a.probs_out)[(i * a.rail_rows + j) * a.max_topk + k] =
          slot;
    }
  }
}

cudaError_t launch_rail_pack(const RailPackArgs& a, cudaStream_t stream) {
  if (a.tokens <= 0) return cudaSuccess;
  constexpr int kThreads = 256;  // 8 tokens per block
  const auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  const int vec = a.row_bytes % 16 == 0 && aligned(a.x) && aligned(a.rows_out);
  const int grid = (int)(((long long)a.tokens * 32 + kThreads - 1) / kThreads);
  rail_pack_kernel<<<grid, kThreads, 0, stream>>>(a, vec);
  return cudaGetLastError();
}

cudaError_t launch_dispatch(const DispatchArgs& a, cudaStream_t stream) {
  EP_LAUNCH_BY_UNIT(a.ex.vec, a.dtype, U, return launch_exchange<DispatchOp<U>>(a, stream));
}

cudaError_t preload_dispatch() {
  cudaFuncAttributes attr;
  const cudaError_t pe =
      cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(rail_pack_kernel));
  if (pe != cudaSuccess) return pe;
  for (int vec = 0; vec < 2; ++vec) {
    for (int dtype : {(int)ncclBfloat16, (int)ncclFloat32}) {
      cudaError_t e;
      EP_LAUNCH_BY_UNIT(vec, dtype, U, e = preload_exchange<DispatchOp<U>>());
      if (e != cudaSuccess) return e;
    }
  }
  return cudaSuccess;
}

}  // namespace nccl_ep
