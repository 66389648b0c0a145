// The CUDA forward path (kernels/cuda/cuda_mixer.h) against the fp64
// reference: chunkwise and recurrent decode kernels for all six variants x
// dtype x head dim, with initial states, in-kernel L2 norm, packed sequences,
// smaller chunks, partial last chunks and many heads. Skips where no GPU is
// present (CI has none).
//
// Tolerances (relative RMS vs fp64 on the exact inputs the GPU sees):
//   bf16 / f16 inputs: 5e-3 for o and states (DESIGN §7).
//   f32 inputs: 1e-5. The kernels run fp32 matrix products on the tensor
//   cores as three tf32 products (hi*hi + hi*lo + lo*hi), which recovers
//   about fp32 accuracy, so the fp32 bound of DESIGN §7 applies unchanged.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/dtype.h"
#include "core/env_knob.h"
#include "core/error.h"
#include "kernels/cpu/reference.h"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/mixer_params.h"
#include "tests/cuda_mixer_test_util.h"
#include "tests/expect_error.h"
#include "tests/test_util.h"

namespace statescan::test {
namespace {

// A forward problem on the GPU: the inputs (DeviceInputs, rounded to what
// the device sees) and the outputs.
class GpuProblem {
 public:
  GpuProblem(ref::Problem& p, DType dtype, int64_t chunk) : in_(p, dtype, chunk) {
    const std::size_t state = in_.state_size();
    o_ = DeviceBuffer<unsigned char>(p.q.size() / p.dk * p.dv * size_of(dtype));
    final_state_ = DeviceBuffer<float>(state * p.num_sequences());
    chunk_states_ = DeviceBuffer<float>(state * in_.num_chunks());
  }

  // Every output poisoned with NaN (all-ones bytes) first, so an element the
  // kernels never write fails the comparison.
  MixerParams params() {
    o_.fill_bytes(0xFF);
    final_state_.fill_bytes(0xFF);
    chunk_states_.fill_bytes(0xFF);
    MixerParams m = in_.params();
    m.o = o_.data();
    m.final_state = final_state_.data();
    m.chunk_states = chunk_states_.data();
    return m;
  }

  void run_chunkwise() {
    cuda::mixer_forward(params(), nullptr);
    check_device_sync();
  }
  void run_decode() {
    cuda::decode_forward(params(), nullptr);
    check_device_sync();
  }
  // The decode as a serving step: final_state holds a copy of the initial
  // state and is passed as both, so the kernel updates it in place.
  void run_decode_in_place() {
    MixerParams m = params();
    SS_CHECK_ARG(m.initial_state != nullptr, "initial_state", "the in-place decode needs one");
    SS_CUDA_CHECK(cudaMemcpy(final_state_.data(), m.initial_state,
                             final_state_.size() * sizeof(float), cudaMemcpyDeviceToDevice));
    m.initial_state = m.final_state;
    cuda::decode_forward(m, nullptr);
    check_device_sync();
  }

  std::vector<double> o() const { return from_storage(in_.dtype(), o_.to_host()); }
  std::vector<double> final_state() const { return to_double(final_state_.to_host()); }
  std::vector<double> chunk_states() const { return to_double(chunk_states_.to_host()); }
  int64_t num_chunks() const { return in_.num_chunks(); }

 private:
  DeviceInputs in_;
  DeviceBuffer<unsigned char> o_;
  DeviceBuffer<float> final_state_, chunk_states_;
};

class CudaForward : public CudaMixerTest {
 protected:
  double tol() const { return output_tol(dtype()); }

  // Chunkwise forward vs the reference: o and final state (errors printed,
  // so a run shows the margins, not only pass/fail).
  void expect_problem_matches_reference(ref::Problem p, int64_t chunk = 64) {
    GpuProblem gpu(p, dtype(), chunk);
    gpu.run_chunkwise();
    const ref::Outputs want = ref::forward(p);
    const double err_o = rel_rms(gpu.o(), want.o), err_s = rel_rms(gpu.final_state(), want.ht);
    std::printf("  rel RMS: o %.2e final state %.2e\n", err_o, err_s);
    EXPECT_LE(err_o, tol()) << "o";
    EXPECT_LE(err_s, tol()) << "final state";
  }
  void expect_matches_reference(ProblemSpec s, uint64_t salt, int64_t chunk = 64) {
    expect_problem_matches_reference(random_problem(s, seed(salt)), chunk);
  }
};

TEST_P(CudaForward, MatchesReference) {
  expect_matches_reference(spec(), 1);
}

TEST_P(CudaForward, MatchesReferenceWithInitialState) {
  ProblemSpec s = spec();
  s.with_h0 = true;
  expect_matches_reference(s, 2);
}

TEST_P(CudaForward, MatchesReferenceWithL2Norm) {
  ProblemSpec s = spec();
  s.l2norm_qk = true;
  s.with_h0 = true;
  expect_matches_reference(s, 3);
}

TEST_P(CudaForward, MatchesReferenceWithPackedSequences) {
  ProblemSpec s = spec();
  s.batch = 1;
  s.seq_len = 230;
  s.cu_seqlens = {0, 17, 81, 150, 151, 230};  // lengths 17, 64, 69, 1, 79
  s.with_h0 = true;
  expect_matches_reference(s, 4);
}

TEST_P(CudaForward, MatchesReferenceWithSmallChunks) {
  ProblemSpec s = spec();
  s.with_h0 = true;
  expect_matches_reference(s, 5, 16);
  expect_matches_reference(s, 6, 32);
}

// Gates decaying ~5 e-folds per token in every other chunk: the 16-bit
// prepare kernel (chunk_prepare16.cuh) then sums the vector gates' diagonal
// blocks exactly on the CUDA cores (a block's decay is far above its
// tensor-core bound of 4 e-folds) and the scalar gate's pairwise factors
// underflow to 0 (and overflow above the diagonal, where they are selected
// away, not multiplied).
TEST_P(CudaForward, MatchesReferenceWithStrongGatesInSomeChunks) {
  ProblemSpec s = spec();
  s.seq_len = 200;
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(12));
  if (p.g.empty()) GTEST_SKIP() << "no gate";
  strengthen_gates_in_odd_chunks(p, 300.0);
  expect_problem_matches_reference(p);
}

// ~3 e-folds of decay per 16-token block: under the tensor-core diagonal's
// bound, with its largest factors (e^{drop} on the diagonal products).
TEST_P(CudaForward, MatchesReferenceWithGatesNearTheDiagonalBound) {
  ProblemSpec s = spec();
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(13));
  if (p.g.empty()) GTEST_SKIP() << "no gate";
  set_block_decay(p.g, 3.0, seed(13) + 2);
  expect_problem_matches_reference(p);
}

// The L2 norm (q, k not 16-bit-exact, so the operand copies round) with 20
// e-folds per block (the exact diagonal path) and with small chunks.
TEST_P(CudaForward, MatchesReferenceWithL2NormAndStrongGates) {
  ProblemSpec s = spec();
  s.l2norm_qk = true;
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(14));
  if (p.g.empty()) GTEST_SKIP() << "no gate";
  set_block_decay(p.g, 20.0, seed(14) + 2);
  expect_problem_matches_reference(p);
  expect_problem_matches_reference(p, 32);
}

// Enough heads that the state scan switches from 16- to 32-column blocks
// (more blocks than one wave of multiprocessors at 16 columns).
TEST_P(CudaForward, MatchesReferenceWithWideScanBlocks) {
  ProblemSpec s = spec();
  s.batch = 1;
  s.heads = 40;
  s.seq_len = 64 + 16;  // one full chunk and a partial one
  s.with_h0 = true;
  expect_matches_reference(s, 11);
}

// chunk_states[c] is the state entering chunk c: the reference's final state
// of the sequence cut just before that chunk.
TEST_P(CudaForward, ChunkStatesMatchReferencePrefixes) {
  ProblemSpec s = spec();
  s.batch = 1;
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(7));
  GpuProblem gpu(p, dtype(), 64);
  gpu.run_chunkwise();
  const std::vector<double> states = gpu.chunk_states();
  ASSERT_EQ(gpu.num_chunks(), 3);
  const std::size_t per_chunk = static_cast<std::size_t>(s.heads * s.dk * s.dv);
  for (int64_t c = 0; c < gpu.num_chunks(); ++c) {
    std::vector<double> got(states.begin() + c * per_chunk, states.begin() + (c + 1) * per_chunk);
    std::vector<double> want = p.h0;
    if (c > 0) {
      ref::Problem prefix = p;
      prefix.seq_len = c * 64;
      const std::size_t keep_k = static_cast<std::size_t>(prefix.seq_len * s.heads * s.dk);
      const std::size_t keep_v = static_cast<std::size_t>(prefix.seq_len * s.heads * s.dv);
      const std::size_t keep_t = static_cast<std::size_t>(prefix.seq_len * s.heads);
      prefix.q.resize(keep_k);
      prefix.k.resize(keep_k);
      prefix.v.resize(keep_v);
      if (!prefix.g.empty()) prefix.g.resize(vector_gate(s.variant) ? keep_k : keep_t);
      if (!prefix.beta.empty()) prefix.beta.resize(keep_t);
      want = ref::forward(prefix).ht;
    }
    EXPECT_LE(rel_rms(got, want), tol()) << "chunk " << c;
  }
}

// Without caller storage for the chunk states (inference) the states live
// only in the workspace, in the input dtype; o and the final state still match.
TEST_P(CudaForward, MatchesReferenceWithoutChunkStates) {
  ref::Problem p = random_problem(spec(), seed(12));
  GpuProblem gpu(p, dtype(), 64);
  MixerParams m = gpu.params();
  m.chunk_states = nullptr;
  cuda::mixer_forward(m, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const ref::Outputs want = ref::forward(p);
  EXPECT_LE(rel_rms(gpu.o(), want.o), tol()) << "o";
  EXPECT_LE(rel_rms(gpu.final_state(), want.ht), tol()) << "final state";
}

TEST_P(CudaForward, DecodeMatchesReference) {
  ProblemSpec s = spec();
  s.with_h0 = true;
  s.l2norm_qk = true;
  ref::Problem p = random_problem(s, seed(8));
  GpuProblem gpu(p, dtype(), 64);
  gpu.run_decode();
  const ref::Outputs want = ref::forward(p);
  EXPECT_LE(rel_rms(gpu.o(), want.o), tol()) << "o";
  EXPECT_LE(rel_rms(gpu.final_state(), want.ht), tol()) << "final state";
}

TEST_P(CudaForward, DecodeMatchesChunkwise) {
  ProblemSpec s = spec();
  s.batch = 1;
  s.seq_len = 230;
  s.cu_seqlens = {0, 100, 101, 230};
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(9));
  GpuProblem gpu(p, dtype(), 64);
  gpu.run_chunkwise();
  const std::vector<double> chunk_o = gpu.o(), chunk_state = gpu.final_state();
  gpu.run_decode();
  EXPECT_LE(rel_rms(gpu.o(), chunk_o), tol()) << "o";
  EXPECT_LE(rel_rms(gpu.final_state(), chunk_state), tol()) << "final state";
}

// A serving step updates each sequence's state in place (final_state ==
// initial_state): o and the state bit for bit as into a separate buffer, over
// packed sequences of 1, 32 and 37 tokens.
TEST_P(CudaForward, DecodeUpdatesTheStateInPlace) {
  ProblemSpec s = spec();
  s.batch = 1;
  s.seq_len = 70;
  s.cu_seqlens = {0, 1, 33, 70};
  s.with_h0 = true;
  ref::Problem p = random_problem(s, seed(15));
  GpuProblem gpu(p, dtype(), 64);
  gpu.run_decode();
  const std::vector<double> o = gpu.o(), state = gpu.final_state();
  gpu.run_decode_in_place();
  EXPECT_TRUE(bitwise_equal(gpu.o(), o)) << "o";
  EXPECT_TRUE(bitwise_equal(gpu.final_state(), state)) << "final state";
  EXPECT_LE(rel_rms(gpu.final_state(), ref::forward(p).ht), tol()) << "final state vs reference";
}

// Whether this process forces the tile kernels on every problem through an
// A/B knob (cuda_mixer.cu: STATESCAN_PREPARE=fp32, STATESCAN_SCAN=wmma,
// STATESCAN_LINEAR=tiles), read as the library reads them; the knob entries
// run this suite under each.
bool tile_knob_set() {
  return env_choice("STATESCAN_PREPARE", {"16", "fp32"}) == 1 ||
         env_choice("STATESCAN_SCAN", {"mma", "wmma"}) == 1 ||
         env_choice("STATESCAN_LINEAR", {"grouped", "scan", "tiles"}) == 2;
}

// Linear attention with 16-bit inputs and no L2 norm runs kernels that read
// q, k, v themselves: its workspaces hold no tiles (the same problem with the
// L2 norm, whose tiles the prepare stage writes, needs more), and no other
// problem takes that path; a tile knob sends every problem through the tiles.
TEST_P(CudaForward, WorkspaceHoldsTilesOnlyWhereKernelsReadThem) {
  ref::Problem p = random_problem(spec(), seed(11));
  GpuProblem gpu(p, dtype(), 64);
  MixerParams plain = gpu.params();
  plain.l2norm_qk = false;
  MixerParams normed = plain;
  normed.l2norm_qk = true;
  const bool raw = variant() == Variant::linear && dtype() != DType::f32 && !tile_knob_set();
  EXPECT_EQ(cuda::reads_inputs_directly(plain), raw);
  EXPECT_FALSE(cuda::reads_inputs_directly(normed));
  if (raw) {
    EXPECT_LT(cuda::forward_workspace_bytes(plain), cuda::forward_workspace_bytes(normed));
    EXPECT_LT(cuda::backward_workspace_bytes(plain), cuda::backward_workspace_bytes(normed));
  } else {
    EXPECT_EQ(cuda::forward_workspace_bytes(plain), cuda::forward_workspace_bytes(normed));
    EXPECT_EQ(cuda::backward_workspace_bytes(plain), cuda::backward_workspace_bytes(normed));
  }
}

TEST_P(CudaForward, RejectsUnsupportedHeadDim) {
  ProblemSpec s = spec();
  s.dk = s.dv = 32;
  ref::Problem p = random_problem(s, seed(10));
  GpuProblem gpu(p, dtype(), 64);
  try {
    cuda::mixer_forward(gpu.params(), nullptr);
    FAIL() << "expected statescan::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "dk");
  }
}

// An o the output stage cannot store in 16-byte pieces is refused naming
// it, before anything runs (a misaligned store is a sticky CUDA error);
// o keeps its poison.
TEST_P(CudaForward, RejectsMisalignedOutput) {
  ref::Problem p = random_problem(spec(), seed(12));
  GpuProblem gpu(p, dtype(), 64);
  MixerParams m = gpu.params();
  m.o = static_cast<char*>(m.o) + size_of(dtype());
  expect_error([&] { cuda::mixer_forward(m, nullptr); }, "o");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (double x : gpu.o()) EXPECT_TRUE(std::isnan(x)) << "o written despite the error";
}

// chunk_states the scans cannot store in 16-byte pieces (and the backward
// would not read: it asks 32-byte alignment) is refused the same way. The
// check comes before anything runs, so the buffer need not hold the states.
TEST_P(CudaForward, RejectsMisalignedChunkStates) {
  ref::Problem p = random_problem(spec(), seed(13));
  GpuProblem gpu(p, dtype(), 64);
  DeviceBuffer<float> states(64);
  MixerParams m = gpu.params();
  m.chunk_states = states.data() + 4;  // 16 bytes past a 256-byte-aligned allocation
  expect_error([&] { cuda::mixer_forward(m, nullptr); }, "chunk_states");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (double x : gpu.o()) EXPECT_TRUE(std::isnan(x)) << "o written despite the error";
}

// A forced STATESCAN_SCAN_CLUSTER that the scan cannot take is an error
// naming the variable, not a silent fallback: 8 CTAs do not divide D = 64's
// four column blocks, and leave chunks of 16 rows 2 rows per CTA (the tensor
// copies need >= 8). The switch is read once per process, so this runs under
// ctest test_cuda_forward_cluster_8 (which also runs the plain cases at
// D = 128 in clusters of 8) and skips elsewhere.
TEST_P(CudaForward, RefusesScanClusterItCannotTake) {
  const char* knob = std::getenv("STATESCAN_SCAN_CLUSTER");
  if (knob == nullptr || std::string(knob) != "8" || dtype() == DType::f32 ||
      !has_beta(variant()))
    GTEST_SKIP() << "needs STATESCAN_SCAN_CLUSTER=8 and a 16-bit delta rule";
  ref::Problem p = random_problem(spec(), seed(11));
  GpuProblem gpu(p, dtype(), dim() == 64 ? 64 : 16);
  try {
    gpu.run_chunkwise();
    FAIL() << "expected statescan::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "STATESCAN_SCAN_CLUSTER") << e.what();
  }
}

// The decode's state in place is the same pointer for initial_state and
// final_state; a final_state overlapping it from another address is refused,
// naming it, before anything runs (host arrays here: the check precedes any
// device access, so this runs without a GPU too).
TEST(CudaDecodeArgs, RefusesAFinalStateThatPartlyOverlapsTheInitialState) {
  MixerParams p = sizes_only();  // inputs and o at an address never read here
  p.scale = 0.125f;
  const std::size_t state = static_cast<std::size_t>(p.num_segments * p.heads * p.dk * p.dv);
  std::vector<float> states(2 * state);
  p.initial_state = states.data();
  p.final_state = states.data() + 1;
  expect_error([&] { cuda::decode_forward(p, nullptr); }, "final_state");
  p.final_state = states.data() + state - 1;
  expect_error([&] { cuda::decode_forward(p, nullptr); }, "final_state");
  p.final_state = states.data();
  p.initial_state = states.data() + state / 2;
  expect_error([&] { cuda::decode_forward(p, nullptr); }, "final_state");
  EXPECT_EQ(states, std::vector<float>(2 * state)) << "a refused call wrote the state";
}

// The sizing functions check the sizes they divide by before validate()
// runs: chunk 0 was a SIGFPE, a negative length a wrapped size_t.
TEST(CudaSizes, SizingFunctionsNameBadSizes) {
  MixerParams p = sizes_only();
  EXPECT_GT(cuda::forward_workspace_bytes(p), 0u);
  p.chunk = 0;
  expect_error([&] { (void)cuda::forward_workspace_bytes(p); }, "chunk");
  expect_error([&] { (void)cuda::backward_workspace_bytes(p); }, "chunk");
  expect_error([&] { (void)cuda::saved_t_bytes(p); }, "chunk");
  p = sizes_only();
  p.seq_len = -5;
  expect_error([&] { (void)cuda::forward_workspace_bytes(p); }, "seq_len");
  p = sizes_only();
  p.num_segments = 0;
  expect_error([&] { (void)cuda::backward_workspace_bytes(p); }, "num_segments");
}

// Heads and sequences index grid dimensions y and z (<= 65,535): more is an
// error naming them, not a failed launch after the prepare stage.
TEST(CudaSizes, GridLimitsNameTheArgument) {
  MixerParams p = sizes_only();
  p.heads = 70000;
  expect_error([&] { cuda::check_grid_limits(p); }, "heads");
  expect_error([&] { cuda::mixer_forward(p, nullptr); }, "heads");
  p = sizes_only();
  p.batch = p.num_segments = 70000;
  expect_error([&] { cuda::check_grid_limits(p); }, "batch");
  p.batch = p.num_segments = 65535;
  EXPECT_NO_THROW(cuda::check_grid_limits(p));
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CudaForward, all_mixer_params(), mixer_param_name);

// Many heads (B*H = 256 blocks per kernel row, more than the SMs of an H200)
// with a partial last chunk, bf16, every variant.
class CudaForwardManyHeads : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaForwardManyHeads, MatchesReference) {
  ProblemSpec s;
  s.variant = GetParam();
  s.batch = 4;
  s.heads = 64;
  s.seq_len = 64 + 17;
  s.dk = s.dv = 64;
  s.with_h0 = true;
  ref::Problem p = random_problem(s, 4242 + static_cast<uint64_t>(GetParam()));
  GpuProblem gpu(p, DType::bf16, 64);
  gpu.run_chunkwise();
  const ref::Outputs want = ref::forward(p);
  EXPECT_LE(rel_rms(gpu.o(), want.o), output_tol(DType::bf16)) << "o";
  EXPECT_LE(rel_rms(gpu.final_state(), want.ht), output_tol(DType::bf16)) << "final state";
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CudaForwardManyHeads, ::testing::ValuesIn(kAllVariants),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return variant_name(info.param);
                         });

// A server captures its decode step into a CUDA graph: batch rows replay to
// the same o and state bit for bit as an eager call; packed sequences (their
// offsets checked on the host) are refused inside a capture, naming
// cu_seqlens, with nothing written.
TEST(CudaDecodeGraph, BatchRowsCaptureAndPackedSequencesAreRefused) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  ProblemSpec s;
  s.variant = Variant::gated_deltanet;
  s.batch = 3;
  s.seq_len = 5;
  s.heads = 2;
  s.dk = s.dv = 64;
  s.with_h0 = true;
  s.l2norm_qk = true;
  ref::Problem p = random_problem(s, 77);
  GpuProblem gpu(p, DType::bf16, 64);
  gpu.run_decode();
  const std::vector<double> o = gpu.o(), state = gpu.final_state();

  cudaStream_t stream = nullptr;
  SS_CUDA_CHECK(cudaStreamCreate(&stream));
  const MixerParams rows = gpu.params();  // outputs poisoned again
  cudaGraph_t graph = nullptr;
  SS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cuda::decode_forward(rows, stream);
  SS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t replay = nullptr;
  SS_CUDA_CHECK(cudaGraphInstantiate(&replay, graph, 0));
  SS_CUDA_CHECK(cudaGraphLaunch(replay, stream));
  SS_CUDA_CHECK(cudaStreamSynchronize(stream));
  SS_CUDA_CHECK(cudaGraphExecDestroy(replay));
  SS_CUDA_CHECK(cudaGraphDestroy(graph));
  EXPECT_TRUE(bitwise_equal(gpu.o(), o)) << "o";
  EXPECT_TRUE(bitwise_equal(gpu.final_state(), state)) << "final state";

  s.batch = 1;
  s.seq_len = 9;
  s.cu_seqlens = {0, 4, 9};
  ref::Problem packed = random_problem(s, 78);
  GpuProblem gpu_packed(packed, DType::bf16, 64);
  const MixerParams segments = gpu_packed.params();
  SS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  expect_error([&] { cuda::decode_forward(segments, stream); }, "cu_seqlens");
  graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess) << "the refusal voided the capture";
  if (graph != nullptr) SS_CUDA_CHECK(cudaGraphDestroy(graph));
  SS_CUDA_CHECK(cudaStreamDestroy(stream));
  for (double x : gpu_packed.o()) EXPECT_TRUE(std::isnan(x)) << "o written despite the error";
}

// The decode takes head shapes the chunkwise kernels do not: Dk and Dv apart
// (GLA's Dk = Dv / 2, Mamba-2's 128-row state over 64-wide heads), Dk from 32
// to 256. Every variant, bf16, packed sequences of 1, 40 and 37 tokens from
// an initial state, the L2 norm on the delta rules; outputs poisoned first.
using DecodeShape = std::tuple<Variant, int64_t, int64_t>;  // variant, Dk, Dv

class CudaDecodeHeadShapes : public ::testing::TestWithParam<DecodeShape> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaDecodeHeadShapes, MatchesReference) {
  const auto [variant, dk, dv] = GetParam();
  ProblemSpec s;
  s.variant = variant;
  s.batch = 1;
  s.seq_len = 78;
  s.cu_seqlens = {0, 1, 41, 78};
  s.heads = 3;
  s.dk = dk;
  s.dv = dv;
  s.with_h0 = true;
  s.l2norm_qk = has_beta(variant);
  ref::Problem p = random_problem(
      s, 5150 + 31 * static_cast<uint64_t>(variant) + static_cast<uint64_t>(dk * 1000 + dv));
  GpuProblem gpu(p, DType::bf16, 64);
  gpu.run_decode();
  const ref::Outputs want = ref::forward(p);
  const double err_o = rel_rms(gpu.o(), want.o), err_s = rel_rms(gpu.final_state(), want.ht);
  std::printf("  rel RMS: o %.2e final state %.2e\n", err_o, err_s);
  EXPECT_LE(err_o, output_tol(DType::bf16)) << "o";
  EXPECT_LE(err_s, output_tol(DType::bf16)) << "final state";
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CudaDecodeHeadShapes,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants),
                                            ::testing::Values<int64_t>(32, 128, 256),
                                            ::testing::Values<int64_t>(32, 64, 256)),
                         [](const ::testing::TestParamInfo<DecodeShape>& info) {
                           return variant_name(std::get<0>(info.param)) + "_dk" +
                                  std::to_string(std::get<1>(info.param)) + "_dv" +
                                  std::to_string(std::get<2>(info.param));
                         });

// Head shapes the decode cannot take are refused naming the dim, before
// anything runs (no device needed: runs in CI).
TEST(CudaDecodeArgs, RefusesHeadDimsItCannotTake) {
  MixerParams p = sizes_only();
  p.scale = 0.125f;
  p.dk = 48;
  expect_error([&] { cuda::decode_forward(p, nullptr); }, "dk");
  p.dk = 512;
  expect_error([&] { cuda::decode_forward(p, nullptr); }, "dk");
  p.dk = 64;
  p.dv = 48;
  expect_error([&] { cuda::decode_forward(p, nullptr); }, "dv");
}

}  // namespace
}  // namespace statescan::test
