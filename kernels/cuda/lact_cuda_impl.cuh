// The LaCT GPU forward and backward (lact_cuda.h), templated on the token
// storage type T (float | __nv_bfloat16) and the Newton-Schulz type U
// (double for f32, float for bf16). Included by one .cu per instantiation so
// that nvcc builds them in parallel; lact_cuda.cu dispatches on the dtype.
//
// Weight blocks on the GPU are laid out [W0 | W2 | W1] per (batch row, head)
// (the CPU uses [W0 | W1 | W2]): W0 and W2 then form one 2M x D matrix, so
// that h0 and h2 (and every product that pairs them) are one GEMM with twice
// the width. Row norms follow the same order: W0's M rows, W2's M rows, W1's
// D rows. The saved checkpoints use this layout too.
//
// Structure mirrors kernels/cpu/lact.cpp function by function: the same
// two-phase chunk loop around the all-reduce, the same saved state (W_c and
// the update P of each chunk), the same recomputation in backward. Where the
// CPU loops over (batch row, head) pairs, the GPU issues one GEMM per batch
// row batched over the heads, and one fused kernel over all pairs.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "core/cuda_check.h"
#include "core/device_pool.h"
#include "core/env_knob.h"
#include "core/error.h"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/lact_cuda.h"
#include "kernels/cuda/lact_hidden.cuh"
#include "kernels/cuda/lact_math.cuh"
#include "kernels/cuda/lact_ns_cluster.cuh"
#include "kernels/cuda/lact_token_gemm.cuh"
#include "kernels/cuda/warp_mma.cuh"

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

// ---- cuBLAS -----------------------------------------------------------------

// One handle per (host thread, device, slot), created on first use and kept
// for the life of the thread: cublasCreate costs far more than one LaCT
// chunk. Slot 1 serves the layer's side stream (side_stream), so that the
// two streams never share a handle's workspace.
inline cublasHandle_t blas_handle(cudaStream_t stream, int slot = 0) {
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  thread_local std::map<std::pair<int, int>, cublasHandle_t> handles;
  cublasHandle_t& h = handles[{device, slot}];
  if (h == nullptr) {
    SS_CUBLAS_CHECK(cublasCreate(&h));
    // Plain fp32 stays fp32: no TF32 (DESIGN §7's 1e-5 budget).
    SS_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  }
  SS_CUBLAS_CHECK(cublasSetStream(h, stream));
  return h;
}

// The bf16 layer's second stream per (host thread, device), non-blocking (no
// implicit order with the legacy default stream), created on first use and
// kept: LactGpu runs there the output side of a chunk (the fused apply, the
// backward's apply and dq), which reads only the chunk's weights, beside the
// update chain on the caller's stream (LactGpu::on_side).
inline cudaStream_t side_stream() {
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  thread_local std::map<int, cudaStream_t> streams;
  cudaStream_t& s = streams[device];
  if (s == nullptr) SS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

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

// ---- weight-state kernels -----------------------------------------------------

// dst[pairs, 3MD] fp32 blocks [W0 | W2 | W1] from the three initial arrays
// (pair i uses head i % H).
template <typename T>
__global__ void load_weights_kernel(const T* w0, const T* w1, const T* w2, int64_t pairs, int64_t H,
                                    int64_t md, float* dst) {
  const int64_t total = pairs * 3 * md;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t pair = e / (3 * md), o = e % (3 * md), slot = o / md, r = o % md;
    dst[e] = to_float(slot_array(slot, w0, w1, w2)[(pair % H) * md + r]);
  }
}

// norms[blocks, 2M + D]: the L2 norm of every row of every block; one warp per row.
static __global__ void row_norms_kernel(const float* w, int64_t blocks, int64_t M, int64_t D,
                                        float* norms) {
  const int64_t rows = blocks * (2 * M + D);
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows) return;
  const int64_t blk = warp / (2 * M + D), r = warp % (2 * M + D);
  const RowPlace rp = row_place(r, M, D);
  const float* row = w + blk * 3 * M * D + rp.offset;
  float s = 0;
  for (int64_t j = lane; j < rp.cols; j += 32) s += row[j] * row[j];
  s = warp_sum(s);
  if (lane == 0) norms[warp] = sqrtf(s);
}

// Storage-typed copy of fp32 values (GEMM operands of the bf16 path).
template <typename T>
__global__ void convert_kernel(const float* src, int64_t n, T* dst) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x)
    dst[e] = from_float<T>(src[e]);
}

// Momentum: vel = mu vel + g.
static __global__ void momentum_kernel(const float* g, int64_t n, float mu, float* vel) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x)
    vel[e] = mu * vel[e] + g[e];
}

// Backward of momentum: dg += dvel; dvel = mu dg.
static __global__ void momentum_backward_kernel(float* dg, int64_t n, float mu, float* dvel) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const float d = dg[e] + dvel[e];
    dg[e] = d;
    dvel[e] = mu * d;
  }
}

// W_out <- renorm(W_in - step) (W_out may be W_in); one warp per row.
// norm0: [H, 2M + D].
// Rows of up to 32 kStepRenormPerLane columns stay in registers.
// Where op is set, also op <- W rounded to T (the GEMM operand copy that
// convert_kernel would make in a pass of its own: ~7 us a chunk at the
// benchmark's shape).
constexpr int kStepRenormPerLane = 16;
template <typename T>
__global__ void step_renorm_kernel(const float* W_in, float* W_out, const float* step,
                                   const float* norm0, int64_t pairs, int64_t H, int64_t M,
                                   int64_t D, bool renorm, T* op) {
  const int64_t nr = 2 * M + D;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= pairs * nr) return;
  const int64_t pair = warp / nr, r = warp % nr;
  const RowPlace rp = row_place(r, M, D);
  const float* in = W_in + pair * 3 * M * D + rp.offset;
  float* row = W_out + pair * 3 * M * D + rp.offset;
  const float* d = step + pair * 3 * M * D + rp.offset;
  T* op_row = op != nullptr ? op + pair * 3 * M * D + rp.offset : nullptr;
  float s = 0;
  if (rp.cols <= 32 * kStepRenormPerLane) {
    // The row in registers: read once, written once (the loops below re-read
    // it to scale it: 14.0 us a chunk at the benchmark's shape, 9.2 here;
    // H200, ncu). Same arithmetic, so the same bits.
    float x[kStepRenormPerLane];
#pragma unroll
    for (int k = 0; k < kStepRenormPerLane; ++k) {
      const int64_t j = lane + 32 * k;
      x[k] = j < rp.cols ? in[j] - d[j] : 0.f;
      s += x[k] * x[k];
    }
    float scale = 1.f;
    if (renorm) scale = norm0[(pair % H) * nr + r] / (sqrtf(warp_sum(s)) + float(kLactEps));
#pragma unroll
    for (int k = 0; k < kStepRenormPerLane; ++k) {
      const int64_t j = lane + 32 * k;
      if (j >= rp.cols) break;
      const float v = renorm ? x[k] * scale : x[k];
      row[j] = v;
      if (op_row != nullptr) op_row[j] = from_float<T>(v);
    }
    return;
  }
  for (int64_t j = lane; j < rp.cols; j += 32) {
    const float x = in[j] - d[j];
    row[j] = x;
    s += x * x;
    if (!renorm && op_row != nullptr) op_row[j] = from_float<T>(x);
  }
  if (!renorm) return;
  s = warp_sum(s);
  const float scale = norm0[(pair % H) * nr + r] / (sqrtf(s) + float(kLactEps));
  __syncwarp();
  for (int64_t j = lane; j < rp.cols; j += 32) {
    const float x = row[j] * scale;
    row[j] = x;
    if (op_row != nullptr) op_row[j] = from_float<T>(x);
  }
}

// Backward of step_renorm for one chunk: x = W - step, dy = dW (adjoint of
// the new weights). Writes dW <- dx (the direct path), d_step = -dx, and adds
// the renorm target's adjoint x.dy / den to d_norm0 [pairs, 2M + D]. With
// w_op, also W's GEMM operand copy (the pass operand_weights would make).
template <typename T>
__global__ void step_renorm_backward_kernel(const float* W, const float* step, const float* norm0,
                                            int64_t pairs, int64_t H, int64_t M, int64_t D,
                                            bool renorm, float* dW, float* d_step, float* d_norm0,
                                            T* w_op) {
  const int64_t nr = 2 * M + D;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= pairs * nr) return;
  const int64_t pair = warp / nr, r = warp % nr;
  const RowPlace rp = row_place(r, M, D);
  const int64_t base = pair * 3 * M * D + rp.offset;
  if (!renorm) {
    for (int64_t j = lane; j < rp.cols; j += 32) {
      d_step[base + j] = -dW[base + j];
      if (w_op != nullptr) w_op[base + j] = from_float<T>(W[base + j]);
    }
    return;
  }
  float xx = 0, xdy = 0;
  const float n0 = norm0[(pair % H) * nr + r];
  if (rp.cols <= 32 * kStepRenormPerLane) {
    // The row's W, x and dW in registers: read once (the loop below re-reads
    // them; step_renorm_kernel's measure). Same arithmetic, so the same bits.
    float w[kStepRenormPerLane], x[kStepRenormPerLane], dy[kStepRenormPerLane];
#pragma unroll
    for (int k = 0; k < kStepRenormPerLane; ++k) {
      const int64_t j = lane + 32 * k;
      const bool in = j < rp.cols;
      w[k] = in ? W[base + j] : 0.f;
      x[k] = in ? w[k] - step[base + j] : 0.f;
      dy[k] = in ? dW[base + j] : 0.f;
      xx += x[k] * x[k];
      xdy += x[k] * dy[k];
    }
    xx = warp_sum(xx);
    xdy = warp_sum(xdy);
    const float s = sqrtf(xx), den = s + float(kLactEps);
    if (lane == 0) d_norm0[pair * nr + r] += xdy / den;
    const float radial = s > 0.0f ? n0 * xdy / (den * den * s) : 0.0f;
#pragma unroll
    for (int k = 0; k < kStepRenormPerLane; ++k) {
      const int64_t j = lane + 32 * k;
      if (j >= rp.cols) break;
      const float dx = n0 / den * dy[k] - radial * x[k];
      dW[base + j] = dx;
      d_step[base + j] = -dx;
      if (w_op != nullptr) w_op[base + j] = from_float<T>(w[k]);
    }
    return;
  }
  for (int64_t j = lane; j < rp.cols; j += 32) {
    const float x = W[base + j] - step[base + j];
    xx += x * x;
    xdy += x * dW[base + j];
  }
  xx = warp_sum(xx);
  xdy = warp_sum(xdy);
  const float s = sqrtf(xx), den = s + float(kLactEps);
  if (lane == 0) d_norm0[pair * nr + r] += xdy / den;
  const float radial = s > 0.0f ? n0 * xdy / (den * den * s) : 0.0f;
  __syncwarp();
  for (int64_t j = lane; j < rp.cols; j += 32) {
    const float w = W[base + j], x = w - step[base + j];
    const float dx = n0 / den * dW[base + j] - radial * x;
    dW[base + j] = dx;
    d_step[base + j] = -dx;
    if (w_op != nullptr) w_op[base + j] = from_float<T>(w);
  }
}

// The initial weights' gradient [H, 3MD]: the carried adjoints summed over
// batch rows plus the renorm targets' path n0 = |w row| (dn0 w / n0).
static __global__ void initial_grad_kernel(const float* dW, const float* d_norm0,
                                           const float* w_init, const float* norm0, int64_t B,
                                           int64_t H, int64_t M, int64_t D, bool renorm,
                                           float* d_init) {
  const int64_t md = M * D, block = 3 * md, nr = 2 * M + D;
  const int64_t total = H * block;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = e / block, o = e % block;
    const int64_t r = o < 2 * md ? o / D : 2 * M + (o - 2 * md) / M;  // row = norm index
    float acc = 0, dn = 0;
    for (int64_t b = 0; b < B; ++b) {
      acc += dW[(b * H + h) * block + o];
      dn += d_norm0[(b * H + h) * nr + r];
    }
    if (renorm) {
      const float n0 = norm0[h * nr + r];
      if (n0 != 0.0f) acc += dn / n0 * w_init[e];
    }
    d_init[e] = acc;
  }
}

// dw0, dw1, dw2 [H, ...] in storage type from d_init [H, 3MD] ([W0 | W2 | W1]).
template <typename T>
__global__ void store_weight_grads_kernel(const float* d_init, int64_t H, int64_t md, T* dw0,
                                          T* dw1, T* dw2) {
  const int64_t total = H * 3 * md;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = e / (3 * md), o = e % (3 * md), slot = o / md, r = o % md;
    slot_array(slot, dw0, dw1, dw2)[h * md + r] = from_float<T>(d_init[e]);
  }
}

// ---- token kernels ------------------------------------------------------------

// Apply forward: gate = silu(h0) h2 (operand type, rows of M) from the
// hidden rows h = [h0 | h2] (rows of 2M). Blocks stride over rows, threads
// over a row's columns (no per-element index division).
template <typename T>
__global__ void apply_gate_kernel(const float* h, int64_t rows, int64_t M, T* gate) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* hr = h + row * 2 * M;
    T* g = gate + row * M;
    for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
      const float x = hr[j];
      g[j] = from_float<T>(x / (1.0f + expf(-x)) * hr[M + j]);
    }
  }
}

// Key side of the update gradient, lr-weighted (operands of G's GEMMs), from
// h = [h0 | h2] (rows of 2M) and e (rows of M): z = [z0 | z2] with
// z0 = lr0 e h2 silu'(h0), z2 = lr2 e silu(h0); gate = lr1 silu(h0) h2.
// With z_lo / gate_lo (bf16 with Muon, see LactGpu::split_update_) each value
// is also written as a second bf16 term, x - bf16(x), so that hi + lo carries
// it to ~2^-16. Blocks stride over the pairs' token rows, threads over columns.
template <typename T>
__global__ void key_side_kernel(const float* h, const float* e_in, const T* lr0, const T* lr1,
                                const T* lr2, int64_t pairs, int64_t n, int64_t M, int64_t H,
                                int64_t local_len, int64_t t0, T* z, T* gate, T* z_lo, T* gate_lo) {
  for (int64_t row = blockIdx.x; row < pairs * n; row += gridDim.x) {
    const int64_t pair = row / n, t = row % n;
    const float l0 = lr_at(lr0, pair, t, H, local_len, t0);
    const float l1 = lr_at(lr1, pair, t, H, local_len, t0);
    const float l2 = lr_at(lr2, pair, t, H, local_len, t0);
    const float* hr = h + row * 2 * M;
    const float* er = e_in + row * M;
    T* zr = z + row * 2 * M;
    T* gr = gate + row * M;
    for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
      const SiluF s(hr[j]);
      const float ev = er[j], hv = hr[M + j];
      const float z0 = l0 * ev * hv * s.d1, z2 = l2 * ev * s.value, g = l1 * s.value * hv;
      const T z0_hi = from_float<T>(z0), z2_hi = from_float<T>(z2), g_hi = from_float<T>(g);
      zr[j] = z0_hi;
      zr[M + j] = z2_hi;
      gr[j] = g_hi;
      if (z_lo != nullptr) {
        z_lo[row * 2 * M + j] = from_float<T>(z0 - to_float(z0_hi));
        z_lo[row * 2 * M + M + j] = from_float<T>(z2 - to_float(z2_hi));
        gate_lo[row * M + j] = from_float<T>(g - to_float(g_hi));
      }
    }
  }
}

// Apply backward elementwise, from h = [h0 | h2] and dgate (rows of M):
// gate = silu(h0) h2 (rows of M) and dh = [dg h2 silu'(h0) | dg silu(h0)]
// (rows of 2M), as operands. Blocks over rows, threads over columns.
template <typename T>
__global__ void apply_backward_kernel(const float* h, const float* dgate, int64_t rows, int64_t M,
                                      T* gate, T* dh) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* hr = h + row * 2 * M;
    const float* dgr = dgate + row * M;
    T* gr = gate + row * M;
    T* dhr = dh + row * 2 * M;
    for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
      const SiluF s(hr[j]);
      const float hv = hr[M + j], dg = dgr[j];
      gr[j] = from_float<T>(s.value * hv);
      dhr[j] = from_float<T>(dg * hv * s.d1);
      dhr[M + j] = from_float<T>(dg * s.value);
    }
  }
}

// Backward of the update gradient, one block per token row (pair, t): from
// h = [h0 | h2], e, u = [u0 | u2] = k [dG0; dG2]^T and u1 = dG1^T v (fp32)
// writes dlr0..2 of the token and the operands z = [z0 | z2], gate (lr-
// weighted, for dk and dv), de and dh = [dh0 | dh2] (for dW, dk, dv).
// Rows of 2M: h, u, z, dh; rows of M: e, u1, gate, de.
template <typename T>
__global__ void gradients_backward_rows_kernel(const float* h, const float* e_in, const float* u,
                                               const float* u1, const T* lr0, const T* lr1,
                                               const T* lr2, int64_t n, int64_t M, int64_t H,
                                               int64_t local_len, int64_t t0, T* dlr0, T* dlr1,
                                               T* dlr2, T* z_out, T* gate_out, T* de_out,
                                               T* dh_out) {
  const int64_t row = blockIdx.x;  // pair * n + t
  const int64_t pair = row / n, t = row % n;
  const float l0 = lr_at(lr0, pair, t, H, local_len, t0);
  const float l1 = lr_at(lr1, pair, t, H, local_len, t0);
  const float l2 = lr_at(lr2, pair, t, H, local_len, t0);
  float s0 = 0, s1 = 0, s2 = 0;
  for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
    const int64_t i = row * M + j, i0 = row * 2 * M + j, i2 = i0 + M;
    const SiluF s(h[i0]);
    const float hv = h[i2], ev = e_in[i], u0 = u[i0], u2 = u[i2], v1 = u1[i];
    const float gate = s.value * hv, z0 = ev * hv * s.d1, z2 = ev * s.value;
    s0 += z0 * u0;
    s2 += z2 * u2;
    s1 -= gate * v1;
    z_out[i0] = from_float<T>(l0 * z0);
    z_out[i2] = from_float<T>(l2 * z2);
    gate_out[i] = from_float<T>(l1 * gate);
    const float dz0 = l0 * u0, dz2 = l2 * u2, dgate = -l1 * v1;
    de_out[i] = from_float<T>(dz2 * s.value + dz0 * hv * s.d1);
    const float dact = dz2 * ev + dgate * hv;
    dh_out[i2] = from_float<T>(dz0 * ev * s.d1 + dgate * s.value);
    dh_out[i0] = from_float<T>(dz0 * ev * hv * s.d2 + dact * s.d1);
  }
  __shared__ float red[3][32];
  s0 = warp_sum(s0);
  s1 = warp_sum(s1);
  s2 = warp_sum(s2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) red[0][warp] = s0, red[1][warp] = s1, red[2][warp] = s2;
  __syncthreads();
  if (threadIdx.x == 0) {
    float a = 0, b = 0, c = 0;
    for (int w = 0; w < warps; ++w) a += red[0][w], b += red[1][w], c += red[2][w];
    const int64_t b_row = pair / H, hh = pair % H;
    const int64_t idx = (b_row * local_len + t0 + t) * H + hh;
    dlr0[idx] = from_float<T>(a);
    dlr1[idx] = from_float<T>(b);
    dlr2[idx] = from_float<T>(c);
  }
}

// Token gradients of one chunk slice from the fp32 accumulator [B, n, H D]
// into the storage tensor [B, T_local, H D] at local row t0.
template <typename T>
__global__ void store_tokens_kernel(const float* src, int64_t B, int64_t n, int64_t hd,
                                    int64_t local_len, int64_t t0, T* dst) {
  const int64_t total = B * n * hd;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = e / (n * hd), r = e % (n * hd);
    dst[(b * local_len + t0) * hd + r] = from_float<T>(src[e]);
  }
}

// ---- Newton-Schulz (Muon) -------------------------------------------------------

// The three matrices of every pair, each oriented so that its Gram matrix is
// the smaller side, all m x n with m = min(M, D), n = max(M, D): W0 and W2
// (M x D) transpose when M > D, W1 (D x M) when D > M. Matrix `mat` (= pair *
// 3 + slot) of a [pairs, 3MD] array starts at mat M D; untransposed it already
// is m x n row-major, transposed it is n x m.
__device__ __forceinline__ bool oriented_transposes(int64_t mat, int M, int D) {
  return mat % 3 == 2 ? D > M : M > D;
}

// Tile shape of the Newton-Schulz layout kernels: 32 x 32 tiles, 32 x 8
// threads each covering kDim / kRows rows, one padding column in shared
// memory against bank conflicts. Block (x, y, z) takes the tile at rows
// kDim y, columns kDim x of matrices z, z + gridDim.z, ... These kernels used
// to take one thread per element with 64-bit division and modulo for the
// indices, and read transposed matrices with a stride of a whole row (on the
// H200 at 12 matrices of 256 x 512: ns_load 18 us, ns_store 21 us, symmetrise
// 9 us a call). Every element still goes through the same conversion, so the
// results are bitwise the same.
struct NsTile {
  static constexpr int kDim = 32, kRows = 8;
  static_assert(kDim % kRows == 0, "every thread covers whole rows of a tile");
  static_assert(kDim == 32, "a tile row is one warp");
};

// The block's tile of one matrix, dst = f(src) elementwise: src and dst
// rows x cols, both row-major (transposed = false), or src rows x cols and
// dst its cols x rows transpose (transposed = true, through the shared
// `tile`, so that both the reads and the writes are coalesced). (i0, j0): the
// tile's first row and column in src. Ends with a barrier when transposed
// (the caller refills the tile next), none otherwise; `transposed` must be
// uniform over the block.
template <typename In, typename Out, typename F>
__device__ __forceinline__ void ns_copy_tile(const In* src, int rows, int cols, int i0, int j0,
                                             bool transposed, Out* dst, F f,
                                             In (&tile)[NsTile::kDim][NsTile::kDim + 1]) {
  constexpr int kDim = NsTile::kDim, kRows = NsTile::kRows;
  const int tx = threadIdx.x, ty = threadIdx.y;
  if (!transposed) {
    for (int k = 0; k < kDim; k += kRows) {
      const int i = i0 + ty + k, j = j0 + tx;
      if (i < rows && j < cols) dst[i * cols + j] = f(src[i * cols + j]);
    }
    return;
  }
  // tile[p][q] = src(i0 + p, j0 + q); dst(j, i) = f(src(i, j)).
  for (int k = 0; k < kDim; k += kRows) {
    const int i = i0 + ty + k, j = j0 + tx;
    if (i < rows && j < cols) tile[ty + k][tx] = src[i * cols + j];
  }
  __syncthreads();
  for (int k = 0; k < kDim; k += kRows) {
    const int j = j0 + ty + k, i = i0 + tx;
    if (i < rows && j < cols) dst[j * rows + i] = f(tile[tx][ty + k]);
  }
  __syncthreads();
}

// X[mat] (packed m x n, U) = oriented(P[mat]) * scale[mat] (scale null: 1).
// Block (x, y, z): the tile at oriented rows 32 y, columns 32 x. Shared
// memory: 32 x 33 floats.
template <typename U>
__global__ void ns_load_kernel(const float* __restrict__ P, const U* __restrict__ scale,
                               int64_t mats, int M, int D, U* __restrict__ X) {
  constexpr int kDim = NsTile::kDim;
  __shared__ float tile[kDim][kDim + 1];
  const int m = min(M, D), n = max(M, D), r0 = blockIdx.y * kDim, c0 = blockIdx.x * kDim;
  for (int64_t mat = blockIdx.z; mat < mats; mat += gridDim.z) {
    const auto f = [&](float v) {
      const U x = static_cast<U>(v);
      return scale ? x * scale[mat] : x;
    };
    const float* src = P + mat * (int64_t(m) * n);
    U* dst = X + mat * (int64_t(m) * n);
    // Transposed, P's matrix is n x m and the tile starts at its row c0.
    if (oriented_transposes(mat, M, D))
      ns_copy_tile(src, n, m, c0, r0, true, dst, f, tile);
    else
      ns_copy_tile(src, m, n, r0, c0, false, dst, f, tile);
  }
}

// out[mat] (fp32, original orientation) = X[mat]; the inverse of
// ns_load_kernel without a scale. Shared memory: 32 x 33 U.
template <typename U>
__global__ void ns_store_kernel(const U* __restrict__ X, int64_t mats, int M, int D,
                                float* __restrict__ out) {
  constexpr int kDim = NsTile::kDim;
  __shared__ U tile[kDim][kDim + 1];
  const int m = min(M, D), n = max(M, D), r0 = blockIdx.y * kDim, c0 = blockIdx.x * kDim;
  const auto f = [](U v) { return static_cast<float>(v); };
  for (int64_t mat = blockIdx.z; mat < mats; mat += gridDim.z)
    ns_copy_tile(X + mat * (int64_t(m) * n), m, n, r0, c0, oriented_transposes(mat, M, D),
                 out + mat * (int64_t(m) * n), f, tile);
}

// S = dA + dA^T for every m x m matrix, dA^T read through a shared tile
// (32 x 33 U). The sum keeps the order dA(i, j) + dA(j, i).
template <typename U>
__global__ void symmetrise_kernel(const U* __restrict__ dA, int64_t mats, int m,
                                  U* __restrict__ S) {
  constexpr int kDim = NsTile::kDim, kRows = NsTile::kRows;
  __shared__ U tile[kDim][kDim + 1];
  const int i0 = blockIdx.y * kDim, j0 = blockIdx.x * kDim, tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t mat = blockIdx.z; mat < mats; mat += gridDim.z) {
    const U* a = dA + mat * (int64_t(m) * m);
    U* s = S + mat * (int64_t(m) * m);
    // tile[p][q] = dA(j0 + p, i0 + q).
    for (int k = 0; k < kDim; k += kRows) {
      const int j = j0 + ty + k, i = i0 + tx;
      if (i < m && j < m) tile[ty + k][tx] = a[j * m + i];
    }
    __syncthreads();
    for (int k = 0; k < kDim; k += kRows) {
      const int i = i0 + ty + k, j = j0 + tx;
      if (i < m && j < m) s[i * m + j] = a[i * m + j] + tile[tx][ty + k];
    }
    __syncthreads();  // the next matrix refills the tile
  }
}

// The Frobenius normalisation's per-matrix sums in double, in a fixed order
// (no atomics: runs repeat bitwise). One block per matrix over its 131,072
// elements (12 blocks on the H200's 132 SMs) was latency-bound: 198 us a
// call for the norms, 429 us for the normalisation backward. Now every matrix
// is cut into kNsSlices slices, one block each; a slice's sums go to a small
// buffer and the consumer adds a matrix's kNsSlices partials one per lane of
// a warp.
constexpr int kNsSlices = 32;
static_assert(kNsSlices == 32, "the partials of a matrix are combined by one warp");

// The [begin, end) elements of slice s of a matrix of len elements.
struct NsSlice {
  int begin, end;
  __device__ __forceinline__ NsSlice(int s, int len) {
    const int per = (len + kNsSlices - 1) / kNsSlices;
    begin = min(len, s * per);
    end = min(len, begin + per);
  }
};

// part[(mat kNsSlices + s) kSums + 0] = sum of x^2 over slice s of matrix mat
// (len elements at mat len) and, when kSums == 2, part[... + 1] = sum of x y.
// Block (s, y) -> slice s of matrices y, y + gridDim.y, ...; kThreads threads.
// Each thread adds its elements in index order (four loads in flight), then
// warps reduce, then thread 0 adds the warps in order.
template <int kSums, typename V>
__global__ void ns_slice_sums_kernel(const V* __restrict__ x, const V* __restrict__ y, int64_t mats,
                                     int len, double* __restrict__ part) {
  static_assert(kSums == 1 || kSums == 2, "x^2, and x y with kSums == 2");
  __shared__ double red[kSums][32];
  const NsSlice slice(blockIdx.x, len);
  const int step = blockDim.x;
  for (int64_t mat = blockIdx.y; mat < mats; mat += gridDim.y) {
    const V* xm = x + mat * len;
    [[maybe_unused]] const V* ym = kSums == 2 ? y + mat * len : nullptr;
    double s[kSums] = {};
    int j = slice.begin + threadIdx.x;
    for (; j + 3 * step < slice.end; j += 4 * step) {
      double a[4], b[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        a[u] = double(xm[j + u * step]);
        if constexpr (kSums == 2) b[u] = double(ym[j + u * step]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        s[0] += a[u] * a[u];
        if constexpr (kSums == 2) s[1] += a[u] * b[u];
      }
    }
    for (; j < slice.end; j += step) {
      const double a = double(xm[j]);
      s[0] += a * a;
      if constexpr (kSums == 2) s[1] += a * double(ym[j]);
    }
#pragma unroll
    for (int k = 0; k < kSums; ++k) {
      s[k] = warp_sum(s[k]);
      if (threadIdx.x % 32 == 0) red[k][threadIdx.x / 32] = s[k];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int k = 0; k < kSums; ++k) {
        double t = 0;
        for (int w = 0; w < int(blockDim.x / 32); ++w) t += red[k][w];
        part[(mat * kNsSlices + blockIdx.x) * kSums + k] = t;
      }
    }
    __syncthreads();  // the next matrix refills red
  }
}

// scale[mat] = 1 / (||P[mat]||_F + eps) from ns_slice_sums_kernel<1>'s
// partials: one warp per matrix, lane s taking slice s.
template <typename U>
__global__ void ns_scale_kernel(const double* __restrict__ part, int64_t mats,
                                U* __restrict__ scale) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t mat = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; mat < mats;
       mat += warps) {
    const double t = warp_sum(part[mat * kNsSlices + threadIdx.x % 32]);
    if (threadIdx.x % 32 == 0) scale[mat] = static_cast<U>(1.0 / (sqrt(t) + kLactEps));
  }
}

// Backward of the Frobenius normalisation, with Xp the unscaled oriented input
// and dX the adjoint of X_0: dXp = dX / den - (Xp.dX) / (den^2 f) Xp, written
// over dX, from ns_slice_sums_kernel<2>'s partials of (Xp, dX). Block (s, y)
// -> slice s of matrices y, y + gridDim.y, ...; kThreads threads. Warp 0
// first adds the matrix's partials (lane s taking slice s), so every block of
// a matrix gets the same f and dot.
template <typename U>
__global__ void ns_normalise_backward_kernel(const U* __restrict__ Xp,
                                             const double* __restrict__ part, int64_t mats, int mn,
                                             U* __restrict__ dX) {
  __shared__ double coef[2];  // den, radial
  const NsSlice slice(blockIdx.x, mn);
  const int step = blockDim.x;
  for (int64_t mat = blockIdx.y; mat < mats; mat += gridDim.y) {
    if (threadIdx.x < 32) {
      const double* p = part + (mat * kNsSlices + threadIdx.x) * 2;
      const double ss = warp_sum(p[0]), sd = warp_sum(p[1]);
      if (threadIdx.x == 0) {
        const double f = sqrt(ss), den = f + kLactEps;
        coef[0] = den;
        coef[1] = f > 0 ? sd / (den * den * f) : 0.0;
      }
    }
    __syncthreads();
    const double den = coef[0], radial = coef[1];
    const U* x = Xp + mat * mn;
    U* d = dX + mat * mn;
    int j = slice.begin + threadIdx.x;
    for (; j + 3 * step < slice.end; j += 4 * step) {
      double a[4], b[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) a[u] = double(x[j + u * step]), b[u] = double(d[j + u * step]);
#pragma unroll
      for (int u = 0; u < 4; ++u) d[j + u * step] = static_cast<U>(b[u] / den - radial * a[u]);
    }
    for (; j < slice.end; j += step)
      d[j] = static_cast<U>(double(d[j]) / den - radial * double(x[j]));
    __syncthreads();  // the next matrix rewrites coef
  }
}

// Newton-Schulz GEMMs of bf16 layers on bf16 tensor cores with two-part
// operands (the default; STATESCAN_LACT_NS=fp32 runs them as fp32 CUDA-core
// GEMMs, for A/B runs): each fp32 operand x = hi + lo with hi = bf16(x), lo =
// bf16(x - hi), and A B ~ A_hi B_hi + A_hi B_lo + A_lo B_hi as ONE bf16 GEMM
// whose contraction is three times as long: A stacked [hi | hi | lo] and B
// [hi ; lo ; hi] along K. The host model (tests/test_lact_ns_model.cpp) puts
// this at 4.6e-5 of NS(P) and 8.4e-5 of its gradient (fp32 GEMMs: 3.5e-7;
// TF32: 3.2e-3 and 5.9e-3, too coarse). H200, the issue's shape (1M tokens,
// 256 chunks of 4096, H 4, D 256, M 512), 2026-12-02: forward 182.8 -> 143.0
// ms, forward + backward 666.8 -> 492.3 ms against the fp32 GEMMs, the layer's
// error vs fp64 unchanged (7.3e-3 on the bench's check problem). f32 layers
// keep their double Newton-Schulz. STATESCAN_LACT_NS=fused (opt-in: passes
// the GPU suite, slower on an H200; lact_cuda.h) computes the same three
// products in ns_gemm_fused_kernel, splitting in registers instead of through
// split3_kernel's buffers.
// The mode: ns_gemms_requested() (lact_cuda.h).

// Where split3_kernel writes one stacking of its source: slot s is the low
// part where bit s of lo_mask is set, the high part otherwise; the three slots
// follow each other along the columns (k_is_cols) or the rows.
struct Split3Target {
  bf16* dst;
  bool k_is_cols;
  int lo_mask;
};
// One or two stackings from one read of the source (X X^T and A A take the
// same matrix as both operands).
struct Split3Targets {
  Split3Target t[2];
  int count;
};

// The bf16 bits of kVec consecutive columns as one word, stored in one
// access: 8 bytes for 4 columns. (nvcc split an aligned struct of 4 bf16
// into four 2-byte stores, and a uint2 into two 4-byte ones.)
template <int kVec>
struct Bf16Bits;
template <>
struct Bf16Bits<1> {
  using type = unsigned short;
  static __device__ __forceinline__ type pack(const unsigned short* v) { return v[0]; }
};
template <>
struct Bf16Bits<4> {
  using type = unsigned long long;
  // Little-endian: the lower column in the lower bits.
  static __device__ __forceinline__ type pack(const unsigned short* v) {
    return type(v[0]) | (type(v[1]) << 16) | (type(v[2]) << 32) | (type(v[3]) << 48);
  }
};

// Each target's dst = `batch` packed rows x cols fp32 matrices, each stacked
// three times along its contraction dimension as bf16 parts (Split3Target).
// Block (x, y, z): 32 x 8 threads; thread (tx, ty) takes kVec consecutive
// columns, from kVec (32 x + tx), of rows 8 y + ty, grid-strided, of matrices
// z, z + gridDim.z, ...: one float4 load and an 8-byte store per slot when
// kVec == 4 (cols % 4 == 0, 16-byte aligned source). The version with one
// thread per element and 64-bit division and modulo took 9.6 us a call on
// the H200, 10 ms per 8 chunks of a layer against 4.9 ms for the bf16 GEMMs
// themselves. Same parts, same layout: bitwise the same operands.
template <int kVec>
__global__ void split3_kernel(const float* __restrict__ src, int64_t batch, int rows, int cols,
                              Split3Targets targets) {
  static_assert(kVec == 1 || kVec == 4, "scalar or float4 columns");
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * kVec;
  if (c >= cols) return;  // no barrier below
  const int64_t per = int64_t(rows) * cols;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    for (int r = blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += gridDim.y * blockDim.y) {
      const float* in = src + b * per + r * cols + c;
      float x[kVec];
      if constexpr (kVec == 4) {
        const float4 v = *reinterpret_cast<const float4*>(in);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
      } else {
        x[0] = *in;
      }
      unsigned short hi_bits[kVec], lo_bits[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const bf16 hi = __float2bfloat16_rn(x[i]);
        const bf16 lo = __float2bfloat16_rn(x[i] - __bfloat162float(hi));
        hi_bits[i] = __bfloat16_as_ushort(hi);
        lo_bits[i] = __bfloat16_as_ushort(lo);
      }
      using Bits = Bf16Bits<kVec>;
      const typename Bits::type hi = Bits::pack(hi_bits), lo = Bits::pack(lo_bits);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        if (t >= targets.count) break;
        const Split3Target& target = targets.t[t];
        bf16* out = target.dst + 3 * b * per;
#pragma unroll
        for (int slot = 0; slot < 3; ++slot) {
          const int at =
              target.k_is_cols ? r * 3 * cols + slot * cols + c : (slot * rows + r) * cols + c;
          *reinterpret_cast<typename Bits::type*>(out + at) =
              (target.lo_mask >> slot) & 1 ? lo : hi;
        }
      }
    }
  }
}

// ---- fused two-part bf16 GEMM (STATESCAN_LACT_NS=fused) -----------------------
//
// Why: on the H200 (12 matrices of 256 x 512, 8 chunks forward + backward)
// the split path's bf16 GEMMs take ~4.9 ms but its split3_kernel launches
// ~4.0 ms (720 calls of 5.5 us, memory-bound: 6 MB read and 9 MB written per
// call). This kernel reads the fp32 operands once and forms hi/lo in
// registers: no split buffers, no split launches. Opt-in (STATESCAN_LACT_NS=
// fused, ctest test_cuda_lact_ns_fused): it passes the GPU suite, but on an
// H200 (2026-12-02) its products took 10.7 ms per 8 chunks where split +
// cuBLAS take ~8.9 (forward 158.4 ms against 143.7).

// Tile shape: a 64 x 64 output tile per CTA, K in steps of 32, 4 warps of
// 32 x 32 (2 x 4 m16n8 tiles each), two cp.async stages.
struct NsFusedTile {
  static constexpr int kM = 64, kN = 64, kK = 32;
  static constexpr int kWarpM = 32, kWarpN = 32;
  static constexpr int kWarps = (kM / kWarpM) * (kN / kWarpN);
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMTiles = kWarpM / 16, kNTiles = kWarpN / 8;
  static constexpr int kStages = 2;
  // M, N and K must be multiples of this (the host falls back otherwise):
  // a 16-byte chunk of 4 floats is then wholly inside or wholly outside a
  // matrix, and an m16n8k16 step never straddles an edge.
  static constexpr int kDimMultiple = 16;
  // A stage holds an operand tile as it lies in global memory (the copy never
  // transposes, so every copy is 16 contiguous bytes): "k-contiguous" tiles
  // (A, or B^T when transposed) as [64 rows][32 k] with row stride kLdK,
  // "k-strided" tiles (A^T, B) as [32 k][64 columns] with row stride kLdMN.
  // The pads make the fragment reads conflict-free: a k-contiguous read is a
  // float2 at (g kLdK + 2 i) words, and 8 g mod 32 spreads the 4 groups of a
  // half-warp over distinct 8-word ranges; a k-strided read is a float at
  // (2 i kLdMN + g) words, 8 i + g mod 32 distinct over the warp. The rows
  // stay 16-byte aligned (160 and 272 bytes) for cp.async.
  static constexpr int kLdK = kK + 8, kLdMN = kM + 4;
  static constexpr int kKContigFloats = kM * kLdK, kKStridedFloats = kK * kLdMN;
  static_assert(kM == kN, "k-strided tiles of A^T and B share kLdMN");
  static_assert(kK % 16 == 0 && kWarpM % 16 == 0 && kWarpN % 8 == 0, "whole mma steps");
  static_assert(kK % 4 == 0 && kM % 4 == 0, "tile rows of whole 16-byte chunks");
  static_assert(kLdK % 4 == 0 && kLdMN % 4 == 0, "16-byte aligned shared rows");
  static_assert(kKContigFloats % 4 == 0 && kKStridedFloats % 4 == 0, "16-byte aligned stages");
  static_assert(kM % kDimMultiple == 0 && kK % kDimMultiple == 0, "edges fall on whole chunks");
  static constexpr int stage_floats(bool k_contig) {
    return k_contig ? kKContigFloats : kKStridedFloats;
  }
};

// One ns_gemm call, packed row-major fp32 matrices b < mats:
//   A_b at A + b M K: M x K, or K x M when kTA (op(A_b) = A_b^T);
//   B_b at B + b K N: K x N, or N x K when kTB;
//   C_b at C + b M N: M x N, never overlapping A or B.
struct NsGemmParams {
  const float* A;
  const float* B;
  float* C;
  int64_t mats;
  int M, N, K;
  float alpha, beta;  // beta == 0: C is not read (it may be uninitialised)
};

// Loads one operand tile of kRows x kCols floats (as stored: row r of the
// tile is global row row0 + r, columns col0 ..) into `dst` (row stride ld_dst)
// with 16-byte cp.async, thread t of NsFusedTile::kThreads; chunks past
// rows_valid x cols_valid are zeroed with plain shared stores instead, so they
// add nothing to the products (visible after the barrier that follows the
// cp.async wait).
template <int kRows, int kCols>
__device__ __forceinline__ void ns_fused_load_tile(float* dst, int ld_dst, const float* src,
                                                   int ld_src, int row0, int col0, int rows_valid,
                                                   int cols_valid, int t) {
  constexpr int kPerRow = kCols / 4;
  constexpr int kChunks = kRows * kPerRow;
  static_assert(kChunks % NsFusedTile::kThreads == 0, "every thread copies whole chunks");
#pragma unroll
  for (int it = 0; it < kChunks / NsFusedTile::kThreads; ++it) {
    const int idx = t + it * NsFusedTile::kThreads;
    const int r = idx / kPerRow, c = (idx % kPerRow) * 4;
    float* d = dst + r * ld_dst + c;
    if (row0 + r < rows_valid && col0 + c < cols_valid)
      detail::cp_async16(d, src + (row0 + r) * ld_src + col0 + c);
    else
      *reinterpret_cast<float4*>(d) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// Elements (mn, k) and (mn, k + 1) of a staged operand tile, where mn is the
// tile's row of op(A) or column of op(B) and k its contraction index:
// k-contiguous tiles hold them side by side (one float2), k-strided tiles a
// row apart.
template <bool kKContig>
__device__ __forceinline__ float2 ns_fused_pair(const float* s, int mn, int k) {
  if constexpr (kKContig) {
    return *reinterpret_cast<const float2*>(s + mn * NsFusedTile::kLdK + k);
  } else {
    return make_float2(s[k * NsFusedTile::kLdMN + mn], s[(k + 1) * NsFusedTile::kLdMN + mn]);
  }
}

// x = hi + lo as split3_kernel forms them (detail::split_bf16x2), two
// elements per 32-bit register, the first in the low half as mma expects:
// bitwise the split path's operands.
__device__ __forceinline__ void ns_fused_split(float2 v, uint32_t& hi, uint32_t& lo) {
  detail::split_bf16x2(v.x, v.y, hi, lo);
}

// For every matrix b < mats: C_b = alpha op(A_b) op(B_b) + beta C_b on bf16
// tensor cores as A_hi B_hi + A_hi B_lo + A_lo B_hi (fp32 accumulation), the
// products split3_kernel + one cuBLAS GEMM with K tripled compute (see the
// comment above ns_gemms_requested), without the split buffers.
//
// Grid: x over 64-column tiles of C, y over 64-row tiles, z over matrices
// (grid-strided past 65535). Block: 4 warps; warp w computes rows 32 (w / 2)
// .. + 32 and columns 32 (w % 2) .. + 32 of the CTA's tile as 2 x 4 m16n8
// accumulators. Shared memory (static): 2 stages x (A tile + B tile), fp32,
// k-contiguous 64 x 40 floats (10240 B) or k-strided 32 x 68 (8704 B) each:
// 37888 B for (ta, tb) = (no, no), 40960 B for (no, yes), the shapes
// Newton-Schulz uses (34816 and 37888 B with ta). Constraints (the host checks them and falls back
// to the split path): M, N, K multiples of 16, A, B, C 16-byte aligned, C not overlapping A or B.
// Deterministic: each output element is summed in a fixed order (k tiles ascending; per k16 step
// the lo-hi, hi-lo, hi-hi products), no atomics.
//
// m16n8k16 .row.col bf16 fragments (PTX ISA; the same layout warp_mma.cuh's
// ldmatrix loads produce, validated there on the GPU), lane = 4 g + i with
// g = lane / 4, i = lane % 4, each 32-bit register two bf16, the lower k (or
// column) in the low half:
//   A (16 x 16, [row][k]): a[0] = (g,     2i .. 2i+1), a[1] = (g + 8, 2i .. 2i+1),
//                          a[2] = (g,  2i+8 .. 2i+9), a[3] = (g + 8, 2i+8 .. 2i+9);
//   B (16 x 8, [k][col]):  b[0] = (k 2i .. 2i+1, col g), b[1] = (k 2i+8 .. 2i+9, col g);
//   C (16 x 8, fp32):      c[0], c[1] = (g, 2i .. 2i+1), c[2], c[3] = (g + 8, 2i .. 2i+1).
// Every register pair is ns_fused_pair(tile, mn, k) with mn the op(A) row or
// op(B) column and k the contraction index, so a transposed operand changes
// only where that pair lies in shared memory (kKContig), not the mapping.
template <bool kTA, bool kTB>
__global__ void __launch_bounds__(NsFusedTile::kThreads)
    ns_gemm_fused_kernel(const __grid_constant__ NsGemmParams p) {
  using Tile = NsFusedTile;
  // op(A) is k-contiguous in memory unless transposed; op(B) only when transposed.
  constexpr bool kAKContig = !kTA, kBKContig = kTB;
  constexpr int kAStage = Tile::stage_floats(kAKContig), kBStage = Tile::stage_floats(kBKContig);
  __shared__ __align__(16) float sA[Tile::kStages][kAStage];
  __shared__ __align__(16) float sB[Tile::kStages][kBStage];

  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int g = lane >> 2, i = lane & 3;
  const int m0 = blockIdx.y * Tile::kM, n0 = blockIdx.x * Tile::kN;
  const int wm = (warp / (Tile::kN / Tile::kWarpN)) * Tile::kWarpM;
  const int wn = (warp % (Tile::kN / Tile::kWarpN)) * Tile::kWarpN;
  const int M = p.M, N = p.N, K = p.K;
  const int k_tiles = (K + Tile::kK - 1) / Tile::kK;

  for (int64_t b = blockIdx.z; b < p.mats; b += gridDim.z) {
    // Within a matrix, 32-bit offsets (NewtonSchulz checks 3 M D < 2^31).
    const float* A = p.A + b * int64_t(M) * K;
    const float* B = p.B + b * int64_t(K) * N;
    float* C = p.C + b * int64_t(M) * N;

    // Stage k tile kt of both operands into buffer s (committed by the caller).
    auto load = [&](int s, int kt) {
      const int k0 = kt * Tile::kK;
      if constexpr (kAKContig)  // A: M x K, rows m0 .., columns k0 ..
        ns_fused_load_tile<Tile::kM, Tile::kK>(sA[s], Tile::kLdK, A, K, m0, k0, M, K, t);
      else  // A^T stored K x M: rows k0 .., columns m0 ..
        ns_fused_load_tile<Tile::kK, Tile::kM>(sA[s], Tile::kLdMN, A, M, k0, m0, K, M, t);
      if constexpr (kBKContig)  // B^T stored N x K: rows n0 .., columns k0 ..
        ns_fused_load_tile<Tile::kN, Tile::kK>(sB[s], Tile::kLdK, B, K, n0, k0, N, K, t);
      else  // B: K x N, rows k0 .., columns n0 ..
        ns_fused_load_tile<Tile::kK, Tile::kN>(sB[s], Tile::kLdMN, B, N, k0, n0, K, N, t);
    };

    float acc[Tile::kMTiles][Tile::kNTiles][4];
#pragma unroll
    for (int tm = 0; tm < Tile::kMTiles; ++tm)
#pragma unroll
      for (int tn = 0; tn < Tile::kNTiles; ++tn)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[tm][tn][e] = 0.f;

    load(0, 0);
    detail::cp_async_commit();
    for (int kt = 0; kt < k_tiles; ++kt) {
      // Prefetch the next k tile into the other buffer (freed by the barrier
      // that ended the previous iteration); an empty group at the end keeps
      // the wait count uniform.
      if (kt + 1 < k_tiles) load((kt + 1) & 1, kt + 1);
      detail::cp_async_commit();
      detail::cp_async_wait<1>();
      __syncthreads();
      const float* a_s = sA[kt & 1];
      const float* b_s = sB[kt & 1];
#pragma unroll
      for (int kk = 0; kk < Tile::kK; kk += 16) {
        // K % 16 == 0: a k16 step is wholly inside K or wholly past it (zeros).
        if (kt * Tile::kK + kk >= K) break;
        uint32_t a_hi[Tile::kMTiles][4], a_lo[Tile::kMTiles][4];
        uint32_t b_hi[Tile::kNTiles][2], b_lo[Tile::kNTiles][2];
#pragma unroll
        for (int tm = 0; tm < Tile::kMTiles; ++tm) {
          const int r = wm + 16 * tm + g, k = kk + 2 * i;
          ns_fused_split(ns_fused_pair<kAKContig>(a_s, r, k), a_hi[tm][0], a_lo[tm][0]);
          ns_fused_split(ns_fused_pair<kAKContig>(a_s, r + 8, k), a_hi[tm][1], a_lo[tm][1]);
          ns_fused_split(ns_fused_pair<kAKContig>(a_s, r, k + 8), a_hi[tm][2], a_lo[tm][2]);
          ns_fused_split(ns_fused_pair<kAKContig>(a_s, r + 8, k + 8), a_hi[tm][3], a_lo[tm][3]);
        }
#pragma unroll
        for (int tn = 0; tn < Tile::kNTiles; ++tn) {
          const int c = wn + 8 * tn + g, k = kk + 2 * i;
          ns_fused_split(ns_fused_pair<kBKContig>(b_s, c, k), b_hi[tn][0], b_lo[tn][0]);
          ns_fused_split(ns_fused_pair<kBKContig>(b_s, c, k + 8), b_hi[tn][1], b_lo[tn][1]);
        }
        // Small terms first, as mma_m16n8k8_tf32x3 does; the tile loops inside
        // put 8 independent accumulators between two dependent mma steps.
#pragma unroll
        for (int term = 0; term < 3; ++term)
#pragma unroll
          for (int tm = 0; tm < Tile::kMTiles; ++tm)
#pragma unroll
            for (int tn = 0; tn < Tile::kNTiles; ++tn) {
              const uint32_t(&a)[4] = term == 0 ? a_lo[tm] : a_hi[tm];
              const uint32_t(&bb)[2] = term == 1 ? b_lo[tn] : b_hi[tn];
              detail::mma_m16n8k16<bf16>(acc[tm][tn], a, bb[0], bb[1]);
            }
      }
      __syncthreads();  // the next iteration's prefetch overwrites this buffer
    }

    // Epilogue: c[0], c[1] at (row g, columns 2i, 2i + 1), c[2], c[3] at row
    // g + 8; N is even, so a pair is wholly inside or past the edge.
#pragma unroll
    for (int tm = 0; tm < Tile::kMTiles; ++tm)
#pragma unroll
      for (int tn = 0; tn < Tile::kNTiles; ++tn)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + wm + 16 * tm + g + 8 * h, col = n0 + wn + 8 * tn + 2 * i;
          if (row >= M || col >= N) continue;
          float2* out = reinterpret_cast<float2*>(C + row * N + col);
          float2 v = make_float2(p.alpha * acc[tm][tn][2 * h], p.alpha * acc[tm][tn][2 * h + 1]);
          if (p.beta != 0.f) {
            const float2 old = *out;
            v.x += p.beta * old.x;
            v.y += p.beta * old.y;
          }
          *out = v;
        }
  }
}

// Muon's NS_s over all 3 * pairs matrices of a [pairs, 3MD] array at once,
// each Newton-Schulz product one batched GEMM in U (for U = float, unless
// STATESCAN_LACT_NS=fp32: one bf16 GEMM of two-part operands, or with
// STATESCAN_LACT_NS=fused one ns_gemm_fused_kernel launch where the shape
// allows).
template <typename U>
class NewtonSchulz {
 public:
  // `mode`: how a bf16 layer (U = float) runs the products, STATESCAN_LACT_NS
  // unless a caller (the tests, statescan-bench --lact-ns) names one.
  NewtonSchulz(const Geo& g, int steps, bool keep_iterates, cudaStream_t stream,
               NsGemms mode = ns_gemms_requested())
      : compute_(wide_compute<U>()),
        M_(g.M),
        D_(g.D),
        m_(std::min(g.M, g.D)),
        n_(std::max(g.M, g.D)),
        mats_(3 * g.pairs),
        steps_(steps),
        stream_(stream),
        X_(mats_ * m_ * n_, stream),
        Y_(mats_ * m_ * n_, stream),
        A_(mats_ * m_ * m_, stream),
        Bm_(mats_ * m_ * m_, stream),
        scale_(mats_, stream),
        sums_(mats_ * kNsSlices * 2, stream),
        mode_(mode) {
    // The kernels index within one matrix (and its three bf16 parts) in 32 bits.
    SS_CHECK_ARG(3 * g.M * g.D < (int64_t(1) << 31), "w0", "Muon needs 3 M D < 2^31, got M = ", g.M,
                 ", D = ", g.D);
    if (split_) {
      // The largest operand is m x n (m <= n).
      split_a_ = PoolArray<bf16>(3 * mats_ * m_ * n_, stream);
      split_b_ = PoolArray<bf16>(3 * mats_ * m_ * n_, stream);
    }
    if (cluster_) {
      const int m = static_cast<int>(m_), n = static_cast<int>(n_);
      cluster_gx_ = PoolArray<bf16>(NsClusterTile::gram_images(mats_, m, n), stream);
      cluster_ax_ = PoolArray<bf16>(NsClusterTile::apply_images(mats_, m, n), stream);
      cluster_ag_ = PoolArray<bf16>(NsClusterTile::poly_images(mats_, m), stream);
    }
    if (keep_iterates) {
      iterates_ = PoolArray<U>(steps_ * mats_ * m_ * n_, stream);
      dA_ = PoolArray<U>(mats_ * m_ * m_, stream);
      dB_ = PoolArray<U>(mats_ * m_ * m_, stream);
    }
  }
  ~NewtonSchulz() {
    if (fwd_.exec != nullptr || bwd_.exec != nullptr) (void)cudaStreamSynchronize(stream_);
    if (fwd_.exec != nullptr) (void)cudaGraphExecDestroy(fwd_.exec);
    if (bwd_.exec != nullptr) (void)cudaGraphExecDestroy(bwd_.exec);
  }
  NewtonSchulz(const NewtonSchulz&) = delete;
  NewtonSchulz& operator=(const NewtonSchulz&) = delete;

  // out = NS(P) (fp32 [pairs, 3MD]); keeps the iterates when constructed so.
  // Replayed as a CUDA graph when P and out repeat (see replay()).
  void forward(const float* P, float* out) {
    replay(fwd_, P, out, nullptr, [&] { forward_eager(P, out); });
  }

  // dP = (dNS/dP)^T d_out, after forward(P, ...) on this object with iterates.
  void backward(const float* P, const float* d_out, float* dP) {
    replay(bwd_, P, d_out, dP, [&] { backward_eager(P, d_out, dP); });
  }

 private:
  // One captured sequence: its executable graph and the pointers it baked in.
  struct Replay {
    cudaGraphExec_t exec = nullptr;
    const void* key[3] = {nullptr, nullptr, nullptr};
    int calls = 0;
    bool failed = false;
  };

  // Runs `enqueue` eagerly the first time (that also sets up cuBLAS for the
  // stream), captures it as a CUDA graph the second time and replays the graph
  // while the pointers stay the same: one launch per chunk instead of ~30 small
  // cuBLAS calls and kernels. (At the 1M-token benchmark shape Newton-Schulz is
  // GPU-bound and the replay changed little, 221 -> 215 ms forward; it helps
  // where chunks are small.) Any capture failure, and the legacy default
  // stream (not capturable), fall back to eager launches.
  template <typename F>
  void replay(Replay& r, const void* a, const void* b, const void* c, F&& enqueue) {
    const bool same = r.key[0] == a && r.key[1] == b && r.key[2] == c;
    if (r.exec != nullptr && same) {
      SS_CUDA_CHECK(cudaGraphLaunch(r.exec, stream_));
      return;
    }
    if (r.exec != nullptr) {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaGraphExecDestroy(r.exec);
      r.exec = nullptr;
    }
    const bool capturable =
        stream_ != nullptr && stream_ != cudaStreamLegacy && stream_ != cudaStreamPerThread;
    const bool first = !same || r.calls == 0;
    r.key[0] = a, r.key[1] = b, r.key[2] = c;
    ++r.calls;
    if (!capturable || r.failed || first) {
      enqueue();
      return;
    }
    cudaGraph_t graph = nullptr;
    if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      (void)cudaGetLastError();
      r.failed = true;
      enqueue();
      return;
    }
    bool captured = true;
    try {
      enqueue();
    } catch (...) {  // the capture must end whatever happened; eager below
      captured = false;
    }
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    if (captured && end == cudaSuccess && graph != nullptr &&
        cudaGraphInstantiate(&r.exec, graph, 0) == cudaSuccess) {
      (void)cudaGraphDestroy(graph);
      SS_CUDA_CHECK(cudaGraphLaunch(r.exec, stream_));
      return;
    }
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    r.exec = nullptr;
    r.failed = true;
    enqueue();  // nothing of the failed capture ran
  }

  void forward_eager(const float* P, float* out) {
    const int64_t mn = m_ * n_;
    forget_splits();
    ns_slice_sums_kernel<1><<<slice_grid(), kThreads, 0, stream_>>>(
        P, static_cast<const float*>(nullptr), mats_, static_cast<int>(mn), sums_.get());
    SS_LAUNCH_CHECK("ns_slice_sums_kernel");
    ns_scale_kernel<U><<<grid_for(mats_ * 32, kThreads), kThreads, 0, stream_>>>(sums_.get(), mats_,
                                                                                 scale_.get());
    SS_LAUNCH_CHECK("ns_scale_kernel");
    ns_load_kernel<U><<<tile_grid(m_, n_), tile_block(), 0, stream_>>>(
        P, scale_.get(), mats_, static_cast<int>(M_), static_cast<int>(D_), X_.get());
    SS_LAUNCH_CHECK("ns_load_kernel");
    if constexpr (std::is_same<U, float>::value) {
      if (cluster_) {
        // Every step in one launch (lact_ns_cluster.cuh); X_ in place.
        NsClusterParams c;
        c.X = X_.get(), c.iterates = iterates_.get();
        c.gx = cluster_gx_.get(), c.ax = cluster_ax_.get(), c.ag = cluster_ag_.get();
        c.mats = mats_, c.m = static_cast<int>(m_), c.n = static_cast<int>(n_), c.steps = steps_;
        c.a = static_cast<float>(kMuonA), c.b = static_cast<float>(kMuonB);
        c.c = static_cast<float>(kMuonC);
        ns_cluster_launch(c, stream_);
      }
    }
    cublasHandle_t h = blas_handle(stream_);
    const int split_steps = cluster_ ? 0 : steps_;  // the cluster kernel ran them all
    for (int s = 0; s < split_steps; ++s) {
      if (iterates_.get())
        SS_CUDA_CHECK(cudaMemcpyAsync(iterates_.get() + s * mats_ * mn, X_.get(),
                                      mats_ * mn * sizeof(U), cudaMemcpyDeviceToDevice, stream_));
      gram(h, X_.get());
      poly(h);
      // Y = a X + B X.
      SS_CUDA_CHECK(cudaMemcpyAsync(Y_.get(), X_.get(), mats_ * mn * sizeof(U),
                                    cudaMemcpyDeviceToDevice, stream_));
      ns_gemm(h, false, false, m_, n_, m_, 1.0, Bm_.get(), X_.get(), kMuonA, Y_.get());
      std::swap(X_, Y_);
    }
    ns_store_kernel<U><<<tile_grid(m_, n_), tile_block(), 0, stream_>>>(
        X_.get(), mats_, static_cast<int>(M_), static_cast<int>(D_), out);
    SS_LAUNCH_CHECK("ns_store_kernel");
  }

  void backward_eager(const float* P, const float* d_out, float* dP) {
    const int64_t mn = m_ * n_, mm = m_ * m_;
    forget_splits();
    cublasHandle_t h = blas_handle(stream_);
    // dX in X_, the next adjoint in Y_.
    ns_load_kernel<U><<<tile_grid(m_, n_), tile_block(), 0, stream_>>>(
        d_out, static_cast<const U*>(nullptr), mats_, static_cast<int>(M_), static_cast<int>(D_),
        X_.get());
    SS_LAUNCH_CHECK("ns_load_kernel");
    // Independent products are ordered so that, in split mode, an operand
    // split by one GEMM is split the same way by the next one (see ns_gemm):
    // dB right after A (both take X^T), dA's dB A right after B (both take A
    // as the right operand). Every product still sees the same inputs.
    for (int s = steps_ - 1; s >= 0; --s) {
      const U* X = iterates_.get() + s * mats_ * mn;
      gram(h, X);
      // Y = a X + B X:  dB = dY X^T; X^T is the right operand of A = X X^T too.
      ns_gemm(h, false, true, m_, m_, n_, 1.0, X_.get(), X, 0.0, dB_.get(), true);
      poly(h);
      // B = b A + c A A:  dA = b dB + c (dB A + A dB); dB A takes A as its right
      // operand as A A just did (A untouched in between).
      SS_CUDA_CHECK(cudaMemcpyAsync(dA_.get(), dB_.get(), mats_ * mm * sizeof(U),
                                    cudaMemcpyDeviceToDevice, stream_));
      ns_gemm(h, false, false, m_, m_, m_, kMuonC, dB_.get(), A_.get(), kMuonB, dA_.get(), true);
      ns_gemm(h, false, false, m_, m_, m_, kMuonC, A_.get(), dB_.get(), 1.0, dA_.get());
      // Y = a X + B X:  dXn = a dY + B dY.
      SS_CUDA_CHECK(cudaMemcpyAsync(Y_.get(), X_.get(), mats_ * mn * sizeof(U),
                                    cudaMemcpyDeviceToDevice, stream_));
      ns_gemm(h, false, false, m_, n_, m_, 1.0, Bm_.get(), X_.get(), kMuonA, Y_.get());
      // A = X X^T:  dXn += (dA + dA^T) X  (Bm_ is free now: it holds S).
      symmetrise_kernel<U><<<tile_grid(m_, m_), tile_block(), 0, stream_>>>(
          dA_.get(), mats_, static_cast<int>(m_), Bm_.get());
      SS_LAUNCH_CHECK("symmetrise_kernel");
      ns_gemm(h, false, false, m_, n_, m_, 1.0, Bm_.get(), X, 1.0, Y_.get());
      std::swap(X_, Y_);
    }
    // X_0 = Xp / (||Xp|| + eps): Xp (unscaled, oriented) into Y_.
    ns_load_kernel<U><<<tile_grid(m_, n_), tile_block(), 0, stream_>>>(
        P, static_cast<const U*>(nullptr), mats_, static_cast<int>(M_), static_cast<int>(D_),
        Y_.get());
    SS_LAUNCH_CHECK("ns_load_kernel");
    ns_slice_sums_kernel<2><<<slice_grid(), kThreads, 0, stream_>>>(
        static_cast<const U*>(Y_.get()), static_cast<const U*>(X_.get()), mats_,
        static_cast<int>(mn), sums_.get());
    SS_LAUNCH_CHECK("ns_slice_sums_kernel");
    ns_normalise_backward_kernel<U><<<slice_grid(), kThreads, 0, stream_>>>(
        Y_.get(), sums_.get(), mats_, static_cast<int>(mn), X_.get());
    SS_LAUNCH_CHECK("ns_normalise_backward_kernel");
    ns_store_kernel<U><<<tile_grid(m_, n_), tile_block(), 0, stream_>>>(
        X_.get(), mats_, static_cast<int>(M_), static_cast<int>(D_), dP);
    SS_LAUNCH_CHECK("ns_store_kernel");
  }

  // Launch shapes: the matrices on y (slices) or z (tiles, split3), grid-
  // strided past CUDA's 65535.
  unsigned mat_grid() const { return static_cast<unsigned>(std::min<int64_t>(mats_, 65535)); }
  dim3 slice_grid() const { return dim3(kNsSlices, mat_grid()); }
  static dim3 tile_block() { return dim3(NsTile::kDim, NsTile::kRows); }
  dim3 tile_grid(int64_t rows, int64_t cols) const {
    return dim3(static_cast<unsigned>((cols + NsTile::kDim - 1) / NsTile::kDim),
                static_cast<unsigned>((rows + NsTile::kDim - 1) / NsTile::kDim), mat_grid());
  }

  static Operand op(const U* p, int64_t ld, int64_t stride) {
    return {p, data_type<U>(), ld, stride};
  }
  static Output out_(U* p, int64_t ld, int64_t stride) { return {p, data_type<U>(), ld, stride}; }

  // A = X X^T for every matrix.
  void gram(cublasHandle_t h, const U* X) {
    ns_gemm(h, false, true, m_, m_, n_, 1.0, X, X, 0.0, A_.get());
  }
  // Bm = b A + c A A for every matrix.
  void poly(cublasHandle_t h) {
    SS_CUDA_CHECK(cudaMemcpyAsync(Bm_.get(), A_.get(), mats_ * m_ * m_ * sizeof(U),
                                  cudaMemcpyDeviceToDevice, stream_));
    ns_gemm(h, false, false, m_, m_, m_, kMuonC, A_.get(), A_.get(), kMuonB, Bm_.get());
  }

  // C = alpha op(A) op(B) + beta C over the mats_ matrices (packed operands),
  // in U, or in split mode as one bf16 GEMM of two-part operands. In split
  // mode `b_unchanged` says that B has not been written since the previous
  // split of a B operand: if that split was of the same matrix in the same
  // stacking, split_b_ still holds it and is used as it is.
  void ns_gemm(cublasHandle_t h, bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
               const U* A, const U* B, double beta, U* C, bool b_unchanged = false) {
    if (!split_) {
      gemm_sliced(h, stream_, ta, tb, M, N, K, alpha, op(A, ta ? M : K, M * K),
                  op(B, tb ? K : N, K * N), beta, out_(C, N, M * N), mats_, compute_, split_k_);
      return;
    }
    if constexpr (std::is_same<U, float>::value) {
      if (fused_ && fused_fits(M, N, K, A, B, C)) {
        ns_gemm_fused(ta, tb, M, N, K, alpha, A, B, beta, C);
        // The fused kernel leaves split_a_ / split_b_ untouched, so their keys
        // still name what they hold, except where the source was C: forget
        // those, as the split path below does, so that a later fallback call
        // (a shape the fused kernel does not take) never reuses a stale split.
        forget_splits_of(C);
        return;
      }
      // A: [hi | hi | lo] along K; B: [hi ; lo ; hi] along K.
      const SplitKey ka{A, ta ? K : M, ta ? M : K, !ta}, kb{B, tb ? N : K, tb ? K : N, tb};
      const bool need_b = !(b_unchanged && kb == split_b_key_);
      Split3Targets targets{};
      targets.t[0] = {split_a_.get(), ka.k_is_cols, 0b100};
      targets.count = 1;
      // X X^T and A A: one read of the matrix writes both stackings.
      const bool both = need_b && A == B && ka.rows == kb.rows && ka.cols == kb.cols;
      if (both) targets.t[targets.count++] = {split_b_.get(), kb.k_is_cols, 0b010};
      split3(A, ka.rows, ka.cols, targets);
      if (need_b && !both) {
        Split3Targets tb_only{};
        tb_only.t[0] = {split_b_.get(), kb.k_is_cols, 0b010};
        tb_only.count = 1;
        split3(B, kb.rows, kb.cols, tb_only);
      }
      split_a_key_ = ka;
      split_b_key_ = kb;
      const Operand a{split_a_.get(), CUDA_R_16BF, ta ? M : 3 * K, 3 * M * K};
      const Operand b{split_b_.get(), CUDA_R_16BF, tb ? 3 * K : N, 3 * K * N};
      gemm_sliced(h, stream_, ta, tb, M, N, 3 * K, alpha, a, b, beta, out_(C, N, M * N), mats_,
                  CUBLAS_COMPUTE_32F, split_k_);
      forget_splits_of(C);
    }
  }

  // C is written now: a split of it is stale.
  void forget_splits_of(const U* C) {
    if (C == split_a_key_.src) split_a_key_ = SplitKey{};
    if (C == split_b_key_.src) split_b_key_ = SplitKey{};
  }

  // Whether ns_gemm_fused_kernel takes this call. Decided per call on the host
  // (the same answer in the eager run and the captured graph): M, N, K
  // multiples of 16 (the kernel's whole-chunk edge handling), 16-byte aligned
  // operands (cp.async; NewtonSchulz's buffers and their per-matrix offsets
  // always are), the row tiles within grid y, and C apart from A and B (the
  // kernel reads A and B tiles while other CTAs write C). Anything else, e.g.
  // a head dim D = 24, goes through split3 + cuBLAS as without the knob.
  bool fused_fits(int64_t M, int64_t N, int64_t K, const U* A, const U* B, const U* C) const {
    constexpr int64_t kMul = NsFusedTile::kDimMultiple;
    const auto aligned = [](const void* p) {
      return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
    };
    const auto apart = [&](const U* x, int64_t count) {
      const auto c = reinterpret_cast<std::uintptr_t>(C), o = reinterpret_cast<std::uintptr_t>(x);
      return c + mats_ * M * N * sizeof(U) <= o || o + mats_ * count * sizeof(U) <= c;
    };
    return M > 0 && N > 0 && K > 0 && M % kMul == 0 && N % kMul == 0 && K % kMul == 0 &&
           (M + NsFusedTile::kM - 1) / NsFusedTile::kM <= 65535 && aligned(A) && aligned(B) &&
           aligned(C) && apart(A, M * K) && apart(B, K * N);
  }

  // One ns_gemm_fused_kernel launch over the mats_ matrices (fused_fits holds).
  void ns_gemm_fused(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const U* A,
                     const U* B, double beta, U* C) {
    NsGemmParams prm;
    prm.A = A, prm.B = B, prm.C = C, prm.mats = mats_;
    prm.M = static_cast<int>(M), prm.N = static_cast<int>(N), prm.K = static_cast<int>(K);
    prm.alpha = static_cast<float>(alpha), prm.beta = static_cast<float>(beta);
    const dim3 grid(static_cast<unsigned>((N + NsFusedTile::kN - 1) / NsFusedTile::kN),
                    static_cast<unsigned>((M + NsFusedTile::kM - 1) / NsFusedTile::kM), mat_grid());
    const dim3 block(NsFusedTile::kThreads);
    if (!ta && !tb)
      ns_gemm_fused_kernel<false, false><<<grid, block, 0, stream_>>>(prm);
    else if (!ta && tb)
      ns_gemm_fused_kernel<false, true><<<grid, block, 0, stream_>>>(prm);
    else if (ta && !tb)
      ns_gemm_fused_kernel<true, false><<<grid, block, 0, stream_>>>(prm);
    else
      ns_gemm_fused_kernel<true, true><<<grid, block, 0, stream_>>>(prm);
    SS_LAUNCH_CHECK("ns_gemm_fused_kernel");
  }

  // The matrix a split buffer holds: source, its rows x cols and stacking.
  struct SplitKey {
    const U* src = nullptr;
    int64_t rows = 0, cols = 0;
    bool k_is_cols = false;
    bool operator==(const SplitKey& o) const {
      return src == o.src && rows == o.rows && cols == o.cols && k_is_cols == o.k_is_cols;
    }
  };
  // Every forward_eager / backward_eager starts with no split reused: the
  // sources change between calls, and a captured graph must make the same
  // choices as the eager run before it.
  void forget_splits() { split_a_key_ = split_b_key_ = SplitKey{}; }

  // The split3_kernel launch for `mats_` rows x cols matrices at src.
  void split3(const float* src, int64_t rows, int64_t cols, const Split3Targets& targets) {
    const auto aligned = [](const void* p, std::size_t bytes) {
      return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
    };
    bool vec = cols % 4 == 0 && aligned(src, 16);
    for (int t = 0; t < targets.count; ++t) vec = vec && aligned(targets.t[t].dst, 8);
    const int per_thread = vec ? 4 : 1;
    const dim3 block(32, 8);
    const int64_t groups = (cols + per_thread - 1) / per_thread;
    const dim3 grid(static_cast<unsigned>((groups + block.x - 1) / block.x),
                    static_cast<unsigned>(std::min<int64_t>((rows + block.y - 1) / block.y, 65535)),
                    mat_grid());
    if (vec) {
      split3_kernel<4><<<grid, block, 0, stream_>>>(src, mats_, static_cast<int>(rows),
                                                    static_cast<int>(cols), targets);
    } else {
      split3_kernel<1><<<grid, block, 0, stream_>>>(src, mats_, static_cast<int>(rows),
                                                    static_cast<int>(cols), targets);
    }
    SS_LAUNCH_CHECK("split3_kernel");
  }

  Replay fwd_, bwd_;
  cublasComputeType_t compute_;
  int64_t M_, D_, m_, n_, mats_;
  int steps_;
  cudaStream_t stream_;
  PoolArray<U> X_, Y_, A_, Bm_, scale_, iterates_, dA_, dB_;
  // Per-slice partial sums of the Frobenius norms: [mats, kNsSlices, 2].
  PoolArray<double> sums_;
  NsGemms mode_;
  bool split_ = std::is_same<U, float>::value && mode_ != NsGemms::fp32;
  // STATESCAN_LACT_NS=fused: split-mode products through ns_gemm_fused_kernel
  // where fused_fits (opt-in: passes the GPU suite, slower on an H200; README).
  bool fused_ = split_ && mode_ == NsGemms::fused;
  // STATESCAN_LACT_NS=cluster: the forward's steps in ns_cluster_kernel where
  // the shape and device allow (opt-in; the backward's steps stay on the
  // split path).
  bool cluster_ = split_ && mode_ == NsGemms::cluster && ns_cluster_supported(m_, n_);
  PoolArray<bf16> cluster_gx_, cluster_ax_, cluster_ag_;  // its stage images (NsClusterParams)
  PoolArray<bf16> split_a_, split_b_;
  SplitKey split_a_key_, split_b_key_;
  SplitKScratch split_k_;  // the split-mode GEMMs' split-K partials and pointers
};

// ---- the layer ------------------------------------------------------------------

template <typename T, typename U>
class LactGpu {
 public:
  LactGpu(const LactCudaParams& p, cudaStream_t stream)
      : p_(p),
        g_(make_geo(p)),
        stream_(stream),
        blas_(blas_handle(stream)),
        causal_(p.config.schedule == LactSchedule::apply_then_update),
        momentum_(p.config.momentum > 0),
        split_update_(!std::is_same<T, float>::value && p.config.muon_steps > 0),
        fused_hidden_(std::is_same<T, bf16>::value && hidden_fused_requested() &&
                      lact_hidden_supported(g_.D, g_.M) && lact_hidden_aligned(p.q, p.k, p.v) &&
                      lact_hidden_addressable(g_.pairs, g_.B * g_.local_len, g_.D, g_.M)),
        w_init_(g_.H * g_.block(), stream),
        norm0_(g_.H * g_.norms(), stream) {
    load_weights_kernel<T><<<grid_for(w_init_.size(), kThreads), kThreads, 0, stream_>>>(
        tok(p.w0), tok(p.w1), tok(p.w2), g_.H, g_.H, g_.md(), w_init_.get());
    SS_LAUNCH_CHECK("load_weights_kernel");
    row_norms_kernel<<<grid_for(g_.H * g_.norms() * 32, kThreads), kThreads, 0, stream_>>>(
        w_init_.get(), g_.H, g_.M, g_.D, norm0_.get());
    SS_LAUNCH_CHECK("row_norms_kernel");
    const std::size_t nm = rows_alloc();
    z_ = PoolArray<T>(2 * nm, stream);
    gate_ = PoolArray<T>(nm, stream);
    if (split_update_) {
      z_lo_ = PoolArray<T>(2 * nm, stream);
      gate_lo_ = PoolArray<T>(nm, stream);
    }
    if (!std::is_same<T, float>::value) w_op_ = PoolArray<T>(g_.state(), stream);
    if (fused_hidden_ && side_stream_requested()) {
      side_ = side_stream();
      side_blas_ = blas_handle(side_, 1);
      SS_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
      SS_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
    }
  }
  LactGpu(const LactGpu&) = delete;
  LactGpu& operator=(const LactGpu&) = delete;
  ~LactGpu() {
    // Side work still queued (an exception left a loop between on_side and
    // join_side) reads arrays that stream_ frees in its order.
    if (side_pending_) cudaStreamWaitEvent(stream_, join_, 0);
    if (fork_ != nullptr) cudaEventDestroy(fork_);
    if (join_ != nullptr) cudaEventDestroy(join_);
  }

  void forward(const LactDeviceAllReduce& all_reduce, LactCudaSaved* saved) {
    const std::size_t state = static_cast<std::size_t>(g_.state());
    PoolArray<float> W(state, stream_), grads, vel, step;
    if (momentum_) {
      vel = PoolArray<float>(state, stream_);
      vel.zero();
    }
    const bool muon = p_.config.muon_steps > 0;
    std::unique_ptr<NewtonSchulz<U>> ns;
    if (muon) {
      step = PoolArray<float>(state, stream_);
      ns = std::make_unique<NewtonSchulz<U>>(g_, p_.config.muon_steps, false, stream_);
    }
    // Checkpoints: reused when a previous forward of the same size left them
    // (repeated steps then allocate nothing; cudaMalloc would sync the device).
    const std::size_t saved_count = static_cast<std::size_t>(g_.chunks) * state;
    if (saved && saved->weights.size() != saved_count) {
      saved->weights = DeviceBuffer<float>();
      saved->updates = DeviceBuffer<float>();
      saved->weights = DeviceBuffer<float>(saved_count);
      saved->updates = DeviceBuffer<float>(saved_count);
    }
    // With checkpoints, chunk c's weights live in their slot (step_renorm
    // writes the next chunk's there, the last chunk's into W) and, without
    // momentum or Muon, its update is formed in its slot: no copies. (Muon's
    // Newton-Schulz replays a graph while its input pointer repeats.)
    auto weights_of = [&](int64_t c) {
      return saved && c < g_.chunks ? saved->weights.data() + c * state : W.get();
    };
    const bool update_in_slot = saved && !momentum_ && !muon;
    if (!update_in_slot) grads = PoolArray<float>(state, stream_);
    load_weights_kernel<T><<<grid_for(state, kThreads), kThreads, 0, stream_>>>(
        tok(p_.w0), tok(p_.w1), tok(p_.w2), g_.pairs, g_.H, g_.md(), weights_of(0));
    SS_LAUNCH_CHECK("load_weights_kernel");
    const T* w_op = nullptr;
    // The fused apply writes only o and reads the chunk's weight copy: it
    // runs on the side stream beside the update (key side, G, Newton-Schulz),
    // joined before step_renorm overwrites that copy.
    const bool side = side_ != nullptr && fused_apply();
    auto apply = [&](const T* w, int64_t n, int64_t t0) {
      if (side)
        on_side([&] { apply_forward(w, n, t0); });
      else
        apply_forward(w, n, t0);
    };
    for (int64_t c = 0; c < g_.chunks; ++c) {
      const int64_t n = g_.slice_len(p_.seq_len, c), t0 = g_.slice_start(c);
      // The operand copy of W: made here for the first chunk, after that by
      // the previous chunk's step_renorm.
      if (c == 0) w_op = operand_weights(weights_of(0));
      if (causal_) apply(w_op, n, t0);
      float* G = update_in_slot ? saved->updates.data() + c * state : grads.get();
      partial_gradients(w_op, n, t0, G);
      if (all_reduce) all_reduce(G, state, stream_);
      float* update = G;
      if (momentum_) {
        momentum_kernel<<<grid_for(state, kThreads), kThreads, 0, stream_>>>(
            G, state, static_cast<float>(p_.config.momentum), vel.get());
        SS_LAUNCH_CHECK("momentum_kernel");
        update = vel.get();
      }
      if (saved && !update_in_slot)
        SS_CUDA_CHECK(cudaMemcpyAsync(saved->updates.data() + c * state, update,
                                      state * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
      const float* d = update;
      if (muon) {
        ns->forward(update, step.get());
        d = step.get();
      }
      join_side();
      w_op = step_renorm(weights_of(c), weights_of(c + 1), d);
      if (!causal_) apply(w_op, n, t0);
    }
    join_side();
  }

  void backward(const LactCudaGrads& gr, const LactCudaSaved& saved,
                const LactDeviceAllReduce& all_reduce) {
    const std::size_t state = static_cast<std::size_t>(g_.state());
    SS_CHECK_ARG(saved.weights.size() == static_cast<std::size_t>(g_.chunks) * state &&
                     saved.updates.size() == saved.weights.size(),
                 "saved", "checkpoints do not match this problem (run lact_cuda_forward first)");
    PoolArray<float> dW(state, stream_), dG(state, stream_), d_step, dvel, step, w_next;
    PoolArray<float> d_norm0(g_.pairs * g_.norms(), stream_);
    dW.zero();
    d_norm0.zero();
    if (momentum_) {
      dvel = PoolArray<float>(state, stream_);
      dvel.zero();
    }
    const bool muon = p_.config.muon_steps > 0;
    std::unique_ptr<NewtonSchulz<U>> ns;
    PoolArray<float> p_stage;
    if (muon) {
      step = PoolArray<float>(state, stream_);
      d_step = PoolArray<float>(state, stream_);
      p_stage = PoolArray<float>(state, stream_);
      ns = std::make_unique<NewtonSchulz<U>>(g_, p_.config.muon_steps, true, stream_);
    }
    if (!causal_) w_next = PoolArray<float>(state, stream_);
    dh_ = PoolArray<T>(2 * rows_alloc(), stream_);
    // The causal schedule's apply backward on the side stream: fused, its
    // outputs gate_ and dh_ are not the buffers of the update's gradient rows
    // (zdh_, gde_: fused too wherever side_ exists).
    const bool side = causal_ && side_ != nullptr && fused_apply_backward(gr);

    for (int64_t c = g_.chunks - 1; c >= 0; --c) {
      const int64_t n = g_.slice_len(p_.seq_len, c), t0 = g_.slice_start(c);
      const float* Wc = saved.weights.data() + c * state;
      const float* Pc = saved.updates.data() + c * state;
      const float* d = Pc;
      if (muon) {
        // Through a fixed buffer, so that Newton-Schulz replays one graph.
        SS_CUDA_CHECK(cudaMemcpyAsync(p_stage.get(), Pc, state * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream_));
        Pc = p_stage.get();
        ns->forward(Pc, step.get());  // keeps the iterates for ns->backward
        d = step.get();
      }
      if (!causal_) apply_backward(gr, step_renorm(Wc, w_next.get(), d), n, t0, dW.get());
      // Without Muon the step's adjoint is dG itself. For bf16 the kernel
      // also writes Wc's operand copy (into w_op_, whose copy of the next
      // weights apply_backward has consumed by now, in stream order).
      T* w_copy = nullptr;
      if constexpr (!std::is_same<T, float>::value) w_copy = w_op_.get();
      step_renorm_backward_kernel<T>
          <<<grid_for(g_.pairs * g_.norms() * 32, kThreads), kThreads, 0, stream_>>>(
              Wc, d, norm0_.get(), g_.pairs, g_.H, g_.M, g_.D, p_.config.renorm, dW.get(),
              muon ? d_step.get() : dG.get(), d_norm0.get(), w_copy);
      SS_LAUNCH_CHECK("step_renorm_backward_kernel");
      const T* w_op = std::is_same<T, float>::value ? reinterpret_cast<const T*>(Wc) : w_copy;
      // The apply's token side (gate, dh, dq) reads only Wc's copy and d_o:
      // on the side stream beside the update's backward, joined before its
      // dW products (added after the update's, the order of the sums as
      // without the side stream) and before the next chunk's
      // step_renorm_backward overwrites the copy.
      if (side) on_side([&] { apply_backward_tokens(gr, w_op, n, t0); });
      if (muon) ns->backward(Pc, d_step.get(), dG.get());
      if (momentum_) {
        momentum_backward_kernel<<<grid_for(state, kThreads), kThreads, 0, stream_>>>(
            dG.get(), state, static_cast<float>(p_.config.momentum), dvel.get());
        SS_LAUNCH_CHECK("momentum_backward_kernel");
      }
      if (all_reduce) all_reduce(dG.get(), state, stream_);
      gradients_backward(gr, w_op, dG.get(), n, t0, dW.get());
      if (side) {
        join_side();
        apply_backward_weights(gr, n, t0, dW.get());
      } else if (causal_) {
        apply_backward(gr, w_op, n, t0, dW.get());
      }
    }

    PoolArray<float> d_init(g_.H * g_.block(), stream_);
    initial_grad_kernel<<<grid_for(d_init.size(), kThreads), kThreads, 0, stream_>>>(
        dW.get(), d_norm0.get(), w_init_.get(), norm0_.get(), g_.B, g_.H, g_.M, g_.D,
        p_.config.renorm, d_init.get());
    SS_LAUNCH_CHECK("initial_grad_kernel");
    if (all_reduce) all_reduce(d_init.get(), d_init.size(), stream_);
    store_weight_grads_kernel<T><<<grid_for(d_init.size(), kThreads), kThreads, 0, stream_>>>(
        d_init.get(), g_.H, g_.md(), static_cast<T*>(gr.dw0), static_cast<T*>(gr.dw1),
        static_cast<T*>(gr.dw2));
    SS_LAUNCH_CHECK("store_weight_grads_kernel");
  }

 private:
  static const T* tok(const void* p) { return static_cast<const T*>(p); }
  static constexpr cudaDataType_t kT = data_type<T>();

  // Views of one batch row b for a GEMM batched over its H heads.
  Operand tokens(const void* base, int64_t b, int64_t t0) const {
    const int64_t hd = g_.H * g_.D;
    return {tok(base) + (b * g_.local_len + t0) * hd, kT, hd, g_.D};
  }
  // Slot 0 of a block as [W0; W2] (2M x D, or W0 alone with M rows), slot 2
  // as W1 (D x M).
  Operand weights(const T* w, int64_t b, int slot) const {
    const int64_t ld = slot == 2 ? g_.M : g_.D;
    return {w + b * g_.H * g_.block() + slot * g_.md(), kT, ld, g_.block()};
  }
  Output weight_grad(float* dW, int64_t b, int slot) const {
    const int64_t ld = slot == 2 ? g_.M : g_.D;
    return {dW + b * g_.H * g_.block() + slot * g_.md(), CUDA_R_32F, ld, g_.block()};
  }
  // Per-pair intermediates of n rows of `width` (M or 2M), pair-major.
  template <typename X>
  Operand rows_in(const X* buf, int64_t b, int64_t n, int64_t width) const {
    return {buf + b * g_.H * n * width, data_type<X>(), width, n * width};
  }
  template <typename X>
  Output rows_out(X* buf, int64_t b, int64_t n, int64_t width) const {
    return {buf + b * g_.H * n * width, data_type<X>(), width, n * width};
  }
  // fp32 token accumulators [B, n, H D].
  Output acc_out(float* buf, int64_t b, int64_t n) const {
    const int64_t hd = g_.H * g_.D;
    return {buf + b * n * hd, CUDA_R_32F, hd, g_.D};
  }
  // A token gradient of batch row b from local row t0, written by a GEMM in
  // the storage type (one rounding of its fp32 sum, as store_tokens).
  Output tokens_out(void* base, int64_t b, int64_t t0) const {
    const int64_t hd = g_.H * g_.D;
    return {static_cast<T*>(base) + (b * g_.local_len + t0) * hd, kT, hd, g_.D};
  }

  // Token-contracted products (A^T B over the slice's tokens into fp32) of
  // bf16 layers go to lact_token_gemm where it fits (lact_token_gemm.cuh).
  void gemm_t(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const Operand& A,
              const Operand& B, double beta, const Output& C) {
    if constexpr (std::is_same<T, bf16>::value) {
      if (token_gemm_ && ta && !tb && C.type == CUDA_R_32F) {
        LactTokenGemmParams t;
        t.a = {static_cast<const T*>(A.data), A.ld, A.stride};
        t.b = {static_cast<const T*>(B.data), B.ld, B.stride};
        t.c = static_cast<float*>(C.data), t.ldc = C.ld, t.c_stride = C.stride;
        t.pairs = g_.H, t.m = m, t.n = n, t.k = k;
        t.alpha = static_cast<float>(alpha), t.beta = static_cast<float>(beta);
        if (lact_token_gemm_fits(t)) {
          lact_token_gemm(t, stream_);
          return;
        }
      }
    }
    gemm_sliced(blas_, stream_, ta, tb, m, n, k, alpha, A, B, beta, C, g_.H, token_compute<T>(),
                split_k_);
  }

  // The cuBLAS path's fp32 h = [h0 | h2] (rows of 2M) and e (rows of M),
  // allocated on first use: a forward through lact_hidden_kernel never needs
  // them (100 MB at the benchmark's shape).
  float* h_buf() { return lazy(h_, 2 * rows_alloc(), stream_); }
  float* e_buf() { return lazy(e_, rows_alloc(), stream_); }
  // Elements of a per-pair array of rows of M over the longest slice.
  std::size_t rows_alloc() const { return static_cast<std::size_t>(g_.pairs * g_.max_n * g_.M); }
  // `a`, allocated with `size` elements on first use.
  template <typename X>
  static X* lazy(PoolArray<X>& a, std::size_t size, cudaStream_t stream) {
    if (a.get() == nullptr) a = PoolArray<X>(size, stream);
    return a.get();
  }
  // The same for the backward's cuBLAS path: u = [u0 | u2], u1 (fp32), de;
  // and the token gradients' fp32 sums of its GEMM pairs.
  float* u_buf() { return lazy(u_, 2 * rows_alloc(), stream_); }
  float* u1_buf() { return lazy(u1_, rows_alloc(), stream_); }
  T* de_buf() { return lazy(de_, rows_alloc(), stream_); }
  float* token_acc(PoolArray<float>& a) {
    return lazy(a, static_cast<std::size_t>(g_.B * g_.max_n * g_.H * g_.D), stream_);
  }

  // The GEMM operand copy of fp32 weights (or of a gradient of them, per
  // pair a block): themselves for f32, bf16 in `copy` (allocated on first
  // use) else.
  const T* operand_copy(const float* W, PoolArray<T>& copy) {
    if constexpr (std::is_same<T, float>::value) {
      (void)copy;
      return W;
    } else {
      T* out = lazy(copy, static_cast<std::size_t>(g_.state()), stream_);
      convert_kernel<T>
          <<<grid_for(g_.state(), kThreads), kThreads, 0, stream_>>>(W, g_.state(), out);
      SS_LAUNCH_CHECK("convert_kernel");
      return out;
    }
  }
  const T* operand_weights(const float* W) { return operand_copy(W, w_op_); }

  // W_out <- renorm(W_in - step) (W_out may be W_in); returns the GEMM
  // operand copy of the new W (written by the same kernel for bf16:
  // operand_weights without its pass).
  const T* step_renorm(const float* W_in, float* W_out, const float* step) {
    T* op = nullptr;
    if constexpr (!std::is_same<T, float>::value) op = w_op_.get();
    step_renorm_kernel<T><<<grid_for(g_.pairs * g_.norms() * 32, kThreads), kThreads, 0, stream_>>>(
        W_in, W_out, step, norm0_.get(), g_.pairs, g_.H, g_.M, g_.D, p_.config.renorm, op);
    SS_LAUNCH_CHECK("step_renorm_kernel");
    if constexpr (std::is_same<T, float>::value)
      return W_out;
    else
      return op;
  }

  // h = [h0 | h2] = X [W0; W2]^T (rows of 2M) for the tokens X (q or k).
  void hidden(const void* x, const T* w, int64_t n, int64_t t0) {
    const int64_t M2 = 2 * g_.M;
    for (int64_t b = 0; b < g_.B; ++b)
      gemm_t(false, true, n, M2, g_.D, 1.0, tokens(x, b, t0), weights(w, b, 0), 0.0,
             rows_out(h_buf(), b, n, M2));
  }

  // The fused hidden-layer kernel's launch for the slice (lact_hidden.cuh);
  // d_o: apply_backward's second token operand.
  LactHiddenParams hidden_params(LactHiddenMode mode, const T* w, int64_t n, int64_t t0,
                                 const void* d_o = nullptr) const {
    if constexpr (std::is_same<T, bf16>::value) {
      LactHiddenParams h;
      h.mode = mode;
      h.x = tok(mode == LactHiddenMode::key_side ? p_.k : p_.q);
      h.v = tok(mode == LactHiddenMode::apply_backward ? d_o : p_.v);
      h.dh = dh_.get();
      h.o = static_cast<bf16*>(p_.o);
      // On the caller's stream the kernel before is always a kernel that
      // writes none of the tokens and reads none of the outputs (step_renorm,
      // the weights' copy, a dW GEMM); on the side stream an event wait
      // precedes every launch.
      h.dependent = pdl_ && stream_ != side_;
      h.w = w;
      h.lr0 = tok(p_.lr0), h.lr1 = tok(p_.lr1), h.lr2 = tok(p_.lr2);
      h.z = z_.get(), h.gate = gate_.get(), h.z_lo = z_lo_.get(), h.gate_lo = gate_lo_.get();
      h.B = g_.B, h.H = g_.H, h.D = g_.D, h.M = g_.M;
      h.local_len = g_.local_len, h.t0 = t0, h.n = n;
      return h;
    } else {
      SS_CHECK_ARG(false, "dtype", "the fused hidden layer takes bf16 layers only");
      return {};
    }
  }

  // o = f_W(q) for the slice (the fused kernel forms o itself; an o it
  // cannot store to, as a d_o it cannot load, takes the cuBLAS path).
  void apply_forward(const T* w, int64_t n, int64_t t0) {
    const int64_t rows = g_.pairs * n, M = g_.M, hd = g_.H * g_.D;
    if (fused_apply()) {
      lact_hidden_launch(hidden_params(LactHiddenMode::apply, w, n, t0), stream_);
      return;
    }
    hidden(p_.q, w, n, t0);
    apply_gate_kernel<T>
        <<<row_grid(rows), kRowThreads, 0, stream_>>>(h_buf(), rows, M, gate_.get());
    SS_LAUNCH_CHECK("apply_gate_kernel");
    for (int64_t b = 0; b < g_.B; ++b)
      gemm_t(false, true, n, g_.D, M, 1.0, rows_in<T>(gate_.get(), b, n, M), weights(w, b, 2), 0.0,
             Output{static_cast<T*>(p_.o) + (b * g_.local_len + t0) * hd, kT, hd, g_.D});
  }

  // h = [h0 | h2] and e = -W1^T v (as rows) at the slice's keys and values.
  void key_side(const T* w, int64_t n, int64_t t0) {
    hidden(p_.k, w, n, t0);
    for (int64_t b = 0; b < g_.B; ++b)
      gemm_t(false, false, n, g_.M, g_.D, -1.0, tokens(p_.v, b, t0), weights(w, b, 2), 0.0,
             rows_out(e_buf(), b, n, g_.M));
  }

  // G = [G0 | G2 | G1] of the slice at W (this rank's partial sum).
  void partial_gradients(const T* w, int64_t n, int64_t t0, float* G) {
    const int64_t M = g_.M, M2 = 2 * g_.M;
    if (fused_hidden_) {
      lact_hidden_launch(hidden_params(LactHiddenMode::key_side, w, n, t0), stream_);
    } else {
      key_side(w, n, t0);
      key_side_kernel<T><<<row_grid(g_.pairs * n), kRowThreads, 0, stream_>>>(
          h_buf(), e_buf(), tok(p_.lr0), tok(p_.lr1), tok(p_.lr2), g_.pairs, n, M, g_.H,
          g_.local_len, t0, z_.get(), gate_.get(), z_lo_.get(), gate_lo_.get());
      SS_LAUNCH_CHECK("key_side_kernel");
    }
    for (int64_t b = 0; b < g_.B; ++b) {
      // [G0; G2] = [z0 | z2]^T k,  G1 = -v^T gate (+ the low bf16 terms).
      gemm_t(true, false, M2, g_.D, n, 1.0, rows_in<T>(z_.get(), b, n, M2), tokens(p_.k, b, t0),
             0.0, weight_grad(G, b, 0));
      gemm_t(true, false, g_.D, M, n, -1.0, tokens(p_.v, b, t0), rows_in<T>(gate_.get(), b, n, M),
             0.0, weight_grad(G, b, 2));
      if (split_update_) {
        gemm_t(true, false, M2, g_.D, n, 1.0, rows_in<T>(z_lo_.get(), b, n, M2),
               tokens(p_.k, b, t0), 1.0, weight_grad(G, b, 0));
        gemm_t(true, false, g_.D, M, n, -1.0, tokens(p_.v, b, t0),
               rows_in<T>(gate_lo_.get(), b, n, M), 1.0, weight_grad(G, b, 2));
      }
    }
  }

  void store_tokens(const float* acc, int64_t n, int64_t t0, void* dst) {
    const int64_t hd = g_.H * g_.D, total = g_.B * n * hd;
    store_tokens_kernel<T><<<grid_for(total, kThreads), kThreads, 0, stream_>>>(
        acc, g_.B, n, hd, g_.local_len, t0, static_cast<T*>(dst));
    SS_LAUNCH_CHECK("store_tokens_kernel");
  }

  // Whether apply_forward / apply_backward take the fused kernel: o and d_o
  // are the caller's, and the kernel's tensor maps and stores need them
  // aligned too.
  bool fused_apply() const { return fused_hidden_ && lact_hidden_aligned(p_.o, p_.o, p_.o); }
  bool fused_apply_backward(const LactCudaGrads& gr) const {
    return fused_hidden_ && lact_hidden_aligned(gr.d_o, gr.d_o, gr.d_o);
  }

  // Backward of apply_forward at w: writes dq of the slice, adds to dW.
  void apply_backward(const LactCudaGrads& gr, const T* w, int64_t n, int64_t t0, float* dW) {
    apply_backward_tokens(gr, w, n, t0);
    apply_backward_weights(gr, n, t0, dW);
  }
  // Its token side: gate and dh (gate_, dh_) of the slice, and dq.
  void apply_backward_tokens(const LactCudaGrads& gr, const T* w, int64_t n, int64_t t0) {
    const int64_t rows = g_.pairs * n, M = g_.M, M2 = 2 * g_.M;
    if (fused_apply_backward(gr)) {
      lact_hidden_launch(hidden_params(LactHiddenMode::apply_backward, w, n, t0, gr.d_o), stream_);
    } else {
      hidden(p_.q, w, n, t0);
      for (int64_t b = 0; b < g_.B; ++b)  // dgate = W1^T do (as rows), in u1's buffer
        gemm_t(false, false, n, M, g_.D, 1.0, tokens(gr.d_o, b, t0), weights(w, b, 2), 0.0,
               rows_out(u1_buf(), b, n, M));
      apply_backward_kernel<T><<<row_grid(rows), kRowThreads, 0, stream_>>>(
          h_buf(), u1_buf(), rows, M, gate_.get(), dh_.get());
      SS_LAUNCH_CHECK("apply_backward_kernel");
    }
    // [h0; h2] = [W0; W2] q: dq = dh [W0; W2].
    for (int64_t b = 0; b < g_.B; ++b)
      gemm_t(false, false, n, g_.D, M2, 1.0, rows_in<T>(dh_.get(), b, n, M2), weights(w, b, 0), 0.0,
             tokens_out(gr.dq, b, t0));
  }
  // Its weight side from gate_ and dh_: o = W1 gate: dW1 += do gate^T;
  // d[W0; W2] += dh^T q.
  void apply_backward_weights(const LactCudaGrads& gr, int64_t n, int64_t t0, float* dW) {
    const int64_t M = g_.M, M2 = 2 * g_.M;
    for (int64_t b = 0; b < g_.B; ++b) {
      gemm_t(true, false, g_.D, M, n, 1.0, tokens(gr.d_o, b, t0), rows_in<T>(gate_.get(), b, n, M),
             1.0, weight_grad(dW, b, 2));
      gemm_t(true, false, M2, g_.D, n, 1.0, rows_in<T>(dh_.get(), b, n, M2), tokens(p_.q, b, t0),
             1.0, weight_grad(dW, b, 0));
    }
  }

  // gradients_backward's rows (z, gate, de, dh, dlr) by lact_hidden_grad_kernel
  // where the fused hidden layer runs, into the packed rows zdh_ = [z | dh]
  // (4M) and gde_ = [gate | de] (2M), with kw_ = [dG0; dG2; W0; W2] and
  // t1_ = [dG1^T; W1^T] per pair beside them: dk and dv are then one GEMM
  // each, straight into the token gradients. False: the caller runs the
  // cuBLAS path.
  bool fused_gradient_rows(const LactCudaGrads& gr, const T* w, const float* dg, int64_t n,
                           int64_t t0) {
    if constexpr (std::is_same<T, bf16>::value) {
      if (!fused_hidden_) return false;
      const int64_t md = g_.md(), pairs = g_.pairs;
      const std::size_t rows = rows_alloc();
      T* zdh = lazy(zdh_, 4 * rows, stream_);
      T* gde = lazy(gde_, 2 * rows, stream_);
      T* kw = lazy(kw_, static_cast<std::size_t>(pairs * 4 * md), stream_);
      T* t1 = lazy(t1_, static_cast<std::size_t>(pairs * 2 * md), stream_);
      // dG's bf16 rows go straight into kw and t1: the block copy of dG
      // that the cuBLAS path converts is not needed here.
      lact_hidden_pack_operands(dg, w, pairs, g_.M, g_.D, kw, t1, stream_);
      LactHiddenGradParams h;
      h.k = tok(p_.k), h.v = tok(p_.v), h.w = kw + 2 * md, h.dg = kw, h.w1t = t1 + md, h.dg1t = t1;
      h.w_pitch = 4 * g_.M, h.t_pitch = 2 * g_.M;
      h.lr0 = tok(p_.lr0), h.lr1 = tok(p_.lr1), h.lr2 = tok(p_.lr2);
      h.dlr0 = static_cast<T*>(gr.dlr0), h.dlr1 = static_cast<T*>(gr.dlr1),
      h.dlr2 = static_cast<T*>(gr.dlr2);
      h.z = zdh, h.dh = zdh + 2 * g_.M, h.z_ld = h.dh_ld = 4 * g_.M;
      h.gate = gde, h.de = gde + g_.M, h.gate_ld = h.de_ld = 2 * g_.M;
      h.B = g_.B, h.H = g_.H, h.D = g_.D, h.M = g_.M, h.local_len = g_.local_len, h.t0 = t0,
      h.n = n;
      h.dependent = pdl_;  // after lact_hidden_pack_operands, which writes only kw and t1
      lact_hidden_grad_launch(h, stream_);
      return true;
    } else {
      (void)gr, (void)w, (void)dg, (void)n, (void)t0;
      return false;
    }
  }

  // Backward of partial_gradients given the all-reduced dG (fp32; w: W's
  // operand copy): writes dk, dv, dlr0..2 of the slice, adds the
  // second-order part to dW.
  //   dk = [lr0 z0 | lr2 z2] [dG0; dG2] + [dh0 | dh2] [W0; W2],
  //   dv = -lr1 gate dG1^T - de W1^T,
  //   e = -W1^T v: dW1 -= v de^T;  [h0; h2] = [W0; W2] k: d[W0; W2] += dh^T k.
  void gradients_backward(const LactCudaGrads& gr, const T* w, const float* dG, int64_t n,
                          int64_t t0, float* dW) {
    const int64_t M = g_.M, M2 = 2 * g_.M, md = g_.md(), D = g_.D;
    if (fused_gradient_rows(gr, w, dG, n, t0)) {
      const T* zdh = zdh_.get();
      const T* gde = gde_.get();
      for (int64_t b = 0; b < g_.B; ++b) {
        const int64_t pb = b * g_.H;  // the row's first pair
        gemm_t(false, false, n, D, 2 * M2, 1.0, rows_in<T>(zdh, b, n, 2 * M2),
               {kw_.get() + pb * 4 * md, kT, D, 4 * md}, 0.0, tokens_out(gr.dk, b, t0));
        gemm_t(false, false, n, D, M2, -1.0, rows_in<T>(gde, b, n, M2),
               {t1_.get() + pb * 2 * md, kT, D, 2 * md}, 0.0, tokens_out(gr.dv, b, t0));
        gemm_t(true, false, D, M, n, -1.0, tokens(p_.v, b, t0), rows_in<T>(gde + M, b, n, M2), 1.0,
               weight_grad(dW, b, 2));
        gemm_t(true, false, M2, D, n, 1.0, rows_in<T>(zdh + M2, b, n, 2 * M2), tokens(p_.k, b, t0),
               1.0, weight_grad(dW, b, 0));
      }
      return;
    }
    const T* dg = operand_copy(dG, dg_op_);
    key_side(w, n, t0);
    for (int64_t b = 0; b < g_.B; ++b) {
      // [u0 | u2] = k [dG0; dG2]^T, u1 = v dG1 (as rows).
      gemm_t(false, true, n, M2, D, 1.0, tokens(p_.k, b, t0), weights(dg, b, 0), 0.0,
             rows_out(u_buf(), b, n, M2));
      gemm_t(false, false, n, M, D, 1.0, tokens(p_.v, b, t0), weights(dg, b, 2), 0.0,
             rows_out(u1_buf(), b, n, M));
    }
    gradients_backward_rows_kernel<T><<<static_cast<unsigned>(g_.pairs * n), 128, 0, stream_>>>(
        h_buf(), e_buf(), u_buf(), u1_buf(), tok(p_.lr0), tok(p_.lr1), tok(p_.lr2), n, M, g_.H,
        g_.local_len, t0, static_cast<T*>(gr.dlr0), static_cast<T*>(gr.dlr1),
        static_cast<T*>(gr.dlr2), z_.get(), gate_.get(), de_buf(), dh_.get());
    SS_LAUNCH_CHECK("gradients_backward_rows_kernel");
    // The rows in separate arrays: dk and dv as two GEMMs each into fp32 sums.
    float* dk_acc = token_acc(dk_acc_);
    float* dv_acc = token_acc(dv_acc_);
    for (int64_t b = 0; b < g_.B; ++b) {
      gemm_t(false, false, n, D, M2, 1.0, rows_in<T>(z_.get(), b, n, M2), weights(dg, b, 0), 0.0,
             acc_out(dk_acc, b, n));
      gemm_t(false, false, n, D, M2, 1.0, rows_in<T>(dh_.get(), b, n, M2), weights(w, b, 0), 1.0,
             acc_out(dk_acc, b, n));
      gemm_t(false, true, n, D, M, -1.0, rows_in<T>(gate_.get(), b, n, M), weights(dg, b, 2), 0.0,
             acc_out(dv_acc, b, n));
      gemm_t(false, true, n, D, M, -1.0, rows_in<T>(de_.get(), b, n, M), weights(w, b, 2), 1.0,
             acc_out(dv_acc, b, n));
      gemm_t(true, false, D, M, n, -1.0, tokens(p_.v, b, t0), rows_in<T>(de_.get(), b, n, M), 1.0,
             weight_grad(dW, b, 2));
      gemm_t(true, false, M2, D, n, 1.0, rows_in<T>(dh_.get(), b, n, M2), tokens(p_.k, b, t0), 1.0,
             weight_grad(dW, b, 0));
    }
    store_tokens(dk_acc, n, t0, gr.dk);
    store_tokens(dv_acc, n, t0, gr.dv);
  }

  LactCudaParams p_;
  Geo g_;
  cudaStream_t stream_;
  cublasHandle_t blas_;
  bool causal_, momentum_;
  // bf16 with Muon: the update gradient G (Newton-Schulz's input) takes its
  // token operands z, gate as bf16 hi + lo pairs (two GEMMs each). Newton-
  // Schulz amplifies the small singular directions of its input by up to
  // a^5 ~ 490, and plain bf16 z, gate put ~1e-3 relative noise there: in a
  // host emulation of this path (bidir, Muon, D 32, M 64, C 128) they lifted
  // dk from 5.4e-3 to 7.3e-3 and dlr from 6.3e-3 to 8.6e-3 (DESIGN's bounds
  // 8e-3 and 2e-2). Costs 6 M D more forward GEMM FLOPs per token (18 -> 24),
  // with Muon only.
  bool split_update_;
  // The hidden layer in lact_hidden_kernel and lact_hidden_grad_kernel
  // (lact_cuda_hidden_path): gate, z (and their low terms), dh, de straight
  // from the MMAs, no fp32 h, e or u.
  bool fused_hidden_;
  bool token_gemm_ = std::is_same<T, bf16>::value && token_gemm_requested();
  bool pdl_ = lact_pdl_requested();  // the fused kernels as dependent launches
  // The side stream (side_stream) and its cuBLAS handle, where the fused
  // hidden layer runs and side_stream_requested (else null); fork_ / join_
  // order it against stream_.
  cudaStream_t side_ = nullptr;
  cublasHandle_t side_blas_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  bool side_pending_ = false;  // join_ recorded and not yet waited on by stream_

  // f() with stream_ and blas_ standing for the side stream: what f
  // enqueues (launches, GEMMs) runs after everything enqueued on stream_ so
  // far and beside what is enqueued there next, until join_side(). f must
  // not allocate (the pool's arrays belong to stream_) nor write what
  // stream_'s work before the join reads.
  template <typename F>
  void on_side(F&& f) {
    SS_CUDA_CHECK(cudaEventRecord(fork_, stream_));
    SS_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
    struct Swap {
      LactGpu& g;
      cudaStream_t stream;
      cublasHandle_t blas;
      ~Swap() {
        g.stream_ = stream, g.blas_ = blas;
        // Recorded even when f threw: the destructor's wait covers what it enqueued.
        g.side_pending_ = cudaEventRecord(g.join_, g.side_) == cudaSuccess;
      }
    } swap{*this, stream_, blas_};
    stream_ = side_, blas_ = side_blas_;
    f();
  }
  // stream_ waits for the side stream's work so far.
  void join_side() {
    if (!side_pending_) return;
    SS_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_, 0));
    side_pending_ = false;
  }
  PoolArray<float> w_init_, norm0_;
  // Rows of 2M: h_, u_ (fp32), z_, dh_ (operands); rows of M: e_, u1_ (fp32),
  // gate_, de_ (operands).
  PoolArray<float> h_, e_, u_, u1_, dk_acc_, dv_acc_;
  PoolArray<T> z_, gate_, de_, dh_, w_op_, z_lo_, gate_lo_;
  // The fused backward's packed rows and weights (fused_gradient_rows), on
  // first use.
  PoolArray<T> zdh_, gde_, kw_, t1_;
  PoolArray<T> dg_op_;     // the cuBLAS path's bf16 dG (operand_copy)
  SplitKScratch split_k_;  // gemm_t's split-K partials and pointer arrays
};

template <typename T, typename U>
void forward_impl(const LactCudaParams& p, const LactDeviceAllReduce& all_reduce,
                  LactCudaSaved* saved, cudaStream_t stream) {
  LactGpu<T, U> layer(p, stream);
  layer.forward(all_reduce, saved);
}

template <typename T, typename U>
void backward_impl(const LactCudaParams& p, const LactCudaGrads& g, const LactCudaSaved& saved,
                   const LactDeviceAllReduce& all_reduce, cudaStream_t stream) {
  LactGpu<T, U> layer(p, stream);
  layer.backward(g, saved, all_reduce);
}

}  // namespace lact_detail
}  // namespace statescan::cuda
