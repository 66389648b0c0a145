// Small fp32 kernels on batches of affine maps S_out = M S_in + E (DESIGN §5):
// what the device exchange composes and applies, and the finiteness count
// the CP mixer's input checks use. The maps are tiny (Dk <= 256 per head), so
// these are plain CUDA-core kernels: one thread per output element, the
// contraction over Dk in a register loop; they are never on the critical
// path of a step for long.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "kernels/cuda/cp_kernels.h"

namespace statescan::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>((n + kThreads - 1) / kThreads);
}

// affine_apply_kernel: out[m][i][c] = bias[m][i][c] + sum_j A[m][i][j] B[m][j][c]
// (A diagonal: A[m][i] B[m][i][c]). One thread per (m, i, c); B, bias and out
// are Dk x width per map with row strides ld_b, ld_bias, width; bias and B
// may be null (zero).
__global__ void affine_apply_kernel(int64_t maps, int64_t dk, int64_t width, bool diagonal,
                                    const float* A, const float* B, int64_t ld_b, int64_t stride_b,
                                    const float* bias, int64_t ld_bias, int64_t stride_bias,
                                    float* out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= maps * dk * width) return;
  const int64_t m = idx / (dk * width), i = (idx / width) % dk, c = idx % width;
  float acc = bias != nullptr ? bias[m * stride_bias + i * ld_bias + c] : 0.f;
  if (B != nullptr) {
    const float* b = B + m * stride_b + c;
    if (diagonal) {
      acc += A[m * dk + i] * b[i * ld_b];
    } else {
      const float* a = A + (m * dk + i) * dk;
      for (int64_t j = 0; j < dk; ++j) acc = fmaf(a[j], b[j * ld_b], acc);
    }
  }
  out[idx] = acc;
}

// elementwise_product_kernel: out[i] = a[i] * b[i] (diagonal maps compose).
__global__ void elementwise_product_kernel(int64_t n, const float* a, const float* b, float* out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx < n) out[idx] = a[idx] * b[idx];
}

// transpose_kernel: Mt[m][j][i] = M[m][i][j], one thread per element.
__global__ void transpose_kernel(const float* M, float* Mt, int64_t maps, int64_t dk) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= maps * dk * dk) return;
  const int64_t m = idx / (dk * dk), i = (idx / dk) % dk, j = idx % dk;
  Mt[(m * dk + j) * dk + i] = M[idx];
}

// identity_kernel: out[m][i][j] = (i == j), Dk x Dv per map.
__global__ void identity_kernel(float* out, int64_t maps, int64_t dk, int64_t dv) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= maps * dk * dv) return;
  const int64_t i = (idx / dv) % dk, j = idx % dv;
  out[idx] = i == j ? 1.f : 0.f;
}

__device__ __forceinline__ float as_float(float x) {
  return x;
}
__device__ __forceinline__ float as_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float as_float(__half x) {
  return __half2float(x);
}

// nonfinite_kernel: adds the number of NaN/Inf elements of data[0, n) to
// *count; grid-stride loop, one atomic per block.
template <typename T>
__global__ void nonfinite_kernel(const T* data, int64_t n, int* count) {
  __shared__ int block_count;
  if (threadIdx.x == 0) block_count = 0;
  __syncthreads();
  int mine = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    mine += isfinite(as_float(data[i])) ? 0 : 1;
  if (mine != 0) atomicAdd(&block_count, mine);
  __syncthreads();
  if (threadIdx.x == 0 && block_count != 0) atomicAdd(count, block_count);
}

}  // namespace

void apply_affine_maps(const DeviceMaps& maps, const float* in, float* out, int64_t col0,
                       int64_t width, cudaStream_t stream) {
  SS_CHECK_ARG(col0 >= 0 && width >= 1 && col0 + width <= maps.dv, "width", "columns [", col0, ", ",
               col0 + width, ") outside Dv = ", maps.dv);
  const int64_t n = maps.maps * maps.dk * width;
  if (n == 0) return;
  affine_apply_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      maps.maps, maps.dk, width, maps.diagonal, maps.M, in, width, maps.dk * width, maps.E + col0,
      maps.dv, maps.dk * maps.dv, out);
  SS_LAUNCH_CHECK("affine_apply_kernel");
}

void compose_affine_maps(int64_t maps, int64_t dk, int64_t dv, bool diagonal, float* later_M,
                         float* later_E, const float* earlier_M, const float* earlier_E,
                         float* scratch, cudaStream_t stream) {
  const int64_t m_size = diagonal ? dk : dk * dk;
  float* new_E = scratch;
  float* new_M = scratch + maps * dk * dv;
  const int64_t ne = maps * dk * dv;
  if (ne == 0) return;
  // E first: it reads M_l before M_l is replaced.
  affine_apply_kernel<<<blocks_for(ne), kThreads, 0, stream>>>(
      maps, dk, dv, diagonal, later_M, earlier_E, dv, dk * dv, later_E, dv, dk * dv, new_E);
  SS_LAUNCH_CHECK("affine_apply_kernel");
  const int64_t nm = maps * m_size;
  if (diagonal) {
    elementwise_product_kernel<<<blocks_for(nm), kThreads, 0, stream>>>(nm, later_M, earlier_M,
                                                                        new_M);
    SS_LAUNCH_CHECK("elementwise_product_kernel");
  } else {
    affine_apply_kernel<<<blocks_for(nm), kThreads, 0, stream>>>(
        maps, dk, dk, false, later_M, earlier_M, dk, dk * dk, nullptr, 0, 0, new_M);
    SS_LAUNCH_CHECK("affine_apply_kernel");
  }
  SS_CUDA_CHECK(
      cudaMemcpyAsync(later_E, new_E, ne * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  SS_CUDA_CHECK(
      cudaMemcpyAsync(later_M, new_M, nm * sizeof(float), cudaMemcpyDeviceToDevice, stream));
}

void transpose_maps(const float* M, float* Mt, int64_t maps, int64_t dk, cudaStream_t stream) {
  const int64_t n = maps * dk * dk;
  if (n == 0) return;
  transpose_kernel<<<blocks_for(n), kThreads, 0, stream>>>(M, Mt, maps, dk);
  SS_LAUNCH_CHECK("transpose_kernel");
}

void fill_identity(float* out, int64_t maps, int64_t dk, int64_t dv, cudaStream_t stream) {
  const int64_t n = maps * dk * dv;
  if (n == 0) return;
  identity_kernel<<<blocks_for(n), kThreads, 0, stream>>>(out, maps, dk, dv);
  SS_LAUNCH_CHECK("identity_kernel");
}

void count_nonfinite(const void* data, int64_t n, DType dtype, int* count, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 1024 ? want : 1024);
  switch (dtype) {
    case DType::f32:
      nonfinite_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const float*>(data), n, count);
      break;
    case DType::bf16:
      nonfinite_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(data), n,
                                                        count);
      break;
    case DType::f16:
      nonfinite_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const __half*>(data), n, count);
      break;
    default:
      SS_FAIL("dtype", "finiteness check needs f32, bf16 or f16, got ", to_string(dtype));
  }
  SS_LAUNCH_CHECK("nonfinite_kernel");
}

}  // namespace statescan::cuda
