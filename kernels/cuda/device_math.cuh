// Small device helpers shared by the CUDA kernels: storage types per dtype,
// conversions, warp reductions and the tf32 tensor-core step.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <type_traits>

#include "core/dtype.h"

namespace statescan::cuda::detail {

template <DType T>
struct StorageOf;
template <>
struct StorageOf<DType::f32> {
  using type = float;
};
template <>
struct StorageOf<DType::bf16> {
  using type = __nv_bfloat16;
};
template <>
struct StorageOf<DType::f16> {
  using type = __half;
};

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// Four consecutive elements as floats (8- or 16-byte aligned loads).
__device__ __forceinline__ float4 load4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ float4 load4(const __half* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void store4(float* p, float4 v) {
  *reinterpret_cast<float4*>(p) = v;
}
// Four consecutive elements rounded to a 16-bit type (8-byte aligned stores).
__device__ __forceinline__ void store4(__nv_bfloat16* p, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 raw;
  raw.x = *reinterpret_cast<const unsigned*>(&lo);
  raw.y = *reinterpret_cast<const unsigned*>(&hi);
  *reinterpret_cast<uint2*>(p) = raw;
}
__device__ __forceinline__ void store4(__half* p, float4 v) {
  const __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
  uint2 raw;
  raw.x = *reinterpret_cast<const unsigned*>(&lo);
  raw.y = *reinterpret_cast<const unsigned*>(&hi);
  *reinterpret_cast<uint2*>(p) = raw;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// 16-byte asynchronous global -> shared copies (sm_80+), committed and
// waited for in groups.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* global_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Copies a kRows x kCols tile of 16-bit or fp32 elements with 16-byte
// cp.async, thread t of kThreads: the shape is a constant, so each thread's
// offsets are loop-invariant across a kernel's chunks. Offsets are 32-bit (a
// tile is far below 2^31 elements): only the base pointer is 64-bit
// arithmetic.
//
// copy_rows_async_masked reads a tile whose rows past `valid_rows` do not
// exist (the last chunk of a sequence): those rows of `dst` are zeroed
// instead, so they add nothing to the products that read the tile. The zeros
// are plain shared stores, visible to the block after the barrier that
// follows the cp.async wait.
template <int kThreads, int kRows, int kCols, typename T>
__device__ __forceinline__ void copy_rows_async_masked(T* dst, int ld_dst, const T* src, int ld_src,
                                                       int t, int valid_rows) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kPerRow = kCols / kVec;
  constexpr int kIters = (kRows * kPerRow + kThreads - 1) / kThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int idx = t + it * kThreads;
    const int i = idx / kPerRow, j = (idx % kPerRow) * kVec;
    if (i < kRows) {
      if (i < valid_rows)
        cp_async16(dst + (i * ld_dst + j), src + (i * ld_src + j));
      else
        *reinterpret_cast<uint4*>(dst + (i * ld_dst + j)) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Every row valid: the row test folds away (kRows is a constant).
template <int kThreads, int kRows, int kCols, typename T>
__device__ __forceinline__ void copy_rows_async(T* dst, int ld_dst, const T* src, int ld_src,
                                                int t) {
  copy_rows_async_masked<kThreads, kRows, kCols>(dst, ld_dst, src, ld_src, t, kRows);
}

// One chunk of a [tokens, H, D] 16-bit input read in place: rows token0 ..
// token0 + kChunk of head h, columns col0 .. col0 + kCols, rows past `length`
// zeroed (the kernels that read q, k, v, dO without a prepare stage).
template <int kThreads, int kChunk, int kCols, int D, typename T>
__device__ __forceinline__ void copy_chunk_rows_async(T* dst, int ld_dst, const void* src,
                                                      int64_t token0, int64_t H, int64_t h,
                                                      int col0, int t, int length) {
  copy_rows_async_masked<kThreads, kChunk, kCols>(
      dst, ld_dst, static_cast<const T*>(src) + (token0 * H + h) * D + col0,
      static_cast<int>(H * D), t, length);
}

namespace wmma = nvcuda::wmma;
using AccFragment = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

// acc += (negate ? -A : A) * B for one 16x16x8 step on the tensor cores, with A
// (16x8) and B (8x16) read as fp32 from shared memory. tf32 keeps 10 mantissa
// bits; with kSplit each operand is split into a tf32 "high" part plus a tf32
// remainder and three products are summed (hi*lo + lo*hi + hi*hi), which
// restores close to fp32 accuracy for fp32 inputs at three times the cost.
template <typename LayoutA, typename LayoutB, bool kSplit, bool kNegateA = false>
__device__ __forceinline__ void mma_tf32(AccFragment& acc, const float* a, unsigned lda,
                                         const float* b, unsigned ldb) {
  wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, LayoutA> a_hi;
  wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, LayoutB> b_hi;
  wmma::load_matrix_sync(a_hi, a, lda);
  wmma::load_matrix_sync(b_hi, b, ldb);
  if constexpr (kSplit) {
    decltype(a_hi) a_lo;
    decltype(b_hi) b_lo;
#pragma unroll
    for (int i = 0; i < a_hi.num_elements; ++i) {
      const float x = kNegateA ? -a_hi.x[i] : a_hi.x[i];
      const float hi = wmma::__float_to_tf32(x);
      a_hi.x[i] = hi;
      a_lo.x[i] = wmma::__float_to_tf32(x - hi);
    }
#pragma unroll
    for (int i = 0; i < b_hi.num_elements; ++i) {
      const float x = b_hi.x[i];
      const float hi = wmma::__float_to_tf32(x);
      b_hi.x[i] = hi;
      b_lo.x[i] = wmma::__float_to_tf32(x - hi);
    }
    wmma::mma_sync(acc, a_lo, b_hi, acc);
    wmma::mma_sync(acc, a_hi, b_lo, acc);
  } else {
#pragma unroll
    for (int i = 0; i < a_hi.num_elements; ++i)
      a_hi.x[i] = wmma::__float_to_tf32(kNegateA ? -a_hi.x[i] : a_hi.x[i]);
#pragma unroll
    for (int i = 0; i < b_hi.num_elements; ++i) b_hi.x[i] = wmma::__float_to_tf32(b_hi.x[i]);
  }
  wmma::mma_sync(acc, a_hi, b_hi, acc);
}

// Tensor-core step per workspace element type T: fp32 tiles (fp32 inputs)
// take 16x16x8 split-tf32 steps, which keep about fp32 accuracy; 16-bit tiles
// (bf16/f16 inputs) take native 16x16x16 steps with fp32 accumulation.
template <typename T>
struct MmaStep {
  static constexpr int kK = 16;
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
};
template <>
struct MmaStep<float> {
  static constexpr int kK = 8;
  using Acc = AccFragment;
};

// acc += A * B for one MmaStep<T>::kK-deep step, A (16 x kK) and B (kK x 16)
// read from shared memory.
template <typename LayoutA, typename LayoutB, typename T>
__device__ __forceinline__ void mma_step(typename MmaStep<T>::Acc& acc, const T* a, unsigned lda,
                                         const T* b, unsigned ldb) {
  if constexpr (std::is_same_v<T, float>) {
    mma_tf32<LayoutA, LayoutB, true>(acc, a, lda, b, ldb);
  } else {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayoutA> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> fb;
    wmma::load_matrix_sync(fa, a, lda);
    wmma::load_matrix_sync(fb, b, ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

}  // namespace statescan::cuda::detail
