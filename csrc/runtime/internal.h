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
 *  - A group's host state is guarded by its mutex: handles may be destroyed from another thread
 *    (a garbage collector, autograd's thread) while this one creates handles or runs ops.
 */
#pragma once

#include <stdarg.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../include/nccl_ep.h"
#include "../kernels/api.cuh"

namespace nccl_ep {

void set_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// A line on stderr when NCCL_EP_DEBUG=1 (read once): the lifecycle steps that can wait on peers
// (the watchdog's steps and stops, group destroy), so that a hang names the step it is in.
void debug_log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
const char* dtype_name(ncclDataType_t dtype);
int dtype_bytes(ncclDataType_t dtype);  // 0 for dtypes the library does not move
size_t align_up(size_t v, size_t a);

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

namespace nccl_ep {

// A typed view of a part of a buffer: its place is decided once, by BufferPlan.
template <typename T>
struct View {
  T* ptr = nullptr;
  size_t count = 0;
  size_t bytes() const { return sizeof(T) * count; }
};

// Lays out views one after another in one allocation (each aligned), then binds them to a base.
class BufferPlan {
 public:
  template <typename T>
  void add(View<T>* v, size_t count, size_t align = 256) {
    offset_ = align_up(offset_, align);
    v->count = count;
    v->ptr = reinterpret_cast<T*>(offset_);  // an offset until bind()
    bound_.push_back(reinterpret_cast<void**>(&v->ptr));
    offset_ += sizeof(T) * count;
  }
  // A view of one T whose storage is `bytes` long (a struct with a flexible tail).
  template <typename T>
  void add_bytes(View<T>* v, size_t bytes, size_t align = 256) {
    add(v, 1, align);
    offset_ += bytes - sizeof(T);
  }
  size_t bytes() const { return offset_ == 0 ? 16 : offset_; }
  void bind(void* base) {
    for (void** p : bound_) *p = reinterpret_cast<char*>(base) + reinterpret_cast<size_t>(*p);
    bound_.clear();
  }

 private:
  size_t offset_ = 0;
  std::vector<void**> bound_;
};

// One handle's device buffers (a pool slot) and its host readback.
struct HandleSlot {
  void* base = nullptr;          // one device allocation for every view below
  View<int> own_routing;         // [Tmax * Kmax] this rank's expert ids (the caller's)
  View<int> kept_routing;        // expert_capacity: the same with dropped slots -1, what the
                                 // ops follow ([Tmax * Kmax]; empty without expert_capacity)
  View<int> recv_row;            // [R * Tmax * Kmax]
  View<int> src_of_row;          // [src_rows]
  View<int> cnt, off;            // [R * L]
  View<int> tile_cnt;            // [R][layout_tiles][L]
  View<int> hist;                // [E]
  View<unsigned long long> err_key;
  View<unsigned> blocks_done;    // validate's finished blocks
  View<LayoutMeta> meta;         // LayoutMeta with its [L] tokens_per_expert tail
  View<int> records;             // groups that span nodes: [R][rec_ints], the all-gathered
                                 // routing records (one node: they sit in the window)
  LayoutMeta* host_meta = nullptr;  // pinned, mapped: the exact-mode readback
  LayoutMeta* host_meta_dev = nullptr;  // its device address (the bases write it)
  cudaEvent_t meta_ready = nullptr; // recorded after the bases (validate_kernel)

  // This rank's routing as the ops follow it (its dropped slots masked under expert_capacity).
  int* op_routing() const { return kept_routing.count > 0 ? kept_routing.ptr : own_routing.ptr; }
};

// Windows of a local team (ncclEpCreateLocalTeam): freed when the last member goes.
struct LocalTeam {
  std::vector<void*> windows;
  ncclEpAllocFn_t alloc_fn = nullptr;
  ncclEpFreeFn_t free_fn = nullptr;
  void* alloc_ctx = nullptr;
  ~LocalTeam();
};

// Groups that span nodes: what travels between rail peers (ranks with the same index in their
// node), one buffer per remote node of Tmax token rows / prob rows, plus this rank's own.
struct RailBuffers {
  void* base = nullptr;
  View<char> rows_in;            // [nodes - 1][Tmax rows]: dispatch tokens / combine partials in
  View<char> rows_out;           // [nodes - 1][Tmax rows]: combine partials out
  View<char> rows_own;           // [Tmax rows]: own node partial; capacity-mode send staging
  View<char> probs_in;           // [nodes - 1][Tmax][max(E, Kmax)] 8-byte probs in
  View<char> probs_out;          // [nodes - 1][Tmax][Kmax] 8-byte probs' gradients out
  View<char> probs_own;          // [Tmax][max(E, Kmax)]: own probs' gradients; send staging
  size_t row_bytes = 0, prob_row_bytes = 0, grad_row_bytes = 0;  // per token, in each view
};

// The NCCL steps of groups that span nodes, named in the watchdog's error.
enum NcclStep : int {
  kStepRoutingGather = 0,  // handle creation's all-gather of the routing records (op_comm)
  kStepRail = 1,           // an op's send/receive with the rail peers (rail_comm)
  kStepConnect = 2,        // group creation's first use of both (connect_nodes)
};

// watchdog.cc: follows the NCCL steps of a group that spans nodes on the device and stops the
// group's communicators when one has not finished timeout_ms after it started, or when NCCL
// reports an asynchronous error on its communicator first.
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

struct ncclEpGroup {
  std::mutex mu;                 // guards the pool and the live handles
  ncclComm_t comm = nullptr;     // null for a local team
  std::shared_ptr<nccl_ep::LocalTeam> team;
  ncclEpGroupConfig_t cfg{};
  int rank = 0, nranks = 1, num_local = 0;
  // Nodes: G consecutive ranks each (G = nranks: one node). The window, its barriers and the
  // exchange engine span the node (node_comm, split from comm when G < nranks); rail_comm joins
  // the ranks of the same index in every node (G < nranks only).
  int node_size = 1, node = 0, node_rank = 0, num_nodes = 1;
  ncclComm_t node_comm = nullptr;  // == comm on one node (not owned then)
  ncclComm_t rail_comm = nullptr;
  ncclComm_t op_comm = nullptr;    // G < nranks: split from comm for the routing all-gather
  std::unique_ptr<nccl_ep::NcclWatchdog> watchdog;  // G < nranks: follows the two above
  nccl_ep::RailBuffers rail;
  size_t row_bytes = 0;          // hidden * token element bytes
  long long capacity = -1;       // capacity mode rows, -1 in exact mode
  long long src_rows = 0;        // rows that src_of_row covers
  long long block_rows = 0;      // expert_capacity: rows of each local expert's block (0: off)
  int device = 0;
  // symmetric window
  nccl_ep::WindowLayout win{};
  void* win_buf = nullptr;       // NCCL: ncclMemAlloc'd; local team: the team's window
  ncclWindow_t nccl_win = nullptr;
  void** d_peers = nullptr;      // device [R]
  std::vector<void*> peers;      // host copy
  nccl_ep::DeviceState* d_state = nullptr;
  // Two host-mapped pinned error words of one allocation: h_err the kernels' (device atomics
  // claim it), h_stop the watchdog's (host only). Host and device atomics on mapped memory are
  // not atomic with each other, so no word has writers on both sides.
  nccl_ep::ErrorInfo* h_err = nullptr;
  nccl_ep::ErrorInfo* d_err = nullptr;   // h_err's device alias
  nccl_ep::ErrorInfo* h_stop = nullptr;  // h_err + 1
  nccl_ep::ErrorInfo* d_stop = nullptr;  // its device alias (read by the latch kernel)
  // handle pool
  size_t slot_bytes = 0;
  std::vector<nccl_ep::HandleSlot*> free_slots;
  std::vector<nccl_ep::HandleSlot*> all_slots;
  std::vector<ncclEpHandle*> live;
  unsigned handles_created = 0;  // the next handle's creation number (ncclEpHandle::seq)
};

struct ncclEpHandle {
  ncclEpGroup* group = nullptr;
  nccl_ep::HandleSlot* slot = nullptr;
  int num_tokens = 0, topk = 0;
  unsigned seq = 0;              // creation number in its group: the same on every rank
  // Exact mode: filled from the readback at the first call that needs it (read_layout).
  bool layout_read = false;
  ncclResult_t layout_result = ncclSuccess;
  std::string layout_error;
  long long num_recv = 0;        // rows of dispatch outputs (capacity: the capacity)
  std::vector<long long> tokens_per_expert;
};

namespace nccl_ep {

// config.cc
ncclResult_t check_config_version(const ncclEpGroupConfig_t* c);  // size and version only
ncclResult_t check_config(const ncclEpGroupConfig_t* c, int nranks, int node_size);
// Sizes and offsets of the window for this config (the same on every rank of a node of nranks).
WindowLayout plan_window(const ncclEpGroupConfig_t& c, int nranks);
int default_channels(const ncclEpGroupConfig_t& c);
// expert_capacity: roundup(nranks x C, expert_alignment), the rows of a local expert's block.
long long expert_block_rows(const ncclEpGroupConfig_t& c, int nranks);
// Checks that every rank of an NCCL group has the same configuration (collective).
ncclResult_t agree_config(ncclEpGroup* g, int lsa_size, int nccl_version, cudaStream_t stream);
ncclResult_t host_all_gather(ncclComm_t comm, int n, int rank, const void* mine, size_t bytes,
                             void* all, cudaStream_t stream);

// window.cc
ncclResult_t open_nccl_window(ncclEpGroup* g, cudaStream_t stream);
void close_window(ncclEpGroup* g);

// pool.cc
ncclResult_t alloc_device(ncclEpGroup* g, void** ptr, size_t bytes);
void free_device(ncclEpGroup* g, void* ptr);
ncclResult_t acquire_slot(ncclEpGroup* g, HandleSlot** out);
void release_slot(ncclEpGroup* g, HandleSlot* slot);
void free_slots(ncclEpGroup* g);
size_t slot_device_bytes(const ncclEpGroup* g);

// group.cc
ncclResult_t check_group_errors(ncclEpGroup* g);
// An error kept for later: a group that spans nodes still makes an op's NCCL calls after a
// device-side error (its rail peers would wait for them forever) and returns it afterwards.
struct DeferredError {
  ncclResult_t res = ncclSuccess;
  std::string message;
  void take(ncclResult_t r) {
    if (r != ncclSuccess && res == ncclSuccess) {
      res = r;
      message = ncclEpGetLastError();
    }
  }
  // The kept error (its message restored), else ncclSuccess.
  ncclResult_t result() const {
    if (res != ncclSuccess) set_error("%s", message.c_str());
    return res;
  }
};
// The handle-creation barrier; `call` is its call_signature().
ncclResult_t barrier(ncclEpGroup* g, unsigned call, cudaStream_t stream);

// ops.cc
// Groups that span nodes: one message each way with the rail peer of remote node `node`.
struct RailMessage {
  int node;
  const void* send;
  size_t send_bytes;
  void* recv;
  size_t recv_bytes;
};
// Enqueues every message as one NCCL group on the stream (both sides list a node's messages in
// the same order); ops make it through the watchdog.
ncclResult_t rail_exchange(const ncclEpGroup* g, const std::vector<RailMessage>& messages,
                           cudaStream_t stream);
// The slot of remote node m in the rail buffers.
inline size_t remote_node_index(const ncclEpGroup* g, int m) {
  return (size_t)(m < g->node ? m : m - 1);
}

// handle.cc
void destroy_handle_state(ncclEpHandle* h);  // caller holds g->mu
ncclResult_t check_op_config(const ncclEpOpConfig_t* config, const char* fn);
// Exact mode: waits for the handle's layout readback (once) and returns its result.
ncclResult_t read_layout(ncclEpHandle* h);

// errors.cc
// Formats a device error word into the thread-local message and returns its ncclResult_t.
ncclResult_t report_error(const ncclEpGroup* g, const ErrorInfo& e, const LayoutMeta* meta);

}  // namespace nccl_ep
