// A host model of Muon's Newton-Schulz iteration (kernels/cpu/lact.h) with
// the operand roundings a GPU could use for its GEMMs, on the update matrices
// P that a real LaCT forward produces: how much each rounding costs NS(P) and
// the backward's dP against fp64.
//
// Why: with Muon on, the GPU layer spends ~70% of its time in fp32
// Newton-Schulz GEMMs (README, LaCT on the GPU). TF32 was measured on the
// H200 (2026-11-30): 28% faster, but dk 8.3e-3 on bidir + Muon, over DESIGN's
// 8e-3 — the polynomial amplifies rounding in P's small singular directions
// by up to a^5 ~ 490. A two-part bf16 operand (x = hi + lo, three products
// hi hi + hi lo + lo hi, ~16 bits, as the chunk kernels' split products)
// runs on the bf16 tensor cores; this model says whether it keeps NS close
// enough to fp32 to leave the layer's error budget alone.
//
// Modes, per GEMM (operands rounded, products exact, sums in fp64, each GEMM's
// result and each elementwise step rounded to fp32 as a GPU stores them):
//   fp32   operands fp32 (today's GPU path);
//   split  operands as bf16 hi + bf16 lo, three products;
//   tf32   operands rounded to 10 mantissa bits;
//   bf16   operands rounded to bf16 once.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/lact.h"
#include "tests/lact_test_util.h"
#include "tests/test_util.h"

namespace statescan::test {
namespace {

enum class NsMode { exact, fp32, split, tf32, bf16 };

const char* mode_name(NsMode m) {
  switch (m) {
    case NsMode::exact:
      return "exact";
    case NsMode::fp32:
      return "fp32";
    case NsMode::split:
      return "split";
    case NsMode::tf32:
      return "tf32";
    case NsMode::bf16:
      return "bf16";
  }
  return "?";
}

double to_f32(double x) {
  return static_cast<float>(x);
}

double to_bf16(double x) {
  return round_to(DType::bf16, static_cast<float>(x));
}

// Round to nearest even on 10 explicit mantissa bits (TF32) from fp32.
double to_tf32(double x) {
  const float f = static_cast<float>(x);
  if (!std::isfinite(f) || f == 0.f) return f;
  int e = 0;
  const double m = std::frexp(static_cast<double>(f), &e);  // m in [0.5, 1)
  return std::ldexp(std::nearbyint(std::ldexp(m, 11)), e - 11);
}

struct Model {
  NsMode mode;
  bool rounds() const { return mode != NsMode::exact; }
  double store(double x) const { return rounds() ? to_f32(x) : x; }

  // C (m x n) = sum_k X[i, k] Y[k, j] with X read as x(i, k), Y as y(k, j).
  template <typename XA, typename YA>
  std::vector<double> gemm(int64_t m, int64_t n, int64_t kk, XA x, YA y) const {
    std::vector<double> c(static_cast<std::size_t>(m * n));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t k = 0; k < kk; ++k) s += product(x(i, k), y(k, j));
        c[i * n + j] = store(s);
      }
    return c;
  }
  // op(X) op(Y) of row-major X, Y: op(X) m x k, op(Y) k x n, transposed
  // where tx / ty say (X stored [k][m], Y stored [n][k]).
  std::vector<double> mul(const std::vector<double>& x, bool tx, const std::vector<double>& y,
                          bool ty, int64_t m, int64_t n, int64_t k) const {
    return gemm(
        m, n, k, [&](int64_t i, int64_t l) { return tx ? x[l * m + i] : x[i * k + l]; },
        [&](int64_t l, int64_t j) { return ty ? y[j * k + l] : y[l * n + j]; });
  }
  // A = X X^T and B = b A + c A A of an m x n iterate (both steps' start).
  void gram_poly(const std::vector<double>& X, int64_t m, int64_t n, std::vector<double>& A,
                 std::vector<double>& B) const {
    A = mul(X, false, X, true, m, m, n);
    const auto AA = mul(A, false, A, false, m, m, m);
    B.resize(A.size());
    for (std::size_t i = 0; i < B.size(); ++i) B[i] = store(kMuonB * A[i] + kMuonC * AA[i]);
  }
  double product(double a, double b) const {
    switch (mode) {
      case NsMode::exact:
        return a * b;
      case NsMode::fp32:
        return to_f32(a) * to_f32(b);
      case NsMode::tf32:
        return to_tf32(a) * to_tf32(b);
      case NsMode::bf16:
        return to_bf16(a) * to_bf16(b);
      case NsMode::split: {
        const double ah = to_bf16(a), al = to_bf16(a - ah);
        const double bh = to_bf16(b), bl = to_bf16(b - bh);
        return ah * bh + ah * bl + al * bh;
      }
    }
    return 0;
  }
};

// X0 = P / (||P|| + eps) in the Gram-small orientation (m <= n), as lact.cpp.
struct Oriented {
  int64_t m, n;
  std::vector<double> x;
};

Oriented orient(const double* P, int64_t rows, int64_t cols) {
  const bool transposed = rows > cols;
  Oriented o{transposed ? cols : rows, transposed ? rows : cols, {}};
  o.x.resize(static_cast<std::size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      (transposed ? o.x[j * rows + i] : o.x[i * cols + j]) = P[i * cols + j];
  return o;
}

// NS_s from X0 (already oriented), with the iterates for the backward.
std::vector<double> ns_forward(const Model& md, const Oriented& p, int steps,
                               std::vector<std::vector<double>>* iterates) {
  const int64_t m = p.m, n = p.n;
  double f = 0;
  for (double v : p.x) f += v * v;
  const double scale = 1.0 / (std::sqrt(f) + kLactEps);
  std::vector<double> X(p.x.size());
  for (std::size_t i = 0; i < X.size(); ++i) X[i] = md.store(p.x[i] * scale);
  std::vector<double> A, B;
  for (int s = 0; s < steps; ++s) {
    if (iterates) iterates->push_back(X);
    md.gram_poly(X, m, n, A, B);
    const auto BX = md.mul(B, false, X, false, m, n, m);
    for (std::size_t i = 0; i < X.size(); ++i) X[i] = md.store(kMuonA * X[i] + BX[i]);
  }
  return X;
}

// dX0 of <NS_s(X0), dY> from the iterates ns_forward kept in the same mode
// (the normalisation's own backward is elementwise and left out: it is the
// same in every mode).
std::vector<double> ns_backward(const Model& md, const Oriented& p,
                                const std::vector<std::vector<double>>& its,
                                const std::vector<double>& dY) {
  const int64_t m = p.m, n = p.n;
  const int steps = static_cast<int>(its.size());
  std::vector<double> dX = dY;
  std::vector<double> A, B;
  for (int s = steps - 1; s >= 0; --s) {
    const auto& X = its[static_cast<std::size_t>(s)];
    md.gram_poly(X, m, n, A, B);
    // Y = a X + B X: dX' = a dY + B dY, dB = dY X^T.
    const auto BdX = md.mul(B, false, dX, false, m, n, m);
    const auto dB = md.mul(dX, false, X, true, m, m, n);
    // B = b A + c A A: dA = b dB + c (dB A + A dB); dX' += (dA + dA^T) X.
    const auto dBA = md.mul(dB, false, A, false, m, m, m);
    const auto AdB = md.mul(A, false, dB, false, m, m, m);
    std::vector<double> S(A.size());
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        const double dij = kMuonB * dB[i * m + j] + kMuonC * (dBA[i * m + j] + AdB[i * m + j]);
        const double dji = kMuonB * dB[j * m + i] + kMuonC * (dBA[j * m + i] + AdB[j * m + i]);
        S[i * m + j] = md.store(dij + dji);
      }
    const auto SX = md.mul(S, false, X, false, m, n, m);
    std::vector<double> next(dX.size());
    for (std::size_t i = 0; i < next.size(); ++i)
      next[i] = md.store(kMuonA * dX[i] + BdX[i] + SX[i]);
    dX.swap(next);
  }
  return dX;
}

// The update matrices P of a real LaCT forward (fp64 reference), each with
// its shape: chunk c, row b, head h, weight i of the [W0 | W1 | W2] block.
struct UpdateMatrix {
  std::vector<double> p;
  int64_t rows, cols;
  // The step the library applied, W_c - W_{c+1} (no momentum, no renorm:
  // exactly NS(P)); empty for the last chunk.
  std::vector<double> applied;
};

std::vector<UpdateMatrix> lact_updates(const LactSizes& s, int64_t chunk, uint64_t seed) {
  const LactProblem prob = random_lact_problem(s, seed);
  LactCase c;
  c.schedule = LactSchedule::update_then_apply;  // the GPU tests' largest errors
  c.muon = true;
  LactParams<double> p;
  p.config = c.config(chunk);
  p.batch = s.batch;
  p.seq_len = s.seq_len;
  p.heads = s.heads;
  p.dim = s.dim;
  p.hidden = s.hidden;
  p.q = prob.q.data();
  p.k = prob.k.data();
  p.v = prob.v.data();
  p.lr0 = prob.lr0.data();
  p.lr1 = prob.lr1.data();
  p.lr2 = prob.lr2.data();
  p.w0 = prob.w0.data();
  p.w1 = prob.w1.data();
  p.w2 = prob.w2.data();
  std::vector<double> o(prob.q.size());
  p.o = o.data();
  LactCheckpoints<double> saved;
  lact_forward<double>(p, {}, &saved);
  const int64_t md = s.hidden * s.dim;
  const std::size_t next_chunk = static_cast<std::size_t>(s.batch * s.heads * 3 * md);
  std::vector<UpdateMatrix> out;
  for (std::size_t off = 0; off < saved.updates.size(); off += static_cast<std::size_t>(3 * md)) {
    for (int64_t i = 0; i < 3; ++i) {  // W0: M x D, W1: D x M, W2: M x D
      const double* blk = saved.updates.data() + off + i * md;
      UpdateMatrix u{std::vector<double>(blk, blk + md),
                     i == 1 ? s.dim : s.hidden,
                     i == 1 ? s.hidden : s.dim,
                     {}};
      if (off + next_chunk < saved.weights.size()) {
        const double* w = saved.weights.data() + off + i * md;
        for (int64_t e = 0; e < md; ++e) u.applied.push_back(w[e] - w[e + next_chunk]);
      }
      out.push_back(std::move(u));
    }
  }
  return out;
}

struct ModeErrors {
  double forward = 0, backward = 0;  // worst rel RMS over the matrices
};

constexpr NsMode kModes[] = {NsMode::fp32, NsMode::split, NsMode::tf32, NsMode::bf16};
constexpr int kNumModes = 4;

// Worst errors of each mode in kModes over the matrices (one fp64 run each).
std::vector<ModeErrors> ns_errors(const std::vector<UpdateMatrix>& updates, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<ModeErrors> e(kNumModes);
  const Model exact{NsMode::exact};
  for (const UpdateMatrix& u : updates) {
    const Oriented p = orient(u.p.data(), u.rows, u.cols);
    std::vector<std::vector<double>> its;
    const auto ref = ns_forward(exact, p, kDefaultMuonSteps, &its);
    const auto dY = randn(ref.size(), rng);
    const auto dref = ns_backward(exact, p, its, dY);
    for (int i = 0; i < kNumModes; ++i) {
      const Model md{kModes[i]};
      its.clear();
      e[i].forward =
          std::max(e[i].forward, rel_rms(ns_forward(md, p, kDefaultMuonSteps, &its), ref));
      e[i].backward = std::max(e[i].backward, rel_rms(ns_backward(md, p, its, dY), dref));
    }
  }
  return e;
}

// The GPU bf16 test's shape and chunk (tests/test_cuda_lact.cpp,
// LactCudaBf16.MatchesReference): D = 32, M = 64, 128-token chunks, and a
// wider one (D = 64, M = 128, 256-token chunks).
struct NsShape {
  LactSizes sizes;
  int64_t chunk;
  std::size_t max_matrices;  // the first ones (chunk 0 first): the model is slow
};

void PrintTo(const NsShape& s, std::ostream* os) {
  *os << "D" << s.sizes.dim << "_M" << s.sizes.hidden << "_chunk" << s.chunk;
}

class LactNsModel : public ::testing::TestWithParam<NsShape> {};

TEST_P(LactNsModel, SplitBf16OperandsKeepNewtonSchulzNearFp32) {
  const NsShape& sh = GetParam();
  auto updates = lact_updates(sh.sizes, sh.chunk, 9100 + sh.sizes.dim);
  ASSERT_FALSE(updates.empty());
  if (updates.size() > sh.max_matrices) updates.resize(sh.max_matrices);
  const std::vector<ModeErrors> err = ns_errors(updates, 77);
  for (int i = 0; i < kNumModes; ++i)
    std::printf("  %-5s NS(P) rel RMS %.2e   dP rel RMS %.2e   (%zu matrices)\n",
                mode_name(kModes[i]), err[i].forward, err[i].backward, updates.size());
  const ModeErrors &f32 = err[0], &split = err[1], &tf32 = err[2], &b16 = err[3];
  // The model without rounding is the library's iteration: its NS(P) is the
  // step the fp64 reference applied between consecutive chunks.
  const Model exact{NsMode::exact};
  int checked = 0;
  for (const UpdateMatrix& u : updates) {
    if (u.applied.empty()) continue;
    const Oriented p = orient(u.p.data(), u.rows, u.cols);
    const Oriented want = orient(u.applied.data(), u.rows, u.cols);
    EXPECT_LT(rel_rms(ns_forward(exact, p, kDefaultMuonSteps, nullptr), want.x), 1e-12);
    ++checked;
  }
  EXPECT_GT(checked, 0);
  // Rounding costs grow with the operand precision lost: fp32 < split (~16
  // bits) < tf32 (11 bits) < bf16 (8 bits), forward and backward.
  EXPECT_LT(f32.forward, split.forward);
  EXPECT_LT(split.forward, tf32.forward);
  EXPECT_LT(tf32.forward, b16.forward);
  EXPECT_LT(split.backward, tf32.backward);
  // The split operands leave NS an order of magnitude (and more) closer to
  // fp64 than TF32, which the H200 measured at dk 8.3e-3 > 8e-3 end to end:
  // an error 16x smaller than TF32's is below the layer's bf16 noise.
  EXPECT_LT(split.forward * 16, tf32.forward);
  EXPECT_LT(split.backward * 16, tf32.backward);
  // And small in absolute terms: under 1e-4 of NS's output and gradient.
  EXPECT_LT(split.forward, 1e-4);
  EXPECT_LT(split.backward, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Shapes, LactNsModel,
                         ::testing::Values(NsShape{LactSizes{2, 256, 2, 32, 64}, 128, 24},
                                           NsShape{LactSizes{1, 512, 1, 64, 128}, 256, 3}),
                         [](const auto& info) {
                           return "D" + std::to_string(info.param.sizes.dim) + "_M" +
                                  std::to_string(info.param.sizes.hidden);
                         });

}  // namespace
}  // namespace statescan::test
