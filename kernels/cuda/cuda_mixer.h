// CUDA forward path of the six linear-attention variants (DESIGN §3-4).
//
// All pointers in MixerParams are device pointers, cu_seqlens included (an
// int64 device array). Work is queued on the caller's stream; the functions
// return before the GPU finishes (except for a small host copy of cu_seqlens
// in packed mode, which synchronises the stream once).
//
// Supported now: dtype in {f32, bf16, f16}, Dk == Dv in {64, 128}, chunk in
// {16, 32, 64}. Other shapes are rejected with statescan::Error naming "dk".
#pragma once

#include <cuda_runtime.h>

#include "kernels/mixer_params.h"

namespace statescan::cuda {

// Chunkwise forward: writes o, and final_state / chunk_states when given.
// Temporary per-chunk intermediates are taken from statescan's workspace
// allocator (core/device_pool.h) and released on the same stream.
void mixer_forward(const MixerParams& p, cudaStream_t stream);

// Bytes of device workspace mixer_forward needs for `p` (host-readable
// cu_seqlens not required: packed problems are sized from T).
size_t forward_workspace_bytes(const MixerParams& p);
// The same forward with caller-owned workspace of at least
// forward_workspace_bytes(p) bytes, 32-byte aligned as cudaMalloc's are (no
// allocation on the hot path).
void mixer_forward(const MixerParams& p, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream);

// Whether `p` can save T for its backward (MixerParams::saved_t): delta rules
// without a vector gate, 16-bit inputs, the 16-bit prepare kernel (not
// STATESCAN_PREPARE=fp32); and the bytes of that buffer (both parts).
bool saved_t_supported(const MixerParams& p);
size_t saved_t_bytes(const MixerParams& p);

// Whether the chunkwise kernels of `p` read q, k, v themselves rather than
// tiles a prepare stage writes (linear attention with 16-bit inputs and no L2
// norm, unless STATESCAN_LINEAR=tiles): their forward and backward
// workspaces hold no tiles, and the backward has no state-product batches.
bool reads_inputs_directly(const MixerParams& p);

// Token-by-token recurrent forward (serving, and a cross-check of the
// chunkwise path): state in from initial_state (zeros if null), o for every
// token, state out to final_state when given. chunk_states is ignored.
// final_state may be initial_state itself: a serving step updates each
// sequence's state in place (every thread reads its state columns before the
// first token and writes them after the last; no other thread touches them).
// A final_state that overlaps initial_state from another address is refused.
// Batch rows (cu_seqlens null) can be captured into a CUDA graph; packed
// sequences cannot (their offsets are checked on the host) and are refused
// inside a capture, naming cu_seqlens.
void decode_forward(const MixerParams& p, cudaStream_t stream);

// --- backward (issue 4; kernels/cuda/chunk_backward*.cu) ----------------------
// Chunkwise backward: dq, dk_out, dv_out, dg, dbeta and d_initial_state (each
// when given) from d_o and d_final_state (null = zero), reading the fp32
// chunk_states that mixer_forward wrote for the same inputs (required unless
// p.recompute_chunk_states: then the backward re-derives them).
// Intra-chunk quantities are recomputed; no floating-point atomics, so two
// calls give bitwise-identical gradients. With p.state_grad_only only
// d_initial_state is written (the CP pre-pass of DESIGN §5).
void mixer_backward(const MixerBwdParams& p, cudaStream_t stream);
// With recompute_chunk_states (MixerBwdParams) the workspace also holds the
// re-derived fp32 chunk states. The workspace is 32-byte aligned, as the
// forward's.
size_t backward_workspace_bytes(const MixerParams& p, bool recompute_chunk_states = false);
void mixer_backward(const MixerBwdParams& p, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream);

// --- context-parallel summary (issue 3; kernels/cuda/summary.cu) --------------
// The GPU twin of cpu::mixer_summary (kernels/cpu/cpu_mixer.h): the affine
// map S_end = M S_start + E of the LAST segment of every batch row, without
// computing outputs. M: [R,H,Dk,Dk] (delta rules) or [R,H,Dk] (additive);
// E: [R,H,Dk,Dv]; R = batch (1 with cu_seqlens). Device pointers.
void mixer_summary(const MixerParams& p, float* M, float* E, cudaStream_t stream);

// True when a CUDA device is visible (tests skip otherwise).
bool device_available();

// Throws naming "heads", or "cu_seqlens" / "batch", where the kernels' grids
// cannot hold the problem: heads and sequences index grid dimensions y and z
// (at most 65,535 each). The forward, backward and decode entry points call it.
void check_grid_limits(const MixerParams& p);

// Multiprocessors of the current device (cached per device).
int multiprocessor_count();

}  // namespace statescan::cuda
