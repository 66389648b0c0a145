// The host model of the chunkwise backward (tests/chunk_bwd_model.h) against
// the fp64 reference backward on tiny shapes: every variant, with initial
// state and final-state gradient, l2norm, packed sequences and a partial chunk.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace statescan::test
