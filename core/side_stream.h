// SideStream: a second stream that work can run on beside `origin`, forked
// from it (the side stream starts after everything queued on origin so far)
// and joined back (origin waits for the side stream's work). Exists only in
// CUDA builds (STATESCAN_HAS_CUDA). Created per use: microseconds, against
// the milliseconds of what runs on it. Its destructor joins too (also when an
// exception unwinds past the caller's join): buffers declared before it and
// freed on origin afterwards are then not handed out while the side stream
// still reads or writes them. CUDA releases the stream itself when its
// pending work completes.
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
  ~SideStream() {
    // The join without its checks: a destructor must not throw, and where it
    // runs during an unwind the exception in flight reports the failure.
    if (side_ != nullptr && join_ != nullptr && cudaEventRecord(join_, side_) == cudaSuccess)
      (void)cudaStreamWaitEvent(origin_, join_, 0);
    release();
  }
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
