/*
 * launch.cuh: the launch seam's dispatch from runtime sizes to templates. Each macro runs its
 * last argument (a statement) with type aliases bound for the case at hand:
 *   EP_LAUNCH_BY_UNIT(vec, dtype, U, stmt)      U: uint4 (16-byte path) or the element unit
 *   EP_LAUNCH_BY_DTYPE(vec, dtype, T, N, stmt)  T: the token type, N: elements per access
 *                                               (a 16-byte pack on the vector path, else 1)
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>

#include "device.cuh"

#define EP_LAUNCH_BY_UNIT(vec, dtype, U, ...)   \
  do {                                          \
    if (vec) {                                  \
      using U = uint4;                          \
      __VA_ARGS__;                              \
    } else if (::nccl_ep::elt_bytes(dtype) == 2) { \
      using U = unsigned short;                 \
      __VA_ARGS__;                              \
    } else {                                    \
      using U = unsigned int;                   \
      __VA_ARGS__;                              \
    }                                           \
  } while (0)

// N = packs of n_vec elements on the vector path, single elements otherwise.
#define EP_LAUNCH_PACKS(vec, N, n_vec, ...) \
  do {                                      \
    if (vec) {                              \
      constexpr int N = n_vec;              \
      __VA_ARGS__;                          \
    } else {                                \
      constexpr int N = 1;                  \
      __VA_ARGS__;                          \
    }                                       \
  } while (0)

#define EP_LAUNCH_BY_DTYPE(vec, dtype, T, N, ...)       \
  do {                                                  \
    if ((dtype) == (int)ncclBfloat16) {                 \
      using T = __nv_bfloat16;                          \
      EP_LAUNCH_PACKS(vec, N, 8, __VA_ARGS__);          \
    } else if ((dtype) == (int)ncclFloat16) {           \
      using T = __half;                                 \
      EP_LAUNCH_PACKS(vec, N, 8, __VA_ARGS__);          \
    } else {                                            \
      using T = float;                                  \
      EP_LAUNCH_PACKS(vec, N, 4, __VA_ARGS__);          \
    }                                                   \
  } while (0)
