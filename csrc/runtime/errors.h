/*
 * errors.h: how a runtime call fails: the thread-local message that ncclEpGetLastError returns,
 * the check macros every runtime file uses, the dtype helpers their messages and sizes use, and
 * the NCCL_EP_DEBUG lines (errors.cc). It includes only nccl_ep.h: every runtime file stands
 * above it.
 *
 * NOTES:
 *  - EP_CHECK(cond, result, fmt, ...) sets the message and returns result; EP_CUDA / EP_NCCL wrap
 *    runtime calls (the message names the call, its error and file:line); EP_RETURN_IF passes a
 *    failed ncclResult_t on, its message already set. Nothing in the library aborts.
 */
#pragma once

#include "../include/nccl_ep.h"

namespace nccl_ep {

void set_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// A line on stderr when NCCL_EP_DEBUG=1 (read once): the lifecycle steps that can wait on peers
// (the watchdog's steps and stops, group destroy), so that a hang names the step it is in.
void debug_log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
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
