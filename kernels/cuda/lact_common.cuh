// Pieces every part of the LaCT GPU layer (lact_cuda_impl.cuh) shares: the
// cuBLAS GEMMs (blas_handle.h's handles; row-major
// operands through cuBLAS's column-major view; split-K for the fp32-output
// GEMMs), launch geometry, and the layer's sizes (Geo) and weight-block rows.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <type_traits>
#include <utility>

#include "core/cuda_check.h"
#include "core/device_pool.h"
#include "core/env_knob.h"
#include "core/error.h"
#include "kernels/cuda/blas_handle.h"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/lact_cuda.h"

namespace statescan::cuda {
namespace lact_detail {

using bf16 = __nv_bfloat16;

// ---- scalar conversions and warp sums: device_math.cuh's ---------------------

using detail::from_float;
using detail::to_float;
using detail::warp_sum;

template <typename T>
constexpr cudaDataType_t data_type();
template <>
constexpr cudaDataType_t data_type<float>() {
  return CUDA_R_32F;
}
template <>
constexpr cudaDataType_t data_type<bf16>() {
  return CUDA_R_16BF;
}
template <>
constexpr cudaDataType_t data_type<double>() {
  return CUDA_R_64F;
}

// The bf16 layer's second stream per (host thread, device), non-blocking (no
// implicit order with the legacy default stream), created on first use and
// kept: LactGpu runs there the output side of a chunk (the fused apply, the
// backward's apply and dq), which reads only the chunk's weights, beside the
// update chain on the caller's stream (LactGpu::on_lane).
inline cudaStream_t side_stream() {
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  thread_local std::map<int, cudaStream_t> streams;
  cudaStream_t& s = streams[device];
  if (s == nullptr) SS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

// ---- cuBLAS -----------------------------------------------------------------

// One operand of a batched row-major GEMM: pointer, element type, leading
// dimension (row stride) and the stride between batch entries, in elements.
struct Operand {
  const void* data;
  cudaDataType_t type;
  int64_t ld, stride;
};
struct Output {
  void* data;
  cudaDataType_t type;
  int64_t ld, stride;
};

// Row-major batched C = alpha op(A) op(B) + beta C with op(A): m x k,
// op(B): k x n, as cuBLAS's column-major C^T = op(B)^T op(A)^T.
// `compute` fixes the precision: CUBLAS_COMPUTE_64F for double operands,
// CUBLAS_COMPUTE_32F_PEDANTIC for fp32 (no TF32), CUBLAS_COMPUTE_32F for bf16.
inline void gemm(cublasHandle_t h, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                 double alpha, const Operand& A, const Operand& B, double beta, const Output& C,
                 int64_t batch, cublasComputeType_t compute) {
  if (m == 0 || n == 0 || batch == 0) return;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (compute == CUBLAS_COMPUTE_64F) {
    SS_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha,
        B.data, B.type, static_cast<int>(B.ld), B.stride, A.data, A.type, static_cast<int>(A.ld),
        A.stride, &beta, C.data, C.type, static_cast<int>(C.ld), C.stride, static_cast<int>(batch),
        compute, CUBLAS_GEMM_DEFAULT));
  } else {
    const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
    SS_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha_f,
        B.data, B.type, static_cast<int>(B.ld), B.stride, A.data, A.type, static_cast<int>(A.ld),
        A.stride, &beta_f, C.data, C.type, static_cast<int>(C.ld), C.stride,
        static_cast<int>(batch), compute, CUBLAS_GEMM_DEFAULT));
  }
}

template <typename T>
constexpr cublasComputeType_t token_compute() {
  return std::is_same<T, float>::value ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
}
// Newton-Schulz precision: fp64 for U = double, fp32 else. Plain
// CUBLAS_COMPUTE_32F with the default math mode never uses TF32 but, unlike
// PEDANTIC, lets cuBLAS pick split-K kernels for these small batched shapes
// (12 matrices of 256 x 512 at the benchmark shape). TF32 was measured: 28%
// faster at 1M tokens, but dk 8.3e-3 on bidir + Muon, over DESIGN's 8e-3.
template <typename U>
constexpr cublasComputeType_t wide_compute() {
  return std::is_same<U, double>::value ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
}

// ---- split-K for GEMMs with small outputs and long contractions -----------
//
// The weight-gradient GEMMs contract over a chunk's tokens (G = [z0 | z2]^T k,
// dW += dh^T q, ...): 2M x D or D x M outputs per head, 16-32 output tiles of
// 256 x 128 over 4 heads at the benchmark shape, against 4,096 tokens of
// contraction, so cuBLAS can keep only 16-32 of 132 SMs busy. Split,
// the contraction's S slices are one batched GEMM over (head, slice) into
// fp32 partials, then a fixed-order sum over the slices (deterministic, no
// atomics). The Newton-Schulz products of a bf16 layer (12 matrices of 256 x
// 256 or 256 x 512 outputs against 768-1536 of two-part contraction: 24-48
// tiles) take the same path. Opt-in (split_k_knob): measured slower. (It was
// written for "one cuBLAS kernel taking 11 of 28 ms in 142 calls" in a
// per-kernel ncu summary of the benchmark; a per-launch listing in the
// eighteenth session showed ~100 of those calls, at ~228 us, to be the
// benchmark's own 4096^3 reference GEMM: docs/performance-history.md, LaCT.)

inline int64_t bytes_of(cudaDataType_t t) {
  return t == CUDA_R_64F ? 8 : t == CUDA_R_32F ? 4 : 2;
}

// Pointers of batch i = h S + s: A and B at head h's base plus slice s's
// offset (bytes), C at partial i (m x n fp32, row-major).
static __global__ void split_k_pointers_kernel(const char* a, int64_t a_head, int64_t a_slice,
                                               const char* b, int64_t b_head, int64_t b_slice,
                                               float* partial, int64_t mn, int heads, int slices,
                                               const void** pa, const void** pb, void** pc) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= heads * slices) return;
  const int h = i / slices, sl = i % slices;
  pa[i] = a + h * a_head + sl * a_slice;
  pb[i] = b + h * b_head + sl * b_slice;
  pc[i] = partial + i * mn;
}

// C[h] = sum over s (in order) of partial[h S + s] (+ beta C[h] when beta != 0:
// C is not read otherwise, so it may hold anything).
static __global__ void split_k_sum_kernel(const float* partial, int slices, int heads, int64_t m,
                                          int64_t n, float beta, float* c, int64_t ldc,
                                          int64_t stride_c) {
  const int64_t mn = m * n, total = heads * mn;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t h = idx / mn, e = idx % mn, r = e / n, col = e % n;
    const float* p = partial + h * slices * mn + e;
    float sum = 0.f;
    for (int sl = 0; sl < slices; ++sl) sum += p[sl * mn];
    float* out = c + h * stride_c + r * ldc + col;
    *out = beta != 0.f ? sum + beta * *out : sum;
  }
}

// ---- stream-ordered scratch -------------------------------------------------

// Row kernels: one block per token row (grid-strided beyond 2^20 rows),
// kRowThreads threads over its columns.
constexpr int kRowThreads = 128;
inline unsigned row_grid(int64_t rows) {
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(rows, 1), 1 << 20));
}

inline unsigned grid_for(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 1 << 20));
}
constexpr int kThreads = 256;

// Calls row(r, lane) for every r in [0, rows), one warp a row (r is the same
// for all its lanes), looping over the grid's warps: grid_for caps the grid
// at 2^20 blocks, so a kernel that stopped after one row a warp would skip
// the rows past 2^20 blocks' warps. blockDim.x a multiple of 32.
template <typename Row>
__device__ __forceinline__ void for_each_warp_row(int64_t rows, Row&& row) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps)
    row(r, lane);
}

// ---- split-K GEMMs (the kernels above) ----------------------------------------

// STATESCAN_LACT_SPLIT_K: unset or 1 no split (the default: on an H200 at the
// benchmark shape the split was slower, forward 141.7 ms -> 203.6 automatic,
// 417.9 with 8 slices, 2026-12-02; README, LaCT; with the fused hidden layer,
// 2 slices: fwd+bwd 92.7 -> 105.6 ms, 2026-12-04); 0 the automatic choice
// (split_k_slices); S > 1 up to S slices of >= 16 on every fp32-output GEMM
// that gemm_sliced runs (the tests force 4).
inline int64_t split_k_knob() {
  static const int64_t knob = env_int("STATESCAN_LACT_SPLIT_K", 1, 0, 64);
  return knob;
}

// Slices of the contraction for `batch` GEMMs of m x n fp32 outputs, k long:
// a power of two dividing k; automatically enough for ~2 output tiles of 128
// x 128 per SM, each slice >= 256 long.
inline int64_t split_k_slices(int64_t m, int64_t n, int64_t k, int64_t batch) {
  int64_t want = split_k_knob();
  if (want == 1) return 1;
  const int64_t min_slice = want > 1 ? 16 : 256;
  if (want == 0) {
    const int64_t tiles = ((m + 127) / 128) * ((n + 127) / 128) * batch;
    const int64_t target = 2 * static_cast<int64_t>(multiprocessor_count());
    want = 1;
    while (want < 16 && tiles * want * 2 <= target) want *= 2;
  }
  int64_t S = 1;
  while (2 * S <= want && k % (2 * S) == 0 && k / (2 * S) >= min_slice) S *= 2;
  return S;
}

// The split GEMMs' fp32 partials and pointer arrays (A, B, C), grown to the
// largest split so far (a few shapes per layer; the pool's stream order keeps
// old arrays alive for queued work).
struct SplitKScratch {
  PoolArray<float> partial;
  PoolArray<uintptr_t> pointers;
};

// gemm() with the contraction in split_k_slices(m, n, k, batch) slices when C
// is fp32 (and the compute type not fp64): one batched GEMM over (matrix,
// slice) into fp32 partials, then their sum in a fixed order (+ beta C).
// Otherwise gemm() itself.
inline void gemm_sliced(cublasHandle_t h, cudaStream_t stream, bool ta, bool tb, int64_t m,
                        int64_t n, int64_t k, double alpha, const Operand& A, const Operand& B,
                        double beta, const Output& C, int64_t batch, cublasComputeType_t compute,
                        SplitKScratch& scratch) {
  const int64_t S =
      C.type == CUDA_R_32F && compute != CUBLAS_COMPUTE_64F ? split_k_slices(m, n, k, batch) : 1;
  if (S <= 1) {
    gemm(h, ta, tb, m, n, k, alpha, A, B, beta, C, batch, compute);
    return;
  }
  if (m == 0 || n == 0 || batch == 0) return;
  const int64_t ks = k / S, parts = batch * S;
  if (scratch.partial.size() < static_cast<std::size_t>(parts * m * n))
    scratch.partial = PoolArray<float>(static_cast<std::size_t>(parts * m * n), stream);
  if (scratch.pointers.size() < static_cast<std::size_t>(3 * parts))
    scratch.pointers = PoolArray<uintptr_t>(static_cast<std::size_t>(3 * parts), stream);
  const void** pa = reinterpret_cast<const void**>(scratch.pointers.get());
  const void** pb = reinterpret_cast<const void**>(scratch.pointers.get() + parts);
  void** pc = reinterpret_cast<void**>(scratch.pointers.get() + 2 * parts);
  // Slice s starts ks further along the contraction: rows of a [k][m]
  // (transposed) A or a [k][n] B, columns of an [m][k] A or an [n][k] B.
  const int64_t ea = bytes_of(A.type), eb = bytes_of(B.type);
  split_k_pointers_kernel<<<grid_for(parts, 128), 128, 0, stream>>>(
      static_cast<const char*>(A.data), A.stride * ea, (ta ? ks * A.ld : ks) * ea,
      static_cast<const char*>(B.data), B.stride * eb, (tb ? ks : ks * B.ld) * eb,
      scratch.partial.get(), m * n, static_cast<int>(batch), static_cast<int>(S), pa, pb, pc);
  SS_LAUNCH_CHECK("split_k_pointers_kernel");
  // Row-major partials through cuBLAS's column-major view, as gemm() does.
  const float alpha_f = static_cast<float>(alpha), zero = 0.f;
  SS_CUBLAS_CHECK(cublasGemmBatchedEx(
      h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
      static_cast<int>(m), static_cast<int>(ks), &alpha_f, pb, B.type, static_cast<int>(B.ld), pa,
      A.type, static_cast<int>(A.ld), &zero, pc, CUDA_R_32F, static_cast<int>(n),
      static_cast<int>(parts), compute, CUBLAS_GEMM_DEFAULT));
  split_k_sum_kernel<<<grid_for(batch * m * n, kThreads), kThreads, 0, stream>>>(
      scratch.partial.get(), static_cast<int>(S), static_cast<int>(batch), m, n,
      static_cast<float>(beta), static_cast<float*>(C.data), C.ld, C.stride);
  SS_LAUNCH_CHECK("split_k_sum_kernel");
}

// ---- geometry -----------------------------------------------------------------

// Sizes of one call. A pair is (batch row b, head h), index b H + h; every
// per-pair weight block is [W0 | W2 | W1] of 3 M D fp32 values.
struct Geo {
  int64_t B, H, D, M, P, local_len, chunk, chunks, pairs, max_n;
  int64_t md() const { return M * D; }
  int64_t block() const { return 3 * M * D; }
  int64_t norms() const { return 2 * M + D; }
  int64_t state() const { return pairs * block(); }
  // Tokens of chunk c on this rank and the local row of its first token.
  int64_t slice_len(int64_t seq_len, int64_t c) const {
    return std::min(chunk, seq_len - c * chunk) / P;
  }
  int64_t slice_start(int64_t c) const { return c * (chunk / P); }
};

inline Geo make_geo(const LactCudaParams& p) {
  Geo g;
  g.B = p.batch;
  g.H = p.heads;
  g.D = p.dim;
  g.M = p.hidden;
  g.P = p.ranks;
  g.local_len = p.local_len();
  g.chunk = p.config.chunk;
  g.chunks = lact_num_chunks(p.seq_len, p.config.chunk);
  g.pairs = p.batch * p.heads;
  g.max_n = std::min(p.config.chunk, p.seq_len) / p.ranks;
  return g;
}

// Row r (of 2M + D) of a weight block: W0's and then W2's M rows of D, then
// W1's D rows of M. Row r's norm sits at index r of the block's norms.
struct RowPlace {
  int64_t offset, cols;
};
__device__ __forceinline__ RowPlace row_place(int64_t r, int64_t M, int64_t D) {
  if (r < 2 * M) return {r * D, D};
  return {2 * M * D + (r - 2 * M) * M, M};
}

// The user's array of slot i of a block: 0 = W0, 1 = W2, 2 = W1.
template <typename P>
__device__ __forceinline__ P slot_array(int64_t slot, P w0, P w1, P w2) {
  return slot == 0 ? w0 : (slot == 1 ? w2 : w1);
}

// Sum over the 32 lanes of a warp (every lane gets it): the fp64 overload
// beside device_math.cuh's fp32 one (Newton-Schulz in double for f32 layers).
__device__ __forceinline__ double warp_sum(double x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace lact_detail
}  // namespace statescan::cuda
