// Shared test helpers: realistic random problems (DESIGN §7) and the relative
// RMS error metric. Header-only so every suite can include it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/options.h"
#include "kernels/cpu/reference.h"

namespace statescan::test {

// Same size and the same bytes (determinism and bitwise-equality checks: NaN
// payloads and signed zeros count, unlike ==).
template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// rms(a - ref) / rms(ref); +inf if any element is NaN/Inf or sizes differ.
// A zero reference compares the absolute RMS instead.
template <typename A, typename B>
double rel_rms(const std::vector<A>& a, const std::vector<B>& ref) {
  if (a.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a[i]), r = static_cast<double>(ref[i]);
    if (!std::isfinite(x) || !std::isfinite(r)) return std::numeric_limits<double>::infinity();
    num += (x - r) * (x - r);
    den += r * r;
  }
  if (den == 0) return std::sqrt(num / std::max<std::size_t>(a.size(), 1));
  return std::sqrt(num / den);
}

// DESIGN §7's bounds on the relative RMS against the fp64 reference, by the
// dtype of the tensors the kernels read (16-bit: FLA's tolerances): outputs
// and states (o, final and chunk states); the token and state gradients (dq,
// dk, dv, dh0); the gates' gradients (dg, dbeta).
inline double output_tol(DType t) {
  return t == DType::f32 ? 1e-5 : 5e-3;
}
inline double grad_tol(DType t) {
  return t == DType::f32 ? 1e-5 : 8e-3;
}
inline double gate_grad_tol(DType t) {
  return t == DType::f32 ? 1e-5 : 2e-2;
}

inline std::vector<double> randn(std::size_t n, std::mt19937_64& rng, double stddev = 1.0) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<double> x(n);
  for (auto& e : x) e = dist(rng);
  return x;
}

inline double log_sigmoid(double x) {
  return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// L2-normalises every length-d vector of x in place.
inline void l2_normalise(std::vector<double>& x, int64_t d) {
  for (std::size_t i = 0; i < x.size(); i += static_cast<std::size_t>(d)) {
    double s = 0;
    for (int64_t j = 0; j < d; ++j) s += x[i + j] * x[i + j];
    s = 1.0 / std::sqrt(s + 1e-12);
    for (int64_t j = 0; j < d; ++j) x[i + j] *= s;
  }
}

struct ProblemSpec {
  Variant variant = Variant::kda;
  int64_t batch = 1, seq_len = 37, heads = 2, dk = 8, dv = 8;
  bool l2norm_qk = false;
  bool with_h0 = false;
  std::vector<int64_t> cu_seqlens;  // empty: batch rows
  double scale = -1;                // < 0: dk^-1/2
};

// A fresh random problem with realistic statistics: g = logsigmoid(N(0,1) + 4),
// beta = sigmoid(N(0,1)), q/k unit-norm for delta rules (unless the op
// normalises them itself), v ~ N(0,1), h0 ~ N(0, 0.1^2).
inline ref::Problem random_problem(const ProblemSpec& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ref::Problem p;
  p.variant = s.variant;
  p.batch = s.batch;
  p.seq_len = s.seq_len;
  p.heads = s.heads;
  p.dk = s.dk;
  p.dv = s.dv;
  p.l2norm_qk = s.l2norm_qk;
  p.cu_seqlens = s.cu_seqlens;
  p.scale = s.scale < 0 ? 1.0 / std::sqrt(static_cast<double>(s.dk)) : s.scale;
  const std::size_t btH = static_cast<std::size_t>(s.batch * s.seq_len * s.heads);
  p.q = randn(btH * s.dk, rng);
  p.k = randn(btH * s.dk, rng);
  p.v = randn(btH * s.dv, rng);
  if (has_beta(s.variant) && !s.l2norm_qk) {
    l2_normalise(p.q, s.dk);
    l2_normalise(p.k, s.dk);
  }
  if (has_gate(s.variant)) {
    p.g = randn(vector_gate(s.variant) ? btH * s.dk : btH, rng);
    for (auto& e : p.g) e = log_sigmoid(e + 4.0);
  }
  if (has_beta(s.variant)) {
    p.beta = randn(btH, rng);
    for (auto& e : p.beta) e = sigmoid(e);
  }
  if (s.with_h0)
    p.h0 = randn(static_cast<std::size_t>(p.num_sequences() * s.heads * s.dk * s.dv), rng, 0.1);
  return p;
}

template <typename T = float>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

// Log gates of the tokens in every other 64-token chunk (the odd ones)
// multiplied by `factor`: random_problem's log_sigmoid(x + 4) ~ -0.02 per
// token becomes ~ -5 at factor 300, so those chunks decay by far more than
// any tensor-core path's bound while their neighbours stay mild.
inline void strengthen_gates_in_odd_chunks(ref::Problem& p, double factor) {
  const int64_t width = vector_gate(p.variant) ? p.dk : 1;
  for (size_t i = 0; i < p.g.size(); ++i) {
    const int64_t token = static_cast<int64_t>(i) / (p.heads * width) % p.seq_len;
    if ((token / 64) % 2 == 1) p.g[i] *= factor;
  }
}

// Log gates that decay by about `per_block` e-folds over every 16 tokens: each
// entry -per_block / 16 times a factor drawn uniformly from [0.75, 1.25], so
// one 16-token block's decay stays within ~11% of per_block (the 16-bit
// backward's vector kernel switches paths at a bound on it).
inline void set_block_decay(std::vector<double>& g, double per_block, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> jitter(0.75, 1.25);
  for (double& e : g) e = -per_block / 16 * jitter(rng);
}

// x with every element rounded to the nearest float (inputs an fp32 path sees
// exactly, kept in double for the reference).
inline std::vector<double> round_f32(std::vector<double> x) {
  for (auto& e : x) e = static_cast<double>(static_cast<float>(e));
  return x;
}

inline std::string variant_name(Variant v) { return to_string(v); }

}  // namespace statescan::test
