/*
 * nccl_ep.h: public C API of megatron_nccl_ep, an expert-parallel dispatch/combine library over
 * NCCL, in the style of the NCCL EP paper. The contract (layout, arithmetic, handles) is
 * docs/design.md of the repository.
 *
 * NOTES:
 *  - Every call returns ncclResult_t. On failure, ncclEpGetLastError() returns a readable reason
 *    (thread-local) naming the argument and the expected value. No call aborts the process.
 *  - Every device operation is stream-ordered on the cudaStream_t it is given; none synchronizes
 *    the host except where documented: group creation and destroy; exact mode: the first call
 *    that needs a handle's receive count (ncclEpHandleGetNumRecvTokens, tokens per expert into
 *    host memory, or the handle's first op) waits for it, once; see also Nodes below.
 *  - Collective calls (group/handle create, dispatch, combine, combine of the weights) must be
 *    made by every rank of the group in the same order, like NCCL collectives. Ranks that do not
 *    make the same call fail with an error naming both calls; a rank that stops calling makes its
 *    peers fail after config.timeout_ms; never a hang.
 *  - Config and info structs are versioned: set .size = sizeof(struct) and .version =
 *    NCCL_EP_API_VERSION (the *_INITIALIZER macros do). A call refuses a struct whose version is
 *    not this library's or whose size is smaller (ncclInvalidArgument), so a caller built against
 *    another header fails with a clear error instead of a misread struct.
 *  - The library never allocates user-visible output memory: outputs are caller tensors. Internal
 *    device buffers come from alloc_fn/free_fn when given, else cudaMalloc; except the symmetric
 *    window of a node of several NCCL ranks (ncclMemAlloc) and group creation's temporary
 *    all-gather buffers (cudaMalloc). Error words and count readbacks are pinned host memory.
 *  - Threads: calls on one group may come from several threads; the group's host state is
 *    locked. The stream rule still holds (one stream per group, or order the streams yourself),
 *    and a handle must not be destroyed while an op that uses it is being called.
 *    ncclEpHandleDestroy is safe from any thread at any time otherwise (a garbage collector),
 *    also while the handle's ops still run on the stream (its buffers are reused in stream
 *    order). ncclEpGroupDestroy is not: no other call on the group or its handles may be in
 *    progress or follow it.
 *  - Nodes: ranks_per_node = G consecutive ranks per node (default: NCCL's LSA team, the ranks
 *    that reach each other's memory over NVLink). G < group size: tokens cross between nodes
 *    once per remote node that holds one of their experts over NCCL send/receive on a rail
 *    communicator (the ranks of the same index in every node) and fan out over NVLink inside the
 *    node; combine sums node by node
 *    (docs/design.md section 4). Those rail transfers and the routing all-gather are NCCL's:
 *    a watchdog thread of the group aborts its communicators (ncclCommAbort) when one has not
 *    finished timeout_ms after it started on the GPU, or when NCCL reports an error on its
 *    communicator first, and every later call returns that error. `comm` must not share
 *    resources with its splits (splitShare = 0, NCCL_COMM_SPLIT_SHARE_RESOURCES unset): the
 *    group's communicators are split from it, and a shared abort flag would stop `comm` too.
 *    One such NCCL step is in flight per group: a call waits on the host for the previous one;
 *    these calls refuse a capturing stream. A device-side error stops the node's ranks only; they
 *    still make their NCCL calls (outputs poisoned) and return the error after them; the other
 *    nodes learn it at the next handle creation.
 *  - Limits of this implementation (HT; the numbers are nccl_ep_limits.h's): group size <=
 *    NCCL_EP_MAX_RANKS, every node's ranks load/store accessible (its LSA team covers the node,
 *    else ncclInvalidUsage), min(max_topk, local experts) <= NCCL_EP_MAX_SLOTS_PER_RANK,
 *    num_experts <= NCCL_EP_MAX_EXPERTS, tokens bf16/fp16/fp32, group size x
 *    max_tokens_per_rank x max_topk < 2^31. The library must run on the NCCL major.minor it was
 *    compiled against (checked at group creation).
 *  - Limits of this implementation (LL, docs/design.md section 9): one node (every rank's window
 *    load/store accessible, or a local team); max_tokens_per_rank (T_max), max_topk and
 *    num_experts up to nccl_ep_limits.h's NCCL_EP_LL_MAX_*, hidden a multiple of
 *    NCCL_EP_LL_PACK_ELEMS (and of a payload's scale block: NCCL_EP_FP8_BLOCK for FP8). LL calls
 *    never synchronize the host; ops sent with send_only and not completed are bounded by the
 *    NCCL_EP_LL_BUFFER_SETS buffer sets of each kind (ncclInvalidUsage beyond: docs/design.md
 *    section 9, ll.cc NOTES).
 *  - Handle buffers come from a per-group pool reused in stream order.
 *  - Device-side errors (capacity mode routing errors and overflow, timeouts, call mismatches)
 *    go to a host-mapped error word of the group; every later call checks it without blocking
 *    and returns it. The error is sticky and spreads to the peers (their waits stop and report
 *    it): the group cannot synchronize again, destroy it and create a new one.
 */
#ifndef NCCL_EP_H_
#define NCCL_EP_H_

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include "nccl_ep_limits.h" /* the defaults and bounds (NCCL_EP_LL_MAX_TOKENS, ...) */

#ifdef __cplusplus
extern "C" {
#endif
/* The API is what libmegatron_nccl_ep.so exports, whatever visibility the library is built with. */
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

#define NCCL_EP_API_VERSION 6 /* 6: ncclEpGroupConfig_t.rail_capacity, ncclEpGroupInfo_t's rail
                                 counters */
#define NCCL_EP_MAX_NDIM 4

typedef struct ncclEpGroup* ncclEpGroup_t;
typedef struct ncclEpHandle* ncclEpHandle_t;

typedef enum {
  ncclEpModeHighThroughput = 0, /* HT: 2D expert-major layout, [total_recv_tokens, hidden] */
  ncclEpModeLowLatency = 1      /* LL: decode batches, double-buffered, no host sync
                                   (docs/design.md section 9) */
} ncclEpMode_t;

/* LL: the dispatch's output layout (docs/design.md section 9). */
typedef enum {
  ncclEpLayoutExpertMajor = 0,  /* recv [L, R x T_max, H] + recv_count [L] + recv_src */
  ncclEpLayoutRankMajor = 1     /* recv [R x T_max, H] + recv_topk_idx/weights + count [1] */
} ncclEpLayout_t;

/* LL: the type the dispatch moves rows in (docs/design.md section 9). */
typedef enum {
  ncclEpPayloadTokenDtype = 0,  /* token_dtype rows */
  ncclEpPayloadFloat8e4m3 = 1   /* float8 e4m3 rows (ncclFloat8e4m3) and one fp32 scale per
                                   NCCL_EP_FP8_BLOCK columns (recv_scales) */
} ncclEpPayloadDtype_t;

typedef enum {
  ncclEpRecvCountExact = 0,    /* N_d read to the host once, by the first call that needs it
                                  (ncclEpHandleGetNumRecvTokens, tokens per expert into host
                                  memory, or the handle's first op); creation does not wait */
  ncclEpRecvCountCapacity = 1, /* outputs sized by max_recv_tokens_per_rank; no host sync; a
                                  rank that would receive more rows stops the group (an error
                                  on every rank) */
  ncclEpRecvCountCapacityDrop = 2 /* capacity mode whose overflow is no error: rows past
                                  max_recv_tokens_per_rank are dropped (no row, never combined,
                                  0 in the probs' gradient) and tokens per expert still counts
                                  every block, so their sum is the rows the routing needed
                                  (docs/design.md section 3) */
} ncclEpRecvCountMode_t;

/* Role of a tensor in an operation (docs/design.md §6). */
typedef enum {
  NCCL_EP_TENSOR_TOKENS = 0,                      /* [T, H] or [N, H] token rows */
  NCCL_EP_TENSOR_TOPK_IDX = 1,                    /* [T, K] int32/int64, -1 = masked slot */
  NCCL_EP_TENSOR_TOPK_WEIGHTS = 2,                /* [T, K] routing probs, or [N] received probs */
  NCCL_EP_TENSOR_SCALES = 3,                      /* LL FP8: [..., H / NCCL_EP_FP8_BLOCK] fp32 */
  NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_DEVICE = 4,  /* [L] int64 on device */
  NCCL_EP_TENSOR_RECV_EXPERT_COUNTER_HOST = 5,    /* [L] int64 in host memory */
  NCCL_EP_TENSOR_TOKENS_PER_EXPERT = 6,           /* [L] int64 on device (alias role) */
  NCCL_EP_TENSOR_ROUTING_MAP = 7,                 /* [T, E] bool (uint8/int8), nonzero = routed */
  NCCL_EP_TENSOR_ROUTING_PROBS = 8,               /* [T, E] dense routing weights (a router's
                                                     probs): slot k reads column topk_idx[t, k] */
  NCCL_EP_TENSOR_RECV_COUNT = 9,                  /* LL: [L] or [1] int32 on device */
  NCCL_EP_TENSOR_RECV_SRC = 10                    /* LL expert-major: [L, R x T_max] int32 */
} ncclEpTensorTag_t;

/* A strided tensor view. Sizes/strides in elements, row-major conventions. */
typedef struct {
  void* data;
  int ndim;
  int64_t sizes[NCCL_EP_MAX_NDIM];
  int64_t strides[NCCL_EP_MAX_NDIM];
  ncclDataType_t dtype;
  ncclEpTensorTag_t tag;
} ncclEpTensor_t;

/* Memory callbacks for internal, non-symmetric device buffers. Return 0 on success; the memory
 * must be 256-byte aligned, as cudaMalloc's is (group creation fails otherwise). */
typedef int (*ncclEpAllocFn_t)(void** ptr, size_t bytes, void* ctx);
typedef int (*ncclEpFreeFn_t)(void* ptr, void* ctx);

typedef struct {
  size_t size;              /* sizeof(ncclEpGroupConfig_t) */
  unsigned int version;     /* NCCL_EP_API_VERSION */
  ncclEpMode_t mode;
  int num_experts;          /* E, multiple of the group size */
  int hidden;               /* H */
  int max_tokens_per_rank;  /* upper bound on T per handle; routing records and handle buffers
                               are sized by it (staging is not) */
  int max_topk;             /* upper bound on K; min(K, num_experts / ranks) <= 32 */
  ncclDataType_t token_dtype;     /* ncclBfloat16, ncclFloat16, ncclFloat32 */
  ncclEpRecvCountMode_t recv_count_mode;
  int64_t max_recv_tokens_per_rank; /* capacity mode: rows of every dispatch output */
  int expert_alignment;     /* A >= 1: pad each expert block to a multiple of A rows */
  int num_sms;              /* SM budget per operation (0 = library default) */
  int64_t timeout_ms;       /* device-side waits (and, over nodes, the watchdog's NCCL steps)
                               fail with ncclSystemError after this */
  ncclEpAllocFn_t alloc_fn; /* NULL = cudaMalloc */
  ncclEpFreeFn_t free_fn;   /* NULL = cudaFree */
  void* alloc_ctx;
  /* Staging: every op moves tokens through a ring per (channel, peer) of staging_depth slots of
   * staging_chunk_tokens tokens (channels = num_sms), so staging memory does not grow with
   * max_tokens_per_rank. 0 = library default (ncclEpGroupGetInfo reports what was chosen);
   * staging_depth is 0 or >= 2 (the combine sends chunk j while it sums chunk j - 1). */
  int staging_chunk_tokens;
  int staging_depth;
  /* G: ranks per node, consecutive ranks (node = rank / G), a divisor of the group size. 0 = NCCL's
   * LSA team size (one node when every rank reaches every other over NVLink; an LSA team that
   * does not divide the group is refused). Set smaller to emulate nodes (G = 1: every transfer
   * goes over the rail). A local team is one node: 0 or its size. */
  int ranks_per_node;
  /* C > 0: the fixed-capacity ("drop-and-pad") layout. Each local expert's block holds R runs of
   * C rows, one per source rank in rank order (then padded to expert_alignment): a source's slots
   * for an expert past the C-th, in token order, are dropped (masked everywhere: not sent, not
   * summed, 0 in the probs' gradient), and rows no slot fills are zero. Every dispatch output
   * then has L x roundup(R x C, expert_alignment) rows, and tokens_per_expert is that block
   * size; capacity mode needs max_recv_tokens_per_rank to equal it. 0 = off. */
  int expert_capacity;
  /* LL (mode ncclEpModeLowLatency): max_tokens_per_rank is T_max; the HT-only fields keep their
   * initializer values. payload_dtype: the type the dispatch moves rows in (FP8: cast per
   * NCCL_EP_FP8_BLOCK columns, hidden a multiple of it); combine stays in token_dtype. */
  ncclEpLayout_t layout;
  ncclEpPayloadDtype_t payload_dtype;
  /* B: groups that span nodes in capacity mode: every rail message of the dispatch (and the
   * messages back) has B token rows, whatever the routing (no host read). A source's tokens
   * with a slot on a remote node beyond B are an error on every rank (reported like capacity
   * overflow, whatever recv_count_mode says about the dispatch output). 0 = max_tokens_per_rank
   * (never overflows); at most max_tokens_per_rank. Exact mode sizes each message to its tokens
   * (0 there). */
  int rail_capacity;
} ncclEpGroupConfig_t;

#define NCCL_EP_GROUP_CONFIG_INITIALIZER                                                  \
  {                                                                                       \
    sizeof(ncclEpGroupConfig_t), NCCL_EP_API_VERSION, ncclEpModeHighThroughput, 0, 0, 0, \
        0, ncclBfloat16, ncclEpRecvCountExact, 0, 1, 0, NCCL_EP_DEFAULT_TIMEOUT_MS, NULL,   \
        NULL, NULL, 0, 0, 0, 0,                                                           \
        ncclEpLayoutExpertMajor, ncclEpPayloadTokenDtype, 0                               \
  }

/* What a group allocated (ncclEpGroupGetInfo). */
typedef struct {
  size_t size;               /* sizeof(ncclEpGroupInfo_t), set by the caller */
  unsigned int version;      /* NCCL_EP_API_VERSION, set by the caller */
  int num_ranks, rank;
  int channels;              /* CTAs per op (the SM budget) */
  int staging_chunk_tokens;  /* tokens per ring slot */
  int staging_depth;         /* ring slots per (channel, peer) */
  size_t window_bytes;       /* the symmetric buffer of this rank, all of it */
  size_t staging_bytes;      /* its token and prob rings (independent of max_tokens_per_rank) */
  size_t routing_bytes;      /* its routing records: 2 x ranks per node records of a 4-int
                                header and max_tokens_per_rank x max_topk int32 ids (rounded
                                up) */
  size_t handle_bytes;       /* device memory of one handle (pooled, reused) */
  int ranks_per_node;        /* G as resolved (the group size: one node) */
  size_t rail_bytes;         /* G < group size: the buffers of the rail transfers */
  /* G < group size: what this rank's ops handed to NCCL on the rail since group creation, per
   * op (0 dispatch, 1 combine, 2 combine of the weights): token rows (one per token and remote
   * node, probs included) and bytes (rows, and the probs' 8-byte slots). Exact mode counts the
   * tokens with a slot on the remote node; capacity mode rail_capacity rows per remote node. */
  uint64_t rail_rows_sent[3];
  uint64_t rail_bytes_sent[3];
} ncclEpGroupInfo_t;

#define NCCL_EP_GROUP_INFO_INITIALIZER                                                  \
  {                                                                                     \
    sizeof(ncclEpGroupInfo_t), NCCL_EP_API_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
        {0, 0, 0}, {0, 0, 0}                                                            \
  }

/* Bytes a configuration allocates on each rank (ncclEpGetMemorySize), without a communicator. */
typedef struct {
  size_t size;            /* sizeof(ncclEpMemorySize_t), set by the caller */
  unsigned int version;   /* NCCL_EP_API_VERSION, set by the caller */
  size_t window_bytes;    /* the symmetric window (ncclMemAlloc over NCCL) */
  size_t device_bytes;    /* alloc_fn / cudaMalloc memory at group creation, preallocated
                             handle buffers included */
  size_t handle_bytes;    /* device memory of one handle (pooled) */
  size_t total_bytes;     /* window_bytes + device_bytes */
} ncclEpMemorySize_t;

#define NCCL_EP_MEMORY_SIZE_INITIALIZER \
  { sizeof(ncclEpMemorySize_t), NCCL_EP_API_VERSION, 0, 0, 0, 0 }

/* Dispatch: tokens (and optionally their routing weights) to the expert-major layout. */
typedef struct {
  ncclEpTensor_t tokens;        /* TOKENS [T, H], T as in the handle */
  ncclEpTensor_t topk_weights;  /* TOPK_WEIGHTS [T, K] in slot order, or ROUTING_PROBS [T, E]
                                  dense; ndim 0 = no weights (an empty tensor's data may be
                                  NULL, so NULL does not mean absent) */
} ncclEpDispatchInputs_t;

typedef struct {
  ncclEpTensor_t recv_tokens;        /* TOKENS [N, H] (N = num recv tokens, or capacity); LL:
                                        [L, R x T_max, H] or [R x T_max, H] of the payload's
                                        type */
  ncclEpTensor_t recv_topk_weights;  /* TOPK_WEIGHTS [N], dtype of topk_weights; ndim 0 if none;
                                        LL rank-major: [R x T_max, max_topk] fp32 */
  /* LL only (ndim 0 in HT): */
  ncclEpTensor_t recv_scales;        /* SCALES [L, R x T_max, H/B] / [R x T_max, H/B] fp32 (a
                                        payload with scales, B = its block: FP8) */
  ncclEpTensor_t recv_count;         /* RECV_COUNT int32 [L] (expert-major) or [1] */
  ncclEpTensor_t recv_src;           /* RECV_SRC int32 [L, R x T_max] (expert-major) */
  ncclEpTensor_t recv_topk_idx;      /* TOPK_IDX int32 [R x T_max, max_topk] (rank-major) */
} ncclEpDispatchOutputs_t;

/* Combine: expert outputs in the layout back to the source tokens, unweighted (docs/design.md §4). */
typedef struct {
  ncclEpTensor_t expert_tokens;  /* TOKENS [N, H]; LL: in the dispatch's layout, the token
                                    dtype or fp32 (rounded to it as read) */
  ncclEpTensor_t topk_weights;   /* LL expert-major: TOPK_WEIGHTS [T, K] fp32 (ndim 0 in HT and
                                    LL rank-major) */
} ncclEpCombineInputs_t;

typedef struct {
  ncclEpTensor_t tokens;  /* TOKENS [T, H] */
} ncclEpCombineOutputs_t;

typedef struct {
  size_t size;           /* sizeof(ncclEpOpConfig_t) */
  unsigned int version;  /* NCCL_EP_API_VERSION */
  int send_only;         /* LL: only send; ncclEpComplete receives (HT: must be 0) */
} ncclEpOpConfig_t;

#define NCCL_EP_OP_CONFIG_INITIALIZER { sizeof(ncclEpOpConfig_t), NCCL_EP_API_VERSION, 0 }

/* Reason for the last failed call on this thread ("" if none). */
const char* ncclEpGetLastError(void);
/* The API version the library was built with (its NCCL_EP_API_VERSION). */
ncclResult_t ncclEpGetVersion(int* version);

/* Collective over comm: checks the config is identical on every rank, allocates the symmetric
 * buffers, maps the NVLink peers; a group that spans nodes also splits its node, rail and op
 * communicators from comm. comm stays owned by the caller and must outlive the group.
 * Its NCCL collectives are not timed (as ncclCommInitRank is not; over nodes the last one, which
 * connects the rail and the routing all-gather, runs under the watchdog): a rank that never calls
 * it holds the others. Callers that need a deadline agree first (the Python Group does, through
 * the process group's store). */
ncclResult_t ncclEpCreateGroup(ncclEpGroup_t* group, ncclComm_t comm,
                               const ncclEpGroupConfig_t* config, cudaStream_t stream);
/* A whole group of nranks ranks inside this process, on the current device, without NCCL:
 * groups[r] is rank r, and the ranks reach each other's windows through plain device memory.
 * For development and tests on one GPU (every device code path of a one-node multi-rank group
 * runs). Each rank needs its own host thread and non-blocking stream; nranks x the SM budget
 * must fit on the GPU (every CTA must be resident at once), and the streams must reach the GPU on
 * separate hardware queues: set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts (at least 2 x
 * nranks is checked). The members' collective calls (HT handle creation, dispatch, combine,
 * combine of the weights; LL dispatch, combine, complete) pass a host gate: a call enqueues
 * nothing before every member entered it and returns only when every member has enqueued it
 * (ncclSystemError naming the missing ranks after timeout_ms, counted on the host from the
 * caller's entry). So each member's thread may do anything between its calls, waits for the
 * whole device included (lazy kernel loads, allocations, cudaFree, synchronizations); another
 * thread of the process may not wait for the whole device while members are inside a call. CUDA
 * graphs: every rank captures its calls at once, in thread-local capture mode, with no wait for
 * the whole device while a peer captures; a replay runs the calls without the gate, so replay
 * every rank's graph between two meetings of the ranks' threads. Destroy every member; the
 * windows are freed with the last one. */
ncclResult_t ncclEpCreateLocalTeam(ncclEpGroup_t* groups, int nranks,
                                   const ncclEpGroupConfig_t* config, cudaStream_t stream);
/* What the group allocated and chose (staging sizes, channels). Not collective. */
ncclResult_t ncclEpGroupGetInfo(ncclEpGroup_t group, ncclEpGroupInfo_t* info);
/* Frees everything the group and its live handles hold (synchronizes the device first). Not
 * collective on one node (NCCL's window deregistration is local); a group that spans nodes also
 * destroys the node, rail and op communicators it split (aborts them after an error), which NCCL
 * may not finish before the peers destroy theirs. Call it after the group's last op and before
 * destroying comm. */
ncclResult_t ncclEpGroupDestroy(ncclEpGroup_t group);

/* Collective: exchanges the routing of one forward pass and builds the row maps (layout:
 * docs/design.md §3/§4), all on the stream, with no host wait: on one node the routing records
 * travel through the symmetric window under the group's timed barrier, no NCCL collective; a
 * group that spans nodes all-gathers them with NCCL over its op communicator, under the
 * watchdog.
 * routing, by its tag: TOPK_IDX [T, K] (int32/int64, -1 = masked slot), K <= max_topk; or
 * ROUTING_MAP [T, E] (a router's dense boolean map): each token's routed experts, in ascending
 * order, fill K = max_topk slots (-1 after the last), as ncclEpHandleGetTopkIdx returns them; a
 * token with more than max_topk routed experts is an error. T <= max_tokens_per_rank. Exact
 * mode: the receive count is read to the host by the first call that needs it
 * (ncclEpHandleGetNumRecvTokens, tokens per expert on the host, or the handle's first op), which
 * also returns bad routing (expert out of range, duplicate expert in a token, too many experts
 * in a routing-map row) as ncclInvalidArgument on every rank; in capacity mode those are
 * reported by the next call that synchronizes (ncclEpGroupCheckErrors) and stop the group. A
 * routing shape out of bounds (T > max_tokens_per_rank, K outside [1, max_topk]) is an error on
 * every rank the same way; in capacity mode the rank that gave it waits for it and returns it.
 * CUDA graphs: in capacity mode (and in LL mode) handle creation and the handle's ops may be
 * captured and replayed with new routing and inputs; a handle created during a capture keeps its
 * buffers out of the group's pool until every graph holding it is destroyed, also after
 * ncclEpHandleDestroy (destroy those graphs before the group). An exact-mode handle inside a
 * capture is ncclInvalidUsage (its receive count is read on the host). */
ncclResult_t ncclEpCreateHandle(ncclEpHandle_t* handle, ncclEpGroup_t group,
                                const ncclEpTensor_t* routing, const ncclEpOpConfig_t* config,
                                cudaStream_t stream);
ncclResult_t ncclEpHandleDestroy(ncclEpHandle_t handle);

/* Rows of this rank's dispatch output: exact mode N_d (the first call waits for the handle's
 * layout, later ones return at once); capacity mode max_recv_tokens_per_rank. Returns the
 * handle's routing error or (on one node) a pending device-side error of the group, if any; over
 * nodes that comes with the next op, after its NCCL calls. */
ncclResult_t ncclEpHandleGetNumRecvTokens(ncclEpHandle_t handle, int64_t* num_recv_tokens);
/* Copies tokens_per_expert [L] int64 into out (RECV_EXPERT_COUNTER_DEVICE or TOKENS_PER_EXPERT:
 * device memory, stream-ordered; RECV_EXPERT_COUNTER_HOST: host memory). Each count is the
 * expert's block including its alignment padding rows, so sum == N_d (docs/design.md §3). The
 * host tag reads the exact-mode readback (waiting for it once, as the receive count does); in
 * capacity mode it synchronizes the stream. */
ncclResult_t ncclEpHandleGetTokensPerExpert(ncclEpHandle_t handle, ncclEpTensor_t* out,
                                            cudaStream_t stream);

/* This rank's routing as top-k ids into out: TOPK_IDX [T, K] contiguous int32/int64,
 * stream-ordered (for a handle made from a routing map: the slots its probabilities take). */
ncclResult_t ncclEpHandleGetTopkIdx(ncclEpHandle_t handle, ncclEpTensor_t* out,
                                    cudaStream_t stream);

/* Collective, stream-ordered. Writes every row of outputs (padding rows zero, prob 0). */
ncclResult_t ncclEpDispatch(ncclEpHandle_t handle, const ncclEpDispatchInputs_t* inputs,
                            ncclEpDispatchOutputs_t* outputs, const ncclEpOpConfig_t* config,
                            cudaStream_t stream);
/* Collective, stream-ordered. y[t] = sum over ranks ascending of (sum over slots ascending). */
ncclResult_t ncclEpCombine(ncclEpHandle_t handle, const ncclEpCombineInputs_t* inputs,
                           ncclEpCombineOutputs_t* outputs, const ncclEpOpConfig_t* config,
                           cudaStream_t stream);
/* Collective, stream-ordered. Reverse of dispatch for the routing weights (autograd of probs):
 * grad_topk_weights[t, k] = grad_recv_topk_weights[row(s, t, k)], 0 for masked slots; with a
 * ROUTING_PROBS [T, E] output, column e of each routed expert e, 0 elsewhere. */
ncclResult_t ncclEpCombineTopkWeights(ncclEpHandle_t handle,
                                      const ncclEpTensor_t* grad_recv_topk_weights,
                                      ncclEpTensor_t* grad_topk_weights, cudaStream_t stream);
/* LL: receives the handle's dispatch or combine sent with send_only = 1 and writes its outputs
 * (stream-ordered; ncclInvalidUsage when none is pending). HT: no-op returning ncclSuccess. */
ncclResult_t ncclEpComplete(ncclEpHandle_t handle, cudaStream_t stream);

/* Not collective, no communicator: what ncclEpCreateGroup (nranks ranks, one node) would
 * allocate on each rank for config (checked as group creation checks it). */
ncclResult_t ncclEpGetMemorySize(const ncclEpGroupConfig_t* config, int nranks,
                                 ncclEpMemorySize_t* size);

/* Returns the group's device-side error (timeout, a peer's error, capacity overflow, bad
 * routing) or the watchdog's stop of an NCCL step between nodes, with its reason; it stays (the
 * group must be destroyed). Non-blocking: it reads the host-mapped error words, so synchronize
 * the stream first for a complete check. */
ncclResult_t ncclEpGroupCheckErrors(ncclEpGroup_t group);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
#ifdef __cplusplus
}
#endif

#endif /* NCCL_EP_H_ */
