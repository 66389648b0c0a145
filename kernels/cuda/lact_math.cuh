// Scalar pieces of LaCT's token kernels: silu for the elementwise kernels
// (lact_layer_kernels.cuh) and, with the fast exponential, for the fused
// hidden-layer kernel (lact_hidden.cu); the learning rates' indexing, which
// both read the same way.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_math.cuh"

namespace statescan::cuda::lact_detail {

// silu(x) = x s and its first two derivatives, from x and s = sigmoid(x).
struct SiluParts {
  float value, d1, d2;  // d2 costs nothing where unused (inlined)
  __device__ __forceinline__ SiluParts(float x, float s) {
    value = x * s;
    // s (1 + x (1 - s)) as s + silu (1 - s): one subtraction and one fma.
    const float t = 1.0f - s;
    d1 = fmaf(value, t, s);
    d2 = s * t * (2.0f + x * (1.0f - 2.0f * s));
  }
};

// silu and its first two derivatives in fp32.
struct SiluF : SiluParts {
  __device__ __forceinline__ explicit SiluF(float x) : SiluParts(x, 1.0f / (1.0f + expf(-x))) {}
};

// silu(x) and silu'(x) with the hardware's approximate 2^x and 1/x,
// flushing denormals: the epilogue's arithmetic competes with the other
// warpgroup's MMAs for issue slots (relative error ~1e-6, far inside bf16's
// rounding of the results). __expf and __fdividef keep denormals, which costs
// a compare and two conditional multiplies around each (ncu SASS, H200).
// The limits hold: x -> -inf gives 2^x = inf, s = 0; x -> +inf, s = 1.
struct SiluFast : SiluParts {
  __device__ __forceinline__ explicit SiluFast(float x) : SiluParts(x, sigmoid(x)) {}

 private:
  __device__ __forceinline__ static float sigmoid(float x) {
    float e, s;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.4426950408889634f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.0f + e));
    return s;
  }
};

// Learning rate of row t of pair i in this chunk slice.
template <typename T>
__device__ __forceinline__ float lr_at(const T* lr, int64_t pair, int64_t t, int64_t H,
                                       int64_t local_len, int64_t t0) {
  const int64_t b = pair / H, h = pair % H;
  return detail::to_float(lr[(b * local_len + t0 + t) * H + h]);
}

}  // namespace statescan::cuda::lact_detail
