// Helpers for the context-parallel suites: run CpMixer on a slice of a
// ref::Problem and collect its outputs as flat vectors.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel/cp_mixer.h"
#include "tests/test_util.h"

namespace statescan::test {

struct CpOutputs {
  std::vector<float> o, ht, dq, dk, dv, dg, dbeta, dh0;
};

// Uneven contiguous shards of T tokens over P ranks: rank r gets a share
// proportional to r + 1 (so the last rank holds the most), every shard >= 1
// token; returns the P + 1 bounds.
inline std::vector<int64_t> shard_bounds(int64_t T, int P) {
  std::vector<int64_t> b(static_cast<std::size_t>(P + 1), 0);
  const int64_t weight = static_cast<int64_t>(P) * (P + 1) / 2;
  for (int r = 1; r < P; ++r)
    b[r] = std::max<int64_t>(b[r - 1] + 1, T * (r * (r + 1) / 2) / weight);
  b[P] = T;
  return b;
}

// Copies tokens [t0, t1) of a [B,T,H,D] tensor (D = inner) into a new vector.
inline std::vector<float> slice_tokens(const std::vector<double>& x, int64_t B, int64_t T,
                                       int64_t t0, int64_t t1, int64_t inner) {
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(B * (t1 - t0) * inner));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < inner; ++i)
        out.push_back(static_cast<float>(x[(b * T + t) * inner + i]));
  return out;
}

inline std::vector<double> slice_tokens_d(const std::vector<double>& x, int64_t B, int64_t T,
                                          int64_t t0, int64_t t1, int64_t inner) {
  auto f = slice_tokens(x, B, T, t0, t1, inner);
  return std::vector<double>(f.begin(), f.end());
}

// Runs forward + backward of `mixer` on tokens [t0, t1) of problem p with
// cotangents d_o (full [B,T,H,Dv]) and dht ([N,H,Dk,Dv] or empty). Outputs
// are poisoned with NaN first so unwritten elements show.
inline CpOutputs run_cp(CpMixer& mixer, const ref::Problem& p, int64_t t0, int64_t t1,
                        const std::vector<double>& d_o, const std::vector<double>& dht) {
  const int64_t B = p.batch, T = p.seq_len, H = p.heads, Dk = p.dk, Dv = p.dv, L = t1 - t0;
  const int64_t N = p.num_sequences();
  const bool vec = vector_gate(p.variant);
  auto q = slice_tokens(p.q, B, T, t0, t1, H * Dk), k = slice_tokens(p.k, B, T, t0, t1, H * Dk);
  auto v = slice_tokens(p.v, B, T, t0, t1, H * Dv);
  std::vector<float> g, beta;
  if (!p.g.empty()) g = slice_tokens(p.g, B, T, t0, t1, vec ? H * Dk : H);
  if (!p.beta.empty()) beta = slice_tokens(p.beta, B, T, t0, t1, H);
  auto h0 = cast(p.h0);
  auto dov = slice_tokens(d_o, B, T, t0, t1, H * Dv);
  auto dhtv = cast(dht);
  std::vector<int64_t> cu = p.cu_seqlens;

  const float nan = std::numeric_limits<float>::quiet_NaN();
  CpOutputs out;
  out.o.assign(static_cast<std::size_t>(B * L * H * Dv), nan);
  out.ht.assign(static_cast<std::size_t>(N * H * Dk * Dv), nan);
  out.dq.assign(q.size(), nan);
  out.dk.assign(k.size(), nan);
  out.dv.assign(v.size(), nan);
  out.dg.assign(g.size(), nan);
  out.dbeta.assign(beta.size(), nan);
  out.dh0.assign(static_cast<std::size_t>(N * H * Dk * Dv), nan);

  const Shape qk{B, L, H, Dk}, vo{B, L, H, Dv}, bth{B, L, H}, st{N, H, Dk, Dv};
  const Shape gs = vec ? qk : bth;
  CpForwardArgs fa;
  fa.q = TensorView(q.data(), DType::f32, qk);
  fa.k = TensorView(k.data(), DType::f32, qk);
  fa.v = TensorView(v.data(), DType::f32, vo);
  if (!g.empty()) fa.g = TensorView(g.data(), DType::f32, gs);
  if (!beta.empty()) fa.beta = TensorView(beta.data(), DType::f32, bth);
  if (!cu.empty())
    fa.cu_seqlens = TensorView(cu.data(), DType::i64, {static_cast<int64_t>(cu.size())});
  if (!h0.empty()) fa.initial_state = TensorView(h0.data(), DType::f32, st);
  fa.o = TensorView(out.o.data(), DType::f32, vo);
  fa.final_state = TensorView(out.ht.data(), DType::f32, st);
  mixer.forward(fa);

  CpBackwardArgs ba;
  ba.d_o = TensorView(dov.data(), DType::f32, vo);
  if (!dhtv.empty()) ba.d_final_state = TensorView(dhtv.data(), DType::f32, st);
  ba.dq = TensorView(out.dq.data(), DType::f32, qk);
  ba.dk = TensorView(out.dk.data(), DType::f32, qk);
  ba.dv = TensorView(out.dv.data(), DType::f32, vo);
  if (!g.empty()) ba.dg = TensorView(out.dg.data(), DType::f32, gs);
  if (!beta.empty()) ba.dbeta = TensorView(out.dbeta.data(), DType::f32, bth);
  ba.d_initial_state = TensorView(out.dh0.data(), DType::f32, st);
  mixer.backward(ba);
  return out;
}

// Rounds every input of p to float so that fp32 paths and the fp64 reference
// see the same values.
inline void round_to_float(ref::Problem& p) {
  for (auto* x : {&p.q, &p.k, &p.v, &p.g, &p.beta, &p.h0}) *x = round_f32(std::move(*x));
}

}  // namespace statescan::test
