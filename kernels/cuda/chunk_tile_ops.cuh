// Warp-level building blocks of the 16-bit chunk kernels that keep their
// operands in shared memory and their accumulators in registers
// (chunk_prepare16_kernel in the forward; chunk_intra_grad_kernel and
// chunk_intra_grad_vector_kernel in the backward): row loads into 16-bit
// operand copies, the blockwise UT inverse T = (I + diag(beta) KK)^{-1}, and
// the walk over a chunk's 16 x 16 slabs.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/warp_mma.cuh"

namespace statescan::cuda::detail {

// `row(t)` in the helpers below: the global row (token * H + head) of the
// chunk's row t.

// Sum over the four lanes of a quad (the lanes holding one accumulator row).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// v and dO rows into 16-bit tiles by cp.async (committed, not waited); rows
// past the chunk's end are zeros.
template <int kThreads, int Dv, typename T, typename Row>
__device__ __forceinline__ void intra_load_v_do(T* sV, T* sDO, int ld, const T* v_in,
                                                const T* do_in, Row row, int C, int L) {
  constexpr int kVec = 8, kRowVecs = Dv / kVec;  // 16-byte copies per row
  for (int idx = threadIdx.x; idx < C * kRowVecs; idx += kThreads) {
    const int t = idx / kRowVecs, j = (idx % kRowVecs) * kVec;
    if (t < L) {
      cp_async16(sV + t * ld + j, v_in + row(t) * Dv + j);
      cp_async16(sDO + t * ld + j, do_in + row(t) * Dv + j);
    } else {
      *reinterpret_cast<uint4*>(sV + t * ld + j) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(sDO + t * ld + j) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  cp_async_commit();
}

// q, k normalised (x / sqrt(|x|^2 + 1e-6), as the forward) into 16-bit
// operand copies, one warp per row; the row factors into sRq, sRk (1 without
// the norm). Rows past the chunk's end are zeros. A warp's rows (at most
// 64 / kWarps) are all loaded before the first is used, so their memory
// latencies overlap instead of adding up.
template <int kWarps, int Dk, bool kL2Norm, typename T, typename Row>
__device__ __forceinline__ void intra_load_qk(T* sQ, T* sK, int ld, float* sRq, float* sRk,
                                              const T* q_in, const T* k_in, Row row, int C, int L) {
  constexpr int kPer = Dk / 32, kRows = 64 / kWarps;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  static_assert(kPer % 2 == 0, "16-bit pairs per lane");
  // A lane's kPer consecutive elements of each row, as 32-bit words.
  uint32_t wq[kRows][kPer / 2], wk[kRows][kPer / 2];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int t = warp + i * kWarps;
#pragma unroll
    for (int e = 0; e < kPer / 2; ++e) wq[i][e] = wk[i][e] = 0u;
    if (t < L && t < C) {
      if constexpr (kPer == 4) {
        const uint2 a = *reinterpret_cast<const uint2*>(q_in + row(t) * Dk + lane * kPer);
        const uint2 b = *reinterpret_cast<const uint2*>(k_in + row(t) * Dk + lane * kPer);
        wq[i][0] = a.x, wq[i][1] = a.y, wk[i][0] = b.x, wk[i][1] = b.y;
      } else {
#pragma unroll
        for (int e = 0; e < kPer / 2; ++e) {
          wq[i][e] = reinterpret_cast<const uint32_t*>(q_in + row(t) * Dk + lane * kPer)[e];
          wk[i][e] = reinterpret_cast<const uint32_t*>(k_in + row(t) * Dk + lane * kPer)[e];
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int t = warp + i * kWarps;
    if (t >= C) break;
    float xq[kPer], xk[kPer], qq = 0.f, kk = 0.f;
#pragma unroll
    for (int e = 0; e < kPer / 2; ++e) {
      const float2 a = unpack2<T>(wq[i][e]), b = unpack2<T>(wk[i][e]);
      xq[2 * e] = a.x, xq[2 * e + 1] = a.y, xk[2 * e] = b.x, xk[2 * e + 1] = b.y;
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      qq += xq[e] * xq[e];
      kk += xk[e] * xk[e];
    }
    float rq = 1.f, rk = 1.f;
    if constexpr (kL2Norm) {
      rq = 1.f / sqrtf(warp_sum(qq) + 1e-6f);
      rk = 1.f / sqrtf(warp_sum(kk) + 1e-6f);
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int d = lane * kPer + e;
      sQ[t * ld + d] = from_float<T>(xq[e] * rq);
      sK[t * ld + d] = from_float<T>(xk[e] * rk);
    }
    if (lane == 0) {
      sRq[t] = rq;
      sRk[t] = rk;
    }
  }
}

// Two adjacent fp32 values (8-byte aligned) as one load.
__device__ __forceinline__ float2 load_pair(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}

// Row r's normalised input at columns col, col + 1 (exact: the 16-bit input
// times the fp32 row factor, not the rounded operand copy).
template <int Dk, typename T, typename Row>
__device__ __forceinline__ float2 exact_pair(const T* x_in, const float* sR, Row row, int r,
                                             int col) {
  const float2 x = unpack2<T>(*reinterpret_cast<const uint32_t*>(x_in + row(r) * Dk + col));
  return make_float2(x.x * sR[r], x.y * sR[r]);
}

// A 16-bit operand copy's elements (r, col), (r, col + 1) in shared memory.
template <typename T>
__device__ __forceinline__ float2 operand_pair(const T* x, int ld, int r, int col) {
  return unpack2<T>(*reinterpret_cast<const uint32_t*>(x + r * ld + col));
}

// T = (I + B)^{-1}, B = diag(beta) KK (KK strictly lower, fp32, in fKK's
// lower triangle), blockwise over 16-row blocks in two calls:
//  1. intra_solve_t_diagonal: the diagonal blocks T_II by forward
//     substitution, one thread per column (threads 0 .. C-1; a chain of at
//     most 15 steps where the whole-chunk substitution had 63);
//  2. intra_solve_t_blocks: block rows I = 1 .. nb-1 in turn,
//     T_IJ = -T_II sum_{K=J}^{I-1} B_IK T_KJ for J < I, every thread, fp32 on
//     the CUDA cores (about 40 K multiply-adds at C = 64); then the 16-bit copy
//     hT and a barrier.
// T's strictly lower part lives transposed in fKK's unused upper triangle
// (fKK[s * ldf + t] = T_ts for t > s; T's diagonal is 1), so KK stays for
// its later readers and no more shared memory is needed. Every thread of the
// block calls both (with a barrier between them: stage 2 reads stage 1).
template <int kMC>
__device__ __forceinline__ void intra_solve_t_diagonal(float* fKK, int ldf, const float* sBeta,
                                                       int C) {
  const int s = threadIdx.x;
  if (s >= C) return;
  const int b0 = s & ~15;  // column s of the block starting at row b0
  float x[16];
#pragma unroll
  for (int u = 0; u < 16; ++u) {
    const int t = b0 + u;
    float part = 0.f;
#pragma unroll
    for (int r = 0; r < u; ++r) part += fKK[t * ldf + b0 + r] * x[r];
    x[u] = (t == s ? 1.f : 0.f) - sBeta[t] * part;  // 0 above the diagonal (t < s)
    if (t > s) fKK[s * ldf + t] = x[u];
  }
}

// With kLo, hT_lo receives T's rounding T - hT (16-bit): hT + hT_lo is T to
// ~16 bits, for products that take T as two operands (chunk_prepare16_kernel).
template <int kThreads, bool kLo = false, typename T>
__device__ __forceinline__ void intra_solve_t_blocks(T* hT, int ldc, float* fKK, int ldf,
                                                     const float* sBeta, int nb,
                                                     T* hT_lo = nullptr) {
  constexpr int kMaxOut = (3 * 256 + kThreads - 1) / kThreads;  // outputs per thread, I <= 3
  auto tv = [&](int t, int c) -> float {                        // T_tc (T_tc for t > c: fKK[c][t])
    return t == c ? 1.f : (t > c ? fKK[c * ldf + t] : 0.f);
  };
  for (int I = 1; I < nb; ++I) {
    const int n = I * 256, t0 = 16 * I;
    // (a) Y_IJ = diag(beta) sum_{K=J}^{I-1} KK_IK T_KJ into T_IJ's (unread)
    // slots: T_rc is 1 at r = c, 0 above, fKK[c][r] below (no branch per term).
    for (int idx = threadIdx.x; idx < n; idx += kThreads) {
      const int t = t0 + (idx % 256) / 16, c = 16 * (idx / 256) + idx % 16;
      const float* kk = fKK + t * ldf;
      const float* tc = fKK + c * ldf;
      float y = kk[c];
      for (int r = c + 1; r < t0; ++r) y += kk[r] * tc[r];
      fKK[c * ldf + t] = sBeta[t] * y;
    }
    __syncthreads();
    // (b) T_IJ = -T_II Y_IJ (all of Y read before any slot is overwritten).
    float out[kMaxOut];
#pragma unroll
    for (int k = 0; k < kMaxOut; ++k) {
      const int idx = threadIdx.x + k * kThreads;
      out[k] = 0.f;
      if (idx < n) {
        const int m = (idx % 256) / 16, c = 16 * (idx / 256) + idx % 16;
        const float* y = fKK + c * ldf + t0;  // Y_IJ's column c
        float x = y[m];                       // T_II's diagonal is 1
        for (int m2 = 0; m2 < m; ++m2) x += fKK[(t0 + m2) * ldf + t0 + m] * y[m2];
        out[k] = -x;
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kMaxOut; ++k) {
      const int idx = threadIdx.x + k * kThreads;
      if (idx < n) fKK[(16 * (idx / 256) + idx % 16) * ldf + t0 + (idx % 256) / 16] = out[k];
    }
    __syncthreads();
  }
  const int C = 16 * nb;
  for (int idx = threadIdx.x; idx < C * C; idx += kThreads) {
    const int t = idx / C, c = idx % C;
    const float x = tv(t, c);
    const T hi = from_float<T>(x);
    hT[t * ldc + c] = hi;
    if constexpr (kLo) hT_lo[t * ldc + c] = from_float<T>(x - to_float(hi));
  }
  __syncthreads();
}

// The 16 x 16 slabs (I, J) of a C x C product over the block's warps: the
// lower triangle J <= I, or all of them.
template <int kWarps, typename Body>
__device__ __forceinline__ void for_lower_slabs(int nb, Body&& body) {
  for (int sl = threadIdx.x / 32; sl < nb * (nb + 1) / 2; sl += kWarps) {
    int I = 0, rest = sl;
    while (rest > I) rest -= ++I;
    body(I, rest);
  }
}
template <int kWarps, typename Body>
__device__ __forceinline__ void for_all_slabs(int nb, Body&& body) {
  for (int sl = threadIdx.x / 32; sl < nb * nb; sl += kWarps) body(sl / nb, sl % nb);
}

}  // namespace statescan::cuda::detail
