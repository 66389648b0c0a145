// LaCT (kernels/cpu/lact.h, parallel/lact_layer.h), single process: the fp64
// reference forward against a naive token-by-token implementation of the
// header's semantics, its backward against fp64 finite differences for every
// gradient over every option combination, the fp32 CPU path against the
// reference, sequences whose last chunk is partial, the sharded-layout
// helpers, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel_for.h"
#include "tests/expect_error.h"
#include "tests/lact_test_util.h"

namespace statescan::test {
namespace {

// DESIGN §7: fp32 inputs must be within 1e-5 relative RMS of the fp64 reference.
constexpr double kF32Tol = 1e-5;
// Fourth-order central differences with step 1e-5 in fp64. Muon makes the
// update scale-free (NS normalises P, which scales with lr ~ 0.05), so the
// loss varies on the scale of the learning rates themselves: d/dlr reaches
// ~100 and a step of 1e-4 already left 5e-6 truncation error there (it falls
// as h^4: 4e-8 at 3e-5, 5e-10 at 1e-5). At 1e-5 truncation and rounding both
// stay near 1e-9 relative; a wrong term shows up at 1e-2 and above.
constexpr double kFdStep = 1e-5;
constexpr double kFdTol = 1e-7;
// The naive forward and the kernel do the same fp64 arithmetic in a
// different order.
constexpr double kNaiveTol = 1e-11;

// ---- a naive implementation of the header's semantics ---------------------

using Mat = std::vector<std::vector<double>>;

Mat zeros(std::size_t r, std::size_t c) {
  return Mat(r, std::vector<double>(c, 0.0));
}

Mat transposed(const Mat& a) {
  Mat t = zeros(a[0].size(), a.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t j = 0; j < a[0].size(); ++j) t[j][i] = a[i][j];
  return t;
}

Mat matmul(const Mat& a, const Mat& b) {
  Mat c = zeros(a.size(), b[0].size());
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t l = 0; l < b.size(); ++l)
      for (std::size_t j = 0; j < b[0].size(); ++j) c[i][j] += a[i][l] * b[l][j];
  return c;
}

Mat newton_schulz_naive(const Mat& p, int steps) {
  const bool flip = p.size() > p[0].size();
  Mat x = flip ? transposed(p) : p;
  double f = 0;
  for (auto& row : x)
    for (double e : row) f += e * e;
  for (auto& row : x)
    for (double& e : row) e /= std::sqrt(f) + 1e-7;
  for (int s = 0; s < steps; ++s) {
    const Mat a = matmul(x, transposed(x));
    const Mat aa = matmul(a, a);
    Mat b = zeros(a.size(), a.size());
    for (std::size_t i = 0; i < a.size(); ++i)
      for (std::size_t j = 0; j < a.size(); ++j) b[i][j] = -4.7750 * a[i][j] + 2.0315 * aa[i][j];
    const Mat bx = matmul(b, x);
    for (std::size_t i = 0; i < x.size(); ++i)
      for (std::size_t j = 0; j < x[0].size(); ++j) x[i][j] = 3.4445 * x[i][j] + bx[i][j];
  }
  return flip ? transposed(x) : x;
}

double silu(double x) {
  return x / (1 + std::exp(-x));
}

// o of every token, one (b, h) at a time, token by token.
std::vector<double> naive_forward(const LactProblem& p, const LactConfig& cfg) {
  const auto& s = p.s;
  const std::size_t D = static_cast<std::size_t>(s.dim), M = static_cast<std::size_t>(s.hidden);
  std::vector<double> o(p.q.size(), 0.0);
  auto tok = [&](int64_t b, int64_t t, int64_t h) {
    return static_cast<std::size_t>(((b * s.seq_len + t) * s.heads + h) * s.dim);
  };
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h) {
      Mat W[3] = {zeros(M, D), zeros(D, M), zeros(M, D)};
      const std::vector<double>* src[3] = {&p.w0, &p.w1, &p.w2};
      for (int i = 0; i < 3; ++i)
        for (std::size_t r = 0; r < W[i].size(); ++r)
          for (std::size_t c = 0; c < W[i][0].size(); ++c)
            W[i][r][c] = (*src[i])[h * M * D + r * W[i][0].size() + c];
      std::vector<double> norm[3];
      for (int i = 0; i < 3; ++i)
        for (auto& row : W[i]) {
          double n = 0;
          for (double e : row) n += e * e;
          norm[i].push_back(std::sqrt(n));
        }
      Mat Pm[3] = {zeros(M, D), zeros(D, M), zeros(M, D)};
      auto apply = [&](int64_t t) {
        const double* x = &p.q[tok(b, t, h)];
        std::vector<double> g(M);
        for (std::size_t m = 0; m < M; ++m) {
          double h0 = 0, h2 = 0;
          for (std::size_t d = 0; d < D; ++d) {
            h0 += W[0][m][d] * x[d];
            h2 += W[2][m][d] * x[d];
          }
          g[m] = silu(h0) * h2;
        }
        for (std::size_t d = 0; d < D; ++d) {
          double y = 0;
          for (std::size_t m = 0; m < M; ++m) y += W[1][d][m] * g[m];
          o[tok(b, t, h) + d] = y;
        }
      };
      for (int64_t c0 = 0; c0 < s.seq_len; c0 += cfg.chunk) {
        const int64_t c1 = std::min(c0 + cfg.chunk, s.seq_len);
        if (cfg.schedule == LactSchedule::apply_then_update)
          for (int64_t t = c0; t < c1; ++t) apply(t);
        Mat G[3] = {zeros(M, D), zeros(D, M), zeros(M, D)};
        for (int64_t t = c0; t < c1; ++t) {
          const double* k = &p.k[tok(b, t, h)];
          const double* v = &p.v[tok(b, t, h)];
          const std::size_t lr = static_cast<std::size_t>((b * s.seq_len + t) * s.heads + h);
          for (std::size_t m = 0; m < M; ++m) {
            double h0 = 0, h2 = 0, e = 0;
            for (std::size_t d = 0; d < D; ++d) {
              h0 += W[0][m][d] * k[d];
              h2 += W[2][m][d] * k[d];
              e -= W[1][d][m] * v[d];  // dL/dg_m for L = -<f(k), v>
            }
            const double sg = 1 / (1 + std::exp(-h0));
            const double dsilu = sg * (1 + h0 * (1 - sg));
            for (std::size_t d = 0; d < D; ++d) {
              G[0][m][d] += p.lr0[lr] * e * h2 * dsilu * k[d];
              G[2][m][d] += p.lr2[lr] * e * silu(h0) * k[d];
              G[1][d][m] -= p.lr1[lr] * v[d] * silu(h0) * h2;
            }
          }
        }
        for (int i = 0; i < 3; ++i) {
          for (std::size_t r = 0; r < G[i].size(); ++r)
            for (std::size_t c = 0; c < G[i][0].size(); ++c)
              Pm[i][r][c] = cfg.momentum * Pm[i][r][c] + G[i][r][c];
          const Mat step = cfg.muon_steps > 0 ? newton_schulz_naive(Pm[i], cfg.muon_steps) : Pm[i];
          for (std::size_t r = 0; r < W[i].size(); ++r) {
            double n = 0;
            for (std::size_t c = 0; c < W[i][0].size(); ++c) {
              W[i][r][c] -= step[r][c];
              n += W[i][r][c] * W[i][r][c];
            }
            if (cfg.renorm)
              for (double& e : W[i][r]) e = e / (std::sqrt(n) + 1e-7) * norm[i][r];
          }
        }
        if (cfg.schedule == LactSchedule::update_then_apply)
          for (int64_t t = c0; t < c1; ++t) apply(t);
      }
    }
  return o;
}

// ---- finite differences -----------------------------------------------------

double loss(const LactProblem& p, const LactConfig& cfg) {
  const auto o = run_lact_kernel<double>(p, cfg, /*backward=*/false).o;
  double l = 0;
  for (std::size_t i = 0; i < o.size(); ++i) l += o[i] * p.d_o[i];
  return l;
}

// d loss / d (p.*field) by fourth-order central differences, element by element (threaded
// over elements; the kernel's own loops then run serially).
std::vector<double> fd_gradient(const LactProblem& p, std::vector<double> LactProblem::*field,
                                const LactConfig& cfg) {
  std::vector<double> grad((p.*field).size());
  parallel_for(static_cast<int64_t>(grad.size()), [&](int64_t i) {
    LactProblem x = p;
    auto at = [&](double offset) {
      (x.*field)[i] = (p.*field)[i] + offset;
      return loss(x, cfg);
    };
    const double near = at(kFdStep) - at(-kFdStep), far = at(2 * kFdStep) - at(-2 * kFdStep);
    grad[i] = (8 * near - far) / (12 * kFdStep);
  });
  return grad;
}

class LactReference : public ::testing::TestWithParam<LactCase> {
 protected:
  static constexpr int64_t kChunk = 4;
  LactProblem problem(uint64_t salt) const {
    const LactCase& c = GetParam();
    const uint64_t seed = 900 + salt * 64 + static_cast<uint64_t>(c.schedule) * 8 +
                          (c.momentum ? 4 : 0) + (c.muon ? 2 : 0) + (c.renorm ? 1 : 0);
    return random_lact_problem(LactSizes{}, seed);  // B=2, T=12, H=2, D=4, M=6
  }
};

TEST_P(LactReference, ForwardMatchesNaiveImplementation) {
  const LactProblem p = problem(0);
  const LactConfig cfg = GetParam().config(kChunk);
  EXPECT_LE(rel_rms(run_lact_kernel<double>(p, cfg, false).o, naive_forward(p, cfg)), kNaiveTol);
}

TEST_P(LactReference, TokenGradientsMatchFiniteDifferences) {
  const LactProblem p = problem(1);
  const LactConfig cfg = GetParam().config(kChunk);
  const auto r = run_lact_kernel<double>(p, cfg);
  EXPECT_LE(rel_rms(r.dq, fd_gradient(p, &LactProblem::q, cfg)), kFdTol);
  EXPECT_LE(rel_rms(r.dk, fd_gradient(p, &LactProblem::k, cfg)), kFdTol);
  EXPECT_LE(rel_rms(r.dv, fd_gradient(p, &LactProblem::v, cfg)), kFdTol);
}

TEST_P(LactReference, LearningRateGradientsMatchFiniteDifferences) {
  const LactProblem p = problem(2);
  const LactConfig cfg = GetParam().config(kChunk);
  const auto r = run_lact_kernel<double>(p, cfg);
  EXPECT_LE(rel_rms(r.dlr0, fd_gradient(p, &LactProblem::lr0, cfg)), kFdTol);
  EXPECT_LE(rel_rms(r.dlr1, fd_gradient(p, &LactProblem::lr1, cfg)), kFdTol);
  EXPECT_LE(rel_rms(r.dlr2, fd_gradient(p, &LactProblem::lr2, cfg)), kFdTol);
}

TEST_P(LactReference, InitialWeightGradientsMatchFiniteDifferences) {
  const LactProblem p = problem(3);
  const LactConfig cfg = GetParam().config(kChunk);
  const auto r = run_lact_kernel<double>(p, cfg);
  EXPECT_LE(rel_rms(r.dw0, fd_gradient(p, &LactProblem::w0, cfg)), kFdTol);
  EXPECT_LE(rel_rms(r.dw1, fd_gradient(p, &LactProblem::w1, cfg)), kFdTol);
  EXPECT_LE(rel_rms(r.dw2, fd_gradient(p, &LactProblem::w2, cfg)), kFdTol);
}

// T = 10 with C = 4: chunks of 4, 4 and 2 tokens.
TEST_P(LactReference, PartialLastChunkMatchesNaiveAndFiniteDifferences) {
  LactSizes s;
  s.seq_len = 10;
  const LactProblem p = random_lact_problem(s, 77 + static_cast<uint64_t>(GetParam().schedule));
  const LactConfig cfg = GetParam().config(kChunk);
  const auto r = run_lact_kernel<double>(p, cfg);
  EXPECT_LE(rel_rms(r.o, naive_forward(p, cfg)), kNaiveTol);
  EXPECT_LE(rel_rms(r.dk, fd_gradient(p, &LactProblem::k, cfg)), kFdTol);
  EXPECT_LE(rel_rms(r.dlr1, fd_gradient(p, &LactProblem::lr1, cfg)), kFdTol);
  EXPECT_LE(rel_rms(r.dw0, fd_gradient(p, &LactProblem::w0, cfg)), kFdTol);
}

std::string case_name(const ::testing::TestParamInfo<LactCase>& info) {
  return lact_case_name(info.param);
}

INSTANTIATE_TEST_SUITE_P(AllOptions, LactReference, ::testing::ValuesIn(all_lact_cases()),
                         case_name);

// ---- the fp32 CPU path against the fp64 reference -----------------------------

void expect_close(const LactResult<float>& got, const LactResult<double>& ref, double tol,
                  const std::string& what) {
  EXPECT_LE(rel_rms(got.o, ref.o), tol) << what << " o";
  EXPECT_LE(rel_rms(got.dq, ref.dq), tol) << what << " dq";
  EXPECT_LE(rel_rms(got.dk, ref.dk), tol) << what << " dk";
  EXPECT_LE(rel_rms(got.dv, ref.dv), tol) << what << " dv";
  EXPECT_LE(rel_rms(got.dlr0, ref.dlr0), tol) << what << " dlr0";
  EXPECT_LE(rel_rms(got.dlr1, ref.dlr1), tol) << what << " dlr1";
  EXPECT_LE(rel_rms(got.dlr2, ref.dlr2), tol) << what << " dlr2";
  EXPECT_LE(rel_rms(got.dw0, ref.dw0), tol) << what << " dw0";
  EXPECT_LE(rel_rms(got.dw1, ref.dw1), tol) << what << " dw1";
  EXPECT_LE(rel_rms(got.dw2, ref.dw2), tol) << what << " dw2";
}

class LactCpuPath : public ::testing::TestWithParam<LactCase> {
 protected:
  uint64_t seed() const {
    const LactCase& c = GetParam();
    return 3100 + static_cast<uint64_t>(c.schedule) * 8 + (c.momentum ? 4 : 0) + (c.muon ? 2 : 0) +
           (c.renorm ? 1 : 0);
  }
};

TEST_P(LactCpuPath, MatchesReference) {
  const LactSizes s{2, 96, 2, 16, 32};
  const LactProblem p = rounded(random_lact_problem(s, seed()));
  const LactConfig cfg = GetParam().config(32);
  expect_close(run_lact_kernel<float>(p, cfg), run_lact_kernel<double>(p, cfg), kF32Tol, "");
}

// T = 70 with C = 16: the last chunk has 6 tokens.
TEST_P(LactCpuPath, PartialLastChunkMatchesReference) {
  const LactSizes s{1, 70, 2, 16, 24};
  const LactProblem p = rounded(random_lact_problem(s, seed() + 1000));
  const LactConfig cfg = GetParam().config(16);
  expect_close(run_lact_kernel<float>(p, cfg), run_lact_kernel<double>(p, cfg), kF32Tol, "");
}

// The layer over a group of one is the fp32 kernel, checked against fp64.
TEST_P(LactCpuPath, SingleRankLayerMatchesReference) {
  const LactSizes s{2, 48, 2, 8, 16};
  const LactProblem p = rounded(random_lact_problem(s, seed() + 2000));
  const LactConfig cfg = GetParam().config(16);
  SingleRankCommunicator self;
  LactLayer layer(self, cfg);
  expect_close(run_lact_layer(layer, p, 1, 0), run_lact_kernel<double>(p, cfg), kF32Tol, "");
  // A group of one exchanges nothing, so it reports no all-reduces.
  EXPECT_EQ(layer.last_forward_exchange().calls, 0);
  EXPECT_EQ(layer.last_backward_exchange().calls, 0);
  EXPECT_EQ(layer.last_forward_exchange().bytes + layer.last_backward_exchange().bytes, 0.0);
}

INSTANTIATE_TEST_SUITE_P(AllOptions, LactCpuPath, ::testing::ValuesIn(all_lact_cases()), case_name);

// ---- the sharded layout -----------------------------------------------------------

TEST(LactLayout, SlicesCoverEveryTokenOnceInChunkOrder) {
  for (int64_t P = 1; P <= 4; ++P)
    for (int64_t C : {12, 24}) {
      const int64_t T = 36;
      std::vector<int> seen(T, 0);
      for (int64_t r = 0; r < P; ++r) {
        int64_t local = 0;
        for (int64_t c = 0; c < lact_num_chunks(T, C); ++c) {
          const LactTokenRange t = lact_token_range(T, C, P, r, c);
          EXPECT_GE(t.begin, c * C);
          EXPECT_LE(t.end, std::min((c + 1) * C, T));
          EXPECT_EQ((t.end - t.begin) * P, std::min(C, T - c * C));
          for (int64_t i = t.begin; i < t.end; ++i) ++seen[i];
          local += t.end - t.begin;
        }
        EXPECT_EQ(local * P, T);
      }
      for (int64_t i = 0; i < T; ++i)
        EXPECT_EQ(seen[i], 1) << "P=" << P << " C=" << C << " t=" << i;
    }
}

TEST(LactLayout, ShardThenUnshardRestoresTheTensor) {
  const int64_t B = 2, T = 36, inner = 3, C = 24, P = 3;
  std::vector<double> global(static_cast<std::size_t>(B * T * inner));
  for (std::size_t i = 0; i < global.size(); ++i) global[i] = static_cast<double>(i);
  std::vector<double> back(global.size(), -1.0);
  for (int64_t r = 0; r < P; ++r) {
    const auto local = lact_shard(global, B, T, inner, C, P, r);
    EXPECT_EQ(static_cast<int64_t>(local.size()), B * T / P * inner);
    // The local tensor starts with slice r of chunk 0 of batch row 0.
    EXPECT_EQ(local[0], static_cast<double>(lact_token_range(T, C, P, r, 0).begin * inner));
    lact_unshard(local, B, T, inner, C, P, r, back);
  }
  EXPECT_EQ(back, global);
}

TEST(LactLayout, ChunkNotDivisibleByRanksThrows) {
  try {
    lact_token_range(30, 10, 3, 0, 0);
    FAIL() << "expected statescan::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "chunk");
  }
}

// lact_check_layout with ten non-null arrays: only the sizes matter.
void check_layout(int64_t seq_len, int64_t chunk, int64_t ranks) {
  static const float dummy = 0.f;
  const void* const arrays[10] = {&dummy, &dummy, &dummy, &dummy, &dummy,
                                  &dummy, &dummy, &dummy, &dummy, &dummy};
  LactConfig cfg;
  cfg.chunk = chunk;
  for (int64_t r = 0; r < ranks; ++r) lact_check_layout(cfg, 1, seq_len, 2, 4, 6, ranks, r, arrays);
}

// A sequence shorter than one chunk is a single chunk of T tokens: it needs
// T, not the chunk size, to split over the ranks (statescan-run's default
// chunk of 2048 with T = 1536 on 3 ranks).
TEST(LactLayout, SingleShortChunkNeedsOnlyTheSequenceToSplit) {
  const int64_t T = 12, C = 16, P = 3;  // C % P != 0, T % P == 0
  EXPECT_NO_THROW(check_layout(T, C, P));
  EXPECT_NO_THROW(check_layout(1536, 2048, 3));
  for (int64_t r = 0; r < P; ++r) {
    const LactTokenRange t = lact_token_range(T, C, P, r, 0);
    EXPECT_EQ(t.begin, 4 * r);
    EXPECT_EQ(t.end, 4 * r + 4);
  }
  const int64_t B = 2, inner = 3;
  std::vector<double> global(static_cast<std::size_t>(B * T * inner));
  for (std::size_t i = 0; i < global.size(); ++i) global[i] = static_cast<double>(i);
  std::vector<double> back(global.size(), -1.0);
  for (int64_t r = 0; r < P; ++r)
    lact_unshard(lact_shard(global, B, T, inner, C, P, r), B, T, inner, C, P, r, back);
  EXPECT_EQ(back, global);
}

// The single chunk itself must split: T = 10 over 3 ranks is the sequence's
// fault (named "q" by the layer's check, "seq_len" by the layout helpers),
// not the chunk size's.
TEST(LactLayout, SingleChunkNotDivisibleByRanksNamesTheSequence) {
  EXPECT_EQ(error_argument([] { check_layout(10, 16, 3); }), "q");
  EXPECT_EQ(error_argument([] { lact_token_range(10, 16, 3, 0, 0); }), "seq_len");
  EXPECT_EQ(error_argument([] { lact_check_split(10, 16, 3, "--seq-len", "--lact-chunk"); }),
            "--seq-len");
  // Two or more chunks: the full ones must split, whatever T is.
  EXPECT_EQ(error_argument([] { check_layout(18, 16, 3); }), "chunk");
  EXPECT_EQ(error_argument([] { lact_check_split(18, 16, 3, "--seq-len", "--lact-chunk"); }),
            "--lact-chunk");
  // The chunk size splits but the last chunk (and so T) does not.
  EXPECT_EQ(error_argument([] { check_layout(20, 6, 3); }), "q");
}

// A wrong inner or a short vector must be refused before lact_shard reads or
// lact_unshard writes out of bounds.
TEST(LactLayout, ShardRefusesWrongSizes) {
  const int64_t B = 2, T = 36, inner = 3, C = 24, P = 3;
  const std::vector<double> global(static_cast<std::size_t>(B * T * inner), 1.0);
  EXPECT_EQ(error_argument([&] { lact_shard(global, B, T, inner + 1, C, P, 0); }), "global");
  const std::vector<double> short_global(global.begin(), global.end() - 1);
  EXPECT_EQ(error_argument([&] { lact_shard(short_global, B, T, inner, C, P, 2); }), "global");
  try {
    lact_shard(short_global, B, T, inner, C, P, 0);
    ADD_FAILURE() << "a short global tensor was taken";
  } catch (const Error& e) {
    // The message gives the expected and the actual size.
    EXPECT_NE(e.message().find(std::to_string(B * T * inner)), std::string::npos) << e.what();
    EXPECT_NE(e.message().find(std::to_string(short_global.size())), std::string::npos) << e.what();
  }
}

TEST(LactLayout, UnshardRefusesWrongSizes) {
  const int64_t B = 2, T = 36, inner = 3, C = 24, P = 3;
  std::vector<double> global(static_cast<std::size_t>(B * T * inner), 0.0);
  const std::vector<double> local(static_cast<std::size_t>(B * T / P * inner), 1.0);
  const std::vector<double> short_local(local.begin(), local.end() - 1);
  EXPECT_EQ(error_argument([&] { lact_unshard(short_local, B, T, inner, C, P, 2, global); }),
            "local");
  const std::vector<double> long_local(local.size() + 1, 1.0);
  EXPECT_EQ(error_argument([&] { lact_unshard(long_local, B, T, inner, C, P, 0, global); }),
            "local");
  try {
    lact_unshard(short_local, B, T, inner, C, P, 0, global);
    ADD_FAILURE() << "a short local tensor was taken";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(std::to_string(local.size())), std::string::npos) << e.what();
    EXPECT_NE(e.message().find(std::to_string(short_local.size())), std::string::npos) << e.what();
  }
  // A wrong inner makes both sizes wrong; the global tensor is named first.
  EXPECT_EQ(error_argument([&] { lact_unshard(local, B, T, inner + 1, C, P, 0, global); }),
            "global");
  std::vector<double> short_global(global.size() - 1, 0.0);
  EXPECT_EQ(error_argument([&] { lact_unshard(local, B, T, inner, C, P, 2, short_global); }),
            "global");
  EXPECT_TRUE(std::all_of(global.begin(), global.end(), [](double x) { return x == 0.0; }));
}

// ---- bad input --------------------------------------------------------------------

TEST(LactErrors, BadConfigIsRejected) {
  SingleRankCommunicator self;
  LactConfig c;
  c.chunk = 0;
  EXPECT_EQ(error_argument([&] { LactLayer layer(self, c); }), "chunk");
  c = LactConfig{};
  c.momentum = 1.0;
  EXPECT_EQ(error_argument([&] { LactLayer layer(self, c); }), "momentum");
  c.momentum = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(error_argument([&] { LactLayer layer(self, c); }), "momentum");
  c = LactConfig{};
  c.muon_steps = -1;
  EXPECT_EQ(error_argument([&] { LactLayer layer(self, c); }), "muon_steps");
  EXPECT_EQ(error_argument([] { parse_lact_schedule("sideways"); }), "schedule");
  EXPECT_EQ(parse_lact_schedule("update_then_apply"), LactSchedule::update_then_apply);
}

// Runs the layer on a problem broken by `breakage`, expects an error naming
// `argument`, and that the output o was left untouched.
template <typename F>
void expect_layer_error(F&& breakage, const std::string& argument) {
  const LactSizes s{1, 8, 2, 4, 6};
  LactProblem p = random_lact_problem(s, 4242);
  const Shape tokens{s.batch, s.seq_len, s.heads, s.dim}, rates{s.batch, s.seq_len, s.heads};
  const Shape wide{s.heads, s.hidden, s.dim}, narrow{s.heads, s.dim, s.hidden};
  auto q = as<float>(p.q), k = as<float>(p.k), v = as<float>(p.v);
  auto lr0 = as<float>(p.lr0), lr1 = as<float>(p.lr1), lr2 = as<float>(p.lr2);
  auto w0 = as<float>(p.w0), w1 = as<float>(p.w1), w2 = as<float>(p.w2);
  std::vector<float> o(q.size(), 123.f);
  LactForwardArgs a;
  a.q = TensorView(q.data(), DType::f32, tokens);
  a.k = TensorView(k.data(), DType::f32, tokens);
  a.v = TensorView(v.data(), DType::f32, tokens);
  a.lr0 = TensorView(lr0.data(), DType::f32, rates);
  a.lr1 = TensorView(lr1.data(), DType::f32, rates);
  a.lr2 = TensorView(lr2.data(), DType::f32, rates);
  a.w0 = TensorView(w0.data(), DType::f32, wide);
  a.w1 = TensorView(w1.data(), DType::f32, narrow);
  a.w2 = TensorView(w2.data(), DType::f32, wide);
  a.o = TensorView(o.data(), DType::f32, tokens);
  breakage(a);
  SingleRankCommunicator self;
  LactConfig cfg;
  cfg.chunk = 4;
  LactLayer layer(self, cfg);
  EXPECT_EQ(error_argument([&] { layer.forward(a); }), argument);
  EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 123.f; }));
}

// A sharded call (ranks > 1) must sum each chunk's gradient over the group:
// without an all-reduce every rank updated from its own slice and the fast
// weights drifted apart with no error.
TEST(LactErrors, ShardedKernelWithoutAllReduceIsRejected) {
  const LactProblem p = random_lact_problem(LactSizes{1, 32, 2, 8, 16}, 31);
  LactConfig cfg;
  cfg.chunk = 16;
  EXPECT_EQ(error_argument([&] { (void)run_lact_kernel<double>(p, cfg, false, 2, 0); }),
            "all_reduce");
}

TEST(LactErrors, NanLearningRateNamesIt) {
  expect_layer_error(
      [](LactForwardArgs& a) { a.lr1.as<float>()[5] = std::numeric_limits<float>::quiet_NaN(); },
      "lr1");
}

TEST(LactErrors, NonPositiveLearningRateNamesIt) {
  expect_layer_error([](LactForwardArgs& a) { a.lr2.as<float>()[0] = 0.f; }, "lr2");
}

TEST(LactErrors, InfiniteKeyNamesIt) {
  expect_layer_error(
      [](LactForwardArgs& a) { a.k.as<float>()[3] = std::numeric_limits<float>::infinity(); }, "k");
}

TEST(LactErrors, WrongShapesNameTheArgument) {
  expect_layer_error([](LactForwardArgs& a) { a.v.shape[3] = 3; }, "v");
  expect_layer_error([](LactForwardArgs& a) { a.lr0.shape = {1, 8, 3}; }, "lr0");
  expect_layer_error([](LactForwardArgs& a) { std::swap(a.w1.shape[1], a.w1.shape[2]); }, "w1");
  expect_layer_error([](LactForwardArgs& a) { a.o = TensorView(); }, "o");
  expect_layer_error([](LactForwardArgs& a) { a.q.dtype = DType::bf16; }, "q");
}

TEST(LactErrors, NanCotangentIsRejectedBeforeAnythingIsWritten) {
  const LactSizes s{1, 8, 2, 4, 6};
  LactProblem p = random_lact_problem(s, 4243);
  p.d_o[7] = std::numeric_limits<double>::quiet_NaN();
  SingleRankCommunicator self;
  LactConfig cfg;
  cfg.chunk = 4;
  LactLayer layer(self, cfg);
  LactResult<float> r;
  try {
    run_lact_layer(layer, p, 1, 0, &r);
    FAIL() << "expected statescan::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "d_o") << e.what();
  }
  // Every gradient still holds the NaN poison run_lact_layer filled it with.
  for (const auto* g : {&r.dq, &r.dk, &r.dv, &r.dlr0, &r.dlr1, &r.dlr2, &r.dw0, &r.dw1, &r.dw2}) {
    ASSERT_FALSE(g->empty());
    for (float x : *g) ASSERT_TRUE(std::isnan(x)) << "a gradient was written before the error";
  }
}

// Backward's outputs are shape-checked like forward's inputs: a wrong one is
// refused, naming it, before any gradient is written.
TEST(LactErrors, BackwardWrongShapesNameTheArgument) {
  const LactSizes s{1, 8, 2, 4, 6};
  const LactProblem p = random_lact_problem(s, 4244);
  SingleRankCommunicator self;
  LactConfig cfg;
  cfg.chunk = 4;
  const std::pair<const char*, std::function<void(LactBackwardArgs&)>> cases[] = {
      {"dq", [](LactBackwardArgs& b) { b.dq.shape[3] = 3; }},
      {"dv", [](LactBackwardArgs& b) { b.dv.shape[3] = 3; }},
      {"dlr0", [](LactBackwardArgs& b) { b.dlr0.shape[2] = 3; }},
      {"dlr1", [](LactBackwardArgs& b) { b.dlr1.shape[2] = 3; }},
      {"dlr2", [](LactBackwardArgs& b) { b.dlr2.shape[2] = 3; }},
      {"dw1", [](LactBackwardArgs& b) { std::swap(b.dw1.shape[1], b.dw1.shape[2]); }},
  };
  for (const auto& [name, breakage] : cases) {
    LactLayer layer(self, cfg);
    LactResult<float> r;
    EXPECT_EQ(error_argument([&] { run_lact_layer(layer, p, 1, 0, &r, breakage); }), name);
    for (const auto* g : {&r.dq, &r.dk, &r.dv, &r.dlr0, &r.dlr1, &r.dlr2, &r.dw0, &r.dw1, &r.dw2})
      for (float x : *g) ASSERT_TRUE(std::isnan(x)) << name << ": a gradient was written";
  }
}

TEST(LactErrors, BackwardWithoutForwardIsRejected) {
  SingleRankCommunicator self;
  LactLayer layer(self, LactConfig{});
  EXPECT_EQ(error_argument([&] { layer.backward(LactBackwardArgs{}); }), "forward");
}

}  // namespace
}  // namespace statescan::test
