// host_floor.cu: what the C API costs the host per call, without Python, torch or an allocation:
// the floor under the bench's host section (benchmarks/host.py), measured the same way: the GPU
// held by a spin kernel queued first, the calls of ITERS x REPEATS repeats timed one by one with
// a steady clock, medians printed (us). Beside them, the CUDA runtime's own floor: an empty
// kernel's launch with 8 bytes and with 440 bytes of arguments (an LL dispatch's), and the
// capture query every op makes. Shapes as the host section's: hidden 7168, top-8 of 256 experts,
// bf16, EP=1 over a one-rank NCCL communicator; LL on every SM, HT on 24.
//
//   nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/host_floor benchmarks/micro/host_floor.cu \
//       -Icsrc/include -I<nccl>/include -Lmegatron_nccl_ep -l:libmegatron_nccl_ep.so \
//       -L<nccl>/lib -l:libnccl.so.2 -Xlinker -rpath,$PWD/megatron_nccl_ep:<nccl>/lib
//   /tmp/host_floor        (tests/gpu/run.sh's micro stage builds and runs it)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "nccl_ep.h"

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      printf("CUDA %s at line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_));              \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)
#define EP(x)                                                                                 \
  do {                                                                                        \
    ncclResult_t e_ = (x);                                                                    \
    if (e_ != ncclSuccess) {                                                                  \
      printf("%s at line %d: %s\n", #x, __LINE__, ncclEpGetLastError());                     \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

constexpr int kHidden = 7168, kTopk = 8, kExperts = 256, kIters = 40, kRepeats = 8;
constexpr long long kHoldNs = 4000000;  // longer than one iteration's calls

__global__ void hold(long long ns) {
  long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}
struct Args440 {
  char bytes[440];
};
__global__ void empty8(long long) {}
__global__ void empty440(Args440) {}

using Clock = std::chrono::steady_clock;
struct Timer {  // host microseconds per named call, over the timed repeats
  std::vector<std::pair<std::string, std::vector<double>>> rows;
  void add(const std::string& name, double us) {
    for (auto& r : rows)
      if (r.first == name) return r.second.push_back(us);
    rows.push_back({name, {us}});
  }
  template <class F>
  void time(const std::string& name, F&& f) {
    const auto t0 = Clock::now();
    f();
    add(name, std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  void print(const char* prefix) {
    for (auto& r : rows) {
      std::sort(r.second.begin(), r.second.end());
      const size_t n = r.second.size();
      printf("%-34s %-16s %7.2f  (p10 %.2f, p90 %.2f; %zu calls)\n", prefix, r.first.c_str(),
             r.second[n / 2], r.second[n / 10], r.second[n * 9 / 10], n);
    }
    rows.clear();
  }
};

ncclEpTensor_t tensor(void* data, std::initializer_list<long long> sizes, ncclDataType_t dtype,
                      ncclEpTensorTag_t tag) {
  ncclEpTensor_t t{};
  t.data = data;
  t.ndim = (int)sizes.size();
  long long stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.sizes[i] = sizes.begin()[i];
    t.strides[i] = stride;
    stride *= t.sizes[i];
  }
  t.dtype = dtype;
  t.tag = tag;
  return t;
}

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  CK(cudaMalloc(&p, bytes));
  CK(cudaMemset(p, 0, bytes));
  return p;
}

// topk_idx [T, K] int64 (distinct experts per token) and weights [T, K] fp32 on the device.
void routing(int T, void** idx, void** w) {
  std::mt19937 gen(T);
  std::vector<long long> h_idx((size_t)T * kTopk);
  std::vector<float> h_w((size_t)T * kTopk, 1.f / kTopk);
  std::vector<int> experts(kExperts);
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < kExperts; ++e) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), gen);
    for (int k = 0; k < kTopk; ++k) h_idx[(size_t)t * kTopk + k] = experts[k];
  }
  *idx = device_alloc(h_idx.size() * 8);
  *w = device_alloc(h_w.size() * 4);
  CK(cudaMemcpy(*idx, h_idx.data(), h_idx.size() * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(*w, h_w.data(), h_w.size() * 4, cudaMemcpyHostToDevice));
}

// Runs `repeat(timer, made)` kIters x kRepeats times (after 4 iterations of warm-up), each
// iteration under one hold of the GPU, then destroys the handles it `made` with the GPU idle.
// The first repeat of an iteration follows a synchronize: it is not counted (the bench's
// "(host, first)").
template <class Repeat>
void measure(Timer& timer, cudaStream_t s, Repeat&& repeat) {
  std::vector<ncclEpHandle_t> made;
  for (int i = 0; i < 4 + kIters; ++i) {
    CK(cudaStreamSynchronize(s));
    hold<<<1, 1, 0, s>>>(kHoldNs);
    for (int r = 0; r < kRepeats; ++r) {
      Timer scratch;
      repeat(i >= 4 && r > 0 ? timer : scratch, made);
    }
    CK(cudaStreamSynchronize(s));
    for (ncclEpHandle_t h : made) EP(ncclEpHandleDestroy(h));
    made.clear();
  }
}

ncclEpGroup_t make_group(ncclComm_t comm, cudaStream_t s, ncclEpMode_t mode, int tokens,
                         int num_sms, long long capacity) {
  ncclEpGroupConfig_t c = NCCL_EP_GROUP_CONFIG_INITIALIZER;
  c.mode = mode;
  c.num_experts = kExperts;
  c.hidden = kHidden;
  c.max_tokens_per_rank = tokens;
  c.max_topk = kTopk;
  c.token_dtype = ncclBfloat16;
  c.num_sms = num_sms;
  if (mode == ncclEpModeLowLatency) c.layout = ncclEpLayoutRankMajor;
  if (capacity > 0) {
    c.recv_count_mode = ncclEpRecvCountCapacity;
    c.max_recv_tokens_per_rank = capacity;
  }
  ncclEpGroup_t g = nullptr;
  EP(ncclEpCreateGroup(&g, comm, &c, s));
  return g;
}

void ll(ncclComm_t comm, cudaStream_t s, int T, int sms) {
  ncclEpGroup_t g = make_group(comm, s, ncclEpModeLowLatency, T, sms, 0);
  void *idx, *w;
  routing(T, &idx, &w);
  const long long RT = T;  // one rank: R x T_max rows
  void* x = device_alloc((size_t)T * kHidden * 2);
  void* recv_x = device_alloc((size_t)RT * kHidden * 2);
  void* count = device_alloc(256);
  void* recv_idx = device_alloc((size_t)RT * kTopk * 4);
  void* recv_w = device_alloc((size_t)RT * kTopk * 4);
  void* y = device_alloc((size_t)T * kHidden * 2);
  const ncclEpTensor_t routing_t = tensor(idx, {T, kTopk}, ncclInt64, NCCL_EP_TENSOR_TOPK_IDX);
  ncclEpDispatchInputs_t din{};
  din.tokens = tensor(x, {T, kHidden}, ncclBfloat16, NCCL_EP_TENSOR_TOKENS);
  din.topk_weights = tensor(w, {T, kTopk}, ncclFloat32, NCCL_EP_TENSOR_TOPK_WEIGHTS);
  ncclEpDispatchOutputs_t dout{};
  dout.recv_tokens = tensor(recv_x, {RT, kHidden}, ncclBfloat16, NCCL_EP_TENSOR_TOKENS);
  dout.recv_count = tensor(count, {1}, ncclInt32, NCCL_EP_TENSOR_RECV_COUNT);
  dout.recv_topk_idx = tensor(recv_idx, {RT, kTopk}, ncclInt32, NCCL_EP_TENSOR_TOPK_IDX);
  dout.recv_topk_weights = tensor(recv_w, {RT, kTopk}, ncclFloat32, NCCL_EP_TENSOR_TOPK_WEIGHTS);
  ncclEpCombineInputs_t cin{};
  cin.expert_tokens = dout.recv_tokens;
  ncclEpCombineOutputs_t cout{};
  cout.tokens = tensor(y, {T, kHidden}, ncclBfloat16, NCCL_EP_TENSOR_TOKENS);
  Timer timer;
  measure(timer, s, [&](Timer& t, std::vector<ncclEpHandle_t>& made) {
    ncclEpHandle_t h = nullptr;
    t.time("handle", [&] { EP(ncclEpCreateHandle(&h, g, &routing_t, nullptr, s)); });
    made.push_back(h);
    t.time("dispatch", [&] { EP(ncclEpDispatch(h, &din, &dout, nullptr, s)); });
    t.time("combine", [&] { EP(ncclEpCombine(h, &cin, &cout, nullptr, s)); });
  });
  timer.print(("LL T=" + std::to_string(T) + " rank-major").c_str());
  EP(ncclEpGroupDestroy(g));
  for (void* p : {idx, w, x, recv_x, count, recv_idx, recv_w, y}) CK(cudaFree(p));
}

// HT: exact mode's count read (it waits for the GPU) runs untimed between handle and dispatch.
void ht(ncclComm_t comm, cudaStream_t s, int T, bool capacity) {
  const long long rows = (long long)T * kTopk;
  ncclEpGroup_t g = make_group(comm, s, ncclEpModeHighThroughput, T, 24, capacity ? rows : 0);
  void *idx, *w;
  routing(T, &idx, &w);
  void* x = device_alloc((size_t)T * kHidden * 2);
  void* recv_x = device_alloc((size_t)rows * kHidden * 2);
  void* recv_w = device_alloc((size_t)rows * 4);
  void* y = device_alloc((size_t)T * kHidden * 2);
  const ncclEpTensor_t routing_t = tensor(idx, {T, kTopk}, ncclInt64, NCCL_EP_TENSOR_TOPK_IDX);
  ncclEpDispatchInputs_t din{};
  din.tokens = tensor(x, {T, kHidden}, ncclBfloat16, NCCL_EP_TENSOR_TOKENS);
  din.topk_weights = tensor(w, {T, kTopk}, ncclFloat32, NCCL_EP_TENSOR_TOPK_WEIGHTS);
  Timer timer;
  measure(timer, s, [&](Timer& t, std::vector<ncclEpHandle_t>& made) {
    ncclEpHandle_t h = nullptr;
    t.time("handle", [&] { EP(ncclEpCreateHandle(&h, g, &routing_t, nullptr, s)); });
    made.push_back(h);
    int64_t n = 0;
    EP(ncclEpHandleGetNumRecvTokens(h, &n));  // exact mode: waits for the layout
    ncclEpDispatchOutputs_t dout{};
    dout.recv_tokens = tensor(recv_x, {n, kHidden}, ncclBfloat16, NCCL_EP_TENSOR_TOKENS);
    dout.recv_topk_weights = tensor(recv_w, {n}, ncclFloat32, NCCL_EP_TENSOR_TOPK_WEIGHTS);
    ncclEpCombineInputs_t cin{};
    cin.expert_tokens = dout.recv_tokens;
    ncclEpCombineOutputs_t cout{};
    cout.tokens = tensor(y, {T, kHidden}, ncclBfloat16, NCCL_EP_TENSOR_TOKENS);
    hold<<<1, 1, 0, s>>>(kHoldNs / kRepeats);  // the read waited for the GPU: hold it again
    t.time("dispatch", [&] { EP(ncclEpDispatch(h, &din, &dout, nullptr, s)); });
    t.time("combine", [&] { EP(ncclEpCombine(h, &cin, &cout, nullptr, s)); });
  });
  timer.print(("HT T=" + std::to_string(T) + (capacity ? " capacity" : " exact")).c_str());
  EP(ncclEpGroupDestroy(g));
  for (void* p : {idx, w, x, recv_x, recv_w, y}) CK(cudaFree(p));
}

int main() {
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("# %s, %d SMs; host us per call, the GPU held (median over %d x %d calls)\n", prop.name,
         prop.multiProcessorCount, kIters, kRepeats - 1);
  cudaStream_t s = 0;  // the legacy default stream: torch's current stream unless set
  Timer timer;
  Args440 big{};
  measure(timer, s, [&](Timer& t, std::vector<ncclEpHandle_t>&) {
    const int sms = prop.multiProcessorCount;
    t.time("empty kernel, 8 B of args", [&] { empty8<<<sms, 512, 0, s>>>(0); });
    t.time("empty kernel, 440 B of args", [&] { empty440<<<sms, 512, 0, s>>>(big); });
    cudaStreamCaptureStatus st;
    unsigned long long capture_id = 0;
    cudaGraph_t graph = nullptr;
    t.time("cudaStreamGetCaptureInfo",
           [&] { CK(cudaStreamGetCaptureInfo(s, &st, &capture_id, &graph)); });
    t.time("cudaGetLastError", [&] { CK(cudaGetLastError()); });
  });
  timer.print("runtime");
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) return 1;
  ncclComm_t comm = nullptr;
  if (ncclCommInitRank(&comm, 1, id, 0) != ncclSuccess) return 1;
  ll(comm, s, 128, prop.multiProcessorCount);
  ll(comm, s, 1, prop.multiProcessorCount);
  ht(comm, s, 4096, false);
  ht(comm, s, 128, true);
  ncclCommDestroy(comm);
  return 0;
}
