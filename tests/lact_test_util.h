// Helpers for the LaCT suites: random problems, option cases with readable
// names, runs of the kernel (unsharded) and of LactLayer (on one rank's
// slices) that return every output as a flat vector, and the comparison of a
// rank's slices with an unsharded run.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "kernels/cpu/lact.h"
#include "parallel/lact_layer.h"
#include "tests/test_util.h"

namespace statescan::test {

struct LactSizes {
  int64_t batch = 2, seq_len = 12, heads = 2, dim = 4, hidden = 6;
};

struct LactProblem {
  LactSizes s;
  std::vector<double> q, k, v, lr0, lr1, lr2, w0, w1, w2, d_o;
};

// q, k unit-norm per head, v ~ N(0,1); W0, W2 ~ N(0,1) so that the SwiGLU
// pre-activations are O(1) (silu's curvature matters), W1 ~ N(0, 1/M);
// learning rates in (0.01, 0.11), the cotangent d_o ~ N(0,1).
inline LactProblem random_lact_problem(const LactSizes& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  LactProblem p;
  p.s = s;
  const auto tokens = static_cast<std::size_t>(s.batch * s.seq_len * s.heads);
  const auto weights = static_cast<std::size_t>(s.heads * s.hidden * s.dim);
  p.q = randn(tokens * s.dim, rng);
  p.k = randn(tokens * s.dim, rng);
  l2_normalise(p.q, s.dim);
  l2_normalise(p.k, s.dim);
  p.v = randn(tokens * s.dim, rng);
  for (auto* lr : {&p.lr0, &p.lr1, &p.lr2}) {
    *lr = randn(tokens, rng);
    for (auto& e : *lr) e = 0.01 + 0.1 * sigmoid(e);
  }
  p.w0 = randn(weights, rng);
  p.w1 = randn(weights, rng, 1.0 / std::sqrt(static_cast<double>(s.hidden)));
  p.w2 = randn(weights, rng);
  p.d_o = randn(tokens * s.dim, rng);
  return p;
}

// Every input rounded to float, so that fp32 and fp64 runs see the same data.
inline LactProblem rounded(LactProblem p) {
  for (auto* x : {&p.q, &p.k, &p.v, &p.lr0, &p.lr1, &p.lr2, &p.w0, &p.w1, &p.w2, &p.d_o})
    *x = round_f32(*x);
  return p;
}

// One combination of the layer's options.
struct LactCase {
  LactSchedule schedule = LactSchedule::apply_then_update;
  bool momentum = false, muon = false, renorm = false;

  LactConfig config(int64_t chunk) const {
    LactConfig c;
    c.chunk = chunk;
    c.schedule = schedule;
    c.momentum = momentum ? 0.7 : 0.0;
    c.muon_steps = muon ? kDefaultMuonSteps : 0;
    c.renorm = renorm;
    return c;
  }
};

inline std::string lact_case_name(const LactCase& c) {
  return std::string(c.schedule == LactSchedule::apply_then_update ? "causal" : "bidir") +
         (c.momentum ? "_momentum" : "") + (c.muon ? "_muon" : "") + (c.renorm ? "_renorm" : "") +
         (!c.momentum && !c.muon && !c.renorm ? "_plain" : "");
}

// Readable parameter in test names (gtest_discover_tests puts it in the ctest name).
inline void PrintTo(const LactCase& c, std::ostream* os) {
  *os << lact_case_name(c);
}

inline std::vector<LactCase> all_lact_cases() {
  std::vector<LactCase> cases;
  for (LactSchedule s : {LactSchedule::apply_then_update, LactSchedule::update_then_apply})
    for (bool mom : {false, true})
      for (bool muon : {false, true})
        for (bool renorm : {false, true}) cases.push_back({s, mom, muon, renorm});
  return cases;
}

template <typename T>
struct LactResult {
  std::vector<T> o, dq, dk, dv, dlr0, dlr1, dlr2, dw0, dw1, dw2;
};

template <typename T>
std::vector<T> as(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

// Rank r's outputs of a layer sharded over P ranks (LaCT's chunk-interleaved
// layout, lact_shard) against an unsharded run: the token outputs within
// out_tol (o) and grad_tol (dq, dk, dv), the learning rates' within rate_tol,
// the weight gradients (every rank holds all of them) within grad_tol.
struct ShardTolerances {
  double out, grad, rate;
};
template <typename T>
void expect_slices_match(const LactResult<T>& mine, const LactResult<double>& full,
                         const LactSizes& s, int64_t chunk, int P, int r,
                         const ShardTolerances& tol) {
  auto local = [&](const std::vector<double>& x, int64_t inner) {
    return lact_shard(x, s.batch, s.seq_len, inner, chunk, P, r);
  };
  const int64_t HD = s.heads * s.dim, H = s.heads;
  EXPECT_LE(rel_rms(mine.o, local(full.o, HD)), tol.out) << "rank " << r << " o";
  EXPECT_LE(rel_rms(mine.dq, local(full.dq, HD)), tol.grad) << "rank " << r << " dq";
  EXPECT_LE(rel_rms(mine.dk, local(full.dk, HD)), tol.grad) << "rank " << r << " dk";
  EXPECT_LE(rel_rms(mine.dv, local(full.dv, HD)), tol.grad) << "rank " << r << " dv";
  EXPECT_LE(rel_rms(mine.dlr0, local(full.dlr0, H)), tol.rate) << "rank " << r << " dlr0";
  EXPECT_LE(rel_rms(mine.dlr1, local(full.dlr1, H)), tol.rate) << "rank " << r << " dlr1";
  EXPECT_LE(rel_rms(mine.dlr2, local(full.dlr2, H)), tol.rate) << "rank " << r << " dlr2";
  EXPECT_LE(rel_rms(mine.dw0, full.dw0), tol.grad) << "rank " << r << " dw0";
  EXPECT_LE(rel_rms(mine.dw1, full.dw1), tol.grad) << "rank " << r << " dw1";
  EXPECT_LE(rel_rms(mine.dw2, full.dw2), tol.grad) << "rank " << r << " dw2";
}

// Kernel params over the given (typed) inputs of a problem; unsharded.
template <typename T>
struct LactInputs {
  std::vector<T> q, k, v, lr0, lr1, lr2, w0, w1, w2, d_o;
  explicit LactInputs(const LactProblem& p)
      : q(as<T>(p.q)),
        k(as<T>(p.k)),
        v(as<T>(p.v)),
        lr0(as<T>(p.lr0)),
        lr1(as<T>(p.lr1)),
        lr2(as<T>(p.lr2)),
        w0(as<T>(p.w0)),
        w1(as<T>(p.w1)),
        w2(as<T>(p.w2)),
        d_o(as<T>(p.d_o)) {}

  LactParams<T> params(const LactSizes& s, const LactConfig& cfg, T* o) const {
    LactParams<T> p;
    p.config = cfg;
    p.batch = s.batch;
    p.seq_len = s.seq_len;
    p.heads = s.heads;
    p.dim = s.dim;
    p.hidden = s.hidden;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.lr0 = lr0.data();
    p.lr1 = lr1.data();
    p.lr2 = lr2.data();
    p.w0 = w0.data();
    p.w1 = w1.data();
    p.w2 = w2.data();
    p.o = o;
    return p;
  }
};

// Rank `rank`'s slices (of `ranks`) of the token tensors of a problem; the
// weights and sizes stay global.
inline LactProblem shard_problem(const LactProblem& p, int64_t chunk, int ranks, int rank) {
  LactProblem local = p;
  const int64_t HD = p.s.heads * p.s.dim;
  auto cut = [&](const std::vector<double>& x, int64_t inner) {
    return lact_shard(x, p.s.batch, p.s.seq_len, inner, chunk, ranks, rank);
  };
  local.q = cut(p.q, HD);
  local.k = cut(p.k, HD);
  local.v = cut(p.v, HD);
  local.d_o = cut(p.d_o, HD);
  local.lr0 = cut(p.lr0, p.s.heads);
  local.lr1 = cut(p.lr1, p.s.heads);
  local.lr2 = cut(p.lr2, p.s.heads);
  return local;
}

// Forward (and backward) of the kernel in precision T: on the whole problem,
// or on rank `rank`'s slices with `all_reduce` summing over the group (then
// o, dq, ... are local slices and dw0..2 full).
template <typename T>
LactResult<T> run_lact_kernel(const LactProblem& pr, const LactConfig& cfg, bool backward = true,
                              int ranks = 1, int rank = 0,
                              const LactAllReduce<T>& all_reduce = {}) {
  const LactInputs<T> in(ranks == 1 ? pr : shard_problem(pr, cfg.chunk, ranks, rank));
  LactResult<T> r;
  r.o.assign(in.q.size(), T(0));
  LactParams<T> p = in.params(pr.s, cfg, r.o.data());
  p.ranks = ranks;
  p.rank = rank;
  LactCheckpoints<T> saved;
  lact_forward<T>(p, all_reduce, backward ? &saved : nullptr);
  if (!backward) return r;
  r.dq.resize(in.q.size());
  r.dk.resize(in.k.size());
  r.dv.resize(in.v.size());
  r.dlr0.resize(in.lr0.size());
  r.dlr1.resize(in.lr1.size());
  r.dlr2.resize(in.lr2.size());
  r.dw0.resize(in.w0.size());
  r.dw1.resize(in.w1.size());
  r.dw2.resize(in.w2.size());
  LactGradParams<T> g;
  g.d_o = in.d_o.data();
  g.dq = r.dq.data();
  g.dk = r.dk.data();
  g.dv = r.dv.data();
  g.dlr0 = r.dlr0.data();
  g.dlr1 = r.dlr1.data();
  g.dlr2 = r.dlr2.data();
  g.dw0 = r.dw0.data();
  g.dw1 = r.dw1.data();
  g.dw2 = r.dw2.data();
  lact_backward<T>(p, g, saved, all_reduce);
  return r;
}

// LactLayer forward + backward on rank `rank`'s slices of the problem (of a
// group of `ranks`), outputs poisoned with NaN first so that unwritten
// elements show. o, dq, ... are local slices; dw0..2 are full. The outputs
// live in `*out` when given (so a caller can inspect them after a throw).
inline LactResult<float> run_lact_layer(
    LactLayer& layer, const LactProblem& pr, int ranks, int rank, LactResult<float>* out = nullptr,
    const std::function<void(LactBackwardArgs&)>& break_backward = {}) {
  const LactSizes& s = pr.s;
  const int64_t C = layer.config().chunk, Tl = s.seq_len / ranks;
  auto local = [&](const std::vector<double>& x, int64_t inner) {
    return as<float>(lact_shard(x, s.batch, s.seq_len, inner, C, ranks, rank));
  };
  const int64_t HD = s.heads * s.dim;
  auto q = local(pr.q, HD), k = local(pr.k, HD), v = local(pr.v, HD), d_o = local(pr.d_o, HD);
  auto lr0 = local(pr.lr0, s.heads), lr1 = local(pr.lr1, s.heads), lr2 = local(pr.lr2, s.heads);
  auto w0 = as<float>(pr.w0), w1 = as<float>(pr.w1), w2 = as<float>(pr.w2);

  const float nan = std::numeric_limits<float>::quiet_NaN();
  LactResult<float> own;
  LactResult<float>& r = out != nullptr ? *out : own;
  r.o.assign(q.size(), nan);
  r.dq.assign(q.size(), nan);
  r.dk.assign(q.size(), nan);
  r.dv.assign(q.size(), nan);
  r.dlr0.assign(lr0.size(), nan);
  r.dlr1.assign(lr0.size(), nan);
  r.dlr2.assign(lr0.size(), nan);
  r.dw0.assign(w0.size(), nan);
  r.dw1.assign(w0.size(), nan);
  r.dw2.assign(w0.size(), nan);

  const Shape tokens{s.batch, Tl, s.heads, s.dim}, rates{s.batch, Tl, s.heads};
  const Shape wide{s.heads, s.hidden, s.dim}, narrow{s.heads, s.dim, s.hidden};
  auto view = [](std::vector<float>& x, const Shape& shape) {
    return TensorView(x.data(), DType::f32, shape);
  };
  LactForwardArgs fa;
  fa.q = view(q, tokens);
  fa.k = view(k, tokens);
  fa.v = view(v, tokens);
  fa.lr0 = view(lr0, rates);
  fa.lr1 = view(lr1, rates);
  fa.lr2 = view(lr2, rates);
  fa.w0 = view(w0, wide);
  fa.w1 = view(w1, narrow);
  fa.w2 = view(w2, wide);
  fa.o = view(r.o, tokens);
  layer.forward(fa);

  LactBackwardArgs ba;
  ba.d_o = view(d_o, tokens);
  ba.dq = view(r.dq, tokens);
  ba.dk = view(r.dk, tokens);
  ba.dv = view(r.dv, tokens);
  ba.dlr0 = view(r.dlr0, rates);
  ba.dlr1 = view(r.dlr1, rates);
  ba.dlr2 = view(r.dlr2, rates);
  ba.dw0 = view(r.dw0, wide);
  ba.dw1 = view(r.dw1, narrow);
  ba.dw2 = view(r.dw2, wide);
  if (break_backward) break_backward(ba);
  layer.backward(ba);
  return r;
}

}  // namespace statescan::test
