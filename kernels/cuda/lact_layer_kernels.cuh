// The LaCT GPU layer's elementwise kernels (lact_cuda_impl.cuh): the weight
// state (loading, row norms, the renormalised step and its backward, momentum)
// and the token rows of the cuBLAS hidden-layer path.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/lact_common.cuh"
#include "kernels/cuda/lact_math.cuh"

namespace statescan::cuda {
namespace lact_detail {

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
__device__ __forceinline__ void row_norm(int64_t row_index, int lane, const float* w, int64_t M,
                                         int64_t D, float* norms) {
  const int64_t blk = row_index / (2 * M + D), r = row_index % (2 * M + D);
  const RowPlace rp = row_place(r, M, D);
  const float* row = w + blk * 3 * M * D + rp.offset;
  float s = 0;
  for (int64_t j = lane; j < rp.cols; j += 32) s += row[j] * row[j];
  s = warp_sum(s);
  if (lane == 0) norms[row_index] = sqrtf(s);
}

static __global__ void row_norms_kernel(const float* w, int64_t blocks, int64_t M, int64_t D,
                                        float* norms) {
  for_each_warp_row(blocks * (2 * M + D),
                    [&](int64_t row, int lane) { row_norm(row, lane, w, M, D, norms); });
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
__device__ __forceinline__ void step_renorm_row(int64_t row_index, int lane, const float* W_in,
                                                float* W_out, const float* step, const float* norm0,
                                                int64_t H, int64_t M, int64_t D, bool renorm,
                                                T* op) {
  const int64_t nr = 2 * M + D;
  const int64_t pair = row_index / nr, r = row_index % nr;
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

template <typename T>
__global__ void step_renorm_kernel(const float* W_in, float* W_out, const float* step,
                                   const float* norm0, int64_t pairs, int64_t H, int64_t M,
                                   int64_t D, bool renorm, T* op) {
  for_each_warp_row(pairs * (2 * M + D), [&](int64_t row, int lane) {
    step_renorm_row<T>(row, lane, W_in, W_out, step, norm0, H, M, D, renorm, op);
  });
}

// Backward of step_renorm for one chunk: x = W - step, dy = dW (adjoint of
// the new weights). Writes dW <- dx (the direct path), d_step = -dx, and adds
// the renorm target's adjoint x.dy / den to d_norm0 [pairs, 2M + D]. With
// w_op, also W's GEMM operand copy (the pass operand_weights would make).
template <typename T>
__device__ __forceinline__ void step_renorm_backward_row(int64_t row_index, int lane,
                                                         const float* W, const float* step,
                                                         const float* norm0, int64_t H, int64_t M,
                                                         int64_t D, bool renorm, float* dW,
                                                         float* d_step, float* d_norm0, T* w_op) {
  const int64_t nr = 2 * M + D;
  const int64_t pair = row_index / nr, r = row_index % nr;
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

template <typename T>
__global__ void step_renorm_backward_kernel(const float* W, const float* step, const float* norm0,
                                            int64_t pairs, int64_t H, int64_t M, int64_t D,
                                            bool renorm, float* dW, float* d_step, float* d_norm0,
                                            T* w_op) {
  for_each_warp_row(pairs * (2 * M + D), [&](int64_t row, int lane) {
    step_renorm_backward_row<T>(row, lane, W, step, norm0, H, M, D, renorm, dW, d_step, d_norm0,
                                w_op);
  });
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

// Backward of the update gradient, a block per token row (pair, t) at a time: from
// h = [h0 | h2], e, u = [u0 | u2] = k [dG0; dG2]^T and u1 = dG1^T v (fp32)
// writes dlr0..2 of the token and the operands z = [z0 | z2], gate (lr-
// weighted, for dk and dv), de and dh = [dh0 | dh2] (for dW, dk, dv).
// Rows of 2M: h, u, z, dh; rows of M: e, u1, gate, de.
template <typename T>
__global__ void gradients_backward_rows_kernel(const float* h, const float* e_in, const float* u,
                                               const float* u1, const T* lr0, const T* lr1,
                                               const T* lr2, int64_t rows, int64_t n, int64_t M,
                                               int64_t H, int64_t local_len, int64_t t0, T* dlr0,
                                               T* dlr1, T* dlr2, T* z_out, T* gate_out, T* de_out,
                                               T* dh_out) {
  __shared__ float red[3][32];
  // Blocks stride over the rows (row_grid caps the grid), as the other row
  // kernels do: one block a row overflowed grid.x past 2^31 - 1 rows.
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {  // pair * n + t
    const int64_t pair = row / n, t = row % n;
    const float l0 = lr_at(lr0, pair, t, H, local_len, t0);
    const float l1 = lr_at(lr1, pair, t, H, local_len, t0);
    const float l2 = lr_at(lr2, pair, t, H, local_len, t0);
    float s0 = 0, s1 = 0, s2 = 0;
    for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
      const int64_t i = row * M + j, i0 = row * 2 * M + j, i2 = i0 + M;
      const GradRowsOut g = grad_rows_element(SiluF(h[i0]), h[i2], e_in[i], u[i0], u[i2], u1[i], l0,
                                              l1, l2, s0, s1, s2);
      z_out[i0] = from_float<T>(g.z0);
      z_out[i2] = from_float<T>(g.z2);
      gate_out[i] = from_float<T>(g.gate);
      de_out[i] = from_float<T>(g.de);
      dh_out[i2] = from_float<T>(g.dh2);
      dh_out[i0] = from_float<T>(g.dh0);
    }
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
    __syncthreads();  // red is the next row's
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

}  // namespace lact_detail
}  // namespace statescan::cuda
