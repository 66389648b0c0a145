// The CPU execution path: the recurrence of DESIGN §3 token by token in fp32,
// one (segment, head) pair per work item, with the state saved once per chunk.
//
// All six variants share one kernel templated on <Decay, Rule>; the decay and
// the rule are resolved at compile time so that the per-row loops over Dv carry
// no branches. State rows are Dv floats, contiguous, and every inner loop runs
// along them (the compiler vectorises them; reductions use several partial sums
// so that no -ffast-math is needed).
#include "kernels/cpu/cpu_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/parallel_for.h"
#include "core/tensor.h"

namespace statescan::cpu {
namespace {

// Same epsilon as the reference (ref::kL2NormEps): x / sqrt(sum x^2 + eps).
constexpr float kL2NormEps = 1e-6f;
// Partial sums per dot product: enough for one AVX register of floats.
constexpr int kLanes = 8;

// sum_j a[j] * b[j] over n floats, in kLanes interleaved partial sums so that
// the loop vectorises without reassociation.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[j + l] * b[j + l];
  float tail = 0.f;
  for (; j < n; ++j) tail += a[j] * b[j];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

// y += a * x over n floats.
inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

// The preprocessed inputs (DESIGN §3) of up to `capacity` consecutive tokens of
// one head: q and k L2-normalised when asked, q scaled, alpha = exp(g). Loaded
// once per chunk so that backward's recompute and reverse passes share them.
class TokenBlock {
 public:
  TokenBlock(const MixerParams& p, int64_t capacity)
      : p_(p),
        dk_(p.dk),
        alpha_width_(vector_gate(p.variant) ? p.dk : 1),
        q_hat_(capacity * p.dk),
        q_(capacity * p.dk),
        k_(capacity * p.dk),
        alpha_(capacity * alpha_width_, 1.f),
        q_norm_(capacity, 1.f),
        k_norm_(capacity, 1.f),
        beta_(capacity, 0.f) {}

  // Loads tokens [t0, t0 + count) of batch row `row`, head `head`.
  void load(int64_t row, int64_t head, int64_t t0, int64_t count) {
    const float* q = static_cast<const float*>(p_.q);
    const float* k = static_cast<const float*>(p_.k);
    const float* beta = static_cast<const float*>(p_.beta);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t token = (row * p_.seq_len + t0 + c) * p_.heads + head;
      float* q_hat = &q_hat_[c * dk_];
      float* kc = &k_[c * dk_];
      std::memcpy(q_hat, q + token * dk_, sizeof(float) * dk_);
      std::memcpy(kc, k + token * dk_, sizeof(float) * dk_);
      if (p_.l2norm_qk) {
        q_norm_[c] = normalise(q_hat);
        k_norm_[c] = normalise(kc);
      }
      float* qc = &q_[c * dk_];
      for (int64_t i = 0; i < dk_; ++i) qc[i] = p_.scale * q_hat[i];
      if (p_.g != nullptr) {
        const float* g = p_.g + token * alpha_width_;
        for (int64_t i = 0; i < alpha_width_; ++i) alpha_[c * alpha_width_ + i] = std::exp(g[i]);
      }
      if (beta != nullptr) beta_[c] = beta[token];
    }
  }

  const float* q_hat(int64_t c) const { return &q_hat_[c * dk_]; }  // normalised, unscaled
  const float* q(int64_t c) const { return &q_[c * dk_]; }          // what the recurrence uses
  const float* k(int64_t c) const { return &k_[c * dk_]; }
  const float* alpha(int64_t c) const { return &alpha_[c * alpha_width_]; }
  float q_norm(int64_t c) const { return q_norm_[c]; }
  float k_norm(int64_t c) const { return k_norm_[c]; }
  float beta(int64_t c) const { return beta_[c]; }

 private:
  // x <- x / r with r = sqrt(sum x^2 + eps); returns r. The sum is taken in
  // double: it is only Dk terms once per token, and it keeps q, k exact to fp32.
  float normalise(float* x) const {
    double sum = 0;
    for (int64_t i = 0; i < dk_; ++i) sum += static_cast<double>(x[i]) * x[i];
    const double r = std::sqrt(sum + kL2NormEps);
    for (int64_t i = 0; i < dk_; ++i) x[i] = static_cast<float>(x[i] / r);
    return static_cast<float>(r);
  }

  const MixerParams& p_;
  int64_t dk_, alpha_width_;
  std::vector<float> q_hat_, q_, k_, alpha_, q_norm_, k_norm_, beta_;
};

// Gradient of x_hat = x / r (r = sqrt(|x|^2 + eps)) pulled back to x, in place:
// dx = (dx_hat - x_hat (x_hat . dx_hat)) / r.
inline void l2norm_backward(const float* x_hat, float r, float* d, int64_t n) {
  double proj = 0;
  for (int64_t i = 0; i < n; ++i) proj += static_cast<double>(x_hat[i]) * d[i];
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>((d[i] - x_hat[i] * proj) / r);
}

// One variant's per-(segment, head) work. `width` is the number of state
// columns: Dv, except in the delta-rule summary, which carries [M | E] as one
// Dk x (Dk + Dv) state.
template <Decay kDecay, Rule kRule>
struct HeadKernel {
  // Row i's retention factor for the token whose alphas are `alpha`.
  static float alpha_row(const float* alpha, int64_t i) {
    if constexpr (kDecay == Decay::vector) return alpha[i];
    if constexpr (kDecay == Decay::scalar) return alpha[0];
    return 1.f;
  }

  // next = transition(prev) for one token (DESIGN §3). With kOutput, o = next^T q.
  // For the delta rule, residual = v - S~^T k (backward reuses it; may be null).
  // u and w are `width`-float scratch.
  template <bool kOutput>
  static void step(const float* __restrict prev, float* __restrict next, int64_t dk, int64_t width,
                   const float* __restrict q, const float* __restrict k, const float* alpha,
                   float beta, const float* __restrict v, float* __restrict o,
                   float* __restrict residual, float* __restrict u, float* __restrict w) {
    if constexpr (kRule == Rule::additive) {
      // S_t[i] = alpha_i S_{t-1}[i] + k_i v ; o += q_i S_t[i].
      if constexpr (kOutput) std::fill(o, o + width, 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        const float a = alpha_row(alpha, i), ki = k[i];
        const float* __restrict src = prev + i * width;
        float* __restrict dst = next + i * width;
        for (int64_t j = 0; j < width; ++j) dst[j] = a * src[j] + ki * v[j];
        if constexpr (kOutput) axpy(q[i], dst, o, width);
      }
    } else {
      // Pass 1: S~ = Diag(alpha) S_{t-1}; u = S~^T k; w = S~^T q.
      std::fill(u, u + width, 0.f);
      if constexpr (kOutput) std::fill(w, w + width, 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        const float a = alpha_row(alpha, i), ki = k[i];
        const float* __restrict src = prev + i * width;
        float* __restrict dst = next + i * width;
        if constexpr (kDecay == Decay::none) {
          std::memcpy(dst, src, sizeof(float) * width);
        } else {
          for (int64_t j = 0; j < width; ++j) dst[j] = a * src[j];
        }
        axpy(ki, dst, u, width);
        if constexpr (kOutput) axpy(q[i], dst, w, width);
      }
      // r = v - u; e = beta r, kept in u; o = S_t^T q = w + (k . q) e.
      for (int64_t j = 0; j < width; ++j) u[j] = v[j] - u[j];
      if (residual != nullptr) std::memcpy(residual, u, sizeof(float) * width);
      for (int64_t j = 0; j < width; ++j) u[j] *= beta;
      if constexpr (kOutput) {
        const float kq = dot(k, q, dk);
        for (int64_t j = 0; j < width; ++j) o[j] = w[j] + kq * u[j];
      }
      // Pass 2: S_t = S~ + k e^T.
      for (int64_t i = 0; i < dk; ++i) axpy(k[i], u, next + i * width, width);
    }
  }
};

// Where one (segment, head) work item lives in the [B, T, H, *] tensors.
struct WorkItem {
  int64_t segment, row, head, begin, end;
  int64_t first_chunk;  // of the segment, in the chunk_states layout
};

// Each segment's first chunk in the chunk_states layout: prefix sums formed
// once per call (first_chunk_of_segment per work item walks every earlier
// segment: O(N^2 H) for N packed sequences).
std::vector<int64_t> segment_first_chunks(const MixerParams& p) {
  std::vector<int64_t> first(static_cast<std::size_t>(p.num_segments), 0);
  for (int64_t n = 1; n < p.num_segments; ++n)
    first[n] =
        first[n - 1] + (segment_end(p, n - 1) - segment_begin(p, n - 1) + p.chunk - 1) / p.chunk;
  return first;
}

WorkItem work_item(const MixerParams& p, const std::vector<int64_t>& first_chunks,
                   int64_t index) {
  WorkItem w;
  w.segment = index / p.heads;
  w.head = index % p.heads;
  w.row = segment_row(p, w.segment);
  w.begin = segment_begin(p, w.segment);
  w.end = segment_end(p, w.segment);
  w.first_chunk = first_chunks[static_cast<std::size_t>(w.segment)];
  return w;
}

// Offset of (row, t, head) in units of one head vector.
inline int64_t token_index(const MixerParams& p, int64_t row, int64_t t, int64_t head) {
  return (row * p.seq_len + t) * p.heads + head;
}

// Offset of (n, head) in an [N, H, Dk, Dv] state tensor.
inline int64_t state_offset(const MixerParams& p, int64_t n, int64_t head) {
  return (n * p.heads + head) * p.dk * p.dv;
}

void check_cpu_inputs(const MixerParams& p) {
  SS_CHECK_ARG(p.dtype == DType::f32, "dtype", "the CPU path needs f32 tensors, got ",
               to_string(p.dtype), " (round inputs with round_to and pass f32)");
  SS_CHECK_ARG(p.saved_t == nullptr, "saved_t",
               "is a GPU-path buffer (the CPU path keeps no prepared tiles)");
  const int64_t rows = p.batch * p.seq_len * p.heads;
  if (p.g != nullptr) {
    // Gates feed exp() in every step; a NaN/Inf, or a positive gate (a decay
    // above 1), would poison all outputs.
    check_log_gates(p.g, rows * (vector_gate(p.variant) ? p.dk : 1), "g");
  }
  // beta scales every delta-rule update the same way.
  if (p.beta != nullptr) check_finite(static_cast<const float*>(p.beta), rows, "beta");
}

// Forward of one (segment, head): o, final state, chunk checkpoints.
template <Decay kDecay, Rule kRule>
void forward_item(const MixerParams& p, const WorkItem& w) {
  using Kernel = HeadKernel<kDecay, kRule>;
  const int64_t dk = p.dk, dv = p.dv, state_size = dk * dv;
  std::vector<float> state_a(state_size, 0.f), state_b(state_size), u(dv), wq(dv);
  float* cur = state_a.data();
  float* nxt = state_b.data();
  if (p.initial_state != nullptr)
    std::memcpy(cur, p.initial_state + state_offset(p, w.segment, w.head),
                sizeof(float) * state_size);

  const float* v = static_cast<const float*>(p.v);
  float* o = static_cast<float*>(p.o);
  const int64_t first_chunk = w.first_chunk;
  TokenBlock tokens(p, p.chunk);
  for (int64_t t0 = w.begin; t0 < w.end; t0 += p.chunk) {
    const int64_t count = std::min(p.chunk, w.end - t0);
    if (p.chunk_states != nullptr) {
      const int64_t c = first_chunk + (t0 - w.begin) / p.chunk;
      std::memcpy(p.chunk_states + (c * p.heads + w.head) * state_size, cur,
                  sizeof(float) * state_size);
    }
    tokens.load(w.row, w.head, t0, count);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t token = token_index(p, w.row, t0 + c, w.head);
      Kernel::template step<true>(cur, nxt, dk, dv, tokens.q(c), tokens.k(c), tokens.alpha(c),
                                  tokens.beta(c), v + token * dv, o + token * dv, nullptr, u.data(),
                                  wq.data());
      std::swap(cur, nxt);
    }
  }
  if (p.final_state != nullptr)
    std::memcpy(p.final_state + state_offset(p, w.segment, w.head), cur,
                sizeof(float) * state_size);
}

// Backward of one (segment, head). Walks the chunks in reverse; each chunk's
// per-token states are recomputed from its checkpoint into `states` (C + 1
// states), then the reverse recurrence of DESIGN §3 runs over its tokens.
template <Decay kDecay, Rule kRule>
void backward_item(const MixerBwdParams& p, const WorkItem& w) {
  using Kernel = HeadKernel<kDecay, kRule>;
  const int64_t dk = p.dk, dv = p.dv, state_size = dk * dv, C = p.chunk;
  constexpr bool kDelta = kRule == Rule::delta;

  std::vector<float> d_state(state_size, 0.f);
  if (p.d_final_state != nullptr)
    std::memcpy(d_state.data(), p.d_final_state + state_offset(p, w.segment, w.head),
                sizeof(float) * state_size);
  std::vector<float> states((C + 1) * state_size), residuals(kDelta ? C * dv : 0);
  std::vector<float> u(dv), wq(dv), de(dv), dv_hat(dv), dq(dk), dk_acc(dk), dalpha(dk);

  const float* v = static_cast<const float*>(p.v);
  const float* d_o = static_cast<const float*>(p.d_o);
  float* dq_out = static_cast<float*>(p.dq);
  float* dk_out = static_cast<float*>(p.dk_out);
  float* dv_out = static_cast<float*>(p.dv_out);
  float* dbeta_out = static_cast<float*>(p.dbeta);
  const int64_t alpha_width = kDecay == Decay::vector ? dk : 1;
  const int64_t first_chunk = w.first_chunk;
  const int64_t num_chunks = (w.end - w.begin + C - 1) / C;
  TokenBlock tokens(p, C);

  for (int64_t chunk = num_chunks - 1; chunk >= 0; --chunk) {
    const int64_t t0 = w.begin + chunk * C;
    const int64_t count = std::min(C, w.end - t0);
    tokens.load(w.row, w.head, t0, count);

    // Recompute S_1..S_count of this chunk from its checkpoint S_0.
    std::memcpy(states.data(),
                p.chunk_states + ((first_chunk + chunk) * p.heads + w.head) * state_size,
                sizeof(float) * state_size);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t token = token_index(p, w.row, t0 + c, w.head);
      Kernel::template step<false>(&states[c * state_size], &states[(c + 1) * state_size], dk, dv,
                                   tokens.q(c), tokens.k(c), tokens.alpha(c), tokens.beta(c),
                                   v + token * dv, nullptr, kDelta ? &residuals[c * dv] : nullptr,
                                   u.data(), wq.data());
    }

    // Reverse over the chunk's tokens; d_state is dL/dS_t on entry to token t.
    for (int64_t c = count - 1; c >= 0; --c) {
      const int64_t token = token_index(p, w.row, t0 + c, w.head);
      const float* __restrict s_prev = &states[c * state_size];
      const float* __restrict s_cur = &states[(c + 1) * state_size];
      const float* __restrict q = tokens.q(c);
      const float* __restrict k = tokens.k(c);
      const float* alpha = tokens.alpha(c);
      const float* __restrict v_t = v + token * dv;
      const float* __restrict do_t = d_o + token * dv;
      float* __restrict ds = d_state.data();
      float* __restrict dv_t = dv_out + token * dv;

      if constexpr (!kDelta) {
        // dS += q do^T; dq = S_t do; dk = dS v; dv = dS^T k;
        // dalpha_i = dS[i] . S_{t-1}[i]; dS <- Diag(alpha) dS.
        std::fill(dv_t, dv_t + dv, 0.f);
        for (int64_t i = 0; i < dk; ++i) {
          float* __restrict row = ds + i * dv;
          axpy(q[i], do_t, row, dv);
          dq[i] = dot(s_cur + i * dv, do_t, dv);
          dk_acc[i] = dot(row, v_t, dv);
          axpy(k[i], row, dv_t, dv);
          if constexpr (kDecay != Decay::none) {
            dalpha[i] = dot(row, s_prev + i * dv, dv);
            const float a = Kernel::alpha_row(alpha, i);
            for (int64_t j = 0; j < dv; ++j) row[j] *= a;
          }
        }
      } else {
        const float beta = tokens.beta(c);
        const float* __restrict r = &residuals[c * dv];
        // e = beta r, with r = v - S~^T k saved by the recompute.
        for (int64_t j = 0; j < dv; ++j) u[j] = beta * r[j];
        // Pass A: dS += q do^T; dq = S_t do; dk = dS e; de = dS^T k.
        std::fill(de.begin(), de.end(), 0.f);
        for (int64_t i = 0; i < dk; ++i) {
          float* __restrict row = ds + i * dv;
          axpy(q[i], do_t, row, dv);
          dq[i] = dot(s_cur + i * dv, do_t, dv);
          dk_acc[i] = dot(row, u.data(), dv);
          axpy(k[i], row, de.data(), dv);
        }
        // dbeta = de . r; dv = beta de; dvhat = -beta de.
        if (dbeta_out != nullptr) dbeta_out[token] = dot(de.data(), r, dv);
        for (int64_t j = 0; j < dv; ++j) {
          dv_t[j] = beta * de[j];
          dv_hat[j] = -beta * de[j];
        }
        // Pass B: dS~ = dS + k dvhat^T; dk += S~ dvhat; dalpha_i = dS~[i] . S_{t-1}[i];
        // dS <- Diag(alpha) dS~.
        for (int64_t i = 0; i < dk; ++i) {
          float* __restrict row = ds + i * dv;
          const float* __restrict prev_row = s_prev + i * dv;
          axpy(k[i], dv_hat.data(), row, dv);
          const float a = Kernel::alpha_row(alpha, i);
          dk_acc[i] += a * dot(prev_row, dv_hat.data(), dv);
          if constexpr (kDecay != Decay::none) {
            dalpha[i] = dot(row, prev_row, dv);
            for (int64_t j = 0; j < dv; ++j) row[j] *= a;
          }
        }
      }

      // dq = scale S_t do (then through the L2 norm); dk likewise; dg = dalpha alpha.
      float* __restrict dq_t = dq_out + token * dk;
      float* __restrict dk_t = dk_out + token * dk;
      for (int64_t i = 0; i < dk; ++i) {
        dq_t[i] = p.scale * dq[i];
        dk_t[i] = dk_acc[i];
      }
      if (p.l2norm_qk) {
        l2norm_backward(tokens.q_hat(c), tokens.q_norm(c), dq_t, dk);
        l2norm_backward(k, tokens.k_norm(c), dk_t, dk);
      }
      if constexpr (kDecay == Decay::vector) {
        float* dg_t = p.dg + token * alpha_width;
        for (int64_t i = 0; i < dk; ++i) dg_t[i] = dalpha[i] * alpha[i];
      } else if constexpr (kDecay == Decay::scalar) {
        double sum = 0;
        for (int64_t i = 0; i < dk; ++i) sum += dalpha[i];
        p.dg[token] = static_cast<float>(sum) * alpha[0];
      }
    }
  }
  if (p.d_initial_state != nullptr)
    std::memcpy(p.d_initial_state + state_offset(p, w.segment, w.head), d_state.data(),
                sizeof(float) * state_size);
}

// d_initial_state of one (segment, head) alone, by the state-gradient
// recurrence dS_{t-1} = A_t^T (dS_t + q_t do_t^T), which needs no forward
// state: A_t^T = Diag(alpha) (I - beta k k^T) for the delta rule, Diag(alpha)
// for the additive rule.
template <Decay kDecay, Rule kRule>
void state_grad_item(const MixerBwdParams& p, const WorkItem& w) {
  using Kernel = HeadKernel<kDecay, kRule>;
  const int64_t dk = p.dk, dv = p.dv, state_size = dk * dv, C = p.chunk;
  std::vector<float> d_state(state_size, 0.f), de(dv);
  if (p.d_final_state != nullptr)
    std::memcpy(d_state.data(), p.d_final_state + state_offset(p, w.segment, w.head),
                sizeof(float) * state_size);
  const float* d_o = static_cast<const float*>(p.d_o);
  TokenBlock tokens(p, C);
  const int64_t num_chunks = (w.end - w.begin + C - 1) / C;
  for (int64_t chunk = num_chunks - 1; chunk >= 0; --chunk) {
    const int64_t t0 = w.begin + chunk * C;
    const int64_t count = std::min(C, w.end - t0);
    tokens.load(w.row, w.head, t0, count);
    for (int64_t c = count - 1; c >= 0; --c) {
      const float* __restrict do_t = d_o + token_index(p, w.row, t0 + c, w.head) * dv;
      const float* __restrict q = tokens.q(c);
      const float* __restrict k = tokens.k(c);
      const float* alpha = tokens.alpha(c);
      float* __restrict ds = d_state.data();
      if constexpr (kRule == Rule::additive) {
        for (int64_t i = 0; i < dk; ++i) {
          float* __restrict row = ds + i * dv;
          const float a = Kernel::alpha_row(alpha, i), qi = q[i];
          for (int64_t j = 0; j < dv; ++j) row[j] = a * (row[j] + qi * do_t[j]);
        }
      } else {
        std::fill(de.begin(), de.end(), 0.f);
        for (int64_t i = 0; i < dk; ++i) {
          float* __restrict row = ds + i * dv;
          axpy(q[i], do_t, row, dv);
          axpy(k[i], row, de.data(), dv);
        }
        const float beta = tokens.beta(c);
        for (int64_t i = 0; i < dk; ++i) {
          float* __restrict row = ds + i * dv;
          const float a = Kernel::alpha_row(alpha, i), bk = beta * k[i];
          for (int64_t j = 0; j < dv; ++j) row[j] = a * (row[j] - bk * de[j]);
        }
      }
    }
  }
  std::memcpy(p.d_initial_state + state_offset(p, w.segment, w.head), d_state.data(),
              sizeof(float) * state_size);
}

// Summary (M, E) of the last segment of batch row `row` for head `head`.
template <Decay kDecay, Rule kRule>
void summary_item(const MixerParams& p, int64_t row, int64_t head, float* M, float* E) {
  using Kernel = HeadKernel<kDecay, kRule>;
  const int64_t dk = p.dk, dv = p.dv;
  const int64_t segment = p.cu_seqlens ? p.num_segments - 1 : row;
  const int64_t begin = segment_begin(p, segment), end = segment_end(p, segment);
  const int64_t m_size = kRule == Rule::delta ? dk * dk : dk;
  float* m_out = M + (row * p.heads + head) * m_size;
  float* e_out = E + (row * p.heads + head) * dk * dv;
  const float* initial =
      p.initial_state ? p.initial_state + state_offset(p, segment, head) : nullptr;

  // Delta rule: carry X = [M | E] (Dk x (Dk + Dv)) from [I | S_0]. Each token
  // maps X -> A_t X + beta k [0 | v]^T, which is the delta step with value [0 | v]:
  // the M columns see A_t alone, the E columns the full state update.
  // Additive rule: E is the plain state; M = prod alpha is kept separately.
  const int64_t width = kRule == Rule::delta ? dk + dv : dv;
  const int64_t e_col = kRule == Rule::delta ? dk : 0;
  std::vector<float> state_a(dk * width, 0.f), state_b(dk * width), value(width, 0.f), u(width),
      scratch(width);
  for (int64_t i = 0; i < dk; ++i) {
    if constexpr (kRule == Rule::delta) state_a[i * width + i] = 1.f;
    if (initial != nullptr)
      std::memcpy(&state_a[i * width + e_col], initial + i * dv, sizeof(float) * dv);
  }
  // log of prod alpha per row, summed in double (additive rule's M).
  std::vector<double> log_decay(dk, 0.0);

  const float* v = static_cast<const float*>(p.v);
  float* cur = state_a.data();
  float* nxt = state_b.data();
  TokenBlock tokens(p, p.chunk);
  for (int64_t t0 = begin; t0 < end; t0 += p.chunk) {
    const int64_t count = std::min(p.chunk, end - t0);
    tokens.load(segment_row(p, segment), head, t0, count);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t token = token_index(p, segment_row(p, segment), t0 + c, head);
      std::memcpy(&value[e_col], v + token * dv, sizeof(float) * dv);
      Kernel::template step<false>(cur, nxt, dk, width, tokens.q(c), tokens.k(c), tokens.alpha(c),
                                   tokens.beta(c), value.data(), nullptr, nullptr, u.data(),
                                   scratch.data());
      std::swap(cur, nxt);
      if constexpr (kRule == Rule::additive && kDecay != Decay::none) {
        const float* g = p.g + token * (kDecay == Decay::vector ? dk : 1);
        for (int64_t i = 0; i < dk; ++i) log_decay[i] += g[kDecay == Decay::vector ? i : 0];
      }
    }
  }
  for (int64_t i = 0; i < dk; ++i) {
    std::memcpy(e_out + i * dv, cur + i * width + e_col, sizeof(float) * dv);
    if constexpr (kRule == Rule::delta) {
      std::memcpy(m_out + i * dk, cur + i * width, sizeof(float) * dk);
    } else {
      m_out[i] = static_cast<float>(std::exp(log_decay[i]));
    }
  }
}

// Calls fn(HeadKernel-tag) with the variant's <Decay, Rule> as compile-time values.
template <Decay kDecay, Rule kRule>
struct VariantTag {
  static constexpr Decay decay = kDecay;
  static constexpr Rule rule = kRule;
};

template <typename Fn>
void dispatch(Variant variant, Fn&& fn) {
  switch (variant) {
    case Variant::linear:
      return fn(VariantTag<Decay::none, Rule::additive>{});
    case Variant::retention:
      return fn(VariantTag<Decay::scalar, Rule::additive>{});
    case Variant::gla:
      return fn(VariantTag<Decay::vector, Rule::additive>{});
    case Variant::deltanet:
      return fn(VariantTag<Decay::none, Rule::delta>{});
    case Variant::gated_deltanet:
      return fn(VariantTag<Decay::scalar, Rule::delta>{});
    case Variant::kda:
      return fn(VariantTag<Decay::vector, Rule::delta>{});
  }
  SS_FAIL("variant", "unknown variant ", static_cast<int>(variant));
}

}  // namespace

void mixer_forward(const MixerParams& p) {
  validate(p);
  check_cpu_inputs(p);
  const std::vector<int64_t> first_chunks = segment_first_chunks(p);
  dispatch(p.variant, [&](auto tag) {
    using Tag = decltype(tag);
    parallel_for(p.num_segments * p.heads, [&](int64_t index) {
      forward_item<Tag::decay, Tag::rule>(p, work_item(p, first_chunks, index));
    });
  });
}

void mixer_backward(const MixerBwdParams& p) {
  validate(p);
  check_cpu_inputs(p);
  if (p.recompute_chunk_states && !p.state_grad_only) {
    // Re-run the forward for its chunk states (its o goes to scratch; the
    // caller's final_state is left alone), then the usual backward.
    std::vector<float> states(
        static_cast<std::size_t>(count_chunks(p) * p.heads * p.dk * p.dv));
    std::vector<float> o(static_cast<std::size_t>(p.batch * p.seq_len * p.heads * p.dv));
    MixerParams fwd = p;
    fwd.o = o.data();
    fwd.final_state = nullptr;
    fwd.chunk_states = states.data();
    mixer_forward(fwd);
    MixerBwdParams with_states = p;
    with_states.chunk_states = states.data();
    with_states.recompute_chunk_states = false;
    mixer_backward(with_states);
    return;
  }
  const std::vector<int64_t> first_chunks = segment_first_chunks(p);
  dispatch(p.variant, [&](auto tag) {
    using Tag = decltype(tag);
    parallel_for(p.num_segments * p.heads, [&](int64_t index) {
      const WorkItem w = work_item(p, first_chunks, index);
      if (p.state_grad_only) {
        state_grad_item<Tag::decay, Tag::rule>(p, w);
      } else {
        backward_item<Tag::decay, Tag::rule>(p, w);
      }
    });
  });
}

void mixer_summary(const MixerParams& p, float* M, float* E) {
  // Its own outputs first: a null E would otherwise stand in for o below and
  // be reported as o.
  SS_CHECK_ARG(M != nullptr, "M", "summary output must not be null");
  SS_CHECK_ARG(E != nullptr, "E", "summary output must not be null");
  // The summary writes no o: validate everything else.
  MixerParams checked = p;
  if (checked.o == nullptr) checked.o = E;
  validate(checked);
  check_cpu_inputs(p);
  const int64_t rows = p.cu_seqlens ? 1 : p.batch;
  dispatch(p.variant, [&](auto tag) {
    using Tag = decltype(tag);
    parallel_for(rows * p.heads, [&](int64_t index) {
      summary_item<Tag::decay, Tag::rule>(p, index / p.heads, index % p.heads, M, E);
    });
  });
}

int64_t summary_m_size(const MixerParams& p) {
  return has_beta(p.variant) ? p.dk * p.dk : p.dk;
}

}  // namespace statescan::cpu
