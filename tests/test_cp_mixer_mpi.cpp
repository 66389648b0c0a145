// Context-parallel invariance under mpirun (2, 3, 4 and 6 ranks): a CP run over
// uneven shards must equal a single-rank run of the same inputs for outputs,
// final state and every gradient, for every variant x exchange, including
// packed sequences whose boundaries fall on and across rank boundaries. Bad
// input on one rank must raise the same error on every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "parallel/exchange.h"
#include "parallel/observer.h"
#include "tests/collective_error.h"
#include "tests/cp_test_util.h"
#include "tests/fault_notice_util.h"

namespace statescan::test {
namespace {

// CP and single-rank runs do the same fp32 work in a different order only at
// shard boundaries (the exchange composes maps); 1e-5 is DESIGN §7's fp32 bar.
constexpr double kTol = 1e-5;

Communicator& world() {
  static std::unique_ptr<MpiCommunicator> comm = MpiCommunicator::world();
  return *comm;
}

enum class Layout { batch_rows, packed_on_boundary, packed_across, packed_from_boundary };

struct Case {
  Variant variant;
  Exchange exchange;
  Layout layout;
  int64_t dv = 8;  // value head dim
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const char* l = c.layout == Layout::batch_rows             ? "rows"
                  : c.layout == Layout::packed_on_boundary   ? "packed_on_boundary"
                  : c.layout == Layout::packed_from_boundary ? "packed_from_boundary"
                                                             : "packed_across";
  return std::string(to_string(c.variant)) + "_" + to_string(c.exchange) + "_" + l +
         (c.dv != 8 ? "_dv" + std::to_string(c.dv) : "");
}

// Readable parameter in test names (gtest_discover_tests puts it in the ctest name).
void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name(::testing::TestParamInfo<Case>(c, 0));
}

// One case's problem (the same on every rank: same seed), its cotangents and
// config, and the uneven shard bounds.
struct CaseProblem {
  ProblemSpec spec;
  ref::Problem p;
  std::vector<double> d_o, dht;
  MixerConfig cfg;
  std::vector<int64_t> bounds;
};

CaseProblem make_problem(const Case& c, int P) {
  CaseProblem cp;
  // 67 tokens up to four ranks; beyond, enough that rank 1 (the smallest
  // shard, shard_bounds) holds 6 tokens, which the packed layouts assume.
  const int64_t T = std::max<int64_t>(67, 6 * static_cast<int64_t>(P) * (P + 1) / 2);
  cp.bounds = shard_bounds(T, P);
  ProblemSpec& s = cp.spec;
  s.variant = c.variant;
  s.seq_len = T;
  s.heads = 2;
  s.dk = 16;
  s.dv = c.dv;
  s.with_h0 = true;
  s.l2norm_qk = c.variant == Variant::kda;  // exercise the in-op normalisation somewhere
  const int64_t b1 = cp.bounds[1];          // rank 1's first token, >= 6
  if (c.layout == Layout::batch_rows) {
    s.batch = 2;
  } else if (c.layout == Layout::packed_on_boundary) {
    // A sequence ending exactly at rank 1's start, one starting there, and a
    // long one that spans every later rank boundary.
    s.cu_seqlens = {0, 3, b1, b1 + 2, T - 4, T};
  } else if (c.layout == Layout::packed_from_boundary) {
    // A sequence that starts exactly at rank 1's first token and runs to the
    // end: rank 1 holds it alone, and its carry must not depend on what
    // enters rank 1 (M = 0), which only a third rank sees.
    s.cu_seqlens = {0, 5, b1, T};
  } else {
    // Sequences that cross the first rank boundary and (for P > 2) others.
    s.cu_seqlens = {0, 5, b1 + 1, T};
  }
  const uint64_t seed = 5000 + static_cast<uint64_t>(c.variant) * 64 +
                        static_cast<uint64_t>(c.exchange) * 8 + static_cast<uint64_t>(c.layout);
  cp.p = random_problem(s, seed);
  round_to_float(cp.p);
  std::mt19937_64 rng(seed + 1);
  cp.d_o = round_f32(randn(cp.p.v.size(), rng));
  cp.dht =
      round_f32(randn(static_cast<std::size_t>(cp.p.num_sequences() * s.heads * s.dk * s.dv), rng));
  cp.cfg.variant = c.variant;
  cp.cfg.chunk = 16;
  cp.cfg.l2norm_qk = s.l2norm_qk;
  return cp;
}

class CpInvariance : public ::testing::TestWithParam<Case> {};

TEST_P(CpInvariance, EqualsSingleRank) {
  const Case c = GetParam();
  Communicator& comm = world();
  const int P = comm.size(), r = comm.rank();
  const CaseProblem cpp = make_problem(c, P);
  const ProblemSpec& s = cpp.spec;
  const ref::Problem& p = cpp.p;
  const int64_t T = s.seq_len;
  const auto& bounds = cpp.bounds;

  SingleRankCommunicator self;
  CpMixer single(self, cpp.cfg, Exchange::ring);
  const CpOutputs full = run_cp(single, p, 0, T, cpp.d_o, cpp.dht);

  CpMixer cp(comm, cpp.cfg, c.exchange);
  const CpOutputs mine = run_cp(cp, p, bounds[r], bounds[r + 1], cpp.d_o, cpp.dht);
  if (P > 1) {
    EXPECT_EQ(cp.last_forward_stats().exchange, c.exchange);
  }

  const int64_t B = p.batch, H = s.heads, Dk = s.dk, Dv = s.dv;
  const bool vec = vector_gate(c.variant);
  auto local = [&](const std::vector<float>& x, int64_t inner) {
    std::vector<double> d(x.begin(), x.end());
    return slice_tokens(d, B, T, bounds[r], bounds[r + 1], inner);
  };
  EXPECT_LE(rel_rms(mine.o, local(full.o, H * Dv)), kTol) << "rank " << r;
  EXPECT_LE(rel_rms(mine.ht, full.ht), kTol) << "rank " << r;
  EXPECT_LE(rel_rms(mine.dq, local(full.dq, H * Dk)), kTol) << "rank " << r;
  EXPECT_LE(rel_rms(mine.dk, local(full.dk, H * Dk)), kTol) << "rank " << r;
  EXPECT_LE(rel_rms(mine.dv, local(full.dv, H * Dv)), kTol) << "rank " << r;
  if (has_gate(c.variant)) {
    EXPECT_LE(rel_rms(mine.dg, local(full.dg, vec ? H * Dk : H)), kTol) << "rank " << r;
  }
  if (has_beta(c.variant)) {
    EXPECT_LE(rel_rms(mine.dbeta, local(full.dbeta, H)), kTol) << "rank " << r;
  }
  EXPECT_LE(rel_rms(mine.dh0, full.dh0), kTol) << "rank " << r;

  // The single-rank run itself against the fp64 reference, so that the two
  // cannot agree on a wrong answer.
  if (r == 0) {
    const ref::Outputs ro = ref::forward(p);
    EXPECT_LE(rel_rms(full.o, ro.o), kTol);
    EXPECT_LE(rel_rms(full.ht, ro.ht), kTol);
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (Variant v : kAllVariants)
    for (Exchange e : {Exchange::allgather, Exchange::ring, Exchange::tree})
      for (Layout l : {Layout::batch_rows, Layout::packed_on_boundary, Layout::packed_across,
                       Layout::packed_from_boundary})
        cases.push_back({v, e, l});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllVariantsExchanges, CpInvariance, ::testing::ValuesIn(all_cases()),
                         case_name);

// The ring splits the state into blocks along Dv: Dv = 10 does not split
// evenly, so its last block is narrower than the rest (giving it the others'
// width went unseen at np 2 and failed from np 3).
INSTANTIATE_TEST_SUITE_P(
    UnevenRingBlocks, CpInvariance,
    ::testing::Values(Case{Variant::gla, Exchange::ring, Layout::batch_rows, 10},
                      Case{Variant::kda, Exchange::ring, Layout::batch_rows, 10}),
    case_name);

// The bytes an exchange reports (the most any rank sent) are those that
// predicted_exchange_bytes models, in both passes, for full and diagonal maps.
TEST(CpExchangeBytes, MatchThePrediction) {
  Communicator& comm = world();
  const int P = comm.size(), r = comm.rank();
  if (P == 1) GTEST_SKIP() << "one rank exchanges nothing";
  for (Variant v : {Variant::gla, Variant::kda})
    for (Exchange x : {Exchange::allgather, Exchange::ring, Exchange::tree}) {
      SCOPED_TRACE(std::string(to_string(v)) + " " + to_string(x));
      const CaseProblem cpp = make_problem({v, x, Layout::batch_rows}, P);
      CpMixer mixer(comm, cpp.cfg, x);
      run_cp(mixer, cpp.p, cpp.bounds[r], cpp.bounds[r + 1], cpp.d_o, cpp.dht);
      const int64_t rows = cpp.p.batch, H = cpp.spec.heads, Dk = cpp.spec.dk, Dv = cpp.spec.dv;
      const int64_t m_size = has_beta(v) ? Dk * Dk : Dk;
      const int64_t state_bytes = rows * H * Dk * Dv * 4;
      const int64_t map_bytes = rows * H * m_size * 4 + state_bytes;
      int64_t most[2] = {mixer.last_forward_stats().exchange_bytes,
                         mixer.last_backward_stats().exchange_bytes};
      comm.all_reduce_max(most, 2, CommType::i64);
      const int64_t want = predicted_exchange_bytes(x, P, map_bytes, state_bytes);
      EXPECT_EQ(most[0], want) << "forward";
      EXPECT_EQ(most[1], want) << "backward";
    }
}

// MixerConfig::recompute_chunk_states: forward keeps only the incoming states
// and backward re-runs the local scan from them, so every output and gradient
// is bitwise the one of the mixer that kept the chunk states (ring exchange;
// the layouts put sequence boundaries on and across rank boundaries).
class CpRecompute : public ::testing::TestWithParam<Case> {};

TEST_P(CpRecompute, GivesTheSavedStatesResults) {
  const Case c = GetParam();
  Communicator& comm = world();
  const int r = comm.rank();
  const CaseProblem cpp = make_problem(c, comm.size());
  const int64_t t0 = cpp.bounds[r], t1 = cpp.bounds[r + 1];
  CpMixer kept(comm, cpp.cfg, c.exchange);
  const CpOutputs want = run_cp(kept, cpp.p, t0, t1, cpp.d_o, cpp.dht);
  MixerConfig cfg = cpp.cfg;
  cfg.recompute_chunk_states = true;
  CpMixer recomputing(comm, cfg, c.exchange);
  const CpOutputs got = run_cp(recomputing, cpp.p, t0, t1, cpp.d_o, cpp.dht);
  auto bits = [](const std::vector<float>& x) {
    std::vector<uint32_t> b(x.size());
    if (!x.empty()) std::memcpy(b.data(), x.data(), x.size() * sizeof(float));
    return b;
  };
  EXPECT_EQ(bits(got.o), bits(want.o)) << "rank " << r;
  EXPECT_EQ(bits(got.ht), bits(want.ht)) << "rank " << r;
  EXPECT_EQ(bits(got.dq), bits(want.dq)) << "rank " << r;
  EXPECT_EQ(bits(got.dk), bits(want.dk)) << "rank " << r;
  EXPECT_EQ(bits(got.dv), bits(want.dv)) << "rank " << r;
  EXPECT_EQ(bits(got.dg), bits(want.dg)) << "rank " << r;
  EXPECT_EQ(bits(got.dbeta), bits(want.dbeta)) << "rank " << r;
  EXPECT_EQ(bits(got.dh0), bits(want.dh0)) << "rank " << r;
}

std::vector<Case> recompute_cases() {
  std::vector<Case> cases;
  for (Variant v : kAllVariants)
    for (Layout l : {Layout::batch_rows, Layout::packed_across})
      cases.push_back({v, Exchange::ring, l});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CpRecompute, ::testing::ValuesIn(recompute_cases()),
                         case_name);

// ---- the control communicator -----------------------------------------------------------

// set_control takes only a communicator of the same ranks in the same order;
// a refusal leaves the mixer as it was, and null restores the default.
TEST(CpControl, TakesOnlyTheSameRanks) {
  Communicator& comm = world();
  MixerConfig cfg;
  cfg.variant = Variant::kda;
  CpMixer mixer(comm, cfg, Exchange::ring);
  mixer.set_control(&comm);
  mixer.set_control(nullptr);
  SingleRankCommunicator self;
  if (comm.size() == 1) {
    mixer.set_control(&self);  // rank 0 of 1 on both
    return;
  }
  try {
    mixer.set_control(&self);
    FAIL() << "a 1-rank control was accepted by a " << comm.size() << "-rank mixer";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "control") << e.what();
  }
}

// ---- the observer at several ranks ---------------------------------------------------

// What a CpObserver heard, call by call.
struct HeardPhase {
  Phase phase;
  double seconds;
  int64_t bytes;
  bool with_strategy;
  Exchange strategy;
};
class RecordingObserver : public CpObserver {
 public:
  void on_phase(Phase phase, double seconds, int64_t bytes) override {
    heard.push_back({phase, seconds, bytes, false, Exchange::automatic});
  }
  void on_exchange(Exchange strategy, double seconds, int64_t bytes) override {
    heard.push_back({Phase::exchange, seconds, bytes, true, strategy});
  }
  std::vector<HeardPhase> heard;
};

// Each pass reports summary, exchange (with its strategy and this rank's
// bytes), merge and its total, as last_*_stats() hold them. At one rank the
// middle three are zeros (tests/test_monitoring.cpp); here, with an exchange,
// the summary and the exchange took time and every rank sent bytes. Every
// variant's forward and backward, both exchanges that send.
TEST(CpObserver, HearsEveryPhaseOfBothPasses) {
  Communicator& comm = world();
  if (comm.size() == 1) GTEST_SKIP() << "the exchange's phases need several ranks";
  const int r = comm.rank();
  for (Variant v : kAllVariants)
    for (Exchange x : {Exchange::allgather, Exchange::ring}) {
      SCOPED_TRACE(std::string(to_string(v)) + " " + to_string(x));
      const CaseProblem cpp = make_problem({v, x, Layout::batch_rows}, comm.size());
      RecordingObserver seen;
      CpMixer mixer(comm, cpp.cfg, x, &seen);
      run_cp(mixer, cpp.p, cpp.bounds[r], cpp.bounds[r + 1], cpp.d_o, cpp.dht);
      ASSERT_EQ(seen.heard.size(), 8u);
      const CpStepStats* passes[2] = {&mixer.last_forward_stats(), &mixer.last_backward_stats()};
      double summary = 0;
      int64_t bytes = 0;
      for (int pass = 0; pass < 2; ++pass) {
        const CpStepStats& s = *passes[pass];
        const HeardPhase* h = &seen.heard[4 * static_cast<std::size_t>(pass)];
        EXPECT_EQ(h[0].phase, Phase::summary);
        EXPECT_EQ(h[0].seconds, s.summary_s);
        EXPECT_TRUE(h[1].with_strategy && h[1].phase == Phase::exchange);
        EXPECT_EQ(h[1].strategy, x);
        EXPECT_EQ(h[1].seconds, s.exchange_s);
        EXPECT_EQ(h[1].bytes, s.exchange_bytes);
        EXPECT_GT(h[1].seconds, 0) << "pass " << pass;
        // The ring's ends send in one direction only (the last rank's
        // forward, the first's backward); an all-gather sends from every rank.
        if (x == Exchange::allgather) {
          EXPECT_GT(h[1].bytes, 0) << "pass " << pass;
        }
        bytes += h[1].bytes;
        EXPECT_EQ(h[2].phase, Phase::merge);
        EXPECT_EQ(h[2].seconds, s.merge_s);
        EXPECT_EQ(h[3].phase, pass == 0 ? Phase::fwd : Phase::bwd);
        EXPECT_EQ(h[3].seconds, s.total_s);
        EXPECT_LE(h[0].seconds + h[1].seconds + h[2].seconds, h[3].seconds);
        summary += h[0].seconds;
      }
      EXPECT_GT(summary, 0);
      EXPECT_GT(bytes, 0);
    }
}

// ---- a failure on one rank alone -----------------------------------------------------

// The victim's forward throws after its last collective, so its peers'
// forwards complete (or stop in their last collective: see
// match_agreement_late) and they wait for it in the backward's first
// agreement. They must hear its fault notice and fail at once, naming it and
// its error, not after their 30-second timeout; the victim keeps its own error.
TEST(CpFaultNotice, AFailureOnOneRankStopsItsPeersAtOnce) {
  Communicator& comm = world();
  if (comm.size() == 1) GTEST_SKIP() << "needs peers to tell";
  const auto group = static_cast<MpiCommunicator&>(comm).split(0, comm.rank());
  group->set_timeout(std::chrono::milliseconds(30000));
  const int P = group->size(), r = group->rank(), victim = P - 1;
  const CaseProblem cpp =
      make_problem({Variant::gated_deltanet, Exchange::ring, Layout::batch_rows}, P);
  FailingObserver failing;
  ForwardEndObserver ended;
  CpMixer mixer(*group, cpp.cfg, Exchange::ring,
                r == victim ? static_cast<CpObserver*>(&failing) : &ended);
  const auto start = std::chrono::steady_clock::now();
  std::optional<Error> e;
  try {
    (void)run_cp(mixer, cpp.p, cpp.bounds[r], cpp.bounds[r + 1], cpp.d_o, cpp.dht);
  } catch (const Error& err) {
    e = err;
  }
  expect_told(e, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), r,
              victim, P, "mpi");
  comm.barrier();
  match_agreement_late(comm, static_cast<MpiCommunicator&>(*group).native(), ended.reached);
  comm.barrier();
}

// ---- `auto` on a measured link -------------------------------------------------------

// measure_link: finite positive figures, the same on every rank (so that every
// rank resolves `auto` alike), the rest of the model taken from `base`.
TEST(MeasureLink, EveryRankGetsTheSamePositiveFigures) {
  Communicator& comm = world();
  LinkModel base;
  base.compose_flops_per_s = 123e9;
  base.gpus_per_node = 4;
  const LinkModel m = measure_link(comm, base);
  if (comm.size() == 1) {
    EXPECT_EQ(m.latency_s, base.latency_s);
    return;
  }
  EXPECT_TRUE(std::isfinite(m.latency_s) && m.latency_s > 0);
  EXPECT_TRUE(std::isfinite(m.bandwidth_Bps) && m.bandwidth_Bps > 0);
  EXPECT_EQ(m.compose_flops_per_s, base.compose_flops_per_s);
  EXPECT_EQ(m.gpus_per_node, base.gpus_per_node);
  // Where the transfer drowned in the latency's noise (bandwidth_measured
  // false) the bandwidth is the base's; either way every rank agrees.
  if (!m.bandwidth_measured) {
    EXPECT_EQ(m.bandwidth_Bps, base.bandwidth_Bps);
  }
  std::vector<double> all(3 * static_cast<std::size_t>(comm.size()));
  const double mine[3] = {m.latency_s, m.bandwidth_Bps, m.bandwidth_measured ? 1.0 : 0.0};
  comm.all_gather(mine, all.data(), 3, CommType::f64);
  for (int r = 0; r < comm.size(); ++r) {
    EXPECT_EQ(all[3 * r], m.latency_s) << "rank " << r;
    EXPECT_EQ(all[3 * r + 1], m.bandwidth_Bps) << "rank " << r;
    EXPECT_EQ(all[3 * r + 2], mine[2]) << "rank " << r;
  }
}

// CpMixer with `auto` measures the link at its first forward and reports it;
// an explicit exchange measures nothing.
TEST(MeasureLink, AutoMixerReportsTheLinkItResolvedWith) {
  Communicator& comm = world();
  const CaseProblem cpp =
      make_problem({Variant::gla, Exchange::automatic, Layout::batch_rows}, comm.size());
  const int r = comm.rank();
  CpMixer automatic(comm, cpp.cfg, Exchange::automatic);
  EXPECT_EQ(automatic.auto_link(), nullptr);
  run_cp(automatic, cpp.p, cpp.bounds[r], cpp.bounds[r + 1], cpp.d_o, cpp.dht);
  if (comm.size() > 1) {
    ASSERT_NE(automatic.auto_link(), nullptr);
    EXPECT_GT(automatic.auto_link()->bandwidth_Bps, 0);
  }
  CpMixer ring(comm, cpp.cfg, Exchange::ring);
  run_cp(ring, cpp.p, cpp.bounds[r], cpp.bounds[r + 1], cpp.d_o, cpp.dht);
  EXPECT_EQ(ring.auto_link(), nullptr);
}

// measure_link_now measures before any forward (statescan-run's timed steps
// then exclude the probe), and the forward keeps that figure; with an
// explicit exchange, or on one rank, it measures nothing.
TEST(MeasureLink, NowMeasuresBeforeTheFirstForward) {
  Communicator& comm = world();
  const CaseProblem cpp =
      make_problem({Variant::gla, Exchange::automatic, Layout::batch_rows}, comm.size());
  const int r = comm.rank();
  CpMixer automatic(comm, cpp.cfg, Exchange::automatic);
  automatic.measure_link_now();
  if (comm.size() == 1) {
    EXPECT_EQ(automatic.auto_link(), nullptr);
  } else {
    ASSERT_NE(automatic.auto_link(), nullptr);
    const double measured = automatic.auto_link()->latency_s;
    EXPECT_GT(measured, 0);
    run_cp(automatic, cpp.p, cpp.bounds[r], cpp.bounds[r + 1], cpp.d_o, cpp.dht);
    ASSERT_NE(automatic.auto_link(), nullptr);
    EXPECT_EQ(automatic.auto_link()->latency_s, measured) << "measured again at the forward";
  }
  CpMixer ring(comm, cpp.cfg, Exchange::ring);
  ring.measure_link_now();
  EXPECT_EQ(ring.auto_link(), nullptr);
}

// ---- errors must reach every rank, with no hang and no partial output -----------

struct CpErrors : ::testing::Test {
  Communicator& comm = world();
  ref::Problem p;
  std::vector<int64_t> bounds;
  void SetUp() override {
    ProblemSpec s;
    s.variant = Variant::gated_deltanet;
    s.seq_len = 40;
    s.heads = 2;
    s.dk = 8;
    s.dv = 8;
    p = random_problem(s, 99);
    bounds = shard_bounds(s.seq_len, comm.size());
  }
  // This rank's shard of the problem; o filled with 12345.
  struct Shard {
    int64_t L = 0;
    std::vector<float> q, k, v, g, beta, o;
    CpForwardArgs args() {
      CpForwardArgs a;
      a.q = TensorView(q.data(), DType::f32, {1, L, 2, 8});
      a.k = TensorView(k.data(), DType::f32, {1, L, 2, 8});
      a.v = TensorView(v.data(), DType::f32, {1, L, 2, 8});
      a.g = TensorView(g.data(), DType::f32, {1, L, 2});
      a.beta = TensorView(beta.data(), DType::f32, {1, L, 2});
      a.o = TensorView(o.data(), DType::f32, {1, L, 2, 8});
      return a;
    }
  };
  Shard shard() const {
    const int r = comm.rank();
    const int64_t b = bounds[r], e = bounds[r + 1];
    Shard sh;
    sh.L = e - b;
    sh.q = slice_tokens(p.q, 1, p.seq_len, b, e, 16);
    sh.k = slice_tokens(p.k, 1, p.seq_len, b, e, 16);
    sh.v = slice_tokens(p.v, 1, p.seq_len, b, e, 16);
    sh.g = slice_tokens(p.g, 1, p.seq_len, b, e, 2);
    sh.beta = slice_tokens(p.beta, 1, p.seq_len, b, e, 2);
    sh.o.assign(sh.v.size(), 12345.f);
    return sh;
  }
  // Runs forward on this rank's shard with rank `culprit`'s input corrupted
  // for `argument`; expects on every rank the error `argument` as raised by
  // rank `reporter` (a cross-rank disagreement is seen by every rank, and the
  // lowest one reports it; its message names the culprit).
  // `how` picks among corruptions of one argument ("same_sum": cu_seqlens
  // whose offsets differ but whose weighted sum does not; "every_rank": the
  // same bad cu_seqlens on every rank).
  void expect_everywhere(const std::string& argument, int culprit, int reporter = -1,
                         const std::string& how = "") {
    if (reporter < 0) reporter = culprit;
    const int r = comm.rank();
    const bool bad = r == culprit;
    MixerConfig cfg;
    cfg.variant = p.variant;
    if (argument == "chunk" && bad) cfg.chunk = 32;
    if (argument == "check_finite" && bad) cfg.check_finite = false;
    if (argument == "scale" && bad) cfg.scale = 0.5;
    if (argument == "l2norm_qk" && bad) cfg.l2norm_qk = true;
    CpMixer mixer(comm, cfg, argument == "exchange" && bad ? Exchange::tree : Exchange::ring);
    Shard sh = shard();
    std::vector<int64_t> cu{0, p.seq_len};
    // [0, 1, 4, 6, T] and [0, 3, 4, 5, T]: sum of cu[n] (n + 1) 38 + 5 T both.
    if (how == "same_sum")
      cu = bad ? std::vector<int64_t>{0, 3, 4, 5, p.seq_len}
               : std::vector<int64_t>{0, 1, 4, 6, p.seq_len};
    if (bad) {
      if (argument == "g") sh.g[1] = std::nanf("");
      if (argument == "cu_seqlens" && how.empty()) cu[1] = p.seq_len + 1;
    }
    // Every rank alike: no cross-rank disagreement to catch it first.
    if (how == "every_rank") cu[1] = p.seq_len + 1;
    const std::size_t states = (cu.size() - 1) * 2 * 8 * 8;
    std::vector<float> ht(states, 12345.f);
    CpForwardArgs a = sh.args();
    if (argument == "cu_seqlens")
      a.cu_seqlens = TensorView(cu.data(), DType::i64, {static_cast<int64_t>(cu.size())});
    // One rank asking for the final state alone would run its all-reduce alone.
    if (argument == "final_state" && bad)
      a.final_state = TensorView(ht.data(), DType::f32, {1, 2, 8, 8});
    expect_collective_error(
        comm, [&] { mixer.forward(a); }, argument, culprit, reporter, sh.o, 12345.f);
  }
};

TEST_F(CpErrors, NanGateOnLastRankFailsEveryRank) {
  expect_everywhere("g", comm.size() - 1);
}

TEST_F(CpErrors, ChunkDisagreeingAcrossRanksFailsEveryRank) {
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  expect_everywhere("chunk", 1, 0);
}

// One rank skipping the NaN/Inf scan while the others run it would let a
// NaN on that rank through unnoticed: refused like any other disagreement.
TEST_F(CpErrors, CheckFiniteDisagreeingAcrossRanksFailsEveryRank) {
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  expect_everywhere("check_finite", 1, 0);
}

TEST_F(CpErrors, CuSeqlensDisagreeingWithShardsFailsEveryRank) {
  expect_everywhere("cu_seqlens", 0);
}

// The same offsets on every rank, their last past the shards' total: each
// rank's own segments look valid (clipped to the shard), so only the check
// against the summed shard lengths catches it (the last sequence's final
// state would otherwise stay 0).
TEST_F(CpErrors, CuSeqlensBeyondTheShardsOnEveryRankFailsEveryRank) {
  expect_everywhere("cu_seqlens", 0, 0, "every_rank");
}

// The offsets are compared by content: arrays that split the sequence
// differently are refused even where a weighted sum of them agrees.
TEST_F(CpErrors, CuSeqlensDifferingAcrossRanksFailsEveryRank) {
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  expect_everywhere("cu_seqlens", 1, 0, "same_sum");
}

// Options and optional outputs every rank must share: a different exchange
// posts messages the others never match, a final state asked for on one rank
// runs its all-reduce there alone, and a different scale or in-op norm gives
// maps the others' do not compose with.
TEST_F(CpErrors, OptionsAndOutputsDisagreeingAcrossRanksFailEveryRank) {
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (const char* argument : {"exchange", "final_state", "scale", "l2norm_qk"}) {
    SCOPED_TRACE(argument);
    expect_everywhere(argument, comm.size() - 1, 0);
  }
}

// Backward: d_initial_state asked for on one rank only (its all-reduce is
// collective) fails every rank before any gradient is written.
TEST_F(CpErrors, InitialStateGradientOnOneRankFailsEveryRank) {
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int r = comm.rank(), culprit = comm.size() - 1;
  MixerConfig cfg;
  cfg.variant = p.variant;
  CpMixer mixer(comm, cfg, Exchange::ring);
  Shard sh = shard();
  const int64_t L = sh.L;
  mixer.forward(sh.args());
  std::vector<float> d_o(sh.v.size(), 0.5f), dq(sh.q.size(), 12345.f), dk(sh.k.size()),
      dv(sh.v.size()), dg(sh.g.size()), dbeta(sh.beta.size()), dh0(2 * 8 * 8);
  CpBackwardArgs b;
  b.d_o = TensorView(d_o.data(), DType::f32, {1, L, 2, 8});
  b.dq = TensorView(dq.data(), DType::f32, {1, L, 2, 8});
  b.dk = TensorView(dk.data(), DType::f32, {1, L, 2, 8});
  b.dv = TensorView(dv.data(), DType::f32, {1, L, 2, 8});
  b.dg = TensorView(dg.data(), DType::f32, {1, L, 2});
  b.dbeta = TensorView(dbeta.data(), DType::f32, {1, L, 2});
  if (r == culprit) b.d_initial_state = TensorView(dh0.data(), DType::f32, {1, 2, 8, 8});
  expect_collective_error(
      comm, [&] { mixer.backward(b); }, "d_initial_state", culprit, 0, dq, 12345.f);
}

}  // namespace
}  // namespace statescan::test
