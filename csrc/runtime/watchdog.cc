/*
 * watchdog.cc: the NCCL calls of groups that span nodes (the routing all-gather of handle
 * creation, the rail's send/receive in every op) run outside the device-side protocol and its
 * timeouts: a rank that died, or returned early on an error of its own, would leave its peers'
 * streams waiting in NCCL forever. Every such step runs between two events; a thread of the group
 * stops the group's own communicators (op_comm, rail_comm) when a step has not finished
 * timeout_ms after it started on the GPU, or when NCCL reports an asynchronous error on the
 * step's communicator first, records the error in the group's stop word, and every later call
 * of the group returns it. The NCCL kernels end when stopped, so the stream moves on
 * (a latch kernel reads the stop word; the kernels after it stop and poison their outputs).
 *
 * NOTES:
 *  - Stopping is ncclCommAbort: it ends the stuck kernel and frees the communicators whatever
 *    the peers do (ncclCommRevoke does not: the survivor's stream or its destroy can still wait
 *    for a peer that is gone). The stop word is written before, so that a latch kernel queued
 *    after each rail step (nodes.cc) stops the group's later kernels on the device. The stuck
 *    step's communicator is aborted first: freeing the other one's memory waits for the device,
 *    that is for the stuck kernel, which only its own communicator's abort ends.
 *  - The clock starts when the step's start event has completed, not at enqueue: a stream with
 *    long work queued before the step is not a peer that stopped.
 *  - An asynchronous error of the running step's communicator (ncclCommGetAsyncError: a peer's
 *    process gone, its sockets closed) stops the group at once, the same way, instead of after
 *    the timeout: NCCL's kernels keep waiting after such an error until the communicator is
 *    aborted. Only while that step is unfinished: a peer may destroy its group right after the
 *    last step, and NCCL's error never clears.
 *  - One step in flight: run() waits (host) until the previous step finished before it enqueues
 *    the next, so no NCCL kernel ever sits queued behind a stuck one (abort frees the
 *    communicators: a kernel queued behind would fault). The cost is a host wait when the host
 *    runs more than one NCCL step ahead of the GPU.
 *  - mu_ guards the step and every NCCL call made through run(): stopping never races an
 *    enqueue, and after it no call reaches the stopped communicators. Enqueues do not block on
 *    peers: group creation connects the rail and op_comm first.
 *  - A CUDA graph cannot hold these steps: a replay would not be followed, nor kept behind the
 *    previous step. run() refuses a capturing stream; the watchdog's own event queries run in
 *    relaxed capture mode so that they never break a capture elsewhere in the process.
 *  - A stop is this rank's: the other nodes' ranks stop on their own timeouts (one later at
 *    most) or sooner on NCCL's error, since this rank makes no NCCL call after it.
 *  - The user's communicator is never aborted (it is not the group's): handle creation gathers
 *    over op_comm, split from it at creation. (NCCL lets a split share its parent's abort flag
 *    when the parent shares resources with its splits: group creation refuses that case.)
 */
#include "internal.h"
#include "watchdog.h"

namespace nccl_ep {

namespace {
constexpr auto kPoll = std::chrono::milliseconds(2);  // the watchdog's look at a running step
constexpr auto kHostWait = std::chrono::microseconds(20);  // run()'s, at the previous step

// Event queries of this thread never invalidate a capture running on another (global mode).
void relax_capture_mode() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
}
}  // namespace

NcclWatchdog::NcclWatchdog(ncclEpGroup* g) : g_(g) {
  thread_ = std::thread([this] { loop(); });
}

NcclWatchdog::~NcclWatchdog() {
  shutdown();
  if (step_.start != nullptr) cudaEventDestroy(step_.start);
  if (step_.end != nullptr) cudaEventDestroy(step_.end);
}

void NcclWatchdog::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool NcclWatchdog::aborted() {
  std::lock_guard<std::mutex> lock(mu_);
  return stopped();
}

std::chrono::steady_clock::time_point NcclWatchdog::stopped_at() {
  std::lock_guard<std::mutex> lock(mu_);
  return stopped_at_;
}

// Caller holds mu_. True when no step is in flight: the last one finished (or the device
// failed, which the next CUDA call reports).
bool NcclWatchdog::idle() {
  if (!in_flight_) return true;
  if (cudaEventQuery(step_.end) == cudaErrorNotReady) return false;
  in_flight_ = false;
  debug_log("rank %d: step of op %d finished", g_->rank, (int)step_.op);
  return true;
}

ncclResult_t NcclWatchdog::run(OpKind op, NcclStep step, cudaStream_t stream,
                               const std::function<ncclResult_t()>& enqueue) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EP_CUDA(cudaStreamIsCapturing(stream, &capture));
  EP_CHECK(capture == cudaStreamCaptureStatusNone, ncclInvalidUsage,
           "%s of a group that spans nodes cannot be captured into a CUDA graph: its NCCL "
           "transfers between nodes run under a host watchdog, which a graph replay escapes "
           "(capture the layers around it, or use one node)",
           step == kStepRoutingGather ? "create_handle" : "an op");
  std::unique_lock<std::mutex> lock(mu_);
  // The previous step first (NOTES); a stuck one ends within the timeout, stopped. (Queries in
  // relaxed capture mode: another thread may be capturing.)
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  while (!stopped() && !idle()) {
    lock.unlock();
    std::this_thread::sleep_for(kHostWait);
    lock.lock();
  }
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (stopped()) {
    lock.unlock();
    EP_RETURN_IF(check_group_errors(g_));
    EP_CHECK(false, ncclSystemError,
             "this group's NCCL communicators were stopped (a timeout or an NCCL error between "
             "nodes): destroy the group and create a new one");
  }
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
  debug_log("rank %d: %s step of op %d enqueued (%s)", g_->rank,
            step == kStepRoutingGather ? "routing gather" : "rail", (int)op,
            ncclGetErrorString(res));
  lock.unlock();
  cv_.notify_all();
  return res;
}

void NcclWatchdog::loop() {
  cudaSetDevice(g_->device);
  relax_capture_mode();
  const auto limit = std::chrono::milliseconds(g_->cfg.timeout_ms);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (stopped() || idle()) {
      cv_.wait(lock, [this] { return stop_ || (in_flight_ && !stopped()); });
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (!step_.running && cudaEventQuery(step_.start) == cudaSuccess) {
      step_.running = true;
      step_.started = now;
      debug_log("rank %d: step of op %d started on the GPU", g_->rank, (int)step_.op);
    }
    if (step_.running) {
      // An error counts only while the step is unfinished (NOTES); idle() looks once more.
      const ncclResult_t failed = async_error(step_.step);
      if (failed != ncclSuccess && !idle()) {
        stop_communicators(lock, kErrNcclFailed, failed);
        continue;
      }
      if (now - step_.started > limit) {
        stop_communicators(lock, kErrNcclTimeout, g_->cfg.timeout_ms);
        continue;
      }
    }
    cv_.wait_for(lock, kPoll);
  }
}

// Caller holds mu_. The asynchronous error of the communicator(s) that `step` uses, or
// ncclSuccess (ncclInProgress: a nonblocking call still running, not an error).
ncclResult_t NcclWatchdog::async_error(NcclStep step) {
  const ncclComm_t rail = step == kStepRoutingGather ? nullptr : g_->rail_comm;
  const ncclComm_t gather = step == kStepRail ? nullptr : g_->op_comm;
  for (ncclComm_t c : {rail, gather}) {
    const ncclResult_t state = comm_async_error(c);
    if (state != ncclSuccess) return state;
  }
  return ncclSuccess;
}

ncclResult_t comm_async_error(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  ncclResult_t state = ncclSuccess;
  const ncclResult_t res = ncclCommGetAsyncError(comm, &state);
  if (res != ncclSuccess) return res;
  return state == ncclInProgress ? ncclSuccess : state;
}

// Caller holds mu_ (through `lock`); released while NCCL aborts the communicators (it waits for
// the stuck kernel and NCCL's proxy threads), with the stop already recorded: no call uses them.
// `code`: kErrNcclTimeout (value: the timeout in ms) or kErrNcclFailed (value: NCCL's error).
void NcclWatchdog::stop_communicators(std::unique_lock<std::mutex>& lock, ErrorCode code,
                                      long long value) {
  stopped_at_ = std::chrono::steady_clock::now();
  // The stop word is the host's alone (internal.h): a device error at the same moment lands in
  // the kernels' word, and neither report tears. One stop per group (stopped() after it); the
  // claim keeps the word written once all the same, `code` published last as raise_error does.
  ErrorInfo* e = g_->h_stop;
  if (__atomic_exchange_n(&e->claim, 1, __ATOMIC_ACQ_REL) == 0) {
    e->rank = g_->rank;
    e->token = -1;
    e->slot = (int)step_.op;
    e->aux = (int)step_.step;
    e->value = value;
    e->extra = g_->num_nodes;
    e->where = -1;
    __atomic_store_n(&e->code, (int)code, __ATOMIC_RELEASE);
  }
  // The stuck step's communicator first (NOTES).
  const bool gather = step_.step == kStepRoutingGather;
  ncclComm_t comms[] = {gather ? g_->op_comm : g_->rail_comm,
                        gather ? g_->rail_comm : g_->op_comm};
  g_->rail_comm = g_->op_comm = nullptr;  // abort frees them
  lock.unlock();
  debug_log("rank %d: stopping op %d's step (%s, %lld): aborting the communicators", g_->rank,
            (int)step_.op, code == kErrNcclTimeout ? "timeout ms" : "NCCL error", value);
  for (ncclComm_t c : comms)
    if (c != nullptr) ncclCommAbort(c);
  debug_log("rank %d: communicators aborted", g_->rank);
  lock.lock();
}

}  // namespace nccl_ep
