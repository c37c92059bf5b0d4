/*
 * team_gate.h: a local team's host gate (ncclEpCreateLocalTeam). The members of a team enter
 * each collective call together and leave it only after every member has enqueued the call's
 * kernels: two meetings per call, the call's checks and launches between them.
 *
 * NOTES:
 *  - Why: the members' kernels wait for each other on one GPU, and a thread of this process may
 *    wait for the whole device at any time: CUDA's lazy loading of a kernel launched for the
 *    first time, cudaFree, a device synchronization, a legacy-stream copy. If a kernel already
 *    spins for a peer whose thread is in such a wait before enqueuing its own kernel, neither
 *    ever finishes (a deadlock until the device-side timeout). With the gate, whenever a member
 *    runs the caller's code, every kernel launched so far has its peers' kernels enqueued, so
 *    any wait for the device ends; between a call's meetings the members only check arguments
 *    and enqueue. A group of one process per GPU needs no gate: a wait for one GPU never waits
 *    for another process's launches.
 *  - The n-th meeting of every member is the same meeting (the calls are collective: the same
 *    calls in the same order on every rank), so a count per member is the whole protocol.
 *  - A meeting that times out stops the gate for good, as a device-side error stops a group:
 *    the members still waiting and every later call fail, naming who stopped it and whom it
 *    waited for (the members that had not reached the meeting).
 */
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "../include/nccl_ep.h"

namespace nccl_ep {

class TeamGate {
 public:
  explicit TeamGate(int size) : size_(size), meetings_(size, 0) {}

  // Returns once every member reached its next meeting: a call's first (`leaving` false: the
  // members enter it) or its second (`leaving`: they have enqueued it). ncclSystemError naming
  // the missing members after timeout_ms, or at once when the gate stopped. `quiet`: the
  // thread's error message is left alone (the call failed already and reports its own).
  ncclResult_t meet(int rank, const char* call, long long timeout_ms, bool leaving, bool quiet);
  // ncclSystemError with the stop's reason once the gate stopped, else ncclSuccess.
  ncclResult_t check();

 private:
  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;                           // members at the open meeting
  std::vector<unsigned long long> meetings_;  // per member: meetings entered
  std::atomic<unsigned long long> done_{0};   // meetings completed
  bool stopped_ = false;
  std::string why_;  // the stop, as the other members report it
};

}  // namespace nccl_ep
