// The fp64 reference recurrence of DESIGN §3, token by token: the oracle every
// other path (CPU chunked path, CUDA kernels, context parallelism) is tested
// against. Simple and slow on purpose; it stores every per-token state, so use
// it on test-sized problems only.
//
// Layouts are those of kernels/mixer_params.h, all in fp64. Segments are the
// same as there: without cu_seqlens each batch row is one sequence, with
// cu_seqlens (B == 1) the tokens are packed sequences.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/options.h"

namespace statescan::ref {

// One sequence: its batch row and token range [begin, end) within that row.
struct Sequence {
  int64_t row, begin, end;
};

struct Problem {
  Variant variant = Variant::kda;
  int64_t batch = 1, seq_len = 1, heads = 1, dk = 1, dv = 1;
  double scale = 1.0;
  bool l2norm_qk = false;
  std::vector<int64_t> cu_seqlens;  // empty: N = batch sequences of seq_len
  std::vector<double> q, k, v;      // [B,T,H,Dk], [B,T,H,Dk], [B,T,H,Dv]
  std::vector<double> g;            // [B,T,H] or [B,T,H,Dk]; empty iff no decay
  std::vector<double> beta;         // [B,T,H]; empty iff additive
  std::vector<double> h0;           // [N,H,Dk,Dv]; empty = zeros

  int64_t num_sequences() const {
    return cu_seqlens.empty() ? batch : static_cast<int64_t>(cu_seqlens.size()) - 1;
  }
  // Sequence n (0 <= n < num_sequences()): batch row n, or packed sequence n of row 0.
  Sequence sequence(int64_t n) const {
    if (cu_seqlens.empty()) return {n, 0, seq_len};
    return {0, cu_seqlens[static_cast<std::size_t>(n)],
            cu_seqlens[static_cast<std::size_t>(n + 1)]};
  }
};

struct Outputs {
  std::vector<double> o;   // [B,T,H,Dv]
  std::vector<double> ht;  // [N,H,Dk,Dv]
};

struct Grads {
  std::vector<double> dq, dk, dv;  // like q, k, v
  std::vector<double> dg;          // like g (empty iff no decay)
  std::vector<double> dbeta;       // like beta (empty iff additive)
  std::vector<double> dh0;         // [N,H,Dk,Dv], always filled
};

// The L2 normalisation used with l2norm_qk: x / sqrt(sum x^2 + kL2NormEps).
constexpr double kL2NormEps = 1e-6;

Outputs forward(const Problem& p);
// do_ [B,T,H,Dv]; dht [N,H,Dk,Dv] or empty (zero).
Grads backward(const Problem& p, const std::vector<double>& d_o, const std::vector<double>& dht);

}  // namespace statescan::ref
