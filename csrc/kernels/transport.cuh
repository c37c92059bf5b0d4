/*
 * transport.cuh: device-side building blocks shared by the kernels: system-scope release/acquire
 * flags, the error word protocol, the global timer, element packs and float conversions.
 *
 * NOTES:
 *  - Peer memory is reached through plain pointers resolved once at group creation (runtime.cu),
 *    so loads/stores below are ordinary global accesses that travel over NVLink when remote.
 *  - Arithmetic helpers never fuse or reorder: sums are written as acc = acc + v, starting from
 *    +0.0f, in the order of DESIGN §4. The build never uses --use_fast_math.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>
#include <stdint.h>

#include "api.cuh"

namespace nccl_ep {

#define EP_DEVICE __device__ __forceinline__

// Every dispatch/combine kernel: 512 threads, one warp per item, at most num_sms CTAs.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// Work items of one chunk: own tokens (push and gather side) and staged (s, t) pairs (receive
// side, every source rank's slice of the staging).
__host__ __device__ inline long long chunk_own_tokens(const ExchangeArgs& e) {
  const long long n = (long long)e.num_tokens - e.c0;
  return n < 0 ? 0 : (n > e.chunk ? e.chunk : n);
}
__host__ __device__ inline long long chunk_staged_items(const ExchangeArgs& e) {
  return (long long)e.num_ranks * e.chunk;
}

inline int grid_for(long long warp_items, int num_sms) {
  long long blocks = (warp_items + kWarps - 1) / kWarps;
  if (blocks > num_sms) blocks = num_sms;
  return (int)blocks;
}

EP_DEVICE void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

EP_DEVICE unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

EP_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

EP_DEVICE unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

EP_DEVICE int ld_volatile_int(const int* p) { return *(const volatile int*)p; }

// One writer per error word (claim), fields first, code last.
EP_DEVICE void raise_error(ErrorInfo* e, int code, int rank, int token, int slot,
                           long long value, long long extra, int aux = 0) {
  if (atomicCAS(&e->claim, 0, 1) != 0) return;
  e->rank = rank;
  e->aux = aux;
  e->token = token;
  e->slot = slot;
  e->value = value;
  e->extra = extra;
  __threadfence_system();
  atomicExch(&e->code, code);
  __threadfence_system();
}

// True (in every thread of the block) when an earlier barrier found the group failed: push
// kernels then write nothing into peers, whose staging the barriers no longer protect.
EP_DEVICE bool group_failed(const unsigned long long* failed_word) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = *(const volatile unsigned long long*)failed_word != 0;
  __syncthreads();
  return failed != 0;
}

// A vector of N elements of T moved as one aligned access (16 bytes on the vector path).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T>
EP_DEVICE float to_float(T v);
template <>
EP_DEVICE float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  // Exact (bf16 is the top half of a float); as bit moves it costs no extra registers per element.
  return __uint_as_float((unsigned)__bfloat16_as_ushort(v) << 16);
}
template <>
EP_DEVICE float to_float<__half>(__half v) { return __half2float(v); }
template <>
EP_DEVICE float to_float<float>(float v) { return v; }

// Round to nearest even into the token dtype.
template <typename T>
EP_DEVICE T from_float(float v);
template <>
EP_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
EP_DEVICE __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
EP_DEVICE float from_float<float>(float v) { return v; }

// Copies `bytes` (a multiple of sizeof(U)) from src to dst with one warp, U-sized accesses,
// 4 loads in flight per lane before the stores.
template <typename U>
EP_DEVICE void warp_copy(void* dst, const void* src, int bytes, int lane) {
  const int n = bytes / (int)sizeof(U);
  const U* s = reinterpret_cast<const U*>(src);
  U* d = reinterpret_cast<U*>(dst);
  constexpr int kUnroll = 4;
  int i = lane;
  for (; i + 32 * (kUnroll - 1) < n; i += 32 * kUnroll) {
    U r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = s[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + 32 * u] = r[u];
  }
  for (; i < n; i += 32) d[i] = s[i];
}

template <typename U>
EP_DEVICE void warp_zero(void* dst, int bytes, int lane) {
  const int n = bytes / (int)sizeof(U);
  U* d = reinterpret_cast<U*>(dst);
  U z;
  memset(&z, 0, sizeof(U));
  for (int i = lane; i < n; i += 32) d[i] = z;
}

// Copies one probability of 2, 4 or 8 bytes.
EP_DEVICE void copy_prob(void* dst, const void* src, int bytes) {
  if (bytes == 8) {
    *reinterpret_cast<unsigned long long*>(dst) = *reinterpret_cast<const unsigned long long*>(src);
  } else if (bytes == 4) {
    *reinterpret_cast<unsigned int*>(dst) = *reinterpret_cast<const unsigned int*>(src);
  } else {
    *reinterpret_cast<unsigned short*>(dst) = *reinterpret_cast<const unsigned short*>(src);
  }
}

EP_DEVICE void zero_prob(void* dst, int bytes) {
  if (bytes == 8) {
    *reinterpret_cast<unsigned long long*>(dst) = 0ull;
  } else if (bytes == 4) {
    *reinterpret_cast<unsigned int*>(dst) = 0u;
  } else {
    *reinterpret_cast<unsigned short*>(dst) = 0;
  }
}

// Destination ranks of one token (bit d set: the token has a slot on rank d), from its routing
// row; every lane computes the same mask.
EP_DEVICE unsigned long long dest_mask(const int* routing_row, int topk, int num_local,
                                       int num_ranks) {
  unsigned long long m = 0;
  for (int k = 0; k < topk; ++k) {
    int e = routing_row[k];
    if (e >= 0) {
      int d = e / num_local;
      if (d < num_ranks) m |= 1ull << d;
    }
  }
  return m;
}

// Token element size: 2 for bf16/fp16, 4 for fp32 (the only token dtypes the host accepts).
__host__ __device__ __forceinline__ int elt_bytes(int dtype) {
  return dtype == (int)ncclBfloat16 || dtype == (int)ncclFloat16 ? 2 : 4;
}

// Staged item i of a chunk -> (source rank s, token t); false when rank s has no token t (a
// record whose shape is out of bounds has none, as in layout.cu).
EP_DEVICE bool staged_token(const ExchangeArgs& e, long long i, int* s, int* t) {
  *s = (int)(i / e.chunk);
  *t = e.c0 + (int)(i % e.chunk);
  const int* header = e.gathered + (size_t)*s * e.rec_ints;
  const int ts = header[0], ks = header[1];
  return ts <= e.max_tokens && ks >= 1 && ks <= e.max_topk && *t < ts;
}

// The slot rows of staged token (s, t) on this rank: recv_row[s][t][0 .. max_topk).
EP_DEVICE const int* staged_rows(const ExchangeArgs& e, int s, int t) {
  return e.recv_row + ((size_t)s * e.max_tokens + t) * e.max_topk;
}

// The rows here of staged token (s, t), compacted in ascending k into rows_out[] (and their
// slots k into slots_out[] when given), skipping rows past the output (capacity overflow,
// already reported). Returns how many, or -1 when (s, t) has no slot here at all. Warp-wide.
EP_DEVICE int collect_rows(const ExchangeArgs& e, int s, int t, int lane, int* rows_out,
                           int* slots_out) {
  const int row = lane < e.topk ? staged_rows(e, s, t)[lane] : -1;
  if (__ballot_sync(0xffffffffu, row >= 0) == 0) return -1;
  const unsigned usable = __ballot_sync(0xffffffffu, row >= 0 && row < e.rows);
  if ((usable >> lane) & 1u) {
    const int j = __popc(usable & ((1u << lane) - 1u));
    rows_out[j] = row;
    if (slots_out != nullptr) slots_out[j] = lane;
  }
  __syncwarp();
  return __popc(usable);
}

EP_DEVICE char* stage_row(void* base, size_t tok_off, size_t stage_row_bytes, long long index) {
  return reinterpret_cast<char*>(base) + tok_off + (size_t)index * stage_row_bytes;
}

EP_DEVICE char* stage_prob(void* base, size_t prob_off, long long index) {
  return reinterpret_cast<char*>(base) + prob_off + (size_t)index * 8;
}

}  // namespace nccl_ep
