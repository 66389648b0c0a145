// The cuBLAS handles of the CUDA kernels (the CP summary's product tree and
// first-segment maps, the LaCT layer's GEMMs, Newton-Schulz): one per
// (host thread, device, slot), made on first use and kept for the thread's
// life.
//
// Why per thread: one handle shared by threads would race on its creation and
// on cublasSetStream, and one thread's GEMMs could land on another thread's
// stream. Why kept: cublasCreate costs far more than one LaCT chunk or one
// summary. Why never destroyed: a thread's handles would be destroyed at its
// exit, which for the main thread can come after the CUDA context is gone
// (PyTorch keeps its handles the same way). Why slots: work that may be in
// flight at once on two streams must not share one handle's workspace.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/error.h"

namespace statescan::cuda::detail {

enum class BlasSlot : int {
  lact = 0,       // the LaCT layer's caller stream
  lact_side = 1,  // the LaCT layer's side stream (lact_detail::side_stream)
  summary = 2,    // the CP summary's GEMMs, on the mixer's streams
  // Muon's Newton-Schulz, on its capture stream or the caller's: a handle of
  // its own, since setting the layer's handle to the capture stream would
  // move the layer's later GEMMs (issued through a handle taken once) there.
  newton_schulz = 3,
};

// The calling thread's handle of `slot` on the current device, bound to
// `stream`; plain fp32 stays fp32 (CUBLAS_DEFAULT_MATH: no TF32; the callers
// choose the compute type per GEMM).
inline cublasHandle_t blas_handle(cudaStream_t stream, BlasSlot slot) {
  constexpr int kDevices = 64;
  constexpr int kSlots = static_cast<int>(BlasSlot::newton_schulz) + 1;  // the last slot
  thread_local cublasHandle_t handles[kDevices][kSlots] = {};
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  SS_CHECK_ARG(device < kDevices, "device", "device ", device, ": more than ", kDevices);
  cublasHandle_t& h = handles[device][static_cast<int>(slot)];
  if (h == nullptr) {
    SS_CUBLAS_CHECK(cublasCreate(&h));
    SS_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  }
  SS_CUBLAS_CHECK(cublasSetStream(h, stream));
  return h;
}

}  // namespace statescan::cuda::detail
