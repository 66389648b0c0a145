// The GPU path of CpMixer (parallel/cp_mixer.h): the same distributed scan as
// the host path, with the CUDA kernels, device maps and, over NCCL, an
// exchange that never leaves the GPU.
//
// Forward: prepare (state-independent tiles, once) -> summary (M, E) from
// those tiles -> exchange on its own stream -> merge -> scan + output from the
// true incoming state with the same tiles. Backward: the pre-pass D (the
// gradient leaving the shard's first segment with none coming from the next
// rank) -> reverse exchange of (M^T, D) -> local backward with the true
// downstream gradient, its prepare stage (cuda::PreparedBackward) queued
// before the wait. Delta rules form D with one GEMM per row from maps their
// forward's summary kept (cuda::FirstSegmentMaps: a scan it ran anyway for
// M, now with outputs), on the exchange stream beside the prepare stage;
// additive rules run the reverse scan (state_grad_only) on the prepared
// tiles first.
//
// Control traffic (argument agreement, collective errors) is a few bytes of
// host data; over NCCL it is staged through a small device buffer
// (NcclHostStaged), so every rank still agrees before anything is written.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "comm/collective_check.h"
#include "core/cuda_check.h"
#include "core/device_pool.h"
#include "core/error.h"
#include "kernels/cuda/cp_kernels.h"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/mixer_params.h"
#include "parallel/cp_mixer.h"
#include "parallel/cp_mixer_internal.h"
#include "parallel/exchange.h"
#include "parallel/exchange_cuda.h"
#ifdef STATESCAN_HAS_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace statescan {

using cp_detail::Geometry;
using cp_detail::LocalSegment;
using cp_detail::TensorRules;

namespace {

PoolArray<float> zeros(std::size_t floats, cudaStream_t stream) {
  PoolArray<float> b(floats, stream);
  b.zero();
  return b;
}

void copy_floats(float* dst, const float* src, int64_t count, cudaStream_t stream) {
  if (count > 0)
    SS_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(count) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, stream));
}

// Joins `side` into `main` when its scope ends by an exception. The pool
// arrays declared before it go back to the pool on `main` (stream-ordered
// there only) while work queued on `side` (the exchange, the pre-pass's
// GEMMs) may still read or write them: without the join the pool could hand
// them to the next call while NCCL still writes them. Where `side` never
// finishes (a peer died inside a collective and nothing aborted it) the
// buffers are then never reused: leaked, not corrupted. On the normal path
// the caller joins the streams itself and this does nothing.
class JoinOnUnwind {
 public:
  JoinOnUnwind(cudaStream_t side, cudaStream_t main)
      : side_(side), main_(main), exceptions_(std::uncaught_exceptions()) {}
  ~JoinOnUnwind() {
    if (std::uncaught_exceptions() <= exceptions_) return;
    // Errors are dropped: a destructor must not throw, and the exception in
    // flight already reports what went wrong.
    cudaEvent_t done = nullptr;
    if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) != cudaSuccess) return;
    if (cudaEventRecord(done, side_) == cudaSuccess) (void)cudaStreamWaitEvent(main_, done, 0);
    (void)cudaEventDestroy(done);
  }
  JoinOnUnwind(const JoinOnUnwind&) = delete;
  JoinOnUnwind& operator=(const JoinOnUnwind&) = delete;

 private:
  cudaStream_t side_, main_;
  int exceptions_;
};

using Clock = std::chrono::steady_clock;

// Event timing of one call's phases on the mixer's streams.
struct Events {
  cudaEvent_t e[10] = {};
  Events() {
    try {
      for (auto& ev : e) SS_CUDA_CHECK(cudaEventCreate(&ev));
    } catch (...) {
      // No destructor runs for a constructor that throws: the ones made go here.
      for (auto& ev : e)
        if (ev != nullptr) (void)cudaEventDestroy(ev);
      throw;
    }
  }
  ~Events() {
    for (auto& ev : e) (void)cudaEventDestroy(ev);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  double seconds(int from, int to) const {
    float ms = 0.f;
    SS_CUDA_CHECK(cudaEventElapsedTime(&ms, e[from], e[to]));
    return ms * 1e-3;
  }
};

}  // namespace

struct CpMixer::DeviceState {
  cudaStream_t compute = nullptr;   // kernels
  cudaStream_t exchange = nullptr;  // the scan's communication and composition
  Events events;

  // Saved by forward for backward.
  bool valid = false;
  Geometry geo;
  std::vector<LocalSegment> segs;
  std::vector<int64_t> local_cu;  // host copy of the local offsets (packed)
  PoolArray<int64_t> local_cu_dev;  // the same on the device
  MixerParams params;             // the local problem (device pointers)
  PoolArray<float> init;          // [nseg, H, Dk, Dv] states entering the local segments
  PoolArray<float> chunk_states;  // [chunks, H, Dk, Dv]
  PoolArray<std::byte> saved_t;   // MixerConfig::save_t: T's two parts, or empty
  PoolArray<float> maps_M;        // this rank's M [rows, H, m_size]
  // Delta rules on ranks whose first segments continue from the previous
  // rank: those segments' maps (cuda::FirstSegmentMaps), from which backward
  // forms its pre-pass result with one GEMM per row instead of a reverse scan.
  bool first_maps = false;
  PoolArray<float> first_P;      // [rows, H, Dk, Dk] fp32
  PoolArray<std::byte> first_H;  // [B, L, H, Dk] in the input dtype
  // Two-level summary (cuda::summary_pieces > 1): the maps of each row's runs
  // [rows, pieces, H, Dk, Dk] fp32; empty with one piece.
  PoolArray<float> first_piece_P;
  int64_t first_pieces = 1;
  cuda::FirstSegmentMaps first_segment_maps() const {
    return {first_P.get(), first_H.get(), first_piece_P.get(), first_pieces};
  }
  // MixerConfig::keep_prepared: the forward's prepared workspace, handed to
  // the backward's PreparedBackward (null when not kept).
  std::unique_ptr<cuda::PreparedForward> kept;
  int64_t rows = 0;
  bool diagonal = false;
  Exchange exchange_used = Exchange::ring;

  DeviceState() {
    // Blocking streams: they wait for work the caller queued on the legacy
    // default stream (inputs copied there are complete when we start).
    SS_CUDA_CHECK(cudaStreamCreate(&compute));
    const cudaError_t rc = cudaStreamCreate(&exchange);
    if (rc != cudaSuccess) {
      (void)cudaStreamDestroy(compute);  // the destructor does not run
      SS_CUDA_CHECK(rc);
    }
  }
  ~DeviceState() {
    // Buffers free on `compute`: finish everything first.
    (void)cudaStreamSynchronize(exchange);
    (void)cudaStreamSynchronize(compute);
    kept.reset();
    local_cu_dev = {};
    init = {};
    chunk_states = {};
    saved_t = {};
    maps_M = {};
    first_P = {};
    first_H = {};
    first_piece_P = {};
    (void)cudaStreamSynchronize(compute);
    (void)cudaStreamDestroy(exchange);
    (void)cudaStreamDestroy(compute);
  }
};

void CpMixer::DeviceStateDeleter::operator()(DeviceState* state) const {
  delete state;
}

namespace {

// Waits for `stream`: through the NCCL communicator's watchdog when there is
// one (a dead peer then fails instead of hanging), else directly.
void wait_stream(Communicator& comm, cudaStream_t stream) {
#ifdef STATESCAN_HAS_NCCL
  if (is_nccl(comm)) {
    static_cast<NcclCommunicator&>(comm).wait(stream);
    return;
  }
#endif
  (void)comm;
  SS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// Sum over ranks of a device fp32 array, in place, ordered on `stream`.
void all_reduce_device(Communicator& comm, float* data, int64_t count, cudaStream_t stream) {
  if (comm.size() == 1 || count == 0) return;
#ifdef STATESCAN_HAS_NCCL
  if (is_nccl(comm)) {
    auto& nccl = static_cast<NcclCommunicator&>(comm);
    const cudaStream_t old = nccl.stream();
    nccl.set_stream(stream);
    try {
      nccl.all_reduce_sum(data, static_cast<std::size_t>(count), CommType::f32);
    } catch (...) {
      nccl.set_stream(old);
      throw;
    }
    nccl.set_stream(old);
    return;
  }
#endif
  std::vector<float> host(static_cast<std::size_t>(count));
  SS_CUDA_CHECK(cudaMemcpyAsync(host.data(), data, host.size() * sizeof(float),
                                cudaMemcpyDeviceToHost, stream));
  SS_CUDA_CHECK(cudaStreamSynchronize(stream));
  comm.all_reduce_sum(host.data(), host.size(), CommType::f32);
  SS_CUDA_CHECK(cudaMemcpyAsync(data, host.data(), host.size() * sizeof(float),
                                cudaMemcpyHostToDevice, stream));
  SS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// The GPU kernels move rows in 16-byte pieces (cuda::mixer_forward and
// mixer_backward refuse anything else); checked here, inside the collective
// checks, so that a misaligned view on one rank is an error on every rank
// instead of one rank's exception while the others wait in the exchange.
void check_aligned16(const TensorView& t, const char* name) {
  SS_CHECK_ARG(!t.defined() || reinterpret_cast<uintptr_t>(t.data) % 16 == 0, name,
               "must be 16-byte aligned (the GPU kernels move rows in 16-byte pieces)");
}

void check_device(const TensorView& t, const char* name) {
  if (t.defined())
    SS_CHECK_ARG(t.memory == Memory::device, name,
                 "is in host memory while other tensors of the call are on the device "
                 "(all host or all device)");
}

// An input the NaN/Inf check covers: its argument name, and whether it holds
// log gates (then also > 0 is refused, DESIGN §2).
struct CheckedInput {
  const TensorView* tensor;
  const char* name;
  bool log_gates = false;
};

// Counts NaN/Inf (and bad log gates) of the given device tensors (one sync)
// and names the first offender. Runs inside collective_check, so a fault on
// one rank is an error on all of them.
void check_finite_device(const std::vector<CheckedInput>& inputs, cudaStream_t stream) {
  PoolArray<int64_t> counts(inputs.size(), stream);
  counts.zero();
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const TensorView& t = *inputs[i].tensor;
    if (!t.defined()) continue;
    if (inputs[i].log_gates)
      cuda::count_bad_log_gates(t.as<const float>(), t.numel(), counts.get() + i, stream);
    else
      cuda::count_nonfinite(t.data, t.numel(), t.dtype, counts.get() + i, stream);
  }
  std::vector<int64_t> host(inputs.size());
  SS_CUDA_CHECK(cudaMemcpyAsync(host.data(), counts.get(), host.size() * sizeof(int64_t),
                                cudaMemcpyDeviceToHost, stream));
  SS_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (std::size_t i = 0; i < inputs.size(); ++i)
    SS_CHECK_ARG(host[i] == 0, inputs[i].name, "has ", host[i],
                 inputs[i].log_gates
                     ? " elements that are not log gates (NaN, Inf or > 0; g = log alpha, "
                       "alpha in (0, 1])"
                     : " non-finite (NaN/Inf) elements");
}

// The forward inputs the NaN/Inf check covers, with their argument names.
std::vector<CheckedInput> forward_inputs(const CpForwardArgs& a) {
  return {{&a.q, "q"},       {&a.k, "k"},
          {&a.v, "v"},       {&a.g, "g", /*log_gates=*/true},
          {&a.beta, "beta"}, {&a.initial_state, "initial_state"}};
}

void check_supported(int64_t dk, int64_t dv) {
  SS_CHECK_ARG(dk == dv && (dk == 64 || dk == 128), "dk",
               "the CUDA path supports Dk == Dv in {64, 128}, got Dk ", dk, ", Dv ", dv);
}

}  // namespace

void CpMixer::forward_device(const CpForwardArgs& a) {
  const auto t_start = Clock::now();
  fwd_stats_ = CpStepStats{};
  fwd_stats_.on_device = true;
  if (!device_) device_.reset(new DeviceState());
  DeviceState& ds = *device_;
  ds.valid = false;
  ds.kept.reset();  // a previous forward's tiles, never used by a backward
  saved_on_device_ = true;
  Communicator& ctl = agreement_comm();
  const cudaStream_t cs = ds.compute;

  // ---- local checks, then agreement ------------------------------------------
  Geometry g;
  std::vector<int64_t> host_cu;
  CpForwardArgs ha = a;  // a.cu_seqlens replaced by a host copy
  bool prepare_checks = false;
  collective_check(ctl, [&] {
    check_device(a.q, "q");
    check_device(a.k, "k");
    check_device(a.v, "v");
    check_device(a.g, "g");
    check_device(a.beta, "beta");
    check_device(a.cu_seqlens, "cu_seqlens");
    check_device(a.initial_state, "initial_state");
    check_device(a.o, "o");
    check_device(a.final_state, "final_state");
    SS_CHECK_ARG(a.q.defined(), "q", "must be defined");
    const DType x = a.q.dtype;
    SS_CHECK_ARG(x == DType::f32 || x == DType::bf16 || x == DType::f16, "q",
                 "the CUDA path takes f32, bf16 or f16 inputs, got ", to_string(x));
    if (a.cu_seqlens.defined()) {
      check_dtype(a.cu_seqlens, DType::i64, "cu_seqlens");
      SS_CHECK_ARG(a.cu_seqlens.shape.size() == 1 && a.cu_seqlens.size(0) >= 2, "cu_seqlens",
                   "must be a 1-D int64 array of >= 2 offsets, got shape ",
                   shape_string(a.cu_seqlens.shape));
      check_contiguous(a.cu_seqlens, "cu_seqlens");  // copied below as one block
      host_cu.resize(static_cast<std::size_t>(a.cu_seqlens.size(0)));
      SS_CUDA_CHECK(cudaMemcpyAsync(host_cu.data(), a.cu_seqlens.data,
                                    host_cu.size() * sizeof(int64_t), cudaMemcpyDeviceToHost, cs));
      SS_CUDA_CHECK(cudaStreamSynchronize(cs));
      ha.cu_seqlens = TensorView(host_cu.data(), DType::i64, a.cu_seqlens.shape);
    }
    TensorRules rules;
    rules.memory = Memory::device;
    rules.dtype = x;
    rules.check_values = false;
    g = cp_detail::check_forward_local(ha, config_, rules);
    check_supported(g.dk, g.dv);
    for (auto [t, name] :
         {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.g, "g"}, {&a.o, "o"}})
      check_aligned16(*t, name);
    if (config_.check_finite) {
      // Where the prepare stage reads all of q, k, v, g, beta (16-bit inputs)
      // it checks them itself (prepare_checks): no pass of their own here;
      // initial_state is counted after the prepare, in the same host sync.
      MixerParams probe;
      probe.variant = config_.variant;
      probe.dtype = x;
      probe.l2norm_qk = config_.l2norm_qk;
      prepare_checks = cuda::prepare_checks_finite(probe);
      if (!prepare_checks) check_finite_device(forward_inputs(a), cs);
    }
  });
  cp_detail::agree_geometry(ctl, ha, config_, exchange_, /*on_device=*/true, g);

  const int P = comm_.size();
  const int64_t H = g.heads, Dk = g.dk, Dv = g.dv, state = Dk * Dv;
  ds.geo = g;
  ds.segs = cp_detail::local_segments(ha, g);
  const auto& segs = ds.segs;
  const int64_t nseg = static_cast<int64_t>(segs.size());
  ds.rows = a.cu_seqlens.defined() ? 1 : g.batch;
  ds.diagonal = !has_beta(config_.variant);
  const int64_t rows = ds.rows;

  MixerParams& p = ds.params;
  p = cp_detail::local_mixer_params(config_, g);
  p.dtype = a.q.dtype;
  p.num_segments = nseg;
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.g = has_gate(config_.variant) ? a.g.as<const float>() : nullptr;
  p.beta = has_beta(config_.variant) ? a.beta.data : nullptr;
  p.o = a.o.data;
  ds.local_cu.clear();
  if (a.cu_seqlens.defined()) {
    ds.local_cu.push_back(0);
    for (const auto& s : segs) ds.local_cu.push_back(s.end);
  }
  int64_t chunks = 0;
  collective_check(ctl, [&] {
    MixerParams host_view = p;
    host_view.cu_seqlens = ds.local_cu.empty() ? nullptr : ds.local_cu.data();
    validate(host_view);
    cuda::check_grid_limits(host_view);  // this rank's own segment count
    chunks = count_chunks(host_view);
  });
  if (!ds.local_cu.empty()) {
    ds.local_cu_dev = PoolArray<int64_t>(ds.local_cu.size(), cs);
    SS_CUDA_CHECK(cudaMemcpyAsync(ds.local_cu_dev.get(), ds.local_cu.data(),
                                  ds.local_cu.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                                  cs));
    p.cu_seqlens = ds.local_cu_dev.get();
  } else {
    ds.local_cu_dev = {};
  }

  Events& ev = ds.events;
  SS_CUDA_CHECK(cudaEventRecord(ev.e[0], cs));
  // States entering the local segments: h0 where a sequence starts here, the
  // incoming boundary state (after the scan) where it continues.
  ds.init = zeros(static_cast<std::size_t>(nseg * H * state), cs);
  const float* h0 = a.initial_state.defined() ? a.initial_state.as<const float>() : nullptr;
  for (int64_t i = 0; i < nseg; ++i)
    if (!segs[i].from_prev && h0 != nullptr)
      copy_floats(ds.init.get() + i * H * state, h0 + segs[i].seq * H * state, H * state, cs);
  // With recompute_chunk_states backward re-runs the scan from ds.init instead.
  ds.chunk_states = config_.recompute_chunk_states
                        ? PoolArray<float>()
                        : PoolArray<float>(static_cast<std::size_t>(chunks * H * state), cs);
  PoolArray<float> finals(static_cast<std::size_t>(nseg * H * state), cs);
  p.initial_state = ds.init.get();
  p.final_state = finals.get();
  p.chunk_states = ds.chunk_states.get();
  // T from the forward's prepare for the backward's re-run (and the
  // pre-pass's): MixerParams::saved_t, where the variant and dtype have one.
  ds.saved_t = config_.save_t && cuda::saved_t_supported(p)
                   ? PoolArray<std::byte>(cuda::saved_t_bytes(p), cs)
                   : PoolArray<std::byte>();
  p.saved_t = ds.saved_t.get();  // null when empty

  // Resolved below where P > 1; one rank exchanges nothing, and reports an
  // automatic choice as ring, as the host path does (observers get a
  // resolved strategy).
  ds.exchange_used = exchange_ == Exchange::automatic ? Exchange::ring : exchange_;
  const int64_t m_size = ds.diagonal ? Dk : Dk * Dk;
  PoolArray<float> maps_E, incoming;
  if (P > 1) {
    ds.maps_M = PoolArray<float>(static_cast<std::size_t>(rows * H * m_size), cs);
    maps_E = PoolArray<float>(static_cast<std::size_t>(rows * H * state), cs);
    incoming = PoolArray<float>(static_cast<std::size_t>(rows * H * state), cs);
  }
  const JoinOnUnwind join_exchange(ds.exchange, cs);  // it reads the maps, writes incoming
  // The backward's pre-pass folded into the summary (delta rules): the maps
  // of the segments that continue from the previous rank. Additive rules keep
  // the pre-pass (their summary's M needs no scan to share).
  ds.first_maps =
      P > 1 && !ds.diagonal &&
      std::any_of(segs.begin(), segs.end(), [](const LocalSegment& s) { return s.from_prev; });
  ds.first_piece_P = {};  // sized at the summary (cuda::summary_pieces)
  ds.first_pieces = 1;
  ds.first_P = ds.first_maps ? PoolArray<float>(static_cast<std::size_t>(rows * H * Dk * Dk), cs)
                             : PoolArray<float>();
  ds.first_H =
      ds.first_maps
          ? PoolArray<std::byte>(
                static_cast<std::size_t>(g.batch * g.local_len * H * Dk) * size_of(p.dtype), cs)
          : PoolArray<std::byte>();
  PoolArray<unsigned> nonfinite;    // the prepare stage's NonFiniteInput bits
  PoolArray<int64_t> nonfinite_h0;  // initial_state's NaN/Inf count
  if (prepare_checks) {
    nonfinite = PoolArray<unsigned>(1, cs);
    nonfinite.zero();
    nonfinite_h0 = PoolArray<int64_t>(1, cs);
    nonfinite_h0.zero();
  }
  SS_CUDA_CHECK(cudaEventRecord(ev.e[1], cs));  // buffers allocated
  auto prepared = std::make_unique<cuda::PreparedForward>(p, cs, nonfinite.get());
  SS_CUDA_CHECK(cudaEventRecord(ev.e[8], cs));  // prepare done
  if (config_.check_finite) {
    // The prepare stage's verdict on q, k, v, g, beta, agreed before anything
    // leaves the rank (only the workspace is written so far). Every rank
    // agrees here, also one whose check ran before (prepare_checks is local:
    // STATESCAN_PREPARE may differ between processes).
    unsigned bits = 0;
    int64_t h0_count = 0;
    if (prepare_checks) {  // initial_state (not read by the prepare) counted here: one sync
      if (a.initial_state.defined())
        cuda::count_nonfinite(a.initial_state.data, a.initial_state.numel(), DType::f32,
                              nonfinite_h0.get(), cs);
      SS_CUDA_CHECK(
          cudaMemcpyAsync(&bits, nonfinite.get(), sizeof(bits), cudaMemcpyDeviceToHost, cs));
      SS_CUDA_CHECK(cudaMemcpyAsync(&h0_count, nonfinite_h0.get(), sizeof(h0_count),
                                    cudaMemcpyDeviceToHost, cs));
      SS_CUDA_CHECK(cudaStreamSynchronize(cs));
    }
    collective_check(ctl, [&] {
      if (bits == 0 && h0_count == 0) return;
      check_finite_device(forward_inputs(a), cs);  // counts them, names the first
      SS_FAIL("nonfinite", "the prepare stage flagged inputs (bits ", bits,
              ") in which the count finds no NaN/Inf (nor, in g, a log gate > 0)");
    });
  }
  if (P > 1) {
    // 1. summary from the prepared tiles. The last rank's map reaches no one
    // and the first rank's M only ever multiplies the zero state entering the
    // scan (also in backward, where their roles swap), so those ranks skip
    // that work and pass zeros (DESIGN §5: the results do not depend on it);
    // so does a rank none of whose rows is one continuing segment (its M is
    // zero). With first_maps, M is the first segments' P (one scan for both).
    const int rank = comm_.rank();
    const bool need_E = rank != P - 1;
    bool any_single = false;
    for (int64_t r = 0; r < rows; ++r) any_single |= cp_detail::single_continuing(segs, r);
    const bool need_M = need_E && rank != 0 && any_single;
    if (ds.first_maps) {
      ds.first_pieces = cuda::summary_pieces(p, need_E);
      ds.first_piece_P =
          ds.first_pieces > 1
              ? PoolArray<float>(static_cast<std::size_t>(rows * ds.first_pieces * H * Dk * Dk), cs)
              : PoolArray<float>();
    }
    if (need_E || ds.first_maps) {
      const cuda::FirstSegmentMaps first = ds.first_segment_maps();
      prepared->summary(ds.maps_M.get(), need_E ? maps_E.get() : nullptr, cs, need_M,
                        ds.first_maps ? &first : nullptr);
    }
    if (!need_E) maps_E.zero();
    if (!need_M) ds.maps_M.zero();
    for (int64_t r = 0; r < rows; ++r)
      if (!cp_detail::single_continuing(segs, r))
        SS_CUDA_CHECK(cudaMemsetAsync(ds.maps_M.get() + r * H * m_size, 0,
                                      static_cast<std::size_t>(H * m_size) * sizeof(float), cs));
    SS_CUDA_CHECK(cudaEventRecord(ev.e[2], cs));  // summary done: maps ready

    // 2. exchange on its own stream, after the summary.
    const int64_t map_bytes = rows * H * (m_size + state) * 4;
    const int64_t apply_flops = 2 * rows * H * m_size * Dv;
    // `auto`: the link measured at the first forward (measure_link_now: over
    // NCCL with device buffers on the GPU, and the GPU's composition rate).
    ds.exchange_used = resolve(map_bytes, rows * H * state * 4, apply_flops);
    // The exchange starts once the summary is done (exclusive_scan_device
    // waits for e[2]): nothing of it runs beside the summary.
    DeviceScanMaps dm;
    dm.rows = rows;
    dm.heads = H;
    dm.dk = Dk;
    dm.dv = Dv;
    dm.diagonal = ds.diagonal;
    dm.M = ds.maps_M.get();
    dm.E = maps_E.get();
    fwd_stats_.exchange_bytes =
        exclusive_scan_device(comm_, ds.exchange_used, dm, ScanOrder::forward, incoming.get(),
                              ds.exchange, ev.e[2], ev.e[3]);
    SS_CUDA_CHECK(cudaEventRecord(ev.e[4], ds.exchange));
    SS_CUDA_CHECK(cudaStreamWaitEvent(cs, ev.e[4], 0));

    // 3. merge: the incoming state enters the segment that continues.
    for (int64_t i = 0; i < nseg; ++i)
      if (segs[i].from_prev)
        copy_floats(ds.init.get() + i * H * state, incoming.get() + segs[i].row * H * state,
                    H * state, cs);
  } else {
    for (int i : {2, 3, 4}) SS_CUDA_CHECK(cudaEventRecord(ev.e[i], cs));
  }
  SS_CUDA_CHECK(cudaEventRecord(ev.e[5], cs));  // merge done
  fwd_stats_.exchange = ds.exchange_used;

  // 4. local scan + output from the true incoming states.
  prepared->finish(cs);
  SS_CUDA_CHECK(cudaEventRecord(ev.e[6], cs));

  // The final state of each sequence leaves the rank on which it ends.
  if (a.final_state.defined()) {
    auto* ht = a.final_state.as<float>();
    SS_CUDA_CHECK(cudaMemsetAsync(
        ht, 0, static_cast<std::size_t>(g.sequences * H * state) * sizeof(float), cs));
    for (int64_t i = 0; i < nseg; ++i)
      if (!segs[i].to_next)
        copy_floats(ht + segs[i].seq * H * state, finals.get() + i * H * state, H * state, cs);
    all_reduce_device(comm_, ht, g.sequences * H * state, cs);
  }
  SS_CUDA_CHECK(cudaEventRecord(ev.e[7], cs));
  wait_stream(comm_, cs);
  p.final_state = nullptr;  // `finals` dies here; backward reads the chunk states
  // The first rank of several prepares its backward while it waits for the
  // exchange: keeping its tiles would save no time.
  if (config_.keep_prepared && (P == 1 || comm_.rank() != 0)) ds.kept = std::move(prepared);

  // Phase times from the events.
  const double prepare_s = ev.seconds(0, 8);
  fwd_stats_.summary_s = ev.seconds(8, 2);
  fwd_stats_.exchange_s = P > 1 ? ev.seconds(3, 4) : 0.0;
  fwd_stats_.merge_s = ev.seconds(4, 5) + ev.seconds(6, 7);
  fwd_stats_.local_s = prepare_s + ev.seconds(5, 6);
  fwd_stats_.prepare_s = ev.seconds(1, 8);
  // Nothing runs beside the forward's exchange: it waits for the summary,
  // and the local pass waits for it.
  fwd_stats_.hidden_s = 0;
  ds.valid = true;
  fwd_stats_.total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  report_to_observer(fwd_stats_, Phase::fwd);
}

void CpMixer::backward_device(const CpBackwardArgs& a) {
  const auto t_start = Clock::now();
  bwd_stats_ = CpStepStats{};
  bwd_stats_.on_device = true;
  if (!device_) device_.reset(new DeviceState());
  DeviceState& ds = *device_;
  Communicator& ctl = agreement_comm();
  const cudaStream_t cs = ds.compute;
  collective_check(ctl, [&] {
    SS_CHECK_ARG(ds.valid && saved_on_device_, "backward",
                 "called without a preceding forward on the device");
  });
  const Geometry& g = ds.geo;
  const MixerParams& sp = ds.params;
  const int P = comm_.size();
  const int64_t H = g.heads, Dk = g.dk, Dv = g.dv, state = Dk * Dv;
  const int64_t nseg = static_cast<int64_t>(ds.segs.size());
  const Shape qk{g.batch, g.local_len, H, Dk}, vo{g.batch, g.local_len, H, Dv};
  const Shape bth{g.batch, g.local_len, H}, states{g.sequences, H, Dk, Dv};
  collective_check(ctl, [&] {
    for (auto [t, name] : {std::pair{&a.d_o, "do"},
                           {&a.d_final_state, "d_final_state"},
                           {&a.dq, "dq"},
                           {&a.dk, "dk"},
                           {&a.dv, "dv"},
                           {&a.dg, "dg"},
                           {&a.dbeta, "dbeta"},
                           {&a.d_initial_state, "d_initial_state"}})
      check_device(*t, name);
    const DType x = sp.dtype;
    check_tensor(a.d_o, vo, x, Memory::device, "do");
    if (a.d_final_state.defined())
      check_tensor(a.d_final_state, states, DType::f32, Memory::device, "d_final_state");
    check_tensor(a.dq, qk, x, Memory::device, "dq");
    check_tensor(a.dk, qk, x, Memory::device, "dk");
    check_tensor(a.dv, vo, x, Memory::device, "dv");
    if (sp.g != nullptr) {
      check_tensor(a.dg, vector_gate(config_.variant) ? qk : bth, DType::f32, Memory::device, "dg");
    } else {
      SS_CHECK_ARG(!a.dg.defined(), "dg", "must be undefined for variant ",
                   to_string(config_.variant));
    }
    if (sp.beta != nullptr) {
      check_tensor(a.dbeta, bth, x, Memory::device, "dbeta");
    } else {
      SS_CHECK_ARG(!a.dbeta.defined(), "dbeta", "must be undefined for variant ",
                   to_string(config_.variant));
    }
    if (a.d_initial_state.defined())
      check_tensor(a.d_initial_state, states, DType::f32, Memory::device, "d_initial_state");
    for (auto [t, name] : {std::pair{&a.d_o, "do"}, {&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}})
      check_aligned16(*t, name);
    if (config_.check_finite)
      check_finite_device({{&a.d_o, "do"}, {&a.d_final_state, "d_final_state"}}, cs);
  });
  cp_detail::agree_backward_outputs(ctl, a);

  MixerBwdParams bp;
  static_cast<MixerParams&>(bp) = sp;
  bp.recompute_chunk_states = config_.recompute_chunk_states;
  bp.d_o = a.d_o.data;
  Events& ev = ds.events;
  SS_CUDA_CHECK(cudaEventRecord(ev.e[0], cs));
  // Gradient entering each local segment's final state: the user's dht where
  // the sequence ends here, the next rank's dS_in where it continues.
  PoolArray<float> dfinal = zeros(static_cast<std::size_t>(nseg * H * state), cs);
  const float* dht = a.d_final_state.defined() ? a.d_final_state.as<const float>() : nullptr;
  for (int64_t i = 0; i < nseg; ++i)
    if (!ds.segs[i].to_next && dht != nullptr)
      copy_floats(dfinal.get() + i * H * state, dht + ds.segs[i].seq * H * state, H * state, cs);
  bp.d_final_state = dfinal.get();
  PoolArray<float> dinit = zeros(static_cast<std::size_t>(nseg * H * state), cs);
  bp.d_initial_state = dinit.get();

  const int64_t rows = ds.rows;
  const int64_t m_size = ds.diagonal ? Dk : Dk * Dk;
  PoolArray<float> back_E, back_M, incoming;
  if (P > 1) {
    back_E = zeros(static_cast<std::size_t>(rows * H * state), cs);
    if (!ds.diagonal) back_M = PoolArray<float>(static_cast<std::size_t>(rows * H * m_size), cs);
    incoming = PoolArray<float>(static_cast<std::size_t>(rows * H * state), cs);
  }
  // The exchange stream reads dfinal, back_E, back_M and writes incoming.
  const JoinOnUnwind join_exchange(ds.exchange, cs);
  SS_CUDA_CHECK(cudaEventRecord(ev.e[1], cs));  // buffers allocated
  // The state-independent tiles, prepared once for the pre-pass and the local
  // backward. Rank 0 has no pre-pass: it queues them after handing its maps
  // to the exchange, so that they are computed while it waits.
  std::optional<cuda::PreparedBackward> prepared;
  // Queues the prepare stage between events 8 and 9 (its GPU time).
  // With the forward's kept tiles (MixerConfig::keep_prepared) no prepare
  // stage runs: the events then time nothing.
  const auto prepare = [&] {
    SS_CUDA_CHECK(cudaEventRecord(ev.e[8], cs));
    if (ds.kept) {
      std::unique_ptr<cuda::PreparedForward> kept = std::move(ds.kept);
      prepared.emplace(bp, *kept, cs);
    } else {
      prepared.emplace(bp, cs);
    }
    SS_CUDA_CHECK(cudaEventRecord(ev.e[9], cs));
  };
  if (P > 1) {
    // 1. pre-pass: D_r = dS_in with zero gradient from the next rank. Rank 0
    // is last in reverse order: its (M^T, D) reach no one, and none of its
    // segments continues from a previous rank, so it skips the pre-pass.
    // Delta rules take it from the forward's first-segment maps, one GEMM per
    // row (cuda::first_segment_state_grad: sum_t H_t^T dO_t + P^T dS_end,
    // with the user's dht as dS_end where that segment ends here), and then
    // prepare while they wait, as rank 0 does; additive rules run the
    // reverse scan (state_grad_only) on the prepared tiles. The GEMMs (and
    // M's transpose) go on the exchange stream, which needs them first, so
    // that the prepare stage queued next on the compute stream runs beside
    // them rather than after.
    const cudaStream_t maps_stream = ds.first_maps ? ds.exchange : cs;
    if (ds.first_maps) {
      SS_CUDA_CHECK(cudaStreamWaitEvent(ds.exchange, ev.e[1], 0));  // dfinal, back_E ready
      for (int64_t i = 0; i < nseg; ++i) {
        const LocalSegment& s = ds.segs[i];
        if (!s.from_prev) continue;
        const float* d_end = !s.to_next && dht != nullptr ? dfinal.get() + i * H * state : nullptr;
        cuda::first_segment_state_grad(sp, ds.first_segment_maps(), a.d_o.data, s.row, s.begin,
                                       s.end, d_end, back_E.get() + s.row * H * state, maps_stream);
      }
    } else if (comm_.rank() != 0) {
      prepare();
      bp.state_grad_only = true;
      prepared->run(bp, cs);
      bp.state_grad_only = false;
      for (int64_t i = 0; i < nseg; ++i)
        if (ds.segs[i].from_prev)
          copy_floats(back_E.get() + ds.segs[i].row * H * state, dinit.get() + i * H * state,
                      H * state, cs);
    }
    const float* m_for_back = ds.maps_M.get();
    if (!ds.diagonal) {
      cuda::transpose_maps(ds.maps_M.get(), back_M.get(), rows * H, Dk, maps_stream);
      m_for_back = back_M.get();
    }
    SS_CUDA_CHECK(cudaEventRecord(ev.e[2], maps_stream));  // pre-pass done: maps ready
    if (!prepared) prepare();

    // 2. reverse exchange: dS_out of this rank = dS_in of the next.
    SS_CUDA_CHECK(cudaStreamWaitEvent(ds.exchange, ev.e[1], 0));
    DeviceScanMaps dm;
    dm.rows = rows;
    dm.heads = H;
    dm.dk = Dk;
    dm.dv = Dv;
    dm.diagonal = ds.diagonal;
    dm.M = m_for_back;
    dm.E = back_E.get();
    bwd_stats_.exchange_bytes =
        exclusive_scan_device(comm_, ds.exchange_used, dm, ScanOrder::reverse, incoming.get(),
                              ds.exchange, ev.e[2], ev.e[3]);
    SS_CUDA_CHECK(cudaEventRecord(ev.e[4], ds.exchange));
    SS_CUDA_CHECK(cudaStreamWaitEvent(cs, ev.e[4], 0));
    for (int64_t i = 0; i < nseg; ++i)
      if (ds.segs[i].to_next)
        copy_floats(dfinal.get() + i * H * state, incoming.get() + ds.segs[i].row * H * state,
                    H * state, cs);
    dinit.zero();
  } else {
    for (int i : {2, 3, 4}) SS_CUDA_CHECK(cudaEventRecord(ev.e[i], cs));
  }
  SS_CUDA_CHECK(cudaEventRecord(ev.e[5], cs));
  bwd_stats_.exchange = ds.exchange_used;

  // 3. local backward with the true downstream state gradient.
  bp.dq = a.dq.data;
  bp.dk_out = a.dk.data;
  bp.dv_out = a.dv.data;
  bp.dg = a.dg.defined() ? a.dg.as<float>() : nullptr;
  bp.dbeta = a.dbeta.defined() ? a.dbeta.data : nullptr;
  if (!prepared) prepare();
  prepared->run(bp, cs);
  SS_CUDA_CHECK(cudaEventRecord(ev.e[6], cs));

  // dh0 of each sequence comes from the rank on which it starts.
  if (a.d_initial_state.defined()) {
    auto* dh0 = a.d_initial_state.as<float>();
    SS_CUDA_CHECK(cudaMemsetAsync(
        dh0, 0, static_cast<std::size_t>(g.sequences * H * state) * sizeof(float), cs));
    for (int64_t i = 0; i < nseg; ++i)
      if (!ds.segs[i].from_prev)
        copy_floats(dh0 + ds.segs[i].seq * H * state, dinit.get() + i * H * state, H * state, cs);
    all_reduce_device(comm_, dh0, g.sequences * H * state, cs);
  }
  SS_CUDA_CHECK(cudaEventRecord(ev.e[7], cs));
  wait_stream(comm_, cs);

  bwd_stats_.summary_s = ev.seconds(1, 2);
  bwd_stats_.exchange_s = P > 1 ? ev.seconds(3, 4) : 0.0;
  bwd_stats_.merge_s = ev.seconds(4, 5) + ev.seconds(6, 7);
  bwd_stats_.local_s = ev.seconds(5, 6);
  bwd_stats_.prepare_s = ev.seconds(8, 9);
  // The backward's prepare stage (events 8 and 9 on the compute stream) runs
  // beside the reverse exchange (3 to 4 on the exchange stream) where it was
  // queued after the pre-pass: that overlap is the exchange hidden. Times
  // from event 1, which precedes both.
  if (P > 1) {
    const double overlap =
        std::min(ev.seconds(1, 4), ev.seconds(1, 9)) - std::max(ev.seconds(1, 3), ev.seconds(1, 8));
    bwd_stats_.hidden_s = std::clamp(overlap, 0.0, bwd_stats_.exchange_s);
  }
  bwd_stats_.total_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  report_to_observer(bwd_stats_, Phase::bwd);
}

}  // namespace statescan
