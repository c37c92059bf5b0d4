/*
 * nccl_ep_limits.h: the defaults and bounds of this implementation, each written once here as a
 * plain integer macro (nothing else goes in this file: megatron_nccl_ep/limits.py reads it, so
 * the Python checks and the reference backend hold the values the library is built with).
 */
#ifndef NCCL_EP_LIMITS_H_
#define NCCL_EP_LIMITS_H_

#define NCCL_EP_DEFAULT_NUM_SMS 24        /* SM budget per op when num_sms is 0 */
#define NCCL_EP_DEFAULT_TIMEOUT_MS 100000 /* the group config initializer's timeout_ms */
#define NCCL_EP_MAX_SLOTS_PER_RANK 32     /* HT: min(max_topk, local experts), a lane each */
#define NCCL_EP_LL_MAX_TOKENS 1024        /* LL: T_max (the handle kernel's shared memory) */
#define NCCL_EP_LL_MAX_TOPK 32            /* LL: max_topk */
#define NCCL_EP_LL_MAX_EXPERTS 4096       /* LL: num_experts */
#define NCCL_EP_FP8_BLOCK 128             /* LL dispatch_fp8: columns per scale */

#endif /* NCCL_EP_LIMITS_H_ */
