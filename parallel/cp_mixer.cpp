#include "parallel/cp_mixer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "comm/collective_check.h"
#include "core/error.h"
#include "kernels/cpu/cpu_mixer.h"
#include "kernels/mixer_params.h"
#include "parallel/cp_mixer_internal.h"
#include "parallel/exchange.h"
#ifdef STATESCAN_HAS_NCCL
#include "parallel/exchange_cuda.h"
#endif

namespace statescan {

using cp_detail::Geometry;
using cp_detail::LocalSegment;
using cp_detail::TensorRules;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void check_input(const TensorView& t, const Shape& shape, bool values, const char* name) {
  check_tensor(t, shape, DType::f32, Memory::host, name);
  if (values) check_finite(t, name);
}

void check_output(const TensorView& t, const Shape& shape, const char* name) {
  check_tensor(t, shape, DType::f32, Memory::host, name);
}

// The same checks under `rules` (dtype: the element type this tensor must have).
void check_input(const TensorView& t, const Shape& shape, DType dtype, const TensorRules& rules,
                 const char* name) {
  check_tensor(t, shape, dtype, rules.memory, name);
  if (rules.check_values) check_finite(t, name);
}

void check_output(const TensorView& t, const Shape& shape, DType dtype, const TensorRules& rules,
                  const char* name) {
  check_tensor(t, shape, dtype, rules.memory, name);
}

}  // namespace

namespace cp_detail {

// The local checks of forward: shapes, dtypes, finiteness. Returns the local
// geometry (global fields are filled in later).
Geometry check_forward_local(const CpForwardArgs& a, const MixerConfig& cfg,
                             const TensorRules& rules) {
  const DType x = rules.dtype;
  check_chunk(cfg.chunk);
  SS_CHECK_ARG(a.q.defined() && a.q.shape.size() == 4, "q", "must be [B, T_local, H, Dk], got ",
               shape_string(a.q.shape));
  SS_CHECK_ARG(a.v.defined() && a.v.shape.size() == 4, "v", "must be [B, T_local, H, Dv], got ",
               shape_string(a.v.shape));
  Geometry g;
  g.batch = a.q.size(0);
  g.local_len = a.q.size(1);
  g.heads = a.q.size(2);
  g.dk = a.q.size(3);
  g.dv = a.v.size(3);
  SS_CHECK_ARG(g.local_len >= 1, "q", "this rank's shard is empty (every rank needs >= 1 token)");
  SS_CHECK_ARG(g.dk >= 1 && g.dk <= 256, "q", "head dim Dk ", g.dk, " not in [1, 256]");
  SS_CHECK_ARG(g.dv >= 1 && g.dv <= 256, "v", "head dim Dv ", g.dv, " not in [1, 256]");
  const Shape qk{g.batch, g.local_len, g.heads, g.dk};
  const Shape vo{g.batch, g.local_len, g.heads, g.dv};
  const Shape bth{g.batch, g.local_len, g.heads};
  check_input(a.q, qk, x, rules, "q");
  check_input(a.k, qk, x, rules, "k");
  check_input(a.v, vo, x, rules, "v");
  if (has_gate(cfg.variant)) {
    check_input(a.g, vector_gate(cfg.variant) ? qk : bth, DType::f32, rules, "g");
    // The local kernel refuses a positive gate too, but on its rank alone:
    // here, inside the collective check, every rank learns of it.
    if (a.g.memory == Memory::host) check_log_gates(a.g, "g");
  } else {
    SS_CHECK_ARG(!a.g.defined(), "g", "must be undefined for variant ", to_string(cfg.variant));
  }
  if (has_beta(cfg.variant)) {
    check_input(a.beta, bth, x, rules, "beta");
  } else {
    SS_CHECK_ARG(!a.beta.defined(), "beta", "must be undefined for variant ",
                 to_string(cfg.variant));
  }
  check_output(a.o, vo, x, rules, "o");
  g.sequences = g.batch;
  if (a.cu_seqlens.defined()) {
    SS_CHECK_ARG(g.batch == 1, "cu_seqlens", "packed sequences need batch 1, got ", g.batch);
    SS_CHECK_ARG(a.cu_seqlens.shape.size() == 1 && a.cu_seqlens.size(0) >= 2, "cu_seqlens",
                 "must be a 1-D int64 array of >= 2 offsets, got shape ",
                 shape_string(a.cu_seqlens.shape));
    check_dtype(a.cu_seqlens, DType::i64, "cu_seqlens");
    check_memory(a.cu_seqlens, Memory::host, "cu_seqlens");
    check_contiguous(a.cu_seqlens, "cu_seqlens");
    const auto* cu = a.cu_seqlens.as<const int64_t>();
    g.sequences = a.cu_seqlens.size(0) - 1;
    SS_CHECK_ARG(cu[0] == 0, "cu_seqlens", "must start at 0, got ", cu[0]);
    for (int64_t n = 0; n < g.sequences; ++n)
      SS_CHECK_ARG(cu[n + 1] > cu[n], "cu_seqlens", "must be strictly increasing (offsets ", n,
                   ", ", n + 1, " are ", cu[n], ", ", cu[n + 1], ")");
  }
  const Shape states{g.sequences, g.heads, g.dk, g.dv};
  if (a.initial_state.defined())
    check_input(a.initial_state, states, DType::f32, rules, "initial_state");
  if (a.final_state.defined())
    check_output(a.final_state, states, DType::f32, rules, "final_state");
  return g;
}

std::vector<int64_t> agree_fields(Communicator& comm, const char* const* names, const int64_t* mine,
                                  int64_t n, int64_t checked) {
  std::vector<int64_t> all(static_cast<std::size_t>(n * comm.size()));
  comm.all_gather(mine, all.data(), static_cast<std::size_t>(n), CommType::i64);
  collective_check(comm, [&] {
    for (int r = 0; r < comm.size(); ++r)
      for (int64_t f = 0; f < checked; ++f)
        SS_CHECK_ARG(all[r * n + f] == mine[f], names[f], "rank ", r, " has ", all[r * n + f],
                     " where this rank has ", mine[f],
                     " (every rank of the group must pass the same problem)");
  });
  return all;
}

// Agrees the geometry across ranks: same B, H, Dk, Dv, N, options, exchange,
// cu_seqlens and the same optional outputs everywhere; shard lengths summing
// to the packed length. Fills the global fields.
void agree_geometry(Communicator& comm, const CpForwardArgs& a, const MixerConfig& cfg,
                    Exchange exchange, bool on_device, Geometry& g) {
  // The offsets by content (a weighted sum let different arrays agree).
  int64_t cu_hash = 0, cu_last = -1;
  if (a.cu_seqlens.defined()) {
    cu_hash = content_hash(a.cu_seqlens.data,
                           static_cast<std::size_t>(g.sequences + 1) * sizeof(int64_t));
    cu_last = a.cu_seqlens.as<const int64_t>()[g.sequences];
  }
  int64_t scale_bits = 0;
  static_assert(sizeof(cfg.scale) == sizeof(scale_bits), "the scale as 64 bits");
  std::memcpy(&scale_bits, &cfg.scale, sizeof(scale_bits));
  // Every field but the last (this rank's shard length) must agree. Where
  // one rank asks for final_state and another does not, the all-reduce that
  // fills it would run on some ranks only; a different exchange posts
  // messages the others never match.
  static const char* const kNames[] = {
      "batch",    "heads",         "dk",         "dv",     "cu_seqlens",   "variant",
      "chunk",    "initial_state", "cu_seqlens", "memory", "check_finite", "final_state",
      "exchange", "l2norm_qk",     "scale",      "dtype",  "local_len"};
  const int64_t mine[] = {g.batch,
                          g.heads,
                          g.dk,
                          g.dv,
                          g.sequences,
                          static_cast<int64_t>(cfg.variant),
                          cfg.chunk,
                          a.initial_state.defined() ? 1 : 0,
                          cu_hash,
                          on_device ? 1 : 0,
                          cfg.check_finite ? 1 : 0,
                          a.final_state.defined() ? 1 : 0,
                          static_cast<int64_t>(exchange),
                          cfg.l2norm_qk ? 1 : 0,
                          scale_bits,
                          static_cast<int64_t>(a.q.dtype),
                          g.local_len};
  constexpr int64_t kFields = sizeof(mine) / sizeof(mine[0]);
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == kFields, "a name per field");
  const std::vector<int64_t> all = agree_fields(comm, kNames, mine, kFields, kFields - 1);
  collective_check(comm, [&] {
    g.global_len = 0;
    g.shard_begin = 0;
    for (int r = 0; r < comm.size(); ++r) {
      if (r < comm.rank()) g.shard_begin += all[r * kFields + kFields - 1];
      g.global_len += all[r * kFields + kFields - 1];
    }
    if (a.cu_seqlens.defined())
      SS_CHECK_ARG(cu_last == g.global_len, "cu_seqlens", "last offset ", cu_last,
                   " disagrees with the shard lengths, which sum to ", g.global_len);
  });
}

void agree_backward_outputs(Communicator& comm, const CpBackwardArgs& a) {
  static const char* const kNames[] = {"d_initial_state"};
  const int64_t mine[] = {a.d_initial_state.defined() ? 1 : 0};
  agree_fields(comm, kNames, mine, 1, 1);
}

std::vector<LocalSegment> local_segments(const CpForwardArgs& a, const Geometry& g) {
  std::vector<LocalSegment> segs;
  const int64_t lo = g.shard_begin, hi = g.shard_begin + g.local_len;
  if (!a.cu_seqlens.defined()) {
    for (int64_t b = 0; b < g.batch; ++b)
      segs.push_back({b, b, 0, g.local_len, lo > 0, hi < g.global_len});
    return segs;
  }
  const auto* cu = a.cu_seqlens.as<const int64_t>();
  for (int64_t n = 0; n < g.sequences; ++n) {
    const int64_t b = std::max(cu[n], lo), e = std::min(cu[n + 1], hi);
    if (b >= e) continue;
    segs.push_back({n, 0, b - lo, e - lo, cu[n]<lo, cu[n + 1]> hi});
  }
  return segs;
}

MixerParams local_mixer_params(const MixerConfig& cfg, const Geometry& g) {
  MixerParams p;
  p.variant = cfg.variant;
  p.batch = g.batch;
  p.seq_len = g.local_len;
  p.heads = g.heads;
  p.dk = g.dk;
  p.dv = g.dv;
  p.chunk = cfg.chunk;
  p.scale = static_cast<float>(cfg.scale_for(g.dk));
  p.l2norm_qk = cfg.l2norm_qk;
  return p;
}

bool single_continuing(const std::vector<LocalSegment>& segs, int64_t row) {
  int64_t count = 0;
  bool from_prev = false;
  for (const auto& s : segs)
    if (s.row == row) {
      ++count;
      from_prev = s.from_prev;
    }
  return count == 1 && from_prev;
}

}  // namespace cp_detail

struct CpMixer::Saved {
  Geometry geo;
  std::vector<LocalSegment> segs;
  std::vector<int64_t> local_cu;    // local segment offsets (packed case)
  MixerParams params;               // local problem; pointers into the user's inputs
  std::vector<float> chunk_states;  // [chunks, H, Dk, Dv], unless recomputed
  std::vector<float> init;          // [nseg, H, Dk, Dv] incoming states, when recomputed
  ScanMaps maps;                    // this rank's (M, E); M reused (transposed) in backward
  Exchange exchange = Exchange::ring;
};

CpMixer::CpMixer(Communicator& comm, MixerConfig config, Exchange exchange, CpObserver* observer)
    : comm_(comm), config_(config), exchange_(exchange), observer_(observer) {
  check_chunk(config_.chunk);
  SS_CHECK_ARG(!(config_.keep_prepared && config_.recompute_chunk_states), "keep_prepared",
               "needs the chunk states saved by forward; it cannot be combined with "
               "recompute_chunk_states");
  SS_CHECK_ARG(std::isfinite(config_.scale) && config_.scale != 0, "scale",
               "must be finite and > 0 (or < 0 for Dk^-1/2), got ", config_.scale);
}

CpMixer::~CpMixer() = default;

void CpMixer::set_control(Communicator* control) {
  if (control != nullptr)
    SS_CHECK_ARG(control->size() == comm_.size() && control->rank() == comm_.rank(), "control",
                 "is rank ", control->rank(), " of ", control->size(), " where the mixer's ",
                 "communicator is rank ", comm_.rank(), " of ", comm_.size(),
                 " (it must span the same ranks in the same order)");
  control_ = control;
}

void CpMixer::report_to_observer(const CpStepStats& s, Phase total) const {
  if (observer_ == nullptr) return;
  observer_->on_phase(Phase::summary, s.summary_s, 0);
  observer_->on_exchange(s.exchange, s.exchange_s, s.exchange_bytes);
  observer_->on_phase(Phase::merge, s.merge_s, 0);
  observer_->on_phase(total, s.total_s, 0);
}

void CpMixer::measure_link_now() {
  if (exchange_ != Exchange::automatic || comm_.size() == 1 || auto_link_) return;
#ifdef STATESCAN_HAS_NCCL
  // As the GPU path's first forward measures it (parallel/cp_mixer_cuda.cpp).
  if (is_nccl(comm_)) {
    auto_link_ = measure_link_device(comm_, link_preset(LinkPreset::nvlink));
    return;
  }
#endif
  auto_link_ = measure_link(comm_);
}

Exchange CpMixer::resolve(int64_t map_bytes, int64_t state_bytes, int64_t apply_flops) {
  if (exchange_ != Exchange::automatic) return exchange_;
  // The first forward's probe, unless the caller measured before (one rank:
  // no link, nothing measured).
  measure_link_now();
  return resolve_exchange(exchange_, comm_.size(), map_bytes, state_bytes, apply_flops,
                          auto_link_ ? *auto_link_ : LinkModel{});
}

namespace {

bool on_device(const TensorView& t) {
  return t.defined() && t.memory == Memory::device;
}

bool any_on_device(const CpForwardArgs& a) {
  for (const TensorView* t :
       {&a.q, &a.k, &a.v, &a.g, &a.beta, &a.cu_seqlens, &a.initial_state, &a.o, &a.final_state})
    if (on_device(*t)) return true;
  return false;
}

bool any_on_device(const CpBackwardArgs& a) {
  for (const TensorView* t :
       {&a.d_o, &a.d_final_state, &a.dq, &a.dk, &a.dv, &a.dg, &a.dbeta, &a.d_initial_state})
    if (on_device(*t)) return true;
  return false;
}

}  // namespace

#ifndef STATESCAN_HAS_CUDA
// Without CUDA there is no GPU path: device tensors are refused (collectively,
// so that every rank throws the same error).
struct CpMixer::DeviceState {};
void CpMixer::DeviceStateDeleter::operator()(DeviceState* state) const {
  delete state;
}
void CpMixer::forward_device(const CpForwardArgs&) {
  collective_check(agreement_comm(),
                   [] { SS_FAIL("q", "device tensors need a CUDA build of statescan"); });
}
void CpMixer::backward_device(const CpBackwardArgs&) {
  collective_check(agreement_comm(),
                   [] { SS_FAIL("do", "device tensors need a CUDA build of statescan"); });
}
#endif

Communicator& CpMixer::agreement_comm() {
  return control_ != nullptr ? *control_ : host_collectives(comm_, staged_control_);
}

void CpMixer::forward(const CpForwardArgs& a) {
  tell_peers_on_failure({&comm_, control_}, [&] { run_forward(a); });
}

void CpMixer::backward(const CpBackwardArgs& a) {
  tell_peers_on_failure({&comm_, control_}, [&] { run_backward(a); });
}

void CpMixer::run_forward(const CpForwardArgs& a) {
  if (any_on_device(a)) {
    saved_.reset();
    forward_device(a);
    return;
  }
  saved_on_device_ = false;
  // A forward that fails leaves nothing for backward (not the previous
  // step's state, which points into that step's inputs).
  saved_.reset();
  const auto t_start = Clock::now();
  fwd_stats_ = CpStepStats{};
  auto saved = std::make_unique<Saved>();
  Geometry& g = saved->geo;
  TensorRules rules;
  rules.check_values = config_.check_finite;
  // Over the GPU path's agreement communicator: a peer on that path meets
  // these two collectives there, and the placement ("memory") fails on both.
  Communicator& ctl = agreement_comm();
  collective_check(ctl, [&] { g = cp_detail::check_forward_local(a, config_, rules); });
  cp_detail::agree_geometry(ctl, a, config_, exchange_, /*on_device=*/false, g);
  // Every rank agreed on host tensors and shares comm_'s kind: all throw alike.
  check_host_tensors_allowed(comm_, "q", "mixer");

  const int P = comm_.size();
  const int64_t H = g.heads, Dk = g.dk, Dv = g.dv, state = Dk * Dv;
  saved->segs = cp_detail::local_segments(a, g);
  const auto& segs = saved->segs;
  const int64_t nseg = static_cast<int64_t>(segs.size());

  MixerParams& p = saved->params;
  p = cp_detail::local_mixer_params(config_, g);
  p.dtype = DType::f32;
  if (a.cu_seqlens.defined()) {
    saved->local_cu.push_back(0);
    for (const auto& s : segs) saved->local_cu.push_back(s.end);
    p.cu_seqlens = saved->local_cu.data();
  }
  p.num_segments = nseg;
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.g = has_gate(config_.variant) ? a.g.as<const float>() : nullptr;
  p.beta = has_beta(config_.variant) ? a.beta.data : nullptr;
  p.o = a.o.data;
  collective_check(comm_, [&] { validate(p); });

  // Initial state of every local segment: the user's h0 where a sequence
  // starts here, the incoming boundary state (filled after the scan) where it
  // continues from the previous rank.
  const float* h0 = a.initial_state.defined() ? a.initial_state.as<const float>() : nullptr;
  std::vector<float> init(static_cast<std::size_t>(nseg * H * state), 0.f);
  for (int64_t i = 0; i < nseg; ++i)
    if (!segs[i].from_prev && h0 != nullptr)
      std::copy_n(h0 + segs[i].seq * H * state, H * state, init.data() + i * H * state);
  p.initial_state = init.data();

  const int64_t rows = a.cu_seqlens.defined() ? 1 : g.batch;
  // Resolved below where P > 1; one rank exchanges nothing, and reports an
  // automatic choice as ring and any other as configured, as the GPU path does.
  saved->exchange = exchange_ == Exchange::automatic ? Exchange::ring : exchange_;
  if (P > 1) {
    // 1. summary of the shard: S_out = M S_in + E for the segment that leaves it.
    auto t0 = Clock::now();
    ScanMaps& maps = saved->maps;
    maps.rows = rows;
    maps.heads = H;
    maps.dk = Dk;
    maps.dv = Dv;
    maps.diagonal = !has_beta(config_.variant);
    maps.M.assign(static_cast<std::size_t>(rows * H * maps.m_size()), 0.f);
    maps.E.assign(static_cast<std::size_t>(rows * H * state), 0.f);
    cpu::mixer_summary(p, maps.M.data(), maps.E.data());
    // A shard in which a sequence begins passes on a carry that no longer
    // depends on its incoming state: M = 0 (DESIGN §5).
    for (int64_t r = 0; r < rows; ++r) {
      if (!cp_detail::single_continuing(segs, r))
        std::fill_n(maps.M.begin() + r * H * maps.m_size(), H * maps.m_size(), 0.f);
    }
    fwd_stats_.summary_s = seconds_since(t0);

    // 2. exchange: exclusive scan across ranks gives the true incoming state.
    t0 = Clock::now();
    const int64_t map_bytes = static_cast<int64_t>((maps.M.size() + maps.E.size()) * 4);
    const int64_t apply_flops = 2 * rows * H * (maps.diagonal ? Dk : Dk * Dk) * Dv;
    saved->exchange = resolve(map_bytes, static_cast<int64_t>(maps.E.size() * 4), apply_flops);
    ScanResult scan = exclusive_scan(comm_, saved->exchange, maps, ScanOrder::forward);
    fwd_stats_.exchange_s = seconds_since(t0);
    fwd_stats_.exchange_bytes = scan.bytes_sent;

    // 3. merge: the incoming state enters the segment that continues.
    t0 = Clock::now();
    for (int64_t i = 0; i < nseg; ++i)
      if (segs[i].from_prev)
        std::copy_n(scan.incoming.data() + segs[i].row * H * state, H * state,
                    init.data() + i * H * state);
    fwd_stats_.merge_s = seconds_since(t0);
  }
  fwd_stats_.exchange = saved->exchange;

  // 4. local chunkwise forward from the true incoming states.
  auto t0 = Clock::now();
  if (!config_.recompute_chunk_states) {
    saved->chunk_states.assign(static_cast<std::size_t>(count_chunks(p) * H * state), 0.f);
    p.chunk_states = saved->chunk_states.data();
  }
  std::vector<float> finals(static_cast<std::size_t>(nseg * H * state));
  p.final_state = finals.data();
  cpu::mixer_forward(p);
  fwd_stats_.local_s = seconds_since(t0);

  // The final state of each sequence leaves the rank on which it ends.
  t0 = Clock::now();
  if (a.final_state.defined()) {
    auto* ht = a.final_state.as<float>();
    std::fill_n(ht, g.sequences * H * state, 0.f);
    for (int64_t i = 0; i < nseg; ++i)
      if (!segs[i].to_next)
        std::copy_n(finals.data() + i * H * state, H * state, ht + segs[i].seq * H * state);
    if (P > 1)
      comm_.all_reduce_sum(ht, static_cast<std::size_t>(g.sequences * H * state), CommType::f32);
  }
  fwd_stats_.merge_s += seconds_since(t0);
  if (config_.recompute_chunk_states) {
    // Backward re-runs the local scan from the same incoming states.
    saved->init = std::move(init);
    p.initial_state = saved->init.data();
  } else {
    p.initial_state = nullptr;  // `init` dies here; backward reads chunk_states
  }
  p.final_state = nullptr;
  p.o = nullptr;
  saved_ = std::move(saved);
  fwd_stats_.total_s = seconds_since(t_start);
  report_to_observer(fwd_stats_, Phase::fwd);
}

void CpMixer::run_backward(const CpBackwardArgs& a) {
  if (saved_on_device_ || any_on_device(a)) {
    backward_device(a);
    return;
  }
  const auto t_start = Clock::now();
  bwd_stats_ = CpStepStats{};
  Communicator& ctl = agreement_comm();  // as in forward: peers on the GPU path meet these
  collective_check(ctl, [&] {
    SS_CHECK_ARG(saved_ != nullptr, "backward", "called without a preceding forward");
  });
  const Saved& sv = *saved_;
  const Geometry& g = sv.geo;
  const int P = comm_.size();
  const int64_t H = g.heads, Dk = g.dk, Dv = g.dv, state = Dk * Dv;
  const int64_t nseg = static_cast<int64_t>(sv.segs.size());
  const Shape qk{g.batch, g.local_len, H, Dk}, vo{g.batch, g.local_len, H, Dv};
  const Shape bth{g.batch, g.local_len, H}, states{g.sequences, H, Dk, Dv};
  collective_check(ctl, [&] {
    check_input(a.d_o, vo, config_.check_finite, "do");
    if (a.d_final_state.defined())
      check_input(a.d_final_state, states, config_.check_finite, "d_final_state");
    check_output(a.dq, qk, "dq");
    check_output(a.dk, qk, "dk");
    check_output(a.dv, vo, "dv");
    if (sv.params.g != nullptr) {
      check_output(a.dg, vector_gate(config_.variant) ? qk : bth, "dg");
    } else {
      SS_CHECK_ARG(!a.dg.defined(), "dg", "must be undefined for variant ",
                   to_string(config_.variant));
    }
    if (sv.params.beta != nullptr) {
      check_output(a.dbeta, bth, "dbeta");
    } else {
      SS_CHECK_ARG(!a.dbeta.defined(), "dbeta", "must be undefined for variant ",
                   to_string(config_.variant));
    }
    if (a.d_initial_state.defined()) check_output(a.d_initial_state, states, "d_initial_state");
  });
  cp_detail::agree_backward_outputs(ctl, a);

  MixerBwdParams bp;
  static_cast<MixerParams&>(bp) = sv.params;
  bp.chunk_states =
      config_.recompute_chunk_states ? nullptr : const_cast<float*>(sv.chunk_states.data());
  bp.recompute_chunk_states = config_.recompute_chunk_states;
  bp.d_o = a.d_o.data;
  // Gradient entering each local segment's final state: the user's dht where
  // the sequence ends here, the next rank's dS_in where it continues (filled
  // after the reverse scan; zero in the pre-pass).
  const float* dht = a.d_final_state.defined() ? a.d_final_state.as<const float>() : nullptr;
  std::vector<float> dfinal(static_cast<std::size_t>(nseg * H * state), 0.f);
  for (int64_t i = 0; i < nseg; ++i)
    if (!sv.segs[i].to_next && dht != nullptr)
      std::copy_n(dht + sv.segs[i].seq * H * state, H * state, dfinal.data() + i * H * state);
  bp.d_final_state = dfinal.data();
  std::vector<float> dinit(static_cast<std::size_t>(nseg * H * state), 0.f);
  bp.d_initial_state = dinit.data();

  if (P > 1) {
    // 1. pre-pass: D_r = dS_in with zero gradient from the next rank.
    auto t0 = Clock::now();
    bp.state_grad_only = true;
    cpu::mixer_backward(bp);
    bp.state_grad_only = false;
    ScanMaps back = sv.maps;  // (M^T, D) in reverse rank order
    std::fill(back.E.begin(), back.E.end(), 0.f);
    for (int64_t i = 0; i < nseg; ++i)
      if (sv.segs[i].from_prev)
        std::copy_n(dinit.data() + i * H * state, H * state,
                    back.E.begin() + sv.segs[i].row * H * state);
    if (!back.diagonal) {
      for (int64_t m = 0; m < back.maps(); ++m) {
        float* M = back.M.data() + m * Dk * Dk;
        for (int64_t i = 0; i < Dk; ++i)
          for (int64_t j = i + 1; j < Dk; ++j) std::swap(M[i * Dk + j], M[j * Dk + i]);
      }
    }
    bwd_stats_.summary_s = seconds_since(t0);

    // 2. reverse exchange: dS_out of this rank = dS_in of the next.
    t0 = Clock::now();
    ScanResult scan = exclusive_scan(comm_, sv.exchange, back, ScanOrder::reverse);
    bwd_stats_.exchange_s = seconds_since(t0);
    bwd_stats_.exchange_bytes = scan.bytes_sent;

    t0 = Clock::now();
    for (int64_t i = 0; i < nseg; ++i)
      if (sv.segs[i].to_next)
        std::copy_n(scan.incoming.data() + sv.segs[i].row * H * state, H * state,
                    dfinal.data() + i * H * state);
    bwd_stats_.merge_s = seconds_since(t0);
  }
  bwd_stats_.exchange = sv.exchange;

  // 3. local backward with the true downstream state gradient.
  auto t0 = Clock::now();
  bp.dq = a.dq.data;
  bp.dk_out = a.dk.data;
  bp.dv_out = a.dv.data;
  bp.dg = a.dg.defined() ? a.dg.as<float>() : nullptr;
  bp.dbeta = a.dbeta.defined() ? a.dbeta.data : nullptr;
  cpu::mixer_backward(bp);
  bwd_stats_.local_s = seconds_since(t0);

  // dh0 of each sequence comes from the rank on which it starts.
  t0 = Clock::now();
  if (a.d_initial_state.defined()) {
    auto* dh0 = a.d_initial_state.as<float>();
    std::fill_n(dh0, g.sequences * H * state, 0.f);
    for (int64_t i = 0; i < nseg; ++i)
      if (!sv.segs[i].from_prev)
        std::copy_n(dinit.data() + i * H * state, H * state, dh0 + sv.segs[i].seq * H * state);
    if (P > 1)
      comm_.all_reduce_sum(dh0, static_cast<std::size_t>(g.sequences * H * state), CommType::f32);
  }
  bwd_stats_.merge_s += seconds_since(t0);
  bwd_stats_.total_s = seconds_since(t_start);
  report_to_observer(bwd_stats_, Phase::bwd);
}

}  // namespace statescan
