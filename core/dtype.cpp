#include "core/dtype.h"

#include <cmath>
#include <cstring>

#include "core/error.h"

namespace statescan {

std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16:
    case DType::f16: return 2;
    case DType::i64: return 8;
  }
  return 0;
}

const char* to_string(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i64: return "i64";
  }
  return "?";
}

DType parse_dtype(std::string_view s, const char* argument) {
  if (s == "f32" || s == "fp32" || s == "float32") return DType::f32;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::f16;
  SS_FAIL(argument, "unknown dtype '", std::string(s), "' (expected f32, bf16 or f16)");
}

static uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
static float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

uint16_t float_to_bf16_bits(float x) {
  uint32_t u = bits_of(x);
  // A NaN stays a NaN: truncated, with the quiet bit set (a payload in the low bits alone would
  // truncate to inf).
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  // Adding 0x7fff plus the lowest kept bit rounds half to even; a carry into
  // the exponent correctly produces the next binade or inf.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_bits_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_f16_bits(float x) {
  uint32_t u = bits_of(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (u >= 0x477ff000u) {
    // >= 65520 rounds to inf (65504 is the largest finite half).
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (u < 0x38800000u) {
    // Result is subnormal (or zero): scale into units of 2^-24 and round to
    // nearest even with the FPU (exact, since the value fits in float).
    const float a = float_of(u);
    const float scaled = a * 16777216.0f;  // 2^24
    float r = std::nearbyint(scaled);      // default rounding mode: to nearest even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  // Normal: rebias exponent 127 -> 15, keep 10 mantissa bits, round half even.
  uint32_t v = u - 0x38000000u;  // (127-15) << 23
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | (v >> 13));
}

float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    const float mag = static_cast<float>(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return sign ? -mag : mag;
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (man << 13));
  return float_of(sign | ((exp + 112u) << 23) | (man << 13));
}

float round_to(DType t, float x) {
  SS_CHECK_ARG(t != DType::i64, "dtype", "i64 is not a floating-point type");
  switch (t) {
    case DType::f32: return x;
    case DType::bf16: return bf16_bits_to_float(float_to_bf16_bits(x));
    case DType::f16: return f16_bits_to_float(float_to_f16_bits(x));
    case DType::i64: break;
  }
  return x;
}

void convert_from_float(DType t, const float* src, void* dst, std::size_t n) {
  SS_CHECK_ARG(t != DType::i64, "dtype", "i64 is not a floating-point type");
  if (t == DType::f32) {
    std::memcpy(dst, src, n * 4);
    return;
  }
  auto* out = static_cast<uint16_t*>(dst);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = t == DType::bf16 ? float_to_bf16_bits(src[i]) : float_to_f16_bits(src[i]);
}

void convert_to_float(DType t, const void* src, float* dst, std::size_t n) {
  SS_CHECK_ARG(t != DType::i64, "dtype", "i64 is not a floating-point type");
  if (t == DType::f32) {
    std::memcpy(dst, src, n * 4);
    return;
  }
  const auto* in = static_cast<const uint16_t*>(src);
  for (std::size_t i = 0; i < n; ++i)
    dst[i] = t == DType::bf16 ? bf16_bits_to_float(in[i]) : f16_bits_to_float(in[i]);
}

}  // namespace statescan
