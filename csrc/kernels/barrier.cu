/*
 * barrier.cu: the kernels of the group runtime: peer pointer resolution through NCCL's device
 * API, the cross-rank flag barrier, and the latch of a host-recorded error.
 *
 * NOTES (barrier choice): we use our own flag barrier over the symmetric window instead of
 * NCCL's ncclLsaBarrierSession because it must time out (the LSA barrier spins forever), must
 * keep its epoch on the device (so a captured CUDA graph replays correctly), and must catch ranks
 * that are not making the same call. It runs once per handle creation (the ops synchronize
 * through their ring flags, exchange.cuh). Flags only grow: rank p writes (epoch, call
 * signature) into flags[p] of every peer with st.release.sys after fence.acq_rel.sys, and waits
 * with ld.acquire.sys until every peer's flag reached the epoch, so no reset is ever needed. A
 * peer seen at this epoch with another signature is a kErrCallMismatch (a peer already past this
 * epoch checked this rank's signature itself: it could not pass without reading it). A rank that
 * holds a device-side error (a timeout, a capacity-mode routing error) stops waiting and writes
 * the abort slot of every peer, whose waits then stop too and report it: errors are sticky and
 * global, and the group must be rebuilt.
 */
#include <nccl.h>
#include <nccl_device.h>

#include "api.cuh"
#include "device.cuh"

namespace nccl_ep {

__global__ void resolve_peers_kernel(ncclWindow_t window, int num_ranks, void** out) {
  int p = threadIdx.x + blockIdx.x * blockDim.x;
  // ncclGetPeerPointer maps a world rank to its LSA index (lsaRank + peer - worldRank); valid
  // because the host checked that the LSA team is the whole communicator of the window (the
  // group's, or its node's: runtime/config.cc, runtime/nodes.cc).
  if (p < num_ranks) out[p] = ncclGetPeerPointer(window, 0, p);
}

cudaError_t launch_resolve_peers(void* window, int num_ranks, void** out_dev,
                                 cudaStream_t stream) {
  resolve_peers_kernel<<<1, kMaxRanks, 0, stream>>>(reinterpret_cast<ncclWindow_t>(window),
                                                    num_ranks, out_dev);
  return cudaGetLastError();
}

int lsa_team_size(void* comm) { return ncclTeamLsa(reinterpret_cast<ncclComm_t>(comm)).nRanks; }

__global__ void __launch_bounds__(kMaxRanks) barrier_kernel(BarrierArgs a) {
  __shared__ unsigned long long epoch, origin;
  __shared__ int give_up;
  unsigned long long* const my_flags = reinterpret_cast<unsigned long long*>(
      reinterpret_cast<char*>(a.peers[a.rank]) + a.sync_off);
  if (threadIdx.x == 0) {
    epoch = a.state->barrier_epoch + 1;
    origin = ld_acquire_sys(my_flags + kAbortSlot);  // a peer's error stopped the group
    if (origin != 0)
      raise_error(a.err, kErrPeerAbort, a.rank, (int)origin - 1, (int)call_op(a.call), 0, 0);
    give_up = ld_volatile_int(&a.err->code) != kErrNone || a.state->failed != 0;
    if (give_up && origin == 0)
      origin = a.state->failed != 0 ? a.state->failed : (unsigned long long)a.rank + 1;
  }
  __syncthreads();
  const int p = threadIdx.x;
  if (p < a.num_ranks && !give_up) {
    // Publish: everything this rank wrote before (earlier kernels on the stream) is ordered
    // before the flag by the fence + release store at system scope.
    fence_acq_rel_sys();
    unsigned long long* peer_flags = reinterpret_cast<unsigned long long*>(
        reinterpret_cast<char*>(a.peers[p]) + a.sync_off);
    st_release_sys(peer_flags + a.rank, (epoch << kCallBits) | a.call);
    const unsigned long long start = global_timer_ns();
    int spins = 0;
    unsigned long long seen;
    while (((seen = ld_acquire_sys(my_flags + p)) >> kCallBits) < epoch) {
      if (++spins < 1024) continue;
      spins = 0;
      const unsigned long long by = ld_acquire_sys(my_flags + kAbortSlot);
      if (by != 0) {
        raise_error(a.err, kErrPeerAbort, a.rank, (int)by - 1, (int)call_op(a.call), 0, 0);
        origin = by;
        break;
      }
      if ((long long)(global_timer_ns() - start) > a.timeout_ns) {
        raise_error(a.err, kErrTimeout, a.rank, p, (int)call_op(a.call), (long long)epoch,
                    a.timeout_ns / 1000000, (int)kWaitBarrier);
        origin = (unsigned long long)a.rank + 1;
        break;
      }
    }
    const unsigned peer_call = (unsigned)(seen & ((1ull << kCallBits) - 1));
    if ((seen >> kCallBits) == epoch && peer_call != a.call) {
      raise_error(a.err, kErrCallMismatch, a.rank, p, (int)call_op(a.call), a.call, peer_call);
      origin = (unsigned long long)a.rank + 1;
    }
    fence_acq_rel_sys();
  }
  __syncthreads();
  // A rank that holds an error tells every peer, so that nobody waits for it and nobody goes on
  // with barriers that no longer order anything.
  if (threadIdx.x == 0) {
    a.state->barrier_epoch = epoch;
    if (origin != 0) stop_group(a.peers, a.sync_off, a.num_ranks, &a.state->failed, origin);
  }
}

cudaError_t preload_barrier() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, barrier_kernel);
}

// Groups that span nodes, after each rail step: a stop the host's watchdog recorded in its stop
// word (a timeout or an NCCL error; it ended the step's NCCL kernels) stops the group on
// the device too, so that the kernels after the rail, which read only `failed`, poison their
// outputs, and the node's peers stop as for a device-side error.
__global__ void latch_error_kernel(const ErrorInfo* stop, void* const* peers, size_t sync_off,
                                   int num_ranks, int rank, DeviceState* state) {
  if (ld_volatile_int(&stop->code) != kErrNone)
    stop_group(peers, sync_off, num_ranks, &state->failed, (unsigned long long)rank + 1);
}

cudaError_t launch_latch_error(const ErrorInfo* stop, void* const* peers, size_t sync_off,
                               int num_ranks, int rank, DeviceState* state, cudaStream_t stream) {
  latch_error_kernel<<<1, 1, 0, stream>>>(stop, peers, sync_off, num_ranks, rank, state);
  return cudaGetLastError();
}

cudaError_t launch_barrier(const BarrierArgs& args, cudaStream_t stream) {
  barrier_kernel<<<1, kMaxRanks, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace nccl_ep
