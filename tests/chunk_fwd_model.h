// Host model (fp64, plain loops) of the 16-bit chunkwise forward that the
// CUDA kernels run (kernels/cuda/chunk_prepare16.cuh, then the state scan and
// the output kernel of chunk_forward.cuh), rounding to bf16 where they round,
// so that the precision of a rounding scheme can be bounded on the CPU (in
// CI) before and after a GPU run. tests/test_chunk_fwd_model.cpp runs it.
//
// Per chunk (rows t, s; b the inclusive cumsum of the log gates, per key
// dimension; a scalar gate is the same in every dimension):
//   Q^_t = scale q_t e^{b_t}, K_t = k_t e^{b_C - b_t}, decay = e^{b_C}
//   A_ts = scale sum_d q_td k_sd e^{b_td - b_sd} (s <= t)
//   delta rules: M_ts = sum_d k_td k_sd e^{b_td - b_sd} (s < t),
//     T = (I + diag(beta) M)^{-1}, W = T diag(beta) K^, U = T diag(beta) V
//   scan: V' = U - W S, o = Q^ S + A V', S <- diag(decay) S + K_^T V'.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/options.h"
#include "kernels/cpu/reference.h"
#include "tests/chunk_model.h"

namespace statescan::test {

// Where the model rounds to bf16. All false: the exact chunkwise algorithm.
struct FwdRounding {
  bool tiles = false;   // the workspace tiles Q^, K_, A, W, U (v2 and v3)
  bool states = false;  // the scan's S copy for the products, V', and o
  // v3's operands of A and KK (v2 took fp32 tf32-split products: exact here).
  // Without vector gates: q and k as one 16-bit copy each (with the L2 norm
  // they are not bf16-exact); v3 took them as two parts (hi + lo: exact), the
  // kernel now takes the raw input rows and applies the norm's row factors
  // to the products (exact as well).
  bool qk_single = false;
  // Vector gates: the reference-row copies, X~(k)_s = k_s e^{b_rho(J) - b_s}
  // rounded once, and the query side Y~_t = x_t e^{b_t - b_rho(I-1)} times the
  // per-dimension factor e^{b_rho(I-1) - b_rho(J)}: rounded twice
  // (query_single) or exact (v3's two parts). On the diagonal only while
  // every block's decay is <= kMaxDrop, else exact (the kernel's CUDA-core path).
  bool reference_rows = false;
  bool query_single = false;
  // W, U = T X with T and X rounded once each (v3 takes both as two parts;
  // without vector gates the kernel now takes T diag(beta rk e^{G}) and
  // T diag(beta) as two parts and the raw k and v rows: exact operands).
  bool tx_single = false;
  // A candidate, not what the kernels run (PERF_NOTES, "Next steps"): the delta
  // rules' scan as one product per chunk step, S <- diag(decay) S + KU - KW S,
  // with KW = K_^T W and KU = K_^T U formed per chunk (exact from the tiles)
  // and rounded to bf16 once, and o = (Q^ - A W) S + A U with both operands
  // rounded once, instead of V' = U - W S rounded and then K_^T V' and A V'.
  bool one_product = false;
};

inline ref::Outputs chunk_forward_model(const ref::Problem& p, int64_t C,
                                        const FwdRounding& r = {}) {
  constexpr double kMaxDrop = 4.0;
  using Vec = std::vector<double>;
  auto rnd = [](bool on, double x) { return on ? round_bf16(x) : x; };
  const VariantSpec spec = spec_of(p.variant);
  const bool delta = spec.rule == Rule::delta;
  const bool vec_gate = spec.decay == Decay::vector;
  const int64_t H = p.heads, Dk = p.dk, Dv = p.dv, T = p.seq_len, N = p.num_sequences();
  ref::Outputs out;
  out.o.assign(p.v.size(), 0);
  out.ht.assign(static_cast<size_t>(N * H * Dk * Dv), 0);
  for (int64_t n = 0; n < N; ++n) {
    const ref::Sequence seq = p.sequence(n);
    const int64_t row = seq.row, begin = seq.begin, end = seq.end;
    for (int64_t h = 0; h < H; ++h) {
      auto tok = [&](int64_t t) { return (row * T + t) * H + h; };
      Vec S(Dk * Dv, 0);
      if (!p.h0.empty())
        for (int64_t e = 0; e < Dk * Dv; ++e) S[e] = p.h0[(n * H + h) * Dk * Dv + e];
      for (int64_t t0 = begin; t0 < end; t0 += C) {
        const ModelChunk in = model_chunk(p, row, h, t0, end, C);
        const int64_t L = in.L;
        const Vec &q = in.q, &k = in.k, &v = in.v, &beta = in.beta, &b = in.b;
        auto bref = [&](int64_t I, int64_t d) { return I >= 0 ? b[(16 * I + 15) * Dk + d] : 0.0; };
        bool fast = true;
        for (int64_t I = 0; I < C / 16; ++I)
          for (int64_t d = 0; d < Dk; ++d) fast = fast && bref(I - 1, d) - bref(I, d) <= kMaxDrop;

        // sum_d x_td y_sd e^{b_td - b_sd} as the kernels' operands give it.
        auto gram = [&](const Vec& x, const Vec& y, int64_t t, int64_t s) {
          const int64_t I = t / 16, J = s / 16;
          double sum = 0;
          for (int64_t d = 0; d < Dk; ++d) {
            const double xt = x[t * Dk + d], ys = y[s * Dk + d];
            if (!vec_gate) {  // the gate factor is applied to the sum
              sum += rnd(r.qk_single, xt) * rnd(r.qk_single, ys);
            } else if (!r.reference_rows || (I == J && !fast)) {
              sum += xt * ys * std::exp(b[t * Dk + d] - b[s * Dk + d]);
            } else {
              const double yq = xt * std::exp(b[t * Dk + d] - bref(I - 1, d));
              const double f = std::exp(bref(I - 1, d) - bref(J, d));
              const double a_op = r.query_single ? round_bf16(round_bf16(yq) * f) : yq * f;
              sum += a_op * round_bf16(ys * std::exp(bref(J, d) - b[s * Dk + d]));
            }
          }
          if (!vec_gate) sum *= std::exp(b[t * Dk] - b[s * Dk]);
          return sum;
        };
        Vec A(C * C, 0), Qh(C * Dk), Kb(C * Dk), decay(Dk);
        for (int64_t t = 0; t < C; ++t)
          for (int64_t s = 0; s <= t; ++s) A[t * C + s] = rnd(r.tiles, p.scale * gram(q, k, t, s));
        for (int64_t t = 0; t < C; ++t)
          for (int64_t d = 0; d < Dk; ++d) {
            Qh[t * Dk + d] = rnd(r.tiles, p.scale * q[t * Dk + d] * std::exp(b[t * Dk + d]));
            Kb[t * Dk + d] =
                rnd(r.tiles, k[t * Dk + d] * std::exp(b[(C - 1) * Dk + d] - b[t * Dk + d]));
          }
        for (int64_t d = 0; d < Dk; ++d) decay[d] = std::exp(b[(C - 1) * Dk + d]);

        // W (delta rules) and U.
        Vec W(C * Dk, 0), U(C * Dv, 0);
        if (!delta) {
          U = v;
        } else {
          // T = (I + diag(beta) M)^{-1} by forward substitution (lower, unit diagonal).
          Vec M(C * C, 0), Tm(C * C, 0);
          for (int64_t t = 0; t < C; ++t)
            for (int64_t s = 0; s < t; ++s) M[t * C + s] = gram(k, k, t, s);
          for (int64_t t = 0; t < C; ++t) {
            Tm[t * C + t] = 1;
            for (int64_t c = 0; c < t; ++c) {
              double x = 0;
              for (int64_t s = c; s < t; ++s) x += beta[t] * M[t * C + s] * Tm[s * C + c];
              Tm[t * C + c] = -x;
            }
          }
          for (int64_t t = 0; t < C; ++t) {
            for (int64_t d = 0; d < Dk; ++d) {
              double x = 0;
              for (int64_t s = 0; s <= t; ++s)
                x += rnd(r.tx_single, Tm[t * C + s]) *
                     rnd(r.tx_single, beta[s] * k[s * Dk + d] * std::exp(b[s * Dk + d]));
              W[t * Dk + d] = rnd(r.tiles, x);
            }
            for (int64_t j = 0; j < Dv; ++j) {
              double x = 0;
              for (int64_t s = 0; s <= t; ++s)
                x += rnd(r.tx_single, Tm[t * C + s]) * rnd(r.tx_single, beta[s] * v[s * Dv + j]);
              U[t * Dv + j] = rnd(r.tiles, x);
            }
          }
        }

        // The scan and the output.
        Vec Sop(Dk * Dv), Vn(C * Dv);
        if (delta && r.one_product) {
          for (int64_t e = 0; e < Dk * Dv; ++e) Sop[e] = rnd(r.states, S[e]);
          Vec KW(Dk * Dk), KU(Dk * Dv), QW(C * Dk), AU(C * Dv);
          for (int64_t d = 0; d < Dk; ++d) {
            for (int64_t e = 0; e < Dk; ++e) {
              double x = 0;
              for (int64_t t = 0; t < C; ++t) x += Kb[t * Dk + d] * W[t * Dk + e];
              KW[d * Dk + e] = round_bf16(x);
            }
            for (int64_t j = 0; j < Dv; ++j) {
              double x = 0;
              for (int64_t t = 0; t < C; ++t) x += Kb[t * Dk + d] * U[t * Dv + j];
              KU[d * Dv + j] = round_bf16(x);
            }
          }
          for (int64_t t = 0; t < C; ++t) {
            for (int64_t e = 0; e < Dk; ++e) {
              double x = Qh[t * Dk + e];
              for (int64_t s = 0; s <= t; ++s) x -= A[t * C + s] * W[s * Dk + e];
              QW[t * Dk + e] = round_bf16(x);
            }
            for (int64_t j = 0; j < Dv; ++j) {
              double x = 0;
              for (int64_t s = 0; s <= t; ++s) x += A[t * C + s] * U[s * Dv + j];
              AU[t * Dv + j] = round_bf16(x);
            }
          }
          for (int64_t t = 0; t < L; ++t)
            for (int64_t j = 0; j < Dv; ++j) {
              double x = AU[t * Dv + j];
              for (int64_t d = 0; d < Dk; ++d) x += QW[t * Dk + d] * Sop[d * Dv + j];
              out.o[tok(t0 + t) * Dv + j] = rnd(r.states, x);
            }
          for (int64_t d = 0; d < Dk; ++d)
            for (int64_t j = 0; j < Dv; ++j) {
              double x = decay[d] * S[d * Dv + j] + KU[d * Dv + j];
              for (int64_t e = 0; e < Dk; ++e) x -= KW[d * Dk + e] * Sop[e * Dv + j];
              S[d * Dv + j] = x;
            }
          continue;
        }
        for (int64_t e = 0; e < Dk * Dv; ++e) Sop[e] = rnd(r.states, S[e]);
        for (int64_t t = 0; t < C; ++t)
          for (int64_t j = 0; j < Dv; ++j) {
            double x = U[t * Dv + j];
            if (delta)
              for (int64_t d = 0; d < Dk; ++d) x -= W[t * Dk + d] * Sop[d * Dv + j];
            Vn[t * Dv + j] = rnd(r.states, x);
          }
        for (int64_t t = 0; t < L; ++t)
          for (int64_t j = 0; j < Dv; ++j) {
            double x = 0;
            for (int64_t d = 0; d < Dk; ++d) x += Qh[t * Dk + d] * Sop[d * Dv + j];
            for (int64_t s = 0; s <= t; ++s) x += A[t * C + s] * Vn[s * Dv + j];
            out.o[tok(t0 + t) * Dv + j] = rnd(r.states, x);
          }
        for (int64_t d = 0; d < Dk; ++d)
          for (int64_t j = 0; j < Dv; ++j) {
            double x = decay[d] * S[d * Dv + j];
            for (int64_t t = 0; t < C; ++t) x += Kb[t * Dk + d] * Vn[t * Dv + j];
            S[d * Dv + j] = x;
          }
      }
      for (int64_t e = 0; e < Dk * Dv; ++e) out.ht[(n * H + h) * Dk * Dv + e] = S[e];
    }
  }
  return out;
}

}  // namespace statescan::test
