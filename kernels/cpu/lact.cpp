// LaCT forward and backward on the CPU, one template over the scalar type
// (double: the fp64 reference; float: the CPU path). See lact.h for the
// semantics and the sharded layout.
//
// Work is threaded over (batch row, head) pairs; within a pair every step is
// a small dense product over the tokens of this rank's chunk slice, written
// as row-major GEMMs so that a GPU port maps them one to one onto batched
// cuBLAS calls. Per chunk, forward runs two phases separated by the all-reduce
// of the fast-weight gradients; backward mirrors them.
#include "kernels/cpu/lact.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "core/parallel_for.h"

namespace statescan {
namespace {

// Where the three fast-weight matrices sit in a [W0 | W1 | W2] block of one
// (batch row, head): W0, W2 are M x D, W1 is D x M, all row-major.
struct WeightLayout {
  int64_t M = 0, D = 0;
  int64_t block() const { return 3 * M * D; }
  int64_t offset(int i) const { return i * M * D; }
  int64_t rows(int i) const { return i == 1 ? D : M; }
  int64_t cols(int i) const { return i == 1 ? M : D; }
  // Row norms of one head: W0's M rows, then W1's D rows, then W2's M rows.
  int64_t norm_offset(int i) const { return i == 0 ? 0 : (i == 1 ? M : M + D); }
  int64_t norms() const { return 2 * M + D; }
};

// C = beta C + alpha op(A) op(B), op(A): m x k, op(B): k x n, row-major with
// leading dimensions lda, ldb, ldc. beta == 0 ignores C's old contents (it
// may be uninitialised). op(B) is made a contiguous k x n block first so that
// the inner loop runs along a row of C (it vectorises); transposes are
// template flags so that no loop carries a branch.
template <bool TransA, bool TransB, typename T>
void gemm(int64_t m, int64_t n, int64_t k, T alpha, const T* A, int64_t lda, const T* B,
          int64_t ldb, T beta, T* C, int64_t ldc) {
  std::vector<T> b_rows;
  if (TransB) {
    b_rows.resize(static_cast<std::size_t>(k * n));
    for (int64_t j = 0; j < n; ++j)
      for (int64_t l = 0; l < k; ++l) b_rows[l * n + j] = B[j * ldb + l];
    B = b_rows.data();
    ldb = n;
  }
  std::vector<T> acc(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < m; ++i) {
    std::fill(acc.begin(), acc.end(), T(0));
    T* __restrict row = acc.data();
    for (int64_t l = 0; l < k; ++l) {
      const T a = TransA ? A[l * lda + i] : A[i * lda + l];
      const T* __restrict b = B + l * ldb;
      for (int64_t j = 0; j < n; ++j) row[j] += a * b[j];
    }
    T* c = C + i * ldc;
    if (beta == T(0)) {
      for (int64_t j = 0; j < n; ++j) c[j] = alpha * row[j];
    } else {
      for (int64_t j = 0; j < n; ++j) c[j] = beta * c[j] + alpha * row[j];
    }
  }
}

// dst (cols x rows) = src^T (src rows x cols).
template <typename T>
void transpose(const T* src, int64_t rows, int64_t cols, T* dst) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[j * rows + i] = src[i * cols + j];
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// silu(x) = x sigmoid(x) and its first two derivatives.
template <typename T>
struct Silu {
  T value, d1, d2;
  explicit Silu(T x) {
    const T s = T(1) / (T(1) + std::exp(-x));
    value = x * s;
    d1 = s * (T(1) + x * (T(1) - s));
    d2 = s * (T(1) - s) * (T(2) + x * (T(1) - T(2) * s));
  }
};

// Muon's Newton-Schulz iteration runs in fp64 for every T. Its polynomial
// amplifies rounding in the small singular directions of P by up to
// a^5 ~ 490; in fp32 that alone put the CPU path at ~1e-5 of the reference
// (DESIGN's whole fp32 budget), in fp64 the path stays near 1e-6. The
// matrices are M x D per head and chunk, negligible next to the token GEMMs.
using Wide = double;

// Muon's orthogonalisation NS_s(P) of one rows x cols matrix into `out`.
// Works on the orientation whose Gram matrix is the smaller side (m <= n).
// When `iterates` is given it receives X_0 .. X_{s-1} (m x n each), the input
// of every step, for the backward.
template <typename T>
void newton_schulz(const T* P_in, int64_t rows, int64_t cols, int steps, T* out,
                   std::vector<Wide>* iterates) {
  using U = Wide;
  const std::vector<U> P_wide(P_in, P_in + rows * cols);
  const U* P = P_wide.data();
  const bool transposed = rows > cols;
  const int64_t m = transposed ? cols : rows, n = transposed ? rows : cols;
  std::vector<U> X(static_cast<std::size_t>(m * n)), Y(X.size());
  std::vector<U> A(static_cast<std::size_t>(m * m)), B(A.size());
  if (transposed) {
    transpose(P, rows, cols, X.data());
  } else {
    std::copy(P, P + m * n, X.begin());
  }
  const U scale = U(1) / (std::sqrt(dot(X.data(), X.data(), m * n)) + U(kLactEps));
  for (auto& x : X) x *= scale;
  if (iterates) iterates->clear();
  for (int s = 0; s < steps; ++s) {
    if (iterates) iterates->insert(iterates->end(), X.begin(), X.end());
    gemm<false, true>(m, m, n, U(1), X.data(), n, X.data(), n, U(0), A.data(), m);
    gemm<false, false>(m, m, m, U(kMuonC), A.data(), m, A.data(), m, U(0), B.data(), m);
    for (std::size_t i = 0; i < A.size(); ++i) B[i] += U(kMuonB) * A[i];
    gemm<false, false>(m, n, m, U(1), B.data(), m, X.data(), n, U(0), Y.data(), n);
    for (std::size_t i = 0; i < X.size(); ++i) Y[i] += U(kMuonA) * X[i];
    X.swap(Y);
  }
  if (transposed) transpose(X.data(), m, n, Y.data()), X.swap(Y);
  std::copy(X.begin(), X.end(), out);
}

// dP = (d NS_s(P) / dP)^T d_out for one rows x cols matrix: recomputes the
// iterates, then walks the steps backwards (B is symmetric, A = X X^T).
template <typename T>
void newton_schulz_backward(const T* P_in, int64_t rows, int64_t cols, int steps, const T* d_out_in,
                            T* dP_out) {
  using U = Wide;
  const std::vector<U> P_wide(P_in, P_in + rows * cols), d_wide(d_out_in, d_out_in + rows * cols);
  const U* P = P_wide.data();
  const U* d_out = d_wide.data();
  std::vector<U> dP_wide(P_wide.size());
  U* dP = dP_wide.data();
  const bool transposed = rows > cols;
  const int64_t m = transposed ? cols : rows, n = transposed ? rows : cols;
  const std::size_t mn = static_cast<std::size_t>(m * n), mm = static_cast<std::size_t>(m * m);
  std::vector<U> iterates, scratch(mn);
  newton_schulz(P, rows, cols, steps, scratch.data(), &iterates);

  std::vector<U> dX(mn), dXn(mn), A(mm), B(mm), dB(mm), dA(mm), S(mm);
  if (transposed) {
    transpose(d_out, rows, cols, dX.data());
  } else {
    std::copy(d_out, d_out + mn, dX.begin());
  }
  for (int s = steps - 1; s >= 0; --s) {
    const U* X = iterates.data() + static_cast<std::size_t>(s) * mn;
    gemm<false, true>(m, m, n, U(1), X, n, X, n, U(0), A.data(), m);
    gemm<false, false>(m, m, m, U(kMuonC), A.data(), m, A.data(), m, U(0), B.data(), m);
    for (std::size_t i = 0; i < mm; ++i) B[i] += U(kMuonB) * A[i];
    // Y = a X + B X:  dX = a dY + B dY,  dB = dY X^U.
    gemm<false, false>(m, n, m, U(1), B.data(), m, dX.data(), n, U(0), dXn.data(), n);
    for (std::size_t i = 0; i < mn; ++i) dXn[i] += U(kMuonA) * dX[i];
    gemm<false, true>(m, m, n, U(1), dX.data(), n, X, n, U(0), dB.data(), m);
    // B = b A + c A A:  dA = b dB + c (dB A + A dB).
    gemm<false, false>(m, m, m, U(kMuonC), dB.data(), m, A.data(), m, U(0), dA.data(), m);
    gemm<false, false>(m, m, m, U(kMuonC), A.data(), m, dB.data(), m, U(1), dA.data(), m);
    for (std::size_t i = 0; i < mm; ++i) dA[i] += U(kMuonB) * dB[i];
    // A = X X^U:  dX += (dA + dA^U) X.
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) S[i * m + j] = dA[i * m + j] + dA[j * m + i];
    gemm<false, false>(m, n, m, U(1), S.data(), m, X, n, U(1), dXn.data(), n);
    dX.swap(dXn);
  }
  // X_0 = Xp / (||Xp|| + eps), Xp the (transposed) input.
  std::vector<U> Xp(mn);
  if (transposed) {
    transpose(P, rows, cols, Xp.data());
  } else {
    std::copy(P, P + mn, Xp.begin());
  }
  const U f = std::sqrt(dot(Xp.data(), Xp.data(), m * n)), den = f + U(kLactEps);
  const U radial = f > U(0) ? dot(Xp.data(), dX.data(), m * n) / (den * den * f) : U(0);
  for (std::size_t i = 0; i < mn; ++i) dXn[i] = dX[i] / den - radial * Xp[i];
  if (transposed) {
    transpose(dXn.data(), m, n, dP);
  } else {
    std::copy(dXn.begin(), dXn.end(), dP);
  }
  std::copy(dP_wide.begin(), dP_wide.end(), dP_out);
}

// The update of one (batch row, head): W_next = renorm(W - D(P_update)).
// `norm0` holds the initial row norms of this head.
template <typename T>
void update_weights(const T* W, const T* P_update, const LactConfig& cfg, const WeightLayout& L,
                    const T* norm0, T* W_next) {
  std::vector<T> step(static_cast<std::size_t>(L.M * L.D));
  for (int i = 0; i < 3; ++i) {
    const int64_t rows = L.rows(i), cols = L.cols(i), off = L.offset(i);
    const T* d = P_update + off;
    if (cfg.muon_steps > 0) {
      newton_schulz(P_update + off, rows, cols, cfg.muon_steps, step.data(),
                    static_cast<std::vector<Wide>*>(nullptr));
      d = step.data();
    }
    for (int64_t e = 0; e < rows * cols; ++e) W_next[off + e] = W[off + e] - d[e];
    if (!cfg.renorm) continue;
    for (int64_t r = 0; r < rows; ++r) {
      T* row = W_next + off + r * cols;
      const T s = norm0[L.norm_offset(i) + r] / (std::sqrt(dot(row, row, cols)) + T(kLactEps));
      for (int64_t j = 0; j < cols; ++j) row[j] *= s;
    }
  }
}

// Backward of update_weights, linear in d_W_next: writes the adjoint of W
// (direct path W -> W - D) and of P_update, and adds the adjoint of the
// initial row norms to d_norm0.
template <typename T>
void update_weights_backward(const T* W, const T* P_update, const LactConfig& cfg,
                             const WeightLayout& L, const T* norm0, const T* d_W_next, T* d_W,
                             T* d_P_update, T* d_norm0) {
  const std::size_t md = static_cast<std::size_t>(L.M * L.D);
  std::vector<T> step(md), w_pre(md), d_pre(md);
  for (int i = 0; i < 3; ++i) {
    const int64_t rows = L.rows(i), cols = L.cols(i), off = L.offset(i);
    const T* d = P_update + off;
    if (cfg.muon_steps > 0) {
      newton_schulz(P_update + off, rows, cols, cfg.muon_steps, step.data(),
                    static_cast<std::vector<Wide>*>(nullptr));
      d = step.data();
    }
    for (int64_t e = 0; e < rows * cols; ++e) w_pre[e] = W[off + e] - d[e];
    if (cfg.renorm) {
      // y = x n0 / (|x| + eps):  dn0 = x.dy / den,
      // dx = n0/den dy - n0 (x.dy) / (den^2 |x|) x.
      for (int64_t r = 0; r < rows; ++r) {
        const T* x = w_pre.data() + r * cols;
        const T* dy = d_W_next + off + r * cols;
        const T n0 = norm0[L.norm_offset(i) + r];
        const T s = std::sqrt(dot(x, x, cols)), den = s + T(kLactEps), xdy = dot(x, dy, cols);
        d_norm0[L.norm_offset(i) + r] += xdy / den;
        const T radial = s > T(0) ? n0 * xdy / (den * den * s) : T(0);
        for (int64_t j = 0; j < cols; ++j) d_pre[r * cols + j] = n0 / den * dy[j] - radial * x[j];
      }
    } else {
      std::copy(d_W_next + off, d_W_next + off + rows * cols, d_pre.begin());
    }
    std::copy(d_pre.begin(), d_pre.end(), d_W + off);
    for (auto& e : d_pre) e = -e;  // adjoint of the step D
    if (cfg.muon_steps > 0) {
      newton_schulz_backward(P_update + off, rows, cols, cfg.muon_steps, d_pre.data(),
                             d_P_update + off);
    } else {
      std::copy(d_pre.begin(), d_pre.end(), d_P_update + off);
    }
  }
}

// The n tokens of one (batch row, head) in this rank's slice of a chunk:
// strided views into the [B, T/P, H, *] tensors.
template <typename T>
struct TokenSlice {
  int64_t n = 0;
  int64_t ld = 0;       // row stride of q, k, v, o (H D)
  int64_t lr_ld = 0;    // stride of the learning rates (H)
  int64_t base = 0;     // element offset of the first token in q, k, v, o
  int64_t lr_base = 0;  // element offset of the first token in lr0..2
};

// Per-token quantities of the loss side (keys and values) at weights W, each
// n x M: h0 = W0 k, h2 = W2 k, silu(h0) and its derivatives, the SwiGLU
// gate g, e = dL/dg = -W1^T v, z0 = dL/dh0, z2 = dL/dh2.
template <typename T>
struct KeySide {
  std::vector<T> h0, h2, act, dact, ddact, gate, e, z0, z2;

  void compute(const T* W, const T* K, const T* V, int64_t n, int64_t ld, const WeightLayout& L) {
    const int64_t M = L.M, D = L.D;
    for (auto* x : {&h0, &h2, &act, &dact, &ddact, &gate, &e, &z0, &z2})
      x->resize(static_cast<std::size_t>(n * M));
    gemm<false, true>(n, M, D, T(1), K, ld, W + L.offset(0), D, T(0), h0.data(), M);
    gemm<false, true>(n, M, D, T(1), K, ld, W + L.offset(2), D, T(0), h2.data(), M);
    gemm<false, false>(n, M, D, T(-1), V, ld, W + L.offset(1), M, T(0), e.data(), M);
    for (std::size_t i = 0; i < h0.size(); ++i) {
      const Silu<T> s(h0[i]);
      act[i] = s.value;
      dact[i] = s.d1;
      ddact[i] = s.d2;
      gate[i] = s.value * h2[i];
      z0[i] = e[i] * h2[i] * s.d1;
      z2[i] = e[i] * s.value;
    }
  }
};

// n x M rows of x, row t scaled by lr[t * lr_ld].
template <typename T>
std::vector<T> scale_rows(const std::vector<T>& x, const T* lr, int64_t lr_ld, int64_t n,
                          int64_t width) {
  std::vector<T> y(x.size());
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < width; ++j) y[t * width + j] = lr[t * lr_ld] * x[t * width + j];
  return y;
}

// This slice's partial fast-weight gradients G = [G0 | G1 | G2] at W.
template <typename T>
void partial_gradients(const LactParams<T>& p, const TokenSlice<T>& s, const T* W,
                       const WeightLayout& L, T* G) {
  const int64_t M = L.M, D = L.D, n = s.n;
  const T* K = p.k + s.base;
  const T* V = p.v + s.base;
  KeySide<T> ks;
  ks.compute(W, K, V, n, s.ld, L);
  // G0 = sum_t lr0 z0 k^T, G2 = sum_t lr2 z2 k^T, G1 = -sum_t lr1 v g^T.
  const auto z0 = scale_rows(ks.z0, p.lr0 + s.lr_base, s.lr_ld, n, M);
  const auto z2 = scale_rows(ks.z2, p.lr2 + s.lr_base, s.lr_ld, n, M);
  const auto gate = scale_rows(ks.gate, p.lr1 + s.lr_base, s.lr_ld, n, M);
  gemm<true, false>(M, D, n, T(1), z0.data(), M, K, s.ld, T(0), G + L.offset(0), D);
  gemm<true, false>(D, M, n, T(-1), V, s.ld, gate.data(), M, T(0), G + L.offset(1), M);
  gemm<true, false>(M, D, n, T(1), z2.data(), M, K, s.ld, T(0), G + L.offset(2), D);
}

// o = f_W(q) for the slice's tokens.
template <typename T>
void apply_forward(const LactParams<T>& p, const TokenSlice<T>& s, const T* W,
                   const WeightLayout& L) {
  const int64_t M = L.M, D = L.D, n = s.n;
  const T* Q = p.q + s.base;
  std::vector<T> h0(static_cast<std::size_t>(n * M)), h2(h0.size());
  gemm<false, true>(n, M, D, T(1), Q, s.ld, W + L.offset(0), D, T(0), h0.data(), M);
  gemm<false, true>(n, M, D, T(1), Q, s.ld, W + L.offset(2), D, T(0), h2.data(), M);
  for (std::size_t i = 0; i < h0.size(); ++i) h0[i] = Silu<T>(h0[i]).value * h2[i];
  gemm<false, true>(n, D, M, T(1), h0.data(), M, W + L.offset(1), M, T(0), p.o + s.base, s.ld);
}

// Backward of apply_forward: writes dq, adds this slice's d(sum <o, do>)/dW to dW.
template <typename T>
void apply_backward(const LactParams<T>& p, const LactGradParams<T>& g, const TokenSlice<T>& s,
                    const T* W, const WeightLayout& L, T* dW) {
  const int64_t M = L.M, D = L.D, n = s.n;
  const T* Q = p.q + s.base;
  const T* dO = g.d_o + s.base;
  const std::size_t nm = static_cast<std::size_t>(n * M);
  std::vector<T> h0(nm), h2(nm), act(nm), dact(nm), gate(nm), dgate(nm);
  gemm<false, true>(n, M, D, T(1), Q, s.ld, W + L.offset(0), D, T(0), h0.data(), M);
  gemm<false, true>(n, M, D, T(1), Q, s.ld, W + L.offset(2), D, T(0), h2.data(), M);
  for (std::size_t i = 0; i < nm; ++i) {
    const Silu<T> sl(h0[i]);
    act[i] = sl.value;
    dact[i] = sl.d1;
    gate[i] = sl.value * h2[i];
  }
  // o = W1 g:  dW1 += do g^T,  dg = W1^T do.
  gemm<true, false>(D, M, n, T(1), dO, s.ld, gate.data(), M, T(1), dW + L.offset(1), M);
  gemm<false, false>(n, M, D, T(1), dO, s.ld, W + L.offset(1), M, T(0), dgate.data(), M);
  // g = silu(h0) h2: reuse h0 as dh0, h2's buffer (after use) as dh2.
  for (std::size_t i = 0; i < nm; ++i) {
    const T dh2 = dgate[i] * act[i];
    h0[i] = dgate[i] * h2[i] * dact[i];
    h2[i] = dh2;
  }
  gemm<true, false>(M, D, n, T(1), h0.data(), M, Q, s.ld, T(1), dW + L.offset(0), D);
  gemm<true, false>(M, D, n, T(1), h2.data(), M, Q, s.ld, T(1), dW + L.offset(2), D);
  T* dQ = g.dq + s.base;
  gemm<false, false>(n, D, M, T(1), h0.data(), M, W + L.offset(0), D, T(0), dQ, s.ld);
  gemm<false, false>(n, D, M, T(1), h2.data(), M, W + L.offset(2), D, T(1), dQ, s.ld);
}

// Backward of partial_gradients given the full (all-reduced) dG: writes dk,
// dv, dlr0..2 of the slice and adds its d/dW (second order) to dW.
template <typename T>
void gradients_backward(const LactParams<T>& p, const LactGradParams<T>& g, const TokenSlice<T>& s,
                        const T* W, const WeightLayout& L, const T* dG, T* dW) {
  const int64_t M = L.M, D = L.D, n = s.n;
  const T* K = p.k + s.base;
  const T* V = p.v + s.base;
  const T* lr0 = p.lr0 + s.lr_base;
  const T* lr1 = p.lr1 + s.lr_base;
  const T* lr2 = p.lr2 + s.lr_base;
  KeySide<T> ks;
  ks.compute(W, K, V, n, s.ld, L);
  const std::size_t nm = static_cast<std::size_t>(n * M);
  std::vector<T> u0(nm), u1(nm), u2(nm);
  // u0 = dG0 k, u2 = dG2 k, u1 = dG1^T v (as rows).
  gemm<false, true>(n, M, D, T(1), K, s.ld, dG + L.offset(0), D, T(0), u0.data(), M);
  gemm<false, true>(n, M, D, T(1), K, s.ld, dG + L.offset(2), D, T(0), u2.data(), M);
  gemm<false, false>(n, M, D, T(1), V, s.ld, dG + L.offset(1), M, T(0), u1.data(), M);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = t * M, lr = t * s.lr_ld;
    g.dlr0[s.lr_base + lr] = dot(ks.z0.data() + row, u0.data() + row, M);
    g.dlr2[s.lr_base + lr] = dot(ks.z2.data() + row, u2.data() + row, M);
    g.dlr1[s.lr_base + lr] = -dot(ks.gate.data() + row, u1.data() + row, M);
  }
  // dk = lr0 dG0^T z0 + lr2 dG2^T z2;  dv = -lr1 dG1 g.
  T* dK = g.dk + s.base;
  T* dV = g.dv + s.base;
  {
    const auto z0 = scale_rows(ks.z0, lr0, s.lr_ld, n, M);
    const auto z2 = scale_rows(ks.z2, lr2, s.lr_ld, n, M);
    const auto gate = scale_rows(ks.gate, lr1, s.lr_ld, n, M);
    gemm<false, false>(n, D, M, T(1), z0.data(), M, dG + L.offset(0), D, T(0), dK, s.ld);
    gemm<false, false>(n, D, M, T(1), z2.data(), M, dG + L.offset(2), D, T(1), dK, s.ld);
    gemm<false, true>(n, D, M, T(-1), gate.data(), M, dG + L.offset(1), M, T(0), dV, s.ld);
  }
  // Adjoints of z0 = e h2 silu'(h0), z2 = e silu(h0), g = silu(h0) h2, back
  // to e, h0 and h2.
  std::vector<T> de(nm), dh0(nm), dh2(nm);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < M; ++j) {
      const std::size_t i = static_cast<std::size_t>(t * M + j);
      const T dz0 = lr0[t * s.lr_ld] * u0[i], dz2 = lr2[t * s.lr_ld] * u2[i];
      const T dgate = -lr1[t * s.lr_ld] * u1[i];
      de[i] = dz2 * ks.act[i] + dz0 * ks.h2[i] * ks.dact[i];
      const T dact = dz2 * ks.e[i] + dgate * ks.h2[i];
      dh2[i] = dz0 * ks.e[i] * ks.dact[i] + dgate * ks.act[i];
      dh0[i] = dz0 * ks.e[i] * ks.h2[i] * ks.ddact[i] + dact * ks.dact[i];
    }
  // e = -W1^T v:  dv -= W1 de,  dW1 -= v de^T.
  gemm<false, true>(n, D, M, T(-1), de.data(), M, W + L.offset(1), M, T(1), dV, s.ld);
  gemm<true, false>(D, M, n, T(-1), V, s.ld, de.data(), M, T(1), dW + L.offset(1), M);
  // h0 = W0 k, h2 = W2 k.
  gemm<true, false>(M, D, n, T(1), dh0.data(), M, K, s.ld, T(1), dW + L.offset(0), D);
  gemm<true, false>(M, D, n, T(1), dh2.data(), M, K, s.ld, T(1), dW + L.offset(2), D);
  gemm<false, false>(n, D, M, T(1), dh0.data(), M, W + L.offset(0), D, T(1), dK, s.ld);
  gemm<false, false>(n, D, M, T(1), dh2.data(), M, W + L.offset(2), D, T(1), dK, s.ld);
}

// Sizes shared by forward and backward.
template <typename T>
struct Geometry {
  int64_t B, H, D, M, P, local_len, chunk, chunks, pairs;
  WeightLayout layout;

  explicit Geometry(const LactParams<T>& p)
      : B(p.batch),
        H(p.heads),
        D(p.dim),
        M(p.hidden),
        P(p.ranks),
        local_len(p.local_len()),
        chunk(p.config.chunk),
        chunks(lact_num_chunks(p.seq_len, p.config.chunk)),
        pairs(p.batch * p.heads),
        layout{p.hidden, p.dim} {}

  // The slice of chunk c for pair i = b H + h.
  TokenSlice<T> slice(int64_t seq_len, int64_t c, int64_t i) const {
    const int64_t b = i / H, h = i % H;
    const int64_t len = std::min(chunk, seq_len - c * chunk);
    const int64_t t0 = c * (chunk / P);  // every earlier chunk is full
    TokenSlice<T> s;
    s.n = len / P;
    s.ld = H * D;
    s.lr_ld = H;
    s.base = ((b * local_len + t0) * H + h) * D;
    s.lr_base = (b * local_len + t0) * H + h;
    return s;
  }
  std::size_t block() const { return static_cast<std::size_t>(layout.block()); }
  T* pair_block(std::vector<T>& x, int64_t i) const { return x.data() + i * layout.block(); }
  const T* pair_block(const std::vector<T>& x, int64_t i) const {
    return x.data() + i * layout.block();
  }
};

// [H, 3 M D] initial weights from the three [H, ...] arrays.
template <typename T>
std::vector<T> initial_blocks(const LactParams<T>& p, const WeightLayout& L) {
  std::vector<T> w(static_cast<std::size_t>(p.heads * L.block()));
  const int64_t md = L.M * L.D;
  for (int64_t h = 0; h < p.heads; ++h) {
    std::copy(p.w0 + h * md, p.w0 + (h + 1) * md, w.begin() + h * L.block() + L.offset(0));
    std::copy(p.w1 + h * md, p.w1 + (h + 1) * md, w.begin() + h * L.block() + L.offset(1));
    std::copy(p.w2 + h * md, p.w2 + (h + 1) * md, w.begin() + h * L.block() + L.offset(2));
  }
  return w;
}

// [H, 2M + D] L2 norms of the initial weights' rows: the renorm targets.
template <typename T>
std::vector<T> row_norms(const std::vector<T>& w, int64_t heads, const WeightLayout& L) {
  std::vector<T> norms(static_cast<std::size_t>(heads * L.norms()));
  for (int64_t h = 0; h < heads; ++h)
    for (int i = 0; i < 3; ++i)
      for (int64_t r = 0; r < L.rows(i); ++r) {
        const T* row = w.data() + h * L.block() + L.offset(i) + r * L.cols(i);
        norms[h * L.norms() + L.norm_offset(i) + r] = std::sqrt(dot(row, row, L.cols(i)));
      }
  return norms;
}

template <typename T>
void check_finite_data(const T* x, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i)
    SS_CHECK_ARG(std::isfinite(x[i]), name, "element ", i, " is ", x[i], " (NaN/Inf not allowed)");
}

template <typename T>
void check_learning_rates(const T* x, int64_t n, const char* name) {
  for (int64_t i = 0; i < n; ++i)
    SS_CHECK_ARG(std::isfinite(x[i]) && x[i] > T(0), name, "element ", i, " is ", x[i],
                 " (learning rates must be finite and > 0)");
}

}  // namespace

void lact_newton_schulz(const double* P, int64_t rows, int64_t cols, int steps, double* out) {
  newton_schulz(P, rows, cols, steps, out, nullptr);
}

void lact_newton_schulz_backward(const double* P, int64_t rows, int64_t cols, int steps,
                                 const double* d_out, double* dP) {
  newton_schulz_backward(P, rows, cols, steps, d_out, dP);
}

const char* to_string(LactSchedule s) {
  return s == LactSchedule::apply_then_update ? "apply_then_update" : "update_then_apply";
}

LactSchedule parse_lact_schedule(std::string_view name, const char* argument) {
  if (name == "apply_then_update") return LactSchedule::apply_then_update;
  if (name == "update_then_apply") return LactSchedule::update_then_apply;
  SS_FAIL(argument, "unknown LaCT schedule '", std::string(name),
          "' (expected apply_then_update or update_then_apply)");
}

void check_lact_config(const LactConfig& c) {
  SS_CHECK_ARG(c.chunk >= 1, "chunk", "must be >= 1, got ", c.chunk);
  SS_CHECK_ARG(std::isfinite(c.momentum) && c.momentum >= 0 && c.momentum < 1, "momentum",
               "must be in [0, 1), got ", c.momentum);
  SS_CHECK_ARG(c.muon_steps >= 0, "muon_steps", "must be >= 0 (0 = no Muon), got ", c.muon_steps);
}

int64_t lact_num_chunks(int64_t seq_len, int64_t chunk) {
  SS_CHECK_ARG(chunk >= 1, "chunk", "must be >= 1, got ", chunk);
  SS_CHECK_ARG(seq_len >= 1, "seq_len", "must be >= 1, got ", seq_len);
  return (seq_len + chunk - 1) / chunk;
}

void lact_check_split(int64_t seq_len, int64_t chunk, int64_t ranks, const char* seq_len_arg,
                      const char* chunk_arg) {
  SS_CHECK_ARG(seq_len >= 1, seq_len_arg, "sequence length must be >= 1, got ", seq_len);
  SS_CHECK_ARG(chunk >= 1, chunk_arg, "must be >= 1, got ", chunk);
  SS_CHECK_ARG(ranks >= 1, "ranks", "must be >= 1, got ", ranks);
  const int64_t chunks = lact_num_chunks(seq_len, chunk);
  // Chunk 0 is a full one whenever another follows it.
  SS_CHECK_ARG(chunks == 1 || chunk % ranks == 0, chunk_arg, "chunk 0 has ", chunk,
               " tokens, not divisible by the ", ranks, " ranks sharing it");
  const int64_t last = seq_len - (chunks - 1) * chunk;
  SS_CHECK_ARG(last % ranks == 0, seq_len_arg, "chunk ", chunks - 1, " has ", last,
               " tokens, not divisible by the ", ranks, " ranks sharing it (T = ", seq_len,
               " is not a multiple of ", ranks, ")");
}

LactTokenRange lact_token_range(int64_t seq_len, int64_t chunk, int64_t ranks, int64_t rank,
                                int64_t c) {
  const int64_t chunks = lact_num_chunks(seq_len, chunk);
  SS_CHECK_ARG(ranks >= 1, "ranks", "must be >= 1, got ", ranks);
  SS_CHECK_ARG(rank >= 0 && rank < ranks, "rank", rank, " not in [0, ", ranks, ")");
  SS_CHECK_ARG(c >= 0 && c < chunks, "chunk_index", c, " not in [0, ", chunks, ")");
  lact_check_split(seq_len, chunk, ranks, "seq_len", "chunk");
  const int64_t len = std::min(chunk, seq_len - c * chunk);
  const int64_t n = len / ranks;
  return {c * chunk + rank * n, c * chunk + (rank + 1) * n};
}

std::size_t lact_check_shard_sizes(int64_t batch, int64_t seq_len, int64_t inner, int64_t chunk,
                                   int64_t ranks, std::size_t global_size, std::size_t local_size) {
  SS_CHECK_ARG(batch >= 1, "batch", "must be >= 1, got ", batch);
  SS_CHECK_ARG(inner >= 1, "inner", "must be >= 1, got ", inner);
  lact_check_split(seq_len, chunk, ranks, "seq_len", "chunk");
  const auto global = static_cast<std::size_t>(batch * seq_len * inner);
  const auto local = static_cast<std::size_t>(batch * (seq_len / ranks) * inner);
  SS_CHECK_ARG(global_size == global, "global", "has ", global_size,
               " elements, expected B T inner = ", batch, " * ", seq_len, " * ", inner, " = ",
               global);
  SS_CHECK_ARG(local_size == kLactLocalUnknown || local_size == local, "local", "has ", local_size,
               " elements, expected B (T / P) inner = ", batch, " * ", seq_len / ranks, " * ",
               inner, " = ", local);
  return local;
}

void lact_check_layout(const LactConfig& config, int64_t batch, int64_t seq_len, int64_t heads,
                       int64_t dim, int64_t hidden, int64_t ranks, int64_t rank,
                       const void* const (&arrays)[10]) {
  check_lact_config(config);
  SS_CHECK_ARG(batch >= 1, "q", "batch must be >= 1, got ", batch);
  SS_CHECK_ARG(heads >= 1, "q", "heads must be >= 1, got ", heads);
  SS_CHECK_ARG(dim >= 1, "q", "head dim D must be >= 1, got ", dim);
  SS_CHECK_ARG(hidden >= 1, "w0", "hidden width M must be >= 1, got ", hidden);
  SS_CHECK_ARG(ranks >= 1, "ranks", "must be >= 1, got ", ranks);
  SS_CHECK_ARG(rank >= 0 && rank < ranks, "rank", rank, " not in [0, ", ranks, ")");
  // The sequence length is q's (and every token array's) T.
  lact_check_split(seq_len, config.chunk, ranks, "q", "chunk");
  const char* names[] = {"q", "k", "v", "lr0", "lr1", "lr2", "w0", "w1", "w2", "o"};
  for (int i = 0; i < 10; ++i) SS_CHECK_ARG(arrays[i] != nullptr, names[i], "is required");
}

template <typename T>
void lact_check_params(const LactParams<T>& p) {
  lact_check_layout(p);
  const int64_t tokens = p.batch * p.local_len() * p.heads, weights = p.heads * p.hidden * p.dim;
  check_finite_data(p.q, tokens * p.dim, "q");
  check_finite_data(p.k, tokens * p.dim, "k");
  check_finite_data(p.v, tokens * p.dim, "v");
  check_learning_rates(p.lr0, tokens, "lr0");
  check_learning_rates(p.lr1, tokens, "lr1");
  check_learning_rates(p.lr2, tokens, "lr2");
  check_finite_data(p.w0, weights, "w0");
  check_finite_data(p.w1, weights, "w1");
  check_finite_data(p.w2, weights, "w2");
}

// Per chunk: (A) apply at W_c if causal, partial G of the slice; all-reduce G;
// (B) momentum, Muon, step, renorm -> W_{c+1}; apply at W_{c+1} otherwise.
// A slice of every chunk updates from the whole chunk's gradient only
// through the all-reduce: without one, ranks > 1 would each apply their own
// partial gradient and their fast weights drift apart, with no error.
namespace {
template <typename T>
void check_all_reduce(const LactParams<T>& p, bool given) {
  SS_CHECK_ARG(p.ranks == 1 || given, "all_reduce", "is required when ranks > 1 (ranks = ", p.ranks,
               ")");
}
}  // namespace

template <typename T>
void lact_forward(const LactParams<T>& p, const LactAllReduce<T>& all_reduce,
                  LactCheckpoints<T>* saved) {
  lact_check_params(p);
  check_all_reduce(p, static_cast<bool>(all_reduce));
  const Geometry<T> geo(p);
  const WeightLayout& L = geo.layout;
  const LactConfig& cfg = p.config;
  const bool causal = cfg.schedule == LactSchedule::apply_then_update;
  const bool momentum = cfg.momentum > 0;
  const std::vector<T> w_init = initial_blocks(p, L);
  const std::vector<T> norm0 = row_norms(w_init, geo.H, L);

  const std::size_t state = static_cast<std::size_t>(geo.pairs) * geo.block();
  std::vector<T> weights(state), velocity(momentum ? state : 0), grads(state);
  for (int64_t i = 0; i < geo.pairs; ++i)
    std::copy(w_init.begin() + (i % geo.H) * L.block(),
              w_init.begin() + (i % geo.H + 1) * L.block(), weights.begin() + i * L.block());
  if (saved) {
    saved->weights.assign(static_cast<std::size_t>(geo.chunks) * state, T(0));
    saved->updates.assign(static_cast<std::size_t>(geo.chunks) * state, T(0));
  }

  for (int64_t c = 0; c < geo.chunks; ++c) {
    if (saved) std::copy(weights.begin(), weights.end(), saved->weights.begin() + c * state);
    parallel_for(geo.pairs, [&](int64_t i) {
      const TokenSlice<T> s = geo.slice(p.seq_len, c, i);
      const T* W = geo.pair_block(weights, i);
      if (causal) apply_forward(p, s, W, L);
      partial_gradients(p, s, W, L, geo.pair_block(grads, i));
    });
    if (all_reduce) all_reduce(grads.data(), grads.size());
    parallel_for(geo.pairs, [&](int64_t i) {
      T* update = geo.pair_block(grads, i);
      if (momentum) {
        T* vel = geo.pair_block(velocity, i);
        for (std::size_t e = 0; e < geo.block(); ++e) vel[e] = T(cfg.momentum) * vel[e] + update[e];
        update = vel;
      }
      if (saved)
        std::copy(update, update + L.block(), saved->updates.data() + c * state + i * L.block());
      std::vector<T> next(geo.block());
      T* W = geo.pair_block(weights, i);
      update_weights(W, update, cfg, L, norm0.data() + (i % geo.H) * L.norms(), next.data());
      std::copy(next.begin(), next.end(), W);
      if (!causal) apply_forward(p, geo.slice(p.seq_len, c, i), W, L);
    });
  }
}

// Reverse over chunks, carrying this rank's partial adjoints of W and of the
// momentum buffer: (A) apply backward at W_{c+1} if not causal, backward of
// the update -> partial dG; all-reduce dG; (B) backward of G on the slice's
// keys and values, apply backward at W_c if causal. Finally the carried
// adjoint plus the renorm targets' gradient, summed over batch rows and
// all-reduced, is the initial weights' gradient.
template <typename T>
void lact_backward(const LactParams<T>& p, const LactGradParams<T>& g,
                   const LactCheckpoints<T>& saved, const LactAllReduce<T>& all_reduce) {
  lact_check_params(p);
  check_all_reduce(p, static_cast<bool>(all_reduce));
  const char* names[] = {"d_o", "dq", "dk", "dv", "dlr0", "dlr1", "dlr2", "dw0", "dw1", "dw2"};
  const void* ptrs[] = {g.d_o, g.dq, g.dk, g.dv, g.dlr0, g.dlr1, g.dlr2, g.dw0, g.dw1, g.dw2};
  for (int i = 0; i < 10; ++i) SS_CHECK_ARG(ptrs[i] != nullptr, names[i], "is required");
  const Geometry<T> geo(p);
  const WeightLayout& L = geo.layout;
  const LactConfig& cfg = p.config;
  const bool causal = cfg.schedule == LactSchedule::apply_then_update;
  const bool momentum = cfg.momentum > 0;
  const std::size_t state = static_cast<std::size_t>(geo.pairs) * geo.block();
  SS_CHECK_ARG(saved.weights.size() == static_cast<std::size_t>(geo.chunks) * state &&
                   saved.updates.size() == saved.weights.size(),
               "saved", "checkpoints do not match this problem (run lact_forward first)");
  const std::vector<T> w_init = initial_blocks(p, L);
  const std::vector<T> norm0 = row_norms(w_init, geo.H, L);

  std::vector<T> d_weights(state), d_velocity(momentum ? state : 0), d_grads(state);
  std::vector<T> d_norm0(static_cast<std::size_t>(geo.pairs * L.norms()));
  for (int64_t c = geo.chunks - 1; c >= 0; --c) {
    const T* W_saved = saved.weights.data() + c * state;
    const T* U_saved = saved.updates.data() + c * state;
    parallel_for(geo.pairs, [&](int64_t i) {
      const T* W = W_saved + i * L.block();
      const T* update = U_saved + i * L.block();
      const T* n0 = norm0.data() + (i % geo.H) * L.norms();
      T* dW = geo.pair_block(d_weights, i);
      if (!causal) {
        std::vector<T> next(geo.block());
        update_weights(W, update, cfg, L, n0, next.data());
        apply_backward(p, g, geo.slice(p.seq_len, c, i), next.data(), L, dW);
      }
      std::vector<T> d_direct(geo.block());
      T* dG = geo.pair_block(d_grads, i);
      update_weights_backward(W, update, cfg, L, n0, dW, d_direct.data(), dG,
                              d_norm0.data() + i * L.norms());
      if (momentum) {
        T* dvel = geo.pair_block(d_velocity, i);
        for (std::size_t e = 0; e < geo.block(); ++e) {
          dG[e] += dvel[e];
          dvel[e] = T(cfg.momentum) * dG[e];
        }
      }
      std::copy(d_direct.begin(), d_direct.end(), dW);
    });
    if (all_reduce) all_reduce(d_grads.data(), d_grads.size());
    parallel_for(geo.pairs, [&](int64_t i) {
      const TokenSlice<T> s = geo.slice(p.seq_len, c, i);
      const T* W = W_saved + i * L.block();
      T* dW = geo.pair_block(d_weights, i);
      gradients_backward(p, g, s, W, L, geo.pair_block(d_grads, i), dW);
      if (causal) apply_backward(p, g, s, W, L, dW);
    });
  }

  // Sum over batch rows; the target norms n0 = |w row| add dn0 w / n0.
  std::vector<T> d_init(static_cast<std::size_t>(geo.H) * geo.block());
  for (int64_t i = 0; i < geo.pairs; ++i) {
    const int64_t h = i % geo.H;
    T* dst = d_init.data() + h * L.block();
    const T* src = geo.pair_block(d_weights, i);
    for (std::size_t e = 0; e < geo.block(); ++e) dst[e] += src[e];
    if (!cfg.renorm) continue;
    for (int w = 0; w < 3; ++w)
      for (int64_t r = 0; r < L.rows(w); ++r) {
        const int64_t row = L.offset(w) + r * L.cols(w);
        const T n0 = norm0[h * L.norms() + L.norm_offset(w) + r];
        if (n0 == T(0)) continue;
        const T scale = d_norm0[i * L.norms() + L.norm_offset(w) + r] / n0;
        for (int64_t j = 0; j < L.cols(w); ++j)
          dst[row + j] += scale * w_init[h * L.block() + row + j];
      }
  }
  if (all_reduce) all_reduce(d_init.data(), d_init.size());
  const int64_t md = L.M * L.D;
  for (int64_t h = 0; h < geo.H; ++h) {
    const T* src = d_init.data() + h * L.block();
    std::copy(src + L.offset(0), src + L.offset(0) + md, g.dw0 + h * md);
    std::copy(src + L.offset(1), src + L.offset(1) + md, g.dw1 + h * md);
    std::copy(src + L.offset(2), src + L.offset(2) + md, g.dw2 + h * md);
  }
}

#define SS_INSTANTIATE_LACT(T)                                                   \
  template void lact_check_params<T>(const LactParams<T>&);                      \
  template void lact_forward<T>(const LactParams<T>&, const LactAllReduce<T>&,   \
                                LactCheckpoints<T>*);                            \
  template void lact_backward<T>(const LactParams<T>&, const LactGradParams<T>&, \
                                 const LactCheckpoints<T>&, const LactAllReduce<T>&);
SS_INSTANTIATE_LACT(double)
SS_INSTANTIATE_LACT(float)
#undef SS_INSTANTIATE_LACT

}  // namespace statescan
