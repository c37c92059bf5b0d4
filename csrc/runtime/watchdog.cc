/*
 * watchdog.cc: the NCCL calls of groups that span nodes (the routing all-gather of handle
 * creation, the rail's send/receive in every op) run outside the device-side protocol and its
 * timeouts: a rank that died, or returned early on an error of its own, would leave its peers'
 * streams waiting in NCCL forever. Every such step runs between two events; a thread of the group
 * stops the group's own communicators (op_comm, rail_comm) when a step has not finished
 * timeout_ms after it started on the GPU, records the error in the group's error word, and every
 * later call of the group returns it. The NCCL kernels end when stopped, so the stream moves on
 * (the next kernels see the error word, stop and poison their outputs).
 *
 * NOTES:
 *  - Stopping: ncclCommRevoke where NCCL has it (>= 2.28; queued NCCL kernels end cleanly, the
 *    communicators are destroyed with the group once quiescent), else ncclCommAbort.
 *  - The clock starts when the step's start event has completed, not at enqueue: a stream with
 *    long work queued before the step is not a peer that stopped.
 *  - One step in flight: run() waits (host) until the previous step finished before it enqueues
 *    the next, so no NCCL kernel ever sits queued behind a stuck one (revoke re-arms the
 *    communicators once done, abort frees them: a queued kernel would hang or fault). The cost
 *    is a host wait when the host runs more than one NCCL step ahead of the GPU.
 *  - mu_ guards the step and every NCCL call made through run(): stopping never races an
 *    enqueue, and after it no call reaches the stopped communicators. Enqueues do not block on
 *    peers: group creation connects the rail and op_comm first.
 *  - Steps enqueued while the stream is being captured into a CUDA graph are not followed (an
 *    event of a capture cannot be queried); neither is a graph's replay.
 *  - The user's communicator is never aborted (it is not the group's): handle creation gathers
 *    over op_comm, split from it at creation.
 */
#include "internal.h"

namespace nccl_ep {

namespace {
constexpr auto kPoll = std::chrono::milliseconds(2);  // the watchdog's look at a running step
constexpr auto kHostWait = std::chrono::microseconds(20);  // run()'s, at the previous step
}

NcclWatchdog::NcclWatchdog(ncclEpGroup* g) : g_(g) {
  thread_ = std::thread([this] { loop(); });
}

NcclWatchdog::~NcclWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (step_.start != nullptr) cudaEventDestroy(step_.start);
  if (step_.end != nullptr) cudaEventDestroy(step_.end);
}

bool NcclWatchdog::aborted() {
  std::lock_guard<std::mutex> lock(mu_);
  return aborted_;
}

// Caller holds mu_. True when no step is in flight: the last one finished (or the device
// failed, which the next CUDA call reports).
bool NcclWatchdog::idle() {
  if (!in_flight_) return true;
  if (cudaEventQuery(step_.end) == cudaErrorNotReady) return false;
  in_flight_ = false;
  return true;
}

ncclResult_t NcclWatchdog::run(OpKind op, NcclStep step, cudaStream_t stream,
                               const std::function<ncclResult_t()>& enqueue) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EP_CUDA(cudaStreamIsCapturing(stream, &capture));
  std::unique_lock<std::mutex> lock(mu_);
  // The previous step first (NOTES); a stuck one ends within the timeout, stopped.
  while (!aborted_ && !idle()) {
    lock.unlock();
    std::this_thread::sleep_for(kHostWait);
    lock.lock();
  }
  if (aborted_) {
    lock.unlock();
    EP_RETURN_IF(check_group_errors(g_));
    EP_CHECK(false, ncclSystemError,
             "this group's NCCL communicators were stopped after a timeout between nodes: "
             "destroy the group and create a new one");
  }
  if (capture != cudaStreamCaptureStatusNone) return enqueue();
  for (cudaEvent_t* e : {&step_.start, &step_.end})
    if (*e == nullptr) EP_CUDA(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  EP_CUDA(cudaEventRecord(step_.start, stream));
  const ncclResult_t res = enqueue();
  // Followed even when the enqueue failed part way: what it queued must finish or be stopped.
  EP_CUDA(cudaEventRecord(step_.end, stream));
  step_.op = op;
  step_.step = step;
  step_.running = false;
  in_flight_ = true;
  lock.unlock();
  cv_.notify_all();
  return res;
}

void NcclWatchdog::loop() {
  cudaSetDevice(g_->device);
  const auto limit = std::chrono::milliseconds(g_->cfg.timeout_ms);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (aborted_ || idle()) {
      cv_.wait(lock, [this] { return stop_ || (in_flight_ && !aborted_); });
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (!step_.running && cudaEventQuery(step_.start) == cudaSuccess) {
      step_.running = true;
      step_.started = now;
    }
    if (step_.running && now - step_.started > limit) {
      stop_communicators();
      continue;
    }
    cv_.wait_for(lock, kPoll);
  }
}

// Caller holds mu_.
void NcclWatchdog::stop_communicators() {
  aborted_ = true;
  ErrorInfo* e = g_->h_err;
  // The device claims the word with an atomic on `claim`; the host does the same, then
  // publishes `code` last, as raise_error does.
  if (__atomic_exchange_n(&e->claim, 1, __ATOMIC_ACQ_REL) == 0) {
    e->rank = g_->rank;
    e->token = -1;
    e->slot = (int)step_.op;
    e->aux = (int)step_.step;
    e->value = g_->cfg.timeout_ms;
    e->extra = g_->num_nodes;
    e->where = -1;
    __atomic_store_n(&e->code, (int)kErrNcclTimeout, __ATOMIC_RELEASE);
  }
  // Ends the NCCL kernels waiting for the peer (nothing is queued behind them: NOTES). Revoke
  // keeps the communicators' memory until destroy_step_comm; NCCL before it only has abort.
  for (ncclComm_t* c : {&g_->rail_comm, &g_->op_comm}) {
    if (*c == nullptr) continue;
#ifdef NCCL_REVOKE_DEFAULT
    ncclCommRevoke(*c, NCCL_REVOKE_DEFAULT);
#else
    ncclCommAbort(*c);
    *c = nullptr;
#endif
  }
}

void destroy_step_comm(ncclComm_t comm, bool revoked) {
  if (comm == nullptr) return;
  // A revoked communicator is destroyed once quiescent, within a bound (else aborted).
  ncclResult_t state = ncclInProgress;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (revoked && state == ncclInProgress && std::chrono::steady_clock::now() < until) {
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
    if (state == ncclInProgress) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (revoked && state == ncclInProgress) {
    ncclCommAbort(comm);
    return;
  }
  ncclCommDestroy(comm);
}

}  // namespace nccl_ep
