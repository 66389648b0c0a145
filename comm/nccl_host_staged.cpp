#include "comm/nccl_host_staged.h"

#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/error.h"

namespace statescan {

NcclHostStaged::~NcclHostStaged() {
  if (buffer_ != nullptr) (void)cudaFree(buffer_);
}

void NcclHostStaged::all_gather(const void* send, void* recv, std::size_t count, CommType type) {
  const std::size_t bytes = count * size_of(type), ranks = static_cast<std::size_t>(size());
  char* dev = reserve(bytes * ranks);
  char* mine = dev + bytes * static_cast<std::size_t>(rank());
  copy_in(mine, send, bytes);
  nccl_.all_gather(mine, dev, count, type);
  to_host(recv, dev, bytes * ranks);
}

void NcclHostStaged::all_reduce_sum(void* data, std::size_t count, CommType type) {
  char* dev = stage_in(data, count * size_of(type));
  nccl_.all_reduce_sum(dev, count, type);
  to_host(data, dev, count * size_of(type));
}

void NcclHostStaged::all_reduce_max(void* data, std::size_t count, CommType type) {
  char* dev = stage_in(data, count * size_of(type));
  nccl_.all_reduce_max(dev, count, type);
  to_host(data, dev, count * size_of(type));
}

void NcclHostStaged::broadcast(void* data, std::size_t count, CommType type, int root) {
  char* dev = stage_in(data, count * size_of(type));
  nccl_.broadcast(dev, count, type, root);
  to_host(data, dev, count * size_of(type));
}

void NcclHostStaged::refuse(const char* op) {
  SS_FAIL("comm", "the host-staged NCCL control communicator has no ", op);
}

char* NcclHostStaged::reserve(std::size_t bytes) {
  if (bytes > capacity_) {
    nccl_.wait();  // the old buffer may still be in use on the stream
    if (buffer_ != nullptr) SS_CUDA_CHECK(cudaFree(buffer_));
    buffer_ = nullptr;
    capacity_ = 0;  // a failed allocation must not leave the old size behind
    SS_CUDA_CHECK(cudaMalloc(&buffer_, bytes));
    capacity_ = bytes;
  }
  return static_cast<char*>(buffer_);
}

char* NcclHostStaged::stage_in(const void* host, std::size_t bytes) {
  char* dev = reserve(bytes);
  copy_in(dev, host, bytes);
  return dev;
}

// The host buffers are pageable: a copy between them and the device may
// block the host until the stream's earlier work is done (a device-to-host
// copy returns only once it has completed), i.e. outside the watchdog, for
// ever if a peer died in a collective queued before it. So the stream is
// drained through wait() (timed, aborting) first; the copy then waits for
// nothing but itself.
void NcclHostStaged::copy_in(void* dev, const void* host, std::size_t bytes) {
  nccl_.wait();
  SS_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, nccl_.stream()));
}

void NcclHostStaged::to_host(void* host, const void* dev, std::size_t bytes) {
  nccl_.wait();
  SS_CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, nccl_.stream()));
  nccl_.wait();
}

}  // namespace statescan
