// Parameters of one chunkwise mixer call on one device (a whole sequence, or a
// rank's shard under context parallelism). One plain struct for the whole op
// family: the CPU path (kernels/cpu/cpu_mixer.h) and the CUDA path read it;
// make_*_params() in parallel/ and the launcher fill and validate it once.
//
// Layouts follow DESIGN §2 (FLA's): row-major, last dim contiguous.
//   q, k        [B, T, H, Dk]          v, o, do     [B, T, H, Dv]
//   g (scalar)  [B, T, H]   (vector)   [B, T, H, Dk]  fp32, natural log of alpha
//   beta        [B, T, H]
//   states      [N, H, Dk, Dv] fp32    N = number of segments (see below)
//
// Segments. Without cu_seqlens every batch row is one segment (N = B). With
// cu_seqlens (B must be 1) the T tokens are N packed segments,
// cu_seqlens[0] = 0 < ... < cu_seqlens[N] = T. Each segment starts from its own
// initial state and ends in its own final state; nothing flows between
// segments. Under CP, parallel/ maps sequences and shard boundaries onto
// segments (a shard's first segment may continue the previous rank's).
//
// Chunks are aligned to segment starts: segment n of length L_n has
// ceil(L_n / chunk) chunks; chunk_states holds the state *entering* every chunk,
// [num_chunks_total, H, Dk, Dv] fp32, segments in order (batch rows in order).
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/options.h"

namespace statescan {

struct MixerParams {
  // --- problem -------------------------------------------------------------
  Variant variant = Variant::kda;
  int64_t batch = 0;     // B
  int64_t seq_len = 0;   // T (tokens per batch row on this device)
  int64_t heads = 0;     // H
  int64_t dk = 0;        // Dk (q/k head dim)
  int64_t dv = 0;        // Dv (v/o head dim)
  int64_t chunk = 64;    // C in {16, 32, 64}
  float scale = 0.f;     // applied to q (already resolved, never < 0 here)
  bool l2norm_qk = false;
  DType dtype = DType::f32;  // element type of q, k, v, o, do, dq, dk, dv, beta

  // --- segments --------------------------------------------------------------
  const int64_t* cu_seqlens = nullptr;  // [N+1] or null (then N = batch)
  int64_t num_segments = 0;             // N

  // --- forward inputs -----------------------------------------------------------
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* g = nullptr;     // null iff the variant has no decay
  const void* beta = nullptr;   // null iff the rule is additive
  const float* initial_state = nullptr;  // [N,H,Dk,Dv] or null (zeros)

  // --- forward outputs ----------------------------------------------------------
  void* o = nullptr;                    // [B,T,H,Dv]
  float* final_state = nullptr;         // [N,H,Dk,Dv] or null (not written)
  float* chunk_states = nullptr;        // [num_chunks_total,H,Dk,Dv]; forward writes,
                                        // backward reads; null in forward = not saved
  // GPU path, delta rules without a vector gate, 16-bit inputs
  // (cuda::saved_t_supported): T = (I + diag(beta) KK)^{-1} per chunk and head
  // as two parts, hi then lo, each [chunks,H,C,C] in dtype with room for the
  // most chunks the problem can have (cuda::saved_t_bytes for both). Forward
  // writes it when non-null; backward reads it and its re-run of the prepare
  // stage skips KK and the solve (the gradients are bitwise those without
  // it). Null = not saved. The CPU path refuses it.
  void* saved_t = nullptr;
};

struct MixerBwdParams : MixerParams {
  // --- backward inputs -----------------------------------------------------------
  const void* d_o = nullptr;            // [B,T,H,Dv]
  const float* d_final_state = nullptr; // [N,H,Dk,Dv] or null (zero)

  // --- backward outputs ------------------------------------------------------
  void* dq = nullptr;                   // [B,T,H,Dk]
  void* dk_out = nullptr;               // [B,T,H,Dk]
  void* dv_out = nullptr;               // [B,T,H,Dv]
  float* dg = nullptr;                  // like g; required iff g is given
  void* dbeta = nullptr;                // [B,T,H]; required iff beta is given
  float* d_initial_state = nullptr;     // [N,H,Dk,Dv] or null (not written)

  // When set, only d_initial_state is computed (dq..dbeta are not touched and
  // may be null). Context parallelism uses this pre-pass: the gradient of a
  // shard's incoming state with zero downstream gradient (DESIGN §5).
  bool state_grad_only = false;

  // When set, chunk_states is not read (it may be null): backward re-runs the
  // forward's state scan into its own workspace first. Forward then need not
  // keep the 4*Dk*Dv/chunk bytes per token and head of fp32 chunk states
  // between the passes, at the cost of one more scan in backward.
  bool recompute_chunk_states = false;
};

// Segment n's token range [begin, end) within its batch row.
inline int64_t segment_begin(const MixerParams& p, int64_t n) {
  return p.cu_seqlens ? p.cu_seqlens[n] : 0;
}
inline int64_t segment_end(const MixerParams& p, int64_t n) {
  return p.cu_seqlens ? p.cu_seqlens[n + 1] : p.seq_len;
}
// Batch row of segment n.
inline int64_t segment_row(const MixerParams& p, int64_t n) { return p.cu_seqlens ? 0 : n; }

// Number of chunks over all segments (chunks are aligned to segment starts).
int64_t count_chunks(const MixerParams& p);
// Index of segment n's first chunk in chunk_states.
int64_t first_chunk_of_segment(const MixerParams& p, int64_t n);

// Checks the sizes that workspace and grid arithmetic use (chunk, batch,
// seq_len, heads, dk, dv, num_segments >= 1), naming the argument at fault;
// reads no pointer. The sizing functions call it before they divide by the
// chunk (chunk 0 was a division by zero there, ahead of validate()).
void check_sizes(const MixerParams& p);
// Checks sizes, pointers and the segment table, naming the argument at fault
// (e.g. "q", "cu_seqlens", "chunk"). Does not read tensor contents.
void validate(const MixerParams& p);
void validate(const MixerBwdParams& p);

}  // namespace statescan
