// LaCT's hidden layer on the token side in one kernel for bf16 layers: the
// products h0 = x W0^T, h2 = x W2^T (and the key side's e = -v W1) of a tile
// of tokens, and the elementwise step that consumes them, with nothing but
// the bf16 results written:
//   apply:    o = gate W1^T, gate = silu(h0) h2         (x = q; gate on chip)
//   key side: z0 = lr0 e h2 silu'(h0), z2 = lr2 e silu(h0),
//             gate = lr1 silu(h0) h2                   (x = k; then G = z^T k, -v^T gate)
//             and, for Muon's two-part update, each as hi + lo bf16 terms;
//   apply_backward (below), and lact_hidden_grad_kernel for the backward's
//   update-gradient rows.
// Why: the cuBLAS path writes h = [h0 | h2] (and e) in fp32 and reads them
// back in an elementwise kernel: ~270 MB a chunk of the ~500 MB that bound the
// forward at the issue's shape (PERF_NOTES, twenty-ninth session); here h and
// e live in the MMAs' accumulators (in the backward, ~600 MB a chunk of fp32
// h, dgate, u, u1 went the same way); the apply also forms o = gate W1^T,
// gate never leaving the chip. The weight-gradient and token-gradient GEMMs
// stay on cuBLAS, reading the bf16 arrays.
//
// Shapes (lact_hidden_supported): D a multiple of 64 up to 256 (the tokens of
// a tile stay in shared memory for all of M), M a multiple of 64; a build with
// sm_90a code on a 9.0 device. Other layers, and STATESCAN_LACT_HIDDEN=cublas,
// take the cuBLAS path (lact_cuda_hidden_path reports which).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace statescan::cuda::lact_detail {

// apply_backward: h from q and dgate = d_o W1 (in the key side's place of
// e), writing gate = silu(h0) h2 and dh = [dgate h2 silu'(h0) | dgate silu(h0)]
// (the backward's apply_backward_kernel), x = q, v = d_o.
enum class LactHiddenMode { apply, key_side, apply_backward };

// One launch: a slice of n tokens per (batch row, head) pair.
struct LactHiddenParams {
  LactHiddenMode mode = LactHiddenMode::apply;
  // x = q (apply) or k (key side), v (key side): [B * local_len][H * D];
  // w: the operand weights, per pair a block [W0 | W2 | W1] (M x D, M x D,
  // D x M), 16-byte aligned.
  const __nv_bfloat16 *x = nullptr, *v = nullptr, *w = nullptr;
  // Learning rates [B, local_len, H] (key side).
  const __nv_bfloat16 *lr0 = nullptr, *lr1 = nullptr, *lr2 = nullptr;
  // Outputs, pair-major rows of the slice: z (2M: z0 | z2) and gate (M);
  // z_lo and gate_lo the low terms (key side, null when not wanted).
  __nv_bfloat16 *z = nullptr, *gate = nullptr, *z_lo = nullptr, *gate_lo = nullptr;
  // apply_backward: dh, rows of 2M (dh0 | dh2).
  __nv_bfloat16* dh = nullptr;
  // apply: o = gate W1^T, token-major as x ([B * local_len][H * D]); the
  // apply writes nothing else (gate stays on chip).
  __nv_bfloat16* o = nullptr;
  int64_t B = 0, H = 0, D = 0, M = 0, local_len = 0, t0 = 0, n = 0;
  // A programmatic dependent launch (launch.cuh's launch_kernel_dependent):
  // the CTAs load their tokens while the stream's previous kernel finishes
  // and wait for it before the weights. Only where that kernel writes none
  // of the tokens and reads none of the outputs, and the stream's previous
  // operation is that kernel (no event wait between).
  bool dependent = false;
};

// The backward's update-gradient rows in one kernel (lact_hidden_grad_kernel,
// gradients_backward_rows_kernel's outputs without its fp32 inputs): from
// the slice's k and v, the rows of W0, W2 and of the all-reduced update
// gradient's dG0, dG2 (operand type), W1^T and dG1^T ([pairs][M][D]), it
// forms h = k [W0; W2]^T, e = -v W1, u = k [dG0; dG2]^T and u1 = v dG1 in
// accumulators and writes z = [lr0 z0 | lr2 z2], gate = lr1 silu(h0) h2, de,
// dh = [dh0 | dh2] (rows of 2M, M, M, 2M) and the learning rates' gradients
// dlr0..2 ([B, local_len, H]).
// The pitches let the layer interleave them: rows [z | dh] of 4M and
// [gate | de] of 2M make dk = [z | dh] [dG0; dG2; W0; W2] and dv one GEMM each
// (with lact_hidden_pack_operands' kw = [dG0; dG2; W0; W2] per pair, w_pitch
// 4M, and t1 = [dG1^T; W1^T] per pair, t_pitch 2M).
struct LactHiddenGradParams {
  // w, dg: W0's (dG0's) first row, rows of D, W2 (dG2) M rows further;
  // w1t, dg1t: W1^T's (dG1^T's) first row, rows of D.
  const __nv_bfloat16 *k = nullptr, *v = nullptr, *w = nullptr, *dg = nullptr;
  const __nv_bfloat16 *w1t = nullptr, *dg1t = nullptr;
  const __nv_bfloat16 *lr0 = nullptr, *lr1 = nullptr, *lr2 = nullptr;
  __nv_bfloat16 *dlr0 = nullptr, *dlr1 = nullptr, *dlr2 = nullptr;
  __nv_bfloat16 *z = nullptr, *gate = nullptr, *de = nullptr, *dh = nullptr;
  int64_t B = 0, H = 0, D = 0, M = 0, local_len = 0, t0 = 0, n = 0;
  // Row pitches in elements (0: the widths 2M, M, M, 2M; else at least the
  // width and a multiple of 8, for the kernel's 16-byte stores); the rows
  // from one pair's W1^T (dG1^T) to the next (0: M); the rows from one
  // pair's W0 (dG0) to the next (0: 3M, a [W0 | W2 | W1] block; else >= 2M).
  int64_t z_ld = 0, gate_ld = 0, de_ld = 0, dh_ld = 0, t_pitch = 0, w_pitch = 0;
  bool dependent = false;  // as LactHiddenParams::dependent
};

// The gradient kernel's and the dk / dv GEMMs' weight operands of a chunk in
// one pass, from the all-reduced update gradient dG (fp32) and W's operand
// copy w (bf16), both per pair a block [W0 | W2 | W1]:
//   kw[pair] = [dG0; dG2; W0; W2]  (4 M D: rows of D),
//   t1[pair] = [dG1^T; W1^T]       (2 M D: rows of D).
// Replaces a conversion of dG, two 2D copies and two transposes (five
// launches, ~25 us a chunk at the benchmark's shape).
void lact_hidden_pack_operands(const float* dg, const __nv_bfloat16* w, int64_t pairs, int64_t M,
                               int64_t D, __nv_bfloat16* kw, __nv_bfloat16* t1,
                               cudaStream_t stream);

void lact_hidden_grad_launch(const LactHiddenGradParams& p, cudaStream_t stream);

// Whether lact_hidden_launch can run layers of this D and M here.
bool lact_hidden_supported(int64_t D, int64_t M);

// Whether the token arrays are aligned for the kernel's tensor maps.
bool lact_hidden_aligned(const void* q, const void* k, const void* v);

// Whether the kernel can address the problem: at most 65535 (batch, head)
// pairs (its grid's y) and token and weight rows within the tensor maps'
// 32-bit coordinates (B local_len tokens; pairs 3 max(M, D) weight rows).
bool lact_hidden_addressable(int64_t pairs, int64_t token_rows, int64_t D, int64_t M);

void lact_hidden_launch(const LactHiddenParams& p, cudaStream_t stream);

}  // namespace statescan::cuda::lact_detail
