// The host model of the chunkwise backward (tests/chunk_bwd_model.h) against
// the fp64 reference backward on tiny shapes: every variant, with initial
// state and final-state gradient, l2norm, packed sequences and a partial chunk.
#include <gtest/gtest.h>

#include <cstdio>
#include <ostream>
#include <random>
#include <string>
#include <tuple>

#include "kernels/cpu/reference.h"
#include "tests/chunk_bwd_model.h"
#include "tests/chunk_model.h"
#include "tests/test_util.h"

namespace statescan::test {
namespace {

using Param = std::tuple<Variant, bool>;  // variant, l2norm + packed

class ChunkBwdModel : public ::testing::TestWithParam<Param> {};

TEST_P(ChunkBwdModel, MatchesReference) {
  ProblemSpec s;
  s.variant = std::get<0>(GetParam());
  s.dk = 6;
  s.dv = 5;
  s.heads = 2;
  s.with_h0 = true;
  if (std::get<1>(GetParam())) {
    s.l2norm_qk = true;
    s.seq_len = 29;
    s.cu_seqlens = {0, 3, 19, 20, 29};
  } else {
    s.batch = 2;
    s.seq_len = 21;
  }
  ref::Problem p = random_problem(s, 17 + static_cast<uint64_t>(s.variant));
  std::mt19937_64 rng(5);
  const std::vector<double> d_o = randn(p.v.size(), rng);
  const std::vector<double> dht = randn(p.h0.size(), rng);
  const ref::Grads want = ref::backward(p, d_o, dht);
  const ref::Grads got = chunk_backward_model(p, d_o, dht, 8);
  const double tol = 1e-10;
  EXPECT_LE(rel_rms(got.dq, want.dq), tol) << "dq";
  EXPECT_LE(rel_rms(got.dk, want.dk), tol) << "dk";
  EXPECT_LE(rel_rms(got.dv, want.dv), tol) << "dv";
  EXPECT_LE(rel_rms(got.dg, want.dg), tol) << "dg";
  EXPECT_LE(rel_rms(got.dbeta, want.dbeta), tol) << "dbeta";
  EXPECT_LE(rel_rms(got.dh0, want.dh0), tol) << "dh0";
}

INSTANTIATE_TEST_SUITE_P(AllVariants, ChunkBwdModel,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return variant_name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_l2norm_packed" : "_plain");
                         });

// Precision of 16-bit tensor-core operands, studied on the CPU: the model
// rounding to bf16 where the GPU kernels round (ModelRounding) against the
// fp64 reference on bf16-representable inputs, D = 64, chunk 64, two full
// chunks and a partial one, dq/dk/dv/dbeta stored as bf16 like the kernels'
// outputs. The bounds are test_cuda_backward's for bf16
// (dq, dk, dv, dh0 8e-3; dg, dbeta 2e-2). "b10": the points the kernels
// rounded at before the intra-chunk kernels; "b11": also every operand of the
// intra-chunk products, a vector gate's operands scaled to 16-row reference
// rows, the diagonal blocks too (chunk_intra_grad_vector_kernel's fast path);
// "b11_exact_diagonal": its path for items whose gates decay by more than
// kMaxDrop = 4 e-folds over a 16-token block (diagonal blocks from the plain
// operands). Gates: random_problem's (mild, ~0.3 e-folds per block), "bound"
// (3.5 per block, at most ~3.9 here: the fast path's largest factors) and
// "strong" (20 per block, -1.25 per token: the exact-diagonal path; the fast
// path is not run there, as the kernel does not). With and without the
// in-kernel L2 norm (normalised q, k are not bf16-exact, so their copies round).
//
// Why the bound is 4 (2026-12-01, this model): the gate gradient db takes each
// pair (t, s) of a chunk twice, + at t through gq and - at s through gk, and
// the reverse cumsum cancels the two; operands rounded differently on the two
// sides leave their rounding, while the true dg shrinks as the gates
// strengthen. Scaled diagonal operands (not bf16-exact even where q, k are)
// gave GLA dg errors of 6.5e-3 (2 e-folds per block), 9.9e-3 (5), 1.9e-2 (10),
// 3.5e-2 (20) and 1.7e-1 (45); the plain operands 1e-3 to 2e-3.
//
// The same mechanism with the L2 norm on: normalised q, k are not
// bf16-exact, and the kernels take db from the exact normalised q, k while
// the products take their rounded copies. The b11 kernels (the
// "b11_exact_diagonal" rounding) then give dg errors, at 20 / 45 e-folds per
// block, of retention 1.9e-2 / 1.8e-1, GLA 6.9e-3 / 3.1e-2, GDN 2.1e-2 /
// 7.0e-2, KDA 9.1e-3 / 4.6e-2. "db_operands" takes db (and the K_ column
// sums) from the copies too (ModelRounding::db_from_operands), so every
// in-chunk pair cancels as in exact arithmetic: 8.7e-3 / 2.0e-2, 2.0e-3 /
// 2.1e-3, 6.1e-3 / 3.4e-3, 3.8e-3 / 3.9e-3. The kernels do that since
// 2026-12-01 (the GPU test MatchesReferenceWithL2NormAndStrongGates: worst
// dg 3.8e-3), so "db_operands" models today's kernels; the b11 cases model
// the kernels before and skip the L2 norm with strong gates, naming the gap.
struct RoundingCase {
  const char* name;
  ModelRounding rounding;
  bool fast_diagonal;  // the kernel's fast path: only within its drop bound
};

void PrintTo(const RoundingCase& c, std::ostream* os) {
  *os << c.name;
}

using Bf16Param = std::tuple<Variant, RoundingCase, GateCase, bool>;

class ChunkBwdModelBf16 : public ::testing::TestWithParam<Bf16Param> {};

TEST_P(ChunkBwdModelBf16, StaysUnderTheBf16Bounds) {
  ProblemSpec s;
  s.variant = std::get<0>(GetParam());
  s.dk = s.dv = 64;
  s.heads = 1;
  s.seq_len = 150;
  s.with_h0 = true;
  s.l2norm_qk = std::get<3>(GetParam());
  ref::Problem p = random_problem(s, 29 + static_cast<uint64_t>(s.variant));
  const RoundingCase& rounding = std::get<1>(GetParam());
  const GateCase& gates = std::get<2>(GetParam());
  if (gates.per_block > 0) {
    if (s.l2norm_qk && gates.per_block > 4 && !rounding.rounding.db_from_operands &&
        rounding.rounding.intra_cd)
      GTEST_SKIP() << "the b11 kernels' gap: dg 3e-2 to 7e-2 with the L2 norm and strong gates, "
                      "closed by taking db from the operand copies (the db_operands cases)";
    set_block_decay(p.g, gates.per_block, 5);
  }
  round_inputs_to_bf16(p);
  std::mt19937_64 rng(11);
  std::vector<double> d_o = randn(p.v.size(), rng), dht = randn(p.h0.size(), rng);
  for (double& e : d_o) e = round_bf16(e);
  for (double& e : dht) e = static_cast<float>(e);
  const ref::Grads want = ref::backward(p, d_o, dht);
  ref::Grads got = chunk_backward_model(p, d_o, dht, 64, rounding.rounding);
  // The roundings are really applied: the model's own result is not bitwise
  // the exact model's (compared before the stores' rounding below, which
  // alone would make them differ).
  const ref::Grads exact = chunk_backward_model(p, d_o, dht, 64);
  EXPECT_GT(rel_rms(got.dk, exact.dk), 0.0);
  // The kernels store dq, dk, dv and dbeta in the input's type.
  for (auto* x : {&got.dq, &got.dk, &got.dv, &got.dbeta})
    for (double& e : *x) e = round_bf16(e);
  const double errs[6] = {rel_rms(got.dq, want.dq),       rel_rms(got.dk, want.dk),
                          rel_rms(got.dv, want.dv),       rel_rms(got.dg, want.dg),
                          rel_rms(got.dbeta, want.dbeta), rel_rms(got.dh0, want.dh0)};
  std::printf("  %-15s %-30s %-6s %-4s dq %.2e dk %.2e dv %.2e dg %.2e dbeta %.2e dh0 %.2e\n",
              variant_name(s.variant).c_str(), rounding.name, gates.name, s.l2norm_qk ? "l2" : "-",
              errs[0], errs[1], errs[2], errs[3], errs[4], errs[5]);
  EXPECT_LE(errs[0], 8e-3) << "dq";
  EXPECT_LE(errs[1], 8e-3) << "dk";
  EXPECT_LE(errs[2], 8e-3) << "dv";
  EXPECT_LE(errs[3], 2e-2) << "dg";
  EXPECT_LE(errs[4], 2e-2) << "dbeta";
  EXPECT_LE(errs[5], 8e-3) << "dh0";
}

const RoundingCase kRoundings[] = {
    {"b10", ModelRounding{true, true, true, false, false, false, false, false}, false},
    {"b11", ModelRounding{true, true, true, true, true, true, true, false}, true},
    {"b11_exact_diagonal", ModelRounding{true, true, true, true, true, true, false, false}, false},
    {"db_operands", ModelRounding{true, true, true, true, true, true, true, true}, true},
    {"db_operands_exact_diagonal", ModelRounding{true, true, true, true, true, true, false, true},
     false},
    // A candidate (ModelRounding::one_product): today's roundings with the
    // delta rules' scans as one product per chunk step (no effect on additive
    // rules).
    {"db_operands_one_product", ModelRounding{true, true, true, true, true, true, true, true, true},
     true},
};

// The kernel takes its exact diagonal under strong gates: its fast path's
// rounding is never run there.
bool kernel_runs(const RoundingCase& c, const GateCase& g) {
  return !(c.fast_diagonal && g.per_block > 4);
}

INSTANTIATE_TEST_SUITE_P(AllVariants, ChunkBwdModelBf16,
                         ::testing::ValuesIn(rounding_model_cases(kRoundings, kernel_runs)),
                         [](const ::testing::TestParamInfo<Bf16Param>& info) {
                           return model_case_name(info.param);
                         });

}  // namespace
}  // namespace statescan::test
