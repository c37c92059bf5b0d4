/*
 * dispatch_combine.c: the C API on its own (no Python): create a group, make a handle from each
 * rank's routing, dispatch tokens into the expert-major layout, run an identity "expert", and
 * combine them back. With identity experts combine(dispatch(x)) is x times the number of the
 * token's routed experts; the tokens are small integers in float32, so that holds exactly.
 *
 *   dispatch_combine               one rank per visible GPU, over an NCCL communicator
 *   dispatch_combine --local-team N  N ranks on GPU 0 (ncclEpCreateLocalTeam: no NCCL)
 *
 * Build: examples/c_api/build.sh [output], i.e. cc -std=c11 dispatch_combine.c
 *   -I<repo>/csrc/include -I<nccl include> -I<cuda include> -L<repo>/megatron_nccl_ep
 *   -lmegatron_nccl_ep -L<nccl lib> -l:libnccl.so.2 -L<cuda lib> -lcudart_static -ldl -lrt
 *   -lpthread
 * Prints one line per rank and exits non-zero on any failure.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nccl_ep.h"

enum { kTokens = 512, kHidden = 1024, kTopk = 4, kExpertsPerRank = 8, kMaxRanks = 8 };

typedef struct {
  int rank, nranks, device;
  ncclUniqueId id;       /* NCCL mode */
  ncclEpGroup_t group;   /* local-team mode: made by the main thread */
  int failed;
} Rank;

#define CHECK_CUDA(call)                                                              \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      fprintf(stderr, "rank %d: %s: %s\n", r->rank, #call, cudaGetErrorString(e_));  \
      r->failed = 1;                                                                  \
      return NULL;                                                                    \
    }                                                                                 \
  } while (0)

#define CHECK_EP(call)                                                                \
  do {                                                                                \
    ncclResult_t e_ = (call);                                                         \
    if (e_ != ncclSuccess) {                                                          \
      fprintf(stderr, "rank %d: %s: %s\n", r->rank, #call, ncclEpGetLastError());    \
      r->failed = 1;                                                                  \
      return NULL;                                                                    \
    }                                                                                 \
  } while (0)

/* Rank s's routing: kTopk distinct experts per token, from a fixed generator. */
static void routing_of(int s, int num_experts, int64_t* idx) {
  uint64_t state = 0x9e3779b97f4a7c15ull * (uint64_t)(s + 1);
  for (int t = 0; t < kTokens; ++t) {
    for (int k = 0; k < kTopk; ++k) {
      int e, dup;
      do {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        e = (int)((state >> 33) % (uint64_t)num_experts);
        dup = 0;
        for (int j = 0; j < k; ++j) dup |= idx[t * kTopk + j] == e;
      } while (dup);
      idx[t * kTopk + k] = e;
    }
    if (t % 7 == 0) idx[t * kTopk + kTopk - 1] = -1; /* a masked slot now and then */
  }
}

static float token_value(int s, int t, int h) { return (float)((s * 131 + t * 7 + h) % 64 - 32); }

static ncclEpTensor_t tensor2d(void* data, int64_t rows, int64_t cols, ncclDataType_t dtype,
                               ncclEpTensorTag_t tag) {
  ncclEpTensor_t t;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.ndim = 2;
  t.sizes[0] = rows;
  t.sizes[1] = cols;
  t.strides[0] = cols;
  t.strides[1] = 1;
  t.dtype = dtype;
  t.tag = tag;
  return t;
}

static ncclEpGroupConfig_t make_config(int nranks) {
  ncclEpGroupConfig_t cfg = NCCL_EP_GROUP_CONFIG_INITIALIZER;
  cfg.num_experts = kExpertsPerRank * nranks;
  cfg.hidden = kHidden;
  cfg.max_tokens_per_rank = kTokens;
  cfg.max_topk = kTopk;
  cfg.token_dtype = ncclFloat32;
  cfg.num_sms = 16;
  cfg.timeout_ms = 20000;
  return cfg;
}

static void* run_rank(void* arg) {
  Rank* r = (Rank*)arg;
  const int E = kExpertsPerRank * r->nranks;
  CHECK_CUDA(cudaSetDevice(r->device));
  /* NOTES: a local team's ranks wait for each other inside one process: each rank makes its
   * collective calls from its own thread (the team's gate lets every rank's call enqueue before
   * any returns, so what a thread does between its calls cannot block a peer), on its own
   * non-blocking stream. */
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ncclComm_t comm = NULL;
  if (r->group == NULL) { /* one rank per GPU, over NCCL */
    if (ncclCommInitRank(&comm, r->nranks, r->id, r->rank) != ncclSuccess) {
      fprintf(stderr, "rank %d: ncclCommInitRank failed\n", r->rank);
      r->failed = 1;
      return NULL;
    }
    ncclEpGroupConfig_t cfg = make_config(r->nranks);
    CHECK_EP(ncclEpCreateGroup(&r->group, comm, &cfg, stream));
  }
  ncclEpGroupInfo_t info = NCCL_EP_GROUP_INFO_INITIALIZER;
  CHECK_EP(ncclEpGroupGetInfo(r->group, &info));

  /* Inputs on the device. */
  int64_t* idx = (int64_t*)malloc(sizeof(int64_t) * kTokens * kTopk);
  float* x = (float*)malloc(sizeof(float) * kTokens * kHidden);
  routing_of(r->rank, E, idx);
  for (int t = 0; t < kTokens; ++t)
    for (int h = 0; h < kHidden; ++h) x[t * kHidden + h] = token_value(r->rank, t, h);
  int64_t* d_idx;
  float *d_x, *d_y, *d_recv;
  /* At most every token of every rank, once per local expert it routes to. */
  const int64_t max_rows = (int64_t)r->nranks * kTokens *
                           (kTopk < kExpertsPerRank ? kTopk : kExpertsPerRank);
  CHECK_CUDA(cudaMalloc((void**)&d_idx, sizeof(int64_t) * kTokens * kTopk));
  CHECK_CUDA(cudaMalloc((void**)&d_x, sizeof(float) * kTokens * kHidden));
  CHECK_CUDA(cudaMalloc((void**)&d_y, sizeof(float) * kTokens * kHidden));
  CHECK_CUDA(cudaMalloc((void**)&d_recv, sizeof(float) * max_rows * kHidden));
  CHECK_CUDA(cudaMemcpyAsync(d_idx, idx, sizeof(int64_t) * kTokens * kTopk,
                             cudaMemcpyHostToDevice, stream));
  CHECK_CUDA(cudaMemcpyAsync(d_x, x, sizeof(float) * kTokens * kHidden, cudaMemcpyHostToDevice,
                             stream));

  /* Handle: the routing exchange; the receive count is read when asked for. */
  ncclEpHandle_t handle;
  ncclEpTensor_t routing = tensor2d(d_idx, kTokens, kTopk, ncclInt64, NCCL_EP_TENSOR_TOPK_IDX);
  CHECK_EP(ncclEpCreateHandle(&handle, r->group, &routing, NULL, stream));
  int64_t n = 0;
  CHECK_EP(ncclEpHandleGetNumRecvTokens(handle, &n));

  /* Dispatch into the expert-major layout: [n, hidden]. */
  ncclEpDispatchInputs_t din;
  ncclEpDispatchOutputs_t dout;
  memset(&din, 0, sizeof(din));
  memset(&dout, 0, sizeof(dout));
  din.tokens = tensor2d(d_x, kTokens, kHidden, ncclFloat32, NCCL_EP_TENSOR_TOKENS);
  dout.recv_tokens = tensor2d(d_recv, n, kHidden, ncclFloat32, NCCL_EP_TENSOR_TOKENS);
  CHECK_EP(ncclEpDispatch(handle, &din, &dout, NULL, stream));

  /* The identity expert, then combine back to [kTokens, hidden]. */
  ncclEpCombineInputs_t cin;
  ncclEpCombineOutputs_t cout_;
  memset(&cin, 0, sizeof(cin));
  cin.expert_tokens = dout.recv_tokens;
  cout_.tokens = tensor2d(d_y, kTokens, kHidden, ncclFloat32, NCCL_EP_TENSOR_TOKENS);
  CHECK_EP(ncclEpCombine(handle, &cin, &cout_, NULL, stream));
  int64_t tokens_per_expert[kExpertsPerRank];
  ncclEpTensor_t tpe;
  memset(&tpe, 0, sizeof(tpe));
  tpe.data = tokens_per_expert;
  tpe.ndim = 1;
  tpe.sizes[0] = kExpertsPerRank;
  tpe.strides[0] = 1;
  tpe.dtype = ncclInt64;
  tpe.tag = NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_HOST;
  CHECK_EP(ncclEpHandleGetTokensPerExpert(handle, &tpe, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_EP(ncclEpGroupCheckErrors(r->group));

  /* Checks: the rows this rank should receive, and y = (routed experts) x x, exactly. */
  int64_t expected_rows = 0, counted = 0;
  int64_t* other = (int64_t*)malloc(sizeof(int64_t) * kTokens * kTopk);
  for (int s = 0; s < r->nranks; ++s) {
    routing_of(s, E, other);
    for (int i = 0; i < kTokens * kTopk; ++i)
      expected_rows += other[i] >= 0 && other[i] / kExpertsPerRank == r->rank;
  }
  for (int l = 0; l < kExpertsPerRank; ++l) counted += tokens_per_expert[l];
  float* y = (float*)malloc(sizeof(float) * kTokens * kHidden);
  CHECK_CUDA(cudaMemcpyAsync(y, d_y, sizeof(float) * kTokens * kHidden, cudaMemcpyDeviceToHost,
                             stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  long long wrong = 0;
  for (int t = 0; t < kTokens; ++t) {
    int routed = 0;
    for (int k = 0; k < kTopk; ++k) routed += idx[t * kTopk + k] >= 0;
    for (int h = 0; h < kHidden; ++h) wrong += y[t * kHidden + h] != routed * x[t * kHidden + h];
  }
  const int ok = n == expected_rows && counted == n && wrong == 0;
  printf("rank %d/%d: received %lld rows (expected %lld, tokens_per_expert sum %lld), "
         "combine(dispatch(x)) wrong elements: %lld, channels %d, staging %.1f MiB: %s\n",
         r->rank, r->nranks, (long long)n, (long long)expected_rows, (long long)counted, wrong,
         info.channels, info.staging_bytes / 1048576.0, ok ? "PASS" : "FAIL");
  r->failed = !ok;

  ncclEpHandleDestroy(handle);
  cudaFree(d_idx);
  cudaFree(d_x);
  cudaFree(d_y);
  cudaFree(d_recv);
  free(idx);
  free(x);
  free(y);
  free(other);
  if (comm != NULL) {
    ncclEpGroupDestroy(r->group);
    r->group = NULL;
    ncclCommDestroy(comm);
  }
  cudaStreamDestroy(stream);
  return NULL;
}

int main(int argc, char** argv) {
  int local_team = 0, nranks = 0;
  if (argc == 3 && strcmp(argv[1], "--local-team") == 0) {
    local_team = 1;
    nranks = atoi(argv[2]);
  } else if (cudaGetDeviceCount(&nranks) != cudaSuccess) {
    fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  if (nranks < 1 || nranks > kMaxRanks) {
    fprintf(stderr, "1 to %d ranks, got %d\n", kMaxRanks, nranks);
    return 1;
  }
  Rank ranks[kMaxRanks];
  memset(ranks, 0, sizeof(ranks));
  ncclUniqueId id;
  memset(&id, 0, sizeof(id));
  ncclEpGroup_t team[kMaxRanks] = {0};
  if (local_team) {
    ncclEpGroupConfig_t cfg = make_config(nranks);
    const cudaError_t ce = cudaSetDevice(0);
    if (ce != cudaSuccess) {
      fprintf(stderr, "cudaSetDevice(0): %s\n", cudaGetErrorString(ce));
      return 1;
    }
    if (ncclEpCreateLocalTeam(team, nranks, &cfg, 0) != ncclSuccess) {
      fprintf(stderr, "ncclEpCreateLocalTeam: %s\n", ncclEpGetLastError());
      return 1;
    }
  } else if (ncclGetUniqueId(&id) != ncclSuccess) {
    fprintf(stderr, "ncclGetUniqueId failed\n");
    return 1;
  }
  pthread_t threads[kMaxRanks];
  for (int i = 0; i < nranks; ++i) {
    ranks[i].rank = i;
    ranks[i].nranks = nranks;
    ranks[i].device = local_team ? 0 : i;
    ranks[i].id = id;
    ranks[i].group = team[i];
    pthread_create(&threads[i], NULL, run_rank, &ranks[i]);
  }
  int failed = 0;
  for (int i = 0; i < nranks; ++i) {
    pthread_join(threads[i], NULL);
    failed |= ranks[i].failed;
  }
  for (int i = 0; local_team && i < nranks; ++i) ncclEpGroupDestroy(team[i]);
  printf("%s: %d rank(s)%s\n", failed ? "FAILED" : "PASSED", nranks,
         local_team ? " in a local team on GPU 0" : ", one per GPU over NCCL");
  return failed;
}
