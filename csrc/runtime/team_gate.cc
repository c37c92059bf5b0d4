/*
 * team_gate.cc: the local team's host gate (team_gate.h).
 */
#include "team_gate.h"

#include <stdio.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "errors.h"

namespace nccl_ep {

namespace {

// The last member usually arrives within microseconds: spin that long before sleeping, so that
// a call pays no wake-up latency in the common case.
constexpr auto kSpin = std::chrono::microseconds(50);
// Longer waits are waits without end (timeout_ms is a 64-bit count; a day fits any real call).
constexpr long long kLongestWaitMs = 24ll * 3600 * 1000;

}  // namespace

ncclResult_t TeamGate::meet(int rank, const char* call, long long timeout_ms, bool leaving,
                           bool quiet) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stopped_) {
    if (!quiet) set_error("%s", why_.c_str());
    return ncclSystemError;
  }
  const unsigned long long mine = ++meetings_[rank];
  if (++arrived_ == size_) {
    arrived_ = 0;
    done_.store(mine, std::memory_order_release);
    cv_.notify_all();
    return ncclSuccess;
  }
  lock.unlock();
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < kSpin) {
    if (done_.load(std::memory_order_acquire) >= mine) return ncclSuccess;
    std::this_thread::yield();
  }
  lock.lock();
  const auto deadline =
      start + std::chrono::milliseconds(std::min(std::max(timeout_ms, 1ll), kLongestWaitMs));
  cv_.wait_until(lock, deadline, [&] { return done_.load() >= mine || stopped_; });
  if (done_.load() >= mine) return ncclSuccess;
  if (!stopped_) {
    std::string missing;
    int n = 0;
    for (int r = 0; r < size_; ++r) {
      if (meetings_[r] >= mine) continue;
      missing += (n++ ? ", " : "") + std::to_string(r);
    }
    const char* ranks = n == 1 ? "rank" : "ranks";
    // The first meeting waits for ranks that have not entered the call; the second for ranks
    // inside it that have not finished enqueuing (a wait of theirs did not end).
    const char* what = leaving ? "finish enqueuing" : "enter";
    char why[512];
    snprintf(why, sizeof(why),
             "rank %d stopped this group: it timed out after %lld ms waiting for %s %s of its "
             "local team to %s the %s call (every member enters a collective call together); "
             "the ranks can no longer synchronize: destroy the group and create a new one",
             rank, timeout_ms, ranks, missing.c_str(), what, call);
    why_ = why;
    stopped_ = true;
    cv_.notify_all();
    if (!quiet)
      set_error("timed out after %lld ms on the host: rank %d waited for %s %s of its local "
                "team to %s the %s call (every member of a local team enters a collective call "
                "together; %s %s may have failed, returned early or be blocked). The group is "
                "stopped: destroy it and create a new one",
                timeout_ms, rank, ranks, missing.c_str(), what, call, ranks, missing.c_str());
    return ncclSystemError;
  }
  if (!quiet) set_error("%s", why_.c_str());
  return ncclSystemError;
}

ncclResult_t TeamGate::check() {
  std::lock_guard<std::mutex> lock(mu_);
  EP_CHECK(!stopped_, ncclSystemError, "%s", why_.c_str());
  return ncclSuccess;
}

}  // namespace nccl_ep
