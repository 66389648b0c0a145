// Counted FLOPs of the chunkwise mixer (DESIGN §4), for the achieved-TFLOP/s
// metric: the matrix products of the algorithm, 2 FLOPs per multiply-add,
// elementwise work (gates, masks, normalisation) left out. A model, not a
// measurement: it makes runs of different shapes and variants comparable.
// It is the model statescan-bench prints its TFLOP/s against.
//
// Per token and head (chunk C; Dk, Dv head dims; intra-chunk products count
// their causal half, C/2 partners per token):
//   additive  Q K^T and A V inside the chunk      C (Dk + Dv)
//             Q S and K^T V across chunks          4 Dk Dv
//   delta     + K K^T                              C Dk
//             + the triangular solve for W and U   C (Dk + Dv)
//             + W S                                2 Dk Dv
// (Dk = Dv = D: additive 2 C D + 4 D^2, delta 5 C D + 6 D^2.)
//
// Backward, as this design runs it (the intra-chunk products recomputed, not
// saved; multiply-adds):
//   additive  the reverse scan's A^T dO, K_ dS, Q^^T dO    C/2 Dv + 2 Dk Dv
//             A again, dA = dO V'^T, dA K, dA^T Q^         C/2 (3 Dk + Dv)
//             dO S^T, V' dS^T                              2 Dk Dv
//   delta     + W^T dV', dW = dV' S^T, V' = U - W S         3 Dk Dv
//             + K K^T again, W and U again                 C/2 (2 Dk + Dv)
//             + T^T [dU | dW], dT                          C (Dk + Dv)
//             + the K K^T paths into dk                    C Dk
// (Dk = Dv = D, in FLOPs: additive 5 C D + 8 D^2, delta 14 C D + 14 D^2.)
#pragma once

#include <cstdint>

#include "core/options.h"

namespace statescan {

struct FlopShape {
  Variant variant = Variant::kda;
  int64_t tokens = 0;  // tokens on this device: B * T_local
  int64_t heads = 0, dk = 0, dv = 0;
  int64_t chunk = 64;
};

// Forward FLOPs; throws statescan::Error naming the field for negative sizes
// or a chunk that is not positive.
double chunkwise_forward_flops(const FlopShape& shape);
// Backward FLOPs (the same checks).
double chunkwise_backward_flops(const FlopShape& shape);
// Forward (+ backward) FLOPs of one step.
double chunkwise_step_flops(const FlopShape& shape, bool with_backward);

// LaCT (DESIGN §6): the token-side GEMMs of the SwiGLU fast weights per token
// and head, hidden width M and head dim D: forward 18 M D (apply: 3 products
// of 2 M D; the fast-weight gradient: 6 more), forward + backward 64 M D.
// Muon's Newton-Schulz products are per chunk, not per token, and are left
// out. Throws naming the field for negative sizes.
double lact_step_flops(int64_t token_heads, int64_t dim, int64_t hidden, bool with_backward);

}  // namespace statescan
