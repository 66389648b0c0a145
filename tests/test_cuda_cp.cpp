// GPU context parallelism on one GPU: cuda::mixer_summary against
// cpu::mixer_summary, the device affine-map kernels against host math, and
// CpMixer on device tensors (SingleRankCommunicator) against the fp64
// reference, forward and backward, plus its argument checks. Skips where no
// GPU is present (CI has none). Multi-rank GPU CP is test_cuda_cp_mpi.
//
// Tolerances (relative RMS): f32 inputs 1e-5 (DESIGN §7; the kernels' fp32
// products are split-tf32, about fp32 accurate); bf16 inputs 5e-3 for o,
// states and the summary maps, 8e-3 for dq/dk/dv, 2e-2 for dg/dbeta.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <future>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/device_pool.h"
#include "core/error.h"
#include "kernels/cpu/cpu_mixer.h"
#include "kernels/cuda/blas_handle.h"
#include "kernels/cuda/cp_kernels.h"
#include "kernels/cuda/cuda_mixer.h"
#include "tests/cuda_cp_test_util.h"
#include "tests/cuda_mixer_test_util.h"
#include "tests/expect_error.h"

namespace statescan::test {
namespace {

std::vector<float> as_float(const std::vector<double>& x) {
  return std::vector<float>(x.begin(), x.end());
}

// ---- cuda::mixer_summary vs cpu::mixer_summary -----------------------------------

enum class Layout { rows, packed };

using SummaryParam = std::tuple<Variant, DType, int64_t, Layout>;

std::string summary_name(const ::testing::TestParamInfo<SummaryParam>& info) {
  return std::string(to_string(std::get<0>(info.param))) + "_" +
         to_string(std::get<1>(info.param)) + "_d" + std::to_string(std::get<2>(info.param)) +
         (std::get<3>(info.param) == Layout::packed ? "_packed" : "_rows");
}

class CudaSummary : public ::testing::TestWithParam<SummaryParam> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
  void expect_summary_matches_cpu();
};

// The errors of the GPU summary (M, E) of problem `s` in `dtype` against the
// CPU's on the same fp32 values (rows: B, or one for packed sequences), under
// the summary scan in force: E's relative RMS, and M's RMS error over
// max(||M||, ||I|| * the smallest normal of the input type).
// Why the floor: M comes from a scan that rounds its copy of S to the input
// type for W S, as the forward does; once decays take M's entries below that
// type's normal range (f16: 6.1e-5; 22 chunks of random_problem's gates give
// ~1e-18) it is held to an absolute precision, and what the CP outputs see of
// it, M times a state, is that small. Above the floor the error is relative.
// M_scale: ||M_cpu|| / ||I||.
struct SummaryErrors {
  double M, E, M_scale;
};
SummaryErrors summary_errors_vs_cpu(const ProblemSpec& s, DType dtype, uint64_t seed);

// Sets the process-wide summary scan for a scope, and restores it.
class SummaryScanScope {
 public:
  explicit SummaryScanScope(cuda::SummaryScan scan) : saved_(cuda::summary_scan()) {
    cuda::set_summary_scan(scan);
  }
  ~SummaryScanScope() { cuda::set_summary_scan(saved_); }
  SummaryScanScope(const SummaryScanScope&) = delete;
  SummaryScanScope& operator=(const SummaryScanScope&) = delete;

 private:
  cuda::SummaryScan saved_;
};

const char* scan_name(cuda::SummaryScan scan) {
  switch (scan) {
    case cuda::SummaryScan::per_head:
      return "per-head scans";
    case cuda::SummaryScan::blocks:
      return "column-block scans";
    case cuda::SummaryScan::two_level:
      return "two-level scans";
    default:
      return "automatic";
  }
}

constexpr cuda::SummaryScan kSummaryScans[] = {
    cuda::SummaryScan::blocks, cuda::SummaryScan::per_head, cuda::SummaryScan::two_level};

// Runs the summary comparison once per way of computing M, and the scans
// once per kernel (per head and two-level where they apply: delta rules,
// 16-bit, D = 128; two-level with one segment per row).
TEST_P(CudaSummary, MatchesCpuSummary) {
  for (cuda::SummaryScan scan : kSummaryScans) {
    SCOPED_TRACE(scan_name(scan));
    const SummaryScanScope scope(scan);
    for (cuda::LinearPart part : {cuda::LinearPart::scan, cuda::LinearPart::products}) {
      SCOPED_TRACE(part == cuda::LinearPart::scan ? "M by scan" : "M by products");
      cuda::set_summary_linear_part(part);
      expect_summary_matches_cpu();
      cuda::set_summary_linear_part(cuda::LinearPart::scan);
      if (!has_beta(std::get<0>(GetParam()))) break;  // additive M has one way only
    }
  }
}

void CudaSummary::expect_summary_matches_cpu() {
  const auto [variant, dtype, dim, layout] = GetParam();
  ProblemSpec s;
  s.variant = variant;
  s.heads = 3;
  s.dk = s.dv = dim;
  s.with_h0 = true;  // E starts from the segment's initial state
  if (layout == Layout::packed) {
    s.seq_len = 230;
    s.cu_seqlens = {0, 37, 101, 230};  // last segment: two full chunks and a partial one
  } else {
    s.batch = 2;
    s.seq_len = 150;
  }
  const uint64_t seed = 17 + 1000 * static_cast<uint64_t>(variant) +
                        100 * static_cast<uint64_t>(dtype) + static_cast<uint64_t>(dim) +
                        (layout == Layout::packed ? 7 : 0);
  const SummaryErrors err = summary_errors_vs_cpu(s, dtype, seed);
  EXPECT_LE(err.M, output_tol(dtype)) << "M";
  EXPECT_LE(err.E, output_tol(dtype)) << "E";
}

SummaryErrors summary_errors_vs_cpu(const ProblemSpec& s, DType dtype, uint64_t seed) {
  ref::Problem p = random_problem(s, seed);
  round_problem(p, dtype);

  const int64_t dim = s.dk;
  const int64_t rows = s.cu_seqlens.empty() ? s.batch : 1;
  const int64_t m_size = has_beta(s.variant) ? dim * dim : dim;
  const int64_t H = s.heads, state = dim * dim;

  // Host fp32 copies of exactly what the GPU sees.
  const auto q = as_float(p.q), k = as_float(p.k), v = as_float(p.v), g = as_float(p.g),
             beta = as_float(p.beta), h0 = as_float(p.h0);
  MixerParams host = mixer_sizes(p, DType::f32, 64);
  host.cu_seqlens = p.cu_seqlens.empty() ? nullptr : p.cu_seqlens.data();
  host.q = q.data();
  host.k = k.data();
  host.v = v.data();
  host.g = g.empty() ? nullptr : g.data();
  host.beta = beta.empty() ? nullptr : beta.data();
  host.initial_state = h0.data();
  std::vector<float> want_M(static_cast<std::size_t>(rows * H * m_size)),
      want_E(static_cast<std::size_t>(rows * H * state));
  cpu::mixer_summary(host, want_M.data(), want_E.data());

  const DeviceTensor dq(q, dtype, {}), dk(k, dtype, {}), dv(v, dtype, {}), dg(g, DType::f32, {}),
      dbeta(beta, dtype, {}), dh0(h0, DType::f32, {});
  std::unique_ptr<DeviceBuffer<int64_t>> cu;
  if (!p.cu_seqlens.empty()) cu = std::make_unique<DeviceBuffer<int64_t>>(p.cu_seqlens);
  MixerParams dev = host;
  dev.dtype = dtype;
  dev.cu_seqlens = cu ? cu->data() : nullptr;
  dev.q = dq.view().data;
  dev.k = dk.view().data;
  dev.v = dv.view().data;
  dev.g = static_cast<const float*>(dg.view().data);
  dev.beta = dbeta.view().data;
  dev.initial_state = static_cast<const float*>(dh0.view().data);
  DeviceBuffer<float> M(want_M.size()), E(want_E.size());
  M.fill_bytes(0xFF);
  E.fill_bytes(0xFF);
  cuda::mixer_summary(dev, M.data(), E.data(), nullptr);
  check_device_sync();
  const std::vector<float> got_M = M.to_host();
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < got_M.size(); ++i) {
    diff += (double(got_M[i]) - want_M[i]) * (double(got_M[i]) - want_M[i]);
    norm += double(want_M[i]) * want_M[i];
  }
  const double identity = std::sqrt(static_cast<double>(rows * H * dim));  // ||I||_F
  const double floor =
      identity * (dtype == DType::f16 ? 6.103515625e-5 : std::numeric_limits<float>::min());
  if (!std::isfinite(diff)) diff = std::numeric_limits<double>::infinity();
  return {std::sqrt(diff) / std::max(std::sqrt(norm), floor), rel_rms(E.to_host(), want_E),
          std::sqrt(norm) / identity};
}

// f16 too: its narrower range is where M loses relative precision (see
// summary_errors_vs_cpu), which only CudaTwoLevelSummary's f16 cases showed.
INSTANTIATE_TEST_SUITE_P(AllVariants, CudaSummary,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants),
                                            ::testing::Values(DType::f32, DType::bf16, DType::f16),
                                            ::testing::Values(int64_t{64}, int64_t{128}),
                                            ::testing::Values(Layout::rows, Layout::packed)),
                         summary_name);

// ---- the first segments' maps: the backward's pre-pass from the summary -----------
//
// cuda::FirstSegmentMaps from PreparedForward::summary, turned into dS0 by
// cuda::first_segment_state_grad, against the fp64 reference's dh0 of the
// first segment of every row: that is what the pre-pass's reverse scan
// computes (DESIGN §5). Once with the user's dht at the segment's end (the P
// term) and once without (H alone). Packed: the first segment is shorter
// than the others and ends inside a chunk.

using FirstMapsParam = std::tuple<Variant, DType, int64_t, Layout>;

// Problem `s` in `dtype` from `seed`, with d_o and dht, and what the fp64
// reference says of it: the final states and dh0 with and without dht. Built
// once per test and shared by its rounds (scans, E beside the maps or not):
// the reference's backward at CudaTwoLevelSummary's size takes seconds, and
// the rounds differ only on the GPU.
// Problem p's inputs on the device in `dtype` (g and h0 in fp32; those p
// lacks stay null), o poisoned, and the forward's MixerParams over them
// (chunk 64).
struct DeviceMixerInputs {
  DeviceTensor q, k, v, g, beta, h0, o;
  std::unique_ptr<DeviceBuffer<int64_t>> cu;
  MixerParams dev;
  DeviceMixerInputs(const ref::Problem& p, DType dtype)
      : q(as_float(p.q), dtype, {}),
        k(as_float(p.k), dtype, {}),
        v(as_float(p.v), dtype, {}),
        g(as_float(p.g), DType::f32, {}),
        beta(as_float(p.beta), dtype, {}),
        h0(as_float(p.h0), DType::f32, {}),
        o(DeviceTensor::poisoned(p.v.size(), dtype, {})),
        dev(mixer_sizes(p, dtype, 64)) {
    if (!p.cu_seqlens.empty()) cu = std::make_unique<DeviceBuffer<int64_t>>(p.cu_seqlens);
    dev.cu_seqlens = cu ? cu->data() : nullptr;
    dev.q = q.view().data;
    dev.k = k.view().data;
    dev.v = v.view().data;
    dev.g = static_cast<const float*>(g.view().data);
    dev.beta = beta.view().data;
    dev.initial_state = static_cast<const float*>(h0.view().data);
    dev.o = o.view().data;
  }
};

struct FirstMapsCase {
  ref::Problem p;
  std::vector<double> d_o, dht;
  std::vector<double> ht, dh0_with_dht, dh0_without_dht;
};

FirstMapsCase first_maps_case(const ProblemSpec& s, DType dtype, uint64_t seed) {
  FirstMapsCase c;
  c.p = random_problem(s, seed);
  round_problem(c.p, dtype);
  std::mt19937_64 rng(seed + 1);
  c.d_o = round_to_dtype(randn(c.p.v.size(), rng), dtype);
  const int64_t N = c.p.num_sequences(), state = s.dk * s.dk;
  c.dht = round_f32(randn(static_cast<std::size_t>(N * s.heads * state), rng));
  c.ht = ref::forward(c.p).ht;
  c.dh0_with_dht = ref::backward(c.p, c.d_o, c.dht).dh0;
  c.dh0_without_dht = ref::backward(c.p, c.d_o, std::vector<double>(c.dht.size(), 0.0)).dh0;
  return c;
}

// The summary of problem `s` in `dtype` with the first segments' maps (E
// beside them where with_E, as on a middle rank; alone as on the last):
// dS0 from first_segment_state_grad against the reference's dh0 of every
// row's first segment, with and without dht; E against the reference's final
// state of every row's last segment; M = P where the first segment is the
// row's only one. Returns the summary's piece count (cuda::summary_pieces).
int64_t expect_first_maps_give_dh0(const ProblemSpec& s, DType dtype, const FirstMapsCase& c,
                                   bool with_E) {
  const bool packed = !s.cu_seqlens.empty();
  const ref::Problem& p = c.p;
  const std::vector<double>& d_o = c.d_o;
  const std::vector<double>& dht = c.dht;
  const int64_t N = p.num_sequences(), H = s.heads, dim = s.dk, state = dim * dim;

  const DeviceMixerInputs in(p, dtype);
  const MixerParams& dev = in.dev;
  const DeviceTensor dO(as_float(d_o), dtype, {}), d_ht(as_float(dht), DType::f32, {});

  const int64_t rows = packed ? 1 : p.batch;
  // M = P needs the first segment to be the row's last.
  const bool with_M = !packed || N == 1;
  const int64_t pieces = cuda::summary_pieces(dev, with_E);
  DeviceBuffer<float> P(static_cast<std::size_t>(rows * H * state)),
      M(static_cast<std::size_t>(rows * H * state)), E(static_cast<std::size_t>(rows * H * state)),
      dS0(static_cast<std::size_t>(rows * H * state)),
      piece_P(static_cast<std::size_t>(std::max<int64_t>(1, rows * pieces * H * state)));
  DeviceBuffer<unsigned char> Hmaps(p.q.size() * size_of(dtype));
  P.fill_bytes(0xFF);
  E.fill_bytes(0xFF);
  Hmaps.fill_bytes(0xFF);
  piece_P.fill_bytes(0xFF);
  cuda::FirstSegmentMaps first{P.data(), Hmaps.data()};
  if (pieces > 1) {
    first.piece_P = piece_P.data();
    first.pieces = pieces;
  }
  {
    cuda::PreparedForward prepared(dev, nullptr);
    prepared.summary(M.data(), with_E ? E.data() : nullptr, nullptr, with_M, &first);
  }
  check_device_sync();
  if (with_M) {
    EXPECT_TRUE(bitwise_equal(M.to_host(), P.to_host())) << "M = P";
  }
  if (with_E) {
    // E: the last segment's final state from its initial state.
    const std::vector<double> want(c.ht.end() - rows * H * state, c.ht.end());
    EXPECT_LE(rel_rms(E.to_host(), want), output_tol(dtype)) << "E";
  }

  for (const bool with_dht : {true, false}) {
    SCOPED_TRACE(with_dht ? "with dht" : "without dht");
    dS0.fill_bytes(0xFF);
    std::vector<double> want;
    const std::vector<double>& dh0 = with_dht ? c.dh0_with_dht : c.dh0_without_dht;
    for (int64_t r = 0; r < rows; ++r) {
      // The first segment of row r: sequence r (rows) or 0 (packed).
      const int64_t end = packed ? p.cu_seqlens[1] : p.seq_len;
      const float* d_end =
          with_dht ? static_cast<const float*>(d_ht.view().data) + r * H * state : nullptr;
      cuda::first_segment_state_grad(dev, first, dO.view().data, r, 0, end, d_end,
                                     dS0.data() + r * H * state, nullptr);
      want.insert(want.end(), dh0.begin() + r * H * state, dh0.begin() + (r + 1) * H * state);
    }
    check_device_sync();
    EXPECT_LE(rel_rms(dS0.to_host(), want), output_tol(dtype)) << "dS0";
  }
  return pieces;
}

class CudaFirstSegmentMaps : public ::testing::TestWithParam<FirstMapsParam> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

// Short rows: two-level runs of at most one chunk (most of them empty).
TEST_P(CudaFirstSegmentMaps, GiveThePrePassStateGradient) {
  const auto [variant, dtype, dim, layout] = GetParam();
  const bool packed = layout == Layout::packed;
  ProblemSpec s;
  s.variant = variant;
  s.heads = 3;
  s.dk = s.dv = dim;
  s.with_h0 = true;
  s.l2norm_qk = variant == Variant::kda;
  if (packed) {
    s.seq_len = 230;
    s.cu_seqlens = {0, 101, 150, 230};
  } else {
    s.batch = 2;
    s.seq_len = 150;
  }
  const uint64_t seed = 900 + 1000 * static_cast<uint64_t>(variant) +
                        100 * static_cast<uint64_t>(dtype) + static_cast<uint64_t>(dim) +
                        (packed ? 7 : 0);
  const FirstMapsCase c = first_maps_case(s, dtype, seed);
  for (cuda::SummaryScan scan : kSummaryScans) {
    SCOPED_TRACE(scan_name(scan));
    const SummaryScanScope scope(scan);
    for (const bool with_E : {false, true}) {
      SCOPED_TRACE(with_E ? "E beside" : "maps alone");
      expect_first_maps_give_dh0(s, dtype, c, with_E);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DeltaRules, CudaFirstSegmentMaps,
                         ::testing::Combine(::testing::Values(Variant::deltanet,
                                                              Variant::gated_deltanet,
                                                              Variant::kda),
                                            ::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(int64_t{64}, int64_t{128}),
                                            ::testing::Values(Layout::rows, Layout::packed)),
                         summary_name);

// ---- the two-level summary: runs of several chunks each --------------------------
//
// Sixteen heads, so that the runs per row (cuda::summary_pieces: one CTA per
// run and head on the GPU) hold several chunks, the last partial; E beside
// the maps and the maps alone (different run counts). The same checks as
// CudaFirstSegmentMaps, plus the plain summary (M, E) against the CPU's.

using TwoLevelParam = std::tuple<Variant, DType, Layout>;

std::string two_level_name(const ::testing::TestParamInfo<TwoLevelParam>& info) {
  return std::string(to_string(std::get<0>(info.param))) + "_" +
         to_string(std::get<1>(info.param)) +
         (std::get<2>(info.param) == Layout::packed ? "_packed" : "_rows");
}

// The cap on a 22-chunk 16-bit summary's error against the CPU's fp32 one
// (measured on an H100, 2026-12-05: at most 6.5e-3 in M, 3.9e-3 in E, bf16,
// either scan; ~3x margin).
constexpr double kLongSummaryTol = 2e-2;

class CudaTwoLevelSummary : public ::testing::TestWithParam<TwoLevelParam> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaTwoLevelSummary, MatchesTheReference) {
  const auto [variant, dtype, layout] = GetParam();
  const SummaryScanScope scope(cuda::SummaryScan::two_level);
  ProblemSpec s;
  s.variant = variant;
  s.heads = 16;
  s.dk = s.dv = 128;
  s.with_h0 = true;
  s.l2norm_qk = true;
  s.seq_len = 64 * 21 + 23;  // 22 chunks, the last partial
  if (layout == Layout::packed)
    s.cu_seqlens = {0, s.seq_len};  // one segment: the two-level layout
  else
    s.batch = 2;
  const uint64_t seed = 4100 + 1000 * static_cast<uint64_t>(variant) +
                        100 * static_cast<uint64_t>(dtype) + (layout == Layout::packed ? 7 : 0);
  const FirstMapsCase c = first_maps_case(s, dtype, seed);
  for (const bool with_E : {false, true}) {
    SCOPED_TRACE(with_E ? "E beside" : "maps alone");
    const int64_t pieces = expect_first_maps_give_dh0(s, dtype, c, with_E);
    if (pieces == 1) GTEST_SKIP() << "no per-head scans here (needs an sm_90a build on a 9.0 GPU)";
    EXPECT_LE(pieces, 22) << "more runs than chunks";
  }
  // The plain summary (no first-segment maps) through the same runs, against
  // the CPU's, beside the block scan's error on the same problem: over 22
  // chunks a 16-bit summary drifts from the fp32 one by more than the short
  // problems' state_tol whatever the scan, so the two-level runs are held to
  // the block scan's error (what their splitting may add) under a cap.
  const SummaryErrors two_level = summary_errors_vs_cpu(s, dtype, seed);
  SummaryErrors blocks{};
  {
    const SummaryScanScope block_scope(cuda::SummaryScan::blocks);
    blocks = summary_errors_vs_cpu(s, dtype, seed);
  }
  std::cout << "  summary vs CPU: two-level M " << two_level.M << " E " << two_level.E
            << ", blocks M " << blocks.M << " E " << blocks.E << "; |M|/|I| " << blocks.M_scale
            << "\n";
  EXPECT_LE(two_level.M, 1.25 * blocks.M + 1e-4) << "M: two-level against blocks";
  EXPECT_LE(two_level.E, 1.25 * blocks.E + 1e-4) << "E: two-level against blocks";
  EXPECT_LE(blocks.M, kLongSummaryTol) << "M (blocks)";
  EXPECT_LE(blocks.E, kLongSummaryTol) << "E (blocks)";
}

INSTANTIATE_TEST_SUITE_P(
    DeltaRules, CudaTwoLevelSummary,
    ::testing::Combine(::testing::Values(Variant::deltanet, Variant::gated_deltanet, Variant::kda),
                       ::testing::Values(DType::bf16, DType::f16),
                       ::testing::Values(Layout::rows, Layout::packed)),
    two_level_name);

// A FirstSegmentMaps whose piece count is not the summary's is refused by
// name, and so are piece maps over part of a row.
TEST(CudaTwoLevelSummaryErrors, RefusesMismatchedPieces) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const SummaryScanScope scope(cuda::SummaryScan::two_level);
  ProblemSpec s;
  s.variant = Variant::deltanet;
  s.heads = 16;
  s.dk = s.dv = 128;
  s.seq_len = 640;
  ref::Problem p = random_problem(s, 5);
  const DeviceMixerInputs in(p, DType::bf16);
  const MixerParams& dev = in.dev;
  const int64_t pieces = cuda::summary_pieces(dev, false);
  if (pieces == 1) GTEST_SKIP() << "no per-head scans here (needs an sm_90a build on a 9.0 GPU)";
  const int64_t state = s.dk * s.dv;
  DeviceBuffer<float> M(s.heads * state), P(s.heads * state), piece_P(pieces * s.heads * state),
      dS0(s.heads * state);
  DeviceBuffer<unsigned char> Hmaps(p.q.size() * 2);
  cuda::PreparedForward prepared(dev, nullptr);
  cuda::FirstSegmentMaps first{P.data(), Hmaps.data()};  // one piece: not the summary's
  expect_error([&] { prepared.summary(M.data(), nullptr, nullptr, true, &first); }, "first");
  first.piece_P = piece_P.data();
  first.pieces = pieces;
  prepared.summary(M.data(), nullptr, nullptr, true, &first);
  expect_error(
      [&] {
        cuda::first_segment_state_grad(dev, first, in.q.view().data, 0, 0, s.seq_len - 64, nullptr,
                                       dS0.data(), nullptr);
      },
      "t_begin");
  check_device_sync();
}

// Additive rules keep the pre-pass: the summary refuses to make their maps.
TEST(CudaFirstSegmentMapsErrors, RefusesAdditiveRules) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  ProblemSpec s;
  s.variant = Variant::gla;
  s.seq_len = 70;
  s.dk = s.dv = 64;
  ref::Problem p = random_problem(s, 3);
  const DeviceMixerInputs in(p, DType::bf16);
  const MixerParams& dev = in.dev;
  DeviceBuffer<float> M(s.heads * s.dk * s.dk), E(s.heads * s.dk * s.dv), P(M.size());
  DeviceBuffer<unsigned char> Hmaps(p.q.size() * 2);
  cuda::PreparedForward prepared(dev, nullptr);
  const cuda::FirstSegmentMaps first{P.data(), Hmaps.data()};
  expect_error([&] { prepared.summary(M.data(), E.data(), nullptr, true, &first); }, "first");
  check_device_sync();
}

// H is written as o is, in 16-byte stores: a misaligned H is refused naming
// "first" before anything runs (a misaligned store is a sticky error).
TEST(CudaFirstSegmentMapsErrors, RefusesAMisalignedH) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  ProblemSpec s;
  s.variant = Variant::deltanet;
  s.seq_len = 70;
  s.dk = s.dv = 64;
  ref::Problem p = random_problem(s, 4);
  const DeviceMixerInputs in(p, DType::bf16);
  const MixerParams& dev = in.dev;
  // Pieces as the summary makes them: only H's alignment is wrong.
  const int64_t pieces = cuda::summary_pieces(dev, true);
  DeviceBuffer<float> M(s.heads * s.dk * s.dk), E(s.heads * s.dk * s.dv), P(M.size()),
      piece_P(pieces * M.size());
  DeviceBuffer<unsigned char> Hmaps(p.q.size() * 2 + 16);
  cuda::PreparedForward prepared(dev, nullptr);
  const cuda::FirstSegmentMaps first{P.data(), Hmaps.data() + 2, piece_P.data(), pieces};
  expect_error([&] { prepared.summary(M.data(), E.data(), nullptr, true, &first); }, "first");
  check_device_sync();
}

// ---- affine-map kernels vs host math ---------------------------------------------

class AffineMaps : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
  bool diagonal() const { return GetParam(); }
  static constexpr int64_t kMaps = 3, kDk = 16, kDv = 12;
  int64_t m_size() const { return diagonal() ? kDk : kDk * kDk; }

  // out = M in + E[:, c0:c0+w] on the host (in may be empty: zero).
  std::vector<double> host_apply(const std::vector<float>& M, const std::vector<float>& E,
                                 const std::vector<float>& in, int64_t c0, int64_t w) const {
    std::vector<double> out(static_cast<std::size_t>(kMaps * kDk * w));
    for (int64_t m = 0; m < kMaps; ++m)
      for (int64_t i = 0; i < kDk; ++i)
        for (int64_t c = 0; c < w; ++c) {
          double acc = E[(m * kDk + i) * kDv + c0 + c];
          if (!in.empty()) {
            if (diagonal()) {
              acc += double(M[m * kDk + i]) * in[(m * kDk + i) * w + c];
            } else {
              for (int64_t j = 0; j < kDk; ++j)
                acc += double(M[(m * kDk + i) * kDk + j]) * in[(m * kDk + j) * w + c];
            }
          }
          out[(m * kDk + i) * w + c] = acc;
        }
    return out;
  }
  std::vector<float> random(std::size_t n, uint64_t seed) const {
    std::mt19937_64 rng(seed);
    return as_float(randn(n, rng, 0.5));
  }
};

TEST_P(AffineMaps, ApplyMatchesHost) {
  const auto M = random(kMaps * m_size(), 1), E = random(kMaps * kDk * kDv, 2);
  const int64_t c0 = 4, w = 5;
  const auto in = random(kMaps * kDk * w, 3);
  DeviceBuffer<float> dM(M), dE(E), din(in), out(static_cast<std::size_t>(kMaps * kDk * w));
  cuda::DeviceMaps maps;
  maps.maps = kMaps;
  maps.dk = kDk;
  maps.dv = kDv;
  maps.diagonal = diagonal();
  maps.M = dM.data();
  maps.E = dE.data();
  out.fill_bytes(0xFF);
  cuda::apply_affine_maps(maps, din.data(), out.data(), c0, w, nullptr);
  check_device_sync();
  EXPECT_LE(rel_rms(out.to_host(), host_apply(M, E, in, c0, w)), 1e-6);
  out.fill_bytes(0xFF);
  cuda::apply_affine_maps(maps, nullptr, out.data(), c0, w, nullptr);  // zero incoming state
  check_device_sync();
  EXPECT_LE(rel_rms(out.to_host(), host_apply(M, E, {}, c0, w)), 1e-6);
}

TEST_P(AffineMaps, ComposeMatchesHost) {
  const auto Ml = random(kMaps * m_size(), 4), El = random(kMaps * kDk * kDv, 5);
  const auto Me = random(kMaps * m_size(), 6), Ee = random(kMaps * kDk * kDv, 7);
  // Host: (Ml Me, Ml Ee + El).
  std::vector<double> want_M(Ml.size()), want_E = host_apply(Ml, El, Ee, 0, kDv);
  for (int64_t m = 0; m < kMaps; ++m)
    for (int64_t i = 0; i < kDk; ++i) {
      if (diagonal()) {
        want_M[m * kDk + i] = double(Ml[m * kDk + i]) * Me[m * kDk + i];
        continue;
      }
      for (int64_t c = 0; c < kDk; ++c) {
        double acc = 0;
        for (int64_t j = 0; j < kDk; ++j)
          acc += double(Ml[(m * kDk + i) * kDk + j]) * Me[(m * kDk + j) * kDk + c];
        want_M[(m * kDk + i) * kDk + c] = acc;
      }
    }
  DeviceBuffer<float> dMl(Ml), dEl(El), dMe(Me), dEe(Ee);
  DeviceBuffer<float> scratch(static_cast<std::size_t>(kMaps * (m_size() + kDk * kDv)));
  cuda::compose_affine_maps(kMaps, kDk, kDv, diagonal(), dMl.data(), dEl.data(), dMe.data(),
                            dEe.data(), scratch.data(), nullptr);
  check_device_sync();
  EXPECT_LE(rel_rms(dMl.to_host(), want_M), 1e-6) << "M";
  EXPECT_LE(rel_rms(dEl.to_host(), want_E), 1e-6) << "E";
}

INSTANTIATE_TEST_SUITE_P(FullAndDiagonal, AffineMaps, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return std::string(i.param ? "diagonal" : "full");
                         });

// multiply_maps: out = op(A) B + bias over tiles of 32 x 32, so shapes
// smaller than a tile, not multiples of it and the summary's 128 x 128;
// B and out with row strides wider than their width; bias none, separate
// or out itself (the pre-pass's in-place Horner step); and more maps than
// one launch's grid.z holds (65535: a delta rule's exchange with B * H above
// that), which run in slices.
enum class Bias { none, separate, in_place };
struct MapsProductParam {
  int64_t dk, width;
  bool transpose;
  Bias bias;
  int64_t maps = 3;
};

class MultiplyMaps : public ::testing::TestWithParam<MapsProductParam> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(MultiplyMaps, MatchesHost) {
  const auto [dk, width, transpose, bias, maps] = GetParam();
  const int64_t ld = width + 3;  // rows padded: strides apart from the width
  std::mt19937_64 rng(static_cast<uint64_t>(dk * 1000 + width));
  const auto A = as_float(randn(static_cast<std::size_t>(maps * dk * dk), rng));
  const auto B = as_float(randn(static_cast<std::size_t>(maps * dk * ld), rng));
  const auto C = as_float(randn(static_cast<std::size_t>(maps * dk * ld), rng));
  std::vector<double> want(static_cast<std::size_t>(maps * dk * ld));
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = bias == Bias::in_place ? C[i] : -1.0;
  for (int64_t m = 0; m < maps; ++m)
    for (int64_t i = 0; i < dk; ++i)
      for (int64_t c = 0; c < width; ++c) {
        double acc = bias == Bias::none ? 0.0 : C[(m * dk + i) * ld + c];
        for (int64_t j = 0; j < dk; ++j) {
          const double a = transpose ? A[(m * dk + j) * dk + i] : A[(m * dk + i) * dk + j];
          acc += a * B[(m * dk + j) * ld + c];
        }
        want[(m * dk + i) * ld + c] = acc;
      }
  // out starts as C (in place) or -1: the padding must stay as it was.
  DeviceBuffer<float> dA(A), dB(B), dC(C),
      out(bias == Bias::in_place ? C : std::vector<float>(want.size(), -1.f));
  cuda::MapsProduct mp;
  mp.maps = maps;
  mp.dk = dk;
  mp.width = width;
  mp.A = dA.data();
  mp.transpose_a = transpose;
  mp.B = dB.data();
  mp.bias = bias == Bias::none ? nullptr : bias == Bias::separate ? dC.data() : out.data();
  mp.out = out.data();
  mp.ld_b = mp.ld_bias = mp.ld_out = ld;
  mp.stride_b = mp.stride_bias = mp.stride_out = dk * ld;
  cuda::multiply_maps(mp, nullptr);
  check_device_sync();
  EXPECT_LE(rel_rms(out.to_host(), want), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MultiplyMaps,
                         ::testing::Values(MapsProductParam{16, 12, false, Bias::none},
                                           MapsProductParam{16, 12, true, Bias::separate},
                                           MapsProductParam{40, 72, false, Bias::separate},
                                           MapsProductParam{40, 72, true, Bias::in_place},
                                           MapsProductParam{128, 128, false, Bias::in_place},
                                           MapsProductParam{128, 128, true, Bias::none},
                                           MapsProductParam{130, 33, true, Bias::separate},
                                           MapsProductParam{4, 5, true, Bias::separate, 65537},
                                           MapsProductParam{4, 5, false, Bias::in_place, 131075}),
                         [](const ::testing::TestParamInfo<MapsProductParam>& i) {
                           const char* bias = i.param.bias == Bias::none       ? "none"
                                              : i.param.bias == Bias::separate ? "bias"
                                                                               : "inplace";
                           return "dk" + std::to_string(i.param.dk) + "_w" +
                                  std::to_string(i.param.width) +
                                  (i.param.transpose ? "_AT_" : "_A_") + bias +
                                  (i.param.maps != 3 ? "_maps" + std::to_string(i.param.maps) : "");
                         });

TEST(AffineMapKernels, MultiplyMapsRefusesOutAliasingB) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  DeviceBuffer<float> A(16 * 16), B(16 * 16);
  cuda::MapsProduct mp;
  mp.maps = 1;
  mp.dk = mp.width = mp.ld_b = mp.ld_out = 16;
  mp.stride_b = mp.stride_out = 256;
  mp.A = A.data();
  mp.B = B.data();
  mp.out = B.data();
  expect_error([&] { cuda::multiply_maps(mp, nullptr); }, "out");
}

// chain_maps: X <- op(A_s) X + bias_s through every step in one launch,
// against the same chain in fp64 on the host. Shapes: the summary's fold
// (128 x 128, two chains of different widths, the second without biases),
// the pre-pass's Horner steps (A^T, out aliasing the last step's bias),
// widths that are not multiples of the kernel's 32 columns, Dk under its
// 32-row slices, and zero steps (a copy). A is scaled by 1 / sqrt(Dk) so
// that X keeps its size along the chain, as the scans' maps do; each step
// adds one fp32 product's rounding, so the bound is that of multiply_maps
// (1e-6) times the steps. More maps than grid.y holds run in slices.
struct MapsChainParam {
  int64_t dk, width;
  int steps;
  bool transpose;
  Bias bias;             // none, separate, or in_place: out aliases the last step's bias
  int64_t second_width;  // > 0: a second chain (no biases) of this width in the same launch
  int64_t maps = 3;
};

class ChainMaps : public ::testing::TestWithParam<MapsChainParam> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(ChainMaps, MatchesHost) {
  const auto [dk, width, steps, transpose, bias, second_width, maps] = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(dk * 7919 + width * 31 + steps));
  const float scale = static_cast<float>(1.0 / std::sqrt(double(dk)));
  auto random_floats = [&](int64_t n, float s) {
    auto v = as_float(randn(static_cast<std::size_t>(n), rng));
    for (float& x : v) x *= s;
    return v;
  };
  // One chain's inputs on the host and the device, and its fp64 result.
  struct Chain {
    int64_t width;
    std::vector<float> x0;
    std::vector<std::vector<float>> A, bias;
    std::vector<double> want;
    std::vector<DeviceBuffer<float>> dA, dbias;
    DeviceBuffer<float> dx0, out;
  };
  auto make = [&](int64_t w, bool with_bias) {
    Chain c;
    c.width = w;
    c.x0 = random_floats(maps * dk * w, 1.f);
    std::vector<double> X(c.x0.begin(), c.x0.end());
    for (int s = 0; s < steps; ++s) {
      c.A.push_back(random_floats(maps * dk * dk, scale));
      c.bias.push_back(with_bias ? random_floats(maps * dk * w, 1.f) : std::vector<float>{});
      std::vector<double> Y(X.size());
      for (int64_t m = 0; m < maps; ++m)
        for (int64_t i = 0; i < dk; ++i)
          for (int64_t col = 0; col < w; ++col) {
            double acc = with_bias ? double(c.bias.back()[(m * dk + i) * w + col]) : 0.0;
            for (int64_t j = 0; j < dk; ++j) {
              const float a =
                  transpose ? c.A.back()[(m * dk + j) * dk + i] : c.A.back()[(m * dk + i) * dk + j];
              acc += double(a) * X[(m * dk + j) * w + col];
            }
            Y[(m * dk + i) * w + col] = acc;
          }
      X = std::move(Y);
    }
    c.want = std::move(X);
    for (int s = 0; s < steps; ++s) {
      c.dA.emplace_back(c.A[static_cast<std::size_t>(s)]);
      if (with_bias) c.dbias.emplace_back(c.bias[static_cast<std::size_t>(s)]);
    }
    c.dx0 = DeviceBuffer<float>(c.x0);
    c.out = DeviceBuffer<float>(std::vector<float>(c.x0.size(), -1.f));
    return c;
  };
  std::vector<Chain> chains;
  chains.push_back(make(width, bias != Bias::none));
  if (second_width > 0) chains.push_back(make(second_width, false));
  cuda::MapsChain mc[2];
  for (std::size_t i = 0; i < chains.size(); ++i) {
    Chain& c = chains[i];
    mc[i].maps = maps;
    mc[i].dk = dk;
    mc[i].width = c.width;
    mc[i].transpose_a = transpose;
    mc[i].steps = steps;
    mc[i].x0 = c.dx0.data();
    for (int s = 0; s < steps; ++s) {
      mc[i].A[s] = c.dA[static_cast<std::size_t>(s)].data();
      mc[i].bias[s] = c.dbias.empty() ? nullptr : c.dbias[static_cast<std::size_t>(s)].data();
    }
    mc[i].out = c.out.data();
  }
  // In place: out is the last step's bias (the pre-pass writes dS0 over X_0).
  if (bias == Bias::in_place && steps > 0) mc[0].out = chains[0].dbias.back().data();
  cuda::chain_maps(mc, static_cast<int>(chains.size()), nullptr);
  check_device_sync();
  const double bound = 1e-6 * std::max(steps, 1);
  EXPECT_LE(rel_rms(bias == Bias::in_place && steps > 0 ? chains[0].dbias.back().to_host()
                                                        : chains[0].out.to_host(),
                    chains[0].want),
            bound);
  if (chains.size() > 1) {
    EXPECT_LE(rel_rms(chains[1].out.to_host(), chains[1].want), bound) << "second chain";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ChainMaps,
    ::testing::Values(MapsChainParam{128, 128, 3, false, Bias::separate, 128},
                      MapsChainParam{128, 128, 4, true, Bias::in_place, 0},
                      MapsChainParam{128, 72, 2, false, Bias::none, 33},
                      MapsChainParam{64, 40, 1, false, Bias::none, 0},
                      MapsChainParam{64, 33, 5, true, Bias::separate, 0},
                      MapsChainParam{16, 12, 3, true, Bias::in_place, 0},
                      MapsChainParam{16, 12, 0, false, Bias::none, 0},
                      MapsChainParam{4, 5, 2, true, Bias::in_place, 3, 65537}),
    [](const ::testing::TestParamInfo<MapsChainParam>& i) {
      const char* bias = i.param.bias == Bias::none       ? "none"
                         : i.param.bias == Bias::separate ? "bias"
                                                          : "inplace";
      return "dk" + std::to_string(i.param.dk) + "_w" + std::to_string(i.param.width) + "_s" +
             std::to_string(i.param.steps) + (i.param.transpose ? "_AT_" : "_A_") + bias +
             (i.param.second_width > 0 ? "_two" + std::to_string(i.param.second_width) : "") +
             (i.param.maps != 3 ? "_maps" + std::to_string(i.param.maps) : "");
    });

TEST(AffineMapKernels, ChainMapsRefusesBadArguments) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  DeviceBuffer<float> A(136 * 136), X(136 * 136), out(136 * 136);
  cuda::MapsChain c;
  c.maps = 1;
  c.dk = c.width = 128;
  c.steps = 1;
  c.A[0] = A.data();
  c.x0 = X.data();
  c.out = out.data();
  cuda::MapsChain bad = c;
  bad.dk = 136;
  expect_error([&] { cuda::chain_maps(&bad, 1, nullptr); }, "dk");
  bad = c;
  bad.steps = cuda::kMaxChainSteps + 1;
  expect_error([&] { cuda::chain_maps(&bad, 1, nullptr); }, "steps");
  bad = c;
  bad.A[0] = nullptr;
  expect_error([&] { cuda::chain_maps(&bad, 1, nullptr); }, "A");
  bad = c;
  bad.x0 = nullptr;
  expect_error([&] { cuda::chain_maps(&bad, 1, nullptr); }, "x0");
  expect_error([&] { cuda::chain_maps(&c, 3, nullptr); }, "count");
}

TEST(AffineMapKernels, TransposeMatchesHost) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t maps = 2, dk = 24;
  std::mt19937_64 rng(11);
  const auto M = as_float(randn(static_cast<std::size_t>(maps * dk * dk), rng));
  std::vector<double> want(M.size());
  for (int64_t m = 0; m < maps; ++m)
    for (int64_t i = 0; i < dk; ++i)
      for (int64_t j = 0; j < dk; ++j) want[(m * dk + j) * dk + i] = M[(m * dk + i) * dk + j];
  DeviceBuffer<float> dM(M), dMt(M.size());
  dMt.fill_bytes(0xFF);
  cuda::transpose_maps(dM.data(), dMt.data(), maps, dk, nullptr);
  check_device_sync();
  EXPECT_EQ(rel_rms(dMt.to_host(), want), 0.0);
}

// The count runs on 16-byte vectors between an unaligned head and tail:
// non-finite values in all three parts, starts off the 16-byte boundary,
// lengths that leave a tail, and the largest finite values (not counted).
TEST(AffineMapKernels, CountsNonFiniteElements) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    const float largest = t == DType::f16 ? 65504.f : t == DType::bf16 ? 3.3895314e38f : 3.4e38f;
    std::vector<float> x(100013, 0.5f);
    for (std::size_t i = 0; i < x.size(); i += 1000) x[i] = i % 2000 ? largest : -largest;
    for (int64_t offset : {0, 1, 3, 8}) {
      for (int64_t n : {int64_t{5}, int64_t{100000} - offset, int64_t{100013} - offset}) {
        std::vector<float> y(x.begin() + offset, x.begin() + offset + n);
        std::vector<int64_t> where{0, n - 1, n / 2, n / 2 + 1};
        for (int64_t w : where) y[static_cast<std::size_t>(w)] = w % 2 ? inf : nan;
        y[static_cast<std::size_t>(n / 3)] = -inf;
        int64_t want = 0;
        for (float v : y) want += std::isfinite(v) ? 0 : 1;
        // The same bytes at `offset` elements into an allocation.
        std::vector<float> padded(x.begin(), x.begin() + offset);
        padded.insert(padded.end(), y.begin(), y.end());
        const DeviceTensor p(padded, t, {static_cast<int64_t>(padded.size())});
        const auto* start =
            static_cast<const char*>(p.view().data) + offset * static_cast<int64_t>(size_of(t));
        DeviceBuffer<int64_t> count(std::vector<int64_t>{0});
        cuda::count_nonfinite(start, n, t, count.data(), nullptr);
        check_device_sync();
        EXPECT_EQ(count.to_host()[0], want) << to_string(t) << " offset " << offset << " n " << n;
      }
    }
  }
}

// The log-gate count: NaN, +-Inf and every float > 0 (the smallest
// subnormal, 1e-30, large values) are counted, 0, -0 and negative values not,
// at every alignment of the start (the head and tail elements take the
// scalar path, the middle the vector one).
TEST(AffineMapKernels, CountsBadLogGates) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float tiny = std::numeric_limits<float>::denorm_min();
  const std::vector<float> good = {0.f, -0.f, -tiny, -1e-30f, -3.f, -3.4e38f};
  const std::vector<float> bad = {nan, inf, -inf, tiny, 1e-30f, 0.5f, 3.4e38f, -nan};
  std::vector<float> x(50021);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = good[i % good.size()];
  for (int64_t offset : {0, 1, 2, 3}) {
    for (int64_t n : {int64_t{3}, int64_t{50000} - offset, int64_t{50021} - offset}) {
      std::vector<float> y(x.begin() + offset, x.begin() + offset + n);
      int64_t want = 0;
      for (int64_t i = 0; i < n; i += 97) {
        y[static_cast<std::size_t>(i)] = bad[static_cast<std::size_t>(i / 97) % bad.size()];
        ++want;
      }
      if (n > 1) {
        y[static_cast<std::size_t>(n - 1)] = 2.f;  // the tail
        want += (n - 1) % 97 == 0 ? 0 : 1;
      }
      std::vector<float> padded(x.begin(), x.begin() + offset);
      padded.insert(padded.end(), y.begin(), y.end());
      const DeviceTensor p(padded, DType::f32, {static_cast<int64_t>(padded.size())});
      DeviceBuffer<int64_t> count(std::vector<int64_t>{0});
      cuda::count_bad_log_gates(static_cast<const float*>(p.view().data) + offset, n, count.data(),
                                nullptr);
      check_device_sync();
      EXPECT_EQ(count.to_host()[0], want) << "offset " << offset << " n " << n;
    }
  }
}

// The prepare stage checks the inputs itself exactly where it reads them all:
// 16-bit inputs through chunk_prepare16_kernel. fp32 inputs and linear
// attention's raw path (no prepare stage) keep the separate count, and
// PreparedForward refuses the flag word there (no device needed for either).
TEST(CudaPrepareChecks, CoverTheSixteenBitPrepareOnly) {
  MixerParams p;
  for (Variant v : kAllVariants) {
    p.variant = v;
    p.l2norm_qk = false;
    p.dtype = DType::bf16;
    EXPECT_EQ(cuda::prepare_checks_finite(p), v != Variant::linear) << to_string(v);
    p.dtype = DType::f16;
    EXPECT_EQ(cuda::prepare_checks_finite(p), v != Variant::linear) << to_string(v);
    p.l2norm_qk = true;  // the norm rewrites q, k: linear attention prepares too
    EXPECT_TRUE(cuda::prepare_checks_finite(p)) << to_string(v);
    p.dtype = DType::f32;
    EXPECT_FALSE(cuda::prepare_checks_finite(p)) << to_string(v);
  }
  unsigned word = 0;  // never written: refused before anything is queued
  expect_error([&] { cuda::PreparedForward(p, nullptr, &word); }, "nonfinite");
}

TEST(AffineMapKernels, FillsIdentity) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  DeviceBuffer<float> out(2 * 8 * 8);
  out.fill_bytes(0xFF);
  cuda::fill_identity(out.data(), 2, 8, 8, nullptr);
  check_device_sync();
  const auto h = out.to_host();
  for (int64_t m = 0; m < 2; ++m)
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t j = 0; j < 8; ++j) ASSERT_EQ(h[(m * 8 + i) * 8 + j], i == j ? 1.f : 0.f);
}

// hold_stream keeps its stream busy for the time asked, and an event recorded
// after it and one after the next launch time that launch alone: what the
// NCCL link probe relies on to time a shift without the host's queueing.
TEST(AffineMapKernels, HoldStreamDelaysWhatIsQueuedBehindIt) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  DeviceBuffer<float> out(2 * 8 * 8);
  cudaEvent_t ev[3] = {};
  for (cudaEvent_t& e : ev) ASSERT_EQ(cudaEventCreate(&e), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ev[0], nullptr), cudaSuccess);
  cuda::hold_stream(nullptr, 5e-3);
  ASSERT_EQ(cudaEventRecord(ev[1], nullptr), cudaSuccess);
  cuda::fill_identity(out.data(), 2, 8, 8, nullptr);
  ASSERT_EQ(cudaEventRecord(ev[2], nullptr), cudaSuccess);
  check_device_sync();
  float held = 0.f, after = 0.f;
  ASSERT_EQ(cudaEventElapsedTime(&held, ev[0], ev[1]), cudaSuccess);
  ASSERT_EQ(cudaEventElapsedTime(&after, ev[1], ev[2]), cudaSuccess);
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  EXPECT_GE(held, 4.9f);             // ms; the global timer ticks in microseconds
  EXPECT_LT(held, 500.f);            // it ends
  EXPECT_LT(after, 1.f);             // the launch queued behind it, timed alone
  EXPECT_EQ(out.to_host()[9], 1.f);  // and it ran: (0, 1, 1) of the identity
  expect_error([] { cuda::hold_stream(nullptr, 0.0); }, "seconds");
  expect_error([] { cuda::hold_stream(nullptr, 2.0); }, "seconds");
  expect_error([] { cuda::hold_stream(nullptr, std::nan("")); }, "seconds");
}

// ---- CpMixer on the GPU, one rank, vs the fp64 reference ----------------------------

using MixerParam = std::tuple<Variant, DType, Layout>;

std::string mixer_name(const ::testing::TestParamInfo<MixerParam>& info) {
  return std::string(to_string(std::get<0>(info.param))) + "_" +
         to_string(std::get<1>(info.param)) +
         (std::get<2>(info.param) == Layout::packed ? "_packed" : "_rows");
}

// The one-rank GPU suites' problem: two heads of 64, an initial state, the L2
// norm for KDA; two rows of 150 tokens, or three sequences packed in 200.
ProblemSpec one_rank_spec(Variant variant, Layout layout) {
  ProblemSpec s;
  s.variant = variant;
  s.heads = 2;
  s.dk = s.dv = 64;
  s.with_h0 = true;
  s.l2norm_qk = variant == Variant::kda;
  if (layout == Layout::packed) {
    s.seq_len = 200;
    s.cu_seqlens = {0, 30, 131, 200};
  } else {
    s.batch = 2;
    s.seq_len = 150;
  }
  return s;
}

class CpGpuSingleRank : public ::testing::TestWithParam<MixerParam> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
    const auto [variant, dtype, layout] = GetParam();
    const ProblemSpec s = one_rank_spec(variant, layout);
    const uint64_t seed = 300 + 31 * static_cast<uint64_t>(variant) +
                          7 * static_cast<uint64_t>(dtype) + (layout == Layout::packed ? 1 : 0);
    p_ = random_problem(s, seed);
    round_problem(p_, dtype);
    std::mt19937_64 rng(seed + 1);
    d_o_ = round_to_dtype(randn(p_.v.size(), rng), dtype);
    dht_ =
        round_f32(randn(static_cast<std::size_t>(p_.num_sequences() * s.heads * s.dk * s.dv), rng));
    cfg_.variant = variant;
    cfg_.chunk = 64;
    cfg_.l2norm_qk = s.l2norm_qk;
  }

 public:
  DType dtype() const { return std::get<1>(GetParam()); }

  ref::Problem p_;
  std::vector<double> d_o_, dht_;
  MixerConfig cfg_;
};

TEST_P(CpGpuSingleRank, ForwardMatchesReference) {
  SingleRankCommunicator comm;
  CpMixer mixer(comm, cfg_, Exchange::automatic);
  const CpOutputs out = run_cp_device(mixer, p_, dtype(), 0, p_.seq_len, d_o_, dht_, false);
  const ref::Outputs want = ref::forward(p_);
  EXPECT_LE(rel_rms(out.o, want.o), output_tol(dtype())) << "o";
  EXPECT_LE(rel_rms(out.ht, want.ht), output_tol(dtype())) << "final state";
  EXPECT_TRUE(mixer.last_forward_stats().on_device);
}

TEST_P(CpGpuSingleRank, BackwardMatchesReference) {
  SingleRankCommunicator comm;
  CpMixer mixer(comm, cfg_, Exchange::automatic);
  const CpOutputs out = run_cp_device(mixer, p_, dtype(), 0, p_.seq_len, d_o_, dht_, true);
  const ref::Grads want = ref::backward(p_, d_o_, dht_);
  EXPECT_LE(rel_rms(out.dq, want.dq), grad_tol(dtype())) << "dq";
  EXPECT_LE(rel_rms(out.dk, want.dk), grad_tol(dtype())) << "dk";
  EXPECT_LE(rel_rms(out.dv, want.dv), grad_tol(dtype())) << "dv";
  if (!p_.g.empty()) {
    EXPECT_LE(rel_rms(out.dg, want.dg), gate_grad_tol(dtype())) << "dg";
  }
  if (!p_.beta.empty()) {
    EXPECT_LE(rel_rms(out.dbeta, want.dbeta), gate_grad_tol(dtype())) << "dbeta";
  }
  EXPECT_LE(rel_rms(out.dh0, want.dh0), output_tol(dtype())) << "dh0";
}

// Every output and gradient of `got` bitwise equal to `want`'s.
void expect_bitwise_equal(const CpOutputs& got, const CpOutputs& want) {
  EXPECT_TRUE(bitwise_equal(got.o, want.o)) << "o";
  EXPECT_TRUE(bitwise_equal(got.ht, want.ht)) << "final state";
  EXPECT_TRUE(bitwise_equal(got.dq, want.dq)) << "dq";
  EXPECT_TRUE(bitwise_equal(got.dk, want.dk)) << "dk";
  EXPECT_TRUE(bitwise_equal(got.dv, want.dv)) << "dv";
  EXPECT_TRUE(bitwise_equal(got.dg, want.dg)) << "dg";
  EXPECT_TRUE(bitwise_equal(got.dbeta, want.dbeta)) << "dbeta";
  EXPECT_TRUE(bitwise_equal(got.dh0, want.dh0)) << "dh0";
}

// `steps` forward + backward steps of one mixer configured by `cfg`.
std::vector<CpOutputs> run_steps(const CpGpuSingleRank& t, const MixerConfig& cfg, int steps) {
  SingleRankCommunicator comm;
  CpMixer mixer(comm, cfg, Exchange::automatic);
  std::vector<CpOutputs> out;
  for (int s = 0; s < steps; ++s)
    out.push_back(run_cp_device(mixer, t.p_, t.dtype(), 0, t.p_.seq_len, t.d_o_, t.dht_, true));
  return out;
}

// recompute_chunk_states on the GPU path: backward re-runs the local scan from
// the kept incoming states, so outputs and gradients are bitwise those of a
// mixer that kept the chunk states.
TEST_P(CpGpuSingleRank, RecomputedChunkStatesGiveTheSavedStatesResults) {
  const CpOutputs want = run_steps(*this, cfg_, 1)[0];
  MixerConfig cfg = cfg_;
  cfg.recompute_chunk_states = true;
  expect_bitwise_equal(run_steps(*this, cfg, 1)[0], want);
}

// save_t (the default): the delta rules' forward saves T and the backward's
// prepare re-run reads it instead of solving again, bitwise the same results
// as a mixer that saves none (the other variants have no T: unchanged).
TEST_P(CpGpuSingleRank, SavedTGivesTheSolvedResults) {
  ASSERT_TRUE(cfg_.save_t) << "save_t is the default";
  MixerConfig cfg = cfg_;
  cfg.save_t = false;
  const CpOutputs want = run_steps(*this, cfg, 1)[0];
  expect_bitwise_equal(run_steps(*this, cfg_, 1)[0], want);
}

// keep_prepared: the backward reads the forward's prepared tiles instead of
// re-running the prepare stage, which would compute the same tiles from the
// same inputs: bitwise the same gradients. Two steps: the first backward's
// hand-over must leave the mixer ready for the next forward.
TEST_P(CpGpuSingleRank, KeptPreparedTilesGiveTheRecomputedResults) {
  const CpOutputs want = run_steps(*this, cfg_, 1)[0];
  MixerConfig cfg = cfg_;
  cfg.keep_prepared = true;
  const std::vector<CpOutputs> got = run_steps(*this, cfg, 2);
  for (std::size_t step = 0; step < got.size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    expect_bitwise_equal(got[step], want);
  }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CpGpuSingleRank,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants),
                                            ::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(Layout::rows, Layout::packed)),
                         mixer_name);

// ---- argument checks of the GPU path ----------------------------------------------

class CpGpuErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
    ProblemSpec s;
    s.variant = Variant::gated_deltanet;
    s.seq_len = 40;
    s.heads = 2;
    s.dk = s.dv = 64;
    p_ = random_problem(s, 5);
    round_problem(p_, DType::bf16);
  }
  // Forward on device tensors, with `tweak` applied to the arguments, must
  // throw naming `argument` and leave o untouched (still NaN-poisoned).
  template <typename F>
  void expect_refused(const std::string& argument, F&& tweak) {
    const int64_t T = p_.seq_len, H = p_.heads, D = p_.dk;
    const Shape qk{1, T, H, D}, bth{1, T, H};
    auto g = as_float(p_.g);
    DeviceTensor q(as_float(p_.q), DType::bf16, qk), k(as_float(p_.k), DType::bf16, qk),
        v(as_float(p_.v), DType::bf16, qk), beta(as_float(p_.beta), DType::bf16, bth);
    DeviceTensor gd(g, DType::f32, bth);
    DeviceTensor o = DeviceTensor::poisoned(static_cast<std::size_t>(T * H * D), DType::bf16, qk);
    CpForwardArgs a;
    a.q = q.view();
    a.k = k.view();
    a.v = v.view();
    a.g = gd.view();
    a.beta = beta.view();
    a.o = o.view();
    std::vector<float> host_g = g;
    tweak(a, host_g);
    SingleRankCommunicator comm;
    MixerConfig cfg;
    cfg.variant = p_.variant;
    CpMixer mixer(comm, cfg, Exchange::ring);
    try {
      mixer.forward(a);
      ADD_FAILURE() << "no error for " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    for (float x : o.to_host()) ASSERT_TRUE(std::isnan(x)) << "o written despite the error";
  }
  ref::Problem p_;
};

TEST_F(CpGpuErrors, RefusesNanInGate) {
  std::unique_ptr<DeviceTensor> bad;
  expect_refused("g", [&](CpForwardArgs& a, std::vector<float>& g) {
    g[3] = std::numeric_limits<float>::quiet_NaN();
    bad = std::make_unique<DeviceTensor>(g, DType::f32, a.g.shape);
    a.g = bad->view();
  });
}

// A non-finite do is refused naming do before the backward writes anything
// (dq untouched), as the forward refuses its inputs.
TEST_F(CpGpuErrors, BackwardRefusesNanInOutputGradient) {
  const int64_t T = p_.seq_len, H = p_.heads, D = p_.dk;
  const Shape qk{1, T, H, D}, bth{1, T, H};
  DeviceTensor q(as_float(p_.q), DType::bf16, qk), k(as_float(p_.k), DType::bf16, qk),
      v(as_float(p_.v), DType::bf16, qk), beta(as_float(p_.beta), DType::bf16, bth),
      g(as_float(p_.g), DType::f32, bth);
  DeviceTensor o = DeviceTensor::poisoned(static_cast<std::size_t>(T * H * D), DType::bf16, qk);
  CpForwardArgs a;
  a.q = q.view();
  a.k = k.view();
  a.v = v.view();
  a.g = g.view();
  a.beta = beta.view();
  a.o = o.view();
  SingleRankCommunicator comm;
  MixerConfig cfg;
  cfg.variant = p_.variant;
  CpMixer mixer(comm, cfg, Exchange::ring);
  mixer.forward(a);
  std::vector<float> d_o(static_cast<std::size_t>(T * H * D), 0.25f);
  d_o[7] = std::numeric_limits<float>::infinity();
  DeviceTensor dout(d_o, DType::bf16, qk);
  const std::size_t n = static_cast<std::size_t>(T * H * D);
  DeviceTensor dq = DeviceTensor::poisoned(n, DType::bf16, qk),
               dk = DeviceTensor::poisoned(n, DType::bf16, qk),
               dv = DeviceTensor::poisoned(n, DType::bf16, qk),
               dg = DeviceTensor::poisoned(static_cast<std::size_t>(T * H), DType::f32, bth),
               dbeta = DeviceTensor::poisoned(static_cast<std::size_t>(T * H), DType::bf16, bth);
  CpBackwardArgs b;
  b.d_o = dout.view();
  b.dq = dq.view();
  b.dk = dk.view();
  b.dv = dv.view();
  b.dg = dg.view();
  b.dbeta = dbeta.view();
  try {
    mixer.backward(b);
    ADD_FAILURE() << "no error for do";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "do") << e.what();
  }
  for (float x : dq.to_host()) ASSERT_TRUE(std::isnan(x)) << "dq written despite the error";
}

TEST_F(CpGpuErrors, RefusesHostTensorAmongDeviceTensors) {
  std::vector<float> host_v;
  expect_refused("v", [&](CpForwardArgs& a, std::vector<float>&) {
    host_v.assign(static_cast<std::size_t>(a.v.numel()), 0.f);
    a.v = TensorView(host_v.data(), DType::bf16, a.v.shape, Memory::host);
  });
}

TEST_F(CpGpuErrors, RefusesMixedDtypes) {
  std::unique_ptr<DeviceTensor> f32_k;
  expect_refused("k", [&](CpForwardArgs& a, std::vector<float>&) {
    f32_k = std::make_unique<DeviceTensor>(as_float(p_.k), DType::f32, a.k.shape);
    a.k = f32_k->view();
  });
}

TEST_F(CpGpuErrors, RefusesUnsupportedHeadDim) {
  // Dk = 32 is valid on the CPU path but not on the GPU kernels.
  ProblemSpec s;
  s.variant = Variant::gated_deltanet;
  s.seq_len = 40;
  s.heads = 2;
  s.dk = s.dv = 32;
  p_ = random_problem(s, 6);
  round_problem(p_, DType::bf16);
  expect_refused("dk", [](CpForwardArgs&, std::vector<float>&) {});
}

// ---- the forward's NaN/Inf check, input by input ---------------------------------

// Forward of `p` (every tensor on the device, q, k, v, beta in `dtype`) through
// a fresh one-rank CpMixer with `cfg`: the argument its error names ("" when
// it succeeds), and o, poisoned with NaN before the call, in *o.
std::string forward_error(const ref::Problem& p, DType dtype, const MixerConfig& cfg,
                          std::vector<float>* o) {
  SingleRankCommunicator comm;
  CpMixer mixer(comm, cfg, Exchange::ring);
  try {
    *o = run_cp_device(mixer, p, dtype, 0, p.seq_len, {}, {}, /*backward=*/false, o).o;
  } catch (const Error& e) {
    return e.argument();
  }
  return "";
}

class CpGpuNonFinite : public ::testing::TestWithParam<MixerParam> {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

// A NaN or an Inf anywhere in any forward input is refused naming that input,
// with o left unwritten: for 16-bit inputs the prepare stage finds it as it
// reads (cuda::prepare_checks_finite; bf16 and f16 have different exponent
// fields), for fp32 inputs and linear attention's raw path a separate count
// does. Positions: the first element, one in the middle, the last (the last,
// partial chunk of the last head's last dimension). The same inputs without
// the bad value pass, every output written. g is also refused where a log
// gate is > 0 (the prepare stage and the count test it too).
TEST_P(CpGpuNonFinite, ForwardRefusesNanOrInfInAnyInputNamingIt) {
  const auto [variant, dtype, layout] = GetParam();
  const ProblemSpec s = one_rank_spec(variant, layout);
  ref::Problem base = random_problem(s, 900 + 13 * static_cast<uint64_t>(variant));
  round_problem(base, dtype);
  MixerConfig cfg;
  cfg.variant = variant;
  cfg.chunk = 64;
  cfg.l2norm_qk = s.l2norm_qk;
  std::vector<float> o;
  ASSERT_EQ(forward_error(base, dtype, cfg, &o), "");
  for (float x : o) ASSERT_TRUE(std::isfinite(x)) << "o not written";

  using Field = std::vector<double> ref::Problem::*;
  const std::vector<std::pair<std::string, Field>> inputs = {
      {"q", &ref::Problem::q}, {"k", &ref::Problem::k},       {"v", &ref::Problem::v},
      {"g", &ref::Problem::g}, {"beta", &ref::Problem::beta}, {"initial_state", &ref::Problem::h0}};
  int checked = 0;
  for (const auto& [name, field] : inputs) {
    const std::size_t n = (base.*field).size();
    if (n == 0) continue;  // the variant has no such input
    for (const std::size_t at : {std::size_t{0}, n / 2 + 1, n - 1}) {
      SCOPED_TRACE(name + "[" + std::to_string(at) + "]");
      ref::Problem p = base;
      (p.*field)[at] = at % 2 == 1 ? std::numeric_limits<double>::infinity()
                                   : std::numeric_limits<double>::quiet_NaN();
      EXPECT_EQ(forward_error(p, dtype, cfg, &o), name);
      for (float x : o) ASSERT_TRUE(std::isnan(x)) << "o written despite the error";
      ++checked;
    }
  }
  EXPECT_GE(checked, 4 * 3);  // q, k, v, initial_state at least
  // A finite log gate above 0 (alpha > 1: the state grows to inf within a
  // few dozen tokens) and -Inf are not log gates either (DESIGN §2); 0 is.
  if (!base.g.empty()) {
    const std::size_t at = base.g.size() / 3;
    for (const double bad : {0.25, -std::numeric_limits<double>::infinity()}) {
      SCOPED_TRACE("g[" + std::to_string(at) + "] = " + std::to_string(bad));
      ref::Problem p = base;
      p.g[at] = bad;
      EXPECT_EQ(forward_error(p, dtype, cfg, &o), "g");
      for (float x : o) ASSERT_TRUE(std::isnan(x)) << "o written despite the error";
    }
    ref::Problem p = base;
    p.g[at] = 0.0;
    EXPECT_EQ(forward_error(p, dtype, cfg, &o), "");
  }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CpGpuNonFinite,
                         ::testing::Combine(::testing::ValuesIn(kAllVariants),
                                            ::testing::Values(DType::f32, DType::bf16, DType::f16),
                                            ::testing::Values(Layout::rows, Layout::packed)),
                         mixer_name);

// ---- statescan's device pool (core/device_pool.h) ----------------------------------

class DevicePool : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(DevicePool, AllocationsAreUsableInStreamOrder) {
  for (const std::size_t n : {std::size_t{1} << 12, std::size_t{3} << 20}) {  // small, large
    void* p = pool_alloc(n, nullptr);
    ASSERT_NE(p, nullptr);
    SS_CUDA_CHECK(cudaMemsetAsync(p, 0x5A, n, nullptr));
    std::vector<unsigned char> host(n, 0);
    SS_CUDA_CHECK(cudaMemcpyAsync(host.data(), p, n, cudaMemcpyDeviceToHost, nullptr));
    pool_free(p, nullptr);
    SS_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    for (unsigned char x : host) ASSERT_EQ(x, 0x5A) << n << " bytes";
  }
  EXPECT_EQ(pool_alloc(0, nullptr), nullptr);
  pool_free(nullptr, nullptr);
}

// A large block given back is cached and handed out again for about the same
// size (at most 1/8 more), also to another stream, which first waits for the
// work that used it: a kernel-length memset queued on one stream and a copy
// queued on the other right after the hand-over must see it finished.
TEST_F(DevicePool, LargeBlocksAreReusedInOrderAcrossStreams) {
  const std::size_t n = std::size_t{64} << 20;
  pool_release_cached();  // no other test's idle blocks to pick instead
  pool_reset_in_use_high();
  const std::size_t before = pool_in_use_high();  // blocks other tests still hold
  cudaStream_t s1 = nullptr, s2 = nullptr;
  SS_CUDA_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  SS_CUDA_CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  void* a = pool_alloc(n, s1);
  SS_CUDA_CHECK(cudaMemsetAsync(a, 0, n, s1));
  SS_CUDA_CHECK(cudaMemsetAsync(a, 0x11, n, s1));
  pool_free(a, s1);
  const std::size_t idle = pool_idle_bytes();
  EXPECT_GE(idle, n);
  void* b = pool_alloc(n - n / 16, s2);  // within 1/8: the same block
  EXPECT_EQ(b, a);
  EXPECT_EQ(pool_idle_bytes(), idle - n);
  std::vector<unsigned char> host(n - n / 16, 0);
  SS_CUDA_CHECK(cudaMemcpyAsync(host.data(), b, host.size(), cudaMemcpyDeviceToHost, s2));
  SS_CUDA_CHECK(cudaStreamSynchronize(s2));
  for (std::size_t i = 0; i < host.size(); i += 4093) ASSERT_EQ(host[i], 0x11) << i;
  void* c = pool_alloc(n / 2, s2);  // much smaller: a block of its own
  EXPECT_NE(c, a);
  EXPECT_EQ(pool_in_use_high(), before + n + n / 2);  // both blocks, whole
  pool_free(b, s2);
  pool_free(c, s2);
  SS_CUDA_CHECK(cudaStreamSynchronize(s2));
  const std::size_t cached = pool_cached_bytes();
  EXPECT_GE(cached, n + n / 2);
  pool_release_cached();  // nothing in use now: all of it goes
  EXPECT_EQ(pool_cached_bytes(), 0u);
  SS_CUDA_CHECK(cudaStreamDestroy(s1));
  SS_CUDA_CHECK(cudaStreamDestroy(s2));
}

// pool_release_cached waits for each idle block's last user without holding
// the pool: with a block whose stream is held (a host callback standing in
// for a collective that waits for a peer), another thread's allocations and
// frees go on while the release waits. The held stream is let go after at
// most 10 s whatever happens, so a release that holds the pool fails the
// test instead of hanging it.
void CUDART_CB wait_for_flag(void* flag) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!static_cast<std::atomic<bool>*>(flag)->load() &&
         std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

TEST_F(DevicePool, ReleaseWaitsWithoutHoldingThePool) {
  pool_release_cached();
  const std::size_t others_hold = pool_cached_bytes();  // blocks other tests still hold
  cudaStream_t held = nullptr, other = nullptr;
  SS_CUDA_CHECK(cudaStreamCreateWithFlags(&held, cudaStreamNonBlocking));
  SS_CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  std::atomic<bool> go{false};
  void* block = pool_alloc(std::size_t{32} << 20, held);
  SS_CUDA_CHECK(cudaLaunchHostFunc(held, wait_for_flag, &go));
  pool_free(block, held);  // idle, its last user behind the callback
  std::atomic<bool> released{false};
  std::thread releaser([&] {
    pool_release_cached();
    released = true;
  });
  // Give the release time to take the block and wait on it.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto others = std::async(std::launch::async, [&] {
    void* small = pool_alloc(std::size_t{1} << 12, other);
    pool_free(small, other);
    return pool_cached_bytes();
  });
  const bool went_on = others.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
  const bool release_waited = !released.load();
  go = true;
  releaser.join();
  EXPECT_TRUE(went_on) << "another thread's allocation waited for the release";
  EXPECT_TRUE(release_waited) << "the release did not wait for the held stream";
  EXPECT_EQ(others.get(), others_hold) << "the released block is still counted as cached";
  EXPECT_TRUE(released.load());
  SS_CUDA_CHECK(cudaStreamSynchronize(other));
  SS_CUDA_CHECK(cudaStreamDestroy(held));
  SS_CUDA_CHECK(cudaStreamDestroy(other));
}

// ---- the kernels' cuBLAS handles (kernels/cuda/blas_handle.h) ----------------------

// One handle per thread and slot, kept: the same slot gives the same handle
// again (on any stream), another slot or another thread another handle, so
// that work in flight at once on two streams (the summary beside LaCT, LaCT's
// side stream beside its caller's) never shares a workspace.
TEST_F(DevicePool, BlasHandlesAreOnePerThreadAndSlot) {
  using cuda::detail::blas_handle;
  using cuda::detail::BlasSlot;
  cudaStream_t s1 = nullptr, s2 = nullptr;
  SS_CUDA_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  SS_CUDA_CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  const cublasHandle_t lact = blas_handle(s1, BlasSlot::lact);
  EXPECT_NE(lact, nullptr);
  EXPECT_EQ(blas_handle(s2, BlasSlot::lact), lact);
  const cublasHandle_t side = blas_handle(s2, BlasSlot::lact_side);
  const cublasHandle_t summary = blas_handle(s1, BlasSlot::summary);
  EXPECT_NE(side, lact);
  EXPECT_NE(summary, lact);
  EXPECT_NE(summary, side);
  const cublasHandle_t ns = blas_handle(s1, BlasSlot::newton_schulz);
  EXPECT_NE(ns, lact);
  EXPECT_NE(ns, side);
  EXPECT_NE(ns, summary);
  cublasHandle_t elsewhere = nullptr;
  std::thread([&] { elsewhere = blas_handle(s1, BlasSlot::lact); }).join();
  EXPECT_NE(elsewhere, nullptr);
  EXPECT_NE(elsewhere, lact);
  SS_CUDA_CHECK(cudaStreamDestroy(s1));
  SS_CUDA_CHECK(cudaStreamDestroy(s2));
}

// Small allocations come from a stream-ordered pool that keeps what is freed
// into it; pool_release_cached gives that back to the device too (it used to
// free only the large cached blocks, so an out-of-memory after many small
// allocations found their memory still reserved): 512 MiB of 1 MiB
// allocations freed and kept, then given back.
TEST_F(DevicePool, ReleaseCachedAlsoReturnsTheSmallAllocationsPool) {
  pool_release_cached();
  const std::size_t before = pool_small_reserved_bytes();
  std::vector<void*> blocks;
  for (int i = 0; i < 512; ++i) blocks.push_back(pool_alloc(std::size_t{1} << 20, nullptr));
  for (void* b : blocks) pool_free(b, nullptr);
  SS_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  EXPECT_GE(pool_small_reserved_bytes(), before + (std::size_t{512} << 20))
      << "the freed small blocks were not kept for reuse";
  pool_release_cached();
  EXPECT_LE(pool_small_reserved_bytes(), before) << "the small pool kept its memory";
}

// PoolArray owns its block: a move hands it over (the source is left empty),
// an assignment over a full array gives the old block back, zero() clears
// every element in stream order.
TEST_F(DevicePool, PoolArrayMovesOwnershipAndZeroes) {
  const std::size_t n = std::size_t{1} << 20;  // 4 MiB of floats: a cached block
  pool_release_cached();
  PoolArray<float> a(n, nullptr);
  ASSERT_NE(a.get(), nullptr);
  EXPECT_EQ(a.size(), n);
  SS_CUDA_CHECK(cudaMemsetAsync(a.get(), 0xFF, n * sizeof(float), nullptr));
  float* const block = a.get();
  PoolArray<float> b(std::move(a));
  EXPECT_EQ(a.get(), nullptr);
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(b.get(), block);
  b.zero();
  std::vector<float> host(n, 1.f);
  SS_CUDA_CHECK(
      cudaMemcpyAsync(host.data(), b.get(), n * sizeof(float), cudaMemcpyDeviceToHost, nullptr));
  SS_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  for (std::size_t i = 0; i < n; i += 997) ASSERT_EQ(host[i], 0.f) << i;
  EXPECT_EQ(pool_idle_bytes(), 0u);
  b = PoolArray<float>(n / 4, nullptr);             // 1 MiB: from the small pool
  EXPECT_EQ(pool_idle_bytes(), n * sizeof(float));  // the 4 MiB block is back in the cache
  b = PoolArray<float>();
  EXPECT_EQ(b.get(), nullptr);
  b.zero();  // nothing to clear
  SS_CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

// Out of memory names the size and leaves the device usable.
TEST_F(DevicePool, OutOfMemoryIsAnErrorNamingTheSize) {
  try {
    (void)pool_alloc(std::size_t{1} << 52, nullptr);  // 4 PiB
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "cuda") << e.what();  // a device failure (statescan-run aborts)
    EXPECT_NE(std::string(e.what()).find(std::to_string(std::size_t{1} << 52)), std::string::npos)
        << e.what();
  }
  void* p = pool_alloc(std::size_t{4} << 20, nullptr);
  ASSERT_NE(p, nullptr);
  pool_free(p, nullptr);
  SS_CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

}  // namespace
}  // namespace statescan::test
