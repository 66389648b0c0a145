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
// (dq, dk, dv, dh0 8e-3; dg, dbeta 2e-2). "b10": the points the kernels round
// at today; "b11 plan": also every operand of the intra-chunk products
// (PERF_NOTES), which the planned kernel needs to keep in shared memory.
struct RoundingCase {
  const char* name;
  ModelRounding rounding;
};

void PrintTo(const RoundingCase& c, std::ostream* os) {
  *os << c.name;
}

using Bf16Param = std::tuple<Variant, RoundingCase>;

class ChunkBwdModelBf16 : public ::testing::TestWithParam<Bf16Param> {};

TEST_P(ChunkBwdModelBf16, StaysUnderTheBf16Bounds) {
  ProblemSpec s;
  s.variant = std::get<0>(GetParam());
  s.dk = s.dv = 64;
  s.heads = 1;
  s.seq_len = 150;
  s.with_h0 = true;
  ref::Problem p = random_problem(s, 29 + static_cast<uint64_t>(s.variant));
  for (auto* x : {&p.q, &p.k, &p.v, &p.beta})
    for (double& e : *x) e = round_bf16(e);
  for (auto* x : {&p.g, &p.h0})
    for (double& e : *x) e = static_cast<float>(e);
  p.scale = static_cast<float>(p.scale);
  std::mt19937_64 rng(11);
  std::vector<double> d_o = randn(p.v.size(), rng), dht = randn(p.h0.size(), rng);
  for (double& e : d_o) e = round_bf16(e);
  for (double& e : dht) e = static_cast<float>(e);
  const ref::Grads want = ref::backward(p, d_o, dht);
  ref::Grads got = chunk_backward_model(p, d_o, dht, 64, std::get<1>(GetParam()).rounding);
  // The kernels store dq, dk, dv and dbeta in the input's type.
  for (auto* x : {&got.dq, &got.dk, &got.dv, &got.dbeta})
    for (double& e : *x) e = round_bf16(e);
  const double errs[6] = {rel_rms(got.dq, want.dq),     rel_rms(got.dk, want.dk),
                          rel_rms(got.dv, want.dv),     rel_rms(got.dg, want.dg),
                          rel_rms(got.dbeta, want.dbeta), rel_rms(got.dh0, want.dh0)};
  std::printf("  %-15s %-9s dq %.2e dk %.2e dv %.2e dg %.2e dbeta %.2e dh0 %.2e\n",
              variant_name(s.variant).c_str(), std::get<1>(GetParam()).name, errs[0], errs[1],
              errs[2], errs[3], errs[4], errs[5]);
  EXPECT_LE(errs[0], 8e-3) << "dq";
  EXPECT_LE(errs[1], 8e-3) << "dk";
  EXPECT_LE(errs[2], 8e-3) << "dv";
  EXPECT_LE(errs[3], 2e-2) << "dg";
  EXPECT_LE(errs[4], 2e-2) << "dbeta";
  EXPECT_LE(errs[5], 8e-3) << "dh0";
  // The roundings are really applied: not bitwise the exact model.
  const ref::Grads exact = chunk_backward_model(p, d_o, dht, 64);
  EXPECT_GT(rel_rms(got.dk, exact.dk), 0.0);
}

const RoundingCase kRoundings[] = {
    {"b10", ModelRounding{true, true, true, false, false}},
    {"b11_plan", ModelRounding{true, true, true, true, true}},
};

INSTANTIATE_TEST_SUITE_P(AllVariants, ChunkBwdModelBf16,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants),
                                            ::testing::ValuesIn(kRoundings)),
                         [](const ::testing::TestParamInfo<Bf16Param>& info) {
                           return variant_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name;
                         });

}  // namespace
}  // namespace statescan::test
