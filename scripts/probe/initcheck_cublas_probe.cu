// initcheck_cublas_probe: does compute-sanitizer's initcheck see what cuBLAS
// writes? C comes from cudaMalloc and is never written by us; cuBLAS forms
// C = A B^T (beta 0, 4 matrices of 512 x 1024, K 256), then a kernel reads
// all of C. Any initcheck report is then about cuBLAS's stores, not ours.
//
//   nvcc -O2 -arch=sm_90a scripts/probe/initcheck_cublas_probe.cu -lcublas -o probe
//   compute-sanitizer --tool initcheck ./probe f   # fp32 operands
//   compute-sanitizer --tool initcheck ./probe b   # bf16 operands, fp32 C
//
// H100, CUDA 13.0 (sixty-third session): fp32 0 errors; bf16 every read of C
// reported, so initcheck cannot check code that reads bf16 cuBLAS outputs
// (LaCT's cuBLAS hidden path, CP's pre-pass), and tests/CMakeLists.txt runs
// initcheck on the chunkwise suites only.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>

__global__ void sum(const float* c, size_t n, float* out) {
  float s = 0;
  for (size_t i = threadIdx.x + blockIdx.x * size_t(blockDim.x); i < n;
       i += size_t(gridDim.x) * blockDim.x)
    s += c[i];
  atomicAdd(out, s);
}

int main(int argc, char** argv) {
  const int m = 512, n = 1024, k = 256, batch = 4;
  const bool bf = argc > 1 && argv[1][0] == 'b';
  const size_t es = bf ? 2 : 4;
  void *A, *B;
  float *C, *out;
  cudaMalloc(&A, es * m * k * batch);
  cudaMalloc(&B, es * n * k * batch);
  cudaMalloc(&C, sizeof(float) * m * n * batch);
  cudaMalloc(&out, sizeof(float));
  cudaMemset(A, 0, es * m * k * batch);
  cudaMemset(B, 0, es * n * k * batch);
  cudaMemset(out, 0, sizeof(float));
  cublasHandle_t h;
  cublasCreate(&h);
  const float one = 1, zero = 0;
  const cudaDataType_t t = bf ? CUDA_R_16BF : CUDA_R_32F;
  // Row-major C [m x n] = A [m x k] B [n x k]^T: column-major C^T = B A^T.
  const cublasStatus_t s = cublasGemmStridedBatchedEx(
      h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, B, t, k, static_cast<long long>(n) * k, A, t, k,
      static_cast<long long>(m) * k, &zero, C, CUDA_R_32F, n, static_cast<long long>(m) * n, batch,
      bf ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT);
  sum<<<64, 256>>>(C, size_t(m) * n * batch, out);
  cudaDeviceSynchronize();
  std::printf("%s gemm status %d, %s\n", bf ? "bf16" : "f32", static_cast<int>(s),
              cudaGetErrorString(cudaGetLastError()));
  return 0;
}
