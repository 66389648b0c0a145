// Host-side plan of one chunkwise forward call, shared by the full forward
// (cuda_mixer.cu), the CP summary (summary.cu) and the backward, which re-runs
// the prepare stage to recompute its tiles: argument checks, the workspace
// layout, the packed-sequence chunk tables, and a launch of any subset of the
// three kernels (ForwardStage) for the variant.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/chunk_forward.cuh"
#include "kernels/mixer_params.h"

namespace statescan::cuda::detail {

struct ForwardPlan {
  ForwardArgs args;              // kernel arguments, pointing into the workspace
  std::vector<int64_t> offsets;  // host copy of cu_seqlens (empty without it)
  int64_t num_chunks = 0;        // chunks over all segments (count_chunks)
};

// A PreparedForward's workspace and plan, handed to a PreparedBackward
// (detail::adopt, summary.cu): the caller owns `workspace` afterwards and
// frees it on `stream`.
struct AdoptedForward {
  MixerParams params;
  void* workspace = nullptr;
  cudaStream_t stream = nullptr;
  ForwardPlan plan;
};

// Validates `p` (cu_seqlens is a device array: copied to the host once, which
// synchronises `stream`), lays the workspace out (at least
// forward_workspace_bytes(p) bytes) and uploads the chunk tables on `stream`.
// prepare_only: a plan without V' and the T-typed chunk states (no room for
// them, null pointers), which only the output kernel reads: the prepare stage,
// and the scan stage when it only has to produce p.chunk_states (the
// backward's recompute); never the output stage. Its workspace is
// prepare_workspace_bytes(p). for_backward: a plan whose tiles a backward may
// adopt (PreparedForward), which then also gets what only the backward reads
// (ForwardArgs::ws_t, where the workspace has room for it).
ForwardPlan plan_forward(const MixerParams& p, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream, bool prepare_only = false,
                         bool for_backward = false);
size_t prepare_workspace_bytes(const MixerParams& p);
// An upper bound on p's chunks that does not need cu_seqlens' contents (each
// segment adds at most one partial chunk), for the forward's and the
// backward's workspace and grids. Checks the sizes first (check_sizes): the
// public sizing functions reach here before validate().
int64_t max_chunks(const MixerParams& p);
// Whether the backward's intra-chunk kernel reads T from the plan
// (ForwardArgs::ws_t: the prepare's, or a saved T) instead of solving it from
// its own operand copies; STATESCAN_BWD_T=solve: never, saved T or not (the
// saved T then serves only the prepare re-run's W and U), so that a saved T
// gives bitwise that mode's gradients too.
bool intra_reads_t();
// STATESCAN_SCAN=wmma: 16-bit state scans through the wmma block kernel (an
// A/B knob), which the per-head wgmma scans do not honour, so the summary's
// choice between them must (per_head_supported).
bool scan_wmma_forced();

// The stages a forward that produces o runs: all three, or only the scan and
// the output when they read the inputs themselves (ForwardArgs::raw_additive).
inline int forward_stages(const ForwardArgs& a) {
  return a.raw_additive ? (kStageScan | kStageOutput) : kAllStages;
}

// Whether a backward of this forward reads the prepare stage's tiles: the raw
// linear path's kernels read the inputs (chunk_grad_raw16.cuh).
inline bool backward_reads_tiles(const ForwardArgs& a) {
  return !a.raw_additive;
}

// Launches `stages` (ForwardStage bits) of the variant's kernels with `a`.
void launch_forward_stages(const MixerParams& p, const ForwardArgs& a, int stages,
                           cudaStream_t stream);

}  // namespace statescan::cuda::detail
