// CpMixer on one rank (SingleRankCommunicator) against the fp64 reference,
// and its argument checking. Multi-rank invariance is test_cp_mixer_mpi.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>

#include "comm/communicator.h"
#include "core/error.h"
#include "parallel/exchange.h"
#include "tests/cp_test_util.h"

namespace statescan::test {
namespace {

constexpr double kTol = 1e-5;  // fp32 path vs fp64 reference (DESIGN §7)

enum class Layout { batch_rows, packed };

struct Case {
  Variant variant;
  Layout layout;
  bool l2norm;
  bool with_state;  // h0 and dht given
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(to_string(c.variant)) + (c.layout == Layout::packed ? "_packed" : "_rows") +
         (c.l2norm ? "_l2" : "") + (c.with_state ? "_h0" : "");
}

// Readable parameter in test names (gtest_discover_tests puts it in the ctest name).
void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name(::testing::TestParamInfo<Case>(c, 0));
}

class CpSingleRank : public ::testing::TestWithParam<Case> {};

TEST_P(CpSingleRank, MatchesReferenceForwardAndBackward) {
  const Case c = GetParam();
  ProblemSpec s;
  s.variant = c.variant;
  s.l2norm_qk = c.l2norm;
  s.with_h0 = c.with_state;
  s.heads = 2;
  s.dk = 16;
  s.dv = 12;
  if (c.layout == Layout::packed) {
    s.seq_len = 77;
    s.cu_seqlens = {0, 9, 40, 77};
  } else {
    s.batch = 2;
    s.seq_len = 53;  // not a multiple of the chunk
  }
  const uint64_t seed = 1000 + static_cast<uint64_t>(c.variant) * 16 + (c.l2norm ? 4 : 0) +
                        (c.with_state ? 2 : 0) + (c.layout == Layout::packed ? 1 : 0);
  ref::Problem p = random_problem(s, seed);
  round_to_float(p);
  std::mt19937_64 rng(seed + 7);
  auto d_o = round_f32(randn(p.v.size(), rng));
  std::vector<double> dht;
  if (c.with_state)
    dht =
        round_f32(randn(static_cast<std::size_t>(p.num_sequences() * s.heads * s.dk * s.dv), rng));

  const ref::Outputs ro = ref::forward(p);
  const ref::Grads rg = ref::backward(p, d_o, dht);

  SingleRankCommunicator comm;
  MixerConfig cfg;
  cfg.variant = c.variant;
  cfg.chunk = 16;
  cfg.l2norm_qk = c.l2norm;
  CpMixer mixer(comm, cfg, Exchange::automatic);
  const CpOutputs out = run_cp(mixer, p, 0, p.seq_len, d_o, dht);

  EXPECT_LE(rel_rms(out.o, ro.o), kTol);
  EXPECT_LE(rel_rms(out.ht, ro.ht), kTol);
  EXPECT_LE(rel_rms(out.dq, rg.dq), kTol);
  EXPECT_LE(rel_rms(out.dk, rg.dk), kTol);
  EXPECT_LE(rel_rms(out.dv, rg.dv), kTol);
  if (has_gate(c.variant)) {
    EXPECT_LE(rel_rms(out.dg, rg.dg), kTol);
  }
  if (has_beta(c.variant)) {
    EXPECT_LE(rel_rms(out.dbeta, rg.dbeta), kTol);
  }
  EXPECT_LE(rel_rms(out.dh0, rg.dh0), kTol);
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (Variant v : kAllVariants)
    for (Layout l : {Layout::batch_rows, Layout::packed})
      for (bool l2 : {false, true})
        for (bool st : {false, true}) cases.push_back({v, l, l2, st});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CpSingleRank, ::testing::ValuesIn(all_cases()), case_name);

// One rank exchanges nothing, yet its stats (and observers) report the
// configured exchange, an automatic one as ring: the host path reported ring
// for every configuration, the GPU path the configured one.
TEST(CpSingleRankStats, ReportTheConfiguredExchange) {
  ProblemSpec s;
  s.variant = Variant::gated_deltanet;
  s.heads = 2;
  s.dk = 8;
  s.dv = 8;
  s.seq_len = 24;
  ref::Problem p = random_problem(s, 77);
  round_to_float(p);
  std::mt19937_64 rng(78);
  const auto d_o = round_f32(randn(p.v.size(), rng));
  SingleRankCommunicator comm;
  MixerConfig cfg;
  cfg.variant = s.variant;
  cfg.chunk = 16;
  for (const auto& [configured, reported] : {std::pair{Exchange::allgather, Exchange::allgather},
                                             {Exchange::ring, Exchange::ring},
                                             {Exchange::tree, Exchange::tree},
                                             {Exchange::automatic, Exchange::ring}}) {
    CpMixer mixer(comm, cfg, configured);
    (void)run_cp(mixer, p, 0, p.seq_len, d_o, {});
    EXPECT_EQ(mixer.last_forward_stats().exchange, reported) << to_string(configured);
  }
}

// ---- argument checking ----------------------------------------------------------

struct BadInputFixture : ::testing::Test {
  SingleRankCommunicator comm;
  ref::Problem p;
  std::vector<float> q, k, v, g, beta, o;
  std::vector<float> d_o, dq, dk, dv, dg, dbeta;
  CpForwardArgs args;
  CpBackwardArgs bargs;  // d_o 0.25 everywhere, dq filled with 12345
  void SetUp() override {
    ProblemSpec s;
    s.variant = Variant::kda;
    s.seq_len = 20;
    s.heads = 2;
    s.dk = 8;
    s.dv = 8;
    p = random_problem(s, 77);
    q = cast(p.q);
    k = cast(p.k);
    v = cast(p.v);
    g = cast(p.g);
    beta = cast(p.beta);
    o.assign(v.size(), 12345.f);
    const Shape qk{1, 20, 2, 8}, bth{1, 20, 2};
    args.q = TensorView(q.data(), DType::f32, qk);
    args.k = TensorView(k.data(), DType::f32, qk);
    args.v = TensorView(v.data(), DType::f32, qk);
    args.g = TensorView(g.data(), DType::f32, qk);
    args.beta = TensorView(beta.data(), DType::f32, bth);
    args.o = TensorView(o.data(), DType::f32, qk);
    d_o.assign(v.size(), 0.25f);
    dq.assign(q.size(), 12345.f);
    dk.assign(k.size(), 0.f);
    dv.assign(v.size(), 0.f);
    dg.assign(g.size(), 0.f);
    dbeta.assign(beta.size(), 0.f);
    bargs.d_o = TensorView(d_o.data(), DType::f32, qk);
    bargs.dq = TensorView(dq.data(), DType::f32, qk);
    bargs.dk = TensorView(dk.data(), DType::f32, qk);
    bargs.dv = TensorView(dv.data(), DType::f32, qk);
    bargs.dg = TensorView(dg.data(), DType::f32, qk);
    bargs.dbeta = TensorView(dbeta.data(), DType::f32, bth);
  }
  // Runs mixer.backward(bargs) expecting a statescan::Error naming
  // `argument`, and checks that dq kept its sentinel.
  void expect_backward_error(CpMixer& mixer, const std::string& argument) {
    std::fill(dq.begin(), dq.end(), 12345.f);
    try {
      mixer.backward(bargs);
      ADD_FAILURE() << "no error for " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    for (float x : dq) ASSERT_EQ(x, 12345.f) << "dq written despite the error";
  }
  // Runs forward expecting a statescan::Error naming `argument`, and checks
  // that the output was not touched.
  void expect_error(const std::string& argument, int64_t chunk = 64) {
    MixerConfig cfg;
    cfg.variant = Variant::kda;
    if (chunk != 64) {
      cfg.chunk = chunk;
      try {
        CpMixer rejected(comm, cfg, Exchange::ring);
        ADD_FAILURE() << "no error for " << argument;
      } catch (const Error& e) {
        EXPECT_EQ(e.argument(), argument) << e.what();
      }
      return;
    }
    CpMixer mixer(comm, cfg, Exchange::ring);
    try {
      mixer.forward(args);
      ADD_FAILURE() << "no error for " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(argument), std::string::npos);
    }
    for (float x : o) ASSERT_EQ(x, 12345.f) << "output written despite the error";
  }
};

TEST_F(BadInputFixture, WrongShapeNamesArgument) {
  args.k.shape = {1, 20, 2, 4};
  args.k.strides = contiguous_strides(args.k.shape);
  expect_error("k");
}

TEST_F(BadInputFixture, NanInGateNamesGate) {
  g[17] = std::nanf("");
  expect_error("g");
}

TEST_F(BadInputFixture, InfInValueNamesValue) {
  v[3] = INFINITY;
  expect_error("v");
}

// MixerConfig::check_finite = false: the same NaN is not looked for; it
// reaches the output instead of an error (the switch does switch), and so
// does a NaN in do reach the gradients.
TEST_F(BadInputFixture, UncheckedNanFlowsIntoTheOutputs) {
  MixerConfig cfg;
  cfg.variant = Variant::kda;
  cfg.check_finite = false;
  v[3] = std::nanf("");
  CpMixer mixer(comm, cfg, Exchange::ring);
  ASSERT_NO_THROW(mixer.forward(args));
  EXPECT_TRUE(std::any_of(o.begin(), o.end(), [](float x) { return std::isnan(x); }));
  v[3] = 0.5f;
  mixer.forward(args);
  for (float x : o) ASSERT_TRUE(std::isfinite(x));
  d_o[5] = std::nanf("");
  ASSERT_NO_THROW(mixer.backward(bargs));
  EXPECT_TRUE(std::any_of(dq.begin(), dq.end(), [](float x) { return std::isnan(x); }));
  // The default checks do: the same call is refused, naming it.
  MixerConfig checked = cfg;
  checked.check_finite = true;
  CpMixer strict(comm, checked, Exchange::ring);
  strict.forward(args);
  expect_backward_error(strict, "do");
}

TEST_F(BadInputFixture, WrongDtypeNamesArgument) {
  args.beta.dtype = DType::bf16;
  expect_error("beta");
}

TEST_F(BadInputFixture, MissingBetaForDeltaRule) {
  args.beta = TensorView();
  expect_error("beta");
}

TEST_F(BadInputFixture, ChunkNotAllowed) { expect_error("chunk", 48); }

TEST_F(BadInputFixture, CuSeqlensDisagreeingWithLength) {
  std::vector<int64_t> cu{0, 5, 19};
  args.cu_seqlens = TensorView(cu.data(), DType::i64, {3});
  expect_error("cu_seqlens");
}

// An empty sequence (two equal offsets) is refused, not skipped.
TEST_F(BadInputFixture, CuSeqlensNotStrictlyIncreasing) {
  std::vector<int64_t> cu{0, 5, 5, 20};
  args.cu_seqlens = TensorView(cu.data(), DType::i64, {4});
  expect_error("cu_seqlens");
}

// Dk above 256 is refused by the mixer's own checks, naming q.
TEST_F(BadInputFixture, HeadDimAbove256NamesQ) {
  const Shape wide{1, 20, 2, 257};
  std::vector<float> big(static_cast<std::size_t>(20 * 2 * 257), 0.1f);
  std::vector<float> kbig = big, gates(big.size(), -0.1f);
  args.q = TensorView(big.data(), DType::f32, wide);
  args.k = TensorView(kbig.data(), DType::f32, wide);
  args.g = TensorView(gates.data(), DType::f32, wide);
  expect_error("q");
}

// keep_prepared hands the forward's tiles to a backward that reads saved
// chunk states: with recompute_chunk_states the mixer is refused at once.
TEST(CpMixerConfig, KeepPreparedWithRecomputedStatesIsRefused) {
  SingleRankCommunicator comm;
  MixerConfig cfg;
  cfg.keep_prepared = true;
  cfg.recompute_chunk_states = true;
  try {
    CpMixer mixer(comm, cfg, Exchange::ring);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "keep_prepared") << e.what();
  }
  cfg.recompute_chunk_states = false;
  EXPECT_NO_THROW(CpMixer(comm, cfg, Exchange::ring));
}

// A forward that fails leaves nothing for backward: not the previous step's
// saved state, which points into that step's inputs.
TEST_F(BadInputFixture, BackwardAfterAFailedForwardIsRefused) {
  MixerConfig cfg;
  cfg.variant = Variant::kda;
  CpMixer mixer(comm, cfg, Exchange::ring);
  mixer.forward(args);  // succeeds: a backward could follow it
  g[3] = std::nanf("");
  EXPECT_THROW(mixer.forward(args), Error);
  expect_backward_error(mixer, "backward");  // not run on the failed forward's predecessor
}

TEST_F(BadInputFixture, BackwardWithoutForward) {
  MixerConfig cfg;
  CpMixer mixer(comm, cfg, Exchange::ring);
  expect_backward_error(mixer, "backward");
}

// The scan is public API too: dimensions below 1 are refused, naming them
// (a Dv of 0 divided by the ring's zero blocks, SIGFPE, before the check).
TEST(ExclusiveScan, DimensionsBelowOneAreRefused) {
  SingleRankCommunicator comm;
  for (const char* field : {"maps.rows", "maps.heads", "maps.dk", "maps.dv"}) {
    ScanMaps maps;
    maps.rows = maps.heads = 1;
    maps.dk = maps.dv = 4;
    const std::string f = field;
    if (f == "maps.rows") maps.rows = 0;
    if (f == "maps.heads") maps.heads = -1;
    if (f == "maps.dk") maps.dk = 0;
    if (f == "maps.dv") maps.dv = 0;
    maps.M.assign(static_cast<std::size_t>(std::max<int64_t>(maps.maps() * maps.m_size(), 0)), 1.f);
    maps.E.assign(static_cast<std::size_t>(std::max<int64_t>(maps.maps() * maps.dk * maps.dv, 0)),
                  0.f);
    for (Exchange e : {Exchange::allgather, Exchange::ring, Exchange::tree}) {
      try {
        exclusive_scan(comm, e, maps, ScanOrder::forward);
        ADD_FAILURE() << field << " accepted by " << to_string(e);
      } catch (const Error& err) {
        EXPECT_EQ(err.argument(), f) << err.what();
      }
    }
  }
}

}  // namespace
}  // namespace statescan::test
