// Tensor views and owning buffers.
//
// TensorView is a non-owning (pointer, dtype, shape, strides) record: the
// library's public functions take views so that callers keep their own memory
// (PyTorch tensors, trainer arenas, ...). Strides are in elements, int64.
// HostBuffer owns host memory; DeviceBuffer (core/device_buffer.h) owns GPU
// memory and exists only in CUDA builds.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace statescan {

using Shape = std::vector<int64_t>;

std::string shape_string(const Shape& s);
int64_t numel(const Shape& s);
Shape contiguous_strides(const Shape& s);

enum class Memory { host, device };

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  Shape strides;  // elements; empty means contiguous
  Memory memory = Memory::host;

  TensorView() = default;
  TensorView(void* d, DType t, Shape s, Memory m = Memory::host)
      : data(d), dtype(t), shape(std::move(s)), strides(contiguous_strides(shape)), memory(m) {}

  bool defined() const { return data != nullptr; }
  int64_t numel() const { return statescan::numel(shape); }
  int64_t size(int d) const { return shape.at(static_cast<std::size_t>(d)); }
  bool is_contiguous() const;
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
};

// Owning, zero-initialised host array.
template <typename T>
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(Shape shape) : shape_(std::move(shape)), data_(statescan::numel(shape_)) {}
  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return static_cast<int64_t>(data_.size()); }
  std::vector<T>& vec() { return data_; }
  const std::vector<T>& vec() const { return data_; }
  T& operator[](int64_t i) { return data_[static_cast<std::size_t>(i)]; }
  const T& operator[](int64_t i) const { return data_[static_cast<std::size_t>(i)]; }

 private:
  Shape shape_;
  std::vector<T> data_;
};

// ---- argument checks (each throws statescan::Error naming `name`) ----------

// Shape must equal `expected`; -1 in `expected` matches any extent.
void check_shape(const TensorView& t, const Shape& expected, const char* name);
void check_dtype(const TensorView& t, DType expected, const char* name);
void check_contiguous(const TensorView& t, const char* name);
void check_memory(const TensorView& t, Memory expected, const char* name);
// The usual argument check in one call: defined, shape (as check_shape),
// dtype, memory and contiguity.
void check_tensor(const TensorView& t, const Shape& shape, DType dtype, Memory memory,
                  const char* name);
// The index of the first element that is not finite or, with log_gates, is
// > 0 (host fp32 data); -1 when there is none. The scan behind check_finite
// and check_log_gates, for callers that word the error themselves.
int64_t first_invalid(const float* data, int64_t n, bool log_gates);
// Every element finite (host fp32 data).
void check_finite(const float* data, int64_t n, const char* name);
// Log gates (DESIGN §2: g = log alpha, alpha in (0, 1]): finite and <= 0.
// A positive gate grows the state by e^g a token, to inf within a few
// dozen tokens, with no error of its own.
void check_log_gates(const float* data, int64_t n, const char* name);
// The same for a host fp32 tensor (contiguous, as check_tensor leaves it):
// the error names the offending element by its coordinates, "[b, t, h, d]"
// (a flat index into a [B, T, H, D] shard is no help to whoever must find
// the token).
void check_finite(const TensorView& t, const char* name);
void check_log_gates(const TensorView& t, const char* name);
// "[i0, i1, ...]": the coordinates of row-major index `flat` in `shape`.
std::string index_string(const Shape& shape, int64_t flat);

}  // namespace statescan
