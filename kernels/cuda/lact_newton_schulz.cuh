// Muon's Newton-Schulz iteration on the GPU for the LaCT layer
// (lact_cuda_impl.cuh): the layout kernels, the two-part bf16 products
// (split3, and the fused GEMMs on mma.sync and on wgmma), and the NewtonSchulz class that runs
// the steps forward and backward in every STATESCAN_LACT_NS mode.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/lact_common.cuh"
#include "kernels/cuda/lact_cuda.h"
#include "kernels/cuda/lact_ns_cluster.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/warp_mma.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace statescan::cuda {
namespace lact_detail {

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
  for_each_warp_row(mats, [&](int64_t mat, int lane) {
    const double t = warp_sum(part[mat * kNsSlices + lane]);
    if (lane == 0) scale[mat] = static_cast<U>(1.0 / (sqrt(t) + kLactEps));
  });
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
// the GPU suite, slower; lact_cuda.h) computes the same three products in
// ns_gemm_wgmma_kernel on a 9.0 device and ns_gemm_fused_kernel elsewhere,
// splitting as they stage the fp32 operands instead of through
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
  // beta's term reads Cin in place of C where set (Cin may be A or B, not
  // another part of C): C = alpha op(A) op(B) + beta Cin without a copy.
  const float* Cin = nullptr;
};

// Matrix b's operands and output in both fused kernels.
struct NsMatrix {
  const float *A, *B;
  float* C;
  const float* Cin;
};
__device__ __forceinline__ NsMatrix ns_matrix(const NsGemmParams& p, int64_t b) {
  float* C = p.C + b * int64_t(p.M) * p.N;
  return {p.A + b * int64_t(p.M) * p.K, p.B + b * int64_t(p.K) * p.N, C,
          p.Cin != nullptr ? p.Cin + b * int64_t(p.M) * p.N : C};
}

// The epilogue's pair (row, col .. col + 1) of C = alpha acc + beta C_in
// (N is even, so a pair is wholly inside or past the edge: skipped then).
__device__ __forceinline__ void ns_store_pair(const NsGemmParams& p, const NsMatrix& mat, int row,
                                              int col, float x, float y) {
  if (row >= p.M || col >= p.N) return;
  float2 v = make_float2(p.alpha * x, p.alpha * y);
  if (p.beta != 0.f) {
    const float2 old = *reinterpret_cast<const float2*>(mat.Cin + row * p.N + col);
    v.x += p.beta * old.x;
    v.y += p.beta * old.y;
  }
  *reinterpret_cast<float2*>(mat.C + row * p.N + col) = v;
}

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
    const NsMatrix mat = ns_matrix(p, b);
    const float *A = mat.A, *B = mat.B;

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
        for (int h = 0; h < 2; ++h)
          ns_store_pair(p, mat, m0 + wm + 16 * tm + g + 8 * h, n0 + wn + 8 * tn + 2 * i,
                        acc[tm][tn][2 * h], acc[tm][tn][2 * h + 1]);
  }
}

// ---- the two-part products on wgmma (STATESCAN_LACT_NS=fused on sm_90a) ------
//
// Why: the split path spends ~512 us of a Muon chunk (H100, the issue's shape)
// in split3_kernel, bound by its bytes, and the mma.sync kernel above runs at
// ~1.3x the split path's time. This one forms hi and lo from the fp32
// operands as it stages them and runs the products on warpgroup MMAs: a
// 64 x 64 tile of C a CTA of one warpgroup, 64-deep k blocks in two stages.
// Each block's fp32 A (M x K, rows of K) and B go through registers into
// shared memory as bf16 hi and lo in wgmma's 128-byte swizzle: A and a
// transposed B (stored N x K) K-major, rows of 64 k; an untransposed B
// (K x N) MN-major, rows of k; every 16-byte global load becomes two 8-byte
// shared stores. Block kt + 1's loads are in flight in registers while block
// kt's MMAs run. Per k16 step the products A_hi B_hi, A_hi B_lo, A_lo B_hi
// into one fp32 accumulator: the same three products as the split path,
// summed in another order (not the same bits; deterministic). op(A) = A only
// (Newton-Schulz never transposes A); the host checks the rest as for
// ns_gemm_fused_kernel (fused_fits).
//
// The tile: Newton-Schulz's products are small (12 matrices of 256 x 256 or
// 256 x 512 at the benchmark's shape). 128 x 128 tiles in two warpgroups
// (48-96 CTAs, one an SM at 129 KB) and 64 x 128 ones took 323-325 us for a
// chunk's forward steps on an H100; 64 x 64 (192-384 CTAs, three an SM at
// 65 KB, whose loads and MMAs overlap one another's) 263, as 128 x 64 did
// (PERF_NOTES, forty-sixth session). What binds it then is the loads'
// latency (ncu: ~6 warps an SM, the top stall the loads' scoreboard, L2 at
// 18 % of its throughput): each block waits for loads issued one block ahead.
struct NsWgmmaTile {
  static constexpr int kM = 64, kN = 64, kK = 64, kThreads = 128;  // one warpgroup
  static constexpr int kPart = kM * kK * 2;  // one bf16 part of an A or B block: 8 KB
  static constexpr int kStage = 4 * kPart;   // A hi, A lo, B hi, B lo
  static constexpr int kStages = 2;
  static constexpr int kSmem = kStages * kStage + 1024;  // + the 1024-byte alignment
  static constexpr int kLoads = kM * kK / 4 / kThreads;  // float4 loads an operand a thread
  static constexpr int kMinBlocks = 3;                   // CTAs an SM (registers: <= 170)
};
static_assert(NsWgmmaTile::kN == NsWgmmaTile::kM && NsWgmmaTile::kK == 64,
              "A and B blocks take the same loads; a 64-deep block is one 128-byte swizzle row");

// Byte offset of 16-bit element (row, col) of a 128-byte-swizzled tile whose
// rows hold 64 elements: the 16-byte piece col / 8 of row `row` sits at piece
// (col / 8) ^ (row % 8) (TMA's CU_TENSOR_MAP_SWIZZLE_128B; wgmma_desc_sw128).
__device__ __forceinline__ uint32_t ns_sw128_offset(int row, int col) {
  return static_cast<uint32_t>(row * 128 + ((((col >> 3) ^ (row & 7)) << 4) | ((col & 7) << 1)));
}

// Four consecutive fp32 values as bf16 hi and lo (detail::split_bf16x2: the
// split path's parts), each 8 bytes, stored at byte offset `off` of the hi and
// lo tiles.
__device__ __forceinline__ void ns_store_parts(unsigned char* hi, unsigned char* lo, uint32_t off,
                                               float4 v) {
  uint32_t h0, l0, h1, l1;
  detail::split_bf16x2(v.x, v.y, h0, l0);
  detail::split_bf16x2(v.z, v.w, h1, l1);
  *reinterpret_cast<uint2*>(hi + off) = make_uint2(h0, h1);
  *reinterpret_cast<uint2*>(lo + off) = make_uint2(l0, l1);
}

template <bool kTB>
__global__ void __launch_bounds__(NsWgmmaTile::kThreads, NsWgmmaTile::kMinBlocks)
    ns_gemm_wgmma_kernel(const __grid_constant__ NsGemmParams p) {
  using Tile = NsWgmmaTile;
  extern __shared__ __align__(128) unsigned char ns_smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(ns_smem_raw) + 1023) & ~uintptr_t{1023});
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int m0 = blockIdx.y * Tile::kM, n0 = blockIdx.x * Tile::kN;
  const int M = p.M, N = p.N, K = p.K;
  const int k_tiles = (K + Tile::kK - 1) / Tile::kK;

  for (int64_t b = blockIdx.z; b < p.mats; b += gridDim.z) {
    // Within a matrix, 32-bit offsets (NewtonSchulz checks 3 M D < 2^31).
    const NsMatrix mat = ns_matrix(p, b);
    const float *A = mat.A, *B = mat.B;

    // Block kt of both operands into registers: load f = t + 128 i is row
    // f / 16, columns 4 (f % 16) .. + 3 of the A block and of a transposed B
    // block (rows n), of an untransposed one row k (rows of 64 n alike); zeros
    // past the edges (K, M, N multiples of 16: a float4 is wholly inside or
    // outside).
    float4 ra[Tile::kLoads], rb[Tile::kLoads];
    auto load = [&](int kt) {
      const int k0 = kt * Tile::kK;
#pragma unroll
      for (int i = 0; i < Tile::kLoads; ++i) {
        const int f = t + Tile::kThreads * i;
        const int r = f >> 4, c = 4 * (f & 15);
        ra[i] = m0 + r < M && k0 + c < K
                    ? *reinterpret_cast<const float4*>(A + (m0 + r) * K + k0 + c)
                    : make_float4(0.f, 0.f, 0.f, 0.f);
        if constexpr (kTB) {
          rb[i] = n0 + r < N && k0 + c < K
                      ? *reinterpret_cast<const float4*>(B + (n0 + r) * K + k0 + c)
                      : make_float4(0.f, 0.f, 0.f, 0.f);
        } else {
          rb[i] = k0 + r < K && n0 + c < N
                      ? *reinterpret_cast<const float4*>(B + (k0 + r) * N + n0 + c)
                      : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
    };
    // The registers into stage s as hi and lo parts: the same (row, column)
    // places for both operands, K-major for A and a transposed B, MN-major
    // (rows of k) for an untransposed B.
    auto store = [&](int s) {
      unsigned char* st = smem + s * Tile::kStage;
#pragma unroll
      for (int i = 0; i < Tile::kLoads; ++i) {
        const int f = t + Tile::kThreads * i;
        const uint32_t off = ns_sw128_offset(f >> 4, 4 * (f & 15));
        ns_store_parts(st, st + Tile::kPart, off, ra[i]);
        ns_store_parts(st + 2 * Tile::kPart, st + 3 * Tile::kPart, off, rb[i]);
      }
    };

    float acc[Tile::kN / 2];
#pragma unroll
    for (int e = 0; e < Tile::kN / 2; ++e) acc[e] = 0.f;
    load(0);
    for (int kt = 0; kt < k_tiles; ++kt) {
      const int s = kt & 1;
      // Stage s was last read by block kt - 2's MMAs, which the warpgroup
      // has waited for (wgmma_wait<1> at the end of block kt - 1).
      __syncthreads();
      store(s);
      detail::fence_proxy_async_shared();
      __syncthreads();
      if (kt + 1 < k_tiles) load(kt + 1);  // in flight during the MMAs
      const unsigned char* st = smem + s * Tile::kStage;
      const uint64_t a_hi = detail::wgmma_desc_sw128(st, 1024);
      const uint64_t a_lo = detail::wgmma_desc_sw128(st + Tile::kPart, 1024);
      // An MN-major B is one 64-column atom (its leading offset unused).
      const uint64_t b_hi =
          kTB ? detail::wgmma_desc_sw128(st + 2 * Tile::kPart, 1024)
              : detail::wgmma_desc_sw128_mn(st + 2 * Tile::kPart, Tile::kPart, 1024);
      const uint64_t b_lo =
          kTB ? detail::wgmma_desc_sw128(st + 3 * Tile::kPart, 1024)
              : detail::wgmma_desc_sw128_mn(st + 3 * Tile::kPart, Tile::kPart, 1024);
      // A k16 step: 32 bytes along a K-major row; two 8-row atoms (2048 B)
      // down an MN-major tile.
      constexpr uint32_t kBStep = kTB ? 32 : 2048;
      detail::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Tile::kK / 16; ++kk) {
        const uint64_t ah = detail::wgmma_desc_advance(a_hi, 32 * kk);
        const uint64_t al = detail::wgmma_desc_advance(a_lo, 32 * kk);
        const uint64_t bh = detail::wgmma_desc_advance(b_hi, kBStep * kk);
        const uint64_t bl = detail::wgmma_desc_advance(b_lo, kBStep * kk);
        detail::wgmma_m64n64k16_ss<true, !kTB>(acc, ah, bh);
        detail::wgmma_m64n64k16_ss<true, !kTB>(acc, ah, bl);
        detail::wgmma_m64n64k16_ss<true, !kTB>(acc, al, bh);
      }
      detail::wgmma_commit();
      detail::wgmma_wait<1>();
    }
    detail::wgmma_wait<0>();

    // The m64n64 accumulator: column block j holds (row r, columns 8 j + 2 q
    // .. + 1) in acc[4 j], acc[4 j + 1] and row r + 8 in acc[4 j + 2 ..],
    // r = 16 warp + lane / 4, q = lane % 4; N is even, so a pair is wholly
    // inside or past the edge.
    const int r0 = m0 + 16 * warp + lane / 4;
#pragma unroll
    for (int j = 0; j < Tile::kN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        ns_store_pair(p, mat, r0 + 8 * h, n0 + 8 * j + 2 * (lane % 4), acc[4 * j + 2 * h],
                      acc[4 * j + 2 * h + 1]);
  }
}

// Muon's NS_s over all 3 * pairs matrices of a [pairs, 3MD] array at once,
// each Newton-Schulz product one batched GEMM in U (for U = float, unless
// STATESCAN_LACT_NS=fp32: one bf16 GEMM of two-part operands, or with
// STATESCAN_LACT_NS=fused one ns_gemm_wgmma_kernel or ns_gemm_fused_kernel
// launch where the shape allows).
template <typename U>
class NewtonSchulz {
 public:
  // `mode`: how a bf16 layer (U = float) runs the products, STATESCAN_LACT_NS
  // unless a caller (the tests, statescan-bench --lact-ns) names one.
  // `allow_wgmma` false keeps every product off ns_gemm_wgmma_kernel, as on a
  // device without wgmma: the tests' way to run the split path's and the
  // mma.sync kernel's products on a 9.0 device too.
  NewtonSchulz(const Geo& g, int steps, bool keep_iterates, cudaStream_t stream,
               NsGemms mode = ns_gemms_requested(), bool allow_wgmma = true)
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
    if constexpr (std::is_same<U, float>::value) {
      if (split_) {
        int device = 0;
        SS_CUDA_CHECK(cudaGetDevice(&device));
        wgmma_ = allow_wgmma && detail::wgmma_device(device);
        if (wgmma_) {
          SS_CUDA_CHECK(cudaFuncSetAttribute(ns_gemm_wgmma_kernel<true>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             NsWgmmaTile::kSmem));
          SS_CUDA_CHECK(cudaFuncSetAttribute(ns_gemm_wgmma_kernel<false>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             NsWgmmaTile::kSmem));
        }
      }
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
  // No host synchronisation: an executable graph destroyed while in flight is
  // freed when it completes (cudaGraphExecDestroy), and the buffers it uses
  // go back to the pool in stream order. A wait here blocked the host at the
  // end of every layer call with Muon and stopped it queuing the next one.
  ~NewtonSchulz() {
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

  // How many graphs replay() has captured so far (for the tests: a blocking
  // caller stream captures too).
  int captures() const { return captures_; }

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
  //
  // The capture (and the eager first run before it, which sets cuBLAS up for
  // that stream) runs on a stream of this object's own, non-blocking, ordered
  // after and before the caller's by events; the graph is launched on the
  // caller's. Why: while a blocking stream (the caller's may well be one;
  // statescan's tools' are) is being captured, no thread may use the legacy
  // default stream: such a call fails with cudaErrorStreamCaptureImplicit
  // (and ends the capture), so another thread of the trainer would see an
  // error of ours.
  template <typename F>
  void replay(Replay& r, const void* a, const void* b, const void* c, F&& enqueue) {
    const bool same = r.key[0] == a && r.key[1] == b && r.key[2] == c;
    if (r.exec != nullptr && same) {
      SS_CUDA_CHECK(cudaGraphLaunch(r.exec, stream_));
      return;
    }
    if (r.exec != nullptr) {  // freed once its queued launches complete (see the destructor)
      (void)cudaGraphExecDestroy(r.exec);
      r.exec = nullptr;
    }
    const bool capturable =
        stream_ != nullptr && stream_ != cudaStreamLegacy && stream_ != cudaStreamPerThread;
    const bool first = !same || r.calls == 0;
    r.key[0] = a, r.key[1] = b, r.key[2] = c;
    ++r.calls;
    if (!capturable || r.failed) {
      enqueue();
      return;
    }
    if (!lane_.open()) {
      r.failed = true;
      enqueue();
      return;
    }
    if (first) {  // eager on the capture stream: sets up cuBLAS there, as a capture needs
      on_lane(enqueue);
      return;
    }
    cudaGraph_t graph = nullptr;
    if (cudaStreamBeginCapture(lane_.stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
      (void)cudaGetLastError();
      r.failed = true;
      enqueue();
      return;
    }
    bool captured = true;
    try {
      enqueue_on(lane_.stream, enqueue);
    } catch (...) {  // the capture must end whatever happened; eager below
      captured = false;
    }
    const cudaError_t end = cudaStreamEndCapture(lane_.stream, &graph);
    if (captured && end == cudaSuccess && graph != nullptr &&
        cudaGraphInstantiate(&r.exec, graph, 0) == cudaSuccess) {
      (void)cudaGraphDestroy(graph);
      ++captures_;
      SS_CUDA_CHECK(cudaGraphLaunch(r.exec, stream_));
      return;
    }
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    r.exec = nullptr;
    r.failed = true;
    enqueue();  // nothing of the failed capture ran
  }

  // enqueue() on the capture stream, after the work queued on the caller's
  // stream so far and before what is queued there next.
  template <typename F>
  void on_lane(F&& enqueue) {
    SS_CUDA_CHECK(cudaEventRecord(lane_.fork, stream_));
    SS_CUDA_CHECK(cudaStreamWaitEvent(lane_.stream, lane_.fork, 0));
    enqueue_on(lane_.stream, enqueue);
    SS_CUDA_CHECK(cudaEventRecord(lane_.join, lane_.stream));
    SS_CUDA_CHECK(cudaStreamWaitEvent(stream_, lane_.join, 0));
  }

  // enqueue() with stream_ (what every launch of it names) pointed at
  // `stream`, and back to the caller's whatever happens.
  template <typename F>
  void enqueue_on(cudaStream_t stream, F&& enqueue) {
    struct Restore {
      cudaStream_t& member;
      cudaStream_t caller;
      ~Restore() { member = caller; }
    } restore{stream_, stream_};
    stream_ = stream;
    enqueue();
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
    cublasHandle_t h = detail::blas_handle(stream_, detail::BlasSlot::newton_schulz);
    const int split_steps = cluster_ ? 0 : steps_;  // the cluster kernel ran them all
    for (int s = 0; s < split_steps; ++s) {
      if (iterates_.get())
        SS_CUDA_CHECK(cudaMemcpyAsync(iterates_.get() + s * mats_ * mn, X_.get(),
                                      mats_ * mn * sizeof(U), cudaMemcpyDeviceToDevice, stream_));
      gram(h, X_.get());
      // B into A where in_place(): nothing reads A after it here.
      U* Bm = in_place() ? A_.get() : Bm_.get();
      poly(h, Bm);
      // Y = a X + B X (into X where the split path runs it in place).
      U* Xn = apply_target(Bm);
      ns_gemm(h, false, false, m_, n_, m_, 1.0, Bm, X_.get(), kMuonA, Xn, X_.get());
      if (Xn != X_.get()) std::swap(X_, Y_);
    }
    ns_store_kernel<U><<<tile_grid(m_, n_), tile_block(), 0, stream_>>>(
        X_.get(), mats_, static_cast<int>(M_), static_cast<int>(D_), out);
    SS_LAUNCH_CHECK("ns_store_kernel");
  }

  void backward_eager(const float* P, const float* d_out, float* dP) {
    const int64_t mn = m_ * n_;
    forget_splits();
    cublasHandle_t h = detail::blas_handle(stream_, detail::BlasSlot::newton_schulz);
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
      ns_gemm(h, false, true, m_, m_, n_, 1.0, X_.get(), X, 0.0, dB_.get(), nullptr, true);
      poly(h, Bm_.get());  // not into A: dA's products read A below
      // B = b A + c A A:  dA = b dB + c (dB A + A dB); dB A takes A as its right
      // operand as A A just did (A untouched in between).
      ns_gemm(h, false, false, m_, m_, m_, kMuonC, dB_.get(), A_.get(), kMuonB, dA_.get(),
              dB_.get(), true);
      ns_gemm(h, false, false, m_, m_, m_, kMuonC, A_.get(), dB_.get(), 1.0, dA_.get());
      // Y = a X + B X:  dXn = a dY + B dY (into dY's own array where the
      // split path runs it in place: dY is not read after this product).
      U* dXn = apply_target(Bm_.get());
      ns_gemm(h, false, false, m_, n_, m_, 1.0, Bm_.get(), X_.get(), kMuonA, dXn, X_.get());
      // A = X X^T:  dXn += (dA + dA^T) X  (Bm_ is free now: it holds S).
      symmetrise_kernel<U><<<tile_grid(m_, m_), tile_block(), 0, stream_>>>(
          dA_.get(), mats_, static_cast<int>(m_), Bm_.get());
      SS_LAUNCH_CHECK("symmetrise_kernel");
      ns_gemm(h, false, false, m_, n_, m_, 1.0, Bm_.get(), X, 1.0, dXn);
      if (dXn != X_.get()) std::swap(X_, Y_);
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

  // Whether a product may write the matrix its operands were split from:
  // on the split path (not the fused kernel's) the GEMM reads only the bf16
  // splits, made before it, so C = a source is safe there and saves the copy
  // of C's start value (Y = X before Y = a X + B X; B = A before B = b A +
  // c A A): 6.3 and 3.1 MB a step at the benchmark shape, ~4.5 and ~2.5 us
  // each, 25 copies a chunk forward and backward. The same products on the
  // same values, so the same bits. A product that routes_fused never runs in
  // place (its kernel reads the fp32 operands while other CTAs write C): the
  // callers check that too.
  bool in_place() const { return split_ && !fused_; }

  // The target of a X + Bm X (forward) or a dY + Bm dY (backward), X_ the
  // right operand and beta's term: X_ itself where the split path runs it in
  // place, else Y_ (the callers swap the two after it).
  U* apply_target(const U* Bm) {
    return in_place() && !routes_fused(false, false, m_, n_, m_, Bm, X_.get(), false) ? X_.get()
                                                                                      : Y_.get();
  }

  // A = X X^T for every matrix.
  void gram(cublasHandle_t h, const U* X) {
    ns_gemm(h, false, true, m_, m_, n_, 1.0, X, X, 0.0, A_.get());
  }
  // Bm = b A + c A A for every matrix (Bm may be A itself: in_place()).
  void poly(cublasHandle_t h, U* Bm) {
    ns_gemm(h, false, false, m_, m_, m_, kMuonC, A_.get(), A_.get(), kMuonB, Bm, A_.get());
  }

  // C's start value for a product that adds beta C (cuBLAS takes C in
  // place): a copy of `from`'s `per` values a matrix, none where C is it.
  void start_value(U* C, const U* from, int64_t per) {
    if (C != from)
      SS_CUDA_CHECK(
          cudaMemcpyAsync(C, from, mats_ * per * sizeof(U), cudaMemcpyDeviceToDevice, stream_));
  }

  // C = alpha op(A) op(B) + beta C_in over the mats_ matrices (packed
  // operands), in U, or in split mode as one bf16 GEMM of two-part operands.
  // C_in is c_in, or C where c_in is null: the fused kernels read it
  // themselves (no copy), the cuBLAS paths take C's start value in place
  // (start_value). In split mode `b_unchanged` says that B has not been
  // written since the previous split of a B operand: if that split was of
  // the same matrix in the same stacking, split_b_ still holds it and is used
  // as it is.
  void ns_gemm(cublasHandle_t h, bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
               const U* A, const U* B, double beta, U* C, const U* c_in = nullptr,
               bool b_unchanged = false) {
    if (c_in == C || beta == 0.0) c_in = nullptr;
    if (!split_) {
      if (c_in != nullptr) start_value(C, c_in, M * N);
      gemm_sliced(h, stream_, ta, tb, M, N, K, alpha, op(A, ta ? M : K, M * K),
                  op(B, tb ? K : N, K * N), beta, out_(C, N, M * N), mats_, compute_, split_k_);
      return;
    }
    if constexpr (std::is_same<U, float>::value) {
      if (routes_fused(ta, tb, M, N, K, A, B, b_unchanged) && fused_fits(M, N, K, A, B, C, c_in)) {
        if (wgmma_ && !ta)
          ns_gemm_wgmma(tb, M, N, K, alpha, A, B, beta, C, c_in);
        else
          ns_gemm_fused(ta, tb, M, N, K, alpha, A, B, beta, C, c_in);
        // The fused kernel leaves split_a_ / split_b_ untouched, so their keys
        // still name what they hold, except where the source was C: forget
        // those, as the split path below does, so that a later fallback call
        // (a shape the fused kernel does not take) never reuses a stale split.
        forget_splits_of(C);
        return;
      }
      if (c_in != nullptr) start_value(C, c_in, M * N);
      const SplitPlan plan = split_plan(ta, tb, M, N, K, A, B, b_unchanged);
      const SplitKey &ka = plan.ka, &kb = plan.kb;
      Split3Targets targets{};
      targets.t[0] = {split_a_.get(), ka.k_is_cols, 0b100};
      targets.count = 1;
      if (plan.both) targets.t[targets.count++] = {split_b_.get(), kb.k_is_cols, 0b010};
      split3(A, ka.rows, ka.cols, targets);
      if (plan.two_launches()) {
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

  // Whether a split-mode product goes to the fused kernels (where fused_fits
  // also holds): every product in STATESCAN_LACT_NS=fused; in the other split
  // modes on a 9.0 device (wgmma_), the products whose operands the split
  // path would split in two launches, neither sharing one read of a matrix
  // (X X^T, A A) nor reusing the previous product's split of B (b_unchanged):
  // Y = a X + B X, and in the backward a dY + B dY, S X and A dB. H100, the
  // benchmark's shape, ncu in place (PERF_NOTES, forty-sixth session): those
  // take 17.1-17.5 us in ns_gemm_wgmma_kernel against 20.9-21.8 for two
  // splits and the cuBLAS GEMM (A dB: 13.9 against 15.2); the products with
  // one split launch are faster on the split path (X X^T 17.3 against 20.9).
  bool routes_fused(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const U* A, const U* B,
                    bool b_unchanged) const {
    if (!split_) return false;
    if (fused_) return true;
    if (!wgmma_ || ta) return false;
    return split_plan(ta, tb, M, N, K, A, B, b_unchanged).two_launches();
  }

  // Whether the fused kernels take this call (ns_gemm_wgmma_kernel's 64 x 64
  // tiles take whatever ns_gemm_fused_kernel's do). Decided per call on the host
  // (the same answer in the eager run and the captured graph): M, N, K
  // multiples of 16 (the kernel's whole-chunk edge handling), 16-byte aligned
  // operands (cp.async; NewtonSchulz's buffers and their per-matrix offsets
  // always are, c_in too), the row tiles within grid y, and C apart from A and B (the
  // kernel reads A and B tiles while other CTAs write C). Anything else, e.g.
  // a head dim D = 24, goes through split3 + cuBLAS as without the knob.
  bool fused_fits(int64_t M, int64_t N, int64_t K, const U* A, const U* B, const U* C,
                  const U* c_in) const {
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
           aligned(C) && (c_in == nullptr || aligned(c_in)) && apart(A, M * K) && apart(B, K * N);
  }

  // Both fused kernels' parameters for one product over the mats_ matrices.
  NsGemmParams gemm_params(int64_t M, int64_t N, int64_t K, double alpha, const U* A, const U* B,
                           double beta, U* C, const U* c_in) const {
    NsGemmParams prm;
    prm.A = A, prm.B = B, prm.C = C, prm.Cin = c_in, prm.mats = mats_;
    prm.M = static_cast<int>(M), prm.N = static_cast<int>(N), prm.K = static_cast<int>(K);
    prm.alpha = static_cast<float>(alpha), prm.beta = static_cast<float>(beta);
    return prm;
  }

  // One ns_gemm_fused_kernel launch over the mats_ matrices (fused_fits holds).
  void ns_gemm_fused(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const U* A,
                     const U* B, double beta, U* C, const U* c_in) {
    const NsGemmParams prm = gemm_params(M, N, K, alpha, A, B, beta, C, c_in);
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

  // One ns_gemm_wgmma_kernel launch over the mats_ matrices (fused_fits
  // holds, op(A) = A).
  void ns_gemm_wgmma(bool tb, int64_t M, int64_t N, int64_t K, double alpha, const U* A, const U* B,
                     double beta, U* C, const U* c_in) {
    const NsGemmParams prm = gemm_params(M, N, K, alpha, A, B, beta, C, c_in);
    const dim3 grid(static_cast<unsigned>((N + NsWgmmaTile::kN - 1) / NsWgmmaTile::kN),
                    static_cast<unsigned>((M + NsWgmmaTile::kM - 1) / NsWgmmaTile::kM), mat_grid());
    if (tb)
      ns_gemm_wgmma_kernel<true><<<grid, NsWgmmaTile::kThreads, NsWgmmaTile::kSmem, stream_>>>(prm);
    else
      ns_gemm_wgmma_kernel<false>
          <<<grid, NsWgmmaTile::kThreads, NsWgmmaTile::kSmem, stream_>>>(prm);
    SS_LAUNCH_CHECK("ns_gemm_wgmma_kernel");
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

  // What the split path would split for a product: A as [hi | hi | lo] along
  // K (always), B as [hi ; lo ; hi] along K unless split_b_ still holds that
  // (need_b false: `b_unchanged` and the same key), and both from one read of
  // the matrix where A is B in the same shape (X X^T, A A).
  struct SplitPlan {
    SplitKey ka, kb;
    bool need_b, both;
    bool two_launches() const { return need_b && !both; }
  };
  SplitPlan split_plan(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const U* A, const U* B,
                       bool b_unchanged) const {
    SplitPlan plan;
    plan.ka = SplitKey{A, ta ? K : M, ta ? M : K, !ta};
    plan.kb = SplitKey{B, tb ? N : K, tb ? K : N, tb};
    plan.need_b = !(b_unchanged && plan.kb == split_b_key_);
    plan.both =
        plan.need_b && A == B && plan.ka.rows == plan.kb.rows && plan.ka.cols == plan.kb.cols;
    return plan;
  }

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
  // replay()'s capture stream (non-blocking) and the events that order its
  // eager runs after and before the caller's stream, made on first use.
  // Declared before the buffers: a buffer taken during a run there is given
  // back on that stream when the buffers go, so it must outlive them.
  struct Lane {
    cudaStream_t stream = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
    Lane() = default;
    Lane(const Lane&) = delete;
    Lane& operator=(const Lane&) = delete;
    ~Lane() { close(); }
    bool open() {
      if (stream != nullptr) return true;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
          cudaEventCreateWithFlags(&fork, cudaEventDisableTiming) == cudaSuccess &&
          cudaEventCreateWithFlags(&join, cudaEventDisableTiming) == cudaSuccess)
        return true;
      (void)cudaGetLastError();
      close();
      return false;
    }
    void close() {
      if (join != nullptr) (void)cudaEventDestroy(join);
      if (fork != nullptr) (void)cudaEventDestroy(fork);
      if (stream != nullptr) (void)cudaStreamDestroy(stream);
      stream = nullptr, fork = join = nullptr;
    }
  } lane_;
  int captures_ = 0;  // graphs instantiated (captures())
  PoolArray<U> X_, Y_, A_, Bm_, scale_, iterates_, dA_, dB_;
  // Per-slice partial sums of the Frobenius norms: [mats, kNsSlices, 2].
  PoolArray<double> sums_;
  NsGemms mode_;
  bool split_ = std::is_same<U, float>::value && mode_ != NsGemms::fp32;
  // STATESCAN_LACT_NS=fused: split-mode products through the fused kernels
  // where fused_fits (opt-in: passes the GPU suite, slower; README).
  bool fused_ = split_ && mode_ == NsGemms::fused;
  // Where the device runs wgmma (wgmma_device), in every split mode: the fused
  // products by ns_gemm_wgmma_kernel instead of ns_gemm_fused_kernel (op(A) = A, which is
  // every Newton-Schulz product).
  bool wgmma_ = false;
  // STATESCAN_LACT_NS=cluster: the forward's steps in ns_cluster_kernel where
  // the shape and device allow (opt-in; the backward's steps stay on the
  // split path).
  bool cluster_ = split_ && mode_ == NsGemms::cluster && ns_cluster_supported(m_, n_);
  PoolArray<bf16> cluster_gx_, cluster_ax_, cluster_ag_;  // its stage images (NsClusterParams)
  PoolArray<bf16> split_a_, split_b_;
  SplitKey split_a_key_, split_b_key_;
  SplitKScratch split_k_;  // the split-mode GEMMs' split-K partials and pointers
};

}  // namespace lact_detail
}  // namespace statescan::cuda
