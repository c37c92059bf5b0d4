// peer_ceilings.cu: what N SMs of each of 2 GPUs can move, locally and over NVLink, with register
// loads/stores (4 or 8 x 16 B in flight per thread) and with TMA bulk copies (one thread per CTA,
// 4 stages of 48 KiB). Standalone (not part of the library). Both GPUs run the same kernel at once
// (the remote cases: each GPU writes to / reads from the other, as in an all-to-all); 256 MiB per
// case, mean of 3 timed runs after one warm-up, the slower GPU counts.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/peer_ceilings \
//       benchmarks/micro/peer_ceilings.cu && /tmp/peer_ceilings
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

template <int U>
__global__ void __launch_bounds__(512, 1) copy_regs(const uint4* src, uint4* dst, size_t n, int write_only) {
  size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = tid; i < n; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      size_t j = i + u * stride;
      if (write_only) v[u] = make_uint4(j, 1, 2, 3);
      else if (j < n) v[u] = src[j];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) { size_t j = i + u * stride; if (j < n) dst[j] = v[u]; }
  }
}

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// One thread per CTA drives a ring of S stages of C bytes: TMA bulk load -> smem -> TMA bulk store.
// write_only: the stage is loaded once and stored repeatedly (the dispatch expansion pattern).
template <int S>
__global__ void __launch_bounds__(32, 1) copy_tma(const char* src, char* dst, size_t bytes, int C, int write_only) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) unsigned long long mbar[S];
  const size_t chunks = bytes / C;
  if (threadIdx.x != 0) return;
  for (int s = 0; s < S; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&mbar[s])));
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  auto load = [&](size_t c, int s) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&mbar[s])), "r"(C) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(smem + (size_t)s * C)), "l"(src + c * C), "r"(C), "r"(smem_u32(&mbar[s])) : "memory");
  };
  auto wait = [&](int s, unsigned phase) {
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(smem_u32(&mbar[s])), "r"(phase) : "memory");
  };
  size_t mine = 0;
  for (size_t c = blockIdx.x; c < chunks; c += gridDim.x) ++mine;
  if (write_only) {
    load(blockIdx.x % chunks, 0); wait(0, 0);
    for (size_t k = 0, c = blockIdx.x; k < mine; ++k, c += gridDim.x) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + c * C), "r"(smem_u32(smem)), "r"(C) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 8;" ::: "memory");
    }
  } else {
    for (size_t k = 0; k < mine && k < S; ++k) load(blockIdx.x + k * gridDim.x, (int)k);
    for (size_t k = 0; k < mine; ++k) {
      const int s = (int)(k % S);
      wait(s, (unsigned)((k / S) & 1));
      const size_t c = blockIdx.x + k * gridDim.x;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + c * C), "r"(smem_u32(smem + (size_t)s * C)), "r"(C) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      if (k + S < mine) load(blockIdx.x + (k + S) * gridDim.x, s);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main(int argc, char** argv) {
  const size_t bytes = 256ull << 20;
  char *buf[2][2];
  cudaStream_t st[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CK(cudaMalloc(&buf[d][0], bytes)); CK(cudaMalloc(&buf[d][1], bytes));
    CK(cudaMemset(buf[d][0], 1, bytes)); CK(cudaMemset(buf[d][1], 2, bytes));
    CK(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking));
    CK(cudaFuncSetAttribute(copy_tma<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 49152));
  }
  int sm_list[] = {8, 24, 48, 132};
  const char* names[] = {"local copy", "local write-only", "remote write (push)", "remote write-only", "remote read (pull)"};
  // src, dst per mode (d = this GPU, o = other)
  for (int impl = 0; impl < 3; ++impl) {
    for (int mode = 0; mode < 5; ++mode) {
      for (int sms : sm_list) {
        float ms[2] = {0, 0};
        for (int rep = 0; rep < 4; ++rep) {
          cudaEvent_t a[2], b[2];
          for (int d = 0; d < 2; ++d) {
            CK(cudaSetDevice(d));
            CK(cudaEventCreate(&a[d])); CK(cudaEventCreate(&b[d]));
          }
          for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); }
          for (int d = 0; d < 2; ++d) {
            const int o = 1 - d;
            CK(cudaSetDevice(d));
            const char* src = mode == 4 ? buf[o][0] : buf[d][0];
            char* dst = (mode == 2 || mode == 3) ? buf[o][1] : buf[d][1];
            const int wo = mode == 1 || mode == 3;
            CK(cudaEventRecord(a[d], st[d]));
            if (impl == 0) copy_regs<4><<<sms, 512, 0, st[d]>>>((const uint4*)src, (uint4*)dst, bytes / 16, wo);
            else if (impl == 1) copy_regs<8><<<sms, 512, 0, st[d]>>>((const uint4*)src, (uint4*)dst, bytes / 16, wo);
            else copy_tma<4><<<sms, 32, 4 * 49152, st[d]>>>(src, dst, bytes, 49152, wo);
            CK(cudaGetLastError());
            CK(cudaEventRecord(b[d], st[d]));
          }
          for (int d = 0; d < 2; ++d) {
            CK(cudaSetDevice(d));
            CK(cudaEventSynchronize(b[d]));
            float t; CK(cudaEventElapsedTime(&t, a[d], b[d]));
            if (rep > 0) ms[d] += t / 3;
            CK(cudaEventDestroy(a[d])); CK(cudaEventDestroy(b[d]));
          }
        }
        const double t = ms[0] > ms[1] ? ms[0] : ms[1];
        const char* in = impl == 0 ? "regs x4" : impl == 1 ? "regs x8" : "tma 4x48K";
        printf("P2P %-10s %-22s sms=%3d  %7.1f us  %7.1f GB/s written per GPU  (%5.1f GB/s per SM)\n", in, names[mode], sms,
               t * 1e3, bytes / (t * 1e-3) / 1e9, bytes / (t * 1e-3) / 1e9 / sms);
      }
    }
  }
  return 0;
}
