#include "parallel/lact_layer.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/collective_check.h"
#include "core/error.h"
#include "parallel/lact_layer_internal.h"

namespace statescan {
namespace lact_detail {

namespace {
// The layer's tensor shapes for its sizes and the check of one tensor
// against one of them in `where`'s dtype and memory.
struct LayerShapes : LactShapes {
  const Placement& where;
  LayerShapes(const LocalSizes& s, const Placement& w)
      : LactShapes(s.batch, s.local_len, s.heads, s.dim, s.hidden), where(w) {}
  void check(const TensorView& t, const Shape& shape, const char* name) const {
    check_tensor(t, shape, where.dtype, where.memory, name);
  }
};
}  // namespace

LocalSizes check_forward_shapes(const LactForwardArgs& a, const Placement& where) {
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
  const LayerShapes x(s, where);
  x.check(a.q, x.tokens, "q");
  x.check(a.k, x.tokens, "k");
  x.check(a.v, x.tokens, "v");
  x.check(a.lr0, x.rates, "lr0");
  x.check(a.lr1, x.rates, "lr1");
  x.check(a.lr2, x.rates, "lr2");
  x.check(a.w0, x.wide, "w0");
  x.check(a.w1, x.narrow, "w1");
  x.check(a.w2, x.wide, "w2");
  x.check(a.o, x.tokens, "o");
  return s;
}

void check_backward_shapes(const LactBackwardArgs& a, const LocalSizes& s, const Placement& where) {
  const LayerShapes x(s, where);
  x.check(a.d_o, x.tokens, "d_o");
  x.check(a.dq, x.tokens, "dq");
  x.check(a.dk, x.tokens, "dk");
  x.check(a.dv, x.tokens, "dv");
  x.check(a.dlr0, x.rates, "dlr0");
  x.check(a.dlr1, x.rates, "dlr1");
  x.check(a.dlr2, x.rates, "dlr2");
  x.check(a.dw0, x.wide, "dw0");
  x.check(a.dw1, x.narrow, "dw1");
  x.check(a.dw2, x.wide, "dw2");
}

void timed_all_reduce(Communicator& comm, float* data, std::size_t count,
                      LactExchangeStats& stats) {
  const auto start = std::chrono::steady_clock::now();
  comm.all_reduce_sum(data, count, CommType::f32);
  stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats.bytes += static_cast<double>(count * sizeof(float));
  ++stats.calls;
}

void agree_on_problem(Communicator& control, const LocalSizes& s, const LactConfig& config,
                      const Placement& where, const LactForwardArgs& a,
                      const std::function<int64_t(const TensorView&)>& hash) {
  int64_t weight_hashes[3] = {};
  collective_check(control, [&] {
    weight_hashes[0] = hash(a.w0);
    weight_hashes[1] = hash(a.w1);
    weight_hashes[2] = hash(a.w2);
  });
  // Every rank must hold the same problem: equal sizes, options (the momentum
  // compared bit for bit through its integer image), placement and initial
  // weights.
  struct Field {
    const char* argument;
    const char* what;
    int64_t value;
  };
  int64_t momentum_bits = 0;
  static_assert(sizeof(double) == sizeof(int64_t), "double is 64-bit");
  std::memcpy(&momentum_bits, &config.momentum, sizeof(double));
  const Field fields[] = {
      {"q", "batch size B", s.batch},
      {"q", "local length T/P", s.local_len},
      {"q", "heads H", s.heads},
      {"q", "head dim D", s.dim},
      {"w0", "hidden width M", s.hidden},
      {"q", "memory (0 host, 1 device)", where.memory == Memory::device ? 1 : 0},
      {"q", "dtype code", static_cast<int64_t>(where.dtype)},
      {"chunk", "chunk size", config.chunk},
      {"schedule", "schedule", static_cast<int64_t>(config.schedule)},
      {"muon_steps", "Newton-Schulz steps", config.muon_steps},
      {"renorm", "renorm flag", config.renorm ? 1 : 0},
      {"momentum", "momentum (bits)", momentum_bits},
      {"w0", "content hash of w0", weight_hashes[0]},
      {"w1", "content hash of w1", weight_hashes[1]},
      {"w2", "content hash of w2", weight_hashes[2]},
  };
  constexpr int kFields = static_cast<int>(sizeof(fields) / sizeof(fields[0]));
  int64_t mine[kFields];
  for (int f = 0; f < kFields; ++f) mine[f] = fields[f].value;
  const int P = control.size();
  std::vector<int64_t> all(static_cast<std::size_t>(kFields * P));
  control.all_gather(mine, all.data(), kFields, CommType::i64);
  collective_check(control, [&] {
    for (int r = 0; r < P; ++r)
      for (int f = 0; f < kFields; ++f)
        SS_CHECK_ARG(all[r * kFields + f] == mine[f], fields[f].argument, fields[f].what, " is ",
                     all[r * kFields + f], " on rank ", r, " but ", mine[f],
                     " here; every rank of the group must pass the same problem");
  });
}

}  // namespace lact_detail

namespace {

using lact_detail::LocalSizes;
using lact_detail::Placement;

const Placement kHostF32{Memory::host, DType::f32};

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

int64_t tensor_hash(const TensorView& t) {
  return content_hash(t.data, static_cast<std::size_t>(t.numel()) * sizeof(float));
}

bool on_device(const TensorView& t) {
  return t.defined() && t.memory == Memory::device;
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

// The host path's fast-weight all-reduce, counted into `stats`; none on one
// rank (nothing to exchange, nothing to report).
LactAllReduce<float> LactLayer::all_reduce(LactExchangeStats& stats) {
  if (comm_.size() == 1) return {};
  return [this, &stats](float* data, std::size_t n) {
    lact_detail::timed_all_reduce(comm_, data, n, stats);
  };
}

void LactLayer::forward(const LactForwardArgs& a) {
  tell_peers_on_failure({&comm_}, [&] { run_forward(a); });
}

void LactLayer::backward(const LactBackwardArgs& a) {
  tell_peers_on_failure({&comm_}, [&] { run_backward(a); });
}

void LactLayer::run_forward(const LactForwardArgs& a) {
  saved_.reset();
  device_.reset();
  if (on_device(a.q)) {
    forward_device(a);
    return;
  }
  // The same collectives as the GPU path, over the same communicator:
  // a peer on that path meets them, and the placement fails on both sides.
  Communicator& ctl = agreement_comm();
  LocalSizes s;
  collective_check(ctl, [&] { s = lact_detail::check_forward_shapes(a, kHostF32); });
  lact_detail::agree_on_problem(ctl, s, config_, kHostF32, a, tensor_hash);
  // Every rank agreed on host tensors and shares comm_'s kind: all throw alike.
  check_host_tensors_allowed(comm_, "q", "layer");

  const int P = comm_.size();
  LactParams<float> p = make_params(a, config_, s, P, comm_.rank());
  collective_check(comm_, [&] { lact_check_params(p); });

  auto saved = std::make_unique<Saved>();
  saved->params = p;
  forward_exchange_ = {};
  lact_forward<float>(p, all_reduce(forward_exchange_), &saved->checkpoints);
  saved_ = std::move(saved);
}

void LactLayer::run_backward(const LactBackwardArgs& a) {
  if (device_ != nullptr || on_device(a.d_o)) {
    backward_device(a);
    return;
  }
  collective_check(agreement_comm(), [&] {
    SS_CHECK_ARG(saved_ != nullptr, "forward", "backward needs a preceding forward on this layer");
    const LactParams<float>& p = saved_->params;
    const LocalSizes s{p.batch, p.local_len(), p.heads, p.dim, p.hidden};
    lact_detail::check_backward_shapes(a, s, kHostF32);
    check_finite(a.d_o, "d_o");
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
  backward_exchange_ = {};
  lact_backward<float>(saved_->params, g, saved_->checkpoints, all_reduce(backward_exchange_));
}

#ifndef STATESCAN_HAS_CUDA
// Without CUDA there is no GPU path: device tensors are refused (collectively).
struct LactLayer::DeviceState {};
void LactLayer::DeviceStateDeleter::operator()(DeviceState* state) const {
  delete state;
}
void LactLayer::forward_device(const LactForwardArgs&) {
  collective_check(comm_, [] {
    SS_FAIL("q", "device tensors need a CUDA build of statescan (this one has no GPU path)");
  });
}
void LactLayer::backward_device(const LactBackwardArgs&) {
  collective_check(comm_, [] {
    SS_FAIL("d_o", "device tensors need a CUDA build of statescan (this one has no GPU path)");
  });
}
#endif

Communicator& LactLayer::agreement_comm() {
  return host_collectives(comm_, staged_control_);
}

}  // namespace statescan
