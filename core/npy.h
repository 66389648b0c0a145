// NumPy .npy read/write (format versions 1.0-3.0, little-endian, C order).
// Reads float32, float64 and int64 arrays; writes float32 and float64.
// Writes go to a temporary file renamed into place, so a failed run never
// leaves a half-written array behind.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace statescan {

struct NpyArray {
  Shape shape;
  std::string descr;          // "<f4", "<f8" or "<i8" as read from the header
  std::vector<double> data;   // values (int64 values converted exactly up to 2^53)
};

NpyArray read_npy(const std::string& path);
bool npy_exists(const std::string& path);
void write_npy(const std::string& path, const Shape& shape, const float* data);
void write_npy(const std::string& path, const Shape& shape, const double* data);

}  // namespace statescan
