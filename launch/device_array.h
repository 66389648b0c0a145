#pragma once
// One run tensor on the GPU for statescan-run's device paths (the mixers and
// LaCT): fp32 host values converted once to the run's dtype, or zeros, and
// copied back to fp32 host values on request. CUDA builds only.

#include <cstddef>
#include <utility>
#include <vector>

#include "core/device_buffer.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace statescan::launch {

class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const std::vector<float>& host, DType dtype) : dtype_(dtype) {
    if (host.empty()) return;
    std::vector<unsigned char> bytes(host.size() * size_of(dtype));
    convert_from_float(dtype, host.data(), bytes.data(), host.size());
    buf_ = DeviceBuffer<unsigned char>(bytes);
    count_ = host.size();
  }
  static DeviceArray zeros(std::size_t count, DType dtype) {
    DeviceArray a;
    a.dtype_ = dtype;
    if (count == 0) return a;
    a.buf_ = DeviceBuffer<unsigned char>(count * size_of(dtype));
    a.buf_.fill_bytes(0);
    a.count_ = count;
    return a;
  }
  // An empty view for an empty array: optional tensors stay absent.
  TensorView view(Shape shape) const {
    if (count_ == 0) return {};
    return TensorView(const_cast<unsigned char*>(buf_.data()), dtype_, std::move(shape),
                      Memory::device);
  }
  void to_host(std::vector<float>& out) const {
    if (count_ == 0) return;
    const std::vector<unsigned char> bytes = buf_.to_host();
    out.resize(count_);
    convert_to_float(dtype_, bytes.data(), out.data(), count_);
  }

 private:
  DeviceBuffer<unsigned char> buf_;
  DType dtype_ = DType::f32;
  std::size_t count_ = 0;
};

}  // namespace statescan::launch
