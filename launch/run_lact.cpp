#include "launch/run_lact.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/collective_check.h"
#include "core/error.h"
#include "core/parallel_for.h"
#include "kernels/cpu/lact.h"
#include "launch/run_comm.h"
#include "launch/run_inputs.h"
#include "launch/run_metrics.h"
#include "monitoring/flop_model.h"
#include "monitoring/metrics_exporter.h"
#include "parallel/lact_layer.h"
#ifdef STATESCAN_HAS_CUDA
#include <cuda_runtime.h>

#include "comm/mpi_communicator.h"
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

// Sharded and unsharded runs are both fp32 on the CPU and differ only in the
// order of the fast-weight gradient sums (partial per rank, then all-reduced).
// Measured up to 1.6e-6 on the CLI test shapes (D = 8, M = 16) and up to
// 2.5e-6 at D = 64, M = 128 with Muon and momentum on 2-4 ranks (README
// "LaCT layers"): 1e-5 leaves a margin of four.
constexpr double kLactCheckTolerance = 1e-5;
// --device cuda with --dtype bf16 against the fp32 CPU reference: bf16 GEMM
// operands put the GPU within 5e-3 (o), 8e-3 (dq, dk, dv, dw) and 2e-2 (the
// learning rates' gradients, DESIGN's dg/dbeta bound) of the fp64 reference
// (tests/test_cuda_lact.cpp); the fp32 CPU is within ~4e-6 of it. One bound
// covers every output here: the loosest.
constexpr double kLactCheckTolerance16 = 2e-2;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Every output and gradient of one step: token tensors are local slices on
// the ranks of a sharded run, dw0..2 are full on every rank.
struct LactOutputs {
  std::vector<float> o, dq, dk, dv, dlr0, dlr1, dlr2, dw0, dw1, dw2;
};

// One rank's (or the whole sequence's) inputs, fp32.
struct LactSlice {
  std::vector<float> q, k, v, lr0, lr1, lr2, d_o;
  int64_t length = 0;  // tokens per batch row
};

TensorView view(const std::vector<float>& x, Shape shape) {
  // LactLayer reads inputs through non-const views; it never writes them.
  return TensorView(const_cast<float*>(x.data()), DType::f32, std::move(shape));
}

class LactJob {
 public:
  LactJob(Communicator& comm, const RunOptions& options, Stage& stage, MetricsExporter* metrics)
      : comm_(comm), options_(options), stage_(stage), metrics_(metrics) {}
  int run();

 private:
  bool root() const { return comm_.rank() == 0; }
  void setup();
  void allocate(LactOutputs& out, int64_t length) const;
  void add_exchange(const LactLayer& layer, StepTimes& t) const;
  void report_step_metrics(const StepTimes& t) const;
  StepTimes step(LactLayer& layer, const LactSlice& in,
                 LactOutputs& out) const;
  void run_reference();
  std::vector<float> gather(const std::vector<float>& local, int64_t inner);
  LactOutputs gather(const LactOutputs& local);
  std::vector<NamedArray> named(const LactOutputs& o) const;
  std::vector<std::pair<std::string, std::string>> header_fields() const;
  // The all-reduce path of the layer: "nccl", "mpi, host-staged" (device
  // tensors over MPI) or the host communicator's backend.
  std::string comm_kind() const;
  double check_tolerance() const {
    return device_ == DeviceKind::cuda && options_.dtype != DType::f32 ? kLactCheckTolerance16
                                                                       : kLactCheckTolerance;
  }
#ifdef STATESCAN_HAS_CUDA
  struct DeviceRun;
  void setup_device();
  StepTimes step_device(LactLayer& layer, LactOutputs& out, bool copy_back);
  std::unique_ptr<DeviceRun> device_run_;
#endif

  Communicator& comm_;
  const RunOptions& options_;
  Stage& stage_;
  MetricsExporter* metrics_;  // null without --metrics-port
  LactConfig config_;
  LactData data_;  // the whole problem (every rank)
  LactSlice local_;
  bool backward_ = false;
  DeviceKind device_ = DeviceKind::cpu;
  LactOutputs reference_;  // rank 0, with --check
};

#ifdef STATESCAN_HAS_CUDA
// --device cuda: this rank's slices and outputs in GPU memory (in --dtype),
// and, over several ranks with NCCL, the NCCL communicator the layer uses.
struct LactJob::DeviceRun {
  DeviceArray q, k, v, lr0, lr1, lr2, w0, w1, w2, d_o;
  DeviceArray o, dq, dk, dv, dlr0, dlr1, dlr2, dw0, dw1, dw2;
  cudaStream_t stream = nullptr;
#ifdef STATESCAN_HAS_NCCL
  std::unique_ptr<NcclCommunicator> nccl;
#endif
  ~DeviceRun() {
#ifdef STATESCAN_HAS_NCCL
    nccl.reset();
#endif
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

// Selects this rank's GPU, copies the slices there and, with several ranks
// over MPI and NCCL built in, creates the NCCL communicator (collective).
void LactJob::setup_device() {
  auto run = std::make_unique<DeviceRun>();
  auto* mpi = dynamic_cast<MpiCommunicator*>(&comm_);
  collective_check(comm_, [&] {
    SS_CHECK_ARG(options_.dtype == DType::f32 || options_.dtype == DType::bf16, "--dtype",
                 "LaCT on the GPU runs f32 or bf16, got ", options_.dtype);
    int devices = 0;
    SS_CUDA_CHECK(cudaGetDeviceCount(&devices));
    const int local = mpi != nullptr ? mpi->local_rank() : 0;
    SS_CUDA_CHECK(cudaSetDevice(local % devices));
    SS_CUDA_CHECK(cudaStreamCreate(&run->stream));
    const DType t = options_.dtype;
    const LactDims& d = data_.dims;
    run->q = DeviceArray(local_.q, t);
    run->k = DeviceArray(local_.k, t);
    run->v = DeviceArray(local_.v, t);
    run->lr0 = DeviceArray(local_.lr0, t);
    run->lr1 = DeviceArray(local_.lr1, t);
    run->lr2 = DeviceArray(local_.lr2, t);
    run->w0 = DeviceArray(data_.w0, t);
    run->w1 = DeviceArray(data_.w1, t);
    run->w2 = DeviceArray(data_.w2, t);
    const auto rates = static_cast<std::size_t>(d.batch * local_.length * d.heads);
    const auto tokens = rates * static_cast<std::size_t>(d.dim);
    const auto weights = static_cast<std::size_t>(d.heads * d.hidden * d.dim);
    run->o = DeviceArray::zeros(tokens, t);
    if (backward_) {
      run->d_o = DeviceArray(local_.d_o, t);
      for (auto* x : {&run->dq, &run->dk, &run->dv}) *x = DeviceArray::zeros(tokens, t);
      for (auto* x : {&run->dlr0, &run->dlr1, &run->dlr2}) *x = DeviceArray::zeros(rates, t);
      for (auto* x : {&run->dw0, &run->dw1, &run->dw2}) *x = DeviceArray::zeros(weights, t);
    }
  });
  // The layer's all-reduces over NCCL or staged through the host over MPI,
  // by --cp-comm as for the other variants.
#ifdef STATESCAN_HAS_NCCL
  if (mpi != nullptr && exchange_over_nccl(options_.cp_comm, *mpi))
    run->nccl = NcclCommunicator::create(*mpi, run->stream);
#else
  if (mpi != nullptr) (void)exchange_over_nccl(options_.cp_comm, *mpi);  // refuses nccl
#endif
  device_run_ = std::move(run);
}

// One forward (+ backward) on the device tensors, timed on this rank (the
// layer returns when its results are complete); `copy_back` fetches the
// outputs into `out` afterwards, outside the timing.
StepTimes LactJob::step_device(LactLayer& layer, LactOutputs& out, bool copy_back) {
  DeviceRun& r = *device_run_;
  const LactDims& d = data_.dims;
  const LactShapes x(d.batch, local_.length, d.heads, d.dim, d.hidden);
  const Shape &tokens = x.tokens, &rates = x.rates, &wide = x.wide, &narrow = x.narrow;
  LactForwardArgs fa;
  fa.q = r.q.view(tokens);
  fa.k = r.k.view(tokens);
  fa.v = r.v.view(tokens);
  fa.lr0 = r.lr0.view(rates);
  fa.lr1 = r.lr1.view(rates);
  fa.lr2 = r.lr2.view(rates);
  fa.w0 = r.w0.view(wide);
  fa.w1 = r.w1.view(narrow);
  fa.w2 = r.w2.view(wide);
  fa.o = r.o.view(tokens);
  StepTimes t;
  const auto t0 = Clock::now();
  layer.forward(fa);
  t.fwd_s = seconds_since(t0);
  if (backward_) {
    LactBackwardArgs ba;
    ba.d_o = r.d_o.view(tokens);
    ba.dq = r.dq.view(tokens);
    ba.dk = r.dk.view(tokens);
    ba.dv = r.dv.view(tokens);
    ba.dlr0 = r.dlr0.view(rates);
    ba.dlr1 = r.dlr1.view(rates);
    ba.dlr2 = r.dlr2.view(rates);
    ba.dw0 = r.dw0.view(wide);
    ba.dw1 = r.dw1.view(narrow);
    ba.dw2 = r.dw2.view(wide);
    const auto t1 = Clock::now();
    layer.backward(ba);
    t.bwd_s = seconds_since(t1);
  }
  add_exchange(layer, t);
  if (copy_back) {
    r.o.to_host(out.o);
    if (backward_) {
      r.dq.to_host(out.dq);
      r.dk.to_host(out.dk);
      r.dv.to_host(out.dv);
      r.dlr0.to_host(out.dlr0);
      r.dlr1.to_host(out.dlr1);
      r.dlr2.to_host(out.dlr2);
      r.dw0.to_host(out.dw0);
      r.dw1.to_host(out.dw1);
      r.dw2.to_host(out.dw2);
    }
  }
  return t;
}
#endif

// The all-reduce path of the layer: "nccl", "<backend>, host-staged" (device
// tensors over a host communicator) or the host communicator's backend.
std::string LactJob::comm_kind() const {
#if defined(STATESCAN_HAS_CUDA) && defined(STATESCAN_HAS_NCCL)
  if (device_run_ && device_run_->nccl) return "nccl";
#endif
  if (device_ == DeviceKind::cuda) return std::string(comm_.backend()) + ", host-staged";
  return comm_.backend();
}

// Global data, this rank's slices of every chunk, and the --save directory.
// Collective: a fault on any rank fails every rank alike.
void LactJob::setup() {
  collective_check(comm_, [&] {
    data_ = options_.load_dir.empty() ? lact_synthetic(options_) : lact_from_directory(options_);
    config_ = options_.lact_config;
    check_lact_config(config_);
    const LactDims& d = data_.dims;
    const int P = comm_.size();
    // Every chunk (the last or only one may be shorter) must split evenly
    // over the ranks; the library's layout rule decides, the message names
    // the flag at fault: --lact-chunk, or T's (no chunk size splits T then).
    try {
      lact_check_split(d.seq_len, config_.chunk, P,
                       options_.load_dir.empty() ? "--seq-len" : "--load", "--lact-chunk");
    } catch (const Error& e) {
      SS_FAIL(e.argument(), "every chunk of --lact-chunk ", config_.chunk,
              " tokens of T = ", d.seq_len, " must split evenly over the ", P,
              " ranks: ", e.message());
    }
    const int64_t HD = d.heads * d.dim;
    auto shard = [&](const std::vector<float>& x, int64_t inner) {
      return lact_shard(x, d.batch, d.seq_len, inner, config_.chunk, P, comm_.rank());
    };
    local_.length = d.seq_len / P;
    local_.q = shard(data_.q, HD);
    local_.k = shard(data_.k, HD);
    local_.v = shard(data_.v, HD);
    local_.lr0 = shard(data_.lr0, d.heads);
    local_.lr1 = shard(data_.lr1, d.heads);
    local_.lr2 = shard(data_.lr2, d.heads);
    if (!data_.d_o.empty()) local_.d_o = shard(data_.d_o, HD);
    if (root()) prepare_output_locations(options_.save_dir, options_.json_path);
  });
  backward_ = !data_.d_o.empty();
}

void LactJob::allocate(LactOutputs& out, int64_t length) const {
  const LactDims& d = data_.dims;
  const auto rates = static_cast<std::size_t>(d.batch * length * d.heads);
  const auto tokens = rates * static_cast<std::size_t>(d.dim);
  const auto weights = static_cast<std::size_t>(d.heads * d.hidden * d.dim);
  out.o.assign(tokens, 0.f);
  if (!backward_) return;
  for (auto* x : {&out.dq, &out.dk, &out.dv}) x->assign(tokens, 0.f);
  for (auto* x : {&out.dlr0, &out.dlr1, &out.dlr2}) x->assign(rates, 0.f);
  for (auto* x : {&out.dw0, &out.dw1, &out.dw2}) x->assign(weights, 0.f);
}

// The layer's all-reduce time and bytes of the step just run (the forward's,
// and the backward's when the run has one).
void LactJob::add_exchange(const LactLayer& layer, StepTimes& t) const {
  t.exchange_s = layer.last_forward_exchange().seconds;
  t.exchange_bytes = layer.last_forward_exchange().bytes;
  if (!backward_) return;
  t.exchange_s += layer.last_backward_exchange().seconds;
  t.exchange_bytes += layer.last_backward_exchange().bytes;
}

// Forward (+ backward) of `layer` on `in`, timed on this rank, with the
// layer's all-reduces.
StepTimes LactJob::step(LactLayer& layer, const LactSlice& in, LactOutputs& out) const {
  const LactDims& d = data_.dims;
  const LactShapes x(d.batch, in.length, d.heads, d.dim, d.hidden);
  const Shape &tokens = x.tokens, &rates = x.rates, &wide = x.wide, &narrow = x.narrow;
  LactForwardArgs fa;
  fa.q = view(in.q, tokens);
  fa.k = view(in.k, tokens);
  fa.v = view(in.v, tokens);
  fa.lr0 = view(in.lr0, rates);
  fa.lr1 = view(in.lr1, rates);
  fa.lr2 = view(in.lr2, rates);
  fa.w0 = view(data_.w0, wide);
  fa.w1 = view(data_.w1, narrow);
  fa.w2 = view(data_.w2, wide);
  fa.o = view(out.o, tokens);
  StepTimes t;
  const auto t0 = Clock::now();
  layer.forward(fa);
  t.fwd_s = seconds_since(t0);
  if (backward_) {
    LactBackwardArgs ba;
    ba.d_o = view(in.d_o, tokens);
    ba.dq = view(out.dq, tokens);
    ba.dk = view(out.dk, tokens);
    ba.dv = view(out.dv, tokens);
    ba.dlr0 = view(out.dlr0, rates);
    ba.dlr1 = view(out.dlr1, rates);
    ba.dlr2 = view(out.dlr2, rates);
    ba.dw0 = view(out.dw0, wide);
    ba.dw1 = view(out.dw1, narrow);
    ba.dw2 = view(out.dw2, wide);
    const auto t1 = Clock::now();
    layer.backward(ba);
    t.bwd_s = seconds_since(t1);
  }
  add_exchange(layer, t);
  return t;
}

// Rank 0 runs the whole sequence as one rank: the oracle of --check. The
// others wait in the agreement, which also carries a failure on rank 0 to them.
void LactJob::run_reference() {
  collective_check(comm_, [&] {
    if (!root()) return;
    SingleRankCommunicator single;
    LactLayer layer(single, config_);
    LactSlice full;
    full.q = data_.q;
    full.k = data_.k;
    full.v = data_.v;
    full.lr0 = data_.lr0;
    full.lr1 = data_.lr1;
    full.lr2 = data_.lr2;
    full.d_o = data_.d_o;
    full.length = data_.dims.seq_len;
    allocate(reference_, full.length);
    step(layer, full, reference_);
  });
}

// Every rank's slices of a [B, T, inner] tensor into rank 0's full-sequence
// tensor, placed by lact_unshard. Other ranks return an empty vector.
std::vector<float> LactJob::gather(const std::vector<float>& local, int64_t inner) {
  constexpr int kTag = 4712;
  const LactDims& d = data_.dims;
  if (!root()) {
    comm_.send(local.data(), local.size(), CommType::f32, 0, kTag);
    return {};
  }
  std::vector<float> full(static_cast<std::size_t>(d.batch * d.seq_len * inner));
  std::vector<float> piece(local.size());  // every rank holds T/P tokens
  for (int r = 0; r < comm_.size(); ++r) {
    if (r != 0) comm_.recv(piece.data(), piece.size(), CommType::f32, r, kTag);
    lact_unshard(r == 0 ? local : piece, d.batch, d.seq_len, inner, config_.chunk, comm_.size(), r,
                 full);
  }
  return full;
}

// The step's outputs in the full-sequence layout on rank 0 (the weight
// gradients are already summed over the ranks by the layer).
LactOutputs LactJob::gather(const LactOutputs& local) {
  const LactDims& d = data_.dims;
  const int64_t HD = d.heads * d.dim;
  LactOutputs full;
  full.o = gather(local.o, HD);
  if (!backward_) return full;
  full.dq = gather(local.dq, HD);
  full.dk = gather(local.dk, HD);
  full.dv = gather(local.dv, HD);
  full.dlr0 = gather(local.dlr0, d.heads);
  full.dlr1 = gather(local.dlr1, d.heads);
  full.dlr2 = gather(local.dlr2, d.heads);
  if (root()) {
    full.dw0 = local.dw0;
    full.dw1 = local.dw1;
    full.dw2 = local.dw2;
  }
  return full;
}

// The outputs of this run with their file names and full shapes, in report order.
std::vector<NamedArray> LactJob::named(const LactOutputs& o) const {
  const LactDims& d = data_.dims;
  const LactShapes x(d.batch, d.seq_len, d.heads, d.dim, d.hidden);  // the whole sequence
  const Shape &tokens = x.tokens, &rates = x.rates, &wide = x.wide, &narrow = x.narrow;
  std::vector<NamedArray> list{{"o", tokens, &o.o}};
  if (!backward_) return list;
  list.insert(list.end(), {{"dq", tokens, &o.dq},
                           {"dk", tokens, &o.dk},
                           {"dv", tokens, &o.dv},
                           {"dlr0", rates, &o.dlr0},
                           {"dlr1", rates, &o.dlr1},
                           {"dlr2", rates, &o.dlr2},
                           {"dw0", wide, &o.dw0},
                           {"dw1", narrow, &o.dw1},
                           {"dw2", wide, &o.dw2}});
  return list;
}

std::vector<std::pair<std::string, std::string>> LactJob::header_fields() const {
  const LactDims& d = data_.dims;
  char momentum[32];
  std::snprintf(momentum, sizeof momentum, "%.6g", config_.momentum);
  const int P = comm_.size();
  return {
      {"variant", "lact"},
      {"B", std::to_string(d.batch)},
      {"T", std::to_string(d.seq_len)},
      {"H", std::to_string(d.heads)},
      {"D", std::to_string(d.dim)},
      {"M", std::to_string(d.hidden)},
      {"lact-chunk", std::to_string(config_.chunk)},
      {"schedule", to_string(config_.schedule)},
      {"momentum", momentum},
      {"muon-steps", std::to_string(config_.muon_steps)},
      {"renorm", config_.renorm ? "on" : "off"},
      {"dtype", to_string(options_.dtype)},
      {"ranks", std::to_string(P)},
      {"exchange",
       P == 1 ? std::string("none (1 rank)") : "all-reduce per chunk (" + comm_kind() + ")"},
      {"layout", "slice r of every chunk (" +
                     std::to_string(std::min(config_.chunk, d.seq_len) / P) + " tokens/rank)"},
      {"device", device_ == DeviceKind::cuda ? "cuda" : "cpu"},
      {"threads/rank", std::to_string(num_threads())},
      {"pass", backward_ ? "fwd+bwd" : "fwd"},
      {"inputs", data_.description},
      {"warmup", std::to_string(options_.warmup)},
      {"iters", std::to_string(options_.iters)},
  };
}

int LactJob::run() {
  stage_ = Stage::setup;
  if (root()) note_ignored_shape_flags(options_, "q.npy and w0.npy");
  device_ = agree_device(comm_, options_);
  setup();
#ifdef STATESCAN_HAS_CUDA
  if (device_ == DeviceKind::cuda) setup_device();
#endif

  stage_ = Stage::steps;
  Communicator* layer_comm = &comm_;
#if defined(STATESCAN_HAS_CUDA) && defined(STATESCAN_HAS_NCCL)
  if (device_run_ && device_run_->nccl) layer_comm = device_run_->nccl.get();
#endif
  LactLayer layer(*layer_comm, config_);
  LactOutputs out;
  allocate(out, local_.length);
  Report report;
  report.check.enabled = options_.check;
  report.check.tolerance = check_tolerance();
  if (options_.check) run_reference();
  LactOutputs last_full;
  const int64_t steps = options_.warmup + options_.iters;
  const LactDims& d = data_.dims;
  ProgressLine progress(root() ? options_.progress : RunOptions::Progress::never, steps,
                        options_.warmup);
  const double tokens = static_cast<double>(d.batch * d.seq_len);
  for (int64_t s = 0; s < steps; ++s) {
    comm_.barrier();  // start together, so the max over ranks is the step's time
    const bool last = s + 1 == steps;
    const bool need_outputs =
        s >= options_.warmup && (options_.check || (last && !options_.save_dir.empty()));
#ifdef STATESCAN_HAS_CUDA
    const StepTimes t = device_ == DeviceKind::cuda ? step_device(layer, out, need_outputs)
                                                    : step(layer, local_, out);
#else
    (void)need_outputs;
    const StepTimes t = step(layer, local_, out);
#endif
    report_step_metrics(t);
    if (s < options_.warmup) {
      progress.update(s + 1, tokens / (t.fwd_s + t.bwd_s));  // this rank's time
      continue;
    }

    StepRow row = reduce_step(comm_, t, s - options_.warmup + 1, backward_, tokens);

    if (options_.check || (last && !options_.save_dir.empty())) {
      LactOutputs full = gather(out);
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
    print_row(report, row, root(), header_fields());
    progress.update(s + 1, row.tokens_per_s);
  }
  progress.clear();

  stage_ = Stage::results;
  // Rank 0 writes; a write failure becomes exit 3 on every rank.
  return finish_report(comm_, report, [&] {
    write_results(options_.json_path, report, options_.save_dir, named(last_full));
  });
}

}  // namespace

// This rank's step to the exporter: the layer's phases (forward, backward,
// the all-reduces), its tokens and wall time, the counted token-GEMM FLOPs,
// and the memory of the device that computes.
void LactJob::report_step_metrics(const StepTimes& t) const {
  if (metrics_ == nullptr) return;
  const LactDims& d = data_.dims;
  metrics_->on_phase(Phase::fwd, t.fwd_s, 0);
  if (backward_) metrics_->on_phase(Phase::bwd, t.bwd_s, 0);
  metrics_->on_allreduce(t.exchange_s, static_cast<int64_t>(t.exchange_bytes));
  const int64_t tokens = d.batch * local_.length;
  const double seconds = std::max(t.fwd_s + t.bwd_s, 1e-9);  // a clock tick can read 0
  metrics_->on_step(
      {tokens, seconds, lact_step_flops(tokens * d.heads, d.dim, d.hidden, backward_)});
  const MemoryUse memory = device_memory(device_);
  metrics_->set_device_memory(memory.current_bytes, memory.peak_bytes);
}

int run_lact_job(Communicator& comm, const RunOptions& options, Stage& stage,
                 MetricsExporter* metrics) {
  LactJob job(comm, options, stage, metrics);
  return job.run();
}

}  // namespace statescan::launch
