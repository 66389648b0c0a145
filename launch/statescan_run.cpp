// statescan-run: the mpirun entry point. Each rank takes a contiguous shard of
// the sequence, runs CpMixer forward (+ backward) for --warmup + --iters steps
// (--variant lact: LactLayer, one slice of every chunk per rank, run_lact.h),
// and rank 0 prints one table row per timed step (maxima over ranks), checks
// every output against a single-rank run, and writes .npy/JSON results.
//
// Errors: every failure is a single line "statescan-run: <what>" on stderr.
// Faults in arguments and inputs are detected identically on every rank
// (argv is the same everywhere; file reads and CpMixer validation go through
// collective_check), so every rank exits with the same code and MPI finalises
// cleanly. Only an unexpected failure on some ranks aborts the job.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/collective_check.h"
#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "core/npy.h"
#include "core/parallel_for.h"
#include "launch/run_comm.h"
#include "launch/run_inputs.h"
#include "launch/run_lact.h"
#include "launch/run_metrics.h"
#include "launch/run_options.h"
#include "launch/run_report.h"
#include "monitoring/flop_model.h"
#include "monitoring/metrics_exporter.h"
#include "parallel/cp_mixer.h"
#ifdef STATESCAN_HAS_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "kernels/cuda/cuda_mixer.h"
#include "launch/device_array.h"
#endif
#ifdef STATESCAN_HAS_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace statescan::launch {
namespace {

// Both runs compute in fp32 from the same inputs and differ only in summation
// order (chunk alignment and the boundary-state scan), which stays well below
// 1e-5. On the GPU with 16-bit inputs the single-GPU run carries its state
// rounded to the dtype for the matrix products while the CP run forms the
// boundary state in fp32: differences of the dtype's state error (DESIGN §7),
// so 16-bit GPU runs use 1e-2.
constexpr double kCheckTolerance = 1e-5;
constexpr double kCheckTolerance16 = 1e-2;

using Clock = std::chrono::steady_clock;

// Every output and gradient of one step on one rank (or the whole sequence).
struct Outputs {
  std::vector<float> o, ht, dq, dk, dv, dg, dbeta, dh0;
};

// Element counts of the outputs of one token range (0: not produced).
struct OutputSizes {
  std::size_t o = 0, ht = 0, dq = 0, dk = 0, dv = 0, dg = 0, dbeta = 0, dh0 = 0;
};

TensorView view(const std::vector<float>& x, Shape shape) {
  // CpMixer reads inputs through non-const views; it never writes them.
  return TensorView(const_cast<float*>(x.data()), DType::f32, std::move(shape));
}

#ifdef STATESCAN_HAS_CUDA
// A TokenRange and its outputs on the GPU: token tensors in the run's dtype,
// g and states fp32, cu_seqlens int64.
struct DeviceStep {
  DeviceArray q, k, v, g, beta, d_o, h0, dht;
  DeviceArray o, ht, dq, dk, dv, dg, dbeta, dh0;
  std::unique_ptr<DeviceBuffer<int64_t>> cu;
};
#endif

// Gathers every rank's [B, L_r, inner] piece into rank 0's [B, T, inner]
// (offsets: the P + 1 shard boundaries). Other ranks return an empty vector.
std::vector<float> gather_tokens(Communicator& comm, const std::vector<float>& local,
                                 const std::vector<int64_t>& offsets, int64_t batch,
                                 int64_t inner) {
  constexpr int kTag = 4711;
  const int P = comm.size();
  const int64_t T = offsets.back();
  if (comm.rank() != 0) {
    comm.send(local.data(), local.size(), CommType::f32, 0, kTag);
    return {};
  }
  std::vector<float> full(static_cast<std::size_t>(batch * T * inner));
  std::vector<float> piece;
  for (int r = 0; r < P; ++r) {
    const int64_t begin = offsets[r], length = offsets[r + 1] - offsets[r];
    const std::vector<float>* src = &local;
    if (r != 0) {
      piece.resize(static_cast<std::size_t>(batch * length * inner));
      comm.recv(piece.data(), piece.size(), CommType::f32, r, kTag);
      src = &piece;
    }
    for (int64_t b = 0; b < batch; ++b)
      std::copy_n(src->begin() + b * length * inner, length * inner,
                  full.begin() + (b * T + begin) * inner);
  }
  return full;
}

class Job {
 public:
  Job(Communicator& comm, Stage& stage) : comm_(comm), stage_(stage) {}
  int run(int argc, char** argv);

 private:
  bool root() const { return comm_.rank() == 0; }
  void configure_threads(const MpiCommunicator* mpi) const;
  void setup_inputs();
  OutputSizes output_sizes(const Dims& d, int64_t length) const;
  double device_memory_in_use() const;
  void allocate(Outputs& out, const Dims& d, int64_t length) const;
  StepTimes step(CpMixer& mixer, const TokenRange& in, Outputs& out, bool copy_back);
#ifdef STATESCAN_HAS_CUDA
  std::unique_ptr<DeviceStep> upload(const TokenRange& in, const OutputSizes& out) const;
#endif
  StepTimes run_step(CpMixer& mixer, const CpForwardArgs& fa, const CpBackwardArgs& ba);
  void setup_device(const MpiCommunicator* mpi);
  double check_tolerance() const {
    return device_ == DeviceKind::cuda && options_.dtype != DType::f32 ? kCheckTolerance16
                                                                       : kCheckTolerance;
  }
  void run_reference();
  Outputs gather(const Outputs& local);
  std::vector<NamedArray> named(const Outputs& o) const;
  std::vector<std::pair<std::string, std::string>> header_fields(Exchange resolved,
                                                                 const LinkModel* link) const;
  int run_steps();
  void report_step_metrics(const StepTimes& t) const;
  void hold_after_run() const;

  Communicator& comm_;
  Stage& stage_;
  RunOptions options_;
  MixerConfig config_;
  std::optional<InputSource> source_;
  Dims dims_;
  std::vector<int64_t> offsets_;
  DeviceKind device_ = DeviceKind::cpu;
  Communicator* cp_comm_ = nullptr;  // the mixer's communicator (comm_, or NCCL over it)
  std::string comm_description_;
#ifdef STATESCAN_HAS_NCCL
  cudaStream_t nccl_stream_ = nullptr;
  std::unique_ptr<NcclCommunicator> nccl_;
#endif
  bool backward_ = false;
  TokenRange local_;
#ifdef STATESCAN_HAS_CUDA
  std::unique_ptr<DeviceStep> device_local_;  // local_ on the GPU, uploaded once
#endif
  Outputs reference_;                         // rank 0, with --check
  std::unique_ptr<MetricsExporter> metrics_;  // with --metrics-port
};

int Job::run(int argc, char** argv) {
  options_ = parse_run_options(argc, argv);
  if (options_.help) {
    if (root()) std::fputs(usage_text().c_str(), stdout);
    return kExitOk;
  }
  const auto* mpi = dynamic_cast<const MpiCommunicator*>(&comm_);
  configure_threads(mpi);
  if (options_.metrics_hold > 0) install_hold_signals();
  device_ = agree_device(comm_, options_);
  cp_comm_ = &comm_;
  comm_description_ = comm_.size() == 1 ? "single rank" : "mpi (host)";
  config_.variant = options_.variant;
  config_.chunk = options_.chunk;
  config_.scale = options_.scale;
  config_.l2norm_qk = options_.l2norm;
  config_.recompute_chunk_states = options_.recompute_states;
  SS_CHECK_ARG(!options_.keep_prepared || device_ == DeviceKind::cuda, "--keep-prepared",
               "applies to --device cuda only (the CPU path has no prepare stage)");
  config_.keep_prepared = options_.keep_prepared;
  SS_CHECK_ARG(options_.save_t || device_ == DeviceKind::cuda, "--no-save-t",
               "applies to --device cuda only (the CPU path saves no T)");
  config_.save_t = options_.save_t;
  config_.check_finite = options_.check_finite;
  metrics_ = start_metrics(comm_, mpi != nullptr ? mpi->local_rank() : 0, options_);
  if (metrics_ && root()) {
    std::fprintf(stderr,
                 "statescan-run: metrics on http://%s/metrics (rank r of a node: port %d + r)\n",
                 metrics_->address().c_str(), options_.metrics_port);
  }
  // A failure from here on (setting up the device and loading the inputs
  // included) is counted in statescan_errors_total, and with --metrics-hold
  // stays visible to a scrape before the job exits. LaCT runs its own layer
  // and job (launch/run_lact.h) with the same exporter.
  try {
    int code = 0;
    if (options_.lact) {
      code = run_lact_job(comm_, options_, stage_, metrics_.get());
    } else {
      setup_device(mpi);
      setup_inputs();
      code = run_steps();
    }
    hold_after_run();
    return code;
  } catch (const RuntimeFailure&) {
    if (metrics_) {
      metrics_->count_error(ErrorKind::io);
      hold_after_run();
    }
    throw;
  } catch (const Error& e) {
    if (metrics_) {
      const ErrorKind kind = error_kind(e, stage_ == Stage::results);
      metrics_->count_error(kind);
      // After a communication failure peers may be stuck: abort without delay.
      if (kind != ErrorKind::communication) hold_after_run();
    }
    throw;
  }
}

// The timed steps, the table and the results; returns the exit code.
int Job::run_steps() {
  stage_ = Stage::steps;
  CpMixer mixer(*cp_comm_, config_, options_.exchange, metrics_.get());
  // Over NCCL the mixer's argument agreement goes over MPI (host, same ranks).
  if (cp_comm_ != &comm_) mixer.set_control(&comm_);
  // --exchange auto's link probe before the timed steps: with --warmup 0 the
  // first step counted it as exchange time (3 ms against 0.5 on two CPU ranks).
  mixer.measure_link_now();
  // Host outputs only where they are written: the CPU path, or GPU steps
  // that copy back (--check, --save). At 1M tokens they are tens of GB whose
  // zero-fill would take longer than the run's timed steps.
  Outputs out;
  if (device_ != DeviceKind::cuda || options_.check || !options_.save_dir.empty())
    allocate(out, dims_, local_.length());
  Report report;
  report.check.enabled = options_.check;
  report.check.tolerance = check_tolerance();
  Outputs last_full;
  const int64_t steps = options_.warmup + options_.iters;
  ProgressLine progress(root() ? options_.progress : RunOptions::Progress::never, steps,
                        options_.warmup);
  const double tokens = static_cast<double>(dims_.batch * dims_.seq_len);
  StepTimes phase_sum;    // the timed steps' phases, summed, then their mean
  double memory[2] = {};  // device memory in use after the first and the last timed step
  for (int64_t s = 0; s < steps; ++s) {
    if (s == options_.warmup && options_.check) run_reference();
    const bool last = s + 1 == steps;
    // Outputs come back from the GPU only for the steps that read them.
    const bool wanted =
        s >= options_.warmup && (options_.check || (last && !options_.save_dir.empty()));
    comm_.barrier();  // start together, so the max over ranks is the step's time
    const StepTimes t = step(mixer, local_, out, wanted);
    report_step_metrics(t);
    // Labels later exchange bytes with the strategy `auto` resolved to, for a
    // CpMixer that does not report it itself (CpObserver::on_exchange_strategy).
    if (metrics_) metrics_->on_exchange_strategy(mixer.last_forward_stats().exchange);
    if (s < options_.warmup) {
      progress.update(s + 1, tokens / (t.fwd_s + t.bwd_s));  // this rank's time
      continue;
    }

    StepRow row = reduce_step(comm_, t, s - options_.warmup + 1, backward_, tokens);
    phase_sum.fwd += t.fwd;
    phase_sum.bwd += t.bwd;
    if (s == options_.warmup) memory[0] = device_memory_in_use();
    if (last) memory[1] = device_memory_in_use();

    if (wanted) {
      Outputs full = gather(out);
      if (options_.check) {
        int64_t wrong = root() ? count_wrong(named(full), named(reference_), check_tolerance(),
                                             report.check.errors)
                               : 0;
        comm_.broadcast(&wrong, 1, CommType::i64, 0);  // every rank exits alike
        row.wrong = static_cast<int>(wrong);
      }
      if (last) last_full = std::move(full);
    }
    progress.clear();
    print_row(report, row, root(),
              header_fields(mixer.last_forward_stats().exchange, mixer.auto_link()));
    progress.update(s + 1, row.tokens_per_s);
    if (last) {
      const double n = static_cast<double>(options_.iters);
      for (double* f : {phase_sum.fwd.s, phase_sum.bwd.s})
        for (int i = 0; i < PassPhases::kFields; ++i) f[i] /= n;
      report.ranks = gather_rank_exchange(comm_, t, &phase_sum, memory);
    }
  }
  progress.clear();

  stage_ = Stage::results;
  // Rank 0 writes; a write failure becomes exit 3 on every rank.
  return finish_report(comm_, report, [&] {
    write_results(options_.json_path, report, options_.save_dir, named(last_full));
  });
}

// This rank's step to the exporter: its tokens, its wall time (forward +
// backward), the counted FLOPs, and the memory of the device that computes.
// CpMixer already reported the phases.
void Job::report_step_metrics(const StepTimes& t) const {
  if (!metrics_) return;
  const int64_t tokens = dims_.batch * local_.length();
  const FlopShape shape{options_.variant, tokens, dims_.heads, dims_.dk, dims_.dv, options_.chunk};
  const double seconds = std::max(t.fwd_s + t.bwd_s, 1e-9);  // a clock tick can read 0
  metrics_->on_step({tokens, seconds, chunkwise_step_flops(shape, backward_)});
  const MemoryUse memory = device_memory(device_);
  metrics_->set_device_memory(memory.current_bytes, memory.peak_bytes);
}

// --metrics-hold: the exporters stay up for a last scrape. Every rank holds
// on its own (no collective), so a signal to any subset ends only those.
void Job::hold_after_run() const {
  if (!metrics_ || options_.metrics_hold <= 0) return;
  hold_metrics(options_.metrics_hold, [&] {
    if (!root()) return;
    std::fprintf(stderr,
                 "statescan-run: holding the metrics exporters for %.0f s (SIGINT, SIGTERM or "
                 "SIGUSR1 end the wait)\n",
                 options_.metrics_hold);
  });
}

// One CPU thread per core on each node: ranks sharing a node split its
// cores, unless STATESCAN_NUM_THREADS says otherwise. Never more threads than
// the cores this process may run on: OpenMPI binds each of up to 2 ranks to
// one core by default, and 32 threads on one core made set-up take minutes.
// Must run before the first parallel_for (the thread count is read once).
void Job::configure_threads(const MpiCommunicator* mpi) const {
  if (std::getenv("STATESCAN_NUM_THREADS") != nullptr) return;
  const int per_node = mpi != nullptr ? std::max(1, mpi->local_size()) : 1;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int threads = std::max(1, cores / per_node);
  const int usable = usable_cores();
  if (usable < threads) {
    if (root() && usable < 4 && cores >= 4 * per_node) {
      std::fprintf(stderr,
                   "statescan-run: note: this rank may use %d of the node's %d cores (mpirun "
                   "binding); host set-up runs on %d thread(s): `mpirun --bind-to none` "
                   "lifts that\n",
                   usable, cores, usable);
    }
    threads = usable;
  }
  ::setenv("STATESCAN_NUM_THREADS", std::to_string(threads).c_str(), 0);
}

void Job::setup_inputs() {
  if (root()) note_ignored_shape_flags(options_, "q.npy and v.npy");
  // A file that one rank cannot read must fail every rank, not hang the others.
  collective_check(comm_, [&] {
    source_ = options_.load_dir.empty() ? InputSource::synthetic(options_)
                                        : InputSource::from_directory(options_);
    dims_ = source_->dims();
    offsets_ = shard_offsets(options_, dims_.seq_len, comm_.size());
    if (root()) prepare_output_locations(options_.save_dir, options_.json_path);
  });
  backward_ = source_->has_backward();
  local_ = source_->tokens(offsets_[comm_.rank()], offsets_[comm_.rank() + 1]);
}

// GPU path: bytes in use on this rank's GPU (every allocation, the
// stream-ordered pool's reserve included; CpMixer returns once its work is
// done, so nothing is in flight); 0 on the CPU path.
double Job::device_memory_in_use() const {
  if (device_ != DeviceKind::cuda) return 0.0;
  return static_cast<double>(device_memory(device_).current_bytes);
}

OutputSizes Job::output_sizes(const Dims& d, int64_t length) const {
  const auto tokens = static_cast<std::size_t>(d.batch * length * d.heads);
  const Variant v = options_.variant;
  OutputSizes n;
  n.o = tokens * d.dv;
  n.ht = static_cast<std::size_t>(d.sequences * d.heads * d.dk * d.dv);
  if (!backward_) return n;
  n.dq = n.dk = tokens * d.dk;
  n.dv = tokens * d.dv;
  n.dg = has_gate(v) ? tokens * (vector_gate(v) ? d.dk : 1) : 0;
  n.dbeta = has_beta(v) ? tokens : 0;
  n.dh0 = source_->has_h0() ? n.ht : 0;
  return n;
}

void Job::allocate(Outputs& out, const Dims& d, int64_t length) const {
  const OutputSizes n = output_sizes(d, length);
  for (auto [vec, count] : {std::pair{&out.o, n.o},
                            {&out.ht, n.ht},
                            {&out.dq, n.dq},
                            {&out.dk, n.dk},
                            {&out.dv, n.dv},
                            {&out.dg, n.dg},
                            {&out.dbeta, n.dbeta},
                            {&out.dh0, n.dh0}})
    vec->assign(count, 0.f);
}

#ifdef STATESCAN_HAS_CUDA
// `in` on the GPU in the run's dtype (g and states fp32), with zeroed outputs
// of the sizes `out`. Not timed.
std::unique_ptr<DeviceStep> Job::upload(const TokenRange& in, const OutputSizes& out) const {
  const DType x = options_.dtype;
  auto dev = std::make_unique<DeviceStep>();
  dev->q = DeviceArray(in.q, x);
  dev->k = DeviceArray(in.k, x);
  dev->v = DeviceArray(in.v, x);
  dev->g = DeviceArray(in.g, DType::f32);
  dev->beta = DeviceArray(in.beta, x);
  dev->h0 = DeviceArray(in.h0, DType::f32);
  dev->o = DeviceArray::zeros(out.o, x);
  dev->ht = DeviceArray::zeros(out.ht, DType::f32);
  if (!in.cu_seqlens.empty()) dev->cu = std::make_unique<DeviceBuffer<int64_t>>(in.cu_seqlens);
  if (!backward_) return dev;
  dev->d_o = DeviceArray(in.d_o, x);
  dev->dht = DeviceArray(in.dht, DType::f32);
  dev->dq = DeviceArray::zeros(out.dq, x);
  dev->dk = DeviceArray::zeros(out.dk, x);
  dev->dv = DeviceArray::zeros(out.dv, x);
  dev->dg = DeviceArray::zeros(out.dg, DType::f32);
  dev->dbeta = DeviceArray::zeros(out.dbeta, x);
  dev->dh0 = DeviceArray::zeros(out.dh0, DType::f32);
  return dev;
}
#endif

// Forward (+ backward) of `mixer` on the tokens `in`, timed on this rank: on
// host views of `in` and `out`, or with --device cuda on device copies (in
// the run's dtype) whose outputs are copied back into `out` when `copy_back`
// (the CPU path writes `out` directly).
StepTimes Job::step(CpMixer& mixer, const TokenRange& in, Outputs& out, bool copy_back) {
  const Dims& d = dims_;
  const int64_t B = d.batch, L = in.length(), H = d.heads, N = d.sequences;
  const Shape qk{B, L, H, d.dk}, vo{B, L, H, d.dv}, bth{B, L, H}, states{N, H, d.dk, d.dv};
  const Variant v = options_.variant;
  const Shape gs = vector_gate(v) ? qk : bth;
  std::vector<int64_t> cu = in.cu_seqlens;
  CpForwardArgs fa;
  CpBackwardArgs ba;

#ifdef STATESCAN_HAS_CUDA
  if (device_ == DeviceKind::cuda) {
    // The tensors go to the GPU once per token range and stay there: a
    // trainer's tensors already live on the GPU, and uploading gigabytes every
    // step would put seconds of host work, and the ranks' skew in it, between
    // the barrier and the timed forward.
    std::unique_ptr<DeviceStep> transient;
    DeviceStep* dev = nullptr;
    if (&in == &local_) {
      if (!device_local_) device_local_ = upload(in, output_sizes(d, L));
      dev = device_local_.get();
    } else {
      transient = upload(in, output_sizes(d, L));
      dev = transient.get();
    }
    fa.q = dev->q.view(qk);
    fa.k = dev->k.view(qk);
    fa.v = dev->v.view(vo);
    fa.g = dev->g.view(gs);
    fa.beta = dev->beta.view(bth);
    if (dev->cu)
      fa.cu_seqlens = TensorView(dev->cu->data(), DType::i64, {static_cast<int64_t>(cu.size())},
                                 Memory::device);
    fa.initial_state = dev->h0.view(states);
    fa.o = dev->o.view(vo);
    fa.final_state = dev->ht.view(states);
    if (backward_) {
      ba.d_o = dev->d_o.view(vo);
      ba.d_final_state = dev->dht.view(states);
      ba.dq = dev->dq.view(qk);
      ba.dk = dev->dk.view(qk);
      ba.dv = dev->dv.view(vo);
      ba.dg = dev->dg.view(gs);
      ba.dbeta = dev->dbeta.view(bth);
      ba.d_initial_state = dev->dh0.view(states);
    }
    const StepTimes t = run_step(mixer, fa, ba);
    if (copy_back) {
      for (auto [from, to] : {std::pair{&dev->o, &out.o},
                              {&dev->ht, &out.ht},
                              {&dev->dq, &out.dq},
                              {&dev->dk, &out.dk},
                              {&dev->dv, &out.dv},
                              {&dev->dg, &out.dg},
                              {&dev->dbeta, &out.dbeta},
                              {&dev->dh0, &out.dh0}})
        from->to_host(*to);
    }
    return t;
  }
#else
  (void)copy_back;
#endif

  fa.q = view(in.q, qk);
  fa.k = view(in.k, qk);
  fa.v = view(in.v, vo);
  if (has_gate(v)) fa.g = view(in.g, gs);
  if (has_beta(v)) fa.beta = view(in.beta, bth);
  if (!cu.empty())
    fa.cu_seqlens = TensorView(cu.data(), DType::i64, {static_cast<int64_t>(cu.size())});
  if (!in.h0.empty()) fa.initial_state = view(in.h0, states);
  fa.o = view(out.o, vo);
  fa.final_state = view(out.ht, states);
  if (backward_) {
    ba.d_o = view(in.d_o, vo);
    if (!in.dht.empty()) ba.d_final_state = view(in.dht, states);
    ba.dq = view(out.dq, qk);
    ba.dk = view(out.dk, qk);
    ba.dv = view(out.dv, vo);
    if (has_gate(v)) ba.dg = view(out.dg, gs);
    if (has_beta(v)) ba.dbeta = view(out.dbeta, bth);
    if (!out.dh0.empty()) ba.d_initial_state = view(out.dh0, states);
  }
  return run_step(mixer, fa, ba);
}

namespace {

// The footer's phase split of one CpMixer call.
PassPhases phases_of(const CpStepStats& st) {
  PassPhases p;
  p.s[0] = st.local_s;
  p.s[1] = st.summary_s;
  p.s[2] = st.exchange_s;
  p.s[3] = st.merge_s;
  p.s[4] = st.total_s;
  p.s[5] = st.prepare_s;
  return p;
}

}  // namespace

// Forward (+ backward when the run has one) with their wall times (CpMixer
// returns once its outputs are complete, on either device).
StepTimes Job::run_step(CpMixer& mixer, const CpForwardArgs& fa, const CpBackwardArgs& ba) {
  StepTimes t;
  const auto t0 = Clock::now();
  mixer.forward(fa);
  t.fwd_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const CpStepStats& fs = mixer.last_forward_stats();
  t.fwd = phases_of(fs);
  t.exchange_s = fs.exchange_s;
  t.exchange_bytes = static_cast<double>(fs.exchange_bytes);
  t.hidden_s = fs.hidden_s;
  if (!backward_) return t;
  const auto t1 = Clock::now();
  mixer.backward(ba);
  t.bwd_s = std::chrono::duration<double>(Clock::now() - t1).count();
  const CpStepStats& bs = mixer.last_backward_stats();
  t.bwd = phases_of(bs);
  t.exchange_s += bs.exchange_s;
  t.exchange_bytes += static_cast<double>(bs.exchange_bytes);
  t.hidden_s += bs.hidden_s;
  return t;
}

// --device cuda: this rank's GPU (local rank modulo the visible GPUs) and,
// with several ranks and an NCCL build, an NCCL communicator over MPI so that
// the exchange stays on the GPU; otherwise the exchange is staged through
// host memory over MPI. Collective (NCCL's creation is).
void Job::setup_device(const MpiCommunicator* mpi) {
  if (device_ != DeviceKind::cuda) return;
#ifdef STATESCAN_HAS_CUDA
  int devices = 0;
  collective_check(comm_, [&] {
    SS_CUDA_CHECK(cudaGetDeviceCount(&devices));
    SS_CUDA_CHECK(cudaSetDevice((mpi != nullptr ? mpi->local_rank() : 0) % devices));
  });
  comm_description_ = comm_.size() == 1 ? "single rank" : "mpi (host-staged exchange)";
  if (mpi == nullptr) return;
  auto& world = const_cast<MpiCommunicator&>(*mpi);
  if (!exchange_over_nccl(options_.cp_comm, world)) return;
#ifdef STATESCAN_HAS_NCCL
  collective_check(comm_, [&] { SS_CUDA_CHECK(cudaStreamCreate(&nccl_stream_)); });
  nccl_ = NcclCommunicator::create(world, nccl_stream_);
  cp_comm_ = nccl_.get();
  comm_description_ = "nccl (device exchange)";
#endif
#else
  (void)mpi;
#endif
}

// Rank 0 runs the whole sequence as one rank: the oracle of --check. The
// others wait in the agreement, which also carries a failure on rank 0 to them.
void Job::run_reference() {
  collective_check(comm_, [&] {
    if (!root()) return;
    SingleRankCommunicator single;
    CpMixer mixer(single, config_, options_.exchange);
    const TokenRange full = source_->tokens(0, dims_.seq_len);
    allocate(reference_, dims_, dims_.seq_len);
    step(mixer, full, reference_, true);
  });
}

// The step's outputs in the full-sequence layout on rank 0 (states are
// already replicated by CpMixer).
Outputs Job::gather(const Outputs& local) {
  const Dims& d = dims_;
  const int64_t B = d.batch, H = d.heads;
  const int64_t gate_width = vector_gate(options_.variant) ? H * d.dk : H;
  Outputs full;
  full.o = gather_tokens(comm_, local.o, offsets_, B, H * d.dv);
  if (backward_) {
    full.dq = gather_tokens(comm_, local.dq, offsets_, B, H * d.dk);
    full.dk = gather_tokens(comm_, local.dk, offsets_, B, H * d.dk);
    full.dv = gather_tokens(comm_, local.dv, offsets_, B, H * d.dv);
    if (!local.dg.empty()) full.dg = gather_tokens(comm_, local.dg, offsets_, B, gate_width);
    if (!local.dbeta.empty()) full.dbeta = gather_tokens(comm_, local.dbeta, offsets_, B, H);
  }
  if (root()) {
    full.ht = local.ht;
    full.dh0 = local.dh0;
  }
  return full;
}

// The outputs this run produces, by file/report name, with their
// full-sequence shapes, in report order.
std::vector<NamedArray> Job::named(const Outputs& o) const {
  const Dims& d = dims_;
  const Shape qk{d.batch, d.seq_len, d.heads, d.dk}, vo{d.batch, d.seq_len, d.heads, d.dv};
  const Shape bth{d.batch, d.seq_len, d.heads}, states{d.sequences, d.heads, d.dk, d.dv};
  std::vector<NamedArray> list{{"o", vo, &o.o}, {"ht", states, &o.ht}};
  if (!backward_) return list;
  list.insert(list.end(), {{"dq", qk, &o.dq}, {"dk", qk, &o.dk}, {"dv", vo, &o.dv}});
  if (has_gate(options_.variant))
    list.push_back({"dg", vector_gate(options_.variant) ? qk : bth, &o.dg});
  if (has_beta(options_.variant)) list.push_back({"dbeta", bth, &o.dbeta});
  if (source_->has_h0()) list.push_back({"dh0", states, &o.dh0});
  return list;
}

// `link`: what `auto` resolved the exchange with (null: none).
std::vector<std::pair<std::string, std::string>> Job::header_fields(Exchange resolved,
                                                                    const LinkModel* link) const {
  const Dims& d = dims_;
  std::string shards;
  for (std::size_t r = 0; r + 1 < offsets_.size(); ++r)
    shards += (r ? "," : "") + std::to_string(offsets_[r + 1] - offsets_[r]);
  std::string exchange = comm_.size() == 1 ? std::string("none (1 rank)") : to_string(resolved);
  if (comm_.size() > 1 && options_.exchange == Exchange::automatic) {
    exchange += " (auto";
    if (link != nullptr) {
      char figures[128];
      std::snprintf(figures, sizeof figures, "; link %.3g us measured, %.3g GB/s %s",
                    link->latency_s * 1e6, link->bandwidth_Bps * 1e-9,
                    link->bandwidth_measured ? "measured" : "preset (transfer below the noise)");
      exchange += figures;
    }
    exchange += ")";
  }
  char scale[32];
  std::snprintf(scale, sizeof scale, "%.6g", config_.scale_for(d.dk));
  return {
      {"variant", to_string(options_.variant)},
      {"B", std::to_string(d.batch)},
      {"T", std::to_string(d.seq_len)},
      {"H", std::to_string(d.heads)},
      {"Dk", std::to_string(d.dk)},
      {"Dv", std::to_string(d.dv)},
      {"chunk", std::to_string(options_.chunk)},
      {"dtype", to_string(options_.dtype)},
      {"scale", scale},
      {"l2norm", options_.l2norm ? "on" : "off"},
      {"chunk states", options_.recompute_states ? "recomputed"
                       : options_.keep_prepared  ? "saved, prepared tiles kept"
                                                 : "saved"},
      {"sequences", std::to_string(d.sequences) + (source_->packed() ? " (packed)" : "")},
      {"ranks", std::to_string(comm_.size())},
      {"exchange", exchange},
      {"device", to_string(device_)},
      {"comm", comm_description_},
      {"threads/rank", std::to_string(num_threads())},
      {"pass", backward_ ? "fwd+bwd" : "fwd"},
      {"inputs", source_->description()},
      {"shards", shards},
      {"warmup", std::to_string(options_.warmup)},
      {"iters", std::to_string(options_.iters)},
      {"metrics", metrics_ ? "http://" + metrics_->address() + "/metrics (port + local rank)"
                           : std::string("off")},
  };
}

// One line on stderr per failing rank.
void report_error(const char* what) {
  std::fprintf(stderr, "statescan-run: %s\n", what);
}

}  // namespace
}  // namespace statescan::launch

int main(int argc, char** argv) {
  using namespace statescan;
  using namespace statescan::launch;
  std::unique_ptr<MpiEnvironment> mpi;
  try {
    mpi = std::make_unique<MpiEnvironment>(&argc, &argv);
  } catch (const std::exception& e) {
    report_error(e.what());
    return kExitRuntime;
  }
  int code = kExitOk;
  bool agreed = true;  // did every rank reach the same failure?
  int ranks = 1;
  {
    Stage stage = Stage::setup;
    try {
      auto world = MpiCommunicator::world();
      ranks = world->size();
      Job job(*world, stage);
      code = job.run(argc, argv);
    } catch (const RuntimeFailure& e) {
      report_error(e.what());
      code = kExitRuntime;
    } catch (const MetricsUnavailable& e) {
      report_error(e.what());  // every rank agreed (start_metrics is collective)
      code = kExitMetrics;
    } catch (const Error& e) {
      report_error(e.what());
      if (e.argument() == "mpi" || e.argument() == "nccl" || e.argument() == "cuda") {
        // Communication failed (a peer died, a timeout) or the device did
        // (out of memory on one rank, a faulted GPU): a runtime failure this
        // rank may have seen alone, with peers waiting in a collective for it,
        // so only an abort ends the job.
        code = kExitRuntime;
        agreed = false;
      } else {
        // Argument and input faults: identical argv on every rank, and the
        // library validates collectively. A fault while writing results that
        // escaped the agreement is a runtime failure seen by this rank alone.
        code = stage == Stage::results ? kExitRuntime : kExitBadInput;
        agreed = stage != Stage::results;
      }
    } catch (const std::exception& e) {
      report_error(e.what());
      code = kExitRuntime;
      agreed = false;
    }
  }
  // Other ranks may wait in a collective for this one: take the job down.
  if (!agreed && ranks > 1) MPI_Abort(MPI_COMM_WORLD, code);
  return code;
}
