#include "core/tensor.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/error.h"

namespace statescan {

std::string shape_string(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t e : s) n *= e;
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (std::size_t i = s.size(); i-- > 0;) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

// A dimension of extent 1 is never stepped along, so its stride does not
// change the layout: PyTorch calls such tensors contiguous (a [1, T, H, D]
// view from a transpose has stride H D in its first dimension, and
// .contiguous() leaves it so), and so does this.
bool TensorView::is_contiguous() const {
  if (strides.empty()) return true;
  if (strides.size() != shape.size()) return false;
  const Shape want = contiguous_strides(shape);
  for (std::size_t i = 0; i < shape.size(); ++i)
    if (shape[i] != 1 && strides[i] != want[i]) return false;
  return true;
}

void check_shape(const TensorView& t, const Shape& expected, const char* name) {
  bool ok = t.shape.size() == expected.size();
  for (std::size_t i = 0; ok && i < expected.size(); ++i)
    ok = expected[i] < 0 || expected[i] == t.shape[i];
  SS_CHECK_ARG(ok, name, "shape ", shape_string(t.shape), " does not match expected ",
               shape_string(expected), " (-1 = any)");
}

void check_dtype(const TensorView& t, DType expected, const char* name) {
  SS_CHECK_ARG(t.dtype == expected, name, "dtype ", to_string(t.dtype), " but ",
               to_string(expected), " is required");
}

void check_contiguous(const TensorView& t, const char* name) {
  SS_CHECK_ARG(t.is_contiguous(), name, "must be contiguous (row-major, last dim fastest)");
}

void check_memory(const TensorView& t, Memory expected, const char* name) {
  SS_CHECK_ARG(t.memory == expected, name, "must be in ",
               expected == Memory::host ? "host" : "device", " memory");
}

void check_tensor(const TensorView& t, const Shape& shape, DType dtype, Memory memory,
                  const char* name) {
  SS_CHECK_ARG(t.defined(), name, "is required");
  check_shape(t, shape, name);
  check_dtype(t, dtype, name);
  check_memory(t, memory, name);
  check_contiguous(t, name);
}

int64_t first_invalid(const float* data, int64_t n, bool log_gates) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(data[i]) || (log_gates && data[i] > 0.f)) return i;
  return -1;
}

std::string index_string(const Shape& shape, int64_t flat) {
  std::vector<int64_t> at(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    const int64_t extent = std::max<int64_t>(shape[d], 1);
    at[d] = flat % extent;
    flat /= extent;
  }
  return shape_string(at);
}

namespace {

// The one refusal behind check_finite and check_log_gates: the first invalid
// element of data[0, n), named by where(i) (its index or its coordinates).
template <typename Where>
void check_values(const float* data, int64_t n, bool log_gates, const char* name, Where&& where) {
  const int64_t i = first_invalid(data, n, log_gates);
  if (i < 0) return;
  SS_FAIL(name, "element ", where(i), " is ", data[i],
          log_gates ? " (log gates must be finite and <= 0: alpha = exp(g) in (0, 1])"
                    : " (NaN/Inf not allowed)");
}

}  // namespace

void check_finite(const float* data, int64_t n, const char* name) {
  check_values(data, n, false, name, [](int64_t i) { return i; });
}

void check_log_gates(const float* data, int64_t n, const char* name) {
  check_values(data, n, true, name, [](int64_t i) { return i; });
}

void check_finite(const TensorView& t, const char* name) {
  check_values(t.as<const float>(), t.numel(), false, name,
               [&](int64_t i) { return index_string(t.shape, i); });
}

void check_log_gates(const TensorView& t, const char* name) {
  check_values(t.as<const float>(), t.numel(), true, name,
               [&](int64_t i) { return index_string(t.shape, i); });
}

}  // namespace statescan
