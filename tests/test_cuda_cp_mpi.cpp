// GPU context parallelism under mpirun (np 1 and 2): CpMixer on device
// tensors with P ranks must equal a single-GPU run of the same inputs, for
// every variant x exchange, forward and backward, over uneven shards and
// packed sequences on and across the rank boundary. Two communicators:
//   nccl  the exchange stays on the GPU (needs one GPU per rank: the suite
//         skips on every rank, by one agreed decision, when the node has fewer);
//   mpi   the exchange is staged through host memory (ranks may share a GPU).
// Bad input on one rank (NaN in g) must raise the same error on every rank.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/nccl_communicator.h"
#include "core/error.h"
#include "kernels/cuda/cuda_mixer.h"
#include "tests/collective_error.h"
#include "tests/cuda_cp_test_util.h"
#include "tests/fault_notice_util.h"

namespace statescan::test {
namespace {

// Tolerances: test_util.h's DESIGN §7 bars. f32: CP and single-GPU runs
// differ only in how the boundary state is formed (fp32 maps vs the carried
// state). bf16: the single-GPU run rounds the carried state to bf16 for its
// products, the CP run composes it in fp32: bf16's state bar (output_tol).

MpiCommunicator& mpi() {
  static std::unique_ptr<MpiCommunicator> comm = MpiCommunicator::world();
  return *comm;
}

// Why this job cannot run GPU tests of `backend`, or "" if it can; agreed
// over MPI so that every rank skips or none does.
std::string why_skip(const std::string& backend) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  const int64_t need = backend == "nccl" ? mpi().local_size() : 1;
  int64_t short_of_gpus = devices < need ? 1 : 0;
  mpi().all_reduce_max(&short_of_gpus, 1, CommType::i64);
  if (short_of_gpus == 0) return "";
  return backend + " needs " + std::to_string(need) + " GPU(s) per node; some node has " +
         std::to_string(devices);
}

// The NCCL communicator over the world, made on first use and finalised by
// the test environment's TearDown (every rank, before MPI_Finalize).
std::unique_ptr<NcclCommunicator>& nccl_world() {
  static std::unique_ptr<NcclCommunicator> nccl;
  return nccl;
}

class NcclWorldEnvironment : public ::testing::Environment {
 public:
  void TearDown() override { nccl_world().reset(); }
};
const ::testing::Environment* const kNcclWorldEnvironment =
    ::testing::AddGlobalTestEnvironment(new NcclWorldEnvironment);

// The communicator of `backend` over the world, made once per process.
Communicator& world(const std::string& backend) {
  static cudaStream_t stream = nullptr;
  if (backend == "mpi") return mpi();
  std::unique_ptr<NcclCommunicator>& nccl = nccl_world();
  if (!nccl) {
    if (cudaStreamCreate(&stream) != cudaSuccess) SS_FAIL("cuda", "cudaStreamCreate failed");
    nccl = NcclCommunicator::create(mpi(), stream);
  }
  return *nccl;
}

enum class Layout { batch_rows, packed_on_boundary, packed_across };

struct Case {
  Variant variant;
  Exchange exchange;
  Layout layout;
  DType dtype;
  const char* backend;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const char* l = c.layout == Layout::batch_rows           ? "rows"
                  : c.layout == Layout::packed_on_boundary ? "packed_on_boundary"
                                                           : "packed_across";
  return std::string(c.backend) + "_" + to_string(c.variant) + "_" + to_string(c.exchange) + "_" +
         l + "_" + to_string(c.dtype);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << case_name(::testing::TestParamInfo<Case>(c, 0));
}

class CudaCpInvariance : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const std::string skip = why_skip(GetParam().backend);
    if (!skip.empty()) GTEST_SKIP() << skip;
    int devices = 1;
    cudaGetDeviceCount(&devices);
    ASSERT_EQ(cudaSetDevice(mpi().local_rank() % devices), cudaSuccess);
    const Case c = GetParam();
    comm_ = &world(c.backend);
    P_ = comm_->size();
    r_ = comm_->rank();
    const int64_t T = 300;
    bounds_ = shard_bounds(T, P_);
    ProblemSpec s;
    s.variant = c.variant;
    s.seq_len = T;
    s.heads = 2;
    s.dk = s.dv = 64;
    s.with_h0 = true;
    s.l2norm_qk = c.variant == Variant::kda;
    if (c.layout == Layout::batch_rows) {
      s.batch = 2;
    } else if (c.layout == Layout::packed_on_boundary) {
      // A sequence ending exactly at rank 1's start, one starting there and
      // running to the end.
      s.cu_seqlens = {0, 7, bounds_[1], T};
      if (P_ == 1) s.cu_seqlens = {0, 7, 100, T};
    } else {
      // A sequence that crosses the rank boundary, then a short one.
      s.cu_seqlens = {0, 5, bounds_[1] + 70 < T ? bounds_[1] + 70 : T - 3, T};
    }
    // Same seed on every rank: every rank holds the same full problem.
    const uint64_t seed = 9000 + static_cast<uint64_t>(c.variant) * 64 +
                          static_cast<uint64_t>(c.exchange) * 8 + static_cast<uint64_t>(c.layout) +
                          static_cast<uint64_t>(c.dtype) * 1000;
    p_ = random_problem(s, seed);
    round_problem(p_, c.dtype);
    std::mt19937_64 rng(seed + 1);
    d_o_ = round_to_dtype(randn(p_.v.size(), rng), c.dtype);
    dht_ =
        round_f32(randn(static_cast<std::size_t>(p_.num_sequences() * s.heads * s.dk * s.dv), rng));
    cfg_.variant = c.variant;
    cfg_.chunk = 64;
    cfg_.l2norm_qk = s.l2norm_qk;
  }

  // Runs the single-GPU and the CP run; returns (full, mine).
  std::pair<CpOutputs, CpOutputs> run(bool backward) {
    const Case c = GetParam();
    SingleRankCommunicator self;
    CpMixer single(self, cfg_, Exchange::ring);
    CpOutputs full = run_cp_device(single, p_, c.dtype, 0, p_.seq_len, d_o_, dht_, backward);
    // The allgather cases keep the forward's prepared tiles (every rank but
    // the first then skips the backward's prepare stage).
    MixerConfig cfg = cfg_;
    cfg.keep_prepared = c.exchange == Exchange::allgather;
    CpMixer cp(*comm_, cfg, c.exchange);
    // Over NCCL the tree cases agree over MPI (set_control), the others
    // through the staged view of the NCCL communicator.
    if (std::string(c.backend) == "nccl" && c.exchange == Exchange::tree) cp.set_control(&mpi());
    CpOutputs mine =
        run_cp_device(cp, p_, c.dtype, bounds_[r_], bounds_[r_ + 1], d_o_, dht_, backward);
    if (P_ > 1) {
      EXPECT_EQ(cp.last_forward_stats().exchange, c.exchange);
      // In forward order every rank but the last sends (ring and tree send
      // nothing from the last rank).
      if (r_ + 1 < P_) {
        EXPECT_GT(cp.last_forward_stats().exchange_bytes, 0);
      }
    }
    EXPECT_TRUE(cp.last_forward_stats().on_device);
    // The forward's exchange waits for the summary and the local pass for it:
    // nothing hides it (an early ring receive would sit beside the summary).
    EXPECT_EQ(cp.last_forward_stats().hidden_s, 0.0);
    return {std::move(full), std::move(mine)};
  }
  std::vector<double> local(const std::vector<float>& x, int64_t inner) const {
    std::vector<double> d(x.begin(), x.end());
    return slice_tokens_d(d, p_.batch, p_.seq_len, bounds_[r_], bounds_[r_ + 1], inner);
  }

  Communicator* comm_ = nullptr;
  int P_ = 1, r_ = 0;
  std::vector<int64_t> bounds_;
  ref::Problem p_;
  std::vector<double> d_o_, dht_;
  MixerConfig cfg_;
};

TEST_P(CudaCpInvariance, ForwardEqualsSingleGpu) {
  const DType t = GetParam().dtype;
  const auto [full, mine] = run(false);
  const int64_t H = p_.heads, Dv = p_.dv;
  EXPECT_LE(rel_rms(mine.o, local(full.o, H * Dv)), output_tol(t)) << "o, rank " << r_;
  EXPECT_LE(rel_rms(mine.ht, full.ht), output_tol(t)) << "final state, rank " << r_;
  // The single-GPU run itself against the fp64 reference, so that the two
  // cannot agree on a wrong answer.
  if (r_ == 0) {
    const ref::Outputs ro = ref::forward(p_);
    EXPECT_LE(rel_rms(full.o, ro.o), output_tol(t));
    EXPECT_LE(rel_rms(full.ht, ro.ht), output_tol(t));
  }
}

TEST_P(CudaCpInvariance, BackwardEqualsSingleGpu) {
  const DType t = GetParam().dtype;
  const auto [full, mine] = run(true);
  const int64_t H = p_.heads, Dk = p_.dk, Dv = p_.dv;
  const bool vec = vector_gate(p_.variant);
  EXPECT_LE(rel_rms(mine.dq, local(full.dq, H * Dk)), grad_tol(t)) << "dq, rank " << r_;
  EXPECT_LE(rel_rms(mine.dk, local(full.dk, H * Dk)), grad_tol(t)) << "dk, rank " << r_;
  EXPECT_LE(rel_rms(mine.dv, local(full.dv, H * Dv)), grad_tol(t)) << "dv, rank " << r_;
  if (has_gate(p_.variant)) {
    EXPECT_LE(rel_rms(mine.dg, local(full.dg, vec ? H * Dk : H)), gate_grad_tol(t))
        << "dg, rank " << r_;
  }
  if (has_beta(p_.variant)) {
    EXPECT_LE(rel_rms(mine.dbeta, local(full.dbeta, H)), gate_grad_tol(t)) << "dbeta, rank " << r_;
  }
  EXPECT_LE(rel_rms(mine.dh0, full.dh0), output_tol(t)) << "dh0, rank " << r_;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const char* backend : {"nccl", "mpi"})
    for (Variant v : kAllVariants)
      for (Exchange e : {Exchange::allgather, Exchange::ring, Exchange::tree})
        for (Layout l : {Layout::batch_rows, Layout::packed_on_boundary, Layout::packed_across})
          cases.push_back({v, e, l, DType::f32, backend});
  // bf16, the training dtype, on the two models issue 5 measures.
  for (Variant v : {Variant::kda, Variant::gated_deltanet})
    for (Exchange e : {Exchange::allgather, Exchange::ring, Exchange::tree})
      cases.push_back({v, e, Layout::packed_across, DType::bf16, "nccl"});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllVariantsExchanges, CudaCpInvariance, ::testing::ValuesIn(all_cases()),
                         case_name);

// ---- a bad input on one rank: the same error everywhere, no hang ---------------------

// Both tests' set-up: the backend (skipped where it cannot run) and this
// rank's GPU.
class CudaCpErrors : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    mpi_control = std::string(GetParam()) == "nccl_mpi_control";
    backend = mpi_control ? "nccl" : GetParam();
    const std::string skip = why_skip(backend);
    if (!skip.empty()) GTEST_SKIP() << skip;
    int devices = 1;
    cudaGetDeviceCount(&devices);
    ASSERT_EQ(cudaSetDevice(mpi().local_rank() % devices), cudaSuccess);
  }
  // One ring forward of `variant` on `a`; the error it threw, if any.
  std::optional<Error> forward_error(Communicator& comm, Variant variant, const CpForwardArgs& a) {
    MixerConfig cfg;
    cfg.variant = variant;
    CpMixer mixer(comm, cfg, Exchange::ring);
    if (mpi_control) mixer.set_control(&mpi());
    try {
      mixer.forward(a);
    } catch (const Error& e) {
      return e;
    }
    return std::nullopt;
  }
  bool mpi_control = false;
  std::string backend;
};

// "nccl_mpi_control": NCCL data plane, agreement over MPI (set_control).
TEST_P(CudaCpErrors, NanInGateOnOneRankFailsEveryRank) {
  Communicator& comm = world(backend);
  const int P = comm.size(), r = comm.rank();
  const int culprit = P - 1;
  ProblemSpec s;
  s.variant = Variant::gated_deltanet;
  s.seq_len = 160;
  s.heads = 2;
  s.dk = s.dv = 64;
  ref::Problem p = random_problem(s, 77);
  round_problem(p, DType::bf16);
  const auto bounds = shard_bounds(s.seq_len, P);
  const int64_t L = bounds[r + 1] - bounds[r];
  const Shape qk{1, L, 2, 64}, bth{1, L, 2};
  auto g = slice_tokens(p.g, 1, s.seq_len, bounds[r], bounds[r + 1], 2);
  if (r == culprit) g[1] = std::numeric_limits<float>::quiet_NaN();
  const DeviceTensor q(slice_tokens(p.q, 1, s.seq_len, bounds[r], bounds[r + 1], 128), DType::bf16,
                       qk);
  const DeviceTensor k(slice_tokens(p.k, 1, s.seq_len, bounds[r], bounds[r + 1], 128), DType::bf16,
                       qk);
  const DeviceTensor v(slice_tokens(p.v, 1, s.seq_len, bounds[r], bounds[r + 1], 128), DType::bf16,
                       qk);
  const DeviceTensor beta(slice_tokens(p.beta, 1, s.seq_len, bounds[r], bounds[r + 1], 2),
                          DType::bf16, bth);
  const DeviceTensor gd(g, DType::f32, bth);
  CpForwardArgs a;
  a.q = q.view();
  a.k = k.view();
  a.v = v.view();
  a.g = gd.view();
  a.beta = beta.view();
  // o holds a sentinel (as bf16 holds it) that must survive the refusal.
  const DeviceTensor o16(std::vector<float>(static_cast<std::size_t>(L * 128), 12345.f),
                         DType::bf16, qk);
  a.o = o16.view();
  const std::optional<Error> e = forward_error(comm, s.variant, a);
  EXPECT_TRUE(e) << "rank " << r << " did not get the error";
  if (e) {
    EXPECT_EQ(e->argument(), "g") << e->what();
    EXPECT_EQ(e->rank(), culprit) << e->what();
  }
  const float sentinel = round_to(DType::bf16, 12345.f);
  for (float x : o16.to_host())
    ASSERT_EQ(x, sentinel) << "rank " << r << " wrote o despite the error";
  mpi().barrier();  // reaching this on every rank is the no-hang check
}

// This rank's shard of a GLA problem (vector gates, no beta; T 96, H 2,
// D 64) as host floats, and an o holding the sentinel 12345.
struct GlaShard {
  Shape shape;
  std::vector<float> q, k, v, g, o;
};
GlaShard gla_shard(const Communicator& comm, uint64_t seed) {
  ProblemSpec s;
  s.variant = Variant::gla;
  s.seq_len = 96;
  s.heads = 2;
  s.dk = s.dv = 64;
  const ref::Problem p = random_problem(s, seed);
  const auto bounds = shard_bounds(s.seq_len, comm.size());
  const int64_t t0 = bounds[comm.rank()], t1 = bounds[comm.rank() + 1];
  auto part = [&](const std::vector<double>& x) {
    return slice_tokens(x, 1, s.seq_len, t0, t1, 128);
  };
  return {Shape{1, t1 - t0, 2, 64},
          part(p.q),
          part(p.k),
          part(p.v),
          part(p.g),
          std::vector<float>(static_cast<std::size_t>((t1 - t0) * 128), 12345.f)};
}

// One rank passing host tensors while its peers pass device tensors: the two
// paths run different code, yet meet in the same agreement collectives (over
// NCCL, the host path's through the staged control plane too), so every rank
// throws the placement mismatch ("memory") instead of the host rank failing
// alone on the NCCL communicator and its peers waiting for the timeout.
TEST_P(CudaCpErrors, HostTensorsOnOneRankFailEveryRank) {
  Communicator& comm = world(backend);
  const int P = comm.size(), r = comm.rank();
  if (P < 2) GTEST_SKIP() << "needs a peer on the other path (every rank skips alike)";
  const bool on_host = r == P - 1;
  GlaShard h = gla_shard(comm, 78);
  const Shape& qk = h.shape;
  const DeviceTensor q(h.q, DType::f32, qk), k(h.k, DType::f32, qk), v(h.v, DType::f32, qk),
      g(h.g, DType::f32, qk), o(h.o, DType::f32, qk);
  CpForwardArgs a;
  a.q = on_host ? TensorView(h.q.data(), DType::f32, qk) : q.view();
  a.k = on_host ? TensorView(h.k.data(), DType::f32, qk) : k.view();
  a.v = on_host ? TensorView(h.v.data(), DType::f32, qk) : v.view();
  a.g = on_host ? TensorView(h.g.data(), DType::f32, qk) : g.view();
  a.o = on_host ? TensorView(h.o.data(), DType::f32, qk) : o.view();
  const std::optional<Error> e = forward_error(comm, Variant::gla, a);
  EXPECT_TRUE(e) << "rank " << r << " did not get the error";
  if (e) {
    EXPECT_EQ(e->argument(), "memory") << e->what();
  }
  for (float x : on_host ? h.o : o.to_host())
    ASSERT_EQ(x, 12345.f) << "rank " << r << " wrote o despite the error";
  mpi().barrier();  // reaching this on every rank is the no-hang check
}

// One rank in bf16 while its peers pass f32: every shape agrees and the
// exchange is fp32 either way, so nothing else would notice the mixed
// precision; the agreement names the dtype on every rank.
TEST_P(CudaCpErrors, ADtypeOnOneRankFailsEveryRank) {
  Communicator& comm = world(backend);
  const int P = comm.size(), r = comm.rank();
  if (P < 2) GTEST_SKIP() << "needs a peer with the other dtype (every rank skips alike)";
  const DType dtype = r == P - 1 ? DType::bf16 : DType::f32;
  const GlaShard h = gla_shard(comm, 79);
  const DeviceTensor q(h.q, dtype, h.shape), k(h.k, dtype, h.shape), v(h.v, dtype, h.shape),
      g(h.g, DType::f32, h.shape), o(h.o, dtype, h.shape);
  CpForwardArgs a;
  a.q = q.view();
  a.k = k.view();
  a.v = v.view();
  a.g = g.view();
  a.o = o.view();
  const std::optional<Error> e = forward_error(comm, Variant::gla, a);
  EXPECT_TRUE(e) << "rank " << r << " did not get the error";
  if (e) {
    EXPECT_EQ(e->argument(), "dtype") << e->what();
  }
  const float sentinel = round_to(dtype, 12345.f);  // 12352 in bf16
  for (float x : o.to_host())
    ASSERT_EQ(x, sentinel) << "rank " << r << " wrote o despite the error";
  mpi().barrier();  // reaching this on every rank is the no-hang check
}

// ---- a failure on one rank alone: its peers hear it at once --------------------------

// The victim's forward fails after its last collective (its observer
// throws), so its peers' forwards complete (or stop in their last collective:
// see match_agreement_late) and they wait for it in the backward's first
// agreement: over MPI (staged exchange), or through the
// NCCL communicator's staged control plane, whose wait polls the fault
// notices of its MPI channel. They must throw at once, naming the victim and
// its error, not after their 30-second timeout. On communicators of their
// own: a notice leaves them unusable.
TEST_P(CudaCpErrors, AFailureOnOneRankStopsItsPeersAtOnce) {
  if (mpi_control) GTEST_SKIP() << "the nccl case covers the NCCL wait";
  if (mpi().size() < 2) GTEST_SKIP() << "needs peers to tell (every rank skips alike)";
  const auto group = mpi().split(0, mpi().rank());
  auto& group_mpi = static_cast<MpiCommunicator&>(*group);
  group_mpi.set_timeout(std::chrono::milliseconds(30000));
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  NcclCommunicator::Options options;
  options.timeout = std::chrono::milliseconds(30000);
  std::unique_ptr<NcclCommunicator> nccl =
      backend == "nccl" ? NcclCommunicator::create(group_mpi, stream, options) : nullptr;
  Communicator& comm = nccl ? static_cast<Communicator&>(*nccl) : group_mpi;
  const int P = comm.size(), r = comm.rank(), victim = P - 1;

  ProblemSpec s;
  s.variant = Variant::gated_deltanet;
  s.seq_len = 256;
  s.heads = 2;
  s.dk = s.dv = 64;
  s.with_h0 = true;
  ref::Problem p = random_problem(s, 91);
  round_problem(p, DType::bf16);
  std::mt19937_64 rng(92);
  const auto d_o = round_to_dtype(randn(p.v.size(), rng), DType::bf16);
  const auto dht = round_f32(randn(static_cast<std::size_t>(2 * 64 * 64), rng));
  const auto bounds = shard_bounds(s.seq_len, P);
  MixerConfig cfg;
  cfg.variant = s.variant;
  FailingObserver failing;
  ForwardEndObserver ended;
  CpMixer mixer(comm, cfg, Exchange::ring,
                r == victim ? static_cast<CpObserver*>(&failing) : &ended);

  const auto start = std::chrono::steady_clock::now();
  std::optional<Error> e;
  try {
    (void)run_cp_device(mixer, p, DType::bf16, bounds[r], bounds[r + 1], d_o, dht, true);
  } catch (const Error& err) {
    e = err;
  }
  expect_told(e, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), r,
              victim, P, nccl ? "nccl" : "mpi");
  mpi().barrier();
  // Over NCCL the survivors aborted what they waited in; over MPI those whose
  // forward ended left the agreement posted.
  if (!nccl) match_agreement_late(mpi(), group_mpi.native(), ended.reached);
  mpi().barrier();
  nccl.reset();  // aborted on every rank: nothing left to finalise
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(Backends, CudaCpErrors,
                         ::testing::Values("nccl", "mpi", "nccl_mpi_control"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return std::string(i.param);
                         });

}  // namespace
}  // namespace statescan::test
