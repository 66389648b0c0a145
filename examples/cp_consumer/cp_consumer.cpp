// cp_consumer: the calls a trainer makes into an installed statescan.
//
// Every rank of `mpirun -np P cp_consumer` holds one contiguous shard of a
// KDA layer's sequence, runs the context-parallel forward and backward on it
// for a few steps with the metrics exporter attached, checks its shard of the
// output and gradients against a single-rank run of the whole sequence, and
// prints what the metrics recorded. Exit status 0 only if the check passes and
// the metrics add up.
//
//   mpirun -np 2 cp_consumer                      # record metrics, no HTTP
//   mpirun -np 2 cp_consumer --metrics-port 9400  # also serve :9400, :9401
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "consumer_check.h"
#include "core/cli_parse.h"
#include "core/error.h"
#include "monitoring/flop_model.h"
#include "monitoring/metrics_exporter.h"
#include "parallel/cp_mixer.h"

namespace {

using statescan::DType;
using statescan::TensorView;

constexpr int64_t kBatch = 1, kSeqLen = 2048, kHeads = 2, kDk = 32, kDv = 32;
constexpr int kSteps = 3;
constexpr double kTolerance = 1e-5;  // fp32 CP vs fp32 single rank: summation order only

// A KDA layer's inputs and output cotangent over the whole sequence. Every rank
// draws the same numbers (same seed), as a trainer's ranks would hold the same
// global batch.
struct LayerInputs {
  std::vector<float> q, k, v, g, beta, d_o;
};

LayerInputs make_inputs(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const auto tokens = static_cast<std::size_t>(kBatch * kSeqLen * kHeads);
  auto draw = [&](std::size_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = normal(rng);
    return x;
  };
  LayerInputs in;
  in.q = draw(tokens * kDk);
  in.k = draw(tokens * kDk);
  in.v = draw(tokens * kDv);
  in.g = draw(tokens * kDk);  // vector decay: log alpha = logsigmoid(N(0,1) + 4)
  for (float& e : in.g) e = -std::log1p(std::exp(-(e + 4.f)));
  in.beta = draw(tokens);
  for (float& e : in.beta) e = 1.f / (1.f + std::exp(-e));
  in.d_o = draw(tokens * kDv);
  return in;
}

// Tokens [t0, t1) of a [B, T, H, inner] tensor.
std::vector<float> shard_of(const std::vector<float>& x, int64_t t0, int64_t t1, int64_t inner) {
  std::vector<float> out;
  for (int64_t b = 0; b < kBatch; ++b) {
    const auto* row = x.data() + (b * kSeqLen + t0) * kHeads * inner;
    out.insert(out.end(), row, row + (t1 - t0) * kHeads * inner);
  }
  return out;
}

// One rank's shard and the buffers the mixer writes.
struct Shard {
  int64_t t0 = 0, t1 = 0;
  std::vector<float> q, k, v, g, beta, d_o;
  std::vector<float> o, dq, dk, dv, dg, dbeta;

  Shard(const LayerInputs& in, int64_t begin, int64_t end) : t0(begin), t1(end) {
    q = shard_of(in.q, t0, t1, kDk);
    k = shard_of(in.k, t0, t1, kDk);
    v = shard_of(in.v, t0, t1, kDv);
    g = shard_of(in.g, t0, t1, kDk);
    beta = shard_of(in.beta, t0, t1, 1);
    d_o = shard_of(in.d_o, t0, t1, kDv);
    o.resize(v.size());
    dq.resize(q.size());
    dk.resize(k.size());
    dv.resize(v.size());
    dg.resize(g.size());
    dbeta.resize(beta.size());
  }
  int64_t tokens() const { return kBatch * (t1 - t0); }
};

// Forward then backward of `mixer` on `s` (no initial state, no final-state
// gradient: a layer in the middle of a model's first chunk).
void forward_backward(statescan::CpMixer& mixer, Shard& s) {
  const int64_t L = s.t1 - s.t0;
  const statescan::Shape qk{kBatch, L, kHeads, kDk}, vo{kBatch, L, kHeads, kDv},
      bth{kBatch, L, kHeads};
  statescan::CpForwardArgs f;
  f.q = TensorView(s.q.data(), DType::f32, qk);
  f.k = TensorView(s.k.data(), DType::f32, qk);
  f.v = TensorView(s.v.data(), DType::f32, vo);
  f.g = TensorView(s.g.data(), DType::f32, qk);
  f.beta = TensorView(s.beta.data(), DType::f32, bth);
  f.o = TensorView(s.o.data(), DType::f32, vo);
  mixer.forward(f);

  statescan::CpBackwardArgs b;
  b.d_o = TensorView(s.d_o.data(), DType::f32, vo);
  b.dq = TensorView(s.dq.data(), DType::f32, qk);
  b.dk = TensorView(s.dk.data(), DType::f32, qk);
  b.dv = TensorView(s.dv.data(), DType::f32, vo);
  b.dg = TensorView(s.dg.data(), DType::f32, qk);
  b.dbeta = TensorView(s.dbeta.data(), DType::f32, bth);
  mixer.backward(b);
}

int parse_port(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--metrics-port") == 0) {
      SS_CHECK_ARG(i + 1 < argc, "--metrics-port", "needs a value");
      return static_cast<int>(statescan::parse_int(argv[i + 1], "--metrics-port", 1, 65535));
    }
    SS_FAIL(argv[i], "unknown argument (usage: cp_consumer [--metrics-port PORT])");
  }
  return -1;
}

int run(int argc, char** argv) {
  const int base_port = parse_port(argc, argv);
  auto world = statescan::MpiCommunicator::world();
  const int rank = world->rank(), ranks = world->size();

  statescan::MixerConfig config;
  config.variant = statescan::Variant::kda;
  config.chunk = 64;
  config.l2norm_qk = true;  // KDA normalises q and k inside the op

  // One exporter per rank; ranks on one node take consecutive ports.
  statescan::MetricsOptions mo;
  mo.rank = rank;
  mo.variant = statescan::to_string(config.variant);
  mo.port = base_port < 0 ? -1 : base_port + world->local_rank();
  statescan::MetricsExporter metrics(mo);

  const LayerInputs inputs = make_inputs(/*seed=*/20261130);
  Shard shard(inputs, kSeqLen * rank / ranks, kSeqLen * (rank + 1) / ranks);
  statescan::CpMixer mixer(*world, config, statescan::Exchange::automatic, &metrics);

  statescan::FlopShape flop_shape{config.variant, shard.tokens(), kHeads, kDk, kDv, config.chunk};
  const double step_flops = statescan::chunkwise_step_flops(flop_shape, /*with_backward=*/true);
  for (int step = 0; step < kSteps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    forward_backward(mixer, shard);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    metrics.on_step({shard.tokens(), seconds, step_flops});
  }

  // The same layer on one rank over the whole sequence: CP must not change it.
  statescan::SingleRankCommunicator single;
  statescan::CpMixer whole_mixer(single, config, statescan::Exchange::allgather);
  Shard whole(inputs, 0, kSeqLen);
  forward_backward(whole_mixer, whole);
  double worst = 0;
  auto compare = [&](const std::vector<float>& got, const std::vector<float>& full, int64_t inner) {
    worst = std::max(worst, consumer::rel_rms(got, shard_of(full, shard.t0, shard.t1, inner)));
  };
  compare(shard.o, whole.o, kDv);
  compare(shard.dq, whole.dq, kDk);
  compare(shard.dk, whole.dk, kDk);
  compare(shard.dv, whole.dv, kDv);
  compare(shard.dg, whole.dg, kDk);
  compare(shard.dbeta, whole.dbeta, 1);
  world->all_reduce_max(&worst, 1, statescan::CommType::f64);

  // What the metrics recorded, one rank after the other.
  const statescan::MetricsSnapshot snap = metrics.snapshot();
  const bool tokens_ok = snap.steps == kSteps && snap.tokens_total == kSteps * shard.tokens();
  // Exchange volume by strategy ("auto": the mixer did not report the one it resolved).
  std::string exchange = "none";
  int64_t bytes = 0;
  for (statescan::Exchange e : {statescan::Exchange::allgather, statescan::Exchange::ring,
                                statescan::Exchange::tree, statescan::Exchange::automatic}) {
    if (snap.bytes(e) == 0) continue;
    exchange = e == statescan::Exchange::automatic ? "auto" : statescan::to_string(e);
    bytes += snap.bytes(e);
  }
  for (int r = 0; r < ranks; ++r) {
    world->barrier();
    if (r != rank) continue;
    std::printf(
        "rank %d: tokens [%lld, %lld)  steps %lld  tokens_total %lld  fwd %.4f s  bwd %.4f s  "
        "exchange %.5f s %lld B (%s)  %.3g tokens/s  %.3g TFLOP/s%s%s\n",
        rank, static_cast<long long>(shard.t0), static_cast<long long>(shard.t1),
        static_cast<long long>(snap.steps), static_cast<long long>(snap.tokens_total),
        snap.phase(statescan::Phase::fwd), snap.phase(statescan::Phase::bwd),
        snap.phase(statescan::Phase::exchange), static_cast<long long>(bytes), exchange.c_str(),
        snap.tokens_per_second, snap.achieved_tflops, metrics.serving() ? "  serving " : "",
        metrics.address().c_str());
    std::fflush(stdout);
  }
  world->barrier();
  if (rank == 0 && statescan::MetricsExporter::serving_available()) {
    // The same numbers in the Prometheus text format, as /metrics serves them.
    std::istringstream text(metrics.exposition_text());
    for (std::string line; std::getline(text, line);)
      if (line.rfind("statescan_tokens_total", 0) == 0)
        std::printf("exposition: %s\n", line.c_str());
  }
  if (rank == 0) {
    std::printf("check: worst relative RMS error vs single rank %.3g (tolerance %.0e) %s\n", worst,
                kTolerance, worst <= kTolerance ? "ok" : "FAILED");
  }
  int64_t failed = (worst <= kTolerance && tokens_ok) ? 0 : 1;
  world->all_reduce_max(&failed, 1, statescan::CommType::i64);
  return static_cast<int>(failed);
}

}  // namespace

int main(int argc, char** argv) {
  return consumer::main_of("cp_consumer", argc, argv, run);
}
