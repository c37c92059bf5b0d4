// hbm_patterns.cu: what the whole GPU reaches with the dispatch's expansion, by the order of its
// writes and how CTAs share the tokens. Standalone (not part of the library). One rank's
// expansion at T tokens x 7168 bf16, top-8 of 256 (T x 8 expert-major rows), from C CTAs (one
// per SM):
//
//   copy / write   sequential read + write of the rows' bytes / sequential writes only
//   tokens         the library's order: CTA b expands tokens [T*b/C, T*(b+1)/C), a warp per
//                  token, each 16-byte pack read once and stored to the token's 8 rows; also with
//                  each row's prob (dense [T, E] fp32), with 8 packs in flight per lane, with the
//                  next 4 packs loading during the stores, and by bulk copies (a segment of the
//                  token into shared memory, one bulk store per row); and each CTA's span on the
//                  global clock with its SM (which CTAs are slow)
//   claimed        the same, tokens drawn by warps from one counter of the grid (1 or 4 a time)
//   tokens, no x   the stores without the loads (what the scattered writes alone cost)
//   rows           the output's order: CTA b writes rows [N*b/C, N*(b+1)/C), each read from its
//                  token (x read ~8 times)
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/hbm_patterns \
//       benchmarks/micro/hbm_patterns.cu && /tmp/hbm_patterns 16384 24 66 132   # T, then SMs
//
// Every expansion's output is checked bitwise against the first one's.
// Measured on 1 x H200 (2026-12-01, thirteenth session), T = 16384, us at 24 / 66 / 132 CTAs:
// write 1321 / 512 / 431; tokens 1356 / 721 / 590; claimed 1 by 1 1308 / 584 / 581; tokens, no x
// 1318 / 540 / 455; rows 1806 / 1030 / 923. Loads in flight and bulk copies change nothing
// (within 2%). With equal ranges the CTAs placed on SMs 124-131 (CTAs 0-7) write slower: at 66
// CTAs they took 720 us, the median CTA 559 us. Below ~48 CTAs each SM's store path (~60 GB/s)
// is the bound whatever the order; above it, how evenly CTAs finish.
#include <cuda_runtime.h>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int H = 7168, K = 8, E = 256, ROWB = H * 2, UNITS = ROWB / 16, WARPS = 16, U = 4;

__global__ void __launch_bounds__(512, 1) copy_seq(const uint4* s, uint4* d, size_t n, int write_only) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t j = i + u * stride;
      v[u] = write_only || j >= n ? make_uint4((unsigned)j, 1, 2, 3) : s[j];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) if (i + u * stride < n) d[i + u * stride] = v[u];
  }
}

// A warp per token of this CTA's range, UU packs per lane in flight, each stored to the K rows.
// kPipe: the next group of packs (of this token or the warp's next one) is loaded before this
// group's stores, so a warp always has a load in flight.
// kProbs: also each row's prob, from dense probs [T, E] (fp32) by the token's experts, as the
// library's dispatch writes it. kBatch > 0: no range per CTA, warps draw tokens kBatch at a time
// from one counter of the grid (`next`, zero at launch), so a CTA whose SM writes slower takes
// fewer.
struct Probs { const int* topk; const float* dense; float* rows; };

template <bool kLoad, int UU = U, bool kPipe = false, bool kProbs = false, int kBatch = 0>
__global__ void __launch_bounds__(WARPS * 32, 1) expand_tokens(const uint4* x, uint4* out, const int* rr, int T,
                                                                 Probs probs = {},
                                                                 unsigned long long* cta_ns = nullptr,
                                                                 int* next = nullptr) {
  static_assert(!(kPipe && kBatch > 0), "the pipelined loop walks the CTA's range");
  constexpr int kGroups = (UNITS + 32 * UU - 1) / (32 * UU);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int begin = (int)((long long)T * blockIdx.x / gridDim.x), end = (int)((long long)T * (blockIdx.x + 1) / gridDim.x);
  auto load = [&](uint4 (&v)[UU], int t, int g) {
    const uint4* src = x + (size_t)t * UNITS;
#pragma unroll
    for (int u = 0; u < UU; ++u) {
      const int j = g * 32 * UU + lane + 32 * u;
      if (j < UNITS) v[u] = kLoad ? src[j] : make_uint4(t, j, 0, 0);
    }
  };
  auto store = [&](const uint4 (&v)[UU], const int (&rows)[K], int g) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      uint4* d = out + (size_t)rows[k] * UNITS;
#pragma unroll
      for (int u = 0; u < UU; ++u) {
        const int j = g * 32 * UU + lane + 32 * u;
        if (j < UNITS) d[j] = v[u];
      }
    }
  };
  auto rows_of = [&](int (&rows)[K], int t) {
#pragma unroll
    for (int k = 0; k < K; ++k) rows[k] = rr[(size_t)t * K + k];
  };
  if constexpr (!kPipe) {
    unsigned long long t_start = 0;
    if (cta_ns != nullptr && threadIdx.x == 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_start));
    auto expand = [&](int t) {
      int rows[K];
      rows_of(rows, t);
      for (int g = 0; g < kGroups; ++g) {
        uint4 v[UU];
        load(v, t, g);
        store(v, rows, g);
      }
      if (kProbs && lane < K)
        probs.rows[rr[(size_t)t * K + lane]] = probs.dense[(size_t)t * E + probs.topk[(size_t)t * K + lane]];
    };
    if constexpr (kBatch == 0) {
      for (int t = begin + warp; t < end; t += WARPS) expand(t);
    } else {
      for (;;) {
        int t0 = 0;
        if (lane == 0) t0 = atomicAdd(next, kBatch);
        t0 = __shfl_sync(0xffffffffu, t0, 0);
        if (t0 >= T) break;
        for (int t = t0; t < min(T, t0 + kBatch); ++t) expand(t);
      }
    }
    if (cta_ns != nullptr) {  // this CTA's start and end on the global clock
      __syncthreads();
      if (threadIdx.x == 0) {
        unsigned long long t_end;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_end));
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        cta_ns[3 * blockIdx.x] = t_start;
        cta_ns[3 * blockIdx.x + 1] = t_end;
        cta_ns[3 * blockIdx.x + 2] = smid;
      }
    }
  } else {
    int t = begin + warp, g = 0;
    if (t >= end) return;
    uint4 cur[UU], nxt[UU];
    int rows[K], next_rows[K];
    load(cur, t, 0);
    rows_of(rows, t);
    while (t < end) {
      const int tn = g + 1 == kGroups ? t + WARPS : t, gn = g + 1 == kGroups ? 0 : g + 1;
      if (tn < end) {
        load(nxt, tn, gn);
        if (tn != t) rows_of(next_rows, tn);
      }
      store(cur, rows, g);
      if (tn != t) {
#pragma unroll
        for (int k = 0; k < K; ++k) rows[k] = next_rows[k];
      }
#pragma unroll
      for (int u = 0; u < UU; ++u) cur[u] = nxt[u];
      t = tn;
      g = gn;
    }
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// Lane 0 of each warp: a segment of its token into a shared stage by a bulk copy (an mbarrier
// counts its bytes), then one bulk store of the stage per row; ST stages per warp.
template <int W, int SEG, int ST>
__global__ void __launch_bounds__(W * 32, 1) expand_tma(const char* x, char* out, const int* rr, int T) {
  extern __shared__ __align__(128) char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  char* buf = smem + (size_t)warp * ST * SEG;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + (size_t)W * ST * SEG) + warp * ST;
  if (lane != 0) return;
  for (int s = 0; s < ST; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bars[s])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int begin = (int)((long long)T * blockIdx.x / gridDim.x), end = (int)((long long)T * (blockIdx.x + 1) / gridDim.x);
  unsigned it = 0;
  for (int t = begin + warp; t < end; t += W) {
    int rows[K];
#pragma unroll
    for (int k = 0; k < K; ++k) rows[k] = rr[(size_t)t * K + k];
    for (int off = 0; off < ROWB; off += SEG, ++it) {
      const int b = it % ST;
      const uint32_t bytes = min(SEG, ROWB - off), bar = smem_addr(&bars[b]), dst = smem_addr(buf + b * SEG);
      asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(ST - 1) : "memory");  // the stage's stores read it
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(dst), "l"(x + (size_t)t * ROWB + off), "r"(bytes), "r"(bar) : "memory");
      for (uint32_t done = 0; !done;)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(bar), "r"((it / ST) & 1) : "memory");
#pragma unroll
      for (int k = 0; k < K; ++k)
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(out + (size_t)rows[k] * ROWB + off), "r"(dst), "r"(bytes) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// A warp per row of this CTA's range of the output, read from its token.
__global__ void __launch_bounds__(WARPS * 32, 1) expand_rows(const uint4* x, uint4* out, const int* src_of_row, int N) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int begin = (int)((long long)N * blockIdx.x / gridDim.x), end = (int)((long long)N * (blockIdx.x + 1) / gridDim.x);
  for (int r = begin + warp; r < end; r += WARPS) {
    const uint4* src = x + (size_t)src_of_row[r] * UNITS;
    uint4* d = out + (size_t)r * UNITS;
    for (int j0 = lane; j0 < UNITS; j0 += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) if (j0 + 32 * u < UNITS) v[u] = src[j0 + 32 * u];
#pragma unroll
      for (int u = 0; u < U; ++u) if (j0 + 32 * u < UNITS) d[j0 + 32 * u] = v[u];
    }
  }
}

template <typename F>
float time_it(F f, int iters = 10) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) f();
  std::vector<float> ts;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a)); f(); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b)); ts.push_back(ms * 1000);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const int T = argc > 1 ? atoi(argv[1]) : 16384;
  std::vector<int> sm_counts;
  for (int i = 2; i < argc; ++i) sm_counts.push_back(atoi(argv[i]));
  if (sm_counts.empty()) sm_counts = {24, 66, 132};
  const int N = T * K;
  std::mt19937 rng(1234);
  std::vector<int> topk((size_t)T * K), cnt(E, 0), base(E, 0), rr((size_t)T * K), src_of_row(N);
  std::vector<int> perm(E);
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    for (int k = 0; k < K; ++k) {  // a partial shuffle: K distinct experts
      std::swap(perm[k], perm[k + rng() % (E - k)]);
      topk[(size_t)t * K + k] = perm[k];
    }
  }
  for (int i = 0; i < N; ++i) cnt[topk[i]]++;
  for (int e = 1; e < E; ++e) base[e] = base[e - 1] + cnt[e - 1];
  for (int i = 0; i < N; ++i) { rr[i] = base[topk[i]]++; src_of_row[rr[i]] = i / K; }
  int *d_rr, *d_src, *d_topk;
  CK(cudaMalloc(&d_rr, sizeof(int) * N)); CK(cudaMalloc(&d_src, sizeof(int) * N)); CK(cudaMalloc(&d_topk, sizeof(int) * N));
  CK(cudaMemcpy(d_topk, topk.data(), sizeof(int) * N, cudaMemcpyHostToDevice));
  Probs probs{d_topk, nullptr, nullptr};
  CK(cudaMalloc(&probs.dense, sizeof(float) * T * E)); CK(cudaMalloc(&probs.rows, sizeof(float) * N));
  CK(cudaMemset(const_cast<float*>(probs.dense), 0x3c, sizeof(float) * T * E));
  CK(cudaMemcpy(d_rr, rr.data(), sizeof(int) * N, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_src, src_of_row.data(), sizeof(int) * N, cudaMemcpyHostToDevice));
  const size_t x_bytes = (size_t)T * ROWB, out_bytes = (size_t)N * ROWB;
  char *x, *ref, *out;
  CK(cudaMalloc(&x, x_bytes)); CK(cudaMalloc(&ref, out_bytes)); CK(cudaMalloc(&out, out_bytes));
  {
    std::vector<unsigned> hx(x_bytes / 4);
    for (auto& v : hx) v = rng();
    CK(cudaMemcpy(x, hx.data(), x_bytes, cudaMemcpyHostToDevice));
  }
  expand_tokens<true><<<132, WARPS * 32>>>((const uint4*)x, (uint4*)ref, d_rr, T);
  CK(cudaDeviceSynchronize());
  auto same = [&](const char* what) {
    std::vector<char> a(out_bytes), b(out_bytes);
    CK(cudaMemcpy(a.data(), ref, out_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), out, out_bytes, cudaMemcpyDeviceToHost));
    if (memcmp(a.data(), b.data(), out_bytes) != 0) { printf("  %s: MISMATCH\n", what); exit(1); }
  };
  printf("T %d x H %d bf16, top-%d of %d: %d rows, x %.1f MB, rows %.1f MB; GB/s = bytes the "
         "pattern moves at the least (x once + rows) / time\n", T, H, K, E, N, x_bytes / 1e6, out_bytes / 1e6);
  auto report = [&](const char* name, int sms, float us, double bytes) {
    printf("%-28s %4d SMs %9.1f us %7.0f GB/s %6.1f GB/s per SM\n", name, sms, us, bytes / us / 1e3,
           bytes / us / 1e3 / sms);
  };
  const size_t units = out_bytes / 16;
  const double expand_bytes = (double)x_bytes + (double)out_bytes;
  report("cudaMemcpy d2d, rows' bytes", 0, time_it([&] { CK(cudaMemcpyAsync(out, ref, out_bytes, cudaMemcpyDeviceToDevice)); }), 2.0 * out_bytes);
  for (int sms : sm_counts) {
    report("copy, sequential", sms, time_it([&] { copy_seq<<<sms, 512>>>((const uint4*)ref, (uint4*)out, units, 0); }), 2.0 * out_bytes);
    report("write, sequential", sms, time_it([&] { copy_seq<<<sms, 512>>>(nullptr, (uint4*)out, units, 1); }), (double)out_bytes);
    CK(cudaMemset(out, 0x5a, out_bytes));
    report("tokens (the library's)", sms, time_it([&] { expand_tokens<true><<<sms, WARPS * 32>>>((const uint4*)x, (uint4*)out, d_rr, T); }), expand_bytes);
    same("tokens");
    CK(cudaMemset(out, 0x5a, out_bytes));
    report("tokens, with probs", sms, time_it([&] { expand_tokens<true, 4, false, true><<<sms, WARPS * 32>>>((const uint4*)x, (uint4*)out, d_rr, T, probs); }), expand_bytes);
    same("tokens with probs");
    int* d_next;
    CK(cudaMalloc(&d_next, sizeof(int)));
    CK(cudaMemset(out, 0x5a, out_bytes));
    report("tokens, claimed 1 by 1", sms, time_it([&] { CK(cudaMemsetAsync(d_next, 0, sizeof(int))); expand_tokens<true, U, false, false, 1><<<sms, WARPS * 32>>>((const uint4*)x, (uint4*)out, d_rr, T, {}, nullptr, d_next); }), expand_bytes);
    same("tokens claimed 1");
    CK(cudaMemset(out, 0x5a, out_bytes));
    report("tokens, claimed 4 at a time", sms, time_it([&] { CK(cudaMemsetAsync(d_next, 0, sizeof(int))); expand_tokens<true, U, false, false, 4><<<sms, WARPS * 32>>>((const uint4*)x, (uint4*)out, d_rr, T, {}, nullptr, d_next); }), expand_bytes);
    same("tokens claimed 4");
    CK(cudaFree(d_next));
    {  // one more run of the library's order, each CTA's span on the global clock
      unsigned long long* d_ns;
      std::vector<unsigned long long> ns(3 * sms);
      CK(cudaMalloc(&d_ns, sizeof(unsigned long long) * 3 * sms));
      expand_tokens<true><<<sms, WARPS * 32>>>((const uint4*)x, (uint4*)out, d_rr, T, {}, d_ns);
      CK(cudaMemcpy(ns.data(), d_ns, sizeof(unsigned long long) * 3 * sms, cudaMemcpyDeviceToHost));
      CK(cudaFree(d_ns));
      unsigned long long first = ~0ull, last = 0;
      std::vector<double> span(sms);
      for (int b = 0; b < sms; ++b) {
        first = std::min(first, ns[3 * b]);
        last = std::max(last, ns[3 * b + 1]);
        span[b] = (ns[3 * b + 1] - ns[3 * b]) / 1e3;
      }
      std::vector<double> sorted = span;
      std::sort(sorted.begin(), sorted.end());
      printf("  CTA spans (library's order): min %.1f median %.1f max %.1f us; first start to last end %.1f us; "
             "slowest CTAs (SM):", sorted[0], sorted[sms / 2], sorted[sms - 1], (last - first) / 1e3);
      std::vector<int> order(sms);
      for (int b = 0; b < sms; ++b) order[b] = b;
      std::sort(order.begin(), order.end(), [&](int a, int b) { return span[a] > span[b]; });
      for (int i = 0; i < std::min(sms, 8); ++i) printf(" %d (SM %llu, %.0f)", order[i], ns[3 * order[i] + 2], span[order[i]]);
      printf("; fastest:");
      for (int i = std::max(0, sms - 4); i < sms; ++i) printf(" %d (SM %llu, %.0f)", order[i], ns[3 * order[i] + 2], span[order[i]]);
      printf("\n");
    }
    report("tokens, 8 packs in flight", sms, time_it([&] { expand_tokens<true, 8><<<sms, WARPS * 32>>>((const uint4*)x, (uint4*)out, d_rr, T); }), expand_bytes);
    same("tokens 8");
    CK(cudaMemset(out, 0x5a, out_bytes));
    report("tokens, 4 + next 4 loading", sms, time_it([&] { expand_tokens<true, 4, true><<<sms, WARPS * 32>>>((const uint4*)x, (uint4*)out, d_rr, T); }), expand_bytes);
    same("tokens pipelined");
#define EXPAND_TMA(W_, SEG_, ST_) { auto k = expand_tma<W_, SEG_, ST_>; const int smem = W_ * ST_ * SEG_ + W_ * ST_ * 8; \
      CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); CK(cudaMemset(out, 0x5a, out_bytes)); \
      report("tokens, bulk copies " #W_ "w " #ST_ "x" #SEG_, sms, time_it([&] { k<<<sms, W_ * 32, smem>>>(x, out, d_rr, T); }), expand_bytes); same("tokens, bulk copies"); }
    EXPAND_TMA(16, 4096, 3) EXPAND_TMA(8, 14336, 2)
    report("tokens, no x (writes only)", sms, time_it([&] { expand_tokens<false><<<sms, WARPS * 32>>>((const uint4*)x, (uint4*)out, d_rr, T); }), (double)out_bytes);
    CK(cudaMemset(out, 0x5a, out_bytes));
    report("rows (x gathered)", sms, time_it([&] { expand_rows<<<sms, WARPS * 32>>>((const uint4*)x, (uint4*)out, d_src, N); }), expand_bytes);
    same("rows");
  }
  printf("every expansion bitwise equal to the first\n");
  return 0;
}
