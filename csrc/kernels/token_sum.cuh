/*
 * token_sum.cuh: the combine's per-token sums (the design's section 4 arithmetic), staged through
 * shared memory by bulk copies. Used by combine.cu.
 *
 * NOTES:
 *  - acc = float32; round = the token dtype's round-to-nearest-even. Every sum starts from +0.0f
 *    and is a chain of single adds in the contract's order; nothing is reordered or fused.
 *  - A warp owns its staging (source list, buffers, barriers): no cross-warp synchronization.
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
struct TokenSum {
  const char* const* src;  // the sources' row starts
  int n_rows, n_parts, own_at;
  __device__ int sources() const { return n_rows + n_parts; }
};

// Sources per warp: a token's rows here plus one partial per peer.
constexpr int kMaxSources = kMaxTopk + kMaxRanks - 1;

// Staging per warp: kStages buffers of Shape::kStageBytes. A token's rows are summed segment by
// segment: the segment (every source's same columns) fills a buffer; while the warp sums segment
// g, the bulk copies of the next kStages - 1 are in flight. The segment shrinks as sources grow so
// that one always fits a buffer.
constexpr int kStages = 2;

// A combine CTA's staging: kWarps warps of kStages buffers of kStageBytes each.
template <int kWarps_, int kStageBytes_>
struct StagingShape {
  static constexpr int kWarps = kWarps_, kStageBytes = kStageBytes_;
  static constexpr size_t kBytes = (size_t)kWarps * kStages * kStageBytes;
  static_assert(kWarps <= kCombineWarps, "warp_staging() sizes its arrays by kCombineWarps");
  static_assert(kStageBytes % 16 == 0, "stage buffers hold 16-byte packs");
};
// Items of 2-5 sources (EP=2 at top-8): 16 warps x 2 x 6656 B (with the static part, 227 KiB).
using NarrowStaging = StagingShape<16, 6656>;
// Items of 8 sources (one rank at top-8): 12 warps x 2 x 8 KiB, so that a segment's bulk copies
// are 1 KiB, not 768 B: at 8 sources a stage is split 8 ways, and the per-copy cost of smaller
// copies outweighs 4 more warps. Items of 2-5 sources have large copies in any stage, so there
// the warps count (NarrowStaging).
using WideStaging = StagingShape<12, 8192>;

// The warp's staging: its source list, buffers (stage_bytes each) and their barriers (phase: bit
// i = the parity the next wait on buffer i waits for); timers: where EP_TRACE builds charge the
// phases (or none).
struct WarpStaging {
  const char** src;
  char* buf;
  int stage_bytes;
  unsigned long long* bar;
  unsigned* phase;
  ItemTimers* timers;
};

template <typename Shape>
EP_DEVICE WarpStaging warp_staging() {
  __shared__ const char* sources[kCombineWarps][kMaxSources];
  __shared__ unsigned long long bars[kCombineWarps][kStages];
  __shared__ unsigned phases[kCombineWarps];
  extern __shared__ __align__(128) char staging[];
  const int w = threadIdx.x >> 5;
  return {sources[w], staging + (size_t)w * kStages * Shape::kStageBytes, Shape::kStageBytes,
          bars[w], &phases[w], nullptr};
}

// Once per warp before its first token sum (lane 0 initializes, the warp waits).
EP_DEVICE void init_warp_staging(const WarpStaging& ws, int lane) {
  if (lane == 0) {
    for (int i = 0; i < kStages; ++i) mbar_init(&ws.bar[i]);
    *ws.phase = 0;
  }
  __syncwarp();
}

// Packs [first, first + count) of every source into buffer `stage`, source i at i * seg packs: by
// bulk copies (16-byte path; lane i issues source i's, the barrier counts the bytes), else by
// the lanes.
// NOTES: lane 0 arms the barrier before any copy is issued (__syncwarp); each issuing lane
// fences its own generic-proxy view (the warp's reads of the buffer's previous segment, ordered
// to it by the caller's __syncwarp) before its copy.
template <typename P>
EP_DEVICE void fill_stage(const TokenSum& s, const WarpStaging& ws, int stage, int first,
                          int count, int seg, bool bulk, int lane) {
  P* buf = reinterpret_cast<P*>(ws.buf + (size_t)stage * ws.stage_bytes);
  const int n = s.sources();
  if (bulk) {
    if (lane == 0) mbar_expect_bytes(&ws.bar[stage], (unsigned)(n * count * sizeof(P)));
    __syncwarp();
    for (int i = lane; i < n; i += 32) {
      fence_proxy_async_shared();
      bulk_load(buf + (size_t)i * seg, reinterpret_cast<const P*>(s.src[i]) + first,
                (unsigned)(count * sizeof(P)), &ws.bar[stage]);
    }
  } else {
    for (int i = 0; i < n; ++i)
      for (int j = lane; j < count; j += 32)
        buf[(size_t)i * seg + j] = reinterpret_cast<const P*>(s.src[i])[first + j];
    __syncwarp();
  }
}

// out[j] for the packs j < count of one buffer (source i's pack j at buf[i * seg + j]); kRows:
// the rows' count when known at compile time (its chain unrolled whole: no loop or remainder
// per pass), else -1.
template <typename T, int N, bool kFinal, int kRows>
EP_DEVICE void sum_stage_rows(const TokenSum& s, const Pack<T, N>* buf, int seg, int count,
                              Pack<T, N>* out, int lane) {
  for (int j = lane; j < count; j += 32) {
    float own[N], acc[N];  // acc: stage 2 only
#pragma unroll
    for (int q = 0; q < N; ++q) own[q] = acc[q] = 0.0f;
    if constexpr (kRows >= 0) {
#pragma unroll
      for (int i = 0; i < kRows; ++i) accumulate(own, buf[(size_t)i * seg + j]);
    } else {
#pragma unroll 4
      for (int i = 0; i < s.n_rows; ++i) accumulate(own, buf[(size_t)i * seg + j]);
    }
    if (kFinal) {
      for (int i = 0; i <= s.n_parts; ++i) {
        // This rank's partial, rounded as a peer's arrives (a packed round, then the words).
        if (i == s.own_at) accumulate(acc, round_pack<T>(own));
        if (i == s.n_parts) break;
        accumulate(acc, buf[(size_t)(s.n_rows + i) * seg + j]);
      }
    }
    out[j] = round_pack<T>(kFinal ? acc : own);
  }
}

// sum_stage_rows with the row count of a token's share on one rank at top-8 (1-8) unrolled.
template <typename T, int N, bool kFinal>
EP_DEVICE void sum_stage(const TokenSum& s, const Pack<T, N>* buf, int seg, int count,
                         Pack<T, N>* out, int lane) {
  switch (s.n_rows) {
#define EP_SUM_ROWS(R) \
  case R: return sum_stage_rows<T, N, kFinal, R>(s, buf, seg, count, out, lane);
    EP_SUM_ROWS(1) EP_SUM_ROWS(2) EP_SUM_ROWS(3) EP_SUM_ROWS(4)
    EP_SUM_ROWS(5) EP_SUM_ROWS(6) EP_SUM_ROWS(7) EP_SUM_ROWS(8)
#undef EP_SUM_ROWS
    default: return sum_stage_rows<T, N, kFinal, -1>(s, buf, seg, count, out, lane);
  }
}

// A segment's cost in issue slots: filling a stage kFillCost + kFillCostPerSource per source
// (arming the barrier, one bulk copy per source), a warp pass over 32 packs kPassCost +
// kPassCostPerSource per source (a load and an add per source). The model only ranks two
// candidate lengths (segment_packs): shorter segments pay a fill each, so cutting a segment to
// whole warp passes pays off only when the passes it saves cost more.
constexpr int kFillCost = 35, kFillCostPerSource = 36, kPassCost = 40, kPassCostPerSource = 19;

// The segment length (packs) for n sources: the longest that fits a stage (`fit`), or the
// longest run of whole warp passes below it when the fewer passes (the last one of each segment
// no longer part-empty) outweigh the more fills.
EP_DEVICE int segment_packs(int fit, int packs, int n) {
  const int whole = fit & ~31;
  if (whole == 0 || whole == fit) return fit;
  auto cost = [&](int seg) {
    const int full = packs / seg, rest = packs - full * seg;
    const int segs = full + (rest > 0), passes = full * ((seg + 31) / 32) + (rest + 31) / 32;
    return segs * (kFillCost + kFillCostPerSource * n) +
           passes * (kPassCost + kPassCostPerSource * n);
  };
  return cost(whole) < cost(fit) ? whole : fit;
}

// dst[begin, begin + packs) = the token's sum over those packs of its sources, through the
// warp's staging buffers.
template <typename T, int N, bool kFinal>
EP_DEVICE void sum_token(const TokenSum& s, const WarpStaging& ws, Pack<T, N>* dst, int begin,
                         int packs, bool bulk, int lane) {
  using P = Pack<T, N>;
  if (packs <= 0) return;  // a half of a one-pack row
  const int n = s.sources();
  // Segments of whole 128-byte lines where they fit (a bulk copy that starts mid-line costs a
  // line more); a zero-source token still writes its (zero) sum, from an untouched buffer.
  int seg_bytes = n == 0 ? packs * (int)sizeof(P) : ws.stage_bytes / n;
  seg_bytes &= seg_bytes >= 128 ? ~127 : ~15;
  const int seg = segment_packs(min(packs, max(1, seg_bytes / (int)sizeof(P))), packs, n);
  const int segs = (packs + seg - 1) / seg;
  auto fill = [&](int g) {
    if (n > 0 && g < segs)
      fill_stage<P>(s, ws, g % kStages, begin + g * seg, min(seg, packs - g * seg), seg, bulk,
                    lane);
  };
  PhaseClock clock(ws.timers, lane);
  for (int g = 0; g < kStages - 1; ++g) fill(g);
  for (int g = 0; g < segs; ++g) {
    fill(g + kStages - 1);
    clock.lap(kPhaseFill);
    const int stage = g % kStages;
    if (n > 0 && bulk) {
      mbar_wait(&ws.bar[stage], (*ws.phase >> stage) & 1u);
      __syncwarp();
      if (lane == 0) *ws.phase ^= 1u << stage;
    }
    clock.lap(kPhaseWait);
    sum_stage<T, N, kFinal>(s, reinterpret_cast<const P*>(ws.buf + (size_t)stage * ws.stage_bytes),
                            seg, min(seg, packs - g * seg), dst + begin + (size_t)g * seg, lane);
    __syncwarp();  // the buffer is refilled next
    clock.lap(kPhaseWork);
    clock.count_segment();
  }
}

// Points sources [0, n) at the expert rows rows[0, n). Warp-wide (n <= kMaxTopk <= 32).
EP_DEVICE void point_at_rows(const char** src, const void* expert_out, size_t row_bytes,
                             const int* rows, int n, int lane) {
  if (lane < n) src[lane] = reinterpret_cast<const char*>(expert_out) + (size_t)rows[lane] * row_bytes;
}

}  // namespace nccl_ep
