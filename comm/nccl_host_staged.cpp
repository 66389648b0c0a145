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
  SS_CUDA_CHECK(cudaMemcpyAsync(mine, send, bytes, cudaMemcpyHostToDevice, nccl_.stream()));
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
    SS_CUDA_CHECK(cudaMalloc(&buffer_, bytes));
    capacity_ = bytes;
  }
  return static_cast<char*>(buffer_);
}

char* NcclHostStaged::stage_in(const void* host, std::size_t bytes) {
  char* dev = reserve(bytes);
  SS_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, nccl_.stream()));
  return dev;
}

void NcclHostStaged::to_host(void* host, const void* dev, std::size_t bytes) {
  SS_CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, nccl_.stream()));
  nccl_.wait();
}

}  // namespace statescan
