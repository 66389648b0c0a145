#include "kernels/mixer_params.h"

#include <cmath>

#include "core/error.h"

namespace statescan {

int64_t count_chunks(const MixerParams& p) {
  return first_chunk_of_segment(p, p.num_segments);
}

int64_t first_chunk_of_segment(const MixerParams& p, int64_t n) {
  if (p.cu_seqlens == nullptr) return n * ((p.seq_len + p.chunk - 1) / p.chunk);
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i)
    c += (p.cu_seqlens[i + 1] - p.cu_seqlens[i] + p.chunk - 1) / p.chunk;
  return c;
}

void check_sizes(const MixerParams& p) {
  check_chunk(p.chunk);
  SS_CHECK_ARG(p.batch >= 1, "batch", "must be >= 1, got ", p.batch);
  SS_CHECK_ARG(p.seq_len >= 1, "seq_len", "must be >= 1, got ", p.seq_len);
  SS_CHECK_ARG(p.heads >= 1, "heads", "must be >= 1, got ", p.heads);
  SS_CHECK_ARG(p.dk >= 1 && p.dk <= 256, "dk", "must be in [1, 256], got ", p.dk);
  SS_CHECK_ARG(p.dv >= 1 && p.dv <= 256, "dv", "must be in [1, 256], got ", p.dv);
  SS_CHECK_ARG(p.num_segments >= 1, p.cu_seqlens != nullptr ? "cu_seqlens" : "num_segments",
               "must hold at least one segment, got ", p.num_segments);
}

namespace {
// Everything but the forward outputs.
void validate_problem(const MixerParams& p) {
  check_sizes(p);
  SS_CHECK_ARG(std::isfinite(p.scale) && p.scale > 0.f, "scale", "must be finite and > 0, got ",
               p.scale);
  SS_CHECK_ARG(p.q != nullptr, "q", "input pointer must not be null");
  SS_CHECK_ARG(p.k != nullptr, "k", "input pointer must not be null");
  SS_CHECK_ARG(p.v != nullptr, "v", "input pointer must not be null");
  SS_CHECK_ARG((p.g != nullptr) == has_gate(p.variant), "g",
               has_gate(p.variant) ? "is required by variant " : "must be null for variant ",
               to_string(p.variant));
  SS_CHECK_ARG((p.beta != nullptr) == has_beta(p.variant), "beta",
               has_beta(p.variant) ? "is required by variant " : "must be null for variant ",
               to_string(p.variant));
  if (p.cu_seqlens != nullptr) {
    SS_CHECK_ARG(p.batch == 1, "cu_seqlens", "packed sequences need batch == 1, got batch ",
                 p.batch);
    SS_CHECK_ARG(p.num_segments >= 1, "cu_seqlens", "must hold at least 2 offsets");
    SS_CHECK_ARG(p.cu_seqlens[0] == 0, "cu_seqlens", "must start at 0, got ", p.cu_seqlens[0]);
    for (int64_t n = 0; n < p.num_segments; ++n)
      SS_CHECK_ARG(p.cu_seqlens[n + 1] > p.cu_seqlens[n], "cu_seqlens",
                   "must be strictly increasing; offsets ", n, " and ", n + 1, " are ",
                   p.cu_seqlens[n], " and ", p.cu_seqlens[n + 1]);
    SS_CHECK_ARG(p.cu_seqlens[p.num_segments] == p.seq_len, "cu_seqlens", "last offset ",
                 p.cu_seqlens[p.num_segments], " must equal the sequence length ", p.seq_len);
  } else {
    SS_CHECK_ARG(p.num_segments == p.batch, "num_segments",
                 "must equal batch without cu_seqlens (", p.num_segments, " vs ", p.batch, ")");
  }
}
}  // namespace

void validate(const MixerParams& p) {
  validate_problem(p);
  SS_CHECK_ARG(p.o != nullptr, "o", "output pointer must not be null");
}

void validate(const MixerBwdParams& p) {
  validate_problem(p);
  SS_CHECK_ARG(p.d_o != nullptr, "do", "must not be null");
  if (p.state_grad_only) {
    // The state-gradient recurrence dS_{t-1} = A_t^T dS_t + scale q do^T needs
    // no forward states, so no chunk_states here.
    SS_CHECK_ARG(p.d_initial_state != nullptr, "d_initial_state",
                 "state_grad_only needs an output for the state gradient");
    return;
  }
  SS_CHECK_ARG(p.chunk_states != nullptr || p.recompute_chunk_states, "chunk_states",
               "backward needs the chunk states saved by forward (or recompute_chunk_states)");
  SS_CHECK_ARG(p.dq != nullptr, "dq", "gradient pointer must not be null");
  SS_CHECK_ARG(p.dk_out != nullptr, "dk_out", "gradient pointer must not be null");
  SS_CHECK_ARG(p.dv_out != nullptr, "dv_out", "gradient pointer must not be null");
  SS_CHECK_ARG((p.dg != nullptr) == (p.g != nullptr), "dg", "must be given exactly when g is");
  SS_CHECK_ARG((p.dbeta != nullptr) == (p.beta != nullptr), "dbeta",
               "must be given exactly when beta is");
}

}  // namespace statescan
