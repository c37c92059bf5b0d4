/*
 * call_checks.h: each op's argument checks against what its group and handle fix: a host-only
 * comparison of the call's tensors (ncclEpTensor_t: shape, strides, dtype, tag, address) with
 * a CallShape, which reads no device and no group state. The ops run them before they enqueue
 * anything (ops.cc, ll.cc, handle.cc: the only statement of these rules); the bindings' check_*
 * functions (_C) run the same functions on host tensors, so that a machine without a GPU drives
 * the front end's lean path (megatron_nccl_ep/backend.py, checked_call) with the library's own
 * checks and messages (tests/test_lean_path.py).
 *
 * NOTES:
 *  - Not part of the public API (nccl_ep.h): the library exports these four functions under
 *    these names only for _C (setup.py's version script; tests/test_cuda_extension.py).
 *  - A failed check sets the message ncclEpGetLastError returns, as every C entry point does.
 */
#pragma once

#include "../include/nccl_ep.h"

namespace nccl_ep {

// What one op's arguments are checked against: its group's configuration and size, and its
// handle's shape (handle creation reads only the group's).
struct CallShape {
  const ncclEpGroupConfig_t* cfg = nullptr;
  int nranks = 1;
  long long num_tokens = 0, topk = 0;  // the handle's T and K
  long long num_recv = 0;  // HT: rows of a dispatch output (exact mode: N_d, else the capacity)
};

}  // namespace nccl_ep

extern "C" {
#pragma GCC visibility push(default)
// ncclEpCreateHandle's checks of the routing (HT: topk_idx [T, K] or a routing map [T, E]
// by its tag; LL: topk_idx [T, K] within the group's bounds).
ncclResult_t megatron_nccl_ep_check_routing(const nccl_ep::CallShape* s,
                                            const ncclEpTensor_t* routing);
// ncclEpDispatch's checks of its tensors (HT or LL by the configuration's mode).
ncclResult_t megatron_nccl_ep_check_dispatch(const nccl_ep::CallShape* s,
                                             const ncclEpDispatchInputs_t* inputs,
                                             const ncclEpDispatchOutputs_t* outputs);
// ncclEpCombine's checks of its tensors (HT or LL by the configuration's mode).
ncclResult_t megatron_nccl_ep_check_combine(const nccl_ep::CallShape* s,
                                            const ncclEpCombineInputs_t* inputs,
                                            const ncclEpCombineOutputs_t* outputs);
// ncclEpCombineTopkWeights's checks of its tensors (HT).
ncclResult_t megatron_nccl_ep_check_combine_probs(const nccl_ep::CallShape* s,
                                                  const ncclEpTensor_t* grad_recv_topk_weights,
                                                  const ncclEpTensor_t* grad_topk_weights);
#pragma GCC visibility pop
}
