// LaCT on the GPU (kernels/cuda/lact_cuda.h, LactLayer on device tensors)
// against the fp64 reference (kernels/cpu/lact.h): every option combination
// in f32 at DESIGN §7's 1e-5, a representative subset in bf16 at its
// tolerances, a partial last chunk, a single-chunk sequence, M < D, bitwise
// repeatable runs, and bad input (the same errors as the host path, nothing
// written). Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/cuda/cuda_mixer.h"
#include "kernels/cuda/lact_hidden.cuh"
#include "kernels/cuda/lact_ns_cluster.cuh"
#include "kernels/cuda/lact_token_gemm.cuh"
#include "tests/expect_error.h"
#include "tests/lact_cuda_test_util.h"

namespace statescan::test {
namespace {

constexpr double kF32Tol = 1e-5;
// bf16 (DESIGN §7, FLA's tolerances): o 5e-3; dq, dk, dv and the initial
// weights' gradients 8e-3; the learning rates' gradients take DESIGN's
// dg/dbeta bound, 2e-2: like dbeta (DeltaNet's per-token learning rate) each
// dlr is one dot product over the hidden width, <z, dG k>, whose terms cancel,
// so it carries the relative noise of its factors amplified. With Muon the
// Newton-Schulz Jacobian amplifies the bf16 operand rounding further; a host
// emulation of this GPU path (same rounding points) put dlr at up to 9e-3 on
// bidir_muon with 64-token chunks (o 4.3e-3, dk 7.2e-3, dw 6e-3) and at
// 7.5e-3 with the 128-token chunks below.
constexpr double kBf16OutTol = 5e-3;
constexpr double kBf16InputGradTol = 8e-3;
constexpr double kBf16WeightGradTol = 8e-3;
constexpr double kBf16RateGradTol = 2e-2;

struct Tolerances {
  double o, inputs, rates, weights;
};

// Whether the current device is compute capability 9.0, where the fused
// hidden-layer kernels and lact_token_gemm must take every shape these tests
// run (elsewhere they may not, and the tests skip).
bool on_sm90_device() {
  int device = 0, major = 0, minor = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  SS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  SS_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
}
constexpr Tolerances kF32{kF32Tol, kF32Tol, kF32Tol, kF32Tol};
constexpr Tolerances kBf16{kBf16OutTol, kBf16InputGradTol, kBf16RateGradTol, kBf16WeightGradTol};

void expect_close(const LactResult<double>& got, const LactResult<double>& ref,
                  const Tolerances& tol) {
  EXPECT_LE(rel_rms(got.o, ref.o), tol.o) << "o";
  EXPECT_LE(rel_rms(got.dq, ref.dq), tol.inputs) << "dq";
  EXPECT_LE(rel_rms(got.dk, ref.dk), tol.inputs) << "dk";
  EXPECT_LE(rel_rms(got.dv, ref.dv), tol.inputs) << "dv";
  EXPECT_LE(rel_rms(got.dlr0, ref.dlr0), tol.rates) << "dlr0";
  EXPECT_LE(rel_rms(got.dlr1, ref.dlr1), tol.rates) << "dlr1";
  EXPECT_LE(rel_rms(got.dlr2, ref.dlr2), tol.rates) << "dlr2";
  EXPECT_LE(rel_rms(got.dw0, ref.dw0), tol.weights) << "dw0";
  EXPECT_LE(rel_rms(got.dw1, ref.dw1), tol.weights) << "dw1";
  EXPECT_LE(rel_rms(got.dw2, ref.dw2), tol.weights) << "dw2";
}

std::string case_name(const ::testing::TestParamInfo<LactCase>& info) {
  return lact_case_name(info.param);
}

class LactCudaTest : public ::testing::TestWithParam<LactCase> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
  uint64_t seed() const {
    const LactCase& c = GetParam();
    return 7100 + static_cast<uint64_t>(c.schedule) * 8 + (c.momentum ? 4 : 0) + (c.muon ? 2 : 0) +
           (c.renorm ? 1 : 0);
  }
  // The GPU kernel and the fp64 reference on the same (dtype-rounded) inputs.
  void compare(const LactSizes& s, int64_t chunk, DType dtype, const Tolerances& tol,
               uint64_t seed_offset) {
    const LactProblem p = rounded_to(random_lact_problem(s, seed() + seed_offset), dtype);
    const LactConfig cfg = GetParam().config(chunk);
    expect_close(run_lact_gpu_kernel(p, cfg, dtype), run_lact_kernel<double>(p, cfg), tol);
  }
  // Two GPU runs of the same problem agree bitwise: every reduction (the
  // Newton-Schulz norms included) sums in a fixed order, without atomics.
  void expect_repeatable(const LactSizes& s, int64_t chunk, DType dtype, uint64_t seed_offset) {
    const LactProblem p = rounded_to(random_lact_problem(s, seed() + seed_offset), dtype);
    const LactConfig cfg = GetParam().config(chunk);
    const LactResult<double> a = run_lact_gpu_kernel(p, cfg, dtype);
    const LactResult<double> b = run_lact_gpu_kernel(p, cfg, dtype);
    // An empty result (the run failed) would compare equal to another.
    ASSERT_FALSE(a.o.empty() || a.dw2.empty() || b.o.empty() || b.dw2.empty())
        << "a GPU run returned no results";
    EXPECT_TRUE(bitwise_equal(a.o, b.o)) << "o";
    EXPECT_TRUE(bitwise_equal(a.dq, b.dq)) << "dq";
    EXPECT_TRUE(bitwise_equal(a.dk, b.dk)) << "dk";
    EXPECT_TRUE(bitwise_equal(a.dv, b.dv)) << "dv";
    EXPECT_TRUE(bitwise_equal(a.dlr0, b.dlr0)) << "dlr0";
    EXPECT_TRUE(bitwise_equal(a.dlr1, b.dlr1)) << "dlr1";
    EXPECT_TRUE(bitwise_equal(a.dlr2, b.dlr2)) << "dlr2";
    EXPECT_TRUE(bitwise_equal(a.dw0, b.dw0)) << "dw0";
    EXPECT_TRUE(bitwise_equal(a.dw1, b.dw1)) << "dw1";
    EXPECT_TRUE(bitwise_equal(a.dw2, b.dw2)) << "dw2";
  }
};

// ---- f32: every option combination --------------------------------------------

using LactCudaF32 = LactCudaTest;

TEST_P(LactCudaF32, MatchesReference) {
  compare(LactSizes{2, 96, 2, 16, 32}, 32, DType::f32, kF32, 0);
}

// T = 70 with C = 16: the last chunk has 6 tokens.
TEST_P(LactCudaF32, PartialLastChunkMatchesReference) {
  compare(LactSizes{1, 70, 2, 16, 24}, 16, DType::f32, kF32, 1000);
}

// M < D: Muon's Gram side flips (W1 transposes instead of W0 and W2).
TEST_P(LactCudaF32, HiddenNarrowerThanHeadMatchesReference) {
  compare(LactSizes{1, 48, 2, 32, 16}, 16, DType::f32, kF32, 2000);
}

// One chunk holds the whole sequence.
TEST_P(LactCudaF32, SingleChunkSequenceMatchesReference) {
  compare(LactSizes{2, 40, 2, 16, 32}, 64, DType::f32, kF32, 3000);
}

// D and M not multiples of 4: rows of the weights and of the token arrays
// that start off any 16-byte boundary.
TEST_P(LactCudaF32, WidthsNotMultiplesOfFourMatchReference) {
  compare(LactSizes{1, 40, 2, 10, 14}, 16, DType::f32, kF32, 1500);
}

// W1's rows longer than the 512 columns a warp of the weight-row kernels
// (the step and its backward) keeps in registers: their loops over the row,
// which no other test reaches.
TEST_P(LactCudaF32, RowsBeyondRegistersMatchReference) {
  compare(LactSizes{1, 24, 1, 8, 520}, 8, DType::f32, kF32, 1600);
}

TEST_P(LactCudaF32, RunsRepeatBitwise) {
  expect_repeatable(LactSizes{2, 96, 2, 16, 32}, 32, DType::f32, 8000);
}

TEST_P(LactCudaF32, LayerOnDeviceTensorsMatchesReference) {
  const LactSizes s{2, 48, 2, 8, 16};
  const LactProblem p = rounded_to(random_lact_problem(s, seed() + 4000), DType::f32);
  const LactConfig cfg = GetParam().config(16);
  SingleRankCommunicator self;
  LactLayer layer(self, cfg);
  expect_close(run_lact_gpu_layer(layer, p, 1, 0, DType::f32), run_lact_kernel<double>(p, cfg),
               kF32);
}

INSTANTIATE_TEST_SUITE_P(AllOptions, LactCudaF32, ::testing::ValuesIn(all_lact_cases()), case_name);

// ---- bf16: a representative subset ----------------------------------------------

std::vector<LactCase> bf16_cases() {
  using S = LactSchedule;
  return {{S::apply_then_update, false, false, false}, {S::apply_then_update, true, true, true},
          {S::apply_then_update, false, true, false},  {S::update_then_apply, false, false, true},
          {S::update_then_apply, false, true, false},  // the largest bf16 errors
          {S::update_then_apply, true, true, true}};
}

// Shapes: every chunk holds at least 2 min(D, M) tokens. With Muon, bf16
// operand rounding puts noise of relative size ~1e-3 into the update P, and
// Newton-Schulz amplifies its small singular directions by up to a^5 ~ 490;
// a chunk of only min(D, M) tokens gives a P whose spectrum reaches down
// there (the host emulation of this path saw dk ~2e-2 at C = D = 32). LaCT's
// chunks are thousands of tokens against D, M of a few hundred.
using LactCudaBf16 = LactCudaTest;

TEST_P(LactCudaBf16, MatchesReference) {
  compare(LactSizes{2, 256, 2, 32, 64}, 128, DType::bf16, kBf16, 5000);
}

// C = 128, T = 200: the last chunk has 72 tokens.
TEST_P(LactCudaBf16, PartialLastChunkMatchesReference) {
  compare(LactSizes{1, 200, 2, 32, 64}, 128, DType::bf16, kBf16, 6000);
}

// D = 64, M = 128: a shape the fused hidden layer takes (lact_hidden.cuh; the
// ones above stay on cuBLAS), the last chunk (144 tokens) ending inside a
// 128-token tile. test_cuda_lact_hidden_cublas runs them on cuBLAS.
TEST_P(LactCudaBf16, FusedHiddenShapeMatchesReference) {
  compare(LactSizes{2, 256, 2, 64, 128}, 128, DType::bf16, kBf16, 5500);
}

TEST_P(LactCudaBf16, FusedHiddenShapePartialChunkMatchesReference) {
  compare(LactSizes{1, 400, 2, 64, 128}, 256, DType::bf16, kBf16, 6500);
}

// D = M = 128: a shape lact_token_gemm takes (its m and n multiples of 128),
// for test_cuda_lact_token_fused (STATESCAN_LACT_TOKEN_GEMM=fused), which
// checks that it did run: the shapes above all fall back to cuBLAS.
TEST_P(LactCudaBf16, TokenGemmShapeMatchesReference) {
  const int64_t calls = cuda::lact_detail::lact_token_gemm_calls();
  compare(LactSizes{1, 256, 2, 128, 128}, 256, DType::bf16, kBf16, 5700);
  if (cuda::lact_detail::token_gemm_requested()) {
    EXPECT_GT(cuda::lact_detail::lact_token_gemm_calls(), calls) << "lact_token_gemm never ran";
  }
}

TEST_P(LactCudaBf16, RunsRepeatBitwise) {
  expect_repeatable(LactSizes{1, 256, 2, 32, 64}, 128, DType::bf16, 9000);
}

TEST_P(LactCudaBf16, LayerOnDeviceTensorsMatchesReference) {
  const LactSizes s{1, 256, 2, 32, 64};
  const LactProblem p = rounded_to(random_lact_problem(s, seed() + 7000), DType::bf16);
  const LactConfig cfg = GetParam().config(128);
  SingleRankCommunicator self;
  LactLayer layer(self, cfg);
  expect_close(run_lact_gpu_layer(layer, p, 1, 0, DType::bf16), run_lact_kernel<double>(p, cfg),
               kBf16);
}

INSTANTIATE_TEST_SUITE_P(Subset, LactCudaBf16, ::testing::ValuesIn(bf16_cases()), case_name);

// ---- Newton-Schulz alone ---------------------------------------------------------

// Muon's Newton-Schulz of a bf16 layer alone (lact_detail::NewtonSchulzBf16)
// in every mode of STATESCAN_LACT_NS, named per test rather than through the
// environment: bf16x3 (split3 + cuBLAS, the default), cluster (the forward's
// steps in ns_cluster_kernel where the shape allows), fused and fp32; the
// backward from the forward's iterates. Against the fp64 reference matrix by
// matrix, outputs poisoned with NaN. Each mode also runs with the wgmma kernel
// allowed and not (NewtonSchulzBf16's allow_wgmma): on a 9.0 device the first
// sends the default's two-split products and the fused mode's products to
// ns_gemm_wgmma_kernel, the second keeps them on the split path and on the
// mma.sync kernel, which would otherwise run there on other devices only.
// Shapes: the Gram side m = min(M, D) in
// {32, 64, 128, 256} with n = 2 m (the cluster kernel: 1, 2, 4 and 8 CTAs;
// M < D transposes W0 and W2 instead of W1), and m = 48 (no cluster kernel).
// Tolerances: the host model of the two-part products
// (tests/test_lact_ns_model.cpp) puts NS(P) at 4.6e-5 and its gradient at
// 8.4e-5 of the fp64 values for P's of this conditioning (Gaussian, n = 2 m:
// singular values within a factor ~6); 4x that margin. The fp32 mode's GEMMs
// round ~130x less (the model: 3.5e-7 and 6.4e-7): its bounds, 1e-5 and
// 2e-5, leave ~30x of margin and still fail if it ran the two-part products.
using cuda::lact_detail::NsGemms;

struct NsShape {
  int64_t pairs, M, D;
};

using NsParam = std::tuple<NsShape, NsGemms, bool>;  // bool: allow_wgmma

class LactCudaNewtonSchulz : public ::testing::TestWithParam<NsParam> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

constexpr double kNsTol = 2e-4, kNsGradTol = 4e-4;
constexpr double kNsTolFp32 = 1e-5, kNsGradTolFp32 = 2e-5;
constexpr int kNsSteps = 5;

// A shape's random P and d_out and their fp64 NS and dP, computed once per
// shape (the 256 x 512 reference takes seconds) and shared by the modes.
struct NsReference {
  std::vector<double> P, d_out, out, dP;
};

const NsReference& ns_reference(const NsShape& s) {
  static std::map<std::tuple<int64_t, int64_t, int64_t>, NsReference> cache;
  const auto key = std::make_tuple(s.pairs, s.M, s.D);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const int64_t md = s.M * s.D, block = 3 * md, n = s.pairs * block;
  std::mt19937_64 rng(1234 + s.M + 7 * s.D);
  NsReference r;
  r.P = randn(static_cast<std::size_t>(n), rng, 0.02);
  r.d_out = randn(static_cast<std::size_t>(n), rng);
  r.out.resize(r.P.size());
  r.dP.resize(r.P.size());
  // Blocks [W0 | W2 | W1]: M x D, M x D, D x M.
  for (int64_t pair = 0; pair < s.pairs; ++pair)
    for (int slot = 0; slot < 3; ++slot) {
      const int64_t off = pair * block + slot * md;
      const int64_t rows = slot < 2 ? s.M : s.D, cols = slot < 2 ? s.D : s.M;
      lact_newton_schulz(r.P.data() + off, rows, cols, kNsSteps, r.out.data() + off);
      lact_newton_schulz_backward(r.P.data() + off, rows, cols, kNsSteps, r.d_out.data() + off,
                                  r.dP.data() + off);
    }
  return cache.emplace(key, std::move(r)).first->second;
}

TEST_P(LactCudaNewtonSchulz, MatchesReference) {
  const NsShape s = std::get<0>(GetParam());
  const NsGemms mode = std::get<1>(GetParam());
  const NsReference& ref = ns_reference(s);
  const double tol = mode == NsGemms::fp32 ? kNsTolFp32 : kNsTol;
  const double dp_tol = mode == NsGemms::fp32 ? kNsGradTolFp32 : kNsGradTol;
  const int64_t md = s.M * s.D, block = 3 * md;
  DeviceTensor P(ref.P, DType::f32), d_out(ref.d_out, DType::f32);
  DeviceTensor out(ref.P.size(), DType::f32), dP(ref.P.size(), DType::f32);
  {
    cuda::lact_detail::NewtonSchulzBf16 ns(s.pairs, s.M, s.D, kNsSteps, true, mode, nullptr,
                                           std::get<2>(GetParam()));
    ns.forward(static_cast<const float*>(P.data()), static_cast<float*>(out.data()));
    ns.backward(static_cast<const float*>(P.data()), static_cast<const float*>(d_out.data()),
                static_cast<float*>(dP.data()));
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<double> got = out.read(), got_dP = dP.read();
  for (int64_t pair = 0; pair < s.pairs; ++pair)
    for (int slot = 0; slot < 3; ++slot) {
      const auto from = static_cast<std::ptrdiff_t>(pair * block + slot * md);
      const auto to = from + static_cast<std::ptrdiff_t>(md);
      EXPECT_LE(rel_rms(std::vector<double>(got.begin() + from, got.begin() + to),
                        std::vector<double>(ref.out.begin() + from, ref.out.begin() + to)),
                tol)
          << "NS, pair " << pair << " slot " << slot;
      EXPECT_LE(rel_rms(std::vector<double>(got_dP.begin() + from, got_dP.begin() + to),
                        std::vector<double>(ref.dP.begin() + from, ref.dP.begin() + to)),
                dp_tol)
          << "dP, pair " << pair << " slot " << slot;
    }
}

// Which path a mode runs is what lact_cuda_ns_gemms reports for it; on a
// Hopper device every shape above but m = 48 must fit the cluster kernel (a
// build without sm_90 code, or a kernel that stopped fitting, fails here
// rather than letting STATESCAN_LACT_NS=cluster silently run the split path).
TEST_P(LactCudaNewtonSchulz, ReportsThePath) {
  const NsShape s = std::get<0>(GetParam());
  const NsGemms mode = std::get<1>(GetParam());
  const int64_t m = std::min(s.M, s.D), n = std::max(s.M, s.D);
  const bool cluster = mode == NsGemms::cluster && cuda::lact_detail::ns_cluster_supported(m, n);
  const char* expected = mode == NsGemms::fp32    ? "fp32"
                         : mode == NsGemms::fused ? "bf16x3-fused"
                         : cluster                ? "bf16x3-cluster"
                                                  : "bf16x3";
  EXPECT_STREQ(cuda::lact_detail::ns_gemms_name(mode, s.D, s.M), expected);
  int device = 0, major = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  const bool cluster_shape =
      m % 32 == 0 && m <= 256 && (m & (m - 1)) == 0 && n % m == 0 && n <= 512;
  if (major >= 9) {
    EXPECT_EQ(cuda::lact_detail::ns_cluster_supported(m, n), cluster_shape);
  }
}

// Newton-Schulz captures its CUDA graph on a stream of its own and launches
// it on the caller's, so a blocking caller stream (statescan's tools use
// them) keeps the graphs while another thread uses the legacy default
// stream: captured on the blocking stream itself, that thread's calls would
// fail with cudaErrorStreamCaptureImplicit. A second thread queues memsets on
// the legacy stream throughout 24 calls that alternate two outputs in runs of
// three (each run: eager, captured, replayed); every memset must succeed,
// graphs must have been captured, and both outputs match the reference.
TEST(LactCudaNewtonSchulzGraphs, CaptureLeavesTheLegacyStreamUsable) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const NsShape s{2, 128, 64};
  const NsReference& ref = ns_reference(s);
  DeviceTensor P(ref.P, DType::f32);
  DeviceTensor out_a(ref.P.size(), DType::f32), out_b(ref.P.size(), DType::f32);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);  // blocking
  DeviceTensor scratch(std::size_t{1} << 16, DType::f32);
  std::atomic<bool> stop{false};
  std::atomic<int> memsets{0}, failures{0};
  std::atomic<int> first_failure{cudaSuccess};
  std::thread legacy_user([&] {
    while (!stop.load()) {
      const cudaError_t rc = cudaMemsetAsync(scratch.data(), 0, std::size_t{1} << 18, nullptr);
      if (rc != cudaSuccess) {
        (void)cudaGetLastError();
        int none = cudaSuccess;
        first_failure.compare_exchange_strong(none, rc);
        ++failures;
      }
      ++memsets;
    }
  });
  int captured = 0;
  {
    cuda::lact_detail::NewtonSchulzBf16 ns(s.pairs, s.M, s.D, kNsSteps, false, NsGemms::bf16x3,
                                           stream);
    const float* p = static_cast<const float*>(P.data());
    for (int run = 0; run < 8; ++run)
      for (int i = 0; i < 3; ++i)
        ns.forward(p, static_cast<float*>((run % 2 == 0 ? out_a : out_b).data()));
    captured = ns.graphs_captured();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  stop = true;
  legacy_user.join();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(failures.load(), 0) << "of " << memsets.load()
                                << " memsets on the legacy stream; first: "
                                << cudaGetErrorString(
                                       static_cast<cudaError_t>(first_failure.load()));
  EXPECT_GT(memsets.load(), 0);
  EXPECT_EQ(captured, 8) << "one graph a run of three calls";
  EXPECT_LE(rel_rms(out_a.read(), ref.out), kNsTol);
  EXPECT_LE(rel_rms(out_b.read(), ref.out), kNsTol);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

std::string ns_param_name(const ::testing::TestParamInfo<NsParam>& info) {
  const NsShape& s = std::get<0>(info.param);
  const char* modes[] = {"bf16x3", "fp32", "fused", "cluster"};
  return "pairs" + std::to_string(s.pairs) + "_M" + std::to_string(s.M) + "_D" +
         std::to_string(s.D) + "_" + modes[static_cast<int>(std::get<1>(info.param))] +
         (std::get<2>(info.param) ? "" : "_no_wgmma");
}

INSTANTIATE_TEST_SUITE_P(
    ShapesAndModes, LactCudaNewtonSchulz,
    ::testing::Combine(
        ::testing::Values(NsShape{3, 64, 32}, NsShape{2, 128, 64}, NsShape{2, 256, 128},
                          NsShape{4, 512, 256}, NsShape{1, 256, 512}, NsShape{2, 96, 48}),
        ::testing::Values(NsGemms::bf16x3, NsGemms::cluster, NsGemms::fused, NsGemms::fp32),
        ::testing::Bool()),
    ns_param_name);

// ---- the fused hidden layer alone -------------------------------------------------

// lact_hidden_kernel (kernels/cuda/lact_hidden.cuh) against the fp64 values of
// its outputs from the same bf16 inputs: o = gate W1^T with gate = silu(h0) h2
// rounded to bf16 as the kernel's MMA operand is (apply; o token-major in a
// [B, L, H, D] array whose rows outside the slice must stay untouched) and, on
// the key side, z0 = lr0 e h2 silu'(h0), z2 = lr2 e silu(h0), gate =
// lr1 silu(h0) h2 with e = -v W1, with and without the low bf16 terms; in
// the backward's apply (v as d_o) gate and dh = [dg h2 silu'(h0) | dg silu(h0)]
// with dg = d_o W1.
// Shapes: D = 64, 128, 192, 256 (one to four k-blocks), M = 64 to 512, slices
// that end inside a 128-token tile and start at t0 > 0 inside a longer
// sequence (B 2, H 2: the tensor maps' row and column offsets). Outputs are
// poisoned with NaN and followed by a poisoned guard region: every element of
// the slice must be written, nothing after it. Tolerances: a bf16 value
// rounds to within 2^-9 relative (RMS ~1.1e-3 over the array), 4e-3 is a
// margin a misplaced block or column would exceed by orders of magnitude;
// hi + lo carries the fp32 value to ~2^-17, and the fp32 products over D
// leave ~1e-6, so 3e-5.
using cuda::lact_detail::LactHiddenMode;

struct HiddenCase {
  int64_t D, M, n, local_len, t0;
  LactHiddenMode mode;
  bool lo;
};

class LactCudaHidden : public ::testing::TestWithParam<HiddenCase> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
    if (!cuda::lact_detail::lact_hidden_supported(GetParam().D, GetParam().M))
      GTEST_SKIP() << "no fused hidden layer on this device or build (ReportsThePath checks 9.0)";
  }
};

constexpr double kHiddenTol = 4e-3, kHiddenSplitTol = 3e-5;
constexpr int64_t kHiddenB = 2, kHiddenH = 2, kHiddenGuard = 4096;

TEST_P(LactCudaHidden, MatchesReference) {
  const HiddenCase c = GetParam();
  const bool key = c.mode == LactHiddenMode::key_side;
  // apply_backward: v plays d_o, and z's buffer takes dh (rows of 2M).
  const bool back = c.mode == LactHiddenMode::apply_backward, two_out = key || back;
  const int64_t pairs = kHiddenB * kHiddenH, D = c.D, M = c.M, n = c.n, L = c.local_len;
  const int64_t hd = kHiddenH * D, tokens = kHiddenB * L;
  std::mt19937_64 rng(4242 + D + 3 * M + n);
  std::uniform_real_distribution<double> rate(0.05, 1.0);
  auto rates = [&] {
    std::vector<double> r(static_cast<std::size_t>(tokens * kHiddenH));
    for (double& e : r) e = rate(rng);
    return r;
  };
  // Uploading rounds to bf16; the reference reads the rounded values back.
  DeviceTensor x(randn(static_cast<std::size_t>(tokens * hd), rng), DType::bf16);
  DeviceTensor v(randn(static_cast<std::size_t>(tokens * hd), rng), DType::bf16);
  DeviceTensor w(randn(static_cast<std::size_t>(pairs * 3 * M * D), rng, 1.0 / std::sqrt(D)),
                 DType::bf16);
  DeviceTensor lr0(rates(), DType::bf16), lr1(rates(), DType::bf16), lr2(rates(), DType::bf16);
  const std::size_t rows = static_cast<std::size_t>(pairs * n);
  DeviceTensor z(rows * 2 * M + kHiddenGuard, DType::bf16),
      gate(rows * M + kHiddenGuard, DType::bf16);
  DeviceTensor z_lo(rows * 2 * M + kHiddenGuard, DType::bf16),
      gate_lo(rows * M + kHiddenGuard, DType::bf16);
  DeviceTensor o(static_cast<std::size_t>(tokens * hd) + kHiddenGuard, DType::bf16);

  cuda::lact_detail::LactHiddenParams p;
  p.mode = c.mode;
  p.x = static_cast<const __nv_bfloat16*>(x.data());
  p.v = static_cast<const __nv_bfloat16*>(v.data());
  p.w = static_cast<const __nv_bfloat16*>(w.data());
  p.lr0 = static_cast<const __nv_bfloat16*>(lr0.data());
  p.lr1 = static_cast<const __nv_bfloat16*>(lr1.data());
  p.lr2 = static_cast<const __nv_bfloat16*>(lr2.data());
  p.z = static_cast<__nv_bfloat16*>(z.data());
  if (back) p.dh = p.z, p.z = nullptr;
  p.gate = static_cast<__nv_bfloat16*>(gate.data());
  p.o = static_cast<__nv_bfloat16*>(o.data());
  if (c.lo) {
    p.z_lo = static_cast<__nv_bfloat16*>(z_lo.data());
    p.gate_lo = static_cast<__nv_bfloat16*>(gate_lo.data());
  }
  p.B = kHiddenB, p.H = kHiddenH, p.D = D, p.M = M, p.local_len = L, p.t0 = c.t0, p.n = n;
  cuda::lact_detail::lact_hidden_launch(p, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const std::vector<double> X = x.read(), V = v.read(), W = w.read(), R0 = lr0.read(),
                            R1 = lr1.read(), R2 = lr2.read();
  std::vector<double> want_gate(rows * M), want_z(two_out ? rows * 2 * M : 0);
  // o: the slice's rows of every pair; NaN (the poison) elsewhere.
  std::vector<double> want_o(static_cast<std::size_t>(tokens * hd),
                             std::numeric_limits<double>::quiet_NaN());
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / kHiddenH, h = pair % kHiddenH;
    const double* w0 = W.data() + pair * 3 * M * D;
    const double* w2 = w0 + M * D;
    const double* w1 = w2 + M * D;  // D x M
    for (int64_t t = 0; t < n; ++t) {
      const int64_t tok = b * L + c.t0 + t;
      const double* xr = X.data() + tok * hd + h * D;
      const double* vr = V.data() + tok * hd + h * D;
      const int64_t row = pair * n + t, lr = tok * kHiddenH + h;
      for (int64_t m = 0; m < M; ++m) {
        double h0 = 0, h2 = 0, e = 0;
        for (int64_t d = 0; d < D; ++d) {
          h0 += xr[d] * w0[m * D + d];
          h2 += xr[d] * w2[m * D + d];
          e -= vr[d] * w1[d * M + m];
        }
        const double s = 1 / (1 + std::exp(-h0)), silu = h0 * s, d1 = s * (1 + h0 * (1 - s));
        if (back) {  // dgate = d_o W1 = -e
          want_gate[row * M + m] = silu * h2;
          want_z[row * 2 * M + m] = -e * h2 * d1;
          want_z[row * 2 * M + M + m] = -e * silu;
        } else if (!key) {
          want_gate[row * M + m] = round_to(DType::bf16, static_cast<float>(silu * h2));
        } else {
          want_z[row * 2 * M + m] = R0[lr] * e * h2 * d1;
          want_z[row * 2 * M + M + m] = R2[lr] * e * silu;
          want_gate[row * M + m] = R1[lr] * silu * h2;
        }
      }
      if (!two_out)
        for (int64_t d = 0; d < D; ++d) {
          double od = 0;
          for (int64_t m = 0; m < M; ++m) od += want_gate[row * M + m] * w1[d * M + m];
          want_o[static_cast<std::size_t>(tok * hd + h * D + d)] = od;
        }
    }
  }
  auto slice = [](const std::vector<double>& a, std::size_t count) {
    return std::vector<double>(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(count));
  };
  auto guard_untouched = [&](const std::vector<double>& a, std::size_t count) {
    return std::all_of(a.begin() + static_cast<std::ptrdiff_t>(count), a.end(),
                       [](double e) { return std::isnan(e); });
  };
  auto sum = [](const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> s(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) s[i] = a[i] + b[i];
    return s;
  };
  const std::vector<double> got_gate = gate.read(), got_z = z.read(), got_o = o.read();
  if (two_out) {
    EXPECT_LE(rel_rms(slice(got_gate, rows * M), want_gate), kHiddenTol) << "gate";
    EXPECT_TRUE(guard_untouched(got_gate, rows * M)) << "gate written past the slice";
    EXPECT_LE(rel_rms(slice(got_z, rows * 2 * M), want_z), kHiddenTol) << (key ? "z" : "dh");
    EXPECT_TRUE(guard_untouched(got_z, rows * 2 * M)) << "z / dh written past the slice";
    EXPECT_TRUE(guard_untouched(got_o, 0))
        << (key ? "the key side" : "apply_backward") << " wrote o";
  } else {
    EXPECT_TRUE(guard_untouched(got_gate, 0)) << "apply wrote gate";
    EXPECT_TRUE(guard_untouched(got_z, 0)) << "apply wrote z";
    // The slice's rows against the reference; every other row of o (and the
    // guard) still NaN.
    std::vector<double> got_in, want_in;
    bool outside_untouched = guard_untouched(got_o, static_cast<std::size_t>(tokens * hd));
    for (std::size_t e = 0; e < want_o.size(); ++e) {
      if (std::isnan(want_o[e])) {
        outside_untouched = outside_untouched && std::isnan(got_o[e]);
      } else {
        got_in.push_back(got_o[e]);
        want_in.push_back(want_o[e]);
      }
    }
    ASSERT_EQ(want_in.size(), rows * static_cast<std::size_t>(D));
    EXPECT_LE(rel_rms(got_in, want_in), kHiddenTol) << "o";
    EXPECT_TRUE(outside_untouched) << "o written outside the slice's rows";
  }
  const std::vector<double> got_z_lo = z_lo.read(), got_gate_lo = gate_lo.read();
  if (c.lo) {
    EXPECT_LE(rel_rms(sum(slice(got_gate, rows * M), slice(got_gate_lo, rows * M)), want_gate),
              kHiddenSplitTol)
        << "gate hi + lo";
    EXPECT_LE(rel_rms(sum(slice(got_z, rows * 2 * M), slice(got_z_lo, rows * 2 * M)), want_z),
              kHiddenSplitTol)
        << "z hi + lo";
    EXPECT_TRUE(guard_untouched(got_gate_lo, rows * M) && guard_untouched(got_z_lo, rows * 2 * M))
        << "low terms written past the slice";
  } else {
    EXPECT_TRUE(guard_untouched(got_gate_lo, 0) && guard_untouched(got_z_lo, 0))
        << "low terms written though not asked for";
  }
}

// The path is what lact_cuda_hidden_path reports; on a 9.0 device every shape
// above fits (a build without sm_90a code fails here rather than letting the
// layer silently run cuBLAS), and shapes off the 64-grid or past D = 256 never do.
TEST(LactCudaHiddenPath, ReportsThePath) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  EXPECT_STREQ(cuda::lact_cuda_hidden_path(DType::f32, 256, 512), "cublas");
  EXPECT_FALSE(cuda::lact_detail::lact_hidden_supported(32, 64));
  EXPECT_FALSE(cuda::lact_detail::lact_hidden_supported(64, 96));
  EXPECT_FALSE(cuda::lact_detail::lact_hidden_supported(320, 512));
  const bool fused = cuda::lact_detail::lact_hidden_supported(256, 512);
  EXPECT_STREQ(cuda::lact_cuda_hidden_path(DType::bf16, 256, 512),
               fused && cuda::lact_detail::hidden_fused_requested() ? "fused" : "cublas");
  if (on_sm90_device()) {
    // Every shape the fused-kernel tests below run (they skip where it does
    // not fit, so a shape that stopped fitting must fail here).
    for (const auto& [D, M] :
         {std::pair<int64_t, int64_t>{64, 64}, {128, 192}, {192, 128}, {256, 512}, {64, 128}})
      EXPECT_TRUE(cuda::lact_detail::lact_hidden_supported(D, M)) << "D " << D << ", M " << M;
  }
}

// Past its addressing the layer takes the cuBLAS path instead of failing
// (host-only: runs without a GPU).
TEST(LactCudaHiddenPath, AddressesAtMost65535PairsAnd32BitRows) {
  using cuda::lact_detail::lact_hidden_addressable;
  EXPECT_TRUE(lact_hidden_addressable(4, 1 << 20, 256, 512));
  EXPECT_TRUE(lact_hidden_addressable(65535, 1 << 20, 64, 64));
  EXPECT_FALSE(lact_hidden_addressable(65536, 1 << 20, 64, 64));
  EXPECT_FALSE(lact_hidden_addressable(4, int64_t{1} << 31, 256, 512));
  EXPECT_FALSE(lact_hidden_addressable(20000, 1024, 256, 65536));  // weight rows past 2^31
}

std::vector<HiddenCase> hidden_cases() {
  std::vector<HiddenCase> cases;
  const HiddenCase shapes[] = {{64, 64, 100, 160, 37, LactHiddenMode::apply, false},
                               {128, 192, 256, 300, 0, LactHiddenMode::apply, false},
                               {192, 128, 129, 200, 5, LactHiddenMode::apply, false},
                               {256, 512, 300, 400, 64, LactHiddenMode::apply, false}};
  for (HiddenCase s : shapes) {
    cases.push_back(s);
    s.mode = LactHiddenMode::apply_backward;
    cases.push_back(s);
    s.mode = LactHiddenMode::key_side;
    cases.push_back(s);
    s.lo = true;
    cases.push_back(s);
  }
  return cases;
}

std::string hidden_case_name(const ::testing::TestParamInfo<HiddenCase>& info) {
  const HiddenCase& c = info.param;
  const char* mode = c.mode == LactHiddenMode::apply            ? "apply"
                     : c.mode == LactHiddenMode::apply_backward ? "apply_backward"
                                                                : "key_side";
  return std::string(mode) + (c.lo ? "_lo" : "") + "_D" + std::to_string(c.D) + "_M" +
         std::to_string(c.M) + "_n" + std::to_string(c.n);
}

INSTANTIATE_TEST_SUITE_P(ShapesAndModes, LactCudaHidden, ::testing::ValuesIn(hidden_cases()),
                         hidden_case_name);

// lact_hidden_grad_kernel (the backward's update-gradient rows) against the
// fp64 values from the same bf16 inputs: z = [lr0 z0 | lr2 z2], gate, de,
// dh = [dh0 | dh2] and dlr0..2 (gradients_backward_rows_kernel's formulas,
// written out here in double). Slices ending inside a tile, t0 > 0; outputs
// poisoned with guard regions, dlr arrays poisoned outside the slice.
// Unpacked: W and dG as [W0 | W2 | W1] blocks, W1^T and dG1^T transposed on
// the host. Packed: the layer's layout, rows [z | dh] of 4M and [gate | de]
// of 2M, the weights from fp32 dG and bf16 W by lact_hidden_pack_operands
// (kw = [dG0; dG2; W0; W2], w_pitch 4M; t1 = [dG1^T; W1^T], t_pitch 2M).
struct HiddenGradCase {
  int64_t D, M, n, local_len, t0;
  bool packed = false;
};

class LactCudaHiddenGrad : public ::testing::TestWithParam<HiddenGradCase> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
    if (!cuda::lact_detail::lact_hidden_supported(GetParam().D, GetParam().M))
      GTEST_SKIP() << "no fused hidden layer on this device or build (ReportsThePath checks 9.0)";
  }
};

TEST_P(LactCudaHiddenGrad, MatchesReference) {
  const HiddenGradCase c = GetParam();
  const int64_t pairs = kHiddenB * kHiddenH, D = c.D, M = c.M, n = c.n, L = c.local_len;
  const int64_t hd = kHiddenH * D, tokens = kHiddenB * L, md = M * D;
  std::mt19937_64 rng(5151 + D + 3 * M + n);
  std::uniform_real_distribution<double> rate(0.05, 1.0);
  auto rates = [&] {
    std::vector<double> r(static_cast<std::size_t>(tokens * kHiddenH));
    for (double& e : r) e = rate(rng);
    return r;
  };
  const auto block_values = static_cast<std::size_t>(pairs * 3 * md);
  DeviceTensor k(randn(static_cast<std::size_t>(tokens * hd), rng), DType::bf16);
  DeviceTensor v(randn(static_cast<std::size_t>(tokens * hd), rng), DType::bf16);
  // W and dG in bf16 values (the packed case's fp32 dG then converts exactly).
  auto weights = [&] {
    std::vector<double> x = randn(block_values, rng, 1.0 / std::sqrt(D));
    for (double& e : x) e = round_to(DType::bf16, static_cast<float>(e));
    return x;
  };
  const std::vector<double> W = weights(), G = weights();
  DeviceTensor w(W, DType::bf16), dg(G, c.packed ? DType::f32 : DType::bf16);
  DeviceTensor lr0(rates(), DType::bf16), lr1(rates(), DType::bf16), lr2(rates(), DType::bf16);
  // Unpacked: [dG1^T for every pair | W1^T for every pair], from the host.
  std::vector<double> transposed(c.packed ? 0 : 2 * block_values / 3);
  for (int64_t pair = 0; !c.packed && pair < pairs; ++pair)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t m = 0; m < M; ++m) {
        const int64_t from = pair * 3 * md + 2 * md + d * M + m, to = pair * md + m * D + d;
        transposed[static_cast<std::size_t>(to)] = G[static_cast<std::size_t>(from)];
        transposed[static_cast<std::size_t>(pairs * md + to)] = W[static_cast<std::size_t>(from)];
      }
  DeviceTensor t1 = c.packed ? DeviceTensor(static_cast<std::size_t>(pairs * 2 * md), DType::bf16)
                             : DeviceTensor(transposed, DType::bf16);
  DeviceTensor kw(c.packed ? static_cast<std::size_t>(pairs * 4 * md) : 1, DType::bf16);
  const std::size_t rows = static_cast<std::size_t>(pairs * n), nlr = tokens * kHiddenH;
  // An output's buffer, first column and row pitch; packed: z and dh share
  // one buffer, gate and de another.
  struct Out {
    DeviceTensor* buf;
    int64_t col, ld;
  };
  DeviceTensor zdh(rows * (c.packed ? 4 * M : 2 * M) + kHiddenGuard, DType::bf16),
      gde(rows * (c.packed ? 2 * M : M) + kHiddenGuard, DType::bf16);
  DeviceTensor de_own(c.packed ? 1 : rows * M + kHiddenGuard, DType::bf16),
      dh_own(c.packed ? 1 : rows * 2 * M + kHiddenGuard, DType::bf16);
  const Out oz{&zdh, 0, c.packed ? 4 * M : 2 * M}, ogate{&gde, 0, c.packed ? 2 * M : M};
  const Out ode = c.packed ? Out{&gde, M, 2 * M} : Out{&de_own, 0, M};
  const Out odh = c.packed ? Out{&zdh, 2 * M, 4 * M} : Out{&dh_own, 0, 2 * M};
  DeviceTensor dlr0(nlr, DType::bf16), dlr1(nlr, DType::bf16), dlr2(nlr, DType::bf16);

  auto bf = [](DeviceTensor& t) { return static_cast<__nv_bfloat16*>(t.data()); };
  auto at = [&](const Out& o) { return bf(*o.buf) + o.col; };
  cuda::lact_detail::LactHiddenGradParams p;
  p.k = bf(k), p.v = bf(v);
  if (c.packed) {
    cuda::lact_detail::lact_hidden_pack_operands(static_cast<const float*>(dg.data()), bf(w), pairs,
                                                 M, D, bf(kw), bf(t1), nullptr);
    p.w = bf(kw) + 2 * md, p.dg = bf(kw), p.w_pitch = 4 * M;
    p.w1t = bf(t1) + md, p.dg1t = bf(t1), p.t_pitch = 2 * M;
  } else {
    p.w = bf(w), p.dg = bf(dg), p.w1t = bf(t1) + pairs * md, p.dg1t = bf(t1);
  }
  p.lr0 = bf(lr0), p.lr1 = bf(lr1), p.lr2 = bf(lr2);
  p.dlr0 = bf(dlr0), p.dlr1 = bf(dlr1), p.dlr2 = bf(dlr2);
  p.z = at(oz), p.gate = at(ogate), p.de = at(ode), p.dh = at(odh);
  p.B = kHiddenB, p.H = kHiddenH, p.D = D, p.M = M, p.local_len = L, p.t0 = c.t0, p.n = n;
  if (c.packed) p.z_ld = p.dh_ld = 4 * M, p.gate_ld = p.de_ld = 2 * M;
  cuda::lact_detail::lact_hidden_grad_launch(p, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const std::vector<double> K = k.read(), V = v.read(), R0 = lr0.read(), R1 = lr1.read(),
                            R2 = lr2.read();
  std::vector<double> want_z(rows * 2 * M), want_gate(rows * M), want_de(rows * M),
      want_dh(rows * 2 * M);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> want_dlr0(nlr, nan), want_dlr1(nlr, nan), want_dlr2(nlr, nan);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / kHiddenH, h = pair % kHiddenH;
    const double* w0 = W.data() + pair * 3 * md;
    const double* w2 = w0 + md;
    const double* w1 = w2 + md;  // D x M
    const double* g0 = G.data() + pair * 3 * md;
    const double* g2 = g0 + md;
    const double* g1 = g2 + md;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t tok = b * L + c.t0 + t, row = pair * n + t, li = tok * kHiddenH + h;
      const double* kr = K.data() + tok * hd + h * D;
      const double* vr = V.data() + tok * hd + h * D;
      const double l0 = R0[li], l1 = R1[li], l2 = R2[li];
      double s0 = 0, s1 = 0, s2 = 0;
      for (int64_t m = 0; m < M; ++m) {
        double h0 = 0, h2 = 0, e = 0, u0 = 0, u2 = 0, u1 = 0;
        for (int64_t d = 0; d < D; ++d) {
          h0 += kr[d] * w0[m * D + d];
          h2 += kr[d] * w2[m * D + d];
          u0 += kr[d] * g0[m * D + d];
          u2 += kr[d] * g2[m * D + d];
          e -= vr[d] * w1[d * M + m];
          u1 += vr[d] * g1[d * M + m];
        }
        const double sg = 1 / (1 + std::exp(-h0)), silu = h0 * sg;
        const double d1 = sg * (1 + h0 * (1 - sg));
        const double d2 = sg * (1 - sg) * (2 + h0 * (1 - 2 * sg));
        const double g = silu * h2, z0 = e * h2 * d1, z2 = e * silu;
        s0 += z0 * u0;
        s2 += z2 * u2;
        s1 -= g * u1;
        want_z[row * 2 * M + m] = l0 * z0;
        want_z[row * 2 * M + M + m] = l2 * z2;
        want_gate[row * M + m] = l1 * g;
        const double dz0 = l0 * u0, dz2 = l2 * u2, dgate = -l1 * u1;
        want_de[row * M + m] = dz2 * silu + dz0 * h2 * d1;
        const double dact = dz2 * e + dgate * h2;
        want_dh[row * 2 * M + M + m] = dz0 * e * d1 + dgate * silu;
        want_dh[row * 2 * M + m] = dz0 * e * h2 * d2 + dact * d1;
      }
      want_dlr0[li] = s0, want_dlr1[li] = s1, want_dlr2[li] = s2;
    }
  }
  // Rows of `width` at o's column and pitch; the guard past the buffer's
  // rows poisoned still.
  auto check = [&](const Out& o, const std::vector<double>& want, const char* name) {
    const std::vector<double> all = o.buf->read();
    const int64_t width = static_cast<int64_t>(want.size() / rows);
    std::vector<double> got;
    for (std::size_t r = 0; r < rows; ++r)
      for (int64_t m = 0; m < width; ++m)
        got.push_back(
            all[r * static_cast<std::size_t>(o.ld) + static_cast<std::size_t>(o.col + m)]);
    EXPECT_LE(rel_rms(got, want), kHiddenTol) << name;
    EXPECT_TRUE(std::all_of(all.begin() + static_cast<std::ptrdiff_t>(rows * o.ld), all.end(),
                            [](double x) { return std::isnan(x); }))
        << name << " written past the slice";
  };
  check(oz, want_z, "z");
  check(ogate, want_gate, "gate");
  check(ode, want_de, "de");
  check(odh, want_dh, "dh");
  // dlr: the slice's rows against the reference, every other row untouched.
  auto check_rates = [&](DeviceTensor& t, const std::vector<double>& want, const char* name) {
    const std::vector<double> got = t.read();
    std::vector<double> a, ref;
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (std::isnan(want[i])) {
        EXPECT_TRUE(std::isnan(got[i])) << name << " written outside the slice at " << i;
      } else {
        a.push_back(got[i]);
        ref.push_back(want[i]);
      }
    }
    EXPECT_LE(rel_rms(a, ref), kHiddenTol) << name;
  };
  check_rates(dlr0, want_dlr0, "dlr0");
  check_rates(dlr1, want_dlr1, "dlr1");
  check_rates(dlr2, want_dlr2, "dlr2");
}

INSTANTIATE_TEST_SUITE_P(Shapes, LactCudaHiddenGrad,
                         ::testing::Values(HiddenGradCase{64, 64, 100, 160, 37},
                                           HiddenGradCase{128, 192, 256, 300, 0},
                                           HiddenGradCase{256, 512, 300, 400, 64},
                                           HiddenGradCase{64, 128, 200, 260, 13, true},
                                           HiddenGradCase{256, 512, 300, 400, 64, true}),
                         [](const ::testing::TestParamInfo<HiddenGradCase>& info) {
                           const HiddenGradCase& c = info.param;
                           return "D" + std::to_string(c.D) + "_M" + std::to_string(c.M) + "_n" +
                                  std::to_string(c.n) + (c.packed ? "_packed" : "");
                         });

// lact_hidden_pack_operands: kw = [dG0; dG2; W0; W2] and t1 = [dG1^T; W1^T]
// per pair, exactly (dG rounded to bf16 to nearest even, W copied), for
// shapes whose transposes end inside a 32 x 32 tile; outputs poisoned with a
// guard past them that must stay NaN.
TEST(LactCudaPackOperands, MatchesLayout) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  struct Shape3 {
    int64_t pairs, M, D;
  };
  for (const Shape3 sh : {Shape3{3, 96, 40}, Shape3{2, 64, 256}, Shape3{1, 8, 1}}) {
    const int64_t pairs = sh.pairs, M = sh.M, D = sh.D, md = M * D;
    std::mt19937_64 rng(77 + M + D);
    const auto block_values = static_cast<std::size_t>(pairs * 3 * md);
    const std::vector<double> G = randn(block_values, rng);
    DeviceTensor dg(G, DType::f32), w(randn(block_values, rng), DType::bf16);
    const std::vector<double> W = w.read();
    DeviceTensor kw(static_cast<std::size_t>(pairs * 4 * md) + kHiddenGuard, DType::bf16);
    DeviceTensor t1(static_cast<std::size_t>(pairs * 2 * md) + kHiddenGuard, DType::bf16);
    cuda::lact_detail::lact_hidden_pack_operands(
        static_cast<const float*>(dg.data()), static_cast<const __nv_bfloat16*>(w.data()), pairs, M,
        D, static_cast<__nv_bfloat16*>(kw.data()), static_cast<__nv_bfloat16*>(t1.data()), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<double> got_kw = kw.read(), got_t1 = t1.read();
    auto g = [&](std::size_t i) { return static_cast<double>(round_to(DType::bf16, float(G[i]))); };
    int64_t wrong = 0;
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const auto src = static_cast<std::size_t>(pair * 3 * md);
      for (int64_t i = 0; i < 2 * md; ++i) {
        const auto at = static_cast<std::size_t>(pair * 4 * md + i);
        wrong += got_kw[at] != g(src + i);
        wrong += got_kw[at + 2 * md] != W[src + i];
      }
      for (int64_t d = 0; d < D; ++d)
        for (int64_t m = 0; m < M; ++m) {
          const auto from = src + static_cast<std::size_t>(2 * md + d * M + m);
          const auto at = static_cast<std::size_t>(pair * 2 * md + m * D + d);
          wrong += got_t1[at] != g(from);
          wrong += got_t1[at + md] != W[from];
        }
    }
    EXPECT_EQ(wrong, 0) << "pairs " << pairs << ", M " << M << ", D " << D;
    EXPECT_TRUE(std::all_of(got_kw.end() - kHiddenGuard, got_kw.end(), [](double x) {
      return std::isnan(x);
    })) << "kw written past its pairs";
    EXPECT_TRUE(std::all_of(got_t1.end() - kHiddenGuard, got_t1.end(), [](double x) {
      return std::isnan(x);
    })) << "t1 written past its pairs";
  }
}

// lact_token_gemm against fp64 from the same bf16 inputs: C = alpha A^T B +
// beta C per pair, A and B token-major in the layer's two layouts (a token
// array with the pairs interleaved in each row, or pair-major rows at a
// pitch), token counts that end inside a 64-token step, splits of the tokens
// over clusters of 1 to 8 CTAs, both tile widths (n a multiple of 256 or
// only of 128). C's row and pair padding must keep its poison (beta 0) or
// its values (beta 1); a second run must give the same bits.
struct TokenGemmCase {
  int64_t pairs, m, n, k;
  bool a_interleaved, b_interleaved;
  float alpha, beta;
};

class LactCudaTokenGemm : public ::testing::TestWithParam<TokenGemmCase> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(LactCudaTokenGemm, MatchesReference) {
  const TokenGemmCase c = GetParam();
  const int64_t pairs = c.pairs, k = c.k;
  std::mt19937_64 rng(99 + c.m + 7 * c.n + k);
  using cuda::lact_detail::LactTokenOperand;
  // An operand of `width` columns: interleaved [k][pairs width + 8], or
  // pair-major [pairs][k][width + 16].
  struct Host {
    std::vector<double> values;
    int64_t ld, stride;
  };
  auto operand = [&](int64_t width, bool interleaved) {
    Host h;
    h.ld = interleaved ? pairs * width + 8 : width + 16;
    h.stride = interleaved ? width : k * h.ld;
    h.values = randn(static_cast<std::size_t>(interleaved ? k * h.ld : pairs * k * h.ld), rng);
    return h;
  };
  const Host a = operand(c.m, c.a_interleaved), b = operand(c.n, c.b_interleaved);
  DeviceTensor da(a.values, DType::bf16), db(b.values, DType::bf16);
  const std::vector<double> A = da.read(), B = db.read();
  const int64_t ldc = c.n + 4, c_stride = c.m * ldc + 4;
  const auto c_values = static_cast<std::size_t>(pairs * c_stride + kHiddenGuard);
  std::vector<double> c0 = randn(c_values, rng);
  for (double& e : c0) e = static_cast<float>(e);  // as the device holds it
  if (c.beta == 0.f) c0.assign(c_values, std::numeric_limits<double>::quiet_NaN());
  std::vector<double> want = c0;
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.n; ++j) {
        double acc = 0;
        for (int64_t t = 0; t < k; ++t)
          acc += A[static_cast<std::size_t>(p * a.stride + t * a.ld + i)] *
                 B[static_cast<std::size_t>(p * b.stride + t * b.ld + j)];
        const auto at = static_cast<std::size_t>(p * c_stride + i * ldc + j);
        want[at] = c.alpha * acc + (c.beta == 0.f ? 0.0 : c.beta * c0[at]);
      }
  cuda::lact_detail::LactTokenGemmParams prm;
  prm.a = {static_cast<const __nv_bfloat16*>(da.data()), a.ld, a.stride};
  prm.b = {static_cast<const __nv_bfloat16*>(db.data()), b.ld, b.stride};
  prm.ldc = ldc, prm.c_stride = c_stride;
  prm.pairs = pairs, prm.m = c.m, prm.n = c.n, prm.k = k, prm.alpha = c.alpha, prm.beta = c.beta;
  if (!cuda::lact_detail::lact_token_gemm_fits(prm)) {
    // On a 9.0 device every case here must fit: a skip there would hide a
    // shape or alignment rule that stopped taking it.
    ASSERT_FALSE(on_sm90_device()) << "lact_token_gemm_fits refused a test case on 9.0";
    GTEST_SKIP() << "no token GEMM on this device or build";
  }
  std::vector<double> first;
  for (int run = 0; run < 2; ++run) {
    DeviceTensor dc(c0, DType::f32);
    prm.c = static_cast<float*>(dc.data());
    cuda::lact_detail::lact_token_gemm(prm, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<double> got = dc.read();
    if (run == 1) {
      EXPECT_TRUE(std::equal(got.begin(), got.end(), first.begin(), [](double x, double y) {
        return (std::isnan(x) && std::isnan(y)) || x == y;
      })) << "a second run differs";
      break;
    }
    first = got;
    std::vector<double> g, w;
    int64_t pad_wrong = 0;
    for (std::size_t e = 0; e < got.size(); ++e) {
      const auto pos = static_cast<int64_t>(e);
      const int64_t p = pos / c_stride, in = pos % c_stride;
      if (p < pairs && in < c.m * ldc && in % ldc < c.n) {
        g.push_back(got[e]);
        w.push_back(want[e]);
      } else {
        pad_wrong += !((std::isnan(got[e]) && std::isnan(c0[e])) || got[e] == c0[e]);
      }
    }
    EXPECT_LE(rel_rms(g, w), 2e-5);
    EXPECT_EQ(pad_wrong, 0) << "written outside C's tiles";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LactCudaTokenGemm,
                         ::testing::Values(TokenGemmCase{2, 128, 128, 200, true, false, 1.f, 0.f},
                                           TokenGemmCase{3, 256, 512, 1000, true, false, -1.f, 1.f},
                                           TokenGemmCase{4, 1024, 256, 1100, false, true, 1.f, 1.f},
                                           TokenGemmCase{1, 128, 256, 64, false, false, 0.5f, 0.f},
                                           TokenGemmCase{2, 384, 384, 130, false, true, 1.f, 1.f}),
                         [](const ::testing::TestParamInfo<TokenGemmCase>& info) {
                           const TokenGemmCase& c = info.param;
                           return "P" + std::to_string(c.pairs) + "_m" + std::to_string(c.m) +
                                  "_n" + std::to_string(c.n) + "_k" + std::to_string(c.k) +
                                  (c.beta != 0.f ? "_acc" : "");
                         });

// ---- bad input --------------------------------------------------------------------

// lact_hidden_grad_launch refuses layouts whose rows or pairs would overlap,
// and lact_hidden_pack_operands shapes and pointers it cannot take, naming the
// argument, before anything touches the device (host-only: runs without a
// GPU).
TEST(LactHiddenGradArgs, RejectsOverlappingLayouts) {
  using cuda::lact_detail::LactHiddenGradParams;
  LactHiddenGradParams p;
  p.B = 1, p.H = 1, p.D = 64, p.M = 64, p.local_len = 16, p.n = 16;
  auto with = [&](auto set) {
    LactHiddenGradParams q = p;
    set(q);
    return error_argument([&] { cuda::lact_detail::lact_hidden_grad_launch(q, nullptr); });
  };
  EXPECT_EQ(with([](LactHiddenGradParams& q) { q.z_ld = 64; }), "z");        // under 2M
  EXPECT_EQ(with([](LactHiddenGradParams& q) { q.dh_ld = 132; }), "dh");     // not 16-byte rows
  EXPECT_EQ(with([](LactHiddenGradParams& q) { q.gate_ld = 32; }), "gate");  // under M
  EXPECT_EQ(with([](LactHiddenGradParams& q) { q.de_ld = 60; }), "de");
  EXPECT_EQ(with([](LactHiddenGradParams& q) { q.t_pitch = 32; }), "w1t");  // pairs overlap
  EXPECT_EQ(with([](LactHiddenGradParams& q) { q.w_pitch = 127; }), "w");   // under 2M
  auto pack = [](int64_t pairs, int64_t M, int64_t D, uintptr_t kw_address) {
    return error_argument([&] {
      cuda::lact_detail::lact_hidden_pack_operands(nullptr, nullptr, pairs, M, D,
                                                   reinterpret_cast<__nv_bfloat16*>(kw_address),
                                                   nullptr, nullptr);
    });
  };
  // The apply writes o: refused without one, or misaligned (before any
  // device query: host-only).
  auto apply = [](uintptr_t o_address) {
    cuda::lact_detail::LactHiddenParams a;
    a.mode = cuda::lact_detail::LactHiddenMode::apply;
    a.B = 1, a.H = 1, a.D = 64, a.M = 64, a.local_len = 16, a.n = 16;
    a.o = reinterpret_cast<__nv_bfloat16*>(o_address);
    return error_argument([&] { cuda::lact_detail::lact_hidden_launch(a, nullptr); });
  };
  EXPECT_EQ(apply(0), "o");
  EXPECT_EQ(apply(8), "o");
  // The key side writes both low terms or neither (host-only as well).
  auto key_low = [](uintptr_t z_lo, uintptr_t gate_lo) {
    cuda::lact_detail::LactHiddenParams k;
    k.mode = cuda::lact_detail::LactHiddenMode::key_side;
    k.B = 1, k.H = 1, k.D = 64, k.M = 64, k.local_len = 16, k.n = 16;
    k.z_lo = reinterpret_cast<__nv_bfloat16*>(z_lo);
    k.gate_lo = reinterpret_cast<__nv_bfloat16*>(gate_lo);
    return error_argument([&] { cuda::lact_detail::lact_hidden_launch(k, nullptr); });
  };
  EXPECT_EQ(key_low(256, 0), "gate_lo");
  EXPECT_EQ(key_low(0, 256), "gate_lo");
  EXPECT_EQ(pack(1 << 16, 64, 64, 0), "heads");  // past the grid's y
  EXPECT_EQ(pack(2, 3, 5, 0), "dim");            // M D not a multiple of 8
  EXPECT_EQ(pack(2, 64, 64, 8), "w");            // kw not 16-byte aligned
}

// lact_token_gemm refuses shapes and layouts it cannot take, naming the
// argument, before anything touches the device (host-only).
TEST(LactTokenGemmArgs, RejectsWhatItCannotTake) {
  using cuda::lact_detail::LactTokenGemmParams;
  LactTokenGemmParams p;
  p.pairs = 2, p.m = 128, p.n = 128, p.k = 100;
  p.a = {nullptr, 256, 128}, p.b = {nullptr, 256, 128};  // interleaved tokens
  p.ldc = 128, p.c_stride = 128 * 128;
  auto with = [&](auto set) {
    LactTokenGemmParams q = p;
    set(q);
    return error_argument([&] { cuda::lact_detail::lact_token_gemm(q, nullptr); });
  };
  EXPECT_EQ(with([](LactTokenGemmParams& q) { q.pairs = 0; }), "heads");
  EXPECT_EQ(with([](LactTokenGemmParams& q) { q.m = 64; }), "dim");  // under a tile
  EXPECT_EQ(with([](LactTokenGemmParams& q) { q.n = 200; }), "dim");
  EXPECT_EQ(with([](LactTokenGemmParams& q) { q.m = q.n = 128 * 256; }), "dim");  // grid's y
  EXPECT_EQ(with([](LactTokenGemmParams& q) { q.k = 0; }), "seq_len");
  EXPECT_EQ(with([](LactTokenGemmParams& q) { q.a.ld = 200; }), "a");  // pairs overlap
  EXPECT_EQ(with([](LactTokenGemmParams& q) { q.b.ld = 252; }), "b");  // rows not 16 bytes
  EXPECT_EQ(with([](LactTokenGemmParams& q) { q.ldc = 126; }), "c");
  EXPECT_FALSE(cuda::lact_detail::lact_token_gemm_fits([&] {
    LactTokenGemmParams q = p;
    q.a.stride = 64;  // pairs' columns overlap
    return q;
  }()));
}

class LactCudaErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

// Runs the layer on device tensors broken by `breakage` (on the host copy
// `p` or on the views `a`), expects an error naming `argument` and o untouched.
template <typename B, typename V>
void expect_layer_error(B&& break_problem, V&& break_views, const std::string& argument) {
  const LactSizes s{1, 8, 2, 4, 6};
  LactProblem p = random_lact_problem(s, 4242);
  break_problem(p);
  DeviceLactRun d(p, DType::f32);
  const float sentinel = 123.f;
  d.o.bytes.copy_from_host([&] {
    std::vector<unsigned char> raw(d.o.count * sizeof(float));
    std::vector<float> f(d.o.count, sentinel);
    std::memcpy(raw.data(), f.data(), raw.size());
    return raw;
  }());
  const Shape tokens{s.batch, s.seq_len, s.heads, s.dim}, rates{s.batch, s.seq_len, s.heads};
  const Shape wide{s.heads, s.hidden, s.dim}, narrow{s.heads, s.dim, s.hidden};
  LactForwardArgs a;
  a.q = d.q.view(tokens);
  a.k = d.k.view(tokens);
  a.v = d.v.view(tokens);
  a.lr0 = d.lr0.view(rates);
  a.lr1 = d.lr1.view(rates);
  a.lr2 = d.lr2.view(rates);
  a.w0 = d.w0.view(wide);
  a.w1 = d.w1.view(narrow);
  a.w2 = d.w2.view(wide);
  a.o = d.o.view(tokens);
  break_views(a);
  SingleRankCommunicator self;
  LactConfig cfg;
  cfg.chunk = 4;
  LactLayer layer(self, cfg);
  EXPECT_EQ(error_argument([&] { layer.forward(a); }), argument);
  const std::vector<double> o = d.o.read();
  EXPECT_TRUE(std::all_of(o.begin(), o.end(), [&](double x) { return x == sentinel; }));
}

void no_problem_change(LactProblem&) {}
void no_view_change(LactForwardArgs&) {}

TEST_F(LactCudaErrors, NanLearningRateNamesIt) {
  expect_layer_error([](LactProblem& p) { p.lr1[5] = std::numeric_limits<double>::quiet_NaN(); },
                     no_view_change, "lr1");
}

TEST_F(LactCudaErrors, NonPositiveLearningRateNamesIt) {
  expect_layer_error([](LactProblem& p) { p.lr2[0] = 0.0; }, no_view_change, "lr2");
}

TEST_F(LactCudaErrors, InfiniteKeyNamesIt) {
  expect_layer_error([](LactProblem& p) { p.k[3] = std::numeric_limits<double>::infinity(); },
                     no_view_change, "k");
}

TEST_F(LactCudaErrors, NanWeightNamesIt) {
  expect_layer_error([](LactProblem& p) { p.w1[2] = std::numeric_limits<double>::quiet_NaN(); },
                     no_view_change, "w1");
}

TEST_F(LactCudaErrors, WrongShapesNameTheArgument) {
  expect_layer_error(
      no_problem_change, [](LactForwardArgs& a) { a.v.shape[3] = 3; }, "v");
  expect_layer_error(
      no_problem_change,
      [](LactForwardArgs& a) {
        a.lr0.shape = {1, 8, 3};
      },
      "lr0");
  expect_layer_error(
      no_problem_change, [](LactForwardArgs& a) { std::swap(a.w1.shape[1], a.w1.shape[2]); }, "w1");
  expect_layer_error(
      no_problem_change, [](LactForwardArgs& a) { a.o = TensorView(); }, "o");
}

TEST_F(LactCudaErrors, MixedDtypeOrPlacementNamesTheArgument) {
  expect_layer_error(
      no_problem_change, [](LactForwardArgs& a) { a.k.dtype = DType::bf16; }, "k");
  expect_layer_error(
      no_problem_change, [](LactForwardArgs& a) { a.w2.memory = Memory::host; }, "w2");
  expect_layer_error(
      no_problem_change,
      [](LactForwardArgs& a) {
        for (TensorView* t : {&a.q, &a.k, &a.v, &a.lr0, &a.lr1, &a.lr2, &a.w0, &a.w1, &a.w2, &a.o})
          t->dtype = DType::f16;
      },
      "q");
}

// Two chunks of `chunk` tokens shared by 2 ranks, with aligned stand-ins for
// the tensors: the checks below refuse it before any pointer is read.
cuda::LactCudaParams two_rank_sizes(int64_t chunk) {
  cuda::LactCudaParams p;
  p.config.chunk = chunk;
  p.batch = 1;
  p.seq_len = 2 * chunk;
  p.heads = 1;
  p.dim = 4;
  p.hidden = 4;
  p.ranks = 2;
  auto* fake = reinterpret_cast<void*>(uintptr_t{1} << 20);
  p.q = p.k = p.v = p.lr0 = p.lr1 = p.lr2 = p.w0 = p.w1 = p.w2 = fake;
  p.o = fake;
  return p;
}

TEST(LactCudaArgs, ChunkNotDivisibleByRanksIsRejected) {
  const cuda::LactCudaParams p = two_rank_sizes(15);
  EXPECT_EQ(error_argument([&] { cuda::lact_cuda_check_sizes(p); }), "chunk");
}

// A sequence shorter than one chunk is a single chunk of T tokens: only T
// must split over the ranks (T = 12 over 3 with chunk 16), as on the CPU.
// Checked before any pointer is read: runs without a GPU.
TEST(LactCudaArgs, SingleShortChunkNeedsOnlyTheSequenceToSplit) {
  cuda::LactCudaParams p = two_rank_sizes(16);
  p.ranks = 3;
  p.seq_len = 12;
  for (p.rank = 0; p.rank < p.ranks; ++p.rank)
    EXPECT_EQ(error_argument([&] { cuda::lact_cuda_check_sizes(p); }), "<no error>");
  p.rank = 0;
  p.seq_len = 10;  // the single chunk itself does not split: T's fault
  EXPECT_EQ(error_argument([&] { cuda::lact_cuda_check_sizes(p); }), "q");
}

// Ranks sharing a chunk update from the whole chunk's gradient only through
// the all-reduce: without one each would apply its own partial gradient and
// the fast weights drift apart with no error (the CPU path refuses it too).
// Refused before any pointer is read: runs without a GPU.
TEST(LactCudaArgs, RanksWithoutAnAllReduceAreRejected) {
  const cuda::LactCudaParams p = two_rank_sizes(16);
  cuda::LactCudaGrads g;
  cuda::LactCudaSaved saved;
  EXPECT_EQ(error_argument([&] { cuda::lact_cuda_forward(p, {}, &saved, nullptr); }), "all_reduce");
  EXPECT_EQ(error_argument([&] { cuda::lact_cuda_backward(p, g, saved, {}, nullptr); }),
            "all_reduce");
}

TEST_F(LactCudaErrors, NanCotangentNamesIt) {
  const LactSizes s{1, 8, 2, 4, 6};
  LactProblem p = random_lact_problem(s, 4243);
  p.d_o[7] = std::numeric_limits<double>::quiet_NaN();
  SingleRankCommunicator self;
  LactConfig cfg;
  cfg.chunk = 4;
  LactLayer layer(self, cfg);
  EXPECT_EQ(error_argument([&] { run_lact_gpu_layer(layer, p, 1, 0, DType::f32); }), "d_o");
}

TEST_F(LactCudaErrors, BackwardWithoutForwardIsRejected) {
  SingleRankCommunicator self;
  LactLayer layer(self, LactConfig{});
  DeviceTensor d_o(8, DType::f32);
  LactBackwardArgs a;
  a.d_o = d_o.view({1, 2, 1, 4});
  EXPECT_EQ(error_argument([&] { layer.backward(a); }), "forward");
}

}  // namespace
}  // namespace statescan::test
