/*
 * nccl_ep_limits.h: the defaults and bounds of this implementation and the numbers of its contract
 * that the C library and Python both use, each written once here (docs/design.md section 1,
 * "Where to change what"). Nothing else goes in this file: megatron_nccl_ep/limits.py reads it,
 * so the Python checks and the reference backend hold the values the library is built with.
 * Every macro is a plain integer, or a float as a C hex-float literal (exact in C and in
 * Python's float.fromhex).
 */
#ifndef NCCL_EP_LIMITS_H_
#define NCCL_EP_LIMITS_H_

/* Defaults (a config field's 0, or the initializer's value). */
#define NCCL_EP_DEFAULT_NUM_SMS 24        /* SM budget per op when num_sms is 0 */
#define NCCL_EP_DEFAULT_TIMEOUT_MS 100000 /* the group config initializer's timeout_ms */
#define NCCL_EP_DEFAULT_STAGING_DEPTH 2   /* HT: ring slots per (channel, peer), staging_depth 0 */

/* Bounds of a group configuration. */
#define NCCL_EP_MAX_RANKS 64              /* group size (per-token destination masks: uint64) */
#define NCCL_EP_MAX_NUM_SMS 1024          /* num_sms: the CTAs of one op */
#define NCCL_EP_MAX_EXPERTS 65535         /* HT: num_experts */
#define NCCL_EP_MAX_EXPERT_ALIGNMENT 1048576 /* HT: expert_alignment (2^20) */
#define NCCL_EP_MAX_SLOTS_PER_RANK 32     /* HT: min(max_topk, local experts), a lane each */
#define NCCL_EP_MIN_STAGING_DEPTH 2       /* HT: staging_depth other than 0 (the combine sends
                                             chunk j while it sums chunk j - 1) */
#define NCCL_EP_MAX_STAGING_DEPTH 64      /* HT: staging_depth */
#define NCCL_EP_MAX_STAGING_CHUNK_TOKENS 65536 /* HT: staging_chunk_tokens */
#define NCCL_EP_LL_MAX_TOKENS 1024        /* LL: T_max (the handle kernel's shared memory) */
#define NCCL_EP_LL_MAX_TOPK 32            /* LL: max_topk */
#define NCCL_EP_LL_MAX_EXPERTS 4096       /* LL: num_experts */

/* LL protocol (docs/design.md section 9). */
#define NCCL_EP_LL_PACK_ELEMS 8           /* rows move in packs of this many elements (a lane's
                                             16 bytes of bf16): hidden is a multiple of it */
#define NCCL_EP_LL_BUFFER_SETS 2          /* the i-th op of a kind uses buffer set i mod this;
                                             so many ops of a kind may be in flight */

/* The LL FP8 payload's cast (ncclEpPayloadFloat8e4m3, docs/design.md section 9). */
#define NCCL_EP_FP8_BLOCK 128             /* columns per fp32 scale */
#define NCCL_EP_FP8_MAX 448               /* the largest finite float8 e4m3 */
#define NCCL_EP_FP8_AMAX_FLOOR 0x1.a36e2ep-14f /* 1e-4 rounded to float32: a block's amax is
                                                  taken at least this large */

#endif /* NCCL_EP_LIMITS_H_ */
