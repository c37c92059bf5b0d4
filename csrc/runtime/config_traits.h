/*
 * config_traits.h: what a group configuration implies by itself, read from ncclEpGroupConfig_t
 * alone (no group state): its mode, its capacity mode, an LL dispatch's payload format and an
 * expert block's rows. Below internal.h, so that the argument checks (call_checks.cc) read the
 * configuration without the group's state; payload_format and expert_block_rows are config.cc's.
 */
#pragma once

#include "../include/nccl_ep.h"

namespace nccl_ep {

inline bool is_ll(const ncclEpGroupConfig_t& c) { return c.mode == ncclEpModeLowLatency; }
// Capacity mode, whatever it does with an overflow (ncclEpRecvCountCapacity, ...CapacityDrop).
inline bool is_capacity_mode(const ncclEpGroupConfig_t& c) {
  return c.recv_count_mode == ncclEpRecvCountCapacity ||
         c.recv_count_mode == ncclEpRecvCountCapacityDrop;
}
// An LL dispatch payload's wire format: its element type and bytes (0: not a payload type) and
// the columns per fp32 scale (0: no scales). The one statement of what each
// ncclEpPayloadDtype_t moves: the window's messages, the outputs' checks and the kernel's cast
// follow it.
struct PayloadFormat {
  ncclDataType_t dtype;
  int elem_bytes;
  int scale_block;
};
PayloadFormat payload_format(const ncclEpGroupConfig_t& c);
// expert_capacity: roundup(nranks x C, expert_alignment), the rows of a local expert's block.
long long expert_block_rows(const ncclEpGroupConfig_t& c, int nranks);

}  // namespace nccl_ep
