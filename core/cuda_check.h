// Checks for CUDA runtime and cuBLAS calls and kernel launches.
//
// Each macro turns a failed call into statescan::Error (argument "cuda" or
// "cublas", the failing expression, the error name and file:line), so a
// failure surfaces as an exception in the caller's rank instead of a silent
// sticky error. Only CUDA translation units and CUDA builds include this.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

// Throws statescan::Error unless `expr` returns cudaSuccess.
#define SS_CUDA_CHECK(expr)                                                        \
  do {                                                                             \
    const cudaError_t ss_cuda_status_ = (expr);                                    \
    if (ss_cuda_status_ != cudaSuccess) {                                          \
      SS_FAIL("cuda", #expr, " failed: ", cudaGetErrorName(ss_cuda_status_), " (", \
              cudaGetErrorString(ss_cuda_status_), ")");                           \
    }                                                                              \
  } while (0)

// Throws statescan::Error unless the cuBLAS call `expr` returns
// CUBLAS_STATUS_SUCCESS. Needs <cublas_v2.h> included before use.
#define SS_CUBLAS_CHECK(expr)                                                            \
  do {                                                                                   \
    const cublasStatus_t ss_cublas_status_ = (expr);                                     \
    if (ss_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                    \
      SS_FAIL("cublas", #expr, " failed: status ", static_cast<int>(ss_cublas_status_)); \
    }                                                                                    \
  } while (0)

// After a kernel launch: throws on a launch error (bad configuration, too much
// shared memory, ...). With STATESCAN_SYNC_LAUNCHES (debug builds) it also
// synchronises the device so that an error inside the kernel is reported at
// the launch that caused it rather than at some later call.
#ifdef STATESCAN_SYNC_LAUNCHES
#define SS_LAUNCH_CHECK(name)                                                                  \
  do {                                                                                         \
    const cudaError_t ss_launch_status_ = cudaGetLastError();                                  \
    if (ss_launch_status_ != cudaSuccess)                                                      \
      SS_FAIL("cuda", "launch of ", name, " failed: ", cudaGetErrorString(ss_launch_status_)); \
    const cudaError_t ss_sync_status_ = cudaDeviceSynchronize();                               \
    if (ss_sync_status_ != cudaSuccess)                                                        \
      SS_FAIL("cuda", "kernel ", name, " failed: ", cudaGetErrorString(ss_sync_status_));      \
  } while (0)
#else
#define SS_LAUNCH_CHECK(name)                                                                  \
  do {                                                                                         \
    const cudaError_t ss_launch_status_ = cudaGetLastError();                                  \
    if (ss_launch_status_ != cudaSuccess)                                                      \
      SS_FAIL("cuda", "launch of ", name, " failed: ", cudaGetErrorString(ss_launch_status_)); \
  } while (0)
#endif
