// Helpers shared by the communicator suites (single rank, MPI, NCCL): typed
// test data as raw bytes, and the error expectation.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "tests/expect_error.h"

namespace statescan::test {

inline constexpr CommType kAllTypes[] = {CommType::f32, CommType::f64, CommType::i64, CommType::u8};

using Bytes = std::vector<unsigned char>;

inline std::string type_name(CommType t) { return to_string(t); }

// Element i of rank r's contribution: distinct per (rank, i) and exact in
// every type (small integers), so gathered data identifies its source.
inline double value_of(int rank, std::size_t i, CommType type) {
  if (type == CommType::u8) return static_cast<double>((rank * 61 + i * 7 + 1) % 256);
  return 1000.0 * (rank + 1) + static_cast<double>(i);
}

inline void store(unsigned char* at, CommType type, double x) {
  switch (type) {
    case CommType::f32: {
      const float v = static_cast<float>(x);
      std::memcpy(at, &v, sizeof v);
      break;
    }
    case CommType::f64:
      std::memcpy(at, &x, sizeof x);
      break;
    case CommType::i64: {
      const int64_t v = static_cast<int64_t>(x);
      std::memcpy(at, &v, sizeof v);
      break;
    }
    case CommType::u8:
      *at = static_cast<unsigned char>(x);
      break;
  }
}

inline double load(const unsigned char* at, CommType type) {
  switch (type) {
    case CommType::f32: {
      float v;
      std::memcpy(&v, at, sizeof v);
      return v;
    }
    case CommType::f64: {
      double v;
      std::memcpy(&v, at, sizeof v);
      return v;
    }
    case CommType::i64: {
      int64_t v;
      std::memcpy(&v, at, sizeof v);
      return static_cast<double>(v);
    }
    case CommType::u8:
      return *at;
  }
  return 0;
}

// Rank `rank`'s `count` elements.
inline Bytes contribution(int rank, std::size_t count, CommType type) {
  Bytes out(count * size_of(type));
  for (std::size_t i = 0; i < count; ++i)
    store(&out[i * size_of(type)], type, value_of(rank, i, type));
  return out;
}

// Number of elements of `got` that differ from the expected values.
// (Counting from element `offset_elements` of `got`.)
template <typename Expected>
std::size_t mismatches(const Bytes& got, std::size_t offset_elements, std::size_t count,
                       CommType type, Expected expected) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i)
    if (load(&got[(offset_elements + i) * size_of(type)], type) != expected(i)) ++wrong;
  return wrong;
}
template <typename Expected>
std::size_t mismatches(const Bytes& got, std::size_t count, CommType type, Expected expected) {
  return mismatches(got, 0, count, type, expected);
}

}  // namespace statescan::test
