/*
 * device.cuh: device-side building blocks shared by the kernels: system-scope release/acquire
 * flags, the error word protocol, the global timer, element packs, float conversions and warp
 * copies.
 *
 * NOTES:
 *  - Peer memory is reached through plain pointers resolved once at group creation (barrier.cu),
 *    so loads/stores below are ordinary global accesses that travel over NVLink when remote.
 *  - Arithmetic helpers never fuse or reorder: sums are written as acc = acc + v, starting from
 *    +0.0f, in the order of the design's combine. The build never uses --use_fast_math.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>
#include <stdint.h>

#include <type_traits>

#include "protocol.cuh"

// Developer builds with device timers (NCCL_EP_TRACE=1 python setup.py build_ext --force): the
// exchange engine's per-role times and the token sums' phases, printed per op (exchange.cuh).
// Off: compiled out.
#ifndef EP_TRACE
#define EP_TRACE 0
#endif

namespace nccl_ep {

#define EP_DEVICE __device__ __forceinline__

constexpr bool kTrace = EP_TRACE != 0;

// EP_TRACE builds: where an op's warps spend their items, in SM cycles summed over a CTA's warps
// (shared memory): finding the item's sources, issuing its bulk copies, waiting for them, and
// the arithmetic with its stores.
enum ItemPhase { kPhaseSetup, kPhaseFill, kPhaseWait, kPhaseWork, kItemPhases };
struct ItemTimers {
  unsigned long long cycles[kItemPhases];
  unsigned items, segments;
};

__device__ __forceinline__ unsigned long long sm_cycles() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
  return t;
}

// Lane 0's stopwatch over a warp's phases; does nothing without EP_TRACE or timers.
struct PhaseClock {
  ItemTimers* timers = nullptr;
  unsigned long long last = 0;
  __device__ __forceinline__ PhaseClock(ItemTimers* t, int lane) {
    if (kTrace && lane == 0 && t != nullptr) {
      timers = t;
      last = sm_cycles();
    }
  }
  // Charges the time since the last lap to phase p.
  __device__ __forceinline__ void lap(ItemPhase p) {
    if (!kTrace || timers == nullptr) return;
    const unsigned long long now = sm_cycles();
    atomicAdd(&timers->cycles[p], now - last);
    last = now;
  }
  __device__ __forceinline__ void restart() {
    if (kTrace && timers != nullptr) last = sm_cycles();
  }
  // Counts one item / one segment.
  __device__ __forceinline__ void count_item() {
    if (kTrace && timers != nullptr) atomicAdd(&timers->items, 1u);
  }
  __device__ __forceinline__ void count_segment() {
    if (kTrace && timers != nullptr) atomicAdd(&timers->segments, 1u);
  }
};

EP_DEVICE void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

EP_DEVICE unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

EP_DEVICE void red_add_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Relaxed (ordering nothing else) but strong at system scope: polled words that carry their
// own validity (an epoch), and counts that no data read depends on.
EP_DEVICE void st_relaxed_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

EP_DEVICE unsigned long long ld_relaxed_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

EP_DEVICE void red_add_relaxed_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

EP_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

EP_DEVICE unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

EP_DEVICE int ld_volatile_int(const int* p) { return *(const volatile int*)p; }
EP_DEVICE unsigned long long ld_volatile_u64(const unsigned long long* p) {
  return *(const volatile unsigned long long*)p;
}

// Named barrier over `threads` (a multiple of 32) of the CTA; id 0 is __syncthreads.
EP_DEVICE void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// One writer per error word (claim), fields first, code last.
EP_DEVICE void raise_error(ErrorInfo* e, int code, int rank, int token, int slot,
                           long long value, long long extra, int aux = 0, long long where = -1) {
  if (atomicCAS(&e->claim, 0, 1) != 0) return;
  e->rank = rank;
  e->aux = aux;
  e->token = token;
  e->slot = slot;
  e->value = value;
  e->extra = extra;
  e->where = where;
  __threadfence_system();
  atomicExch(&e->code, code);
  __threadfence_system();
}

// Marks the group failed (origin = the rank whose error stopped it, + 1) and tells every peer,
// whose waits then stop and report it: errors are sticky and global.
EP_DEVICE void stop_group(void* const* peers, size_t sync_off, int num_ranks,
                          unsigned long long* failed, unsigned long long origin) {
  atomicCAS(failed, 0ull, origin);
  for (int p = 0; p < num_ranks; ++p) {
    st_release_sys(reinterpret_cast<unsigned long long*>(
                       reinterpret_cast<char*>(peers[p]) + sync_off) + kAbortSlot,
                   origin);
  }
}

// Bulk copies (TMA) from global into shared memory, completed through an mbarrier: the copies'
// bytes are in flight without registers, so a warp can keep many KiB of rows loading while it sums.
EP_DEVICE unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

EP_DEVICE void mbar_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives (the one expected arrival) and expects `bytes` of bulk copies in this phase.
EP_DEVICE void mbar_expect_bytes(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

EP_DEVICE void mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
}

// Order this thread's earlier generic-proxy accesses before its later bulk copies: its warp's
// reads of a shared buffer about to be refilled (shared), the data of peers it acquired through
// a flag (global: once per round, it waits for the thread's outstanding global accesses).
EP_DEVICE void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
EP_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// bytes (a multiple of 16, both addresses 16-byte aligned) from global src into shared dst.
EP_DEVICE void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
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

// acc[q] = acc[q] + float(v[q]) for every element of a pack: one add per element, as the chain
// of the design's section 4 needs. bf16 pairs are read as 32-bit words: the low element shifted
// up, the high one masked in place, one instruction each (exact; element by element the compiler
// extracts each half first, which costs more instructions per pack summed).
template <typename T, int N>
EP_DEVICE void accumulate(float (&acc)[N], const Pack<T, N>& v) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value && N % 2 == 0) {
    const unsigned* w = reinterpret_cast<const unsigned*>(&v);
#pragma unroll
    for (int q = 0; q < N / 2; ++q) {
      acc[2 * q] = acc[2 * q] + __uint_as_float(w[q] << 16);
      acc[2 * q + 1] = acc[2 * q + 1] + __uint_as_float(w[q] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int q = 0; q < N; ++q) acc[q] = acc[q] + to_float<T>(v.v[q]);
  }
}

// Round to nearest even into the token dtype.
template <typename T>
EP_DEVICE T from_float(float v);
template <>
EP_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
EP_DEVICE __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
EP_DEVICE float from_float<float>(float v) { return v; }

// The pack of v's elements, each rounded to nearest even into T (bf16 pairs: one packed
// conversion each).
template <typename T, int N>
EP_DEVICE Pack<T, N> round_pack(const float (&v)[N]) {
  Pack<T, N> r;
#pragma unroll
  for (int q = 0; q < N; ++q) r.v[q] = from_float<T>(v[q]);
  return r;
}

// Copies `units` U-sized elements from src to the n destinations dst_of(0 .. n) with one warp:
// kUnroll loads in flight per lane, each value stored to every destination.
template <typename U, int kUnroll = 4, typename DstOf>
EP_DEVICE void warp_copy_rows(const void* src, int units, int lane, int n, DstOf dst_of) {
  const U* s = reinterpret_cast<const U*>(src);
  for (int j0 = lane; j0 < units; j0 += 32 * kUnroll) {
    U v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (j0 + 32 * u < units) v[u] = s[j0 + 32 * u];
    for (int k = 0; k < n; ++k) {
      U* d = reinterpret_cast<U*>(dst_of(k));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (j0 + 32 * u < units) d[j0 + 32 * u] = v[u];
    }
  }
}

template <typename U>
EP_DEVICE void warp_zero(void* dst, int units, int lane) {
  U* d = reinterpret_cast<U*>(dst);
  U z;
  memset(&z, 0, sizeof(U));
  for (int i = lane; i < units; i += 32) d[i] = z;
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

// The rank of expert e among num_ranks ranks whose first expert is expert_base (a node's ranks;
// 0 on one node), or -1 when e is masked or on no such rank.
EP_DEVICE int rank_of_expert(int e, int expert_base, int num_local, int num_ranks) {
  const int rel = e - expert_base;
  const int d = e >= 0 && rel >= 0 ? rel / num_local : -1;
  return d < num_ranks ? d : -1;
}

// Destination ranks of one token (bit d set: the token has a slot on rank d), from its routing
// row: lane k reads slot k (one load per lane, not a chain of topk dependent loads), 32 slots a
// pass (a routing-map row may name more experts than a warp has lanes); warp-wide, every lane
// gets the mask.
EP_DEVICE unsigned long long dest_mask(const int* routing_row, int topk, int expert_base,
                                       int num_local, int num_ranks, int lane) {
  unsigned lo = 0, hi = 0;
  for (int k0 = 0; k0 < topk; k0 += 32) {
    const int e = k0 + lane < topk ? routing_row[k0 + lane] : -1;
    const int d = rank_of_expert(e, expert_base, num_local, num_ranks);
    const bool ok = d >= 0;
    lo |= __reduce_or_sync(0xffffffffu, ok && d < 32 ? 1u << d : 0u);
    hi |= __reduce_or_sync(0xffffffffu, ok && d >= 32 ? 1u << (d - 32) : 0u);
  }
  return ((unsigned long long)hi << 32) | lo;
}

// Token element size: 2 for bf16/fp16, 4 for fp32 (the only token dtypes the host accepts).
__host__ __device__ __forceinline__ int elt_bytes(int dtype) {
  return dtype == (int)ncclBfloat16 || dtype == (int)ncclFloat16 ? 2 : 4;
}

}  // namespace nccl_ep
