// What the host models of the chunkwise kernels (tests/chunk_fwd_model.h,
// tests/chunk_bwd_model.h) and their tests share: bf16 rounding as the
// kernels round, one chunk's inputs as the kernels load them, and the gate
// strengths the precision tests sweep.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/options.h"
#include "kernels/cpu/reference.h"

namespace statescan::test {

// x rounded to bf16 as the kernels' operands are (core's round_to).
inline double round_bf16(double x) {
  return round_to(DType::bf16, static_cast<float>(x));
}

// The inputs rounded to what the kernels see: q, k, v, beta to bf16 (a bf16
// tensor), the gates, h0 and the scale to fp32.
inline void round_inputs_to_bf16(ref::Problem& p) {
  for (auto* x : {&p.q, &p.k, &p.v, &p.beta})
    for (double& e : *x) e = round_bf16(e);
  for (auto* x : {&p.g, &p.h0})
    for (double& e : *x) e = static_cast<float>(e);
  p.scale = static_cast<float>(p.scale);
}

// One chunk of one head as the kernels load it: C rows from token t0 of the
// sequence that ends at `end` (row `row` of the batch without cu_seqlens),
// rows past the end zero with g = 0 (exact no-ops); q and k normalised when
// the problem asks (q without the scale), rq, rk their row factors (1
// otherwise); b the inclusive cumsum of the log gates per key dimension (a
// scalar gate is the same in every dimension).
struct ModelChunk {
  int64_t t0 = 0, L = 0;
  std::vector<double> q, k, b, v, beta, rq, rk;
};

inline ModelChunk model_chunk(const ref::Problem& p, int64_t row, int64_t h, int64_t t0,
                              int64_t end, int64_t C) {
  const VariantSpec spec = spec_of(p.variant);
  const bool vec_gate = spec.decay == Decay::vector, scalar_gate = spec.decay == Decay::scalar;
  const int64_t H = p.heads, Dk = p.dk, Dv = p.dv, T = p.seq_len;
  auto tok = [&](int64_t t) { return (row * T + t) * H + h; };
  ModelChunk x;
  x.t0 = t0;
  x.L = std::min(C, end - t0);
  x.q.assign(C * Dk, 0);
  x.k.assign(C * Dk, 0);
  x.b.assign(C * Dk, 0);
  x.v.assign(C * Dv, 0);
  x.beta.assign(C, 0);
  x.rq.assign(C, 1);
  x.rk.assign(C, 1);
  for (int64_t t = 0; t < x.L; ++t) {
    const int64_t i = tok(t0 + t);
    double qq = 0, kk = 0;
    for (int64_t d = 0; d < Dk; ++d) {
      qq += p.q[i * Dk + d] * p.q[i * Dk + d];
      kk += p.k[i * Dk + d] * p.k[i * Dk + d];
    }
    if (p.l2norm_qk) {
      x.rq[t] = 1 / std::sqrt(qq + ref::kL2NormEps);
      x.rk[t] = 1 / std::sqrt(kk + ref::kL2NormEps);
    }
    for (int64_t d = 0; d < Dk; ++d) {
      x.q[t * Dk + d] = p.q[i * Dk + d] * x.rq[t];
      x.k[t * Dk + d] = p.k[i * Dk + d] * x.rk[t];
    }
    for (int64_t j = 0; j < Dv; ++j) x.v[t * Dv + j] = p.v[i * Dv + j];
    if (spec.rule == Rule::delta) x.beta[t] = p.beta[i];
  }
  for (int64_t t = 0; t < C; ++t)
    for (int64_t d = 0; d < Dk; ++d) {
      double g = 0;
      if (t < x.L && vec_gate) g = p.g[tok(t0 + t) * Dk + d];
      if (t < x.L && scalar_gate) g = p.g[tok(t0 + t)];
      x.b[t * Dk + d] = (t > 0 ? x.b[(t - 1) * Dk + d] : 0) + g;
    }
  return x;
}

// Gate strengths of the precision tests (set_block_decay, test_util.h).
struct GateCase {
  const char* name;
  double per_block;  // e-folds of decay per 16 tokens; 0: random_problem's gates
};

inline void PrintTo(const GateCase& c, std::ostream* os) {
  *os << c.name;
}

inline constexpr GateCase kGateCases[] = {{"mild", 0.0}, {"bound", 3.5}, {"strong", 20.0}};

// Whether gate case g means something for variant v: "mild" (random_problem's
// gates, or none) for every variant, the stronger decays only with a gate.
inline bool gate_case_applies(Variant v, const GateCase& g) {
  return g.per_block == 0 || has_gate(v);
}

// Every (variant, gates, l2norm) whose gates apply: the parameters of the
// exact model tests (Combine over all of them had 80 cases that could only
// skip, strong gates on variants without a gate).
inline std::vector<std::tuple<Variant, GateCase, bool>> exact_model_cases() {
  std::vector<std::tuple<Variant, GateCase, bool>> out;
  for (Variant v : kAllVariants)
    for (const GateCase& g : kGateCases)
      if (gate_case_applies(v, g))
        for (bool l2norm : {false, true}) out.emplace_back(v, g, l2norm);
  return out;
}

// The same with a rounding case among `cases`, less those `keep` rejects
// (combinations the kernels never run).
template <typename Case, std::size_t N>
std::vector<std::tuple<Variant, Case, GateCase, bool>> rounding_model_cases(
    const Case (&cases)[N], bool (*keep)(const Case&, const GateCase&) = nullptr) {
  std::vector<std::tuple<Variant, Case, GateCase, bool>> out;
  for (Variant v : kAllVariants)
    for (const Case& c : cases)
      for (const GateCase& g : kGateCases)
        if (gate_case_applies(v, g) && (keep == nullptr || keep(c, g)))
          for (bool l2norm : {false, true}) out.emplace_back(v, c, g, l2norm);
  return out;
}

// The test name of a (variant, rounding case, gates, l2norm) parameter, e.g.
// kda_v3_bound_l2norm (`Case` has a `name`).
template <typename Case>
std::string model_case_name(const std::tuple<Variant, Case, GateCase, bool>& param) {
  return std::string(to_string(std::get<0>(param))) + "_" + std::get<1>(param).name + "_" +
         std::get<2>(param).name + (std::get<3>(param) ? "_l2norm" : "");
}

}  // namespace statescan::test
