#include "parallel/lact_layer.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/collective_check.h"
#include "core/error.h"

namespace statescan {
namespace {

void check_host_f32(const TensorView& t, const Shape& shape, const char* name) {
  check_tensor(t, shape, DType::f32, Memory::host, name);
}

// This rank's sizes; checked against every other rank's.
struct LocalSizes {
  int64_t batch = 0, local_len = 0, heads = 0, dim = 0, hidden = 0;
};

// Shapes, dtypes and placement of the forward arguments (no data reads).
LocalSizes check_forward_shapes(const LactForwardArgs& a) {
  SS_CHECK_ARG(a.q.defined() && a.q.shape.size() == 4, "q", "must be [B, T_local, H, D], got ",
               shape_string(a.q.shape));
  SS_CHECK_ARG(a.w0.defined() && a.w0.shape.size() == 3, "w0", "must be [H, M, D], got ",
               shape_string(a.w0.shape));
  LocalSizes s;
  s.batch = a.q.size(0);
  s.local_len = a.q.size(1);
  s.heads = a.q.size(2);
  s.dim = a.q.size(3);
  s.hidden = a.w0.size(1);
  SS_CHECK_ARG(s.batch >= 1 && s.local_len >= 1 && s.heads >= 1 && s.dim >= 1, "q",
               "every extent must be >= 1, got ", shape_string(a.q.shape));
  SS_CHECK_ARG(s.hidden >= 1, "w0", "hidden width M must be >= 1, got ", shape_string(a.w0.shape));
  const Shape tokens{s.batch, s.local_len, s.heads, s.dim};
  const Shape rates{s.batch, s.local_len, s.heads};
  const Shape wide{s.heads, s.hidden, s.dim}, narrow{s.heads, s.dim, s.hidden};
  check_host_f32(a.q, tokens, "q");
  check_host_f32(a.k, tokens, "k");
  check_host_f32(a.v, tokens, "v");
  check_host_f32(a.lr0, rates, "lr0");
  check_host_f32(a.lr1, rates, "lr1");
  check_host_f32(a.lr2, rates, "lr2");
  check_host_f32(a.w0, wide, "w0");
  check_host_f32(a.w1, narrow, "w1");
  check_host_f32(a.w2, wide, "w2");
  check_host_f32(a.o, tokens, "o");
  return s;
}

LactParams<float> make_params(const LactForwardArgs& a, const LactConfig& cfg, const LocalSizes& s,
                              int ranks, int rank) {
  LactParams<float> p;
  p.config = cfg;
  p.batch = s.batch;
  p.seq_len = s.local_len * ranks;
  p.heads = s.heads;
  p.dim = s.dim;
  p.hidden = s.hidden;
  p.ranks = ranks;
  p.rank = rank;
  p.q = a.q.as<const float>();
  p.k = a.k.as<const float>();
  p.v = a.v.as<const float>();
  p.lr0 = a.lr0.as<const float>();
  p.lr1 = a.lr1.as<const float>();
  p.lr2 = a.lr2.as<const float>();
  p.w0 = a.w0.as<const float>();
  p.w1 = a.w1.as<const float>();
  p.w2 = a.w2.as<const float>();
  p.o = a.o.as<float>();
  return p;
}

// FNV-1a hash of a tensor's bytes: lets the ranks confirm, with one small
// all-gather, that they start from the same initial weights.
int64_t content_hash(const TensorView& t) {
  const auto* bytes = static_cast<const unsigned char*>(t.data);
  uint64_t h = 1469598103934665603ull;
  for (int64_t i = 0; i < t.numel() * static_cast<int64_t>(sizeof(float)); ++i) {
    h ^= bytes[i];
    h *= 1099511628211ull;
  }
  int64_t out = 0;
  std::memcpy(&out, &h, sizeof(out));
  return out;
}

}  // namespace

struct LactLayer::Saved {
  LactParams<float> params;  // pointers into the caller's inputs
  LactCheckpoints<float> checkpoints;
};

LactLayer::LactLayer(Communicator& comm, LactConfig config) : comm_(comm), config_(config) {
  check_lact_config(config_);
}

LactLayer::~LactLayer() = default;

void LactLayer::forward(const LactForwardArgs& a) {
  saved_.reset();
  LocalSizes s;
  collective_check(comm_, [&] { s = check_forward_shapes(a); });

  // Every rank must hold the same problem: equal sizes, options (the momentum
  // compared bit for bit through its integer image) and initial weights.
  struct Field {
    const char* argument;
    const char* what;
    int64_t value;
  };
  int64_t momentum_bits = 0;
  static_assert(sizeof(double) == sizeof(int64_t), "double is 64-bit");
  std::memcpy(&momentum_bits, &config_.momentum, sizeof(double));
  const Field fields[] = {
      {"q", "batch size B", s.batch},
      {"q", "local length T/P", s.local_len},
      {"q", "heads H", s.heads},
      {"q", "head dim D", s.dim},
      {"w0", "hidden width M", s.hidden},
      {"chunk", "chunk size", config_.chunk},
      {"schedule", "schedule", static_cast<int64_t>(config_.schedule)},
      {"muon_steps", "Newton-Schulz steps", config_.muon_steps},
      {"renorm", "renorm flag", config_.renorm ? 1 : 0},
      {"momentum", "momentum (bits)", momentum_bits},
      {"w0", "content hash of w0", content_hash(a.w0)},
      {"w1", "content hash of w1", content_hash(a.w1)},
      {"w2", "content hash of w2", content_hash(a.w2)},
  };
  constexpr int kFields = static_cast<int>(sizeof(fields) / sizeof(fields[0]));
  int64_t mine[kFields];
  for (int f = 0; f < kFields; ++f) mine[f] = fields[f].value;
  const int P = comm_.size();
  std::vector<int64_t> all(static_cast<std::size_t>(kFields * P));
  comm_.all_gather(mine, all.data(), kFields, CommType::i64);

  LactParams<float> p = make_params(a, config_, s, P, comm_.rank());
  collective_check(comm_, [&] {
    for (int r = 0; r < P; ++r)
      for (int f = 0; f < kFields; ++f)
        SS_CHECK_ARG(all[r * kFields + f] == mine[f], fields[f].argument, fields[f].what, " is ",
                     all[r * kFields + f], " on rank ", r, " but ", mine[f],
                     " here; every rank of the group must pass the same problem");
    lact_check_params(p);
  });

  auto saved = std::make_unique<Saved>();
  saved->params = p;
  lact_forward<float>(
      p, [this](float* data, std::size_t n) { comm_.all_reduce_sum(data, n, CommType::f32); },
      &saved->checkpoints);
  saved_ = std::move(saved);
}

void LactLayer::backward(const LactBackwardArgs& a) {
  collective_check(comm_, [&] {
    SS_CHECK_ARG(saved_ != nullptr, "forward", "backward needs a preceding forward on this layer");
    const LactParams<float>& p = saved_->params;
    const Shape tokens{p.batch, p.local_len(), p.heads, p.dim};
    const Shape rates{p.batch, p.local_len(), p.heads};
    const Shape wide{p.heads, p.hidden, p.dim}, narrow{p.heads, p.dim, p.hidden};
    check_host_f32(a.d_o, tokens, "d_o");
    check_finite(a.d_o.as<const float>(), a.d_o.numel(), "d_o");
    check_host_f32(a.dq, tokens, "dq");
    check_host_f32(a.dk, tokens, "dk");
    check_host_f32(a.dv, tokens, "dv");
    check_host_f32(a.dlr0, rates, "dlr0");
    check_host_f32(a.dlr1, rates, "dlr1");
    check_host_f32(a.dlr2, rates, "dlr2");
    check_host_f32(a.dw0, wide, "dw0");
    check_host_f32(a.dw1, narrow, "dw1");
    check_host_f32(a.dw2, wide, "dw2");
  });
  LactGradParams<float> g;
  g.d_o = a.d_o.as<const float>();
  g.dq = a.dq.as<float>();
  g.dk = a.dk.as<float>();
  g.dv = a.dv.as<float>();
  g.dlr0 = a.dlr0.as<float>();
  g.dlr1 = a.dlr1.as<float>();
  g.dlr2 = a.dlr2.as<float>();
  g.dw0 = a.dw0.as<float>();
  g.dw1 = a.dw1.as<float>();
  g.dw2 = a.dw2.as<float>();
  lact_backward<float>(saved_->params, g, saved_->checkpoints, [this](float* data, std::size_t n) {
    comm_.all_reduce_sum(data, n, CommType::f32);
  });
}

}  // namespace statescan
