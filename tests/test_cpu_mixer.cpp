// The fp32 CPU path (kernels/cpu/cpu_mixer.h) against the fp64 reference:
// forward, backward, chunk checkpoints, the CP summary, the state-gradient
// pre-pass, output coverage and argument checking, for all six variants.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/cpu_mixer.h"
#include "kernels/cpu/reference.h"
#include "tests/test_util.h"

namespace statescan::test {
namespace {

constexpr double kTol = 1e-5;  // fp32 path vs fp64 reference (DESIGN §7)
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- a ref::Problem as the CPU path's fp32 inputs ------------------------------

// Holds a problem whose values are all fp32-representable (so the reference
// and the CPU path see identical inputs) and the fp32 copies MixerParams
// points into.
struct Fp32Problem {
  explicit Fp32Problem(ref::Problem problem) : ref(std::move(problem)) {
    for (auto* x : {&ref.q, &ref.k, &ref.v, &ref.g, &ref.beta, &ref.h0}) *x = round_f32(*x);
    q = cast(ref.q);
    k = cast(ref.k);
    v = cast(ref.v);
    g = cast(ref.g);
    beta = cast(ref.beta);
    h0 = cast(ref.h0);
  }

  int64_t num_segments() const { return ref.num_sequences(); }
  std::size_t state_numel() const {
    return static_cast<std::size_t>(num_segments() * ref.heads * ref.dk * ref.dv);
  }

  // Forward parameters without outputs.
  MixerParams params(int64_t chunk) const {
    MixerParams p;
    p.variant = ref.variant;
    p.batch = ref.batch;
    p.seq_len = ref.seq_len;
    p.heads = ref.heads;
    p.dk = ref.dk;
    p.dv = ref.dv;
    p.chunk = chunk;
    p.scale = static_cast<float>(ref.scale);
    p.l2norm_qk = ref.l2norm_qk;
    p.dtype = DType::f32;
    if (!ref.cu_seqlens.empty()) p.cu_seqlens = ref.cu_seqlens.data();
    p.num_segments = num_segments();
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.g = g.empty() ? nullptr : g.data();
    p.beta = beta.empty() ? nullptr : beta.data();
    p.initial_state = h0.empty() ? nullptr : h0.data();
    return p;
  }

  ref::Problem ref;
  std::vector<float> q, k, v, g, beta, h0;
};

struct ForwardResult {
  std::vector<float> o, final_state, chunk_states;
};

// mixer_forward with every output poisoned with NaN beforehand.
ForwardResult run_forward(const Fp32Problem& fp, int64_t chunk) {
  MixerParams p = fp.params(chunk);
  ForwardResult r;
  r.o.assign(fp.v.size(), kNaN);
  r.final_state.assign(fp.state_numel(), kNaN);
  r.chunk_states.assign(static_cast<std::size_t>(count_chunks(p) * p.heads * p.dk * p.dv), kNaN);
  p.o = r.o.data();
  p.final_state = r.final_state.data();
  p.chunk_states = r.chunk_states.data();
  cpu::mixer_forward(p);
  return r;
}

struct BackwardResult {
  std::vector<float> dq, dk, dv, dg, dbeta, dh0;
};

// mixer_backward (after a forward that saved the chunk states), outputs
// poisoned with NaN beforehand. dht may be empty (zero).
// recompute: backward re-derives the chunk states (none are passed to it).
BackwardResult run_backward(const Fp32Problem& fp, int64_t chunk, const std::vector<float>& d_o,
                            const std::vector<float>& dht, bool state_grad_only = false,
                            bool recompute = false) {
  ForwardResult fwd = run_forward(fp, chunk);
  MixerBwdParams p;
  static_cast<MixerParams&>(p) = fp.params(chunk);
  p.o = fwd.o.data();
  p.chunk_states = recompute ? nullptr : fwd.chunk_states.data();
  p.recompute_chunk_states = recompute;
  p.d_o = d_o.data();
  p.d_final_state = dht.empty() ? nullptr : dht.data();
  p.state_grad_only = state_grad_only;
  BackwardResult r;
  r.dh0.assign(fp.state_numel(), kNaN);
  p.d_initial_state = r.dh0.data();
  if (!state_grad_only) {
    r.dq.assign(fp.q.size(), kNaN);
    r.dk.assign(fp.k.size(), kNaN);
    r.dv.assign(fp.v.size(), kNaN);
    r.dg.assign(fp.g.size(), kNaN);
    r.dbeta.assign(fp.beta.size(), kNaN);
    p.dq = r.dq.data();
    p.dk_out = r.dk.data();
    p.dv_out = r.dv.data();
    p.dg = r.dg.empty() ? nullptr : r.dg.data();
    p.dbeta = r.dbeta.empty() ? nullptr : r.dbeta.data();
  }
  cpu::mixer_backward(p);
  return r;
}

// Random cotangents for o and the final state, fp32-representable.
struct Cotangents {
  std::vector<double> d_o, dht;
};
Cotangents random_cotangents(const Fp32Problem& fp, bool with_dht, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Cotangents c;
  c.d_o = round_f32(randn(fp.v.size(), rng));
  if (with_dht) c.dht = round_f32(randn(fp.state_numel(), rng));
  return c;
}

// Segment n's first `len` tokens (len >= 1) as a one-row problem starting from
// that segment's initial state: the reference on it gives the state after
// `len` tokens.
ref::Problem segment_prefix(const ref::Problem& p, int64_t n, int64_t len) {
  const ref::Sequence seq = p.sequence(n);
  const int64_t row = seq.row, begin = seq.begin;
  const int64_t H = p.heads;
  auto slice = [&](const std::vector<double>& x, int64_t inner) {
    std::vector<double> out;
    if (x.empty()) return out;
    const auto first = x.begin() + ((row * p.seq_len + begin) * H) * inner;
    out.assign(first, first + len * H * inner);
    return out;
  };
  ref::Problem s = p;
  s.batch = 1;
  s.seq_len = len;
  s.cu_seqlens.clear();
  s.q = slice(p.q, p.dk);
  s.k = slice(p.k, p.dk);
  s.v = slice(p.v, p.dv);
  s.g = slice(p.g, vector_gate(p.variant) ? p.dk : 1);
  s.beta = slice(p.beta, 1);
  if (!p.h0.empty()) {
    const auto first = p.h0.begin() + n * H * p.dk * p.dv;
    s.h0.assign(first, first + H * p.dk * p.dv);
  }
  return s;
}

// ---- parametrisation ----------------------------------------------------------

struct HeadDims {
  int64_t dk, dv;
};
void PrintTo(const HeadDims& d, std::ostream* os) { *os << "dk" << d.dk << "dv" << d.dv; }

// (variant, chunk, with initial state, l2norm_qk, head dims)
using Case = std::tuple<Variant, int64_t, bool, bool, HeadDims>;

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& [variant, chunk, with_h0, l2norm, dims] = info.param;
  return std::string(to_string(variant)) + "_c" + std::to_string(chunk) + (with_h0 ? "_h0" : "") +
         (l2norm ? "_l2" : "") + "_dk" + std::to_string(dims.dk) + "dv" + std::to_string(dims.dv);
}

class CpuMixer : public ::testing::TestWithParam<Case> {
 protected:
  Variant variant() const { return std::get<0>(GetParam()); }
  int64_t chunk() const { return std::get<1>(GetParam()); }
  bool with_h0() const { return std::get<2>(GetParam()); }
  bool l2norm() const { return std::get<3>(GetParam()); }
  HeadDims dims() const { return std::get<4>(GetParam()); }

  // Two batch rows of 150 tokens: not a multiple of any chunk size.
  ProblemSpec rows_spec() const {
    ProblemSpec s;
    s.variant = variant();
    s.batch = 2;
    s.seq_len = 150;
    s.heads = 2;
    s.dk = dims().dk;
    s.dv = dims().dv;
    s.l2norm_qk = l2norm();
    s.with_h0 = with_h0();
    return s;
  }
  // Three packed sequences in one row, each with its own initial state.
  ProblemSpec packed_spec() const {
    ProblemSpec s = rows_spec();
    s.batch = 1;
    s.seq_len = 133;
    s.cu_seqlens = {0, 5, 70, 133};
    return s;
  }
  // A fresh seed per test and case.
  uint64_t seed() const {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    return std::hash<std::string>{}(std::string(info->name()) + info->test_suite_name());
  }

  void expect_forward_matches(const ProblemSpec& spec) {
    Fp32Problem fp(random_problem(spec, seed()));
    const ref::Outputs want = ref::forward(fp.ref);
    const ForwardResult got = run_forward(fp, chunk());
    EXPECT_LE(rel_rms(got.o, want.o), kTol);
    EXPECT_LE(rel_rms(got.final_state, want.ht), kTol);
  }

  void expect_backward_matches(const ProblemSpec& spec) {
    Fp32Problem fp(random_problem(spec, seed()));
    const Cotangents ct = random_cotangents(fp, /*with_dht=*/true, seed() + 1);
    const ref::Grads want = ref::backward(fp.ref, ct.d_o, ct.dht);
    const BackwardResult got = run_backward(fp, chunk(), cast(ct.d_o), cast(ct.dht));
    EXPECT_LE(rel_rms(got.dq, want.dq), kTol) << "dq";
    EXPECT_LE(rel_rms(got.dk, want.dk), kTol) << "dk";
    EXPECT_LE(rel_rms(got.dv, want.dv), kTol) << "dv";
    EXPECT_LE(rel_rms(got.dg, want.dg), kTol) << "dg";
    EXPECT_LE(rel_rms(got.dbeta, want.dbeta), kTol) << "dbeta";
    EXPECT_LE(rel_rms(got.dh0, want.dh0), kTol) << "d_initial_state";
  }

  void expect_chunk_states_match(const ProblemSpec& spec) {
    Fp32Problem fp(random_problem(spec, seed()));
    const ForwardResult got = run_forward(fp, chunk());
    const MixerParams p = fp.params(chunk());
    const int64_t state_size = p.heads * p.dk * p.dv;
    for (int64_t n = 0; n < p.num_segments; ++n) {
      const int64_t len = segment_end(p, n) - segment_begin(p, n);
      const int64_t first = first_chunk_of_segment(p, n);
      for (int64_t c = 0; c * p.chunk < len; ++c) {
        // The state entering chunk c: the segment's initial state for c = 0,
        // else the reference's final state after c * chunk tokens.
        std::vector<double> want(static_cast<std::size_t>(state_size), 0.0);
        if (c == 0) {
          if (!fp.ref.h0.empty())
            want.assign(fp.ref.h0.begin() + n * state_size,
                        fp.ref.h0.begin() + (n + 1) * state_size);
        } else {
          want = ref::forward(segment_prefix(fp.ref, n, c * p.chunk)).ht;
        }
        const auto first_value = got.chunk_states.begin() + (first + c) * state_size;
        const std::vector<float> have(first_value, first_value + state_size);
        EXPECT_LE(rel_rms(have, want), kTol) << "segment " << n << " chunk " << c;
      }
    }
  }
};

// ---- forward ----------------------------------------------------------------------

TEST_P(CpuMixer, ForwardMatchesReference) {
  expect_forward_matches(rows_spec());
}

TEST_P(CpuMixer, ForwardPackedSequencesMatchReference) {
  expect_forward_matches(packed_spec());
}

TEST_P(CpuMixer, ChunkStatesAreStatesAtChunkStarts) {
  expect_chunk_states_match(rows_spec());
}

TEST_P(CpuMixer, ChunkStatesOfPackedSequencesAreStatesAtChunkStarts) {
  expect_chunk_states_match(packed_spec());
}

// ---- backward ---------------------------------------------------------------------

TEST_P(CpuMixer, BackwardMatchesReference) {
  expect_backward_matches(rows_spec());
}

TEST_P(CpuMixer, BackwardPackedSequencesMatchReference) {
  expect_backward_matches(packed_spec());
}

TEST_P(CpuMixer, StateGradOnlyEqualsFullBackward) {
  Fp32Problem fp(random_problem(packed_spec(), seed()));
  const Cotangents ct = random_cotangents(fp, with_h0(), seed() + 1);
  const BackwardResult full = run_backward(fp, chunk(), cast(ct.d_o), cast(ct.dht));
  const BackwardResult only = run_backward(fp, chunk(), cast(ct.d_o), cast(ct.dht), true);
  EXPECT_LE(rel_rms(only.dh0, full.dh0), kTol);
}

// Backward that recomputes the chunk states (the same forward pass) gives
// bitwise the gradients of the one that reads the saved states.
TEST_P(CpuMixer, RecomputedChunkStatesGiveTheSavedStatesGradients) {
  Fp32Problem fp(random_problem(packed_spec(), seed()));
  const Cotangents ct = random_cotangents(fp, with_h0(), seed() + 2);
  const BackwardResult saved = run_backward(fp, chunk(), cast(ct.d_o), cast(ct.dht));
  const BackwardResult again = run_backward(fp, chunk(), cast(ct.d_o), cast(ct.dht), false, true);
  auto bits = [](const std::vector<float>& x) {
    std::vector<uint32_t> b(x.size());
    if (!x.empty()) std::memcpy(b.data(), x.data(), x.size() * sizeof(float));
    return b;
  };
  EXPECT_EQ(bits(again.dq), bits(saved.dq));
  EXPECT_EQ(bits(again.dk), bits(saved.dk));
  EXPECT_EQ(bits(again.dv), bits(saved.dv));
  EXPECT_EQ(bits(again.dg), bits(saved.dg));
  EXPECT_EQ(bits(again.dbeta), bits(saved.dbeta));
  EXPECT_EQ(bits(again.dh0), bits(saved.dh0));
}

// ---- summary (DESIGN §5) ---------------------------------------------------------

// M S0 + E, with (M, E) the summary from a zero start, vs the reference's
// final state from S0 = fp's h0, for the last segment of every batch row.
void expect_summary_composes(const Fp32Problem& fp, int64_t chunk) {
  Fp32Problem zero_start = fp;
  zero_start.h0.clear();
  MixerParams p = zero_start.params(chunk);
  std::vector<float> o(fp.v.size());
  p.o = o.data();
  const int64_t rows = p.cu_seqlens ? 1 : p.batch;
  const int64_t H = p.heads, dk = p.dk, dv = p.dv, m_size = cpu::summary_m_size(p);
  std::vector<float> M(static_cast<std::size_t>(rows * H * m_size), kNaN);
  std::vector<float> E(static_cast<std::size_t>(rows * H * dk * dv), kNaN);
  cpu::mixer_summary(p, M.data(), E.data());

  const ref::Outputs want = ref::forward(fp.ref);
  std::vector<double> composed, wanted;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t segment = p.cu_seqlens ? p.num_segments - 1 : r;
    for (int64_t h = 0; h < H; ++h) {
      const double* s0 = &fp.ref.h0[(segment * H + h) * dk * dv];
      const float* m = &M[(r * H + h) * m_size];
      const float* e = &E[(r * H + h) * dk * dv];
      for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = 0; j < dv; ++j) {
          double x = e[i * dv + j];
          if (m_size == dk) {
            x += m[i] * s0[i * dv + j];
          } else {
            for (int64_t l = 0; l < dk; ++l) x += m[i * dk + l] * s0[l * dv + j];
          }
          composed.push_back(x);
          wanted.push_back(want.ht[((segment * H + h) * dk + i) * dv + j]);
        }
    }
  }
  EXPECT_LE(rel_rms(composed, wanted), kTol);
}

TEST_P(CpuMixer, SummaryComposesToFinalState) {
  ProblemSpec s = rows_spec();
  s.with_h0 = true;  // S0 to compose with
  expect_summary_composes(Fp32Problem(random_problem(s, seed())), chunk());
}

TEST_P(CpuMixer, SummaryOfPackedSequencesDescribesLastSegment) {
  ProblemSpec s = packed_spec();
  s.with_h0 = true;
  expect_summary_composes(Fp32Problem(random_problem(s, seed())), chunk());
}

TEST_P(CpuMixer, SummaryEIsFinalStateFromInitialState) {
  Fp32Problem fp(random_problem(rows_spec(), seed()));
  MixerParams p = fp.params(chunk());
  std::vector<float> o(fp.v.size());
  p.o = o.data();
  std::vector<float> M(static_cast<std::size_t>(p.batch * p.heads * cpu::summary_m_size(p)));
  std::vector<float> E(fp.state_numel(), kNaN);  // one segment per row: [N,H,Dk,Dv]
  cpu::mixer_summary(p, M.data(), E.data());
  EXPECT_LE(rel_rms(E, ref::forward(fp.ref).ht), kTol);
}

// ---- coverage ---------------------------------------------------------------------

TEST_P(CpuMixer, EveryOutputIsWritten) {
  Fp32Problem fp(random_problem(packed_spec(), seed()));
  const Cotangents ct = random_cotangents(fp, with_h0(), seed() + 1);
  const ForwardResult fwd = run_forward(fp, chunk());
  const BackwardResult bwd = run_backward(fp, chunk(), cast(ct.d_o), cast(ct.dht));
  // rel_rms of x against itself is 0 unless some element is NaN/Inf.
  for (const auto* x : {&fwd.o, &fwd.final_state, &fwd.chunk_states, &bwd.dq, &bwd.dk, &bwd.dv,
                        &bwd.dg, &bwd.dbeta, &bwd.dh0})
    EXPECT_EQ(rel_rms(*x, *x), 0.0);
}

constexpr HeadDims kSquare{16, 16};
constexpr HeadDims kMixed{32, 64};
// Not multiples of the kernels' 8-wide dot products: their scalar tails run
// (mutation testing found them reached only through test_cp_mixer).
constexpr HeadDims kOdd{12, 20};

INSTANTIATE_TEST_SUITE_P(AllVariants, CpuMixer,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants),
                                            ::testing::Values<int64_t>(16, 64), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Values(kSquare)),
                         case_name);

INSTANTIATE_TEST_SUITE_P(MixedHeadDims, CpuMixer,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants),
                                            ::testing::Values<int64_t>(32), ::testing::Values(true),
                                            ::testing::Bool(), ::testing::Values(kMixed, kOdd)),
                         case_name);

// ---- bad input -------------------------------------------------------------------

std::string variant_param_name(const ::testing::TestParamInfo<Variant>& info) {
  return to_string(info.param);
}

class CpuMixerArguments : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    ProblemSpec s;
    s.variant = GetParam();
    s.seq_len = 40;
    s.dk = s.dv = 8;
    fp_ = std::make_unique<Fp32Problem>(random_problem(s, 17));
    o_.assign(fp_->v.size(), kSentinel);
  }
  MixerParams params() const {
    MixerParams p = fp_->params(16);
    p.o = const_cast<float*>(o_.data());
    return p;
  }
  static constexpr float kSentinel = 12345.f;
  // fn must throw a statescan::Error naming `argument`, before writing o or
  // any of `outputs` (the call's own outputs, filled with kSentinel).
  template <typename Fn>
  void expect_rejects(Fn&& fn, const std::string& argument,
                      std::initializer_list<const std::vector<float>*> outputs = {}) {
    try {
      fn();
      ADD_FAILURE() << "no error thrown; expected one naming " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    for (float x : o_) ASSERT_EQ(x, kSentinel) << "o was written before the error";
    for (const std::vector<float>* out : outputs)
      for (float x : *out) ASSERT_EQ(x, kSentinel) << "an output was written before the error";
  }

  std::unique_ptr<Fp32Problem> fp_;
  std::vector<float> o_;
};

TEST_P(CpuMixerArguments, RejectsNonF32Dtype) {
  MixerParams p = params();
  p.dtype = DType::bf16;
  expect_rejects([&] { cpu::mixer_forward(p); }, "dtype");
}

// MixerParams::saved_t is a GPU-path buffer: the CPU path names it rather
// than ignore it (a caller would expect its backward to read it).
TEST_P(CpuMixerArguments, RejectsSavedT) {
  MixerParams p = params();
  std::vector<unsigned char> t(64);
  p.saved_t = t.data();
  expect_rejects([&] { cpu::mixer_forward(p); }, "saved_t");
}

TEST_P(CpuMixerArguments, RejectsChunk48) {
  MixerParams p = params();
  p.chunk = 48;
  expect_rejects([&] { cpu::mixer_forward(p); }, "chunk");
}

TEST_P(CpuMixerArguments, RejectsCuSeqlensNotEndingAtT) {
  MixerParams p = params();
  const std::vector<int64_t> cu{0, 10, 39};
  p.cu_seqlens = cu.data();
  p.num_segments = 2;
  expect_rejects([&] { cpu::mixer_forward(p); }, "cu_seqlens");
}

// Gated variants need g; the others must not get one.
TEST_P(CpuMixerArguments, RejectsGateMismatchedWithVariant) {
  MixerParams p = params();
  const std::vector<float> stray_g(fp_->q.size(), -0.1f);
  p.g = has_gate(GetParam()) ? nullptr : stray_g.data();
  expect_rejects([&] { cpu::mixer_forward(p); }, "g");
}

TEST_P(CpuMixerArguments, BackwardRejectsMissingChunkStates) {
  MixerBwdParams p;
  static_cast<MixerParams&>(p) = params();
  std::vector<float> d_o(fp_->v.size()), dq(fp_->q.size(), kSentinel), dk(fp_->k.size(), kSentinel),
      dv(fp_->v.size(), kSentinel), dg(fp_->g.size(), kSentinel),
      dbeta(fp_->beta.size(), kSentinel);
  p.d_o = d_o.data();
  p.dq = dq.data();
  p.dk_out = dk.data();
  p.dv_out = dv.data();
  p.dg = dg.empty() ? nullptr : dg.data();
  p.dbeta = dbeta.empty() ? nullptr : dbeta.data();
  expect_rejects([&] { cpu::mixer_backward(p); }, "chunk_states", {&dq, &dk, &dv, &dg, &dbeta});
}

// An infinite scale passed the old "> 0" test and made every output inf.
TEST_P(CpuMixerArguments, RejectsNonFiniteScale) {
  MixerParams p = params();
  p.scale = std::numeric_limits<float>::infinity();
  expect_rejects([&] { cpu::mixer_forward(p); }, "scale");
}

// MixerParams' own checks, each naming its argument: an empty packed segment,
// segments that do not match the batch, and backward's optional outputs.
TEST_P(CpuMixerArguments, RejectsEmptySegment) {
  MixerParams p = params();
  const std::vector<int64_t> cu{0, 3, 3, 40};
  p.cu_seqlens = cu.data();
  p.num_segments = 3;
  expect_rejects([&] { cpu::mixer_forward(p); }, "cu_seqlens");
}

TEST_P(CpuMixerArguments, RejectsSegmentsNotMatchingBatch) {
  MixerParams p = params();
  p.num_segments = p.batch + 1;
  expect_rejects([&] { cpu::mixer_forward(p); }, "num_segments");
}

TEST_P(CpuMixerArguments, BackwardRejectsMisplacedOptionalGradients) {
  std::vector<float> states(static_cast<std::size_t>(64 * 64 * 64)), d_o(fp_->v.size()),
      dq(fp_->q.size(), kSentinel), dk(fp_->k.size(), kSentinel), dv(fp_->v.size(), kSentinel),
      stray(fp_->q.size(), kSentinel);
  auto base = [&] {
    MixerBwdParams p;
    static_cast<MixerParams&>(p) = params();
    p.chunk_states = states.data();
    p.d_o = d_o.data();
    p.dq = dq.data();
    p.dk_out = dk.data();
    p.dv_out = dv.data();
    p.dg = has_gate(GetParam()) ? stray.data() : nullptr;
    p.dbeta = has_beta(GetParam()) ? stray.data() : nullptr;
    return p;
  };
  MixerBwdParams p = base();
  p.dg = has_gate(GetParam()) ? nullptr : stray.data();  // missing, or given without g
  expect_rejects([&] { cpu::mixer_backward(p); }, "dg", {&dq, &dk, &dv, &stray});
  p = base();
  p.dbeta = has_beta(GetParam()) ? nullptr : stray.data();
  expect_rejects([&] { cpu::mixer_backward(p); }, "dbeta", {&dq, &dk, &dv, &stray});
  p = base();
  p.state_grad_only = true;  // needs d_initial_state
  expect_rejects([&] { cpu::mixer_backward(p); }, "d_initial_state", {&dq, &dk, &dv, &stray});
}

TEST_P(CpuMixerArguments, SummaryRejectsNullOutputs) {
  const MixerParams p = params();
  std::vector<float> E(static_cast<std::size_t>(p.heads * p.dk * p.dv), kSentinel);
  expect_rejects([&] { cpu::mixer_summary(p, nullptr, E.data()); }, "M", {&E});
  // A summary call writes no o; a null E must be named as E, not as the o it
  // stands in for during validation.
  MixerParams no_o = p;
  no_o.o = nullptr;
  std::vector<float> M(static_cast<std::size_t>(p.heads * p.dk * p.dk), kSentinel);
  expect_rejects([&] { cpu::mixer_summary(no_o, M.data(), nullptr); }, "E", {&M});
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CpuMixerArguments, ::testing::ValuesIn(kAllVariants),
                         variant_param_name);

using CpuMixerGateArguments = CpuMixerArguments;

TEST_P(CpuMixerGateArguments, RejectsNonFiniteGate) {
  std::vector<float> g = fp_->g;
  g[g.size() / 2] = -std::numeric_limits<float>::infinity();  // only the finiteness test refuses it
  MixerParams p = params();
  p.g = g.data();
  expect_rejects([&] { cpu::mixer_forward(p); }, "g");
}

// g = log alpha with alpha in (0, 1]: a positive gate (a raw logit, say) grew
// the state to inf within a few dozen tokens without an error.
TEST_P(CpuMixerGateArguments, RejectsPositiveGate) {
  std::vector<float> g = fp_->g;
  g[g.size() / 3] = 0.5f;
  MixerParams p = params();
  p.g = g.data();
  expect_rejects([&] { cpu::mixer_forward(p); }, "g");
  g[g.size() / 3] = 0.f;  // alpha = 1: allowed
  EXPECT_NO_THROW(cpu::mixer_forward(p));
}

INSTANTIATE_TEST_SUITE_P(GatedVariants, CpuMixerGateArguments,
                         ::testing::Values(Variant::retention, Variant::gla,
                                           Variant::gated_deltanet, Variant::kda),
                         variant_param_name);

using CpuMixerBetaArguments = CpuMixerArguments;

// beta scales every delta-rule update: a NaN there poisoned every output.
TEST_P(CpuMixerBetaArguments, RejectsNonFiniteBeta) {
  std::vector<float> beta = fp_->beta;
  beta[beta.size() / 2] = std::numeric_limits<float>::quiet_NaN();
  MixerParams p = params();
  p.beta = beta.data();
  expect_rejects([&] { cpu::mixer_forward(p); }, "beta");
}

INSTANTIATE_TEST_SUITE_P(DeltaVariants, CpuMixerBetaArguments,
                         ::testing::Values(Variant::deltanet, Variant::gated_deltanet,
                                           Variant::kda),
                         variant_param_name);

TEST(CpuMixerSummary, MSizeIsMatrixForDeltaAndDiagonalForAdditive) {
  MixerParams p;
  p.dk = 32;
  p.variant = Variant::gated_deltanet;
  EXPECT_EQ(cpu::summary_m_size(p), 32 * 32);
  p.variant = Variant::gla;
  EXPECT_EQ(cpu::summary_m_size(p), 32);
}

}  // namespace
}  // namespace statescan::test
