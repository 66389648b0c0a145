// CUDA pieces of context parallelism (DESIGN §5) that parallel/ builds on:
//
//   PreparedForward  one chunkwise forward split around the exchange: the
//                    state-independent prepare stage runs once, the summary
//                    (M, E) of the shard reads its tiles, and after the
//                    exchange the scan + output stages run from the true
//                    incoming state with the same workspace.
//   affine-map kernels  apply S <- M S + E (full or diagonal M), compose two
//                    maps, transpose M, count non-finite elements: what the
//                    device exchange and the CP mixer's checks need. fp32.
//
// All pointers are device pointers; work is queued on the given stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "core/dtype.h"
#include "kernels/mixer_params.h"

namespace statescan::cuda {

// How the summary computes the delta rules' (M, E):
//   scan      E: the forward's own boundary scan (outputs off); M: the same
//             scan run from S = I with U = 0 (both sequential over chunks);
//   products  each chunk's map (diag(d) - K_^T W, K_^T U) by batched GEMMs,
//             then a log-depth tree of batched GEMMs composing neighbours
//             (cuBLAS; parallel over chunks; TF32 tree for 16-bit inputs,
//             fp32 for fp32 inputs). Additive rules always use the scan for E.
// Process-wide; the default comes from STATESCAN_CP_LINEAR=scan|products
// (unset: scan).
enum class LinearPart { scan, products };
LinearPart summary_linear_part();
void set_summary_linear_part(LinearPart part);

// How the summary runs its scans (E, M's, the first segments' maps), where
// the per-head kernel applies (delta rules, 16-bit, Dk = Dv = 128, chunk 64,
// sm_90a):
//   blocks     the forward's column-block scans, the GPU shared in halves
//              between E and the linear part;
//   per_head   E and M's scans (final state only) as one CTA per head and
//              segment holding the whole state, its products as warpgroup
//              MMAs (chunk_scan_wgmma.cuh): a longer step (~1.5 us against
//              ~1.0) on far fewer multiprocessors;
//   two_level  every row (one segment each; else as automatic) cut into
//              summary_pieces() runs of chunks, each run's E (from zero) and
//              map (from the identity, with its H for the first segments'
//              maps) by the per-head kernel, all runs at once, then composed
//              in order per row (fp32 map products, chain_maps);
//   automatic  two_level where it applies; else per_head where the column
//              blocks need more than one wave even at 32 columns
//              (heads x segments x Dv / 32 > SMs), else blocks.
// Elsewhere all mean `blocks`. Process-wide; the default comes from
// STATESCAN_SUMMARY_SCAN=auto|per-head|blocks|two-level (unset: auto).
enum class SummaryScan { automatic, per_head, blocks, two_level };
SummaryScan summary_scan();
void set_summary_scan(SummaryScan scan);

// The runs per row of the two-level summary of `p` (1 where it does not
// apply), with E computed beside the maps (with_E) or not: what
// FirstSegmentMaps::pieces must be for PreparedForward::summary.
int64_t summary_pieces(const MixerParams& p, bool with_E);

// Whether PreparedForward's prepare stage reads all of q, k, v, g and beta
// and can check them for NaN/Inf (its `nonfinite`): 16-bit inputs through
// chunk_prepare16_kernel, i.e. not fp32, not linear attention's raw path (no
// prepare stage: cuda::reads_inputs_directly), not STATESCAN_PREPARE=fp32.
bool prepare_checks_finite(const MixerParams& p);

// PreparedBackward's adopting constructor takes a PreparedForward's
// workspace through this (summary.cu; AdoptedForward in forward_plan.cuh).
class PreparedForward;

// What a CP rank that continues sequences from the previous rank keeps from
// its forward so that its backward needs no pre-pass (DESIGN §5). For the
// FIRST segment of every batch row (the whole row without cu_seqlens,
// segment 0 with it), whose outputs are affine in the state S0 entering it:
//   P  [rows, H, Dk, Dk] fp32: the product of its chunk maps (its final state
//      is P S0 + what it adds itself);
//   H  [B, L, H, Dk] in the input dtype, the layout of q: per token,
//      H_t = d o_t / d S0, so that o_t = H_t S0 + (terms without S0).
// Then the gradient reaching S0 from that segment's outputs and final state,
// what the pre-pass's reverse scan computed, is one GEMM:
//   dS0 = sum_t H_t^T dO_t + P^T dS_end        (first_segment_state_grad).
// Both come from one scan of the identity with U = 0 (as M's, see
// summary()) with the output stage on: its outputs are H, its final state P.
// Tokens of H outside the first segments are left unwritten.
// Two-level summary (pieces = summary_pieces(p, E != null) > 1): each row's
// chunks in `pieces` runs, each scanned from its own identity, so H holds
// every run's own outputs and piece_P [rows, pieces, H, Dk, Dk] fp32 their
// maps (P is still their product); first_segment_state_grad composes them.
struct FirstSegmentMaps {
  float* P = nullptr;
  void* H = nullptr;
  float* piece_P = nullptr;
  int64_t pieces = 1;
};

namespace detail {
struct AdoptedForward;
// Runs `check` on the forward's problem and stream, then takes its workspace:
// a check that throws leaves the forward whole (usable, and freed by it).
AdoptedForward adopt(PreparedForward& forward,
                     const std::function<void(const MixerParams&, cudaStream_t)>& check);
}  // namespace detail

// Bits of PreparedForward's `nonfinite` word, one per input the prepare
// stage checks: a NaN or Inf, and for g also a log gate > 0 (DESIGN §2).
enum NonFiniteInput : unsigned {
  kNonFiniteQ = 1u,
  kNonFiniteK = 2u,
  kNonFiniteV = 4u,
  kNonFiniteG = 8u,
  kNonFiniteBeta = 16u,
};

class PreparedForward {
 public:
  // Validates `p` (device pointers, cu_seqlens included; synchronises `stream`
  // once in packed mode to read it), takes the workspace from statescan's
  // pool and queues the prepare stage. p.o, p.final_state,
  // p.chunk_states and p.initial_state are the pointers finish() uses; the
  // *contents* of p.initial_state may change until finish() is queued.
  // With `nonfinite` (a device word, zeroed by the caller; only where
  // prepare_checks_finite(p)), the prepare stage also ORs into it the
  // NonFiniteInput bit of every input among q, k, v, g, beta in which it
  // reads a NaN or Inf (or, in g, a log gate > 0): the CP mixer's input check
  // without a pass of its own.
  PreparedForward(const MixerParams& p, cudaStream_t stream, unsigned* nonfinite = nullptr);
  ~PreparedForward();  // frees the workspace on the construction stream
  PreparedForward(const PreparedForward&) = delete;
  PreparedForward& operator=(const PreparedForward&) = delete;

  // The summary of cuda::mixer_summary (cuda_mixer.h) from the prepared
  // tiles, with E starting from the *current* contents of p.initial_state
  // (zeros if null). Overwrites the workspace's state and V' tiles (and, for
  // fp32 inputs, p.chunk_states), which finish() rewrites. With
  // with_linear_part = false only E is computed (M is not touched): CP ranks
  // whose M is never applied (the first and last of the scan) skip its scan.
  // With `first` (delta rules only) the first segments' maps are computed as
  // well, beside E; M then is the P of that scan, which needs the
  // first segment of every row to be its last (no cu_seqlens, or one
  // segment) when with_linear_part. E may then be null (not computed).
  void summary(float* M, float* E, cudaStream_t stream, bool with_linear_part = true,
               const FirstSegmentMaps* first = nullptr);

  // Scan + output stages from p.initial_state: o, final_state, chunk_states.
  // summary() and finish() take the construction stream only (checked: the
  // tiles are written and freed there).
  void finish(cudaStream_t stream);

 private:
  friend detail::AdoptedForward detail::adopt(
      PreparedForward& forward, const std::function<void(const MixerParams&, cudaStream_t)>& check);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One chunkwise backward split around the CP exchange: the construction
// queues the forward's prepare stage (the state-independent tiles; with
// p.recompute_chunk_states also the state scan) once, and every run() reads
// those tiles: the pre-pass (state_grad_only) and then the local backward.
// A rank that waits for the exchange constructs it before the wait, so the
// prepare stage runs meanwhile. run() takes the problem of the construction
// (same sizes, inputs, initial state and chunk states; its outputs and
// gradients may differ) on the same stream. The workspace comes from
// statescan's workspace allocator (core/device_pool.h), freed on that stream.
class PreparedBackward {
 public:
  PreparedBackward(const MixerBwdParams& p, cudaStream_t stream);
  // The same without a prepare stage: takes over `forward`'s workspace, whose
  // prepare-stage tiles are what that stage would recompute (the same kernel
  // on the same inputs: bitwise the same gradients), and frees it with its
  // own. `forward` must have been built on `stream` for the problem of `p`
  // (its inputs unchanged since), `p` must read saved chunk states (not
  // recompute_chunk_states); `forward` is empty afterwards.
  PreparedBackward(const MixerBwdParams& p, PreparedForward& forward, cudaStream_t stream);
  ~PreparedBackward();
  PreparedBackward(const PreparedBackward&) = delete;
  PreparedBackward& operator=(const PreparedBackward&) = delete;

  // cuda::mixer_backward(p) from the prepared tiles.
  void run(const MixerBwdParams& p, cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// out[m] = op(A[m]) B[m] + bias[m] for `maps` full Dk x Dk maps A (op: A, or
// A^T where transpose_a; [maps, Dk, Dk] contiguous) and Dk x width matrices
// B, bias and out (row strides ld_*, one matrix to the next stride_*), fp32
// (multiply_maps). bias may be null (zero) or out itself (accumulate in
// place); B must not alias out.
struct MapsProduct {
  int64_t maps = 0, dk = 0, width = 0;
  const float* A = nullptr;
  bool transpose_a = false;
  const float* B = nullptr;
  int64_t ld_b = 0, stride_b = 0;
  const float* bias = nullptr;
  int64_t ld_bias = 0, stride_bias = 0;
  float* out = nullptr;
  int64_t ld_out = 0, stride_out = 0;
};
void multiply_maps(const MapsProduct& p, cudaStream_t stream);
// A MapsProduct over packed matrices (rows of `width`, Dk x width per map);
// the caller sets A, B, bias and out.
inline MapsProduct packed_maps_product(int64_t maps, int64_t dk, int64_t width) {
  MapsProduct mp;
  mp.maps = maps;
  mp.dk = dk;
  mp.width = width;
  mp.ld_b = mp.ld_bias = mp.ld_out = width;
  mp.stride_b = mp.stride_bias = mp.stride_out = dk * width;
  return mp;
}

// A chain of map products applied to states, in one launch:
//   X <- op(A_s) X + bias_s,  s = 0 .. steps - 1,  X from x0, the result into out,
// `maps` of them side by side: op(A_s) = A_s or A_s^T (transpose_a), packed
// Dk x Dk per map; x0, every bias_s (null: none) and out packed Dk x width
// per map. Each column of X only ever meets the same column of the biases
// (the products are separable by columns), so each CTA carries its columns
// of X through the whole chain in shared memory: the two-level summary's
// fold (P_{G-1} ... P_0, and E) and the pre-pass's Horner steps, which were
// 2 (G - 1) and G - 1 launches of ~10 us each (PERF_NOTES, twenty-fifth
// session). out may alias its chain's x0 or biases (a CTA reads its columns
// of those before it writes them), not another chain's. fp32, Dk <= 128.
constexpr int kMaxChainSteps = 64;
struct MapsChain {
  int64_t maps = 0, dk = 0, width = 0;
  bool transpose_a = false;
  int steps = 0;
  const float* x0 = nullptr;
  const float* A[kMaxChainSteps] = {};
  const float* bias[kMaxChainSteps] = {};
  float* out = nullptr;
};
// `count` (1 or 2) independent chains, one launch.
void chain_maps(const MapsChain* chains, int count, cudaStream_t stream);

// One batch of affine maps S_out = M S_in + E, [maps] of them, contiguous:
// M [maps, Dk, Dk] (or [maps, Dk] when diagonal), E [maps, Dk, Dv].
struct DeviceMaps {
  int64_t maps = 0, dk = 0, dv = 0;
  bool diagonal = false;
  const float* M = nullptr;
  const float* E = nullptr;
  int64_t m_size() const { return diagonal ? dk : dk * dk; }
};

// out[m] (Dk x width, packed) = M[m] in[m] + E[m][:, col0 : col0 + width];
// in (Dk x width per map, packed) may be null (a zero incoming state).
// `out` must not alias `in`.
void apply_affine_maps(const DeviceMaps& maps, const float* in, float* out, int64_t col0,
                       int64_t width, cudaStream_t stream);

// (M_l, E_l) <- (M_l M_e, M_l E_e + E_l): `later` (M_l, E_l at later_M, later_E)
// composed after `earlier`, in place. `scratch` holds at least
// maps * (m_size + Dk * Dv) floats and must not alias either.
void compose_affine_maps(int64_t maps, int64_t dk, int64_t dv, bool diagonal, float* later_M,
                         float* later_E, const float* earlier_M, const float* earlier_E,
                         float* scratch, cudaStream_t stream);

// The pre-pass's result for batch row `row` from a forward's
// FirstSegmentMaps:
//   dS0[h] = sum over local tokens t in [t_begin, t_end) of H_t[h]^T dO_t[h]
//            + P[h]^T dS_end[h]   (the second term only where dS_end != null),
// with P = maps.P + row * H * Dk * Dk; dS0 and dS_end [H, Dk, Dv] fp32, d_o
// [B, L, H, Dv] in p.dtype. fp32 accumulation: cuBLAS GEMMs per head (and
// run) contract over the tokens, the P^T terms one chain_maps launch. With
// maps.pieces > 1 (the whole row,
// t_begin = 0, t_end = L) the runs are composed from the last:
// dS <- sum over the run of H_t^T dO_t + P_g^T dS.
void first_segment_state_grad(const MixerParams& p, const FirstSegmentMaps& maps, const void* d_o,
                              int64_t row, int64_t t_begin, int64_t t_end, const float* dS_end,
                              float* dS0, cudaStream_t stream);

// Mt[m] = M[m]^T for [maps, Dk, Dk]; Mt must not alias M.
void transpose_maps(const float* M, float* Mt, int64_t maps, int64_t dk, cudaStream_t stream);

// Queues a count of the NaN/Inf elements of `data` (n elements of dtype f32,
// bf16 or f16, element-aligned) into *count (a device int64, added to: zero
// it first). Bandwidth-bound: one read of the array.
void count_nonfinite(const void* data, int64_t n, DType dtype, int64_t* count, cudaStream_t stream);
// The same count for log gates (fp32): the elements that are NaN, +-Inf or
// > 0 (DESIGN §2: g = log alpha, alpha in (0, 1]).
void count_bad_log_gates(const float* g, int64_t n, int64_t* count, cudaStream_t stream);

// out[m] = identity (Dk x Dv, ones where i == j) for `maps` states.
void fill_identity(float* out, int64_t maps, int64_t dk, int64_t dv, cudaStream_t stream);

// Queues a one-thread kernel that keeps `stream` busy for `seconds` (0 <
// seconds <= 1, by the GPU's global timer). What the host queues behind it
// meanwhile starts as soon as it ends, so an event recorded right after it
// and one after that work time the work alone, not the host's time to queue
// it. The NCCL link probe (measure_link_device) holds its stream so before
// every timed shift. Throws naming "seconds" outside that range.
void hold_stream(cudaStream_t stream, double seconds);

}  // namespace statescan::cuda
