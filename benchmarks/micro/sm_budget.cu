// sm_budget.cu: how fast can N SMs expand tokens into expert rows, and sum them back, on one GPU?
// Standalone (not part of the library): the bench shape at EP=1 (4096 tokens x 7168 bf16, top-8
// of 256, 32768 expert-major rows), each variant checked bitwise against the first one.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I <nccl include> -o /tmp/sm_budget \
//       benchmarks/micro/sm_budget.cu && /tmp/sm_budget 24        # argument: SMs (CTAs)
//
// Variants: expand with 16-byte register stores (expand_v0) or TMA bulk stores from shared memory
// (expand_tma: warps x segment x stages), or a share of the tokens by the copy engines (one
// cudaMemcpyBatchAsync of their row copies) beside expand_v0 on the SMs; combine with 1 or 2 packs per lane of register loads
// (combine_reg) or TMA bulk loads into shared memory (combine_tma); the library's token sums
// (combine_library), also with the engine receiver's per-token code (ENGINE); the hand-written
// TMA combine without the proxy fence before each refill; split: the same
// bytes as 2x the items of K/2 rows each (EP=2's per-rank sums), per item vs per byte.
// Ceilings: a plain copy from the same number of CTAs, from 2 CTAs per SM, and cudaMemcpy.
// Measured on 1 x H200 (2026-11-29): at 24 SMs every expand variant ~337 us (~1.57 TB/s, the SM
// store path: ~65 GB/s per SM; 16 SMs: ~490 us), combine_reg 408 / 300 us (P1 / P2),
// combine_tma 246 us at 12 warps x 1 KB segments. On 2026-12-01 (ninth session): combine_tma
// 665-773 us, a CTA-wide combine (a producer warp, one bulk copy of 7-14 KiB per source, 8-28
// consumer warps, 2-8 stages, items of 8 or 4 rows; removed since) 654-693 us in every shape, the
// library's warp sums 331 us (768-byte copies; split 236 us): few large bulk copies per SM lose
// to many small ones here. Tenth session: the library's sums
// with packs added as 32-bit words and each source's copy issued by its own lane, 276 us (split
// 220 us).
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <random>
#include <cstring>
#include <chrono>

// The library's own token sums (csrc/kernels/token_sum.cuh), timed outside the exchange engine,
// and the engine's per-token receiver code (exchange.cuh: dest_mask, collect_rows).
#include "../../csrc/kernels/exchange.cuh"
#include "../../csrc/kernels/token_sum.cuh"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1);} } while (0)

constexpr int T = 4096, H = 7168, K = 8, E = 256;
constexpr int ROWB = H * 2;
constexpr int N = T * K;

__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int c) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(sa(b)), "r"(c) : "memory"); }
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  uint64_t st; asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;" : "=l"(st) : "r"(sa(b)), "r"(bytes) : "memory"); (void)st; }
__device__ __forceinline__ bool mbar_try_wait(uint64_t* b, uint32_t parity) {
  uint32_t ok; asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(ok) : "r"(sa(b)), "r"(parity) : "memory"); return ok != 0; }
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) { while (!mbar_try_wait(b, parity)) {} }
__device__ __forceinline__ void tma_load(void* s, const void* g, uint32_t bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" :: "r"(sa(s)), "l"(g), "r"(bytes), "r"(sa(b)) : "memory"); }
__device__ __forceinline__ void tma_store(void* g, const void* s, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(g), "r"(sa(s)), "r"(bytes) : "memory"); }
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int n> __device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(n) : "memory"); }
template <int n> __device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;" :: "n"(n) : "memory"); }

// ---- expand ----
// V0: registers, one warp per token, 4 x 16B loads in flight per lane, stores to K rows; tokens
// [t_begin, T) (the split with the copy engines gives them the others).
template <int WARPS>
__global__ void __launch_bounds__(WARPS * 32) expand_v0(const uint4* x, uint4* out, const int* rr,
                                                        int t_begin = 0) {
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * WARPS + (threadIdx.x >> 5), nw = gridDim.x * WARPS;
  const int units = ROWB / 16;
  for (int t = t_begin + warp; t < T; t += nw) {
    int rows[K];
#pragma unroll
    for (int k = 0; k < K; ++k) rows[k] = rr[t * K + k];
    const uint4* src = x + (size_t)t * units;
    for (int j0 = lane; j0 < units; j0 += 32 * 4) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) if (j0 + 32 * u < units) v[u] = src[j0 + 32 * u];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        uint4* d = out + (size_t)rows[k] * units;
#pragma unroll
        for (int u = 0; u < 4; ++u) if (j0 + 32 * u < units) d[j0 + 32 * u] = v[u];
      }
    }
  }
}

// V1: TMA, one warp per token, lane 0 loads a segment into smem and bulk-stores it to each row.
template <int WARPS, int SEG, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) expand_tma(const char* x, char* out, const int* rr) {
  extern __shared__ __align__(128) char smem[];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int warp = blockIdx.x * WARPS + wid, nw = gridDim.x * WARPS;
  char* buf = smem + (size_t)wid * STAGES * SEG;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + (size_t)WARPS * STAGES * SEG) + wid * STAGES;
  if (lane == 0) { for (int s = 0; s < STAGES; ++s) mbar_init(&bars[s], 1); fence_mbar_init(); }
  __syncwarp();
  if (lane != 0) return;
  unsigned it = 0;
  for (int t = warp; t < T; t += nw) {
    int rows[K];
#pragma unroll
    for (int k = 0; k < K; ++k) rows[k] = rr[t * K + k];
    const char* src = x + (size_t)t * ROWB;
    for (int off = 0; off < ROWB; off += SEG, ++it) {
      const int b = it % STAGES;
      const uint32_t bytes = min(SEG, ROWB - off);
      bulk_wait_read<STAGES - 1>();
      mbar_expect_tx(&bars[b], bytes);
      tma_load(buf + b * SEG, src + off, bytes, &bars[b]);
      mbar_wait(&bars[b], (it / STAGES) & 1);
#pragma unroll
      for (int k = 0; k < K; ++k) tma_store(out + (size_t)rows[k] * ROWB + off, buf + b * SEG, bytes);
      bulk_commit();
    }
  }
  bulk_wait<0>();
}

// ---- combine (own partial: y[t] = round(0 + sum_k rows)) ----
// The contract's arithmetic on one 16-byte pack of 8 bf16: acc = acc + v element by element, in
// float32; the sum rounded to nearest even.
__device__ __forceinline__ void add_pack(float (&acc)[8], const uint4& v) {
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = acc[q] + __bfloat162float(e[q]);
}
__device__ __forceinline__ uint4 round_pack(const float (&acc)[8]) {
  uint4 o;
  __nv_bfloat16* oe = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
  for (int q = 0; q < 8; ++q) oe[q] = __float2bfloat16_rn(acc[q]);
  return o;
}
template <int P>  // packs per lane in flight
__global__ void __launch_bounds__(512) combine_reg(const uint4* eo, uint4* y, const int* rr) {
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * 16 + (threadIdx.x >> 5), nw = gridDim.x * 16;
  const int units = ROWB / 16;
  for (int t = warp; t < T; t += nw) {
    int rows[K];
#pragma unroll
    for (int k = 0; k < K; ++k) rows[k] = rr[t * K + k];
    for (int j0 = lane; j0 < units; j0 += 32 * P) {
      uint4 v[P][K];
#pragma unroll
      for (int p = 0; p < P; ++p)
#pragma unroll
        for (int k = 0; k < K; ++k) if (j0 + 32 * p < units) v[p][k] = eo[(size_t)rows[k] * units + j0 + 32 * p];
#pragma unroll
      for (int p = 0; p < P; ++p) {
        if (j0 + 32 * p >= units) continue;
        float acc[8] = {};
#pragma unroll
        for (int k = 0; k < K; ++k) add_pack(acc, v[p][k]);
        y[(size_t)t * units + j0 + 32 * p] = round_pack(acc);
      }
    }
  }
}

// TMA: lane 0 loads the K rows' segment into smem (one mbarrier per stage), next segment
// prefetched; lanes sum from smem.
// CONTIG: CTA b takes the contiguous tokens [T b / C, T (b+1) / C) (the engine's channels);
// DEP: one more dependent load per token before its rows (the engine's routing / slot reads).
// FENCE: the shared-memory proxy fence before each refill (as token_sum.cuh has it); without it,
// whether the fence (which may wait for the warp's previous output stores) costs per segment.
template <int WARPS, int SEG, bool CONTIG = false, bool DEP = false, bool FENCE = true>
__global__ void __launch_bounds__(WARPS * 32) combine_tma(const char* eo, char* y, const int* rr) {
  extern __shared__ __align__(128) char smem[];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const int warp = blockIdx.x * WARPS + wid, nw = gridDim.x * WARPS;
  char* buf = smem + (size_t)wid * 2 * K * SEG;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + (size_t)WARPS * 2 * K * SEG) + wid * 2;
  if (lane == 0) { mbar_init(&bars[0], 1); mbar_init(&bars[1], 1); fence_mbar_init(); }
  __syncwarp();
  unsigned ph[2] = {0, 0};
  constexpr int nseg = (ROWB + SEG - 1) / SEG;
  const int t0 = CONTIG ? (int)((long long)T * blockIdx.x / gridDim.x) + wid : warp;
  const int t1 = CONTIG ? (int)((long long)T * (blockIdx.x + 1) / gridDim.x) : T;
  for (int t = t0; t < t1; t += CONTIG ? WARPS : nw) {
    int rows[K];
    const int* rrt = rr + t * K;
    if (DEP) rrt += __shfl_sync(0xffffffffu, rr[t * K + (lane & 7)] & 0, 0);  // a dependent load
#pragma unroll
    for (int k = 0; k < K; ++k) rows[k] = rrt[k];
    auto issue = [&](int s, int b) {
      const int off = s * SEG; const uint32_t bytes = min(SEG, ROWB - off);
      mbar_expect_tx(&bars[b], bytes * K);
#pragma unroll
      for (int k = 0; k < K; ++k) tma_load(buf + (b * K + k) * SEG, eo + (size_t)rows[k] * ROWB + off, bytes, &bars[b]);
    };
    if (lane == 0) { if (FENCE) fence_proxy_async(); issue(0, 0); }
    for (int s = 0; s < nseg; ++s) {
      const int b = s & 1;
      if (s + 1 < nseg && lane == 0) { if (FENCE) fence_proxy_async(); issue(s + 1, b ^ 1); }
      mbar_wait(&bars[b], ph[b]); ph[b] ^= 1;
      const int off = s * SEG; const int bytes = min(SEG, ROWB - off);
      for (int j = lane; j < bytes / 16; j += 32) {
        float acc[8] = {};
#pragma unroll
        for (int k = 0; k < K; ++k) add_pack(acc, reinterpret_cast<const uint4*>(buf + (b * K + k) * SEG)[j]);
        reinterpret_cast<uint4*>(y + (size_t)t * ROWB + off)[j] = round_pack(acc);
      }
      __syncwarp();
    }
  }
}

// The engine's sum_token on the same work: per token a source list of its K rows, then the
// library's staging (token_sum.cuh: Shape, the narrow one of EP >= 2 or the wide one that one
// rank at top-8 uses). CTA b takes the engine's contiguous
// token range; FINAL: the receivers' stage-2 path (own partial rounded, then the chain). ENGINE:
// the token's rows found as the engine's combine finds them at EP=1 (combine.cu: the row map's
// and the routing's loads, the destination mask, compact_rows: ballots, shared memory) instead
// of a plain read of rr; against ENGINE = false, what that per-token code costs in the engine.
template <bool FINAL, bool ENGINE, typename Shape>
__global__ void __launch_bounds__(Shape::kWarps * 32, 1)
    combine_library(const char* eo, char* y, const int* rr, const nccl_ep::ExchangeArgs e) {
  using namespace nccl_ep;
  using P = Pack<__nv_bfloat16, 8>;
  __shared__ int rows_sh[Shape::kWarps][kMaxTopk], slots_sh[Shape::kWarps][kMaxTopk];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const WarpStaging ws = warp_staging<Shape>();
  init_warp_staging(ws, lane);
  const int t1 = (int)((long long)T * (blockIdx.x + 1) / gridDim.x);
  for (int t = (int)((long long)T * blockIdx.x / gridDim.x) + wid; t < t1; t += Shape::kWarps) {
    int n = K;
    bool has_own = true;
    if (ENGINE) {
      const int row = slot_row(e, 0, t, lane);  // in flight with the routing load, as there
      has_own = dest_mask(e.own_routing + (size_t)t * e.topk, e.topk, e.expert_base, e.num_local,
                          e.num_ranks, lane) & 1ull;
      n = has_own ? max(0, compact_rows(e, token_rows(e, 0, t), row, lane, rows_sh[wid],
                                                       slots_sh[wid])) : 0;
      point_at_rows(ws.src, eo, ROWB, rows_sh[wid], n, lane);
    } else if (lane < K) {
      ws.src[lane] = eo + (size_t)rr[t * K + lane] * ROWB;
    }
    __syncwarp();
    sum_token<__nv_bfloat16, 8, FINAL>({ws.src, n, 0, has_own ? 0 : -1}, ws,
                                       reinterpret_cast<P*>(y + (size_t)t * ROWB), 0, ROWB / 16,
                                       true, lane);
    __syncwarp();
  }
}

// Split: the same bytes as combine_library<false, false> in twice the items, each half a token's
// rows (item (t, h): rows [h K/2, (h+1) K/2) of token t, into y[2t + h]), as at EP=2 where each
// rank sums ~K/2 of a token's rows. Against K rows per item: whether the sums cost per item.
constexpr int kSplit = 2, kSplitRows = K / kSplit;
using SplitStaging = nccl_ep::NarrowStaging;  // K/2 sources per item, as at EP=2
__global__ void __launch_bounds__(SplitStaging::kWarps * 32, 1)
    combine_library_split(const char* eo, char* y, const int* rr) {
  using namespace nccl_ep;
  using P = Pack<__nv_bfloat16, 8>;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const WarpStaging ws = warp_staging<SplitStaging>();
  init_warp_staging(ws, lane);
  constexpr int items = T * kSplit;
  const int i1 = (int)((long long)items * (blockIdx.x + 1) / gridDim.x);
  for (int i = (int)((long long)items * blockIdx.x / gridDim.x) + wid; i < i1;
       i += SplitStaging::kWarps) {
    const int t = i / kSplit, h = i % kSplit;
    if (lane < kSplitRows) ws.src[lane] = eo + (size_t)rr[t * K + h * kSplitRows + lane] * ROWB;
    __syncwarp();
    sum_token<__nv_bfloat16, 8, false>({ws.src, kSplitRows, 0, 0}, ws,
                                       reinterpret_cast<P*>(y + (size_t)i * ROWB), 0, ROWB / 16,
                                       true, lane);
    __syncwarp();
  }
}

// The split's reference: the same partial sums (+0.0f, ascending rows, float32, round to nearest
// even), one thread per 16-byte pack.
__global__ void combine_split_ref(const uint4* eo, uint4* y, const int* rr) {
  constexpr int units = ROWB / 16;
  for (size_t p = blockIdx.x * (size_t)blockDim.x + threadIdx.x; p < (size_t)T * kSplit * units;
       p += (size_t)gridDim.x * blockDim.x) {
    const int i = (int)(p / units), j = (int)(p % units), t = i / kSplit, h = i % kSplit;
    float acc[8] = {};
    for (int k = 0; k < kSplitRows; ++k) add_pack(acc, eo[(size_t)rr[t * K + h * kSplitRows + k] * units + j]);
    y[p] = round_pack(acc);
  }
}

// ---- ceilings ----
__global__ void __launch_bounds__(512) copy_reg(const uint4* s, uint4* d, size_t n) {
  for (size_t i = blockIdx.x * 512 + threadIdx.x; i < n; i += (size_t)gridDim.x * 512 * 4) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) if (i + u * (size_t)gridDim.x * 512 < n) v[u] = s[i + u * (size_t)gridDim.x * 512];
#pragma unroll
    for (int u = 0; u < 4; ++u) if (i + u * (size_t)gridDim.x * 512 < n) d[i + u * (size_t)gridDim.x * 512] = v[u];
  }
}

template <typename F>
float time_it(F f, int iters = 20) {
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> ts;
  for (int i = 0; i < iters; ++i) { CK(cudaEventRecord(a)); f(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b)); float ms; CK(cudaEventElapsedTime(&ms, a, b)); ts.push_back(ms * 1000); }
  CK(cudaGetLastError());
  std::sort(ts.begin(), ts.end()); return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // line by line: a run cut off by a timeout keeps its lines
  const int sms = argc > 1 ? atoi(argv[1]) : 24;
  std::mt19937 rng(1234);
  std::vector<int> topk(T * K);
  for (int t = 0; t < T; ++t) { std::vector<int> p(E); for (int e = 0; e < E; ++e) p[e] = e; std::shuffle(p.begin(), p.end(), rng); for (int k = 0; k < K; ++k) topk[t * K + k] = p[k]; }
  std::vector<int> cnt(E, 0), base(E, 0), rr(T * K);
  for (int i = 0; i < T * K; ++i) cnt[topk[i]]++;
  for (int e = 1; e < E; ++e) base[e] = base[e - 1] + cnt[e - 1];
  for (int i = 0; i < T * K; ++i) rr[i] = base[topk[i]]++;
  int* d_rr; CK(cudaMalloc(&d_rr, sizeof(int) * T * K)); CK(cudaMemcpy(d_rr, rr.data(), sizeof(int) * T * K, cudaMemcpyHostToDevice));
  std::vector<uint16_t> hx((size_t)T * H), he((size_t)N * H);
  for (auto& v : hx) { float f = (float)(rng() % 20001) / 10000.0f - 1.0f; __nv_bfloat16 b = __float2bfloat16(f); memcpy(&v, &b, 2); }
  for (auto& v : he) { float f = (float)(rng() % 20001) / 10000.0f - 1.0f; __nv_bfloat16 b = __float2bfloat16(f); memcpy(&v, &b, 2); }
  char *x, *out, *out2, *eo, *y, *y2;
  CK(cudaMalloc(&x, (size_t)T * ROWB)); CK(cudaMalloc(&out, (size_t)N * ROWB)); CK(cudaMalloc(&out2, (size_t)N * ROWB));
  CK(cudaMalloc(&eo, (size_t)N * ROWB)); CK(cudaMalloc(&y, (size_t)T * ROWB)); CK(cudaMalloc(&y2, (size_t)T * ROWB));
  CK(cudaMemcpy(x, hx.data(), (size_t)T * ROWB, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(eo, he.data(), (size_t)N * ROWB, cudaMemcpyHostToDevice));
  const double exp_bytes = (double)T * ROWB + (double)N * ROWB, comb_bytes = exp_bytes;
  auto report = [&](const char* name, float us, double bytes) { printf("%-36s %8.1f us  %7.0f GB/s\n", name, us, bytes / us / 1e3); };
  auto cmp = [&](const char* a, const char* b, size_t bytes, const char* what) {
    std::vector<char> h1(bytes), h2(bytes); CK(cudaMemcpy(h1.data(), a, bytes, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(h2.data(), b, bytes, cudaMemcpyDeviceToHost));
    printf("  check %s: %s\n", what, memcmp(h1.data(), h2.data(), bytes) == 0 ? "bitwise equal" : "MISMATCH");
  };
  printf("SMs %d, T %d H %d K %d E %d bf16\n", sms, T, H, K, E);
  // ceilings
  { size_t n = (size_t)N * ROWB / 16; 
    report("copy_reg 24 SMs (470 MB)", time_it([&] { copy_reg<<<sms, 512>>>((const uint4*)eo, (uint4*)out2, n); }), 2.0 * n * 16);
    report("copy_reg 132x2 CTAs", time_it([&] { copy_reg<<<264, 512>>>((const uint4*)eo, (uint4*)out2, n); }), 2.0 * n * 16);
    report("cudaMemcpy d2d", time_it([&] { CK(cudaMemcpyAsync(out2, eo, n * 16, cudaMemcpyDeviceToDevice)); }), 2.0 * n * 16); }
  // expand
  CK(cudaMemset(out, 0x7f, (size_t)N * ROWB));
  report("expand_v0 16w", time_it([&] { expand_v0<16><<<sms, 512>>>((const uint4*)x, (uint4*)out, d_rr); }), exp_bytes);
  report("expand_v0 32w", time_it([&] { expand_v0<32><<<sms, 1024>>>((const uint4*)x, (uint4*)out, d_rr); }), exp_bytes);
#define EXP_TMA(W, S, ST) { auto k = expand_tma<W, S, ST>; int smem = W * ST * S + W * ST * 8; CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    CK(cudaMemset(out2, 0x55, (size_t)N * ROWB)); \
    report("expand_tma w" #W " seg" #S " st" #ST, time_it([&] { k<<<sms, W * 32, smem>>>(x, out2, d_rr); }), exp_bytes); cmp(out, out2, (size_t)N * ROWB, "expand"); }
  EXP_TMA(16, 4096, 2) EXP_TMA(16, 2048, 3) EXP_TMA(8, 4096, 3) EXP_TMA(16, 3584, 3) EXP_TMA(32, 2048, 2) EXP_TMA(8, 7168, 2) EXP_TMA(4, 14336, 2)
  // combine
  CK(cudaMemset(y, 0x7f, (size_t)T * ROWB));
  report("combine_reg P1", time_it([&] { combine_reg<1><<<sms, 512>>>((const uint4*)eo, (uint4*)y, d_rr); }), comb_bytes);
  CK(cudaMemset(y2, 0x55, (size_t)T * ROWB));
  report("combine_reg P2", time_it([&] { combine_reg<2><<<sms, 512>>>((const uint4*)eo, (uint4*)y2, d_rr); }), comb_bytes);
  cmp(y, y2, (size_t)T * ROWB, "combine");
#define COMB_TMA(W, S) { auto k = combine_tma<W, S>; int smem = W * 2 * K * S + W * 16; CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    CK(cudaMemset(y2, 0x55, (size_t)T * ROWB)); \
    report("combine_tma w" #W " seg" #S, time_it([&] { k<<<sms, W * 32, smem>>>(eo, y2, d_rr); }), comb_bytes); cmp(y, y2, (size_t)T * ROWB, "combine"); }
  COMB_TMA(8, 1024) COMB_TMA(16, 512) COMB_TMA(6, 2048) COMB_TMA(12, 1024) COMB_TMA(4, 3584) COMB_TMA(24, 512)
#define COMB_TMA_ENGINE(W, S, C, D) { auto k = combine_tma<W, S, C, D>; int smem = W * 2 * K * S + W * 16; CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    CK(cudaMemset(y2, 0x55, (size_t)T * ROWB)); \
    report("combine_tma w" #W " seg" #S " contig" #C " dep" #D, time_it([&] { k<<<sms, W * 32, smem>>>(eo, y2, d_rr); }), comb_bytes); cmp(y, y2, (size_t)T * ROWB, "combine"); }
  COMB_TMA_ENGINE(12, 1024, true, false) COMB_TMA_ENGINE(12, 1024, false, true) COMB_TMA_ENGINE(12, 1024, true, true)
#define COMB_TMA_NOFENCE(W, S) { auto k = combine_tma<W, S, true, true, false>; int smem = W * 2 * K * S + W * 16; CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    CK(cudaMemset(y2, 0x55, (size_t)T * ROWB)); \
    report("combine_tma w" #W " seg" #S " contig dep, no fence", time_it([&] { k<<<sms, W * 32, smem>>>(eo, y2, d_rr); }), comb_bytes); cmp(y, y2, (size_t)T * ROWB, "combine"); }
  COMB_TMA_NOFENCE(12, 1024) COMB_TMA_NOFENCE(16, 768) COMB_TMA_NOFENCE(8, 1536)
  // The engine's per-token code's view (one rank: every expert local, the row map is rr).
  nccl_ep::ExchangeArgs ex{};
  int* d_topk; CK(cudaMalloc(&d_topk, sizeof(int) * T * K));
  CK(cudaMemcpy(d_topk, topk.data(), sizeof(int) * T * K, cudaMemcpyHostToDevice));
  ex.own_routing = d_topk; ex.recv_row = d_rr; ex.topk = K; ex.max_topk = K; ex.max_tokens = T;
  ex.num_local = E; ex.num_ranks = 1; ex.rank = 0; ex.expert_base = 0; ex.rows = N;
#define COMB_LIB(F, ENG, SHAPE, NAME) { using Shape = nccl_ep::SHAPE; auto k = combine_library<F, ENG, Shape>; const int smem = (int)Shape::kBytes; CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); \
    CK(cudaMemset(y2, 0x55, (size_t)T * ROWB)); \
    report(NAME ", " #SHAPE " final=" #F, time_it([&] { k<<<sms, Shape::kWarps * 32, smem>>>(eo, y2, d_rr, ex); }), comb_bytes); cmp(y, y2, (size_t)T * ROWB, "combine"); }
  COMB_LIB(false, false, NarrowStaging, "combine_library (token_sum.cuh)")
  COMB_LIB(false, false, WideStaging, "combine_library (token_sum.cuh)")
  // Split (K/2 rows per item, 2x the items, same bytes), right after its K-row counterpart.
  { char *ys, *ys_ref; const size_t bytes = (size_t)T * kSplit * ROWB;
    CK(cudaMalloc(&ys, bytes)); CK(cudaMalloc(&ys_ref, bytes));
    combine_split_ref<<<1024, 256>>>((const uint4*)eo, (uint4*)ys_ref, d_rr); CK(cudaGetLastError());
    const int smem = (int)SplitStaging::kBytes;
    CK(cudaFuncSetAttribute(combine_library_split, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaMemset(ys, 0x55, bytes));
    report("combine_library split 2x4 rows", time_it([&] { combine_library_split<<<sms, SplitStaging::kWarps * 32, smem>>>(eo, ys, d_rr); }), comb_bytes);
    cmp(ys_ref, ys, bytes, "combine split");
    CK(cudaFree(ys)); CK(cudaFree(ys_ref)); }
  COMB_LIB(true, false, WideStaging, "combine_library (token_sum.cuh)")
  COMB_LIB(false, true, WideStaging, "combine, engine's per-token code")
  COMB_LIB(true, true, WideStaging, "combine, engine's per-token code")
  // The copy engines in the expansion (issue 7, item 2): the rows of tokens [0, n) as one batch of
  // row copies (cudaMemcpyBatchAsync, preferring to overlap compute) on a second stream, while
  // expand_v0 on the SM budget writes the other tokens' rows; n = 0: the SMs alone, n = T: the
  // copy engines alone. The SMs' kernel is launched first and the batch issued while it runs, as
  // a library would; the GPU time (events, from before both to after both) includes the host's
  // batch call where that outlasts the SMs' part (issuing the copies is part of their cost), and
  // the host time of the call is printed beside it. (A stream held by a spin kernel until both
  // were enqueued made the batch call wait for that kernel: no gate.)
  {
    std::vector<void*> dsts(N);
    std::vector<const void*> srcs(N);
    std::vector<size_t> sizes(N, ROWB);
    for (int i = 0; i < N; ++i) {
      dsts[i] = out2 + (size_t)rr[i] * ROWB;
      srcs[i] = x + (size_t)(i / K) * ROWB;
    }
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx = 0;
    cudaStream_t sm_stream, ce_stream;
    CK(cudaStreamCreateWithFlags(&sm_stream, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&ce_stream, cudaStreamNonBlocking));
    cudaEvent_t start, ce_done, stop;
    CK(cudaEventCreate(&start)); CK(cudaEventCreate(&ce_done)); CK(cudaEventCreate(&stop));
    cudaError_t batch_error = cudaSuccess;  // a runtime without batches: the SMs' line only
    for (int n_ce : {0, T / 8, T / 4, 3 * T / 8, T / 2, T}) {
      if (n_ce > 0 && batch_error != cudaSuccess) break;
      double host_us = 0;
      auto run = [&] {
        CK(cudaEventRecord(start, sm_stream));
        CK(cudaStreamWaitEvent(ce_stream, start));
        if (n_ce < T) expand_v0<16><<<sms, 512, 0, sm_stream>>>((const uint4*)x, (uint4*)out2, d_rr, n_ce);
        if (n_ce > 0 && batch_error == cudaSuccess) {
          const auto h0 = std::chrono::steady_clock::now();
          batch_error = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                             (size_t)n_ce * K, &attr, &attr_idx, 1, ce_stream);
          host_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0)
                        .count();
          if (batch_error != cudaSuccess) {
            printf("cudaMemcpyBatchAsync: %s (the copy-engine lines are skipped)\n",
                   cudaGetErrorString(batch_error));
            (void)cudaGetLastError();
          }
        }
        CK(cudaEventRecord(ce_done, ce_stream));
        CK(cudaStreamWaitEvent(sm_stream, ce_done));
        CK(cudaEventRecord(stop, sm_stream));
      };
      CK(cudaMemsetAsync(out2, 0x55, (size_t)N * ROWB, sm_stream));
      CK(cudaStreamSynchronize(sm_stream));
      std::vector<float> ts;
      for (int it = 0; it < 13 && batch_error == cudaSuccess; ++it) {
        run();
        CK(cudaEventSynchronize(stop));
        float ms;
        CK(cudaEventElapsedTime(&ms, start, stop));
        if (it >= 3) ts.push_back(ms * 1000);
      }
      if (ts.empty()) break;
      CK(cudaGetLastError());
      std::sort(ts.begin(), ts.end());
      char name[96];
      snprintf(name, sizeof(name), "expand, copy engines %d%% + %d SMs (host %.0f us)",
               100 * n_ce / T, n_ce < T ? sms : 0, host_us);
      report(name, ts[ts.size() / 2], exp_bytes);
      cmp(out, out2, (size_t)N * ROWB, "expand");
    }
    CK(cudaEventDestroy(start)); CK(cudaEventDestroy(ce_done)); CK(cudaEventDestroy(stop));
    CK(cudaStreamDestroy(sm_stream)); CK(cudaStreamDestroy(ce_stream));
  }
  CK(cudaDeviceSynchronize());
  printf("done\n");
  return 0;
}
