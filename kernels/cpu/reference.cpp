// The fp64 reference recurrence (DESIGN §3), token by token.
//
// Structure: validate the Problem once; normalise and scale q, k once (keeping
// the norms for the backward); then every (sequence, head) pair is an
// independent recurrence over its tokens, run in parallel. Decay is always
// expanded to one alpha per state row (ones without decay, Dk copies of the
// scalar for scalar decay), so that all six variants share one code path and
// only the rule (additive | delta) branches.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "core/error.h"
#include "core/parallel_for.h"

namespace statescan::ref {
namespace {

// Sizes and strides of one Problem, derived once.
struct Dims {
  int64_t batch, seq_len, heads, dk, dv, num_sequences;
  Decay decay;
  Rule rule;

  // Offset of token t of batch row b, head h, in a [B,T,H,D] array.
  int64_t token(int64_t b, int64_t t, int64_t h, int64_t d) const {
    return ((b * seq_len + t) * heads + h) * d;
  }
  // Offset of (sequence n, head h) in an [N,H,Dk,Dv] state array.
  int64_t state(int64_t n, int64_t h) const { return (n * heads + h) * dk * dv; }
  int64_t state_size() const { return dk * dv; }
  // Values of g per (token, head).
  int64_t gate_width() const {
    return decay == Decay::vector ? dk : (decay == Decay::scalar ? 1 : 0);
  }
};

Dims dims_of(const Problem& p) {
  const VariantSpec spec = spec_of(p.variant);
  return Dims{p.batch, p.seq_len, p.heads, p.dk, p.dv, p.num_sequences(), spec.decay, spec.rule};
}

std::vector<Sequence> sequences_of(const Problem& p) {
  std::vector<Sequence> seqs;
  for (int64_t n = 0; n < p.num_sequences(); ++n) seqs.push_back(p.sequence(n));
  return seqs;
}

void check_size(const std::vector<double>& x, int64_t expected, const char* name,
                const char* layout) {
  SS_CHECK_ARG(static_cast<int64_t>(x.size()) == expected, name, "must hold ", expected,
               " values (", layout, "), got ", x.size());
}

void check_finite(const std::vector<double>& x, const char* name) {
  for (std::size_t i = 0; i < x.size(); ++i)
    SS_CHECK_ARG(std::isfinite(x[i]), name, "element ", i, " is not finite (", x[i], ")");
}

// Checks every size of the Problem against its shapes, the segment table and
// that g / beta are present exactly when the variant needs them.
void validate(const Problem& p) {
  SS_CHECK_ARG(p.batch >= 1, "batch", "must be >= 1, got ", p.batch);
  SS_CHECK_ARG(p.seq_len >= 1, "seq_len", "must be >= 1, got ", p.seq_len);
  SS_CHECK_ARG(p.heads >= 1, "heads", "must be >= 1, got ", p.heads);
  SS_CHECK_ARG(p.dk >= 1, "dk", "must be >= 1, got ", p.dk);
  SS_CHECK_ARG(p.dv >= 1, "dv", "must be >= 1, got ", p.dv);
  SS_CHECK_ARG(std::isfinite(p.scale), "scale", "must be finite, got ", p.scale);

  if (!p.cu_seqlens.empty()) {
    const auto& cu = p.cu_seqlens;
    SS_CHECK_ARG(p.batch == 1, "cu_seqlens", "packed sequences need batch == 1, got batch ",
                 p.batch);
    SS_CHECK_ARG(cu.size() >= 2, "cu_seqlens", "must hold at least 2 offsets, got ", cu.size());
    SS_CHECK_ARG(cu.front() == 0, "cu_seqlens", "must start at 0, got ", cu.front());
    for (std::size_t n = 0; n + 1 < cu.size(); ++n)
      SS_CHECK_ARG(cu[n + 1] > cu[n], "cu_seqlens", "must be strictly increasing; offsets ", n,
                   " and ", n + 1, " are ", cu[n], " and ", cu[n + 1]);
    SS_CHECK_ARG(cu.back() == p.seq_len, "cu_seqlens", "last offset ", cu.back(),
                 " must equal seq_len ", p.seq_len);
  }

  const Dims d = dims_of(p);
  const int64_t tokens = p.batch * p.seq_len * p.heads;
  check_size(p.q, tokens * p.dk, "q", "[B,T,H,Dk]");
  check_size(p.k, tokens * p.dk, "k", "[B,T,H,Dk]");
  check_size(p.v, tokens * p.dv, "v", "[B,T,H,Dv]");
  if (d.decay == Decay::none) {
    SS_CHECK_ARG(p.g.empty(), "g", "must be empty for variant ", to_string(p.variant));
  } else {
    check_size(p.g, tokens * d.gate_width(), "g",
               d.decay == Decay::vector ? "[B,T,H,Dk]" : "[B,T,H]");
  }
  if (d.rule == Rule::additive) {
    SS_CHECK_ARG(p.beta.empty(), "beta", "must be empty for variant ", to_string(p.variant));
  } else {
    check_size(p.beta, tokens, "beta", "[B,T,H]");
  }
  if (!p.h0.empty())
    check_size(p.h0, d.num_sequences * d.state_size() * p.heads, "h0", "[N,H,Dk,Dv]");

  check_finite(p.q, "q");
  check_finite(p.k, "k");
  check_finite(p.v, "v");
  check_finite(p.g, "g");
  // DESIGN §2: alpha = exp(g) in (0, 1]. The oracle refuses what the kernels
  // refuse: a positive log gate grows the state without bound, and a
  // reference computed from it would be confidently meaningless.
  for (std::size_t i = 0; i < p.g.size(); ++i)
    SS_CHECK_ARG(p.g[i] <= 0, "g", "element ", i, " is ", p.g[i],
                 " (log gates must be finite and <= 0: alpha = exp(g) in (0, 1])");
  check_finite(p.beta, "beta");
  check_finite(p.h0, "h0");
}

// q and k as the recurrence sees them: q̂ = scale * q / r_q, k̂ = k / r_k with
// r = sqrt(|x|^2 + eps) when l2norm_qk, else r = 1. The norms r are kept for
// the backward of the normalisation.
struct PreparedQK {
  std::vector<double> q, k;            // [B,T,H,Dk]
  std::vector<double> q_norm, k_norm;  // [B,T,H]
};

void normalise_rows(const std::vector<double>& x, int64_t d, bool l2norm, double factor,
                    std::vector<double>& out, std::vector<double>& norms) {
  const int64_t rows = static_cast<int64_t>(x.size()) / d;
  out.resize(x.size());
  norms.assign(static_cast<std::size_t>(rows), 1.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = x.data() + r * d;
    double norm = 1.0;
    if (l2norm) {
      double sum_sq = 0;
      for (int64_t i = 0; i < d; ++i) sum_sq += xr[i] * xr[i];
      norm = std::sqrt(sum_sq + kL2NormEps);
    }
    norms[r] = norm;
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = factor * xr[i] / norm;
  }
}

PreparedQK prepare_qk(const Problem& p) {
  PreparedQK qk;
  normalise_rows(p.q, p.dk, p.l2norm_qk, p.scale, qk.q, qk.q_norm);
  normalise_rows(p.k, p.dk, p.l2norm_qk, 1.0, qk.k, qk.k_norm);
  return qk;
}

// Gradient through x̂ = factor * x / r, r = sqrt(|x|^2 + eps), in place on dx:
// with n = x / r, dn = factor * dx̂ and dx = (dn - n (n·dn)) / r (the Jacobian
// of x / r is (I - n n^T) / r, symmetric). Without l2norm it is dx = factor dx̂.
void normalise_rows_backward(const std::vector<double>& x, const std::vector<double>& norms,
                             int64_t d, bool l2norm, double factor, std::vector<double>& dx) {
  const int64_t rows = static_cast<int64_t>(x.size()) / d;
  for (int64_t r = 0; r < rows; ++r) {
    double* g = dx.data() + r * d;
    for (int64_t i = 0; i < d; ++i) g[i] *= factor;
    if (!l2norm) continue;
    const double* xr = x.data() + r * d;
    const double norm = norms[r];
    double n_dot_g = 0;
    for (int64_t i = 0; i < d; ++i) n_dot_g += (xr[i] / norm) * g[i];
    for (int64_t i = 0; i < d; ++i) g[i] = (g[i] - (xr[i] / norm) * n_dot_g) / norm;
  }
}

// The recurrence of one (sequence, head): pointers into the problem's arrays
// and the per-row decay of the current token.
class HeadRecurrence {
 public:
  HeadRecurrence(const Problem& p, const PreparedQK& qk, const Dims& d, const Sequence& s,
                 int64_t n, int64_t h)
      : p_(p),
        qk_(qk),
        d_(d),
        seq_(s),
        seq_index_(n),
        head_(h),
        alpha_(static_cast<std::size_t>(d.dk)),
        u_(static_cast<std::size_t>(d.dv)) {}

  int64_t length() const { return seq_.end - seq_.begin; }
  int64_t k_offset(int64_t i) const { return d_.token(seq_.row, seq_.begin + i, head_, d_.dk); }
  int64_t v_offset(int64_t i) const { return d_.token(seq_.row, seq_.begin + i, head_, d_.dv); }
  int64_t scalar_offset(int64_t i) const { return d_.token(seq_.row, seq_.begin + i, head_, 1); }
  int64_t state_offset() const { return d_.state(seq_index_, head_); }

  // alpha_ <- exp(g) of token i, one value per state row.
  const std::vector<double>& load_alpha(int64_t i) {
    switch (d_.decay) {
      case Decay::none:
        for (auto& a : alpha_) a = 1.0;
        break;
      case Decay::scalar: {
        const double a = std::exp(p_.g[scalar_offset(i)]);
        for (auto& x : alpha_) x = a;
        break;
      }
      case Decay::vector: {
        const double* g = p_.g.data() + k_offset(i);
        for (int64_t r = 0; r < d_.dk; ++r) alpha_[r] = std::exp(g[r]);
        break;
      }
    }
    return alpha_;
  }

  double beta(int64_t i) const { return d_.rule == Rule::delta ? p_.beta[scalar_offset(i)] : 0.0; }

  // S_{i} from S_{i-1} in place (token i of the sequence):
  //   S~ = Diag(alpha) S;  additive: S = S~ + k v^T;  delta: S = S~ + beta k (v - S~^T k)^T.
  void step(int64_t i, double* S) {
    const int64_t dk = d_.dk, dv = d_.dv;
    load_alpha(i);
    const double* k = qk_.k.data() + k_offset(i);
    const double* v = p_.v.data() + v_offset(i);
    for (int64_t r = 0; r < dk; ++r)
      for (int64_t c = 0; c < dv; ++c) S[r * dv + c] *= alpha_[r];
    if (d_.rule == Rule::additive) {
      for (int64_t r = 0; r < dk; ++r)
        for (int64_t c = 0; c < dv; ++c) S[r * dv + c] += k[r] * v[c];
      return;
    }
    const double b = beta(i);
    for (int64_t c = 0; c < dv; ++c) u_[c] = v[c];
    for (int64_t r = 0; r < dk; ++r)
      for (int64_t c = 0; c < dv; ++c) u_[c] -= S[r * dv + c] * k[r];
    for (int64_t r = 0; r < dk; ++r)
      for (int64_t c = 0; c < dv; ++c) S[r * dv + c] += b * k[r] * u_[c];
  }

  // o_i = S_i^T q̂_i.
  void output(int64_t i, const double* S, double* o) const {
    const double* q = qk_.q.data() + k_offset(i);
    for (int64_t c = 0; c < d_.dv; ++c) o[c] = 0;
    for (int64_t r = 0; r < d_.dk; ++r)
      for (int64_t c = 0; c < d_.dv; ++c) o[c] += S[r * d_.dv + c] * q[r];
  }

  // Copies the initial state (or zeros) into S.
  void load_initial_state(double* S) const {
    for (int64_t e = 0; e < d_.state_size(); ++e)
      S[e] = p_.h0.empty() ? 0.0 : p_.h0[state_offset() + e];
  }

 private:
  const Problem& p_;
  const PreparedQK& qk_;
  const Dims& d_;
  Sequence seq_;
  int64_t seq_index_, head_;
  std::vector<double> alpha_;  // decay of the current token per state row
  std::vector<double> u_;      // delta rule: v - S~^T k
};

// Forward of one (sequence, head): writes its o rows and its final state.
void forward_head(HeadRecurrence& rec, const Dims& d, Outputs& out) {
  std::vector<double> S(static_cast<std::size_t>(d.state_size()));
  rec.load_initial_state(S.data());
  for (int64_t i = 0; i < rec.length(); ++i) {
    rec.step(i, S.data());
    rec.output(i, S.data(), out.o.data() + rec.v_offset(i));
  }
  for (int64_t e = 0; e < d.state_size(); ++e) out.ht[rec.state_offset() + e] = S[e];
}

// Backward of one (sequence, head) in terms of q̂ and k̂ (the chain through
// scale and normalisation is applied afterwards, for all tokens at once).
// Re-runs the forward storing every state S_0..S_L, then walks back from
// dS = dht, per token i (S = S_i, P = S_{i-1}, S~ = Diag(alpha) P):
//   dS += q̂ do^T ;  dq̂ = S do
//   additive: dk̂ = dS v ; dv = dS^T k̂ ; dS~ = dS
//   delta:    u = v - S~^T k̂ ; e = beta u ; dk̂ = dS e ; de = dS^T k̂ ;
//             dbeta = de·u ; dv = beta de ; dû = -beta de ;
//             dS~ = dS + k̂ dû^T ; dk̂ += S~ dû
//   dalpha_r = sum_c dS~_rc P_rc ;  dS <- Diag(alpha) dS~
//   dg = dalpha ⊙ alpha (vector decay), sum_r dalpha_r * alpha (scalar decay).
void backward_head(HeadRecurrence& rec, const Problem& p, const PreparedQK& qk, const Dims& d,
                   const std::vector<double>& d_o, const std::vector<double>& dht, Grads& grads) {
  const int64_t dk = d.dk, dv = d.dv, L = rec.length(), state = d.state_size();
  std::vector<double> states(static_cast<std::size_t>((L + 1) * state));
  rec.load_initial_state(states.data());
  for (int64_t i = 0; i < L; ++i) {
    std::copy(states.begin() + i * state, states.begin() + (i + 1) * state,
              states.begin() + (i + 1) * state);
    rec.step(i, states.data() + (i + 1) * state);
  }

  std::vector<double> dS(static_cast<std::size_t>(state), 0.0);
  if (!dht.empty())
    for (int64_t e = 0; e < state; ++e) dS[e] = dht[rec.state_offset() + e];
  std::vector<double> S_tilde(static_cast<std::size_t>(state));
  std::vector<double> u(static_cast<std::size_t>(dv)), de(static_cast<std::size_t>(dv));
  std::vector<double> dalpha(static_cast<std::size_t>(dk));

  for (int64_t i = L - 1; i >= 0; --i) {
    const double* S = states.data() + (i + 1) * state;
    const double* P = states.data() + i * state;
    const double* q = qk.q.data() + rec.k_offset(i);
    const double* k = qk.k.data() + rec.k_offset(i);
    const double* v = p.v.data() + rec.v_offset(i);
    const double* g_o = d_o.data() + rec.v_offset(i);
    double* dq = grads.dq.data() + rec.k_offset(i);
    double* dkk = grads.dk.data() + rec.k_offset(i);
    double* dvv = grads.dv.data() + rec.v_offset(i);

    for (int64_t r = 0; r < dk; ++r)
      for (int64_t c = 0; c < dv; ++c) dS[r * dv + c] += q[r] * g_o[c];
    for (int64_t r = 0; r < dk; ++r) {
      double acc = 0;
      for (int64_t c = 0; c < dv; ++c) acc += S[r * dv + c] * g_o[c];
      dq[r] = acc;
    }

    const std::vector<double>& alpha = rec.load_alpha(i);
    for (int64_t r = 0; r < dk; ++r)
      for (int64_t c = 0; c < dv; ++c) S_tilde[r * dv + c] = alpha[r] * P[r * dv + c];

    if (d.rule == Rule::additive) {
      for (int64_t r = 0; r < dk; ++r) {
        double acc = 0;
        for (int64_t c = 0; c < dv; ++c) acc += dS[r * dv + c] * v[c];
        dkk[r] = acc;
      }
      for (int64_t c = 0; c < dv; ++c) dvv[c] = 0;
      for (int64_t r = 0; r < dk; ++r)
        for (int64_t c = 0; c < dv; ++c) dvv[c] += dS[r * dv + c] * k[r];
    } else {
      const double b = rec.beta(i);
      for (int64_t c = 0; c < dv; ++c) u[c] = v[c];
      for (int64_t r = 0; r < dk; ++r)
        for (int64_t c = 0; c < dv; ++c) u[c] -= S_tilde[r * dv + c] * k[r];
      for (int64_t r = 0; r < dk; ++r) {
        double acc = 0;
        for (int64_t c = 0; c < dv; ++c) acc += dS[r * dv + c] * b * u[c];
        dkk[r] = acc;
      }
      for (int64_t c = 0; c < dv; ++c) de[c] = 0;
      for (int64_t r = 0; r < dk; ++r)
        for (int64_t c = 0; c < dv; ++c) de[c] += dS[r * dv + c] * k[r];
      double dbeta = 0;
      for (int64_t c = 0; c < dv; ++c) dbeta += de[c] * u[c];
      grads.dbeta[rec.scalar_offset(i)] = dbeta;
      for (int64_t c = 0; c < dv; ++c) dvv[c] = b * de[c];
      // de now becomes dû = -beta de, the gradient of the subtracted S~^T k̂.
      for (int64_t c = 0; c < dv; ++c) de[c] *= -b;
      for (int64_t r = 0; r < dk; ++r)
        for (int64_t c = 0; c < dv; ++c) dS[r * dv + c] += k[r] * de[c];
      for (int64_t r = 0; r < dk; ++r) {
        double acc = 0;
        for (int64_t c = 0; c < dv; ++c) acc += S_tilde[r * dv + c] * de[c];
        dkk[r] += acc;
      }
    }

    // dS holds dS~ here.
    for (int64_t r = 0; r < dk; ++r) {
      double acc = 0;
      for (int64_t c = 0; c < dv; ++c) acc += dS[r * dv + c] * P[r * dv + c];
      dalpha[r] = acc;
    }
    if (d.decay == Decay::vector) {
      double* dg = grads.dg.data() + rec.k_offset(i);
      for (int64_t r = 0; r < dk; ++r) dg[r] = dalpha[r] * alpha[r];
    } else if (d.decay == Decay::scalar) {
      double acc = 0;
      for (int64_t r = 0; r < dk; ++r) acc += dalpha[r] * alpha[r];
      grads.dg[rec.scalar_offset(i)] = acc;
    }
    for (int64_t r = 0; r < dk; ++r)
      for (int64_t c = 0; c < dv; ++c) dS[r * dv + c] *= alpha[r];
  }
  for (int64_t e = 0; e < state; ++e) grads.dh0[rec.state_offset() + e] = dS[e];
}

// Runs body(recurrence) for every (sequence, head) pair, in parallel: pairs
// write disjoint parts of the outputs, so the result does not depend on the
// thread count.
template <typename Body>
void for_each_head(const Problem& p, const PreparedQK& qk, const Dims& d, Body&& body) {
  const std::vector<Sequence> seqs = sequences_of(p);
  const int64_t pairs = static_cast<int64_t>(seqs.size()) * d.heads;
  parallel_for(pairs, [&](int64_t item) {
    const int64_t n = item / d.heads, h = item % d.heads;
    HeadRecurrence rec(p, qk, d, seqs[static_cast<std::size_t>(n)], n, h);
    body(rec);
  });
}

}  // namespace

Outputs forward(const Problem& p) {
  validate(p);
  const Dims d = dims_of(p);
  const PreparedQK qk = prepare_qk(p);
  Outputs out;
  out.o.assign(static_cast<std::size_t>(d.batch * d.seq_len * d.heads * d.dv), 0.0);
  out.ht.assign(static_cast<std::size_t>(d.num_sequences * d.heads * d.state_size()), 0.0);
  for_each_head(p, qk, d, [&](HeadRecurrence& rec) { forward_head(rec, d, out); });
  return out;
}

Grads backward(const Problem& p, const std::vector<double>& d_o, const std::vector<double>& dht) {
  validate(p);
  const Dims d = dims_of(p);
  check_size(d_o, d.batch * d.seq_len * d.heads * d.dv, "do", "[B,T,H,Dv]");
  check_finite(d_o, "do");
  if (!dht.empty()) {
    check_size(dht, d.num_sequences * d.heads * d.state_size(), "dht", "[N,H,Dk,Dv]");
    check_finite(dht, "dht");
  }

  const PreparedQK qk = prepare_qk(p);
  Grads grads;
  grads.dq.assign(p.q.size(), 0.0);
  grads.dk.assign(p.k.size(), 0.0);
  grads.dv.assign(p.v.size(), 0.0);
  grads.dg.assign(p.g.size(), 0.0);
  grads.dbeta.assign(p.beta.size(), 0.0);
  grads.dh0.assign(static_cast<std::size_t>(d.num_sequences * d.heads * d.state_size()), 0.0);
  for_each_head(p, qk, d,
                [&](HeadRecurrence& rec) { backward_head(rec, p, qk, d, d_o, dht, grads); });

  normalise_rows_backward(p.q, qk.q_norm, d.dk, p.l2norm_qk, p.scale, grads.dq);
  normalise_rows_backward(p.k, qk.k_norm, d.dk, p.l2norm_qk, 1.0, grads.dk);
  return grads;
}

}  // namespace statescan::ref
