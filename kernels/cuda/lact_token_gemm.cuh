// LaCT's token-contracted products for bf16 layers in one kernel: per
// (batch row, head) pair p of a slice of k tokens,
//   C_p[i][j] = alpha sum_t A_p[t][i] B_p[t][j] + beta C_p[i][j]   (C fp32),
// A_p: k x m, B_p: k x n, both token-major (row t of pair p at
// data + p stride + t ld): the fast-weight gradients [G0; G2] = [z0 | z2]^T k,
// G1 = -v^T gate, and the backward's dW terms (dh^T k, v^T de, dh^T q,
// do^T gate).
// Why: their outputs are small (m x n = 1024 x 256 or 256 x 512 a pair) and
// their contraction long (4096 tokens at the benchmark's shape). cuBLAS runs
// them as 64 x 128 or 64 x 64 tiles, one per SM, at 300-440 TFLOP/s: each
// tile re-reads its operands from L2 (~200 MB for [G0; G2]'s 8.6 GFLOP),
// ~100 us a chunk of 410. Here a CTA computes a 128 x BN tile (BN 256 where
// n allows, else 128) over 1 / S of the tokens, with S the CTAs of a cluster,
// and the cluster sums its S partial tiles through distributed shared memory
// in a fixed order (deterministic; no fp32 partials in global memory, no
// second launch).
// Measured (H200, benchmark shape, ncu at locked clocks, 2026-12-04): 25-26 us
// a launch (128 x 128 tiles, 2-CTA clusters, chosen by the plan) against
// cuBLAS's 19.7 ([G0; G2]) and 14.4 (G1); the tensor pipe ~50 % busy with
// ~75 % of cycles without an eligible warp; a third of DRAM bandwidth with
// ncu's flushed caches. The layer's forward + backward: 105.9 ms against
// 97.1 on cuBLAS. Hence opt-in (below) until its main loop is faster
// (PERF_NOTES, thirty-second session).
//
// Shapes (lact_token_gemm_fits): m a multiple of 128, n of 128; rows (ld) and
// pairs (stride) of A and B 16-byte aligned; C's rows and pairs in whole
// float4s; a build with sm_90a code on a 9.0 device. The layer takes cuBLAS
// elsewhere, and everywhere unless STATESCAN_LACT_TOKEN_GEMM=fused.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace statescan::cuda::lact_detail {

// One operand: element (t, col) of pair p at data[p stride + t ld + col].
struct LactTokenOperand {
  const __nv_bfloat16* data = nullptr;
  int64_t ld = 0, stride = 0;
};

struct LactTokenGemmParams {
  LactTokenOperand a, b;
  float* c = nullptr;  // C_p[i][j] at c[p c_stride + i ldc + j]
  int64_t ldc = 0, c_stride = 0;
  int64_t pairs = 0, m = 0, n = 0, k = 0;
  float alpha = 1.f, beta = 0.f;  // beta 0: C is not read (it may hold NaN)
};

// STATESCAN_LACT_TOKEN_GEMM: "fused" lets bf16 layers take lact_token_gemm
// where it fits; unset or "cublas" keeps them on cuBLAS (opt-in while it is
// slower: README, LaCT); read once per process, any other value an error
// naming it.
bool token_gemm_requested();

// Whether lact_token_gemm can run p on the current device (shapes, alignment,
// the build's and the device's wgmma support).
bool lact_token_gemm_fits(const LactTokenGemmParams& p);

// C = alpha A^T B + beta C for every pair, ordered on `stream`; throws
// statescan::Error naming the argument where lact_token_gemm_fits fails.
void lact_token_gemm(const LactTokenGemmParams& p, cudaStream_t stream);

// Calls of lact_token_gemm in this process so far: the layer takes it only
// where it fits and falls back to cuBLAS silently otherwise (by design: the
// fit is per GEMM), so a test of the opt-in path checks that it ran.
int64_t lact_token_gemm_calls();

}  // namespace statescan::cuda::lact_detail
