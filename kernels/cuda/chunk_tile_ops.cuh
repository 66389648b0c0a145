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

// The inclusive cumsum of sG[0 .. 64) in place (a scalar gate's G_t over a
// chunk's rows; rows past the chunk hold zeros), by one warp: two rows per
// lane, then a shuffle scan of the pair sums. chunk_prepare16_kernel and
// chunk_intra_grad_kernel both form G this way: bitwise the same values.
__device__ __forceinline__ void warp_cumsum64(float* sG) {
  const int lane = threadIdx.x % 32;
  const float x0 = sG[2 * lane], x1 = sG[2 * lane + 1];
  float incl = x0 + x1;
#pragma unroll
  for (int m = 1; m < 32; m *= 2) {
    const float o = __shfl_up_sync(0xffffffffu, incl, m);
    if (lane >= m) incl += o;
  }
  const float excl = incl - (x0 + x1);
  sG[2 * lane] = excl + x0;
  sG[2 * lane + 1] = incl;
}

// An input's [C, D] rows (the chunk's tokens of one head: row(t) maps them
// into the [tokens, H, D] layout) into a 16-bit tile of pitch ld by cp.async
// (committed by the caller, not waited); rows past the chunk's end are zeros.
// (device_math.cuh's copy_rows_async copies a contiguous tile instead.)
template <int kThreads, int D, typename T, typename Row>
__device__ __forceinline__ void copy_input_rows_async(T* dst, int ld, const T* in, Row row, int C,
                                                      int L) {
  constexpr int kVec = 8, kRowVecs = D / kVec;  // 16-byte copies per row
  for (int idx = threadIdx.x; idx < C * kRowVecs; idx += kThreads) {
    const int t = idx / kRowVecs, j = (idx % kRowVecs) * kVec;
    if (t < L)
      cp_async16(dst + t * ld + j, in + row(t) * D + j);
    else
      *reinterpret_cast<uint4*>(dst + t * ld + j) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Two inputs' rows (v and dO; q and k) as copy_input_rows_async, then committed.
template <int kThreads, int Dv, typename T, typename Row>
__device__ __forceinline__ void copy_row_pair_async(T* sV, T* sDO, int ld, const T* v_in,
                                                    const T* do_in, Row row, int C, int L) {
  copy_input_rows_async<kThreads, Dv>(sV, ld, v_in, row, C, L);
  copy_input_rows_async<kThreads, Dv>(sDO, ld, do_in, row, C, L);
  cp_async_commit();
}

// q and k rows of a chunk held in registers: one warp per row (rows warp,
// warp + kWarps, ...: at most 64 / kWarps), each lane kPer = Dk / 32
// consecutive elements as 16-bit pairs, and the rows' L2-norm factors. Every
// row is loaded before the first is used, so the memory latencies overlap
// instead of adding up; rows past the chunk's valid end are zeros.
// chunk_prepare16_kernel keeps them for all its phases (each used to re-read
// q and k from global memory, a third of its instructions in index math);
// intra_load_qk stores them as operand copies.
template <int kWarps, int Dk, typename T>
struct QKRows {
  static constexpr int kPer = Dk / 32, kRows = 64 / kWarps, kPairs = kPer / 2;
  static_assert(kPer % 2 == 0, "16-bit pairs per lane");
  uint32_t wq[kRows][kPairs], wk[kRows][kPairs];
  float rq[kRows], rk[kRows];

  __device__ __forceinline__ static int row_of(int i) { return threadIdx.x / 32 + i * kWarps; }
  __device__ __forceinline__ static int col_of(int e) { return (threadIdx.x % 32) * kPer + 2 * e; }

  template <typename Row>
  __device__ __forceinline__ void load(const T* q_in, const T* k_in, Row row, int C, int L) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int t = row_of(i);
#pragma unroll
      for (int e = 0; e < kPairs; ++e) wq[i][e] = wk[i][e] = 0u;
      if (t < L && t < C) {
        if constexpr (kPer == 4) {
          const uint2 a = *reinterpret_cast<const uint2*>(q_in + row(t) * Dk + lane * kPer);
          const uint2 b = *reinterpret_cast<const uint2*>(k_in + row(t) * Dk + lane * kPer);
          wq[i][0] = a.x, wq[i][1] = a.y, wk[i][0] = b.x, wk[i][1] = b.y;
        } else {
#pragma unroll
          for (int e = 0; e < kPairs; ++e) {
            wq[i][e] = reinterpret_cast<const uint32_t*>(q_in + row(t) * Dk + lane * kPer)[e];
            wk[i][e] = reinterpret_cast<const uint32_t*>(k_in + row(t) * Dk + lane * kPer)[e];
          }
        }
      }
    }
  }
  // rq, rk = 1 / sqrt(|x|^2 + 1e-6) with the norm (as the forward), else 1.
  template <bool kL2Norm>
  __device__ __forceinline__ void normalise() {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float qq = 0.f, kk = 0.f;
      if constexpr (kL2Norm) {
#pragma unroll
        for (int e = 0; e < kPairs; ++e) {
          const float2 a = unpack2<T>(wq[i][e]), b = unpack2<T>(wk[i][e]);
          qq += a.x * a.x;  // element by element, in order (as before: bitwise the same)
          qq += a.y * a.y;
          kk += b.x * b.x;
          kk += b.y * b.y;
        }
        rq[i] = 1.f / sqrtf(warp_sum(qq) + 1e-6f);
        rk[i] = 1.f / sqrtf(warp_sum(kk) + 1e-6f);
      } else {
        rq[i] = rk[i] = 1.f;
      }
    }
  }
  // The exact normalised pairs (the 16-bit input times the fp32 row factor).
  __device__ __forceinline__ float2 q(int i, int e) const {
    const float2 x = unpack2<T>(wq[i][e]);
    return make_float2(x.x * rq[i], x.y * rq[i]);
  }
  __device__ __forceinline__ float2 k(int i, int e) const {
    const float2 x = unpack2<T>(wk[i][e]);
    return make_float2(x.x * rk[i], x.y * rk[i]);
  }
  // Calls f(t, i, e, d) for each of this thread's pairs (chunk row t < C,
  // columns d and d + 1; register row i, pair e).
  template <typename F>
  __device__ __forceinline__ static void for_each_pair(int C, F&& f) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int t = row_of(i);
      if (t >= C) break;
#pragma unroll
      for (int e = 0; e < kPairs; ++e) f(t, i, e, col_of(e));
    }
  }
  // The row factors into sRq, sRk (lane 0 of each row's warp).
  __device__ __forceinline__ void store_factors(float* sRq, float* sRk, int C) const {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      if (threadIdx.x % 32 == 0 && row_of(i) < C) sRq[row_of(i)] = rq[i], sRk[row_of(i)] = rk[i];
  }
};

// q, k rows loaded by x (QKRows::load), normalised (x / sqrt(|x|^2 + 1e-6),
// as the forward) into 16-bit operand copies, one warp per row; the row
// factors into sRq, sRk (1 without the norm). Rows past the chunk's end are
// zeros. Split from intra_load_qk so that a kernel can issue the loads early
// and store the copies once their slots are free.
template <int kWarps, int Dk, bool kL2Norm, typename T>
__device__ __forceinline__ void intra_store_qk(QKRows<kWarps, Dk, T>& x, T* sQ, T* sK, int ld,
                                               float* sRq, float* sRk, int C) {
  x.template normalise<kL2Norm>();
  x.for_each_pair(C, [&](int t, int i, int e, int d) {
    const float2 a = x.q(i, e), b = x.k(i, e);
    *reinterpret_cast<uint32_t*>(sQ + t * ld + d) = pack2<T>(a.x, a.y);
    *reinterpret_cast<uint32_t*>(sK + t * ld + d) = pack2<T>(b.x, b.y);
  });
  x.store_factors(sRq, sRk, C);
}

// Both halves at once.
template <int kWarps, int Dk, bool kL2Norm, typename T, typename Row>
__device__ __forceinline__ void intra_load_qk(T* sQ, T* sK, int ld, float* sRq, float* sRk,
                                              const T* q_in, const T* k_in, Row row, int C, int L) {
  QKRows<kWarps, Dk, T> x;
  x.load(q_in, k_in, row, C, L);
  intra_store_qk<kWarps, Dk, kL2Norm>(x, sQ, sK, ld, sRq, sRk, C);
}

// Two adjacent fp32 values (8-byte aligned) as one load.
__device__ __forceinline__ float2 load_pair(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}

// A 16-bit operand copy's elements (r, col), (r, col + 1) in shared memory.
template <typename T>
__device__ __forceinline__ float2 operand_pair(const T* x, int ld, int r, int col) {
  return unpack2<T>(*reinterpret_cast<const uint32_t*>(x + r * ld + col));
}

// Row r's normalised input at columns col, col + 1, exact (the 16-bit input
// times the fp32 row factor, not the rounded operand copy), from a shared
// copy of the raw input rows (pitch ld).
template <typename T>
__device__ __forceinline__ float2 exact_pair_shared(const T* x, int ld, const float* sR, int r,
                                                    int col) {
  const float2 v = operand_pair(x, ld, r, col);
  return make_float2(v.x * sR[r], v.y * sR[r]);
}

// T = (I + B)^{-1}, B = diag(beta) KK (KK strictly lower, fp32, in fKK's
// lower triangle), blockwise over 16-row blocks in two calls:
//  1. intra_solve_t_diagonal: the diagonal blocks T_II by forward
//     substitution, one thread per column (threads 0 .. C-1; a chain of at
//     most 15 steps where the whole-chunk substitution had 63);
//  2. intra_solve_t_rows: block rows I = 1 .. nb-1 in turn,
//     T_IJ = -T_II sum_{K=J}^{I-1} B_IK T_KJ for J < I, on the tensor cores
//     (intra_solve_t_blocks: by every warp, then the 16-bit copy hT and a
//     barrier).
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

// T's entry (t, c) once solved: the strictly lower part from its transposed
// place in fKK's upper triangle, 1 on the diagonal, 0 above it.
__device__ __forceinline__ float intra_t_entry(const float* fKK, int ldf, int t, int c) {
  const float x = fKK[c * ldf + t];
  return t > c ? x : (t == c ? 1.f : 0.f);
}

// Block rows I = 1 .. nb-1 of T (the diagonal blocks solved and visible) by
// every warp of the block, a barrier between rounds and none after the last
// (the caller's follows). Block row I (t0 = 16 I) takes one warp per 8-column group
// [n0, n0 + 8) of columns 0 .. t0 - 1 (2 I warps; the others wait at the
// barrier):
//   (a) Y = diag(beta_I) KK[I rows, n0 .. t0) T[n0 .. t0, n0 .. n0 + 8)
//       (T is lower triangular with a unit diagonal: rows below n0 add 0);
//   (b) T[I rows, group] = -T_II Y, with Y passed from the accumulator
//       layout to the B operand through the group's own (not yet written) T
//       slots, so (a) and (b) need no barrier between them, only one per row.
// fp32 operands on tf32 tensor cores, three products each (~fp32: the
// CUDA-core version's ~40 K shared-memory multiply-adds per chunk, their
// loads and nine barriers were the prepare kernel's largest cost, ncu
// 2026-12-02). Operands of T and T_II outside their lower triangle are
// selected (0 above, 1 on the diagonal), never multiplied.
template <int kWarps>
__device__ __forceinline__ void intra_solve_t_rows(float* fKK, int ldf, const float* sBeta,
                                                   int nb) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, i4 = lane & 3;
  auto tv = [&](int t, int c) { return intra_t_entry(fKK, ldf, t, c); };
  for (int I = 1; I < nb; ++I) {
    const int t0 = 16 * I;
    for (int grp = warp; grp < 2 * I; grp += kWarps) {
      const int n0 = 8 * grp;
      float y[4] = {0.f, 0.f, 0.f, 0.f};
      for (int r0 = n0; r0 < t0; r0 += 8) {  // (a)
        const float* kk = fKK + (t0 + g) * ldf + r0 + i4;
        const float a[4] = {kk[0], kk[8 * ldf], kk[4], kk[8 * ldf + 4]};
        const float b[2] = {tv(r0 + i4, n0 + g), tv(r0 + i4 + 4, n0 + g)};
        mma_m16n8k8_tf32x3(y, a, b);
      }
      const float b0 = sBeta[t0 + g], b8 = sBeta[t0 + g + 8];
      // Y's element (m, c) into T's slot fKK[c][t0 + m].
      float* slot = fKK + (n0 + 2 * i4) * ldf + t0 + g;
      slot[0] = b0 * y[0];
      slot[ldf] = b0 * y[1];
      slot[8] = b8 * y[2];
      slot[ldf + 8] = b8 * y[3];
      __syncwarp();
      float z[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int k0 = 0; k0 < 16; k0 += 8) {  // (b)
        const float a[4] = {tv(t0 + g, t0 + k0 + i4), tv(t0 + g + 8, t0 + k0 + i4),
                            tv(t0 + g, t0 + k0 + i4 + 4), tv(t0 + g + 8, t0 + k0 + i4 + 4)};
        const float* yc = fKK + (n0 + g) * ldf + t0 + k0 + i4;
        const float b[2] = {yc[0], yc[4]};
        mma_m16n8k8_tf32x3(z, a, b);
      }
      __syncwarp();  // every lane's Y read before its slots take T
      slot[0] = -z[0];
      slot[ldf] = -z[1];
      slot[8] = -z[2];
      slot[ldf + 8] = -z[3];
    }
    if (I + 1 < nb) __syncthreads();
  }
}

// The block rows by every warp, then T's 16-bit copy hT (zeros above the
// diagonal) and a barrier. With kLo, hT_lo receives T's rounding T - hT
// (16-bit): hT + hT_lo is T to ~16 bits, for products that take T as two
// operands (chunk_prepare16_kernel with vector gates).
template <int kThreads, bool kLo = false, typename T>
__device__ __forceinline__ void intra_solve_t_blocks(T* hT, int ldc, float* fKK, int ldf,
                                                     const float* sBeta, int nb,
                                                     T* hT_lo = nullptr) {
  intra_solve_t_rows<kThreads / 32>(fKK, ldf, sBeta, nb);
  __syncthreads();
  const int C = 16 * nb;
  for (int idx = threadIdx.x; idx < C * C; idx += kThreads) {
    const int t = idx / C, c = idx % C;
    const float x = intra_t_entry(fKK, ldf, t, c);
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
