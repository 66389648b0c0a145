// Host model (fp64, plain loops) of the chunkwise backward that the CUDA
// kernels in kernels/cuda/chunk_backward.cuh implement, phase for phase:
//   1. states entering every chunk (the forward's chunk_states),
//   2. the reverse scan over chunks: dV' = A^T dO + K_ dS_{c+1},
//      dS_c = diag(gamma) dS_{c+1} + Q^^T dO - W^T dV',
//   3. per chunk, the intra-chunk gradients with every exponential written as
//      a difference b_t - b_s <= 0 (never e^{-b} alone).
// It exists to check the derivation against ref::backward before the GPU;
// tests/test_chunk_bwd_model.cpp runs it on tiny shapes. With a ModelRounding
// it also rounds to bf16 where the 16-bit GPU kernels round (or would), so
// their precision can be studied on the CPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/options.h"
#include "kernels/cpu/reference.h"
#include "tests/chunk_model.h"

namespace statescan::test {

// Where the model rounds a value to bf16 as a tensor-core operand (the fp64
// value is kept everywhere else). All false: the exact chunkwise algorithm.
struct ModelRounding {
  // What the 16-bit kernels do (2026-11-30, backward b10):
  bool prepared = false;        // the prepare stage's W, U, K_, Q^, A tiles (bf16 workspace)
  bool states = false;          // S, dS, V' and -dV' as operands of the forward and reverse scans
  bool state_products = false;  // V', dV' as operands of gk = V' dS^T, dW = -dV' S^T (b8)
  // The intra-chunk kernels (PERF_NOTES, b11): operands of their products.
  bool intra_cc = false;  // T, dA, dT, tmp = dT T^T and dMm (C x C)
  bool intra_cd = false;  // q, k, v, dO, V', dV', dW, K^ (C x D)
  // Vector gates (chunk_intra_grad_vector_kernel; with intra_cd): the decayed
  // path products round the operand scaled to a 16-row reference row,
  // x_s e^{b_rho - b_s} (rho the last row of s's block) or y_r e^{b_r - b_rho'}
  // (rho' the last row of the block before r's; 0 before the chunk), and
  // apply the rest of the decay in full precision, as the kernel's
  // tensor-core form does: in the blocks below the diagonal always, in the
  // diagonal blocks only with reference_rows_diagonal (the kernel's fast path;
  // otherwise they round the plain operand, as its exact CUDA-core path).
  bool reference_rows = false;
  bool reference_rows_diagonal = false;
  // The gate gradient db = gq q - gk k (+ the delta rule's terms) and the K_
  // path's column sums from the rounded operand copies of q and k (the values
  // the products used) instead of the exact normalised q, k: each in-chunk
  // pair then cancels in dg's reverse cumsum as it does in exact arithmetic
  // (planned for the kernels; test_chunk_bwd_model says why).
  bool db_from_operands = false;
  // A candidate, not what the kernels run (PERF_NOTES, "Next steps"): the
  // delta rules' scans as one product per chunk step, with KW = K_^T W, KU =
  // K_^T U and G = (Q^ - A W)^T dO formed per chunk from the tiles and rounded
  // to bf16 once: forward S <- diag(decay) S + KU - KW S, reverse
  // dS <- diag(decay) dS + G - KW^T dS (dV' for the gradients as before).
  bool one_product = false;
};

inline ref::Grads chunk_backward_model(const ref::Problem& p, const std::vector<double>& d_o,
                                       const std::vector<double>& dht, int64_t C,
                                       const ModelRounding& rounding = {}) {
  using Vec = std::vector<double>;
  auto rnd_if = [](bool on) { return [on](double x) { return on ? round_bf16(x) : x; }; };
  const auto r_prep = rnd_if(rounding.prepared), r_state = rnd_if(rounding.states),
             r_sp = rnd_if(rounding.state_products), r_cc = rnd_if(rounding.intra_cc),
             r_cd = rnd_if(rounding.intra_cd);
  const VariantSpec spec = spec_of(p.variant);
  const bool delta = spec.rule == Rule::delta;
  const bool vec_gate = spec.decay == Decay::vector, scalar_gate = spec.decay == Decay::scalar;
  const int64_t H = p.heads, Dk = p.dk, Dv = p.dv, T = p.seq_len;
  const int64_t N = p.num_sequences();
  ref::Grads out;
  out.dq.assign(p.q.size(), 0);
  out.dk.assign(p.k.size(), 0);
  out.dv.assign(p.v.size(), 0);
  out.dg.assign(p.g.size(), 0);
  out.dbeta.assign(p.beta.size(), 0);
  out.dh0.assign(static_cast<size_t>(N * H * Dk * Dv), 0);

  for (int64_t n = 0; n < N; ++n) {
    const ref::Sequence seq = p.sequence(n);
    const int64_t row = seq.row, begin = seq.begin, end = seq.end;
    const int64_t nchunks = (end - begin + C - 1) / C;
    for (int64_t h = 0; h < H; ++h) {
      auto tok = [&](int64_t t) { return (row * T + t) * H + h; };
      // Per-chunk inputs (tests/chunk_model.h) and dO (padded rows zero).
      struct Chunk : ModelChunk {
        Vec dO;
      };
      std::vector<Chunk> ch(static_cast<size_t>(nchunks));
      for (int64_t c = 0; c < nchunks; ++c) {
        Chunk& x = ch[c];
        static_cast<ModelChunk&>(x) = model_chunk(p, row, h, begin + c * C, end, C);
        x.dO.assign(C * Dv, 0);
        for (int64_t t = 0; t < x.L; ++t)
          for (int64_t j = 0; j < Dv; ++j) x.dO[t * Dv + j] = d_o[tok(x.t0 + t) * Dv + j];
      }
      auto e = [&](const Chunk& x, int64_t t, int64_t s, int64_t d) {
        return std::exp(x.b[t * Dk + d] - x.b[s * Dk + d]);
      };
      // q and k as the gate gradient takes them (ModelRounding::db_from_operands).
      auto q_db = [&](const Chunk& x, int64_t t, int64_t d) {
        return rounding.db_from_operands ? r_cd(x.q[t * Dk + d]) : x.q[t * Dk + d];
      };
      auto k_db = [&](const Chunk& x, int64_t t, int64_t d) {
        return rounding.db_from_operands ? r_cd(x.k[t * Dk + d]) : x.k[t * Dk + d];
      };
      // One term of a decayed path product: operand xv of source row s (the
      // row the sum runs over), target row t, dimension d: xv e^{b_t - b_s}
      // (fwd: s <= t) or xv e^{b_s - b_t} (!fwd: s >= t), with the operand
      // rounded as ModelRounding says.
      auto path_term = [&](const Chunk& x, double xv, int64_t t, int64_t s, int64_t d, bool fwd) {
        const bool diagonal = s / 16 == t / 16;
        if (!vec_gate || !rounding.reference_rows ||
            (diagonal && !rounding.reference_rows_diagonal))
          return r_cd(xv) * (fwd ? e(x, t, s, d) : e(x, s, t, d));
        const int64_t blk = s / 16;
        const double bref =
            fwd ? x.b[(16 * blk + 15) * Dk + d] : (blk == 0 ? 0.0 : x.b[(16 * blk - 1) * Dk + d]);
        const double bs = x.b[s * Dk + d], bt = x.b[t * Dk + d];
        return fwd ? r_cd(xv * std::exp(bref - bs)) * std::exp(bt - bref)
                   : r_cd(xv * std::exp(bs - bref)) * std::exp(bref - bt);
      };
      // Per chunk: A, KK (raw k k~ products), T, W, U.
      auto intra = [&](const Chunk& x, Vec& A, Vec& KK, Vec& Tm, Vec& W, Vec& U) {
        A.assign(C * C, 0);
        KK.assign(C * C, 0);
        for (int64_t t = 0; t < C; ++t)
          for (int64_t s = 0; s <= t; ++s) {
            double a = 0, m = 0;
            for (int64_t d = 0; d < Dk; ++d) {
              a += x.q[t * Dk + d] * x.k[s * Dk + d] * e(x, t, s, d);
              m += x.k[t * Dk + d] * x.k[s * Dk + d] * e(x, t, s, d);
            }
            A[t * C + s] = r_prep(p.scale * a);
            if (s < t) KK[t * C + s] = m;
          }
        Tm.assign(C * C, 0);
        W.assign(C * Dk, 0);
        U = x.v;
        if (!delta) return;
        for (int64_t s = 0; s < C; ++s)
          for (int64_t t = 0; t < C; ++t) {
            double acc = t == s ? 1 : 0;
            for (int64_t r = s; r < t; ++r) acc -= x.beta[t] * KK[t * C + r] * Tm[r * C + s];
            Tm[t * C + s] = acc;
          }
        for (int64_t t = 0; t < C; ++t) {
          for (int64_t d = 0; d < Dk; ++d) {
            double acc = 0;
            for (int64_t s = 0; s <= t; ++s)
              acc += Tm[t * C + s] * x.beta[s] * x.k[s * Dk + d] * std::exp(x.b[s * Dk + d]);
            W[t * Dk + d] = r_prep(acc);
          }
          for (int64_t j = 0; j < Dv; ++j) {
            double acc = 0;
            for (int64_t s = 0; s <= t; ++s) acc += Tm[t * C + s] * x.beta[s] * x.v[s * Dv + j];
            U[t * Dv + j] = r_prep(acc);
          }
        }
      };
      // The one-product form's per-chunk tiles (ModelRounding::one_product):
      // K_ as the prepare stage stores it, KW = K_^T W rounded once.
      auto kbar = [&](const Chunk& x, int64_t t, int64_t d) {
        return r_prep(x.k[t * Dk + d] * std::exp(x.b[(C - 1) * Dk + d] - x.b[t * Dk + d]));
      };
      auto kw_of = [&](const Chunk& x, const Vec& W) {
        Vec KW(Dk * Dk);
        for (int64_t d = 0; d < Dk; ++d)
          for (int64_t e2 = 0; e2 < Dk; ++e2) {
            double acc = 0;
            for (int64_t t = 0; t < C; ++t) acc += kbar(x, t, d) * W[t * Dk + e2];
            KW[d * Dk + e2] = round_bf16(acc);
          }
        return KW;
      };
      // 1. forward chunk states.
      std::vector<Vec> S(static_cast<size_t>(nchunks + 1), Vec(Dk * Dv, 0));
      if (!p.h0.empty())
        for (int64_t i = 0; i < Dk * Dv; ++i) S[0][i] = p.h0[(n * H + h) * Dk * Dv + i];
      std::vector<Vec> Vp(static_cast<size_t>(nchunks));
      for (int64_t c = 0; c < nchunks; ++c) {
        const Chunk& x = ch[c];
        Vec A, KK, Tm, W, U;
        intra(x, A, KK, Tm, W, U);
        Vp[c] = U;
        for (int64_t t = 0; t < C; ++t)
          for (int64_t j = 0; j < Dv; ++j)
            for (int64_t d = 0; d < Dk; ++d)
              Vp[c][t * Dv + j] -= W[t * Dk + d] * r_state(S[c][d * Dv + j]);
        if (delta && rounding.one_product) {
          const Vec KW = kw_of(x, W);
          for (int64_t d = 0; d < Dk; ++d)
            for (int64_t j = 0; j < Dv; ++j) {
              double ku = 0;
              for (int64_t t = 0; t < C; ++t) ku += kbar(x, t, d) * U[t * Dv + j];
              double s = std::exp(x.b[(C - 1) * Dk + d]) * S[c][d * Dv + j] + round_bf16(ku);
              for (int64_t e2 = 0; e2 < Dk; ++e2) s -= KW[d * Dk + e2] * r_state(S[c][e2 * Dv + j]);
              S[c + 1][d * Dv + j] = s;
            }
          continue;
        }
        for (int64_t d = 0; d < Dk; ++d)
          for (int64_t j = 0; j < Dv; ++j) {
            double s = std::exp(x.b[(C - 1) * Dk + d]) * S[c][d * Dv + j];
            for (int64_t t = 0; t < C; ++t)
              s += r_prep(x.k[t * Dk + d] * std::exp(x.b[(C - 1) * Dk + d] - x.b[t * Dk + d])) *
                   r_state(Vp[c][t * Dv + j]);
            S[c + 1][d * Dv + j] = s;
          }
      }
      // 2. reverse scan.
      std::vector<Vec> dS(static_cast<size_t>(nchunks + 1), Vec(Dk * Dv, 0));
      if (!dht.empty())
        for (int64_t i = 0; i < Dk * Dv; ++i) dS[nchunks][i] = dht[(n * H + h) * Dk * Dv + i];
      std::vector<Vec> dVp(static_cast<size_t>(nchunks));
      for (int64_t c = nchunks - 1; c >= 0; --c) {
        const Chunk& x = ch[c];
        Vec A, KK, Tm, W, U;
        intra(x, A, KK, Tm, W, U);
        Vec& dv = dVp[c];
        dv.assign(C * Dv, 0);
        for (int64_t t = 0; t < C; ++t)
          for (int64_t j = 0; j < Dv; ++j) {
            double acc = 0;
            for (int64_t r = t; r < C; ++r) acc += A[r * C + t] * x.dO[r * Dv + j];
            for (int64_t d = 0; d < Dk; ++d)
              acc += r_prep(x.k[t * Dk + d] * std::exp(x.b[(C - 1) * Dk + d] - x.b[t * Dk + d])) *
                     r_state(dS[c + 1][d * Dv + j]);
            dv[t * Dv + j] = acc;
          }
        if (delta && rounding.one_product) {
          // G = (Q^ - A W)^T dO with Q^ - A W rounded as the forward's output
          // operand, G rounded once; dS <- diag(decay) dS + G - KW^T dS.
          const Vec KW = kw_of(x, W);
          Vec QW(C * Dk);
          for (int64_t t = 0; t < C; ++t)
            for (int64_t d = 0; d < Dk; ++d) {
              double acc = r_prep(p.scale * x.q[t * Dk + d] * std::exp(x.b[t * Dk + d]));
              for (int64_t s2 = 0; s2 <= t; ++s2) acc -= A[t * C + s2] * W[s2 * Dk + d];
              QW[t * Dk + d] = round_bf16(acc);
            }
          for (int64_t d = 0; d < Dk; ++d)
            for (int64_t j = 0; j < Dv; ++j) {
              double g = 0;
              for (int64_t t = 0; t < C; ++t) g += QW[t * Dk + d] * x.dO[t * Dv + j];
              double acc = std::exp(x.b[(C - 1) * Dk + d]) * dS[c + 1][d * Dv + j] + round_bf16(g);
              for (int64_t e2 = 0; e2 < Dk; ++e2)
                acc -= KW[e2 * Dk + d] * r_state(dS[c + 1][e2 * Dv + j]);
              dS[c][d * Dv + j] = acc;
            }
          continue;
        }
        for (int64_t d = 0; d < Dk; ++d)
          for (int64_t j = 0; j < Dv; ++j) {
            double acc = std::exp(x.b[(C - 1) * Dk + d]) * dS[c + 1][d * Dv + j];
            for (int64_t t = 0; t < C; ++t) {
              acc +=
                  r_prep(p.scale * x.q[t * Dk + d] * std::exp(x.b[t * Dk + d])) * x.dO[t * Dv + j];
              acc -= W[t * Dk + d] * r_state(dv[t * Dv + j]);
            }
            dS[c][d * Dv + j] = acc;
          }
      }
      for (int64_t i = 0; i < Dk * Dv; ++i) out.dh0[(n * H + h) * Dk * Dv + i] = dS[0][i];
      // 3. per-chunk gradients.
      for (int64_t c = 0; c < nchunks; ++c) {
        const Chunk& x = ch[c];
        Vec A, KK, Tm, W, U;
        intra(x, A, KK, Tm, W, U);
        const Vec& Sc = S[c];
        const Vec& dSn = dS[c + 1];
        const Vec& vp = Vp[c];
        const Vec& dvp = dVp[c];
        Vec dA(C * C, 0), gq(C * Dk, 0), gk(C * Dk, 0), db(C * Dk, 0), dW(C * Dk, 0);
        Vec dbeta(C, 0), dvout(C * Dv, 0), dgamma(Dk, 0), colsum(Dk, 0);
        for (int64_t t = 0; t < C; ++t)
          for (int64_t s = 0; s <= t; ++s) {
            double acc = 0;
            for (int64_t j = 0; j < Dv; ++j) acc += x.dO[t * Dv + j] * r_cd(vp[s * Dv + j]);
            dA[t * C + s] = acc;
          }
        for (int64_t t = 0; t < C; ++t)
          for (int64_t d = 0; d < Dk; ++d) {
            const double eb = std::exp(x.b[t * Dk + d]);
            const double ebar = std::exp(x.b[(C - 1) * Dk + d] - x.b[t * Dk + d]);
            double os = 0, vs = 0, ws = 0;
            for (int64_t j = 0; j < Dv; ++j) {
              os += x.dO[t * Dv + j] * r_state(Sc[d * Dv + j]);
              vs += r_sp(vp[t * Dv + j]) * r_state(dSn[d * Dv + j]);
              ws += r_sp(dvp[t * Dv + j]) * r_state(Sc[d * Dv + j]);
            }
            double qa = 0, ka = 0;
            for (int64_t s = 0; s <= t; ++s)
              qa += r_cc(dA[t * C + s]) * path_term(x, x.k[s * Dk + d], t, s, d, true);
            for (int64_t r = t; r < C; ++r)
              ka += r_cc(dA[r * C + t]) * path_term(x, x.q[r * Dk + d], t, r, d, false);
            gq[t * Dk + d] = p.scale * (eb * os + qa);
            const double gkbar = ebar * vs, gkt = p.scale * ka;
            gk[t * Dk + d] = gkbar + gkt;
            db[t * Dk + d] = gq[t * Dk + d] * q_db(x, t, d) - (gkbar + gkt) * k_db(x, t, d);
            colsum[d] += gkbar * k_db(x, t, d);
            dW[t * Dk + d] = -ws;
          }
        for (int64_t d = 0; d < Dk; ++d)
          for (int64_t j = 0; j < Dv; ++j) dgamma[d] += dSn[d * Dv + j] * Sc[d * Dv + j];
        if (delta) {
          Vec TdU(C * Dv, 0), TdW(C * Dk, 0), dT(C * C, 0), tmp(C * C, 0), dM(C * C, 0);
          for (int64_t s = 0; s < C; ++s) {
            for (int64_t j = 0; j < Dv; ++j) {
              double acc = 0;
              for (int64_t t = s; t < C; ++t) acc += r_cc(Tm[t * C + s]) * r_cd(dvp[t * Dv + j]);
              TdU[s * Dv + j] = acc;
            }
            for (int64_t d = 0; d < Dk; ++d) {
              double acc = 0;
              for (int64_t t = s; t < C; ++t) acc += r_cc(Tm[t * C + s]) * r_cd(dW[t * Dk + d]);
              TdW[s * Dk + d] = acc;
            }
          }
          for (int64_t t = 0; t < C; ++t) {
            for (int64_t j = 0; j < Dv; ++j) {
              dvout[t * Dv + j] = x.beta[t] * TdU[t * Dv + j];
              dbeta[t] += TdU[t * Dv + j] * x.v[t * Dv + j];
            }
            for (int64_t d = 0; d < Dk; ++d) {
              const double eb = std::exp(x.b[t * Dk + d]);
              dbeta[t] += TdW[t * Dk + d] * x.k[t * Dk + d] * eb;
              const double gkh = x.beta[t] * eb * TdW[t * Dk + d];
              gk[t * Dk + d] += gkh;
              db[t * Dk + d] += gkh * k_db(x, t, d);
            }
          }
          // dT only matters strictly below the diagonal: T's perturbations
          // -T dMm T are strictly lower triangular.
          for (int64_t t = 0; t < C; ++t)
            for (int64_t s = 0; s < t; ++s) {
              double acc = 0;
              for (int64_t j = 0; j < Dv; ++j) acc += r_cd(dvp[t * Dv + j]) * x.v[s * Dv + j];
              for (int64_t d = 0; d < Dk; ++d)
                acc += r_cd(dW[t * Dk + d]) * r_cd(x.k[s * Dk + d] * std::exp(x.b[s * Dk + d]));
              dT[t * C + s] = x.beta[s] * acc;
            }
          for (int64_t t = 0; t < C; ++t)
            for (int64_t s = 0; s < C; ++s) {
              double acc = 0;
              for (int64_t r = 0; r < C; ++r) acc += r_cc(dT[t * C + r]) * r_cc(Tm[s * C + r]);
              tmp[t * C + s] = acc;
            }
          for (int64_t t = 0; t < C; ++t)
            for (int64_t s = 0; s < t; ++s) {
              double acc = 0;
              for (int64_t r = 0; r < C; ++r) acc += r_cc(Tm[r * C + t]) * r_cc(tmp[r * C + s]);
              dM[t * C + s] = -acc;
            }
          for (int64_t t = 0; t < C; ++t) {
            for (int64_t s = 0; s < t; ++s) dbeta[t] += dM[t * C + s] * KK[t * C + s];
            for (int64_t d = 0; d < Dk; ++d) {
              double kh = 0, kt = 0;
              for (int64_t s = 0; s < t; ++s)
                kh += r_cc(dM[t * C + s]) * path_term(x, x.k[s * Dk + d], t, s, d, true);
              for (int64_t r = t + 1; r < C; ++r)
                kt +=
                    r_cc(x.beta[r] * dM[r * C + t]) * path_term(x, x.k[r * Dk + d], t, r, d, false);
              kh *= x.beta[t];
              gk[t * Dk + d] += kh + kt;
              db[t * Dk + d] += (kh - kt) * k_db(x, t, d);
            }
          }
        } else {
          dvout = dvp;
        }
        for (int64_t d = 0; d < Dk; ++d)
          db[(x.L - 1) * Dk + d] += colsum[d] + dgamma[d] * std::exp(x.b[(C - 1) * Dk + d]);
        // Outputs.
        for (int64_t t = 0; t < x.L; ++t) {
          const int64_t i = tok(x.t0 + t);
          double qg = 0, kg = 0;
          for (int64_t d = 0; d < Dk; ++d) {
            qg += x.q[t * Dk + d] * gq[t * Dk + d];
            kg += x.k[t * Dk + d] * gk[t * Dk + d];
          }
          for (int64_t d = 0; d < Dk; ++d) {
            double dq = gq[t * Dk + d], dk = gk[t * Dk + d];
            if (p.l2norm_qk) {
              dq = x.rq[t] * (dq - x.q[t * Dk + d] * qg);
              dk = x.rk[t] * (dk - x.k[t * Dk + d] * kg);
            }
            out.dq[i * Dk + d] = dq;
            out.dk[i * Dk + d] = dk;
          }
          for (int64_t j = 0; j < Dv; ++j) out.dv[i * Dv + j] = dvout[t * Dv + j];
          if (delta) out.dbeta[i] = dbeta[t];
          if (vec_gate)
            for (int64_t d = 0; d < Dk; ++d) {
              double acc = 0;
              for (int64_t r = t; r < x.L; ++r) acc += db[r * Dk + d];
              out.dg[i * Dk + d] = acc;
            }
          if (scalar_gate) {
            double acc = 0;
            for (int64_t r = t; r < x.L; ++r)
              for (int64_t d = 0; d < Dk; ++d) acc += db[r * Dk + d];
            out.dg[i] = acc;
          }
        }
      }
    }
  }
  return out;
}

}  // namespace statescan::test
