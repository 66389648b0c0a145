// SideStream: a second stream that work can run on beside `origin`, forked
// from it (the side stream starts after everything queued on origin so far)
// and joined back (origin waits for the side stream's work). Exists only in
// CUDA builds (STATESCAN_HAS_CUDA). Created per use: microseconds, against
// the milliseconds of what runs on it; destroying it with work pending is
// fine, CUDA releases the stream when that work completes.
#pragma once

#include <cuda_runtime.h>

#include "core/cuda_check.h"

namespace statescan {

class SideStream {
 public:
  // Creates the stream and its events and forks from origin.
  explicit SideStream(cudaStream_t origin) : origin_(origin) {
    SS_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    try {
      SS_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
      SS_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
      fork();
    } catch (...) {
      release();
      throw;
    }
  }
  ~SideStream() { release(); }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  cudaStream_t stream() const { return side_; }
  // The side stream's next work starts after everything queued on origin.
  void fork() {
    SS_CUDA_CHECK(cudaEventRecord(fork_, origin_));
    SS_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
  }
  // Origin's next work starts after everything queued on the side stream.
  void join() {
    SS_CUDA_CHECK(cudaEventRecord(join_, side_));
    SS_CUDA_CHECK(cudaStreamWaitEvent(origin_, join_, 0));
  }

 private:
  void release() noexcept {
    if (join_ != nullptr) (void)cudaEventDestroy(join_);
    if (fork_ != nullptr) (void)cudaEventDestroy(fork_);
    if (side_ != nullptr) (void)cudaStreamDestroy(side_);
  }
  cudaStream_t origin_ = nullptr, side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
};

}  // namespace statescan
