// lact_consumer: the calls a trainer makes into an installed statescan for a
// LaCT layer (large-chunk test-time training, kernels/cpu/lact.h).
//
// Every rank of `mpirun -np P lact_consumer` holds slice r of every chunk of
// one LaCT layer's sequence (lact_shard: LaCT shards inside each chunk, where
// the linear-attention mixers shard contiguously), runs the forward and the
// backward with one all-reduce of the fast-weight gradients per chunk, and
// checks its slices of the output and the token gradients, and the initial
// weights' gradients (the same on every rank), against a single-rank run of
// the whole sequence. Exit status 0 only if the check passes.
//
//   mpirun -np 2 lact_consumer
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "consumer_check.h"
#include "core/error.h"
#include "kernels/cpu/lact.h"
#include "parallel/lact_layer.h"

namespace {

using statescan::DType;
using statescan::LactShapes;
using statescan::Shape;
using statescan::TensorView;

constexpr int64_t kBatch = 1, kSeqLen = 1024, kHeads = 2, kDim = 16, kHidden = 32;
// fp32 sharded vs fp32 single rank: only the order of the gradient sums
// differs (the README measures up to 2.5e-6 with Muon and momentum).
constexpr double kTolerance = 1e-5;

// The layer's inputs over the whole sequence, the same on every rank (same
// seed), as a trainer's ranks hold the same global batch: q and k unit rows
// (the SwiGLU pre-activations are then O(1), where silu bends), learning
// rates in (0.01, 0.11).
struct LayerInputs {
  std::vector<float> q, k, v, lr0, lr1, lr2, w0, w1, w2, d_o;
};

LayerInputs make_inputs(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  const auto tokens = static_cast<std::size_t>(kBatch * kSeqLen * kHeads);
  const auto weights = static_cast<std::size_t>(kHeads * kHidden * kDim);
  auto draw = [&](std::size_t n, float scale) {
    std::vector<float> x(n);
    for (float& e : x) e = scale * normal(rng);
    return x;
  };
  auto unit_rows = [&](std::vector<float> x) {
    for (std::size_t r = 0; r < x.size(); r += kDim) {
      float s = 0;
      for (int64_t d = 0; d < kDim; ++d) s += x[r + d] * x[r + d];
      for (int64_t d = 0; d < kDim; ++d) x[r + d] /= std::sqrt(s);
    }
    return x;
  };
  auto rates = [&] {
    std::vector<float> x(tokens);
    for (float& e : x) e = 0.01f + 0.1f * uniform(rng);
    return x;
  };
  LayerInputs in;
  in.q = unit_rows(draw(tokens * kDim, 1.f));
  in.k = unit_rows(draw(tokens * kDim, 1.f));
  in.v = draw(tokens * kDim, 1.f);
  in.lr0 = rates();
  in.lr1 = rates();
  in.lr2 = rates();
  in.w0 = draw(weights, 1.f);
  in.w1 = draw(weights, 1.f / std::sqrt(static_cast<float>(kHidden)));
  in.w2 = draw(weights, 1.f);
  in.d_o = draw(tokens * kDim, 1.f);
  return in;
}

// One run's tokens (this rank's slices, or the whole sequence) and outputs.
struct Run {
  int64_t len = 0;  // tokens per batch row
  std::vector<float> q, k, v, lr0, lr1, lr2, d_o;
  std::vector<float> o, dq, dk, dv, dlr0, dlr1, dlr2, dw0, dw1, dw2;
};

// Rank `rank`'s slices of every chunk (ranks = 1: the whole sequence).
Run slices_of(const LayerInputs& in, int64_t chunk, int64_t ranks, int64_t rank) {
  auto shard = [&](const std::vector<float>& x, int64_t inner) {
    return statescan::lact_shard(x, kBatch, kSeqLen, kHeads * inner, chunk, ranks, rank);
  };
  Run r;
  r.len = kSeqLen / ranks;
  r.q = shard(in.q, kDim);
  r.k = shard(in.k, kDim);
  r.v = shard(in.v, kDim);
  r.lr0 = shard(in.lr0, 1);
  r.lr1 = shard(in.lr1, 1);
  r.lr2 = shard(in.lr2, 1);
  r.d_o = shard(in.d_o, kDim);
  r.o.resize(r.q.size());
  r.dq.resize(r.q.size());
  r.dk.resize(r.q.size());
  r.dv.resize(r.q.size());
  r.dlr0.resize(r.lr0.size());
  r.dlr1.resize(r.lr0.size());
  r.dlr2.resize(r.lr0.size());
  r.dw0.resize(in.w0.size());
  r.dw1.resize(in.w1.size());
  r.dw2.resize(in.w2.size());
  return r;
}

// Forward then backward of a LaCT layer over `comm` on the run's tokens.
statescan::LactExchangeStats forward_backward(statescan::Communicator& comm,
                                              const statescan::LactConfig& config,
                                              const LayerInputs& in, Run& r) {
  // This rank's tensor shapes (LactShapes: tokens, rates, wide W0/W2, narrow W1).
  const LactShapes x(kBatch, r.len, kHeads, kDim, kHidden);
  const Shape &tokens = x.tokens, &rates = x.rates, &wide = x.wide, &narrow = x.narrow;
  auto view = [](const std::vector<float>& x, const Shape& s) {
    return TensorView(const_cast<float*>(x.data()), DType::f32, s);
  };
  statescan::LactLayer layer(comm, config);
  statescan::LactForwardArgs f;
  f.q = view(r.q, tokens);
  f.k = view(r.k, tokens);
  f.v = view(r.v, tokens);
  f.lr0 = view(r.lr0, rates);
  f.lr1 = view(r.lr1, rates);
  f.lr2 = view(r.lr2, rates);
  f.w0 = view(in.w0, wide);
  f.w1 = view(in.w1, narrow);
  f.w2 = view(in.w2, wide);
  f.o = view(r.o, tokens);
  layer.forward(f);

  statescan::LactBackwardArgs b;
  b.d_o = view(r.d_o, tokens);
  b.dq = view(r.dq, tokens);
  b.dk = view(r.dk, tokens);
  b.dv = view(r.dv, tokens);
  b.dlr0 = view(r.dlr0, rates);
  b.dlr1 = view(r.dlr1, rates);
  b.dlr2 = view(r.dlr2, rates);
  b.dw0 = view(r.dw0, wide);
  b.dw1 = view(r.dw1, narrow);
  b.dw2 = view(r.dw2, wide);
  layer.backward(b);
  statescan::LactExchangeStats total = layer.last_forward_exchange();
  total.calls += layer.last_backward_exchange().calls;
  total.bytes += layer.last_backward_exchange().bytes;
  total.seconds += layer.last_backward_exchange().seconds;
  return total;
}

int run() {
  auto world = statescan::MpiCommunicator::world();
  const int rank = world->rank(), ranks = world->size();

  statescan::LactConfig config;
  config.chunk = 256;  // 4 chunks; every one split over the ranks
  config.schedule = statescan::LactSchedule::apply_then_update;
  config.momentum = 0.5;
  config.muon_steps = 3;
  SS_CHECK_ARG(config.chunk % ranks == 0, "ranks", "lact_consumer splits chunks of ", config.chunk,
               " tokens: run it on a number of ranks that divides them, not ", ranks);

  const LayerInputs inputs = make_inputs(/*seed=*/20261204);
  Run mine = slices_of(inputs, config.chunk, ranks, rank);
  const statescan::LactExchangeStats exchange = forward_backward(*world, config, inputs, mine);

  // The same layer on one rank over the whole sequence, cut the same way.
  statescan::SingleRankCommunicator single;
  Run whole = slices_of(inputs, config.chunk, 1, 0);
  forward_backward(single, config, inputs, whole);
  auto mine_of = [&](const std::vector<float>& full, int64_t inner) {
    return statescan::lact_shard(full, kBatch, kSeqLen, kHeads * inner, config.chunk, ranks, rank);
  };
  double worst = 0;
  worst = std::max(worst, consumer::rel_rms(mine.o, mine_of(whole.o, kDim)));
  worst = std::max(worst, consumer::rel_rms(mine.dq, mine_of(whole.dq, kDim)));
  worst = std::max(worst, consumer::rel_rms(mine.dk, mine_of(whole.dk, kDim)));
  worst = std::max(worst, consumer::rel_rms(mine.dv, mine_of(whole.dv, kDim)));
  worst = std::max(worst, consumer::rel_rms(mine.dlr0, mine_of(whole.dlr0, 1)));
  worst = std::max(worst, consumer::rel_rms(mine.dlr1, mine_of(whole.dlr1, 1)));
  worst = std::max(worst, consumer::rel_rms(mine.dlr2, mine_of(whole.dlr2, 1)));
  worst = std::max(worst, consumer::rel_rms(mine.dw0, whole.dw0));
  worst = std::max(worst, consumer::rel_rms(mine.dw1, whole.dw1));
  worst = std::max(worst, consumer::rel_rms(mine.dw2, whole.dw2));
  world->all_reduce_max(&worst, 1, statescan::CommType::f64);

  for (int r = 0; r < ranks; ++r) {
    world->barrier();
    if (r != rank) continue;
    std::printf(
        "rank %d: %lld tokens (slice %d of each of %lld chunks)  all-reduces %lld, "
        "%.0f B, %.4f s\n",
        rank, static_cast<long long>(kBatch * mine.len), rank,
        static_cast<long long>(statescan::lact_num_chunks(kSeqLen, config.chunk)),
        static_cast<long long>(exchange.calls), exchange.bytes, exchange.seconds);
    std::fflush(stdout);
  }
  world->barrier();
  if (rank == 0) {
    std::printf("check: worst relative RMS error vs single rank %.3g (tolerance %.0e) %s\n", worst,
                kTolerance, worst <= kTolerance ? "ok" : "FAILED");
  }
  return worst <= kTolerance ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return consumer::main_of("lact_consumer", argc, argv, [](int, char**) { return run(); });
}
