/*
 * runtime.cu: the kernels of the group runtime: peer pointer resolution through NCCL's device
 * API, and the cross-rank flag barrier.
 *
 * NOTES (barrier choice): we use our own flag barrier over the symmetric window instead of
 * NCCL's ncclLsaBarrierSession because it must time out (the LSA barrier spins forever) and must
 * keep its epoch on the device (so a captured CUDA graph replays correctly). Flags only grow:
 * rank p writes epoch into flags[p] of every peer with st.release.sys after fence.acq_rel.sys,
 * and waits with ld.acquire.sys until every peer's flag reached the epoch, so no reset is ever
 * needed. Every rank runs the same sequence of barriers, so epochs stay in lockstep even after a
 * timeout (the epoch is bumped either way); once the group's error word holds any error, later
 * barriers do not wait (results are void; rebuild the group after a device-side error).
 */
#include <nccl.h>
#include <nccl_device.h>

#include "api.cuh"
#include "transport.cuh"

namespace nccl_ep {

__global__ void resolve_peers_kernel(ncclWindow_t window, int num_ranks, void** out) {
  int p = threadIdx.x + blockIdx.x * blockDim.x;
  // ncclGetPeerPointer maps a world rank to its LSA index (lsaRank + peer - worldRank); valid
  // because the host checked that the LSA team is the whole communicator.
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
  __shared__ unsigned long long epoch;
  __shared__ int skip_wait;
  if (threadIdx.x == 0) {
    epoch = *a.epoch + 1;
    // Any pending error (a timeout, or a capacity-mode routing error / overflow that every rank
    // detected on its own) means results are void until the group is rebuilt: do not wait, so
    // a rank that already raised on the host cannot stall the others.
    skip_wait = ld_volatile_int(&a.err->code) != kErrNone;
  }
  __syncthreads();
  const int p = threadIdx.x;
  if (p < a.num_ranks) {
    // Publish: everything this rank wrote before (earlier kernels on the stream) is ordered
    // before the flag by the fence + release store at system scope.
    fence_acq_rel_sys();
    unsigned long long* remote = reinterpret_cast<unsigned long long*>(
        reinterpret_cast<char*>(a.peers[p]) + a.flags_off) + a.rank;
    st_release_sys(remote, epoch);
    if (!skip_wait) {
      const unsigned long long* mine = reinterpret_cast<const unsigned long long*>(
          reinterpret_cast<const char*>(a.peers[a.rank]) + a.flags_off) + p;
      const unsigned long long start = global_timer_ns();
      int spins = 0;
      while (ld_acquire_sys(mine) < epoch) {
        if (++spins == 1024) {
          spins = 0;
          if ((long long)(global_timer_ns() - start) > a.timeout_ns) {
            raise_error(a.err, kErrTimeout, a.rank, p, a.tag, (long long)epoch,
                        a.timeout_ns / 1000000);
            break;
          }
          if (ld_volatile_int(&a.err->code) != kErrNone) break;  // gave up elsewhere
        }
      }
      fence_acq_rel_sys();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *a.epoch = epoch;
}

cudaError_t launch_barrier(const BarrierArgs& args, cudaStream_t stream) {
  barrier_kernel<<<1, kMaxRanks, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace nccl_ep
