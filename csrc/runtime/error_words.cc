/*
 * error_words.cc: the decoding of a group's device-side error words (kernels/protocol.cuh
 * ErrorInfo) into the thread-local message (errors.h), worded like the reference backend's, so
 * both backends read alike. Op kinds and wait kinds come from the protocol's enums; a watchdog
 * stop names its NCCL step (watchdog.h).
 */
#include <stdio.h>

#include <string>

#include "internal.h"
#include "watchdog.h"  // the NCCL steps a watchdog stop names

namespace nccl_ep {

static const char* op_name(int op) {
  switch (op) {
    case kOpCreateHandle: return "create_handle";
    case kOpDispatch: return "dispatch";
    case kOpCombine: return "combine";
    case kOpCombineProbs: return "combine_probs";
    case kOpLLDispatch: return "LL dispatch";
    case kOpLLCombine: return "LL combine";
    case kOpLLHandle: return "LL handle creation";
    default: return "an unknown call";
  }
}

// "dispatch (with probs of 4 bytes) of handle #3", from a call_signature().
static std::string describe_call(unsigned call) {
  const OpKind op = call_op(call);
  const int prob_bytes = call_prob_bytes(call);
  std::string s = op_name(op);
  if (op == kOpDispatch && prob_bytes == 0) s += " (without probs)";
  if (prob_bytes != 0) s += " (with probs of " + std::to_string(prob_bytes) + " bytes)";
  return s + " of handle #" + std::to_string(call_handle(call));
}

// What the waiter waited for, with where (channel, chunk) when the wait was in an op.
static std::string describe_wait(const ErrorInfo& e) {
  const int channel = (int)(e.where >> 32), chunk = (int)(e.where & 0xffffffff);
  const std::string at = e.where < 0 ? "" : " (channel " + std::to_string(channel) + ", chunk " +
                                                (chunk >= (int)kAllChunks - 1
                                                     ? std::string("final")
                                                     : std::to_string(chunk)) + ")";
  switch (e.aux) {
    case kWaitBarrier: return std::string("at the barrier of ") + op_name(e.slot);
    case kWaitReady: return std::string("for its data in ") + op_name(e.slot) + at;
    case kWaitCredit: return std::string("for free staging in ") + op_name(e.slot) + at;
    default: return "";
  }
}

ncclResult_t report_error(const ncclEpGroup* g, const ErrorInfo& word, const LayoutMeta* meta) {
  ErrorInfo e = word;
  if (e.code == kErrTimeout || e.code == kErrPeerAbort || e.code == kErrCallMismatch) {
    // Written by the exchange engine, which numbers the ranks of its node.
    e.rank += g->node * g->node_size;
    e.token += g->node * g->node_size;
  }
  char where[64] = "";
  if (g->nranks > 1) snprintf(where, sizeof(where), " (rank %d)", e.rank);
  switch (e.code) {
    case kErrExpertRange:
      if (e.aux == kRecordRoutingMap) {
        set_error("routing_map row %d routes to %lld experts, more than max_topk=%d of this "
                  "group%s",
                  e.token, -1 - e.value, g->cfg.max_topk, where);
        return ncclInvalidArgument;
      }
      set_error("topk_idx[%d, %d] = %lld is out of range: expert ids must be in [-1, %lld) "
                "(-1 = masked slot)%s",
                e.token, e.slot, e.value, e.extra, where);
      return ncclInvalidArgument;
    case kErrDuplicateExpert:
      set_error("topk_idx token %d names expert %lld twice: a token may route to each expert at "
                "most once%s",
                e.token, e.value, where);
      return ncclInvalidArgument;
    case kErrTopkMismatch: {
      std::string ks;
      if (meta != nullptr) {
        for (int s = 0; s < g->nranks; ++s) ks += (s ? ", " : "") + std::to_string(meta->ks[s]);
      } else {
        ks = "rank " + std::to_string(e.rank) + ": " + std::to_string(e.value) + ", this rank: " +
             std::to_string(e.extra);
      }
      set_error("topk_idx top-k differs across ranks: [%s]; every rank must route with the same "
                "top-k",
                ks.c_str());
      return ncclInvalidArgument;
    }
    case kErrShape:
      if (e.slot == 0)
        set_error("%s has %lld tokens, more than max_tokens_per_rank=%lld of this group%s",
                  e.aux == kRecordRoutingMap ? "routing_map" : "topk_idx", e.value, e.extra,
                  where);
      else
        set_error("topk_idx has top-k %lld, expected 1 <= top-k <= max_topk=%lld%s", e.value,
                  e.extra, where);
      return ncclInvalidArgument;
    case kErrPeerAbort:
      set_error("rank %d stopped this group after a device-side error (reported there: a "
                "timeout, an NCCL error between nodes, a routing error, a capacity overflow or "
                "inconsistent calls), seen in "
                "%s; the ranks can no longer synchronize: destroy the group and create a new "
                "one%s",
                e.token, op_name(e.slot), where);
      return ncclSystemError;
    case kErrRemoteAbort:
      set_error("rank %lld's record says its node stopped after a device-side error of rank %d "
                "(a timeout, a routing error, a capacity overflow or inconsistent calls; reported "
                "there), seen in the routing exchange of a handle creation; the ranks can no "
                "longer synchronize: destroy the group and create a new one%s",
                e.value, e.token, where);
      return ncclSystemError;
    case kErrCallMismatch:
      set_error("inconsistent collective calls across ranks: rank %d called %s while rank %d "
                "called %s (handle #n = the n-th handle this group created, counted from 0); "
                "every rank must make the same calls, with the same handles, in the same order. "
                "The group is stopped: destroy it and create a new one",
                e.rank, describe_call((unsigned)e.value).c_str(), e.token,
                describe_call((unsigned)e.extra).c_str());
      return ncclSystemError;
    case kErrCapacity:
      set_error("capacity overflow: rank %d would receive %lld rows but "
                "max_recv_tokens_per_rank=%lld; raise the capacity (or capacity factor) or use "
                "exact mode",
                e.rank, e.value, e.extra);
      return ncclSystemError;
    case kErrRailCapacity:
      set_error("rail capacity overflow: rank %d has %lld tokens with a slot on node %d but "
                "rail_capacity=%lld tokens per message between nodes; raise rail_capacity (0 = "
                "max_tokens_per_rank, which never overflows) or use exact mode",
                e.rank, e.value, e.token, e.extra);
      return ncclSystemError;
    case kErrNcclTimeout:
    case kErrNcclFailed: {
      // Who it waited for: the rail's peers (this index in the other nodes), or, in the routing
      // all-gather, every other rank (the first 8 named).
      std::string peers;
      int n = 0;
      for (int r = 0; r < g->nranks; ++r) {
        const bool peer = e.aux == kStepRail ? r % g->node_size == g->node_rank && r != e.rank
                                             : r != e.rank;
        if (!peer) continue;
        if (n < 8) peers += (n ? ", " : "") + std::to_string(r);
        ++n;
      }
      if (n > 8) peers += " and " + std::to_string(n - 8) + " more";
      const char* what = e.aux == kStepRail           ? "the rail's send/receive"
                         : e.aux == kStepRoutingGather ? "the routing all-gather"
                                                       : "connecting the rail and the all-gather";
      char failure[160];
      if (e.code == kErrNcclTimeout)
        snprintf(failure, sizeof(failure), "timed out after %lld ms", e.value);
      else
        snprintf(failure, sizeof(failure), "failed (NCCL: %s)",
                 ncclGetErrorString((ncclResult_t)e.value));
      set_error("NCCL exchange between nodes %s: rank %d waited for %s %s (%s) in %s; every rank "
                "must make the same collective calls in the same order (a rank may have failed, "
                "returned early, exited or be blocked). The group's NCCL communicators were "
                "stopped: destroy the group and create a new one",
                failure, e.rank, n == 1 ? "rank" : "ranks", peers.c_str(), what,
                e.aux == kStepConnect ? "ncclEpCreateGroup" : op_name(e.slot));
      return ncclSystemError;
    }
    case kErrTimeout:
      set_error("device-side wait timed out after %lld ms: rank %d waited for rank %d %s (op "
                "epoch %lld); every rank must make the same collective calls in the same order "
                "(rank %d may have failed, exited or be blocked). The group is stopped: destroy "
                "it and create a new one",
                e.extra, e.rank, e.token, describe_wait(e).c_str(), e.value, e.token);
      return ncclSystemError;
    default:
      set_error("device-side error code %d (rank %d)", e.code, e.rank);
      return ncclInternalError;
  }
}

}  // namespace nccl_ep
