// DeviceBuffer<T>: an owning, move-only array in GPU memory (plain cudaMalloc,
// never managed memory), with copies to and from host vectors. Exists only in
// CUDA builds (STATESCAN_HAS_CUDA).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/error.h"

namespace statescan {

namespace detail {
void* device_alloc(std::size_t bytes);
void device_free(void* ptr) noexcept;
void copy_to_device(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);
void fill_device_bytes(void* dst, unsigned char value, std::size_t bytes);
}  // namespace detail

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t count)
      : data_(static_cast<T*>(detail::device_alloc(count * sizeof(T)))), count_(count) {}
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    copy_from_host(host);
  }
  ~DeviceBuffer() { detail::device_free(data_); }

  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      detail::device_free(data_);
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return count_; }
  std::size_t bytes() const { return count_ * sizeof(T); }

  // Synchronous copies (the default stream); sizes must match exactly.
  void copy_from_host(const std::vector<T>& host) {
    SS_CHECK_ARG(host.size() == count_, "host", "size ", host.size(), " != device size ", count_);
    detail::copy_to_device(data_, host.data(), bytes());
  }
  std::vector<T> to_host() const {
    std::vector<T> host(count_);
    detail::copy_to_host(host.data(), data_, bytes());
    return host;
  }
  // Sets every byte to `value` (0xFF poisons floats with NaN).
  void fill_bytes(unsigned char value) { detail::fill_device_bytes(data_, value, bytes()); }

 private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

}  // namespace statescan
