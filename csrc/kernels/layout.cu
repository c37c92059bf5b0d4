/*
 * layout.cu: the deterministic 2D layout of the design's section 3, computed on every rank from
 * the routing records of all ranks.
 *
 * Kernels, in stream order:
 *   pack      own topk_idx (int32/int64, strided) -> own record [T, K, kind, 0, idx as int32 ...],
 *             written into every rank's window (the routing exchange) and into the handle; or
 *             own routing map [T, E] (bool) -> the same record, one warp per token (a ballot and
 *             a prefix count over each 32 experts give the ascending slots). Also resets the
 *             layout's scratch (error key, histogram, counts, error word): no memset launches.
 *   (barrier) every rank's record is in every window (handle.cc)
 *   validate  a thread per slot (s, t, k): expert id in [-1, E), no duplicate expert in a
 *             token; the first error (by rank, then range-before-duplicate, then token, then
 *             slot/expert, matching the reference's choice) is kept as an atomicMin'd 64-bit
 *             key; also the per-expert histogram of all ranks' slots and cnt[s][l] = tokens of
 *             s routed to local expert l (counts: order does not matter), and recv_row[s][t][*]
 *             = -1 (the scatter fills the rows here). Then its last block to finish sets
 *   (bases)   error decode (one thread), a scan over local experts for the aligned expert
 *             blocks, tokens_per_expert, off[s][l], N_d, src_of_row = -1 on padding rows, the
 *             capacity check; in exact mode it writes the meta (error, N_d, counts) into the
 *             handle's mapped host buffer, and the count read waits for this kernel only
 *   rail      groups that span nodes: which tokens each rail message carries and its count
 *             (rail_kernel); exact mode's message sizes go into the readback too, and the event
 *             the count read waits for follows this kernel instead of the bases
 *   scatter   one block per tile of a source: a stable sort of its slots by local expert ->
 *             recv_row[s][t][k], src_of_row[row] (the tile's first positions from the bases)
 *   drop      expert_capacity only: one block per (expert, node) masks the dropped slots in the
 *             routing the ops follow (kept_routing; over nodes also the rail's sources' records)
 *
 * NOTES:
 *  - Row of slot (s, t, k) with local expert l: off[s][l] + #{t' < t : token t' of s routes to l}.
 *    off[s][l] = base[l] + sum_{s' < s} cnt[s'][l]; base[l] = sum_{l' < l} align(total[l']).
 *    Only scans and stable sorts decide rows; atomics are used for the error key and the
 *    counts alone.
 *  - Capacity mode: every rank checks the receive count of every rank (from the histogram), so
 *    an overflow anywhere is reported by all ranks, with the first overflowing rank's numbers.
 *    Dropping capacity mode (drops_overflow) checks nothing: a slot's row past the capacity is
 *    kept in recv_row, the ops skip it (compact_rows) and no src_of_row names it; the expert
 *    blocks and tokens_per_expert are those of the whole routing, so a caller truncates the
 *    blocks by clamping their running sum at the capacity.
 *  - A token names an expert at most once (validated), so one (s, t) gives at most one row per l;
 *    with a duplicate (already an error) only the first slot gets the row, so nothing is written
 *    twice or out of bounds.
 *  - tokens_per_expert[l] is the size of expert l's block including its alignment padding, like
 *    the reference backend, so sum(tokens_per_expert) == N_d.
 *  - The bases run in validate's last block (a counter of finished blocks, reset by pack)
 *    rather than in a kernel of their own: the layout is host-bound in Megatron's path, where a
 *    launch costs more host time than the bases take on the GPU.
 *  - Fixed capacity (expert_capacity C): off[s][l] = l * roundup(R * C, A) + s * C; a slot is kept
 *    iff its position among s's slots for its expert, in token order, is < C. The scatter (by its
 *    stable sort) and the drop pass (by a scan) compute that same position from the source's
 *    record alone, so the destination's rows and the source's sends agree without any exchange.
 */
#include <algorithm>
#include <climits>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "api.cuh"
#include "device.cuh"

namespace nccl_ep {

constexpr int kLayoutThreads = 256;

// Capacity mode whose overflow is an error: every rank checks every rank's rows, from the
// histogram of all ranks' slots per expert. With drops_overflow the ops skip rows past the
// capacity instead (compact_rows), and tokens_per_expert keeps every block whole.
__host__ __device__ __forceinline__ bool checks_capacity(const LayoutArgs& a) {
  return a.capacity >= 0 && !a.drops_overflow;
}
constexpr int kTileTokens = 1024;  // tokens per tile of the drop pass's scans
constexpr int kFlatTopk = 32;      // longer (routing-map) rows are searched token by token
constexpr int kScanLoads = 8;      // 16-byte loads per thread in flight in a scan (top-k 8: a tile)

// This rank's record's offset in every window: creation n (counted by the barriers before it)
// writes half n mod 2 (handle.cc NOTES).
__device__ __forceinline__ size_t record_offset(const PackArgs& a) {
  const bool odd = a.barrier_epoch != nullptr && (*a.barrier_epoch & 1ull) != 0;
  return a.record_off + (odd ? a.half_bytes : 0);
}

// This rank's record in window d at offset `off` (or its place in the all-gather buffer).
__device__ __forceinline__ int* record_in(const PackArgs& a, size_t off, int d) {
  return a.peers == nullptr
             ? reinterpret_cast<int*>(a.own_record)
             : reinterpret_cast<int*>(reinterpret_cast<char*>(a.peers[d]) + off);
}

// Writes id `v` of entry i (token-major, i < tokens * topk) to every window and to the handle.
__device__ __forceinline__ void put_id(const PackArgs& a, size_t off, long long i, int v) {
  a.own_routing[i] = v;
  if (a.kept_routing != nullptr) a.kept_routing[i] = v;
  for (int d = 0; d < a.num_ranks; ++d) record_in(a, off, d)[kRecordHeader + i] = v;
}

// The header and the layout's scratch, by thread 0 / the first threads of block 0.
__device__ __forceinline__ void pack_header(const PackArgs& a, size_t off) {
  if (blockIdx.x != 0) return;
  if (threadIdx.x < a.num_ranks) {
    int* rec = record_in(a, off, threadIdx.x);
    rec[0] = a.header_tokens;
    rec[1] = a.header_topk;
    rec[2] = a.kind;
    rec[3] = 0;
    if (a.state != nullptr) {
      const unsigned long long failed = ld_volatile_u64(&a.state->failed);  // node rank + 1
      rec[3] = failed != 0 ? a.stop_base + (int)failed
                           : (ld_volatile_int(&a.err->code) != kErrNone ? a.rank + 1 : 0);
    }
  }
  if (threadIdx.x == 0) {
    *a.err_key = ~0ull;
    *a.blocks_done = 0;
    if (a.rail_done != nullptr) *a.rail_done = 0;
    memset(a.meta_err, 0, sizeof(ErrorInfo));
  }
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) a.hist[e] = 0;
}

template <typename IdxT>
__global__ void pack_topk_kernel(PackArgs a) {
  const size_t off = record_offset(a);
  pack_header(a, off);
  const IdxT* idx = reinterpret_cast<const IdxT*>(a.routing);
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < (long long)a.tokens * a.topk) {
    const long long t = i / a.topk, k = i % a.topk;
    long long v = (long long)idx[t * a.stride0 + k * a.stride1];
    // Values that do not fit int32 are out of range anyway; clamp so they stay invalid.
    if (v > 0x7fffffffll) v = 0x7fffffffll;
    if (v < -0x7fffffffll) v = -0x7fffffffll;
    put_id(a, off, i, (int)v);
  }
}

// One warp per token: a ballot and a prefix count over each 32 experts give the ascending slots.
__global__ void pack_map_kernel(PackArgs a) {
  const size_t off = record_offset(a);
  pack_header(a, off);
  const unsigned char* map = reinterpret_cast<const unsigned char*>(a.routing);
  const int lane = threadIdx.x & 31;
  const long long t = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (t >= a.tokens) return;
  const unsigned char* row = map + t * a.stride0;
  const long long first = t * a.topk;
  int n = 0;  // routed experts so far (warp-uniform)
  for (int e0 = 0; e0 < a.num_experts; e0 += 32) {
    const int e = e0 + lane;
    const bool routed = e < a.num_experts && row[(long long)e * a.stride1] != 0;
    const unsigned m = __ballot_sync(0xffffffffu, routed);
    const int slot = n + __popc(m & ((1u << lane) - 1u));
    if (routed && slot < a.topk) put_id(a, off, first + slot, e);
    n += __popc(m);
  }
  for (int k = n + lane; k < a.topk; k += 32) put_id(a, off, first + k, -1);
  __syncwarp();  // a token with too many experts: its last slot holds -1 - n instead
  if (n > a.topk && lane == 0) put_id(a, off, first + a.topk - 1, -1 - n);
}

cudaError_t launch_pack(const PackArgs& a, cudaStream_t stream) {
  if (a.kind == kRecordRoutingMap) {
    const long long warps_per_block = kLayoutThreads / 32;
    const int grid = a.tokens > 0 ? (int)((a.tokens + warps_per_block - 1) / warps_per_block) : 1;
    pack_map_kernel<<<grid, kLayoutThreads, 0, stream>>>(a);
  } else {
    const long long n = (long long)a.tokens * a.topk;
    const int grid = n > 0 ? (int)((n + kLayoutThreads - 1) / kLayoutThreads) : 1;
    if (a.idx_is_64)
      pack_topk_kernel<long long><<<grid, kLayoutThreads, 0, stream>>>(a);
    else
      pack_topk_kernel<int><<<grid, kLayoutThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

__global__ void copy_topk_kernel(const int* ids, long long count, void* out, int out_is_64) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  if (out_is_64)
    reinterpret_cast<long long*>(out)[i] = ids[i];
  else
    reinterpret_cast<int*>(out)[i] = ids[i];
}

cudaError_t launch_copy_topk(const int* ids, long long count, void* out, int out_is_64,
                             cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  copy_topk_kernel<<<(int)((count + kLayoutThreads - 1) / kLayoutThreads), kLayoutThreads, 0,
                     stream>>>(ids, count, out, out_is_64);
  return cudaGetLastError();
}

// Error key: rank (bits 48..), kind (bit 47: 0 range, 1 duplicate), token (bits 16..46),
// minor (bits 0..15: slot for range errors, expert for duplicates).
__device__ __forceinline__ unsigned long long error_key(int s, int kind, int t, int minor) {
  return ((unsigned long long)s << 48) | ((unsigned long long)kind << 47) |
         ((unsigned long long)t << 16) | (unsigned long long)(minor & 0xffff);
}

// A record whose shape is out of bounds (kErrShape) holds no routing: it contributes nothing.
__device__ __forceinline__ bool shape_ok(const int* rec, int max_tokens, int max_topk) {
  return rec[0] >= 0 && rec[0] <= max_tokens && rec[1] >= 1 && rec[1] <= max_topk;
}
// Tokens of a record: 0 for one whose shape is out of bounds (its rank packed no routing; the
// buffer may hold an earlier handle's).
__device__ __forceinline__ int record_tokens(const int* rec, int max_tokens, int max_topk) {
  return shape_ok(rec, max_tokens, max_topk) ? rec[0] : 0;
}
__device__ __forceinline__ int clamp_topk(const int* rec, int max_topk) {
  int k = rec[1];
  return k < 1 ? 1 : (k > max_topk ? max_topk : k);
}

// Whether slot k of a token's ids `row` is the first naming v (a later one is a duplicate, an
// error, and gets no row). A routing map's ids are distinct by construction (ascending): no
// earlier slot to compare, which would cost top-k^2 per token when a map row names every expert.
__device__ __forceinline__ bool first_naming(const int* row, int k, int v, bool distinct) {
  bool first = true;
  if (!distinct)
    for (int j = 0; j < k; ++j) first &= row[j] != v;
  return first;
}

// The bases' block-wide scan and reduction (in validate's last block).
using BasesScan = cub::BlockScan<long long, kLayoutThreads>;
using BasesReduce = cub::BlockReduce<long long, kLayoutThreads>;
union BasesTemp {
  typename BasesScan::TempStorage scan;
  typename BasesReduce::TempStorage reduce;
};

// The most counters a validate block's shared tables hold (44 KiB: with the bases' static shared
// memory, within the 48 KiB a kernel gets without opting in); with more, it counts with global
// atomics, which then spread over as many addresses and hardly collide.
constexpr int kMaxTableCounters = 11264;
constexpr int kSlotsPerThread = kLayoutTileSlots / kLayoutThreads;  // of a tile
static_assert(kMaxTableCounters * sizeof(int) + sizeof(BasesTemp) + 64 <= 48 * 1024,
              "validate's tables and the bases' shared memory fit the default 48 KiB");

// Adds 1 to counter c: in the block's table (shared) when it has one, else in global memory.
__device__ __forceinline__ void count_into(int* table, int* global, int c) {
  if (table != nullptr) atomicAdd(&table[c], 1);
  else atomicAdd(&global[c], 1);
}

// validate_kernel's block: tile blockIdx.x (kLayoutTileSlots slots (t, k)) of one source s
// (blockIdx.y), a thread per slot at a time: the slots of a token are checked in parallel.
// NOTES:
//  - The tile's counts per local expert go to tile_cnt[s][tile] whole (zeros too: no reset).
//    They go through block tables in shared memory (tabled): same-address atomics serialize in
//    L2, so one global atomic per slot on a few hundred counters would leave the kernel draining
//    them long after its work is done.
//  - The first error is the minimum key over every slot's candidates. A slot reports a
//    duplicate (its expert named at an earlier slot) even when its token also has a range error:
//    for the same rank a range key is smaller than any duplicate key, so the minimum is the
//    reference's choice (range errors first, then the lowest token, then its lowest duplicate).
EP_DEVICE void count_slots(const LayoutArgs& a, int* table) {
  const int s = blockIdx.y;
  const bool tabled = table != nullptr;
  const int* rec = a.gathered + (size_t)s * a.rec_ints;
  // 32-bit indices: the group's slots are < 2^31 (config.cc), and 32-bit divisions are cheap.
  const unsigned slots = (unsigned)record_tokens(rec, a.max_tokens, a.max_topk) * a.max_topk;
  const unsigned first = blockIdx.x * (unsigned)kLayoutTileSlots;
  const int L = a.num_local;
  int* tile_cnt = a.tile_cnt + ((size_t)s * a.tiles + blockIdx.x) * L;
  if (first >= slots || !tabled) {  // (block-uniform) counted in place: from 0
    for (int c = threadIdx.x; c < L; c += blockDim.x) tile_cnt[c] = 0;
    if (first >= slots) return;
  }
  const int experts_counted = checks_capacity(a) ? a.num_experts : 0;  // hist
  int* cnt_table = tabled ? table : nullptr;
  int* hist_table = tabled ? table + L : nullptr;
  if (tabled) {
    for (int c = threadIdx.x; c < L + experts_counted; c += blockDim.x) table[c] = 0;
  }
  __syncthreads();  // the table's zeros, or the counters' in global memory, before any count
  const int ks = clamp_topk(rec, a.max_topk);
  // Only records of the handle's top-k are counted, as the scatter reads them (another top-k is
  // an error).
  const bool counted = rec[1] == a.topk, distinct = rec[2] == kRecordRoutingMap;
  int* rows = a.recv_row + (size_t)s * a.max_tokens * a.max_topk;  // [t][max_topk]
  // The thread's ids first, every load in flight at once: the stores and atomics below would
  // otherwise order each slot's load after the previous slot's work (a chain of latencies).
  int ids[kSlotsPerThread];
#pragma unroll
  for (int j = 0; j < kSlotsPerThread; ++j) {
    const unsigned i = first + j * kLayoutThreads + threadIdx.x;
    const int t = (int)(i / (unsigned)a.max_topk), k = (int)(i - t * (unsigned)a.max_topk);
    ids[j] = i < slots && k < ks ? rec[kRecordHeader + (size_t)t * ks + k] : -1;
  }
#pragma unroll
  for (int j = 0; j < kSlotsPerThread; ++j) {
    const unsigned i = first + j * kLayoutThreads + threadIdx.x;
    if (i >= slots) break;
    rows[i] = -1;  // no row here until the scatter says otherwise (it runs after this kernel)
    const int t = (int)(i / (unsigned)a.max_topk), k = (int)(i - t * (unsigned)a.max_topk);
    const int v = ids[j];  // (-1 past the record's top-k: nothing to check)
    if (v < -1 || v >= a.num_experts) {
      atomicMin(a.err_key, error_key(s, 0, t, k));
      continue;
    }
    if (v < 0) continue;
    if (experts_counted) count_into(hist_table, a.hist, v);
    if (!first_naming(rec + kRecordHeader + (size_t)t * ks, k, v, distinct)) {
      atomicMin(a.err_key, error_key(s, 1, t, v));
      continue;
    }
    // The tile's tokens routed to local expert l, a token once (its first slot naming l).
    const int l = v - a.rank * L;
    if (counted && l >= 0 && l < L) count_into(cnt_table, tile_cnt, l);
  }
  if (tabled) {
    __syncthreads();
    for (int c = threadIdx.x; c < L; c += blockDim.x) tile_cnt[c] = table[c];
    for (int c = threadIdx.x; c < experts_counted; c += blockDim.x)
      if (table[L + c] != 0) atomicAdd(&a.hist[c], table[L + c]);
  }
}

// The fixed-capacity layout (expert_capacity C): expert l's block is block_rows rows from
// l * block_rows, source s's run C rows from s * C into it, whatever the routing. Its rows past
// the run's min(cnt, C) slots, and the block's alignment tail, are rows of no slot (zeros).
// Nothing can overflow: the output always has L x block_rows rows.
// NOTES: a warp per run (and per block tail), its lanes over the run's empty rows: one expert
// per rank with a large C (e.g. 8 experts at EP=8) leaves up to R x C rows to mark.
EP_DEVICE void fixed_capacity_bases(const LayoutArgs& a) {
  const long long C = a.expert_capacity, block = a.block_rows;
  const int L = a.num_local, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  for (int l = threadIdx.x; l < L; l += blockDim.x) a.meta->tokens_per_expert[l] = block;
  // Runs (s, l) at i = s * L + l, then the tails of the L blocks at i = R * L + l.
  for (int i = warp; i < (a.num_ranks + 1) * L; i += warps) {
    const int s = i / L, l = i - s * L;
    long long first, end;
    if (s < a.num_ranks) {
      const long long run = l * block + s * C;
      if (lane == 0) a.off[i] = (int)run;
      first = run + min((long long)__ldcg(&a.cnt[i]), C);
      end = run + C;
    } else {
      first = l * block + a.num_ranks * C;
      end = (l + 1) * block;
    }
    for (long long r = first + lane; r < end; r += 32) a.src_of_row[r] = -1;
  }
  if (threadIdx.x == 0) a.meta->num_rows = block * L;
}

// Exact mode: the meta is final once the bases are set, so this kernel writes it straight into
// the host's pinned readback (mapped): the count read waits for the bases, not for the scatter
// and a device-to-host copy queued after it.
EP_DEVICE void publish_meta(const LayoutArgs& a) {
  if (a.host_meta == nullptr) return;
  __syncthreads();  // every thread's meta writes, before they are read back
  const long long* from = reinterpret_cast<const long long*>(a.meta);
  long long* to = reinterpret_cast<long long*>(a.host_meta);
  const int words = (int)(layout_meta_bytes(a.num_local) / sizeof(long long));
  for (int i = threadIdx.x; i < words; i += blockDim.x) to[i] = from[i];
}

// The bases, by validate's last block: every block's counts and error key are in (their
// atomics came before the finished-block counter), read through L2 (__ldcg): this SM's L1 may
// hold none of them, but nothing here relies on that.
EP_DEVICE void set_bases(const LayoutArgs& a) {
  LayoutMeta* m = a.meta;
  // cnt[s][l], and in place of each tile's count its first position among s's tokens naming l
  // (an exclusive sum over the tiles, in token order).
  for (int i = threadIdx.x; i < a.num_ranks * a.num_local; i += blockDim.x) {
    const int s = i / a.num_local, l = i - s * a.num_local;
    int* tile = a.tile_cnt + (size_t)s * a.tiles * a.num_local + l;
    int run = 0;
    for (int b = 0; b < a.tiles; ++b) {
      const int c = __ldcg(tile + (size_t)b * a.num_local);
      tile[(size_t)b * a.num_local] = run;
      run += c;
    }
    a.cnt[i] = run;
  }
  for (int s = threadIdx.x; s < a.num_ranks; s += blockDim.x) {
    const int* rec = a.gathered + (size_t)s * a.rec_ints;
    m->ks[s] = rec[1];
    m->ts[s] = rec[0];
    m->tokens[s] = record_tokens(rec, a.max_tokens, a.max_topk);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // A node stopped by a device-side error (groups that span nodes) first: the group is dead.
    for (int s = 0; s < a.num_ranks; ++s) {
      const int stopped = a.gathered[(size_t)s * a.rec_ints + 3];
      if (stopped != 0) {
        raise_error(a.err, kErrRemoteAbort, a.rank, stopped - 1, -1, s, 0);
        break;
      }
    }
    // Errors, in the reference's order: the first rank with a bad shape or bad routing values
    // (a rank with a bad shape packed no routing, so it has only the one), then top-k agreement.
    int bad_shape = -1;
    for (int s = 0; s < a.num_ranks && bad_shape < 0; ++s)
      if (!shape_ok(a.gathered + (size_t)s * a.rec_ints, a.max_tokens, a.max_topk)) bad_shape = s;
    const unsigned long long key = __ldcg(a.err_key);
    if (bad_shape >= 0 && (key == ~0ull || bad_shape < (int)(key >> 48))) {
      const int tokens = m->ts[bad_shape], topk = m->ks[bad_shape];
      const int kind = a.gathered[(size_t)bad_shape * a.rec_ints + 2];
      if (tokens > a.max_tokens)
        raise_error(a.err, kErrShape, bad_shape, -1, 0, tokens, a.max_tokens, kind);
      else
        raise_error(a.err, kErrShape, bad_shape, -1, 1, topk, a.max_topk, kind);
    } else if (key != ~0ull) {
      const int s = (int)(key >> 48), kind = (int)((key >> 47) & 1);
      const int t = (int)((key >> 16) & 0x7fffffffull), minor = (int)(key & 0xffff);
      if (kind == 0) {
        const int* rec = a.gathered + (size_t)s * a.rec_ints;
        const int ks = clamp_topk(rec, a.max_topk);
        raise_error(a.err, kErrExpertRange, s, t, minor,
                    rec[kRecordHeader + (size_t)t * ks + minor], a.num_experts, rec[2]);
      } else {
        raise_error(a.err, kErrDuplicateExpert, s, t, -1, minor, a.num_experts);
      }
    } else {
      for (int s = 0; s < a.num_ranks; ++s) {
        if (m->ks[s] != a.topk) {
          raise_error(a.err, kErrTopkMismatch, s, -1, -1, m->ks[s], a.topk);
          break;
        }
      }
    }
  }
  if (a.expert_capacity > 0) {
    fixed_capacity_bases(a);
    publish_meta(a);
    return;
  }
  // Expert blocks: one thread per local expert, an exclusive scan of the aligned block sizes
  // over l (tiles of blockDim, carried), then off[s][l] in source-rank order.
  __shared__ BasesTemp tmp;
  long long carry = 0;
  for (int l0 = 0; l0 < a.num_local; l0 += kLayoutThreads) {
    const int l = l0 + (int)threadIdx.x;
    long long total = 0;
    if (l < a.num_local)
      for (int s = 0; s < a.num_ranks; ++s) total += __ldcg(&a.cnt[s * a.num_local + l]);
    const long long block = (total + a.align - 1) / a.align * a.align;
    long long base, tile;
    BasesScan(tmp.scan).ExclusiveSum(block, base, tile);
    if (l < a.num_local) {
      long long run = carry + base;
      for (int s = 0; s < a.num_ranks; ++s) {
        a.off[s * a.num_local + l] = (int)run;
        run += __ldcg(&a.cnt[s * a.num_local + l]);
      }
      // The block's alignment padding: rows of no slot (dispatch writes zeros there).
      for (long long r = run; r < carry + base + block && r < a.src_rows; ++r) a.src_of_row[r] = -1;
      m->tokens_per_expert[l] = block;  // padded block: sum == N_d (docs/design.md §3, reference)
    }
    carry += tile;
    __syncthreads();  // tmp is reused by the next tile
  }
  if (threadIdx.x == 0) m->num_rows = carry;
  publish_meta(a);
  if (!checks_capacity(a)) return;
  // Capacity: every rank checks every rank's rows (from the all-ranks histogram), so all ranks
  // report an overflow together; the first rank over the bound is named.
  for (int d = 0; d < a.num_ranks; ++d) {
    long long rows = 0;
    for (int l = threadIdx.x; l < a.num_local; l += blockDim.x) {
      const long long n = __ldcg(&a.hist[d * a.num_local + l]);
      rows += (n + a.align - 1) / a.align * a.align;
    }
    rows = BasesReduce(tmp.reduce).Sum(rows);
    __syncthreads();  // tmp is reused by the next rank
    if (threadIdx.x == 0) {
      if (d == a.rank && carry > rows) rows = carry;  // (duplicates: already an error)
      if (rows > a.capacity) raise_error(a.err, kErrCapacity, d, -1, -1, rows, a.capacity);
    }
  }
}

// The records this creation's pack wrote: after its barrier the count of barriers is n + 1 for
// creation n, which wrote half n mod 2.
__device__ __forceinline__ const int* routing_records(const LayoutArgs& a) {
  if (a.barrier_epoch == nullptr) return a.gathered;
  return a.gathered + ((*a.barrier_epoch & 1ull) ? 0 : a.half_ints);
}

__global__ void __launch_bounds__(kLayoutThreads) validate_kernel(LayoutArgs a, int tabled) {
  a.gathered = routing_records(a);
  extern __shared__ int table[];  // cnt of s per local expert [L], then hist per expert [E]
  count_slots(a, tabled ? table : nullptr);
  // The last block to finish sets the bases (threadFenceReduction's pattern: each block's
  // atomics, a fence, then its ticket).
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(a.blocks_done, 1u) == gridDim.x * gridDim.y - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  set_bases(a);
}

// Every token of a record (`tokens` of `topk` ids) that names expert e, in token order, block-
// wide: visit(t, k, p), k the token's first slot naming e, p its position among those tokens.
// The capacity drops come from it; the scatter places the same positions (a slot's among its
// source's tokens naming e, in token order) by a sort per tile.
// A tile of kTileTokens tokens at a time: first each token's first slot naming e, into shared
// memory, then a block scan of kTileItems tokens per thread in token order. Rows of up to
// kFlatTopk ids are read flat, 16 bytes a load, kScanLoads loads per thread in flight (a whole
// tile at top-k <= 8; a thread per token reading its ids one by one would make the scans a chain
// of load latencies). Longer rows are a routing map's (max_topk up to E: Megatron's
// drop-and-pad), whose ids ascend, then -1 to the row's end: a thread per token stops at the
// first id above e or, with stop_at_pad, at the first -1 (a few ids instead of all).
// stop_at_pad = false where the drop pass masks ids to -1 in place in the record being read
// (over nodes), so that a -1 may sit mid-row.
// NOTES: a record is 16-byte aligned (rec_ints is a multiple of 4, records start aligned) and so
// is a tile (t0 * topk is a multiple of 4, t0 of kTileTokens). The capacity drops mask ids in
// place (-1) in records that blocks of other experts read meanwhile: a -1 never equals e and is
// never above it, so neither way of reading sees a change.
template <typename Visit>
__device__ __forceinline__ void for_tokens_naming(const int* rec, int tokens, int topk, int e,
                                                  bool stop_at_pad, Visit visit) {
  constexpr int kTileItems = kTileTokens / kLayoutThreads;
  using Scan = cub::BlockScan<int, kLayoutThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int first_k[kTileTokens];  // INT_MAX: the token does not name e
  const bool sorted_rows = rec[2] == kRecordRoutingMap && topk > kFlatTopk;
  int run = 0;
  for (int t0 = 0; t0 < tokens; t0 += kTileTokens) {
    for (int j = threadIdx.x; j < kTileTokens; j += kLayoutThreads) first_k[j] = INT_MAX;
    __syncthreads();
    const int* ids = rec + kRecordHeader + (size_t)t0 * topk;
    const int tile = min(kTileTokens, tokens - t0);
    if (sorted_rows) {
      for (int j = threadIdx.x; j < tile; j += kLayoutThreads) {
        const int* row = ids + (size_t)j * topk;
        for (int k = 0; k < topk; ++k) {
          const int id = row[k];
          if (id == e) first_k[j] = k;
          if (id >= e || (stop_at_pad && id < 0)) break;
        }
      }
    } else {
      const int n = tile * topk;
      const int4* quads = reinterpret_cast<const int4*>(ids);
      auto note = [&](int i, int v) {  // (duplicates, an error: the first slot keeps the row)
        if (v == e) atomicMin(&first_k[i / topk], i % topk);
      };
      // kScanLoads loads per thread in flight at once, all issued before any is compared (the
      // shared-memory atomics between them would otherwise order them): the scans are bound by
      // the bytes in flight per SM.
      for (int q0 = threadIdx.x; q0 < n / 4; q0 += kScanLoads * kLayoutThreads) {
        int4 v[kScanLoads];
#pragma unroll
        for (int m = 0; m < kScanLoads; ++m) {
          const int q = q0 + m * kLayoutThreads;
          v[m] = q < n / 4 ? quads[q] : make_int4(-1, -1, -1, -1);
        }
#pragma unroll
        for (int m = 0; m < kScanLoads; ++m) {
          const int q = q0 + m * kLayoutThreads;
          note(4 * q, v[m].x);
          note(4 * q + 1, v[m].y);
          note(4 * q + 2, v[m].z);
          note(4 * q + 3, v[m].w);
        }
      }
      if (threadIdx.x < n % 4) note(n - n % 4 + threadIdx.x, ids[n - n % 4 + threadIdx.x]);
    }
    __syncthreads();
    int hit_k[kTileItems], hit[kTileItems], prefix[kTileItems];
#pragma unroll
    for (int j = 0; j < kTileItems; ++j) {
      hit_k[j] = first_k[threadIdx.x * kTileItems + j];  // past the tile's tokens: INT_MAX
      hit[j] = hit_k[j] != INT_MAX ? 1 : 0;
    }
    int aggregate;
    Scan(tmp).ExclusiveSum(hit, prefix, aggregate);
#pragma unroll
    for (int j = 0; j < kTileItems; ++j)
      if (hit[j]) visit(t0 + (int)threadIdx.x * kTileItems + j, hit_k[j], run + prefix[j]);
    run += aggregate;
    __syncthreads();  // tmp and first_k are reused by the next tile
  }
}

// One block per tile of source s (blockIdx.x, blockIdx.y), its slots in token order: each slot
// that gets a row here (its token's first slot naming local expert l) takes position
// first[s][tile][l] + (its rank among the tile's such slots of l) among s's tokens naming l, by a
// stable sort of the tile's slots by l. Reads every id once (a scan per expert read them L times).
__global__ void __launch_bounds__(kLayoutThreads) scatter_kernel(LayoutArgs a) {
  a.gathered = routing_records(a);
  using Sort = cub::BlockRadixSort<unsigned, kLayoutThreads, kSlotsPerThread, int>;
  using MaxScan = cub::BlockScan<int, kLayoutThreads>;
  __shared__ union {
    typename Sort::TempStorage sort;
    typename MaxScan::TempStorage scan;
  } tmp;
  const int s = blockIdx.y, L = a.num_local;
  const int* rec = a.gathered + (size_t)s * a.rec_ints;
  // A record of another top-k (an error) gets no rows, as validate counts none of it.
  const int ts = rec[1] == a.topk ? record_tokens(rec, a.max_tokens, a.max_topk) : 0;
  const unsigned slots = (unsigned)ts * a.max_topk;
  const unsigned first = blockIdx.x * (unsigned)kLayoutTileSlots;
  if (first >= slots) return;  // (block-uniform)
  const int ks = clamp_topk(rec, a.max_topk);
  const bool distinct = rec[2] == kRecordRoutingMap;
  // Blocked: thread j holds the tile's slots [j * kSlotsPerThread, ...), so the sort's stable
  // order is token order. Key: the slot's local expert, or L (no row here).
  unsigned key[kSlotsPerThread];
  int slot[kSlotsPerThread];
#pragma unroll
  for (int j = 0; j < kSlotsPerThread; ++j) {
    const unsigned i = first + threadIdx.x * kSlotsPerThread + j;
    const int t = (int)(i / (unsigned)a.max_topk), k = (int)(i - t * (unsigned)a.max_topk);
    const int* row = rec + kRecordHeader + (size_t)t * ks;
    const int v = i < slots && k < ks ? row[k] : -1;
    const int l = v - a.rank * L;
    const bool own = v >= 0 && v < a.num_experts && l >= 0 && l < L &&
                     first_naming(row, k, v, distinct);
    key[j] = own ? (unsigned)l : (unsigned)L;
    slot[j] = (int)i;
  }
  Sort(tmp.sort).Sort(key, slot, 0, 32 - __clz(L));
  __syncthreads();  // tmp is reused by the scan
  // Each sorted position's run start (the first position of its key): a max-scan of run heads.
  __shared__ unsigned last_key[kLayoutThreads];
  last_key[threadIdx.x] = key[kSlotsPerThread - 1];
  __syncthreads();
  int head[kSlotsPerThread];
#pragma unroll
  for (int j = 0; j < kSlotsPerThread; ++j) {
    const int pos = (int)threadIdx.x * kSlotsPerThread + j;
    const unsigned prev = j > 0 ? key[j - 1] : (threadIdx.x > 0 ? last_key[threadIdx.x - 1] : ~0u);
    head[j] = key[j] != prev ? pos : 0;
  }
  MaxScan(tmp.scan).InclusiveScan(head, head, [](int x, int y) { return max(x, y); });
  const int* tile_first = a.tile_cnt + ((size_t)s * a.tiles + blockIdx.x) * L;
#pragma unroll
  for (int j = 0; j < kSlotsPerThread; ++j) {
    if (key[j] >= (unsigned)L) continue;
    const int l = (int)key[j];
    const int p = tile_first[l] + (int)threadIdx.x * kSlotsPerThread + j - head[j];
    // Fixed capacity: the slot's position in its run decides; past C it is dropped (no row).
    if (a.expert_capacity > 0 && p >= a.expert_capacity) continue;
    const long long r = (long long)a.off[s * L + l] + p;
    const int at = s * a.max_tokens * a.max_topk + slot[j];
    a.recv_row[at] = (int)r;
    if (r < a.src_rows) a.src_of_row[r] = at;
  }
}

// Fixed capacity: one block per (expert e, node m) masks, in the routing the ops follow for
// source s = m * G + node_rank (this rank's, or one the rail brings here), every slot naming e
// past the C-th in s's token order (the scatter's position, for every expert, not only the local
// ones), so that no rank sends, sums or reports a slot its destination dropped.
// NOTES: blocks of other experts read the ids this one masks; an id turned to -1 never equals
// theirs, so none of them sees a change.
__global__ void __launch_bounds__(kLayoutThreads) drop_kernel(LayoutArgs a) {
  a.gathered = routing_records(a);
  const int s = blockIdx.y * a.node_size + a.node_rank;
  const int* rec = a.gathered + (size_t)s * a.rec_ints;
  const int ts = rec[1] == a.topk ? record_tokens(rec, a.max_tokens, a.max_topk) : 0;
  int* kept = s == a.rank ? a.kept_routing : a.records_rw + (size_t)s * a.rec_ints + kRecordHeader;
  // Another source's record is the one masked in place (by every expert's block): no stop at -1.
  for_tokens_naming(rec, ts, a.topk, blockIdx.x, s == a.rank, [&](int t, int k, int p) {
    if (p >= a.expert_capacity) kept[(size_t)t * a.topk + k] = -1;
  });
}

// Groups that span nodes: which tokens each rail message carries (LayoutArgs, docs/internode.md).
// One block per source s, a tile of kLayoutThreads tokens at a time (a thread per token): the
// token's nodes (a mask over its record's ids), then per node a block scan of the mask's bit in
// token order gives the packed rows. The last block to finish checks capacity mode's budget for
// every pair in (s, n) order, so every rank reports the same pair.
// NOTES: it reads the records as gathered (before the drop pass masks some of them in place),
// which every rank holds alike: every rank computes the same c(s, n) for every pair. A slot that
// the fixed-capacity drop masks later may still select its token (its bytes travel unread).
__global__ void __launch_bounds__(kLayoutThreads) rail_kernel(LayoutArgs a) {
  a.gathered = routing_records(a);
  using Scan = cub::BlockScan<int, kLayoutThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int run[kMaxRanks];  // per node: the tokens selected so far
  const int s = blockIdx.x, G = a.node_size, N = a.num_nodes, node = a.rank / G;
  const int home = s / G, experts_per_node = G * a.num_local;
  const int* rec = a.gathered + (size_t)s * a.rec_ints;
  // Tokens as the scatter counts them: none for a record out of bounds or of another top-k.
  const int ts = rec[1] == a.topk ? record_tokens(rec, a.max_tokens, a.max_topk) : 0;
  const int ks = clamp_topk(rec, a.max_topk);
  // The maps this rank keeps: its own tokens' (every remote node), and those of the source whose
  // tokens its rail brings here (this node only).
  const bool own = s == a.rank, brought = !own && home != node && s % G == a.node_rank;
  const long long budget = a.rail_capacity >= 0 ? a.rail_capacity : (long long)a.max_tokens;
  for (int n = threadIdx.x; n < N; n += blockDim.x) run[n] = 0;
  __syncthreads();
  for (int t0 = 0; t0 < ts; t0 += kLayoutThreads) {
    const int t = t0 + (int)threadIdx.x;
    unsigned long long mask = 0;
    if (t < ts) {
      const int* row = rec + kRecordHeader + (size_t)t * ks;
      for (int k = 0; k < ks; ++k) {
        const int id = row[k];
        if (id >= 0 && id < a.num_experts) mask |= 1ull << (id / experts_per_node);
      }
    }
    for (int n = 0; n < N; ++n) {
      if (n == home) continue;  // (block-uniform) no message to its own node
      const int bit = (int)((mask >> n) & 1ull);
      int before, total;
      Scan(tmp).ExclusiveSum(bit, before, total);
      const int r = run[n] + before;
      int* map = own ? a.rail_out + (size_t)n * a.max_tokens
                     : (brought && n == node ? a.rail_in + (size_t)home * a.max_tokens : nullptr);
      // A row past the budget is not in the message (an error, below): nothing writes it.
      if (map != nullptr && t < ts) map[t] = bit && r < budget ? r : -1;
      __syncthreads();  // every thread read run[n] (and tmp is reused)
      if (threadIdx.x == 0) run[n] += total;
      __syncthreads();
    }
  }
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    const int c = n == home ? 0 : run[n];
    a.rail_counts[(size_t)s * N + n] = c;
    // Exact mode's message sizes, into the readback the first op waits for.
    if (own) {
      a.meta->rail_send[n] = c;
      if (a.host_meta != nullptr) a.host_meta->rail_send[n] = c;
    }
    if (brought && n == node) {
      a.meta->rail_recv[home] = c;
      if (a.host_meta != nullptr) a.host_meta->rail_recv[home] = c;
    }
  }
  if (own && threadIdx.x == 0) {
    a.meta->rail_recv[home] = 0;
    if (a.host_meta != nullptr) a.host_meta->rail_recv[home] = 0;
  }
  if (a.rail_capacity < 0) return;
  // Capacity mode: the last block checks every pair against the budget.
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(a.rail_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last || threadIdx.x != 0) return;
  __threadfence();
  for (int src = 0; src < a.num_ranks; ++src) {
    for (int n = 0; n < N; ++n) {
      const int c = __ldcg(&a.rail_counts[(size_t)src * N + n]);
      if (c > a.rail_capacity) {
        raise_error(a.err, kErrRailCapacity, src, n, -1, c, a.rail_capacity);
        return;
      }
    }
  }
}

cudaError_t preload_layout() {
  cudaFuncAttributes attr;
  const void* kernels[] = {
      reinterpret_cast<const void*>(pack_topk_kernel<long long>),
      reinterpret_cast<const void*>(pack_topk_kernel<int>),
      reinterpret_cast<const void*>(pack_map_kernel),
      reinterpret_cast<const void*>(copy_topk_kernel),
      reinterpret_cast<const void*>(validate_kernel),
      reinterpret_cast<const void*>(scatter_kernel),
      reinterpret_cast<const void*>(drop_kernel),
      reinterpret_cast<const void*>(rail_kernel)};
  for (const void* k : kernels) {
    const cudaError_t e = cudaFuncGetAttributes(&attr, k);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t launch_layout(const LayoutArgs& a, cudaEvent_t published, cudaStream_t stream) {
  const int counters = a.num_local + (checks_capacity(a) ? a.num_experts : 0);
  const int tabled = counters <= kMaxTableCounters;
  // (At least one block: its last block sets the bases.)
  validate_kernel<<<dim3(a.tiles, a.num_ranks), kLayoutThreads,
                    tabled ? counters * sizeof(int) : 0, stream>>>(a, tabled);
  // Over nodes the rail's maps and counts come with the meta (exact mode's message sizes).
  if (a.num_nodes > 1) rail_kernel<<<a.num_ranks, kLayoutThreads, 0, stream>>>(a);
  if (published != nullptr) {
    const cudaError_t e = cudaEventRecord(published, stream);
    if (e != cudaSuccess) return e;
  }
  scatter_kernel<<<dim3(a.tiles, a.num_ranks), kLayoutThreads, 0, stream>>>(a);
  if (a.expert_capacity > 0)  // after the scatter: over nodes it rewrites the records it read
    drop_kernel<<<dim3(a.num_experts, a.num_nodes), kLayoutThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace nccl_ep
