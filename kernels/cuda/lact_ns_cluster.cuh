// Muon's Newton-Schulz steps for a bf16 LaCT layer in one launch: one thread
// block cluster per matrix runs every step, each CTA owning 32 rows of X (and
// of A = X X^T and B = b A + c A A), the products on bf16 tensor cores with
// two-part operands (x = hi + lo, A B ~ A_hi B_hi + A_hi B_lo + A_lo B_hi,
// fp32 accumulation: the same precision as the split path of NewtonSchulz).
//
// Why: the split path runs a step as ~9 launches (three cuBLAS GEMMs of 12
// matrices, the hi/lo splits, copies), ~45 a Newton-Schulz call, with grids
// of 24-96 CTAs that ramp up and drain at the issue's shape (12 matrices of
// 256 x 512 per chunk). Here a step is three products whose operands are
// split once, by the CTA that produced them, in its epilogue:
//   gram   A_i  = X_i X^T      X^T streamed (all rows; X_i is this CTA's rows of it)
//   poly   B_i  = b A_i + c A_i A    A_i kept in registers, A streamed
//   apply  X'_i = a X_i + B_i X      B_i from shared memory, X streamed
// The streamed operands go through global memory (L2) as *stage images*: the
// producing CTA writes its rows straight into the padded shared-memory layout
// of the pipeline stages that will read them, so every stage is one
// contiguous block, fetched by one bulk copy per CTA (each CTA copies 1/cs of
// it, multicast to the whole cluster: every byte leaves L2 once per cluster,
// not once per CTA). Two cluster barriers a step order the images (X' goes to
// the other of two buffers, so one barrier covers "X' is complete" and
// "nobody reads the old X any more"); between them a kStages-deep mbarrier
// pipeline (full: this CTA's stage landed; empty: every warp of every CTA is
// done with it) lets thread 0 run ahead, across the poly -> apply boundary
// too. The fp32 X stays where the caller keeps it: each thread reads and
// rewrites only the elements its accumulators hold, so no other thread ever
// touches them.
//
// Status (H200, 2026-12-04; STATESCAN_LACT_NS=cluster, opt-in): correct (the
// Newton-Schulz tests and the GPU LaCT suite), but on par with the split path,
// not faster: 297 us a call for the 12 matrices of the benchmark under ncu
// (five steps, 40 stages each: ~1.5 us a stage against ~0.45 of tensor work),
// LaCT forward 141.8 ms against 142.2, forward + backward 488.5 against 490.5.
// Measured on the way: per-CTA cp.async stages 369 us (waiting on L2),
// multicast stages with a cluster-scope release per stage hand-back 400 us
// (ncu: stall membar), CTA-scope 302 us, 32-bit ldmatrix addresses 297. ncu now
// finds no single hot spot: warps spin on the stage barriers (~13 % of the
// samples), the HMMAs (~20 %), cluster barriers and fences (~7 %), 64-bit
// index arithmetic and the epilogue's 4-byte scattered stores (LG throttle);
// issue slots 12 % busy. PERF_NOTES ("twenty-ninth session") has the next
// steps (wgmma from the stage images, staged 16-byte epilogue stores).
//
// Shapes (the host checks; NewtonSchulz runs other shapes on the split
// path): m in {32, 64, 128, 256} (the Gram side, m <= n), n a multiple of m,
// n <= 512: a cluster of m / 32 <= 8 CTAs (the portable size), one column
// pass of m for gram and poly, n / m passes for apply.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace statescan::cuda::lact_detail {

struct NsClusterTile {
  static constexpr int kRows = 32;      // rows of X, A, B per CTA
  static constexpr int kThreads = 256;  // 8 warps: 2 row halves x 4 column quarters
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kKc = 32;  // contraction per pipeline stage (= kRows)
  static constexpr int kStages = 4;
  // Row padding (bf16): rows 16 bytes apart mod 128 keep the eight rows of an
  // ldmatrix 8 x 8 load on distinct banks.
  static constexpr int kPad = 8;
  static constexpr int kMaxM = 256, kMaxN = 512;
  // Stage images (bf16 elements, hi plane then lo plane):
  //   gram tile t: X's columns 32 t .. 32 t + 32 of all m rows, [m][kKc + kPad];
  //   row tile:    32 rows of m columns, [kKc][m + kPad] (poly's A rows 32 kc
  //                ..; apply's X rows 32 kc .., columns of one pass).
  static constexpr int gram_plane(int m) { return m * (kKc + kPad); }
  static constexpr int row_plane(int m) { return kKc * (m + kPad); }
  static constexpr int stage_elems(int m) {
    return 2 * (gram_plane(m) > row_plane(m) ? gram_plane(m) : row_plane(m));
  }
  // Dynamic shared memory: the stages, this CTA's A_i / B_i (a row tile),
  // the 2 kStages mbarriers. (Gram's A operand, X_i, is this CTA's rows of
  // each gram tile as it streams by.)
  static constexpr size_t smem_bytes(int m) {
    return sizeof(__nv_bfloat16) * (size_t(kStages) * stage_elems(m) + 2 * size_t(row_plane(m))) +
           sizeof(uint64_t) * 2 * kStages;
  }
  // Global scratch (bf16 elements) for `mats` matrices, see NsClusterParams.
  static constexpr int64_t gram_images(int64_t mats, int m, int n) {
    return 2 * mats * (n / kKc) * 2 * int64_t(gram_plane(m));
  }
  static constexpr int64_t apply_images(int64_t mats, int m, int n) {
    return 2 * mats * (n / kKc) * 2 * int64_t(row_plane(m));
  }
  static constexpr int64_t poly_images(int64_t mats, int m) {
    return mats * (m / kKc) * 2 * int64_t(row_plane(m));
  }
};

// One launch: every matrix mat < mats (m x n, packed) of X gets `steps`
// Newton-Schulz steps in place.
struct NsClusterParams {
  float* X;         // [mats, m, n] fp32: X_0 in, X_steps out
  float* iterates;  // [steps, mats, m, n]: X_s, the input of step s; or null
  // Stage images (NsClusterTile), 16-byte aligned, sizes from its *_images:
  __nv_bfloat16* gx;  // [2 buffers, mats, n / 32 gram tiles]: X for gram
  __nv_bfloat16* ax;  // [2 buffers, mats, n / m passes, m / 32 row tiles]: X for apply
  __nv_bfloat16* ag;  // [mats, m / 32 row tiles]: A for poly
  int64_t mats;
  int m, n, steps;
  float a, b, c;  // the polynomial a X + (b A + c A A) X
};

// Whether ns_cluster_kernel can run m x n matrices (m <= n, the Gram side
// first) on the current device: the shape (above), a device of compute
// capability 9.0 or later with code built for it, enough shared memory, and a
// cluster of m / 32 CTAs that fits. Cached per (device, m, n).
bool ns_cluster_supported(int64_t m, int64_t n);

// Every step of p.mats matrices in one launch on `stream`; throws unless
// ns_cluster_supported(p.m, p.n).
void ns_cluster_launch(const NsClusterParams& p, cudaStream_t stream);

}  // namespace statescan::cuda::lact_detail
