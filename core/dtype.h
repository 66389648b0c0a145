// Element types of user tensors. Compute and states are always fp32 (or fp64
// in the reference); bf16/f16 exist at the storage boundary only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

namespace statescan {

// i64 is for index tensors (cu_seqlens) only; the conversions below reject it.
enum class DType { f32, bf16, f16, i64 };

std::size_t size_of(DType t);
const char* to_string(DType t);
// Parses "f32"/"fp32"/"float32", "bf16"/"bfloat16", "f16"/"fp16"/"float16";
// throws statescan::Error naming `argument` otherwise.
DType parse_dtype(std::string_view text, const char* argument = "dtype");

inline std::ostream& operator<<(std::ostream& os, DType t) { return os << to_string(t); }

// Round-to-nearest-even conversions (NaN stays NaN, overflow goes to inf).
uint16_t float_to_bf16_bits(float x);
float bf16_bits_to_float(uint16_t b);
uint16_t float_to_f16_bits(float x);
float f16_bits_to_float(uint16_t h);

// The value `x` takes after a round trip through `t` (identity for f32). Used
// to give the CPU path and the reference exactly the inputs a bf16/f16 run sees.
float round_to(DType t, float x);

// Converts n floats into `t`'s storage at dst, and back.
void convert_from_float(DType t, const float* src, void* dst, std::size_t n);
void convert_to_float(DType t, const void* src, float* dst, std::size_t n);

}  // namespace statescan
