// The CPU execution path (`--device cpu`): fp32 compute, threaded over
// (segment, head), state checkpointed once per chunk so that backward memory
// is O(T/C * Dk * Dv) per head. Backward recomputes the states inside a chunk
// from its checkpoint, then runs the reverse recurrence of DESIGN §3.
//
// Inputs/outputs: see kernels/mixer_params.h. The CPU path needs
// dtype == f32 and host pointers; bf16/f16 inputs are rounded to their dtype
// by the caller before they get here (core/dtype.h round_to).
#pragma once

#include "kernels/mixer_params.h"

namespace statescan::cpu {

// o, final_state (if set) and chunk_states (if set).
void mixer_forward(const MixerParams& p);

// dq, dk, dv, dg, dbeta, d_initial_state from d_o and d_final_state, reading the
// chunk_states written by mixer_forward with the same inputs.
void mixer_backward(const MixerBwdParams& p);

// The affine summary of the LAST segment of every batch row (DESIGN §5):
// S_end = M S_start + E, with S_start the segment's incoming state.
//   E: the segment's final state when it starts from p.initial_state (zeros if
//      null) — [R, H, Dk, Dv] with R = batch (R = 1 with cu_seqlens).
//   M: the product of the per-token transitions over that segment:
//      delta rule:    [R, H, Dk, Dk], M = A_L ... A_1, A_t = (I - b k k^T) Diag(alpha_t)
//      additive rule: [R, H, Dk], the diagonal prod_t alpha_t (ones without decay).
// No outputs are computed. Threads over (row, head).
void mixer_summary(const MixerParams& p, float* M, float* E);

// Number of floats of M per (row, head): Dk*Dk for delta rules, Dk otherwise.
int64_t summary_m_size(const MixerParams& p);

}  // namespace statescan::cpu
