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
    // s (1 - s) (2 + x (1 - 2 s)) = (1 - s) (silu' + s - silu s): an add, an
    // fma and a multiply where the product form took five.
    d2 = t * fmaf(-value, s, d1 + s);
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

// The update gradient's backward at one element (DESIGN §6; both
// gradients_backward_rows_kernel and lact_hidden_grad_kernel): from silu's
// parts of h0, h2, e = -v W1, u0 = k dG0^T, u2 = k dG2^T, u1 = v dG1^T and
// the row's learning rates, the lr-weighted operands z0, z2, gate (for dk,
// dv), de and dh0, dh2 (for dW, dk, dv), and the terms of the dlr sums added
// to s0..s2. Arranged for the fewest multiplies, the fused kernel's epilogue
// issue being its bound: h2 silu' and dz0 e are shared, the gate's gradient
// is carried with its sign flipped so that the negations land on FFMA
// operands (31 FP instructions an element with silu, against ~40 written
// out term by term).
struct GradRowsOut {
  float z0, z2, gate, de, dh0, dh2;
};
__device__ __forceinline__ GradRowsOut grad_rows_element(const SiluParts& s, float hv, float ev,
                                                         float u0, float u2, float u1, float l0,
                                                         float l1, float l2, float& s0, float& s1,
                                                         float& s2) {
  const float p = hv * s.d1;  // d(silu(h0) h2) / dh0
  const float z0 = ev * p, z2 = ev * s.value, gate = s.value * hv;
  s0 = fmaf(z0, u0, s0);
  s2 = fmaf(z2, u2, s2);
  s1 = fmaf(-gate, u1, s1);
  // ndgate is minus the gate's gradient (-l1 u1).
  const float dz0 = l0 * u0, dz2 = l2 * u2, ndgate = l1 * u1;
  const float dact = fmaf(dz2, ev, -ndgate * hv), m = dz0 * ev;
  return {l0 * z0,
          l2 * z2,
          l1 * gate,
          fmaf(dz2, s.value, dz0 * p),
          fmaf(m * hv, s.d2, dact * s.d1),
          fmaf(m, s.d1, -ndgate * s.value)};
}

// Learning rate of row t of pair i in this chunk slice.
template <typename T>
__device__ __forceinline__ float lr_at(const T* lr, int64_t pair, int64_t t, int64_t H,
                                       int64_t local_len, int64_t t0) {
  const int64_t b = pair / H, h = pair % H;
  return detail::to_float(lr[(b * local_len + t0 + t) * H + h]);
}

}  // namespace statescan::cuda::lact_detail
