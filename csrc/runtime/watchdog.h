/*
 * watchdog.h: the NcclWatchdog of a group that spans nodes (watchdog.cc) and the NCCL steps it
 * follows. Used by nodes.cc (every NCCL call between nodes is one of its steps), group.cc (a
 * group owns its watchdog) and error_words.cc (its stop names the step).
 */
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "../include/nccl_ep.h"
#include "../kernels/protocol.cuh"

struct ncclEpGroup;

namespace nccl_ep {

// The NCCL steps of groups that span nodes, named in the watchdog's error.
enum NcclStep : int {
  kStepRoutingGather = 0,  // handle creation's all-gather of the routing records (op_comm)
  kStepRail = 1,           // an op's send/receive with the rail peers (rail_comm)
  kStepConnect = 2,        // group creation's first use of both (connect_nodes)
};

// Follows the NCCL steps of a group that spans nodes on the device and stops the group's
// communicators when one has not finished timeout_ms after it started, or when NCCL reports an
// asynchronous error on its communicator first.
class NcclWatchdog {
 public:
  explicit NcclWatchdog(ncclEpGroup* g);
  ~NcclWatchdog();  // stops the thread; a step still in flight is no longer followed
  // Makes the NCCL calls of `enqueue` on `stream` as one followed step, after the previous step
  // finished; once the communicators were stopped, makes none and returns the group's error.
  ncclResult_t run(OpKind op, NcclStep step, cudaStream_t stream,
                   const std::function<ncclResult_t()>& enqueue);
  bool aborted();  // the communicators were stopped
  // When the communicators were stopped (a default time_point while they were not).
  std::chrono::steady_clock::time_point stopped_at();
  void shutdown();  // stops the thread (after a stop in progress)

 private:
  struct Step {
    cudaEvent_t start = nullptr, end = nullptr;  // recorded around its NCCL calls
    OpKind op = kOpCreateHandle;
    NcclStep step = kStepRail;
    std::chrono::steady_clock::time_point started;
    bool running = false;  // the start event completed (at `started`, as the watchdog saw it)
  };
  void loop();
  bool idle();
  bool stopped() const { return stopped_at_ != std::chrono::steady_clock::time_point{}; }
  ncclResult_t async_error(NcclStep step);
  void stop_communicators(std::unique_lock<std::mutex>& lock, ErrorCode code, long long value);

  ncclEpGroup* g_;
  std::mutex mu_;
  std::condition_variable cv_;
  Step step_;
  bool in_flight_ = false, stop_ = false;
  std::chrono::steady_clock::time_point stopped_at_{};  // set once, when stopped (under mu_)
  std::thread thread_;  // last: started once the members above exist
};

// `comm`'s asynchronous error, or ncclSuccess (also for a null comm and for ncclInProgress).
ncclResult_t comm_async_error(ncclComm_t comm);

}  // namespace nccl_ep
