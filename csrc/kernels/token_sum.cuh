/*
 * token_sum.cuh: the combine's per-token sums (the design's section 4 arithmetic), staged through
 * shared memory by bulk copies. Used by combine.cu, and by benchmarks/micro/sm_budget.cu to time
 * the same code outside the exchange engine.
 *
 * NOTES:
 *  - acc = float32; round = the token dtype's round-to-nearest-even. Every sum starts from +0.0f
 *    and is a chain of single adds in the contract's order; nothing is reordered or fused.
 *  - A warp owns its staging (source lists, buffers, barriers): no cross-warp synchronization.
 */
#pragma once

#include "api.cuh"
#include "device.cuh"

namespace nccl_ep {

// One token's sum, described by its sources: rows [0, n_rows) are expert rows (ascending k) that
// make this rank's partial; then n_parts peer partials, in ascending rank order. `own_at` places
// this rank's partial in that order (before partial own_at; -1: the token has none here).
//   kFinal = false: out = round(0 + acc(row 0) + acc(row 1) + ...)            (stage 1)
//   kFinal = true:  out = round(0 + acc(partial d0) + acc(partial d1) + ...)  (stage 2; this
//                   rank's partial is stage 1 of its rows, rounded, in its place)
// The sources' row starts are in the job's source list (WarpStaging::src_of(id)).
struct TokenJob {
  void* dst;               // the sum's row
  int n_rows, n_parts, own_at;
  int seg, segs;           // packs per segment, segments (set by the stream)
  unsigned id;             // the job's number in its stream (its source list: id & 1)
  __device__ int sources() const { return n_rows + n_parts; }
};

// Sources per warp: a token's rows here plus one partial per peer.
constexpr int kMaxSources = kMaxTopk + kMaxRanks - 1;

// Staging per warp: kStages buffers of kStageBytes. A token's rows are summed segment by segment:
// the segment (every source's same columns) fills a buffer; while the warp sums one segment, the
// bulk copies of the next are in flight, also across tokens (the next token's first segment
// loads while the current token's last one is summed). The segment shrinks as sources grow so
// that one always fits a buffer.
constexpr int kStages = 2;
constexpr int kStageBytes = 8192;  // 12 warps x 2 x 8 KiB + the static part fit 227 KiB
constexpr size_t kCombineStagingBytes = (size_t)kCombineWarps * kStages * kStageBytes;
static_assert(kStageBytes % 16 == 0, "stage buffers hold 16-byte packs");

// The warp's staging: two source lists (the stream keeps at most two tokens open), buffers and
// their barriers (phase: bit i = the parity the next wait on buffer i waits for).
struct WarpStaging {
  const char** src;        // [2][kMaxSources]
  char* buf;
  unsigned long long* bar;
  unsigned* phase;
  __device__ const char** src_of(unsigned id) const { return src + (id & 1u) * kMaxSources; }
};

EP_DEVICE WarpStaging warp_staging() {
  __shared__ const char* sources[kCombineWarps][2 * kMaxSources];
  __shared__ unsigned long long bars[kCombineWarps][kStages];
  __shared__ unsigned phases[kCombineWarps];
  extern __shared__ __align__(128) char staging[];
  const int w = threadIdx.x >> 5;
  return {sources[w], staging + (size_t)w * kStages * kStageBytes, bars[w], &phases[w]};
}

// Packs [first, first + count) of the n sources src[] into buffer `stage`, source i at i * seg
// packs: by bulk copies (16-byte path; lane 0 issues, the barrier counts the bytes), else by the
// lanes.
template <typename P>
EP_DEVICE void fill_stage(const char* const* src, int n, const WarpStaging& ws, int stage,
                          int first, int count, int seg, bool bulk, int lane) {
  P* buf = reinterpret_cast<P*>(ws.buf + (size_t)stage * kStageBytes);
  if (bulk) {
    if (lane == 0) {
      fence_proxy_async_shared();  // the lanes' reads of the buffer's previous segment first
      mbar_expect_bytes(&ws.bar[stage], (unsigned)(n * count * sizeof(P)));
      for (int i = 0; i < n; ++i)
        bulk_load(buf + (size_t)i * seg, reinterpret_cast<const P*>(src[i]) + first,
                  (unsigned)(count * sizeof(P)), &ws.bar[stage]);
    }
  } else {
    for (int i = 0; i < n; ++i)
      for (int j = lane; j < count; j += 32)
        buf[(size_t)i * seg + j] = reinterpret_cast<const P*>(src[i])[first + j];
    __syncwarp();
  }
}

// out[j] for the packs j < count of one buffer (source i's pack j at buf[i * seg + j]).
template <typename T, int N, bool kFinal>
EP_DEVICE void sum_stage(const TokenJob& s, const Pack<T, N>* buf, int seg, int count,
                         Pack<T, N>* out, int lane) {
  for (int j = lane; j < count; j += 32) {
    float own[N], acc[N];  // acc: stage 2 only
#pragma unroll
    for (int q = 0; q < N; ++q) own[q] = acc[q] = 0.0f;
#pragma unroll 4
    for (int i = 0; i < s.n_rows; ++i) {
      const Pack<T, N> v = buf[(size_t)i * seg + j];
#pragma unroll
      for (int q = 0; q < N; ++q) own[q] = own[q] + to_float<T>(v.v[q]);
    }
    Pack<T, N> r;
    if (kFinal) {
      for (int i = 0; i <= s.n_parts; ++i) {
        if (i == s.own_at) {
#pragma unroll
          for (int q = 0; q < N; ++q) acc[q] = acc[q] + to_float<T>(from_float<T>(own[q]));
        }
        if (i == s.n_parts) break;
        const Pack<T, N> v = buf[(size_t)(s.n_rows + i) * seg + j];
#pragma unroll
        for (int q = 0; q < N; ++q) acc[q] = acc[q] + to_float<T>(v.v[q]);
      }
#pragma unroll
      for (int q = 0; q < N; ++q) r.v[q] = from_float<T>(acc[q]);
    } else {
#pragma unroll
      for (int q = 0; q < N; ++q) r.v[q] = from_float<T>(own[q]);
    }
    out[j] = r;
  }
}

// Sums a stream of tokens through the warp's staging buffers, each token's row of `packs` packs.
// `next(src, job)` opens the next token: it points src[0, sources) at the token's sources, sets
// job->dst, n_rows, n_parts and own_at, and returns true; or returns false, writing nothing, when
// the stream is done (it is not called again). It is called by the whole warp and returns the
// same on every lane. It runs while the bulk copies of the previous segment are in flight, so its
// own loads (routing, rows) hide behind them.
//
// NOTES: one segment is filled ahead of the one summed (kStages = 2), across token boundaries.
// Up to three tokens are live: k summed, k + 1 of one segment already filled, k + 2 being filled.
// Only fills read a source list, so two lists (id & 1) suffice: k + 2 reuses k's list after k's
// last fill. Sums read the staged buffers and the job (held in registers), never the lists.
template <typename T, int N, bool kFinal, typename Next>
EP_DEVICE void sum_tokens(const WarpStaging& ws, int packs, bool bulk, int lane, Next next) {
  using P = Pack<T, N>;
  static_assert(kStages == 2, "one segment in flight ahead: two buffers, two source lists");
  unsigned opened = 0;
  // Opens the next token into *job (id = tokens opened so far); false when the stream is done.
  auto open = [&](TokenJob* job) -> bool {
    TokenJob t;
    t.id = opened;
    if (!next(ws.src_of(opened), &t)) return false;
    __syncwarp();  // the lanes' source pointers, before lane 0 issues the copies
    ++opened;
    const int n = t.sources();
    // Segments of whole 128-byte lines where they fit (a bulk copy that starts mid-line costs a
    // line more); a zero-source token still writes its (zero) sum, from an untouched buffer.
    int seg_bytes = n == 0 ? packs * (int)sizeof(P) : kStageBytes / n;
    seg_bytes &= seg_bytes >= 128 ? ~127 : ~15;
    t.seg = min(packs, max(1, seg_bytes / (int)sizeof(P)));
    t.segs = (packs + t.seg - 1) / t.seg;
    *job = t;
    return true;
  };
  TokenJob fill_job;             // the newest open token, whose segments are being filled
  if (!open(&fill_job)) return;
  TokenJob fill_prev = fill_job; // the token opened before it
  int fill_g = 0;                // the next segment of fill_job to fill
  bool filling = true;
  unsigned filled = 0, summed = 0;  // segments so far: segment i uses buffer i % kStages
  auto fill_one = [&]() {
    if (!filling) return;
    const int n = fill_job.sources(), first = fill_g * fill_job.seg;
    if (n > 0)
      fill_stage<P>(ws.src_of(fill_job.id), n, ws, filled % kStages, first,
                    min(fill_job.seg, packs - first), fill_job.seg, bulk, lane);
    ++filled;
    if (++fill_g == fill_job.segs) {
      TokenJob t;
      filling = open(&t);
      if (filling) {
        fill_prev = fill_job;
        fill_job = t;
        fill_g = 0;
      }
    }
  };
  TokenJob job = fill_job;  // the token summed
  int g = 0;                // its segment summed next
  fill_one();
  while (summed < filled) {
    fill_one();
    const int stage = summed % kStages, first = g * job.seg;
    if (job.sources() > 0 && bulk) {
      mbar_wait(&ws.bar[stage], (*ws.phase >> stage) & 1u);
      __syncwarp();
      if (lane == 0) *ws.phase ^= 1u << stage;
    }
    sum_stage<T, N, kFinal>(job, reinterpret_cast<const P*>(ws.buf + (size_t)stage * kStageBytes),
                            job.seg, min(job.seg, packs - first),
                            reinterpret_cast<P*>(job.dst) + first, lane);
    __syncwarp();  // the buffer is refilled next
    ++summed;
    if (++g == job.segs && summed < filled) {
      // The next token is open: the newest one, or the one before it.
      job = fill_job.id == job.id + 1 ? fill_job : fill_prev;
      g = 0;
    }
  }
}

// Points sources [0, n) at the expert rows rows[0, n). Warp-wide (n <= kMaxTopk <= 32).
EP_DEVICE void point_at_rows(const char** src, const void* expert_out, size_t row_bytes,
                             const int* rows, int n, int lane) {
  if (lane < n) src[lane] = reinterpret_cast<const char*>(expert_out) + (size_t)rows[lane] * row_bytes;
}

}  // namespace nccl_ep
