// Tests of the fp64 reference recurrence (kernels/cpu/reference.h), the oracle
// of every other path: its backward against central finite differences, its
// forward against independent closed forms, packed sequences against separate
// runs, and its argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/reference.h"
#include "tests/test_util.h"

namespace statescan {
namespace {

using ref::Problem;
using test::ProblemSpec;
using test::random_problem;
using test::rel_rms;

// Central differences in fp64 with this step are accurate to ~1e-9 relative on
// the tiny problems below, so 1e-6 catches any wrong term yet never a rounding.
constexpr double kFdStep = 1e-6;
constexpr double kFdTolerance = 1e-6;
// Closed forms sum the same products in another order: only rounding differs.
constexpr double kClosedFormTolerance = 1e-12;
// Packed and separate runs perform identical operations.
constexpr double kSameOpsTolerance = 1e-14;

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// The scalar test loss L = <o, w_o> + <ht, w_h>; its gradients are backward()
// with do = w_o and dht = w_h.
double loss(const Problem& p, const std::vector<double>& w_o, const std::vector<double>& w_h) {
  const ref::Outputs out = ref::forward(p);
  return dot(out.o, w_o) + dot(out.ht, w_h);
}

// dL/dx for every element of the Problem field `field`, by central differences.
std::vector<double> fd_gradient(const Problem& p, std::vector<double> Problem::*field,
                                const std::vector<double>& w_o, const std::vector<double>& w_h) {
  Problem probe = p;
  std::vector<double>& x = probe.*field;
  std::vector<double> grad(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + kFdStep;
    const double up = loss(probe, w_o, w_h);
    x[i] = x0 - kFdStep;
    const double down = loss(probe, w_o, w_h);
    x[i] = x0;
    grad[i] = (up - down) / (2 * kFdStep);
  }
  return grad;
}

std::size_t state_count(const Problem& p) {
  return static_cast<std::size_t>(p.num_sequences() * p.heads * p.dk * p.dv);
}

// ---- 1. backward vs finite differences --------------------------------------

// (variant, with h0, l2norm_qk, packed sequences)
using GradParam = std::tuple<Variant, bool, bool, bool>;

class ReferenceGradient : public ::testing::TestWithParam<GradParam> {
 protected:
  Problem make_problem(uint64_t seed) const {
    const auto [variant, with_h0, l2norm, packed] = GetParam();
    ProblemSpec s;
    s.variant = variant;
    s.with_h0 = with_h0;
    s.l2norm_qk = l2norm;
    s.heads = 2;
    s.dk = 3;
    s.dv = 4;
    s.seq_len = 7;
    if (packed) {
      s.batch = 1;
      s.cu_seqlens = {0, 3, 7};
    } else {
      s.batch = 2;
    }
    return random_problem(s, seed);
  }
};

TEST_P(ReferenceGradient, MatchesCentralFiniteDifferences) {
  const auto [variant, with_h0, l2norm, packed] = GetParam();
  const Problem p =
      make_problem(1000 + 17 * static_cast<uint64_t>(variant) + 4 * with_h0 + 2 * l2norm + packed);
  std::mt19937_64 rng(7);
  const std::vector<double> w_o = test::randn(p.v.size(), rng);
  const std::vector<double> w_h = test::randn(state_count(p), rng);
  const ref::Grads grads = ref::backward(p, w_o, w_h);

  EXPECT_LE(rel_rms(grads.dq, fd_gradient(p, &Problem::q, w_o, w_h)), kFdTolerance) << "dq";
  EXPECT_LE(rel_rms(grads.dk, fd_gradient(p, &Problem::k, w_o, w_h)), kFdTolerance) << "dk";
  EXPECT_LE(rel_rms(grads.dv, fd_gradient(p, &Problem::v, w_o, w_h)), kFdTolerance) << "dv";
  if (has_gate(p.variant)) {
    EXPECT_LE(rel_rms(grads.dg, fd_gradient(p, &Problem::g, w_o, w_h)), kFdTolerance) << "dg";
  } else {
    EXPECT_TRUE(grads.dg.empty());
  }
  if (has_beta(p.variant)) {
    EXPECT_LE(rel_rms(grads.dbeta, fd_gradient(p, &Problem::beta, w_o, w_h)), kFdTolerance)
        << "dbeta";
  } else {
    EXPECT_TRUE(grads.dbeta.empty());
  }
  // Without h0 the gradient is the one at h0 = 0, which is what an explicit
  // zero initial state gives.
  Problem with_state = p;
  if (with_state.h0.empty()) with_state.h0.assign(state_count(p), 0.0);
  EXPECT_LE(rel_rms(grads.dh0, fd_gradient(with_state, &Problem::h0, w_o, w_h)), kFdTolerance)
      << "dh0";
}

std::string grad_param_name(const ::testing::TestParamInfo<GradParam>& info) {
  const auto [variant, with_h0, l2norm, packed] = info.param;
  return test::variant_name(variant) + (with_h0 ? "_h0" : "_noh0") + (l2norm ? "_l2" : "_nol2") +
         (packed ? "_packed" : "_rows");
}

INSTANTIATE_TEST_SUITE_P(AllVariants, ReferenceGradient,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Bool()),
                         grad_param_name);

// ---- 2. forward vs closed forms -----------------------------------------------

// (variant, with h0, l2norm_qk)
using ClosedFormParam = std::tuple<Variant, bool, bool>;

class ReferenceAdditiveClosedForm : public ::testing::TestWithParam<ClosedFormParam> {};

// The additive rules unrolled: with cumulative log-decay per state row i,
//   o_t = sum_i q̂_t[i] ( exp(sum_{r<=t} g_r[i]) h0[i,:]
//                        + sum_{s<=t} exp(sum_{r=s+1..t} g_r[i]) k_s[i] v_s )
//   ht  = the same with q̂ dropped and t = T.
// Linear attention has g = 0; retention broadcasts its scalar g to every row.
// q̂ = scale * q / sqrt(|q|^2 + eps) with l2norm_qk (likewise k without scale).
TEST_P(ReferenceAdditiveClosedForm, MatchesUnrolledSums) {
  const auto [variant, with_h0, l2norm] = GetParam();
  ProblemSpec s;
  s.variant = variant;
  s.with_h0 = with_h0;
  s.l2norm_qk = l2norm;
  s.batch = 2;
  s.seq_len = 9;
  s.heads = 2;
  s.dk = 5;
  s.dv = 3;
  const Problem p = random_problem(s, 77 + static_cast<uint64_t>(variant));
  const int64_t B = p.batch, T = p.seq_len, H = p.heads, Dk = p.dk, Dv = p.dv;

  auto normalised = [&](const std::vector<double>& x, int64_t at, int64_t i, double factor) {
    if (!l2norm) return factor * x[at + i];
    double sq = 0;
    for (int64_t j = 0; j < Dk; ++j) sq += x[at + j] * x[at + j];
    return factor * x[at + i] / std::sqrt(sq + ref::kL2NormEps);
  };
  // log-decay of row i at token t of batch row b, head h.
  auto log_decay = [&](int64_t b, int64_t t, int64_t h, int64_t i) {
    if (!has_gate(variant)) return 0.0;
    const int64_t th = (b * T + t) * H + h;
    return vector_gate(variant) ? p.g[th * Dk + i] : p.g[th];
  };
  auto decay_between = [&](int64_t b, int64_t h, int64_t i, int64_t from, int64_t to) {
    double sum = 0;  // sum over r in (from, to]
    for (int64_t r = from + 1; r <= to; ++r) sum += log_decay(b, r, h, i);
    return std::exp(sum);
  };
  // Contribution of state row i to the state after token t (ht when q̂ = 1).
  auto state_entry = [&](int64_t b, int64_t h, int64_t i, int64_t c, int64_t t) {
    double value =
        with_h0 ? decay_between(b, h, i, -1, t) * p.h0[((b * H + h) * Dk + i) * Dv + c] : 0.0;
    for (int64_t s_tok = 0; s_tok <= t; ++s_tok) {
      const int64_t ks = ((b * T + s_tok) * H + h) * Dk;
      value += decay_between(b, h, i, s_tok, t) * normalised(p.k, ks, i, 1.0) *
               p.v[((b * T + s_tok) * H + h) * Dv + c];
    }
    return value;
  };

  std::vector<double> o(p.v.size()), ht(state_count(p));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t qt = ((b * T + t) * H + h) * Dk;
        for (int64_t c = 0; c < Dv; ++c) {
          double value = 0;
          for (int64_t i = 0; i < Dk; ++i)
            value += normalised(p.q, qt, i, p.scale) * state_entry(b, h, i, c, t);
          o[((b * T + t) * H + h) * Dv + c] = value;
        }
      }
      for (int64_t i = 0; i < Dk; ++i)
        for (int64_t c = 0; c < Dv; ++c)
          ht[((b * H + h) * Dk + i) * Dv + c] = state_entry(b, h, i, c, T - 1);
    }

  const ref::Outputs out = ref::forward(p);
  EXPECT_LE(rel_rms(out.o, o), kClosedFormTolerance) << "o";
  EXPECT_LE(rel_rms(out.ht, ht), kClosedFormTolerance) << "ht";
}

std::string closed_form_name(const ::testing::TestParamInfo<ClosedFormParam>& info) {
  const auto [variant, with_h0, l2norm] = info.param;
  return test::variant_name(variant) + (with_h0 ? "_h0" : "_noh0") + (l2norm ? "_l2" : "_nol2");
}

INSTANTIATE_TEST_SUITE_P(AdditiveVariants, ReferenceAdditiveClosedForm,
                         ::testing::Combine(::testing::Values(Variant::linear, Variant::retention,
                                                              Variant::gla),
                                            ::testing::Bool(), ::testing::Bool()),
                         closed_form_name);

class ReferenceDeltaRule : public ::testing::TestWithParam<Variant> {};

// With beta = 1 and a unit-norm key, the delta rule overwrites what the state
// recalls at that key: S_t^T k_t = v_t exactly, whatever the decay and the
// history. So querying with q_t = k_t returns scale * v_t.
TEST_P(ReferenceDeltaRule, UnitBetaRecallsTheLatestValue) {
  ProblemSpec s;
  s.variant = GetParam();
  s.with_h0 = true;
  s.batch = 2;
  s.seq_len = 11;
  s.heads = 2;
  s.dk = 6;
  s.dv = 5;
  Problem p = random_problem(s, 300 + static_cast<uint64_t>(GetParam()));
  for (auto& b : p.beta) b = 1.0;
  for (std::size_t row = 0; row < p.k.size(); row += static_cast<std::size_t>(p.dk)) {
    double sq = 0;
    for (int64_t i = 0; i < p.dk; ++i) sq += p.k[row + i] * p.k[row + i];
    for (int64_t i = 0; i < p.dk; ++i) p.k[row + i] /= std::sqrt(sq);
  }
  p.q = p.k;

  std::vector<double> expected = p.v;
  for (auto& e : expected) e *= p.scale;
  EXPECT_LE(rel_rms(ref::forward(p).o, expected), kClosedFormTolerance);
}

INSTANTIATE_TEST_SUITE_P(DeltaVariants, ReferenceDeltaRule,
                         ::testing::Values(Variant::deltanet, Variant::gated_deltanet,
                                           Variant::kda),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return test::variant_name(info.param);
                         });

// ---- 3. packed sequences and batch rows vs separate runs ------------------------

// One sequence of a problem as a problem of its own (batch 1, no cu_seqlens).
Problem slice_sequence(const Problem& p, int64_t n) {
  const bool packed = !p.cu_seqlens.empty();
  const int64_t row = packed ? 0 : n;
  const int64_t begin = packed ? p.cu_seqlens[n] : 0;
  const int64_t end = packed ? p.cu_seqlens[n + 1] : p.seq_len;
  const int64_t tokens = (end - begin) * p.heads;
  const int64_t first = (row * p.seq_len + begin) * p.heads;
  auto rows = [&](const std::vector<double>& x, int64_t width) {
    if (x.empty()) return x;
    return std::vector<double>(x.begin() + first * width, x.begin() + (first + tokens) * width);
  };
  Problem s = p;
  s.batch = 1;
  s.seq_len = end - begin;
  s.cu_seqlens.clear();
  s.q = rows(p.q, p.dk);
  s.k = rows(p.k, p.dk);
  s.v = rows(p.v, p.dv);
  s.g = rows(p.g, vector_gate(p.variant) ? p.dk : 1);
  s.beta = rows(p.beta, 1);
  const int64_t state = p.heads * p.dk * p.dv;
  if (!p.h0.empty())
    s.h0 = std::vector<double>(p.h0.begin() + n * state, p.h0.begin() + (n + 1) * state);
  return s;
}

// Runs every sequence of p on its own and concatenates the results in p's
// order (token arrays and state arrays are both sequence-major).
struct Joined {
  ref::Outputs out;
  ref::Grads grads;
};

Joined run_separately(const Problem& p, const std::vector<double>& d_o,
                      const std::vector<double>& dht) {
  Joined joined;
  const int64_t state = p.heads * p.dk * p.dv;
  int64_t token_row = 0;  // running (token, head) row across sequences
  auto append = [](std::vector<double>& to, const std::vector<double>& from) {
    to.insert(to.end(), from.begin(), from.end());
  };
  for (int64_t n = 0; n < p.num_sequences(); ++n) {
    const Problem s = slice_sequence(p, n);
    const int64_t rows = s.seq_len * s.heads;
    const std::vector<double> s_do(d_o.begin() + token_row * p.dv,
                                   d_o.begin() + (token_row + rows) * p.dv);
    const std::vector<double> s_dht(dht.begin() + n * state, dht.begin() + (n + 1) * state);
    token_row += rows;
    const ref::Outputs out = ref::forward(s);
    const ref::Grads g = ref::backward(s, s_do, s_dht);
    append(joined.out.o, out.o);
    append(joined.out.ht, out.ht);
    append(joined.grads.dq, g.dq);
    append(joined.grads.dk, g.dk);
    append(joined.grads.dv, g.dv);
    append(joined.grads.dg, g.dg);
    append(joined.grads.dbeta, g.dbeta);
    append(joined.grads.dh0, g.dh0);
  }
  return joined;
}

void expect_same_as_separate_runs(const Problem& p) {
  std::mt19937_64 rng(11);
  const std::vector<double> d_o = test::randn(p.v.size(), rng);
  const std::vector<double> dht = test::randn(state_count(p), rng);
  const ref::Outputs out = ref::forward(p);
  const ref::Grads grads = ref::backward(p, d_o, dht);
  const Joined sep = run_separately(p, d_o, dht);
  EXPECT_LE(rel_rms(out.o, sep.out.o), kSameOpsTolerance) << "o";
  EXPECT_LE(rel_rms(out.ht, sep.out.ht), kSameOpsTolerance) << "ht";
  EXPECT_LE(rel_rms(grads.dq, sep.grads.dq), kSameOpsTolerance) << "dq";
  EXPECT_LE(rel_rms(grads.dk, sep.grads.dk), kSameOpsTolerance) << "dk";
  EXPECT_LE(rel_rms(grads.dv, sep.grads.dv), kSameOpsTolerance) << "dv";
  EXPECT_LE(rel_rms(grads.dg, sep.grads.dg), kSameOpsTolerance) << "dg";
  EXPECT_LE(rel_rms(grads.dbeta, sep.grads.dbeta), kSameOpsTolerance) << "dbeta";
  EXPECT_LE(rel_rms(grads.dh0, sep.grads.dh0), kSameOpsTolerance) << "dh0";
}

// (variant, l2norm_qk)
using SplitParam = std::tuple<Variant, bool>;

class ReferenceSequences : public ::testing::TestWithParam<SplitParam> {
 protected:
  ProblemSpec spec() const {
    ProblemSpec s;
    s.variant = std::get<0>(GetParam());
    s.l2norm_qk = std::get<1>(GetParam());
    s.with_h0 = true;
    s.heads = 2;
    s.dk = 4;
    s.dv = 5;
    return s;
  }
};

TEST_P(ReferenceSequences, PackedEqualsSeparateRuns) {
  ProblemSpec s = spec();
  s.batch = 1;
  s.seq_len = 13;
  s.cu_seqlens = {0, 1, 5, 13};
  expect_same_as_separate_runs(random_problem(s, 500 + static_cast<uint64_t>(s.variant)));
}

TEST_P(ReferenceSequences, BatchRowsEqualSeparateRuns) {
  ProblemSpec s = spec();
  s.batch = 3;
  s.seq_len = 6;
  expect_same_as_separate_runs(random_problem(s, 600 + static_cast<uint64_t>(s.variant)));
}

INSTANTIATE_TEST_SUITE_P(AllVariants, ReferenceSequences,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<SplitParam>& info) {
                           return test::variant_name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_l2" : "_nol2");
                         });

// ---- 4. bad inputs --------------------------------------------------------------

struct BadInput {
  std::string label;
  Variant variant;
  bool packed;
  // Breaks one field of a valid problem (or of the backward cotangents).
  std::function<void(Problem&, std::vector<double>& d_o, std::vector<double>& dht)> mutate;
  std::string argument;  // what Error::argument() must name
  bool backward_only;    // the fault is in do/dht, so forward stays valid
};

// gtest prints the case by its label rather than as raw bytes.
void PrintTo(const BadInput& c, std::ostream* os) {
  *os << c.label;
}

class ReferenceBadInput : public ::testing::TestWithParam<BadInput> {};

TEST_P(ReferenceBadInput, ThrowsNamingTheField) {
  const BadInput& c = GetParam();
  ProblemSpec s;
  s.variant = c.variant;
  s.with_h0 = true;
  s.seq_len = 7;
  if (c.packed) s.cu_seqlens = {0, 3, 7};
  Problem p = random_problem(s, 900);
  std::vector<double> d_o(p.v.size(), 1.0), dht(state_count(p), 1.0);
  c.mutate(p, d_o, dht);

  auto expect_error = [&](const std::function<void()>& call, const char* which) {
    try {
      call();
      ADD_FAILURE() << which << " did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), c.argument) << which << ": " << e.what();
    }
  };
  if (c.backward_only) {
    EXPECT_NO_THROW(ref::forward(p));
  } else {
    expect_error([&] { ref::forward(p); }, "forward");
  }
  expect_error([&] { ref::backward(p, d_o, dht); }, "backward");
}

using Vec = std::vector<double>;

const BadInput kBadInputs[] = {
    {"q_short", Variant::kda, false, [](Problem& p, Vec&, Vec&) { p.q.pop_back(); }, "q", false},
    {"k_long", Variant::gla, false, [](Problem& p, Vec&, Vec&) { p.k.push_back(0.5); }, "k", false},
    {"v_short", Variant::linear, false, [](Problem& p, Vec&, Vec&) { p.v.pop_back(); }, "v", false},
    {"q_nan", Variant::deltanet, false, [](Problem& p, Vec&, Vec&) { p.q[3] = std::nan(""); }, "q",
     false},
    {"g_missing", Variant::kda, false, [](Problem& p, Vec&, Vec&) { p.g.clear(); }, "g", false},
    {"g_given_without_decay", Variant::linear, false,
     [](Problem& p, Vec&, Vec&) {
       p.g.assign(static_cast<std::size_t>(p.seq_len * p.heads), -0.1);
     },
     "g", false},
    {"g_scalar_for_vector_decay", Variant::gla, false,
     [](Problem& p, Vec&, Vec&) { p.g.resize(static_cast<std::size_t>(p.seq_len * p.heads)); }, "g",
     false},
    {"g_inf", Variant::retention, false,
     [](Problem& p, Vec&, Vec&) { p.g[0] = -std::numeric_limits<double>::infinity(); }, "g", false},
    // alpha = exp(g) > 1: the state grows without bound (the oracle returned
    // |o| ~ 3e16 at T = 40 instead of refusing, as the kernels do).
    {"g_positive", Variant::retention, false, [](Problem& p, Vec&, Vec&) { p.g[2] = 0.25; }, "g",
     false},
    {"beta_missing", Variant::gated_deltanet, false, [](Problem& p, Vec&, Vec&) { p.beta.clear(); },
     "beta", false},
    {"beta_given_for_additive", Variant::retention, false,
     [](Problem& p, Vec&, Vec&) {
       p.beta.assign(static_cast<std::size_t>(p.seq_len * p.heads), 0.5);
     },
     "beta", false},
    {"h0_short", Variant::kda, false, [](Problem& p, Vec&, Vec&) { p.h0.pop_back(); }, "h0", false},
    {"heads_zero", Variant::kda, false, [](Problem& p, Vec&, Vec&) { p.heads = 0; }, "heads",
     false},
    {"cu_seqlens_with_batch_2", Variant::kda, true, [](Problem& p, Vec&, Vec&) { p.batch = 2; },
     "cu_seqlens", false},
    {"cu_seqlens_not_from_0", Variant::kda, true,
     [](Problem& p, Vec&, Vec&) {
       p.cu_seqlens = {1, 3, 7};
     },
     "cu_seqlens", false},
    {"cu_seqlens_decreasing", Variant::kda, true,
     [](Problem& p, Vec&, Vec&) {
       p.cu_seqlens = {0, 5, 3, 7};
     },
     "cu_seqlens", false},
    {"cu_seqlens_empty_sequence", Variant::kda, true,
     [](Problem& p, Vec&, Vec&) {
       p.cu_seqlens = {0, 3, 3, 7};
     },
     "cu_seqlens", false},
    {"cu_seqlens_short_of_seq_len", Variant::kda, true,
     [](Problem& p, Vec&, Vec&) {
       p.cu_seqlens = {0, 3, 6};
     },
     "cu_seqlens", false},
    {"cu_seqlens_single_offset", Variant::kda, true,
     [](Problem& p, Vec&, Vec&) { p.cu_seqlens = {0}; }, "cu_seqlens", false},
    {"do_short", Variant::kda, false, [](Problem&, Vec& d_o, Vec&) { d_o.pop_back(); }, "do", true},
    {"do_nan", Variant::gla, false, [](Problem&, Vec& d_o, Vec&) { d_o[2] = std::nan(""); }, "do",
     true},
    {"dht_long", Variant::kda, true, [](Problem&, Vec&, Vec& dht) { dht.push_back(1.0); }, "dht",
     true},
};

INSTANTIATE_TEST_SUITE_P(Cases, ReferenceBadInput, ::testing::ValuesIn(kBadInputs),
                         [](const ::testing::TestParamInfo<BadInput>& info) {
                           return info.param.label;
                         });

}  // namespace
}  // namespace statescan
