#include "core/device_buffer.h"

#include "core/cuda_check.h"

namespace statescan::detail {

void* device_alloc(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  void* ptr = nullptr;
  SS_CUDA_CHECK(cudaMalloc(&ptr, bytes));
  return ptr;
}

// Destructors must not throw; a failed free here means the context is already
// broken, which the next checked call reports.
void device_free(void* ptr) noexcept {
  if (ptr != nullptr) (void)cudaFree(ptr);
}

void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  SS_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  SS_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void fill_device_bytes(void* dst, unsigned char value, std::size_t bytes) {
  if (bytes == 0) return;
  SS_CUDA_CHECK(cudaMemset(dst, value, bytes));
}

}  // namespace statescan::detail
