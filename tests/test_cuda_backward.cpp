// The CUDA chunkwise backward (kernels/cuda/cuda_mixer.h mixer_backward)
// against the fp64 reference backward: all six variants x dtype x head dim,
// with initial state and final-state gradient, in-kernel L2 norm, packed
// sequences, chunk sizes 16/32/64 and partial last chunks; determinism, the
// state-gradient-only pre-pass and bad arguments. Skips where no GPU is
// present (CI has none).
//
// Tolerances (relative RMS vs fp64 on the exact inputs the GPU sees, DESIGN §7):
//   f32: 1e-5 for every gradient.
//   bf16 / f16: dq, dk, dv and dh0 8e-3; dg and dbeta 2e-2.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "core/device_buffer.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/reference.h"
#include "kernels/cuda/cp_kernels.h"
#include "kernels/cuda/cuda_mixer.h"
#include "tests/cuda_mixer_test_util.h"
#include "tests/expect_error.h"
#include "tests/test_util.h"

namespace statescan::test {
namespace {

struct Tolerances {
  double qkv, gate, state;
};

Tolerances tolerances(DType t) {
  return {grad_tol(t), gate_grad_tol(t), grad_tol(t)};
}

bool all_bytes(const std::vector<unsigned char>& x, unsigned char value) {
  for (unsigned char e : x)
    if (e != value) return false;
  return true;
}

// A forward + backward problem on the GPU: the inputs (DeviceInputs, rounded
// to what the device sees), the incoming gradients (rounded alike) and the
// outputs.
class GpuBackward {
 public:
  GpuBackward(ref::Problem& p, DType dtype, int64_t chunk, bool with_dht, uint64_t seed)
      : in_(p, dtype, chunk) {
    std::mt19937_64 rng(seed);
    d_o_host_ = randn(p.v.size(), rng);
    if (with_dht) {
      dht_host_ = randn(static_cast<size_t>(p.num_sequences() * p.heads * p.dk * p.dv), rng);
      for (auto& e : dht_host_) e = static_cast<float>(e);
    }
    d_o_ = DeviceBuffer<unsigned char>(to_storage(dtype, d_o_host_));
    if (with_dht)
      dht_ = DeviceBuffer<float>(std::vector<float>(dht_host_.begin(), dht_host_.end()));

    const size_t state = in_.state_size();
    const size_t elem = size_of(dtype);
    o_ = DeviceBuffer<unsigned char>(p.v.size() * elem);
    chunk_states_ = DeviceBuffer<float>(state * in_.num_chunks());
    dq_ = DeviceBuffer<unsigned char>(p.q.size() * elem);
    dk_ = DeviceBuffer<unsigned char>(p.k.size() * elem);
    dv_ = DeviceBuffer<unsigned char>(p.v.size() * elem);
    if (!p.g.empty()) dg_ = DeviceBuffer<float>(p.g.size());
    if (!p.beta.empty()) dbeta_ = DeviceBuffer<unsigned char>(p.beta.size() * elem);
    dh0_ = DeviceBuffer<float>(state * p.num_sequences());
  }

  // The forward, saving the chunk states the backward reads (and T where
  // saved_t is given: MixerParams::saved_t).
  void run_forward(void* saved_t = nullptr) {
    MixerParams m = forward_params();
    m.saved_t = saved_t;
    cuda::mixer_forward(m, nullptr);
    check_device_sync();
  }
  // The forward's parameters: o and the chunk states the backward reads.
  MixerParams forward_params() {
    MixerParams m = in_.params();
    m.o = o_.data();
    m.chunk_states = chunk_states_.data();
    return m;
  }

  // Backward parameters with every output poisoned (NaN bytes) first, so an
  // element the kernels never write fails the comparison.
  MixerBwdParams backward_params() {
    for (auto* b : {&dq_, &dk_, &dv_, &dbeta_}) b->fill_bytes(0xFF);
    dg_.fill_bytes(0xFF);
    dh0_.fill_bytes(0xFF);
    MixerBwdParams m;
    static_cast<MixerParams&>(m) = in_.params();
    m.chunk_states = chunk_states_.data();
    m.d_o = d_o_.data();
    m.d_final_state = dht_.size() ? dht_.data() : nullptr;
    m.dq = dq_.data();
    m.dk_out = dk_.data();
    m.dv_out = dv_.data();
    m.dg = dg_.size() ? dg_.data() : nullptr;
    m.dbeta = dbeta_.size() ? dbeta_.data() : nullptr;
    m.d_initial_state = dh0_.data();
    return m;
  }

  void run_backward() {
    cuda::mixer_backward(backward_params(), nullptr);
    check_device_sync();
  }

  ref::Grads want() const { return ref::backward(in_.problem(), d_o_host_, dht_host_); }

  // Gradients as computed (dtype-rounded where stored in dtype).
  ref::Grads got() const {
    const DType dtype = in_.dtype();
    ref::Grads g;
    g.dq = from_storage(dtype, dq_.to_host());
    g.dk = from_storage(dtype, dk_.to_host());
    g.dv = from_storage(dtype, dv_.to_host());
    if (dg_.size()) g.dg = to_double(dg_.to_host());
    if (dbeta_.size()) g.dbeta = from_storage(dtype, dbeta_.to_host());
    g.dh0 = to_double(dh0_.to_host());
    return g;
  }
  // Raw bytes of every gradient output, for bitwise comparisons.
  std::vector<std::vector<unsigned char>> raw_outputs() const {
    std::vector<std::vector<unsigned char>> out = {dq_.to_host(), dk_.to_host(), dv_.to_host()};
    if (dbeta_.size()) out.push_back(dbeta_.to_host());
    for (const DeviceBuffer<float>* f : {&dg_, &dh0_}) {
      const std::vector<float> x = f->size() ? f->to_host() : std::vector<float>{};
      std::vector<unsigned char> bytes(x.size() * sizeof(float));
      if (!x.empty()) std::memcpy(bytes.data(), x.data(), bytes.size());
      out.push_back(bytes);
    }
    return out;
  }
  std::vector<double> dh0() const { return to_double(dh0_.to_host()); }

 private:
  DeviceInputs in_;
  std::vector<double> d_o_host_, dht_host_;
  DeviceBuffer<unsigned char> o_, d_o_, dq_, dk_, dv_, dbeta_;
  DeviceBuffer<float> dht_, chunk_states_, dg_, dh0_;
};

void expect_grads_match(const ref::Grads& got, const ref::Grads& want, const Tolerances& tol) {
  const double dq = rel_rms(got.dq, want.dq), dk = rel_rms(got.dk, want.dk),
               dv = rel_rms(got.dv, want.dv), dg = rel_rms(got.dg, want.dg),
               dbeta = rel_rms(got.dbeta, want.dbeta), dh0 = rel_rms(got.dh0, want.dh0);
  // The errors themselves (not only pass/fail): how close each gradient runs
  // to its bound is what a kernel change moves.
  std::printf("  rel RMS: dq %.2e dk %.2e dv %.2e dg %.2e dbeta %.2e dh0 %.2e\n", dq, dk, dv, dg,
              dbeta, dh0);
  EXPECT_LE(dq, tol.qkv) << "dq";
  EXPECT_LE(dk, tol.qkv) << "dk";
  EXPECT_LE(dv, tol.qkv) << "dv";
  EXPECT_LE(dg, tol.gate) << "dg";
  EXPECT_LE(dbeta, tol.gate) << "dbeta";
  EXPECT_LE(dh0, tol.state) << "dh0";
}

class CudaBackward : public CudaMixerTest {
 protected:
  // One batch row of packed sequences (an empty-ish one of length 1 among
  // them) with an initial state: the bitwise checks of the backward's
  // alternative paths against its default.
  ProblemSpec packed_spec() const {
    ProblemSpec s = spec();
    s.batch = 1;
    s.seq_len = 230;
    s.cu_seqlens = {0, 17, 81, 150, 151, 230};
    s.with_h0 = true;
    return s;
  }
  // A problem with an initial state and a final-state gradient, run forward
  // and backward once: what the workspace, determinism and batching checks
  // compare their other runs against. (GpuBackward keeps a reference to the
  // problem, so both live together on the heap.)
  struct RanOnce {
    ref::Problem problem;
    std::unique_ptr<GpuBackward> gpu;
    std::vector<std::vector<unsigned char>> outputs;  // raw_outputs() of that run
  };
  std::unique_ptr<RanOnce> run_once(uint64_t salt, int64_t chunk) const {
    auto r = std::make_unique<RanOnce>();
    ProblemSpec s = spec();
    s.with_h0 = true;
    r->problem = random_problem(s, seed(salt));
    r->gpu = std::make_unique<GpuBackward>(r->problem, dtype(), chunk, true, seed(salt) + 1);
    r->gpu->run_forward();
    r->gpu->run_backward();
    r->outputs = r->gpu->raw_outputs();
    return r;
  }

  void expect_matches_reference(const ProblemSpec& s, uint64_t salt, int64_t chunk, bool with_dht) {
    ref::Problem p = random_problem(s, seed(salt));
    expect_problem_matches_reference(p, salt, chunk, with_dht);
  }
  // The same for a problem the test has changed (its gates, say).
  void expect_problem_matches_reference(ref::Problem& p, uint64_t salt, int64_t chunk,
                                        bool with_dht) {
    GpuBackward gpu(p, dtype(), chunk, with_dht, seed(salt) + 1);
    gpu.run_forward();
    gpu.run_backward();
    expect_grads_match(gpu.got(), gpu.want(), tolerances(dtype()));
  }
};

TEST_P(CudaBackward, MatchesReference) {
  expect_matches_reference(spec(), 1, 64, false);
}

TEST_P(CudaBackward, MatchesReferenceWithInitialStateAndFinalGradient) {
  ProblemSpec s = spec();
  s.with_h0 = true;
  expect_matches_reference(s, 2, 64, true);
}

TEST_P(CudaBackward, MatchesReferenceWithL2Norm) {
  ProblemSpec s = spec();
  s.l2norm_qk = true;
  s.with_h0 = true;
  expect_matches_reference(s, 3, 64, true);
}

TEST_P(CudaBackward, MatchesReferenceWithPackedSequences) {
  ProblemSpec s = spec();
  s.batch = 1;
  s.seq_len = 230;
  s.cu_seqlens = {0, 17, 81, 150, 151, 230};  // lengths 17, 64, 69, 1, 79
  s.with_h0 = true;
  expect_matches_reference(s, 4, 64, true);
}

TEST_P(CudaBackward, MatchesReferenceWithChunk16) {
  ProblemSpec s = spec();
  s.with_h0 = true;
  expect_matches_reference(s, 5, 16, true);
}

TEST_P(CudaBackward, MatchesReferenceWithChunk32) {
  ProblemSpec s = spec();
  s.seq_len = 101;
  expect_matches_reference(s, 6, 32, true);
}

// Gates that decay by ~5 e-folds per token in every other 64-token chunk:
// past the vector kernel's bound on one 16-row block's decay (4 e-folds), so
// those chunks take the exact diagonal blocks of
// chunk_intra_grad_vector_kernel while the mild ones keep the tensor-core
// form, in the same launch. (The scalar-gate variants get the same gates.)
TEST_P(CudaBackward, MatchesReferenceWithStrongGatesInSomeChunks) {
  ProblemSpec s = spec();
  s.seq_len = 200;
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(7));
  if (p.g.empty()) GTEST_SKIP() << "no gate";
  strengthen_gates_in_odd_chunks(p, 300.0);
  expect_problem_matches_reference(p, 7, 64, true);
}

// Gates whose decay over one 16-token block sits just under the vector
// kernel's bound for its tensor-core diagonal blocks (kMaxDrop = 4 e-folds,
// chunk_intra_grad_vector.cuh): ~3 per block, at most ~3.4 over every block
// and dimension here, so the diagonal products run with their largest output
// factors. (The CPU model bounds this case: test_chunk_bwd_model's "bound".
// fp32 inputs take the split-tf32 kernel and get the same gates.)
TEST_P(CudaBackward, MatchesReferenceWithGatesNearTheDiagonalBound) {
  ProblemSpec s = spec();
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(8));
  if (p.g.empty()) GTEST_SKIP() << "no gate";
  set_block_decay(p.g, 3.0, seed(8) + 2);
  expect_problem_matches_reference(p, 8, 64, true);
}

// The L2 norm with strong gates (20 e-folds per 16-token block, every
// chunk): the case where the gate gradient needs db taken from the 16-bit
// operand copies of q and k (the CPU model, test_chunk_bwd_model: from the
// exact normalised q, k dg reached 2.1e-2 for Gated DeltaNet, 1.9e-2 for
// retention; from the copies at most 8.7e-3).
TEST_P(CudaBackward, MatchesReferenceWithL2NormAndStrongGates) {
  ProblemSpec s = spec();
  s.l2norm_qk = true;
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(9));
  if (p.g.empty()) GTEST_SKIP() << "no gate";
  set_block_decay(p.g, 20.0, seed(9) + 2);
  expect_problem_matches_reference(p, 9, 64, true);
}

// Every output bitwise equal to the expected run's (raw_outputs order).
void expect_same_outputs(const std::vector<std::vector<unsigned char>>& got,
                         const std::vector<std::vector<unsigned char>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == want[i]) << "output " << i;
}

// The caller-owned workspace entry point: at least backward_workspace_bytes
// works (and gives the allocating entry point's results), one byte less is
// refused naming "workspace", and so is a start 16 bytes past a 32-byte
// boundary (the fp32 paths' wmma loads from it need 32), before anything
// runs: the outputs keep their poison.
TEST_P(CudaBackward, UsesCallerWorkspace) {
  const auto ran = run_once(11, 32);
  GpuBackward& gpu = *ran->gpu;
  const auto& expected = ran->outputs;
  MixerBwdParams m = gpu.backward_params();
  const size_t bytes = cuda::backward_workspace_bytes(m);
  DeviceBuffer<unsigned char> workspace(bytes);
  cuda::mixer_backward(m, workspace.data(), bytes, nullptr);
  check_device_sync();
  const auto got = gpu.raw_outputs();
  expect_same_outputs(got, expected);
  expect_error([&] { cuda::mixer_backward(m, workspace.data(), bytes - 1, nullptr); }, "workspace");
  m = gpu.backward_params();  // poisons the outputs again
  DeviceBuffer<unsigned char> larger(bytes + 16);
  expect_error([&] { cuda::mixer_backward(m, larger.data() + 16, bytes, nullptr); }, "workspace");
  check_device_sync();
  for (const auto& raw : gpu.raw_outputs()) EXPECT_TRUE(all_bytes(raw, 0xFF));
}

// No float atomics: two runs give bitwise-identical gradients.
TEST_P(CudaBackward, IsDeterministic) {
  const auto ran = run_once(7, 64);
  ran->gpu->run_backward();
  expect_same_outputs(ran->gpu->raw_outputs(), ran->outputs);
}

// 16-bit inputs run the per-chunk gradients in batches of (chunk, head) items
// (the state products of one batch held in the workspace): 18 items in
// batches of 7 (the last one short, each smaller than the persistent grid)
// give bitwise the gradients of one batch, and the workspace shrinks with
// the batch. Only vector gates (GLA, KDA) run in batches: fp32 inputs, the
// kernels that read their inputs directly (linear attention) and the scalar
// gates' one-kernel gradients (b17) have none, and the variable changes
// nothing there.
TEST_P(CudaBackward, BatchedGradientsEqualOneBatch) {
  const auto ran = run_once(13, 64);
  GpuBackward& gpu = *ran->gpu;
  const auto& whole = ran->outputs;
  const size_t whole_bytes = cuda::backward_workspace_bytes(gpu.backward_params());
  ASSERT_EQ(setenv("STATESCAN_BWD_BATCH", "7", 1), 0);
  const size_t batched_bytes = cuda::backward_workspace_bytes(gpu.backward_params());
  gpu.run_backward();
  const auto batched = gpu.raw_outputs();
  const bool batches = dtype() != DType::f32 && vector_gate(variant()) &&
                       !cuda::reads_inputs_directly(gpu.backward_params());
  if (batches) {
    ASSERT_EQ(setenv("STATESCAN_BWD_BATCH", "0", 1), 0);
    expect_error([&] { cuda::mixer_backward(gpu.backward_params(), nullptr); },
                 "STATESCAN_BWD_BATCH");
  }
  ASSERT_EQ(unsetenv("STATESCAN_BWD_BATCH"), 0);
  expect_same_outputs(batched, whole);
  if (batches)
    EXPECT_LT(batched_bytes, whole_bytes);
  else
    EXPECT_EQ(batched_bytes, whole_bytes);
}

// recompute_chunk_states: backward re-derives the chunk states with the
// forward's own scan, so its gradients are bitwise those of the run that read
// the saved states (outputs poisoned again in between), packed sequences and
// an initial state included; the caller's workspace entry point sizes for it.
TEST_P(CudaBackward, RecomputedChunkStatesGiveTheSavedStatesGradients) {
  ref::Problem p = random_problem(packed_spec(), seed(12));
  GpuBackward gpu(p, dtype(), 64, true, seed(12) + 1);
  gpu.run_forward();
  gpu.run_backward();
  const auto expected = gpu.raw_outputs();
  MixerBwdParams m = gpu.backward_params();  // poisons the outputs again
  m.chunk_states = nullptr;
  m.recompute_chunk_states = true;
  cuda::mixer_backward(m, nullptr);
  check_device_sync();
  const auto got = gpu.raw_outputs();
  expect_same_outputs(got, expected);

  m = gpu.backward_params();
  m.chunk_states = nullptr;
  m.recompute_chunk_states = true;
  const size_t bytes = cuda::backward_workspace_bytes(m, true);
  EXPECT_GT(bytes, cuda::backward_workspace_bytes(m));  // room for the states
  DeviceBuffer<unsigned char> workspace(bytes);
  cuda::mixer_backward(m, workspace.data(), bytes, nullptr);
  check_device_sync();
  const auto again = gpu.raw_outputs();
  expect_same_outputs(again, expected);
  expect_error(
      [&] {
        cuda::mixer_backward(m, workspace.data(), cuda::backward_workspace_bytes(m), nullptr);
      },
      "workspace");
}

// MixerParams::saved_t: the forward saves T in two parts and the backward's
// prepare re-run reads them instead of forming KK and solving; the gradients
// are bitwise those of the re-run that solves (packed sequences and an
// initial state included), and the backward's workspace has no T region then.
// Where it is unsupported (additive rules, vector gates, fp32) the forward
// and the backward refuse it naming "saved_t".
TEST_P(CudaBackward, SavedTGivesTheSolvedTGradients) {
  ref::Problem p = random_problem(packed_spec(), seed(14));
  GpuBackward gpu(p, dtype(), 64, true, seed(14) + 1);
  gpu.run_forward();
  gpu.run_backward();
  const auto expected = gpu.raw_outputs();
  MixerBwdParams m = gpu.backward_params();  // poisons the outputs again
  if (!cuda::saved_t_supported(m)) {
    DeviceBuffer<unsigned char> some(256);
    m.saved_t = some.data();
    expect_error([&] { cuda::mixer_backward(m, nullptr); }, "saved_t");
    expect_error([&] { gpu.run_forward(some.data()); }, "saved_t");
    return;
  }
  DeviceBuffer<unsigned char> saved(cuda::saved_t_bytes(m));
  saved.fill_bytes(0xFF);  // NaN bytes: a part the forward does not write poisons the gradients
  gpu.run_forward(saved.data());
  m = gpu.backward_params();
  m.saved_t = saved.data();
  EXPECT_LE(cuda::backward_workspace_bytes(m),
            cuda::backward_workspace_bytes(gpu.backward_params()));
  cuda::mixer_backward(m, nullptr);
  check_device_sync();
  expect_same_outputs(gpu.raw_outputs(), expected);
}

// cuda::PreparedBackward (the CP path): one prepared set of tiles serves the
// pre-pass and then the full backward, bitwise equal to mixer_backward's; a
// different problem or stream is refused.
TEST_P(CudaBackward, PreparedBackwardServesThePrePassAndTheBackward) {
  ProblemSpec s = spec();
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(13));
  GpuBackward gpu(p, dtype(), 64, true, seed(13) + 1);
  gpu.run_forward();
  gpu.run_backward();
  const auto expected = gpu.raw_outputs();
  const std::vector<double> expected_dh0 = gpu.dh0();

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  {
    MixerBwdParams m = gpu.backward_params();
    cuda::PreparedBackward prepared(m, stream);
    MixerBwdParams pre = m;
    pre.state_grad_only = true;
    prepared.run(pre, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_LE(rel_rms(gpu.dh0(), expected_dh0), 1e-6) << "pre-pass dh0";
    m = gpu.backward_params();  // poisons the outputs again
    prepared.run(m, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto got = gpu.raw_outputs();
    expect_same_outputs(got, expected);

    MixerBwdParams other = m;
    other.scale *= 2;
    expect_error([&] { prepared.run(other, stream); }, "p");
    expect_error([&] { prepared.run(m, nullptr); }, "stream");
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// PreparedBackward's adopting constructor (MixerConfig::keep_prepared): the
// forward's prepared tiles give mixer_backward's gradients bitwise. A refused
// hand-over (another problem, another stream) leaves the forward whole and
// usable; after the hand-over the forward refuses summary() and finish(),
// whose tiles are the backward's now.
TEST_P(CudaBackward, PreparedBackwardAdoptsTheForwardsTiles) {
  ProblemSpec s = spec();
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(15));
  GpuBackward gpu(p, dtype(), 64, true, seed(15) + 1);
  gpu.run_forward();
  gpu.run_backward();
  const auto expected = gpu.raw_outputs();

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  {
    cuda::PreparedForward forward(gpu.forward_params(), stream);
    MixerBwdParams m = gpu.backward_params();  // poisons the outputs again
    MixerBwdParams other = m;
    other.scale *= 2;
    expect_error([&] { cuda::PreparedBackward refused(other, forward, stream); }, "p");
    expect_error([&] { cuda::PreparedBackward refused(m, forward, nullptr); }, "stream");
    forward.finish(stream);  // the same o and chunk states as the forward above
    cuda::PreparedBackward adopted(m, forward, stream);
    expect_error([&] { forward.finish(stream); }, "forward");
    expect_error([&] { forward.summary(nullptr, nullptr, stream); }, "forward");
    adopted.run(m, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    expect_same_outputs(gpu.raw_outputs(), expected);
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The CP pre-pass: only d_initial_state, equal to the full run's; every other
// output keeps its poison.
TEST_P(CudaBackward, StateGradOnlyWritesOnlyInitialStateGradient) {
  ProblemSpec s = spec();
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(8));
  GpuBackward gpu(p, dtype(), 64, false, seed(8) + 1);
  gpu.run_forward();
  gpu.run_backward();
  const std::vector<double> full = gpu.dh0();
  MixerBwdParams m = gpu.backward_params();
  m.state_grad_only = true;
  m.chunk_states = nullptr;  // not needed by the pre-pass
  cuda::mixer_backward(m, nullptr);
  check_device_sync();
  EXPECT_LE(rel_rms(gpu.dh0(), full), 1e-6) << "dh0";
  EXPECT_LE(rel_rms(gpu.dh0(), gpu.want().dh0), tolerances(dtype()).state) << "dh0 vs reference";
  const auto raw = gpu.raw_outputs();
  for (size_t i = 0; i + 2 < raw.size(); ++i)
    EXPECT_TRUE(all_bytes(raw[i], 0xFF)) << "output " << i;
  EXPECT_TRUE(all_bytes(raw[raw.size() - 2], 0xFF)) << "dg";
}

TEST_P(CudaBackward, RejectsMissingChunkStates) {
  ref::Problem p = random_problem(spec(), seed(9));
  GpuBackward gpu(p, dtype(), 64, false, seed(9) + 1);
  MixerBwdParams m = gpu.backward_params();
  m.chunk_states = nullptr;
  expect_error([&] { cuda::mixer_backward(m, nullptr); }, "chunk_states");
}

TEST_P(CudaBackward, RejectsMissingGateOrBetaGradient) {
  if (!has_gate(variant()) && !has_beta(variant())) GTEST_SKIP() << "no g or beta";
  ref::Problem p = random_problem(spec(), seed(10));
  GpuBackward gpu(p, dtype(), 64, false, seed(10) + 1);
  gpu.run_forward();
  MixerBwdParams m = gpu.backward_params();
  const char* expected = has_gate(variant()) ? "dg" : "dbeta";
  if (has_gate(variant()))
    m.dg = nullptr;
  else
    m.dbeta = nullptr;
  expect_error([&] { cuda::mixer_backward(m, nullptr); }, expected);
}

// A buffer the kernels cannot address in 16-byte pieces is refused naming it,
// before anything runs (a misaligned access is a sticky CUDA error: the
// context, and a CP job's peers, would be lost); every output keeps its poison.
TEST_P(CudaBackward, RejectsMisalignedGradientBuffers) {
  ref::Problem p = random_problem(spec(), seed(11));
  GpuBackward gpu(p, dtype(), 64, false, seed(11) + 1);
  gpu.run_forward();
  const auto shift = [&](auto* ptr) {
    using Ptr = decltype(ptr);
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const char, char>;
    return reinterpret_cast<Ptr>(reinterpret_cast<Byte*>(ptr) + size_of(dtype()));
  };
  for (const std::string name : {"do", "dq", "dk_out", "dv_out"}) {
    SCOPED_TRACE(name);
    MixerBwdParams m = gpu.backward_params();
    if (name == "do") m.d_o = shift(m.d_o);
    if (name == "dq") m.dq = shift(m.dq);
    if (name == "dk_out") m.dk_out = shift(m.dk_out);
    if (name == "dv_out") m.dv_out = shift(m.dv_out);
    expect_error([&] { cuda::mixer_backward(m, nullptr); }, name);
    check_device_sync();
    const auto raw = gpu.raw_outputs();
    for (size_t i = 0; i < raw.size(); ++i) EXPECT_TRUE(all_bytes(raw[i], 0xFF)) << "output " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CudaBackward, all_mixer_params(), mixer_param_name);

// B*H fills the GPU: 16 heads x 32 chunks = 512 (chunk, head) items, more
// than the persistent grid, bf16, every variant.
// The backward's own arguments are checked on the host before anything is
// allocated or launched, so this runs without a device (CI): every bad
// argument is named, by both entry points and by PreparedBackward where it
// checks it.
TEST(CudaBackwardArgs, EachBadArgumentIsNamed) {
  const auto at = [](uintptr_t offset) {
    return reinterpret_cast<char*>(uintptr_t{1} << 21) + offset;  // stand-ins, never read
  };
  MixerBwdParams good;
  static_cast<MixerParams&>(good) = sizes_only();
  good.d_o = at(0);
  good.dq = good.dk_out = good.dv_out = good.dbeta = at(0);
  good.chunk_states = reinterpret_cast<float*>(at(0));
  good.d_initial_state = reinterpret_cast<float*>(at(0));
  using Tweak = void (*)(MixerBwdParams&, char*);
  struct Bad {
    const char* argument;
    Tweak tweak;
  };
  // Each tweak gets a stand-in 8 bytes past a 16-byte boundary.
  const Bad cases[] = {
      {"dk", [](MixerBwdParams& m, char*) { m.dk = m.dv = 32; }},
      {"dk", [](MixerBwdParams& m, char*) { m.dv = 128; }},
      {"do", [](MixerBwdParams& m, char*) { m.d_o = nullptr; }},
      {"do", [](MixerBwdParams& m, char* odd) { m.d_o = odd; }},
      {"chunk_states", [](MixerBwdParams& m, char*) { m.chunk_states = nullptr; }},
      {"chunk_states",
       [](MixerBwdParams& m, char* odd) { m.chunk_states = reinterpret_cast<float*>(odd + 8); }},
      {"dq", [](MixerBwdParams& m, char*) { m.dq = nullptr; }},
      {"dk_out", [](MixerBwdParams& m, char*) { m.dk_out = nullptr; }},
      {"dv_out", [](MixerBwdParams& m, char*) { m.dv_out = nullptr; }},
      {"dq", [](MixerBwdParams& m, char* odd) { m.dq = odd; }},
      {"dk_out", [](MixerBwdParams& m, char* odd) { m.dk_out = odd; }},
      {"dv_out", [](MixerBwdParams& m, char* odd) { m.dv_out = odd; }},
      {"dbeta", [](MixerBwdParams& m, char*) { m.dbeta = nullptr; }},
      {"dg", [](MixerBwdParams& m, char* odd) { m.dg = reinterpret_cast<float*>(odd + 8); }},
      {"d_initial_state",
       [](MixerBwdParams& m, char*) {
         m.state_grad_only = true;
         m.d_initial_state = nullptr;
       }},
  };
  for (const Bad& c : cases) {
    MixerBwdParams m = good;
    c.tweak(m, at(8));
    SCOPED_TRACE(c.argument);
    expect_error([&] { cuda::mixer_backward(m, nullptr); }, c.argument);
    expect_error([&] { cuda::mixer_backward(m, at(0), size_t{1} << 30, nullptr); }, c.argument);
  }
  // PreparedBackward checks the head dims and the chunk states first.
  MixerBwdParams m = good;
  m.dk = m.dv = 32;
  expect_error([&] { cuda::PreparedBackward refused(m, nullptr); }, "dk");
  m = good;
  m.chunk_states = nullptr;
  expect_error([&] { cuda::PreparedBackward refused(m, nullptr); }, "chunk_states");
}

class CudaBackwardLarge : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaBackwardLarge, MatchesReference) {
  ProblemSpec s;
  s.variant = GetParam();
  s.batch = 1;
  s.heads = 16;
  s.seq_len = 2048;
  s.dk = s.dv = 64;
  s.with_h0 = true;
  ref::Problem p = random_problem(s, 4242 + static_cast<uint64_t>(GetParam()));
  GpuBackward gpu(p, DType::bf16, 64, true, 99);
  gpu.run_forward();
  gpu.run_backward();
  expect_grads_match(gpu.got(), gpu.want(), tolerances(DType::bf16));
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CudaBackwardLarge, ::testing::ValuesIn(kAllVariants),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return variant_name(info.param);
                         });

}  // namespace
}  // namespace statescan::test
