/*
 * internal.h: host-side state of groups and handles, and the error macros.
 *
 * NOTES:
 *  - Errors: EP_CHECK(cond, result, fmt, ...) sets the thread-local message and returns result;
 *    EP_CUDA / EP_NCCL wrap runtime calls. Nothing in the library aborts.
 *  - Handle buffers come from a per-group pool of equal-sized slots (allocated once through
 *    alloc_fn/cudaMalloc, reused by later handles, freed at group destroy), so creating and
 *    destroying handles never calls cudaMalloc/cudaFree in steady state. A slot returned by
 *    ncclEpHandleDestroy is reused by the next handle in stream order: handles of one group must
 *    be used on one stream (or the caller orders the streams).
 */
#pragma once

#include <stdarg.h>

#include <string>
#include <vector>

#include "../include/nccl_ep.h"
#include "../kernels/api.cuh"

namespace nccl_ep {

void set_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
const char* dtype_name(ncclDataType_t dtype);
int dtype_bytes(ncclDataType_t dtype);  // 0 for dtypes the library does not move

}  // namespace nccl_ep

#define EP_CHECK(cond, result, ...)     \
  do {                                  \
    if (!(cond)) {                      \
      ::nccl_ep::set_error(__VA_ARGS__); \
      return (result);                  \
    }                                   \
  } while (0)

#define EP_CUDA(call)                                                                    \
  do {                                                                                   \
    cudaError_t ep_err_ = (call);                                                        \
    if (ep_err_ != cudaSuccess) {                                                        \
      ::nccl_ep::set_error("%s failed: %s (%s:%d)", #call, cudaGetErrorString(ep_err_), \
                           __FILE__, __LINE__);                                          \
      return ncclUnhandledCudaError;                                                     \
    }                                                                                    \
  } while (0)

#define EP_NCCL(call)                                                                      \
  do {                                                                                     \
    ncclResult_t ep_res_ = (call);                                                         \
    if (ep_res_ != ncclSuccess) {                                                          \
      ::nccl_ep::set_error("%s failed: %s (%s:%d)", #call, ncclGetErrorString(ep_res_),   \
                           __FILE__, __LINE__);                                            \
      return ep_res_;                                                                      \
    }                                                                                      \
  } while (0)

#define EP_RETURN_IF(call)                 \
  do {                                     \
    ncclResult_t ep_res_ = (call);         \
    if (ep_res_ != ncclSuccess) return ep_res_; \
  } while (0)

struct ncclEpHandleSlot {
  void* base = nullptr;
  size_t bytes = 0;
  int* gathered = nullptr;       // [R][rec_ints]
  int* recv_row = nullptr;       // [R * Tmax * Kmax]
  int* src_of_row = nullptr;     // [src_rows]
  unsigned long long* err_key = nullptr;  // placed right after src_of_row (one 0xff memset)
  int* cnt = nullptr;            // [R * L]
  int* off = nullptr;            // [R * L]
  nccl_ep::LayoutMeta* meta = nullptr;
  int* hist = nullptr;           // [E], right after meta (one zero memset)
  size_t ff_bytes = 0;           // bytes from recv_row to the end of err_key
  size_t zero_bytes = 0;         // bytes from meta to the end of hist
};

struct ncclEpGroup {
  ncclComm_t comm = nullptr;
  ncclEpGroupConfig_t cfg{};
  int rank = 0, nranks = 1, num_local = 0;
  int elt = 2;                   // token element bytes
  size_t row_bytes = 0;          // hidden * elt
  size_t stage_row_bytes = 0;    // row_bytes rounded up to 16
  int chunk = 0;                 // C: staged tokens per source rank
  int num_chunks = 1;
  int num_sms = 24;
  long long capacity = -1;       // capacity mode rows, -1 in exact mode
  int rec_ints = 0;
  long long src_rows = 0;        // rows that src_of_row covers
  // symmetric window
  void* win_buf = nullptr;
  size_t win_bytes = 0;
  ncclWindow_t win = nullptr;
  bool win_is_local = false;     // one rank: a plain device buffer, no NCCL window
  size_t flags_off = 0, tok_off = 0, prob_off = 0;
  void** d_peers = nullptr;      // device [R]
  std::vector<void*> peers;
  unsigned long long* d_epoch = nullptr;  // [0] barrier epoch, [1] failed (BarrierArgs)
  nccl_ep::ErrorInfo* h_err = nullptr;  // host-mapped pinned error word
  nccl_ep::ErrorInfo* d_err = nullptr;  // its device alias
  void* h_meta = nullptr;        // pinned readback of LayoutMeta (exact mode)
  size_t meta_bytes = 0;
  // handle pool
  size_t slot_bytes = 0;
  std::vector<ncclEpHandleSlot*> free_slots;
  std::vector<ncclEpHandleSlot*> all_slots;
  std::vector<ncclEpHandle*> live;
  unsigned handles_created = 0;  // the next handle's creation number (ncclEpHandle::seq)
};

struct ncclEpHandle {
  ncclEpGroup* group = nullptr;
  ncclEpHandleSlot* slot = nullptr;
  int num_tokens = 0, topk = 0;
  unsigned seq = 0;              // creation number in its group: the same on every rank
  long long num_recv = 0;        // rows of dispatch outputs
  std::vector<long long> tokens_per_expert;  // exact mode host copy
};

namespace nccl_ep {

// group.cc
ncclResult_t check_group_errors(ncclEpGroup* g);
// A cross-rank barrier of one operation; `call` is its call_signature() (api.cuh).
ncclResult_t barrier(ncclEpGroup* g, unsigned call, cudaStream_t stream);
ncclResult_t alloc_device(ncclEpGroup* g, void** ptr, size_t bytes);
void free_device(ncclEpGroup* g, void* ptr);
ncclResult_t acquire_slot(ncclEpGroup* g, ncclEpHandleSlot** out);
void release_slot(ncclEpGroup* g, ncclEpHandleSlot* slot);
// handle.cc
void destroy_handle_state(ncclEpHandle* h);
ncclResult_t check_op_config(const ncclEpOpConfig_t* config, const char* fn);
// Formats a device error word into the thread-local message and returns its ncclResult_t.
ncclResult_t report_error(const ncclEpGroup* g, const ErrorInfo& e, const LayoutMeta* meta);

}  // namespace nccl_ep
