// token_gemm_batch_probe: LaCT's backward apply weight GEMMs (dW1 += do^T
// gate, d[W0; W2] += dh^T q; contracted over a chunk's tokens) as the layer
// issues them, one chunk at a time batched over the heads, against the same
// products of G chunks in one cuBLAS call (pointer arrays over (chunk,
// head)), to decide whether batching the chain-independent apply backward
// over chunks is worth building (PERF_NOTES, sixty-third session).
//
//   nvcc -O2 -std=c++17 -arch=sm_90a scripts/probe/token_gemm_batch_probe.cu -lcublas
//   ./a.out [G=8] [iters=20]
//
// Shapes: the issue-6 benchmark (C 4096 tokens a chunk, H 4, D 256, M 512,
// bf16 operands, fp32 outputs with beta 1). Prints the median time per chunk
// of each way and its TFLOP/s.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                \
  do {                                                                       \
    cudaError_t e_ = (x);                                                    \
    if (e_ != cudaSuccess) {                                                 \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)
#define CB(x)                                                                     \
  do {                                                                            \
    cublasStatus_t s_ = (x);                                                      \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                            \
      std::printf("%s:%d cublas %d\n", __FILE__, __LINE__, static_cast<int>(s_)); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

namespace {

constexpr int C = 4096, H = 4, D = 256, M = 512;

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    p[i] = __float2bfloat16((h & 0xffff) / 65536.f - 0.5f);
  }
}

// Row-major C[m x n] (+)= A^T B with A [k x m] (row pitch lda), B [k x n]
// (pitch ldb): cuBLAS column-major C^T = B^T A.
void strided(cublasHandle_t h, int m, int n, int k, const void* A, int lda, long long sa,
             const void* B, int ldb, long long sb, float* Cm, long long sc, int batch) {
  const float one = 1.f;
  CB(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, n, m, k, &one, B, CUDA_R_16BF, ldb, sb,
                                A, CUDA_R_16BF, lda, sa, &one, Cm, CUDA_R_32F, n, sc, batch,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}
void pointers(cublasHandle_t h, int m, int n, int k, const void* const* A, int lda,
              const void* const* B, int ldb, void* const* Cm, int batch) {
  const float one = 1.f;
  CB(cublasGemmBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_T, n, m, k, &one, B, CUDA_R_16BF, ldb, A,
                         CUDA_R_16BF, lda, &one, Cm, CUDA_R_32F, n, batch, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT));
}

template <typename F>
float median_ms(cudaStream_t s, int iters, F&& f) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a, s));
    f();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int G = argc > 1 ? std::atoi(argv[1]) : 8;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 20;
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasHandle_t h;
  CB(cublasCreate(&h));
  CB(cublasSetStream(h, s));
  // Tokens [G C, H, D] (q and do), rows per (chunk, pair) [C, 2M] (dh) and
  // [C, M] (gate), fp32 outputs per (chunk, pair).
  const size_t tok = size_t(G) * C * H * D, dh_n = size_t(G) * H * C * 2 * M,
               gate_n = size_t(G) * H * C * M, out1 = size_t(D) * M, out0 = size_t(2 * M) * D;
  __nv_bfloat16 *q, *d_o, *dh, *gate;
  float *w1, *w0;
  CK(cudaMalloc(&q, tok * 2));
  CK(cudaMalloc(&d_o, tok * 2));
  CK(cudaMalloc(&dh, dh_n * 2));
  CK(cudaMalloc(&gate, gate_n * 2));
  CK(cudaMalloc(&w1, size_t(G) * H * out1 * 4));
  CK(cudaMalloc(&w0, size_t(G) * H * out0 * 4));
  fill<<<1024, 256, 0, s>>>(q, tok, 1);
  fill<<<1024, 256, 0, s>>>(d_o, tok, 2);
  fill<<<1024, 256, 0, s>>>(dh, dh_n, 3);
  fill<<<1024, 256, 0, s>>>(gate, gate_n, 4);
  CK(cudaMemsetAsync(w1, 0, size_t(G) * H * out1 * 4, s));
  CK(cudaMemsetAsync(w0, 0, size_t(G) * H * out0 * 4, s));

  // Pointer arrays over (chunk g, head p), index g H + p.
  const int n = G * H;
  std::vector<const void*> a1(n), b1(n), a0(n), b0(n);
  std::vector<void*> c1(n), c0(n);
  for (int g = 0; g < G; ++g)
    for (int p = 0; p < H; ++p) {
      const int i = g * H + p;
      a1[i] = d_o + (size_t(g) * C * H + p) * D;
      b1[i] = gate + size_t(i) * C * M;
      c1[i] = w1 + size_t(i) * out1;
      a0[i] = dh + size_t(i) * C * 2 * M;
      b0[i] = q + (size_t(g) * C * H + p) * D;
      c0[i] = w0 + size_t(i) * out0;
    }
  void** dp;
  CK(cudaMalloc(&dp, 6 * n * sizeof(void*)));
  std::vector<const void*> all;
  for (auto* v : {&a1, &b1, &a0, &b0}) all.insert(all.end(), v->begin(), v->end());
  for (auto* v : {&c1, &c0}) all.insert(all.end(), v->begin(), v->end());
  CK(cudaMemcpy(dp, all.data(), 6 * n * sizeof(void*), cudaMemcpyHostToDevice));
  const void* const* pa1 = const_cast<const void* const*>(dp);
  const void* const* pb1 = pa1 + n;
  const void* const* pa0 = pa1 + 2 * n;
  const void* const* pb0 = pa1 + 3 * n;
  void* const* pc1 = dp + 4 * n;
  void* const* pc0 = dp + 5 * n;

  // Per chunk, as the layer does: two strided calls batched over the heads.
  auto per_chunk1 = [&] {
    for (int g = 0; g < G; ++g)
      strided(h, D, M, C, d_o + size_t(g) * C * H * D, H * D, D, gate + size_t(g) * H * C * M, M,
              size_t(C) * M, w1 + size_t(g) * H * out1, out1, H);
  };
  auto per_chunk0 = [&] {
    for (int g = 0; g < G; ++g)
      strided(h, 2 * M, D, C, dh + size_t(g) * H * C * 2 * M, 2 * M, size_t(C) * 2 * M,
              q + size_t(g) * C * H * D, H * D, D, w0 + size_t(g) * H * out0, out0, H);
  };
  // Per head, strided over the G chunks.
  auto per_head1 = [&] {
    for (int p = 0; p < H; ++p)
      strided(h, D, M, C, d_o + size_t(p) * D, H * D, size_t(C) * H * D, gate + size_t(p) * C * M,
              M, size_t(H) * C * M, w1 + size_t(p) * out1, size_t(H) * out1, G);
  };
  auto per_head0 = [&] {
    for (int p = 0; p < H; ++p)
      strided(h, 2 * M, D, C, dh + size_t(p) * C * 2 * M, 2 * M, size_t(H) * C * 2 * M,
              q + size_t(p) * D, H * D, size_t(C) * H * D, w0 + size_t(p) * out0, size_t(H) * out0,
              G);
  };
  auto batched1 = [&] { pointers(h, D, M, C, pa1, H * D, pb1, M, pc1, n); };
  auto batched0 = [&] { pointers(h, 2 * M, D, C, pa0, 2 * M, pb0, H * D, pc0, n); };

  const double f1 = 2.0 * D * M * C * H, f0 = 2.0 * 2 * M * D * C * H;  // per chunk
  struct Row {
    const char* name;
    double flops;
    float ms;
  };
  std::vector<Row> rows;
  for (int round = 0; round < 2; ++round) {
    rows.push_back({"dW1 per chunk (today)", f1, median_ms(s, iters, per_chunk1)});
    rows.push_back({"dW1 per head, G chunks", f1, median_ms(s, iters, per_head1)});
    rows.push_back({"dW1 one call, G x H", f1, median_ms(s, iters, batched1)});
    rows.push_back({"dW02 per chunk (today)", f0, median_ms(s, iters, per_chunk0)});
    rows.push_back({"dW02 per head, G chunks", f0, median_ms(s, iters, per_head0)});
    rows.push_back({"dW02 one call, G x H", f0, median_ms(s, iters, batched0)});
  }
  std::printf("G = %d chunks, C %d, H %d, D %d, M %d, median of %d\n", G, C, H, D, M, iters);
  std::printf("%-26s %12s %10s\n", "way", "us/chunk", "TFLOP/s");
  for (const Row& r : rows)
    std::printf("%-26s %12.2f %10.1f\n", r.name, 1e3 * r.ms / G, r.flops * G / (r.ms * 1e9));
  CK(cudaDeviceSynchronize());
  return 0;
}
