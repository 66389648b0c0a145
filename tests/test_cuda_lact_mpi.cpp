// LaCT on the GPU sharded over ranks (mpirun -np 1 and 2, one GPU per rank):
// LactLayer on device tensors over NCCL (and over the MPI communicator, whose
// all-reduces stage through the host) must give the unsharded fp64 result for
// the output and every gradient, forward and backward; bad input on one rank
// must raise the same error on every rank with nothing written. Every rank
// skips when the node has fewer GPUs than ranks.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/nccl_communicator.h"
#include "core/error.h"
#include "tests/collective_error.h"
#include "tests/lact_cuda_test_util.h"

namespace statescan::test {
namespace {

constexpr double kF32Tol = 1e-5;  // DESIGN §7 vs fp64
// bf16 (tests/test_cuda_lact.cpp explains the learning rates' bound).
constexpr double kBf16OutTol = 5e-3, kBf16GradTol = 8e-3, kBf16RateGradTol = 2e-2;

// MPI world, and (when every rank has a GPU of its own) an NCCL communicator
// over it on this rank's GPU. Built once for the whole binary: NCCL setup is
// slow. The MPI cases need only a GPU on every rank (ranks may share one, as
// on a one-GPU machine), the NCCL ones a GPU per rank.
struct World {
  std::unique_ptr<MpiCommunicator> mpi;
  std::string skip_mpi, skip_nccl;  // why the cases cannot run here, agreed by all ranks
  cudaStream_t stream = nullptr;
  std::unique_ptr<NcclCommunicator> nccl;

  World() {
    mpi = MpiCommunicator::world();
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
    int64_t without_gpu = devices < 1 ? 1 : 0;
    mpi->all_reduce_max(&without_gpu, 1, CommType::i64);
    if (without_gpu != 0) {
      skip_mpi = skip_nccl = "needs a GPU on every rank; some rank sees none";
      return;
    }
    if (cudaSetDevice(NcclCommunicator::device_for(*mpi)) != cudaSuccess ||
        cudaStreamCreate(&stream) != cudaSuccess) {
      skip_mpi = skip_nccl = "could not select this rank's GPU";
      return;
    }
    // By GPU identity, as create() decides (one visible GPU per rank is fine).
    skip_nccl = NcclCommunicator::gpu_conflict(*mpi);
    if (!skip_nccl.empty()) return;
    nccl = NcclCommunicator::create(*mpi, stream);
  }
  const std::string& skip(bool over_nccl) const { return over_nccl ? skip_nccl : skip_mpi; }
};

World& world() {
  static World w;
  return w;
}

struct ShardCase {
  LactCase options;
  int64_t seq_len, chunk;  // every chunk divisible by 2
  DType dtype;
  bool over_nccl;  // else the MPI communicator (host-staged all-reduce)
  // bf16 at D 64, M 128 (else 32, 64): a shape the fused hidden layer takes
  // (kernels/cuda/lact_hidden.cuh), each rank's slice a partial 128-token tile.
  bool wide = false;
};

std::string shard_case_name(const ::testing::TestParamInfo<ShardCase>& info) {
  const ShardCase& c = info.param;
  return lact_case_name(c.options) + "_T" + std::to_string(c.seq_len) + "_C" +
         std::to_string(c.chunk) + "_" + to_string(c.dtype) + (c.wide ? "_wide" : "") +
         (c.over_nccl ? "_nccl" : "_mpi");
}

void PrintTo(const ShardCase& c, std::ostream* os) {
  *os << shard_case_name(::testing::TestParamInfo<ShardCase>(c, 0));
}

class LactCudaSharding : public ::testing::TestWithParam<ShardCase> {
 protected:
  void SetUp() override {
    const std::string& why = world().skip(GetParam().over_nccl);
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

// The layer on device tensors, sharded over the world, against the unsharded
// fp64 reference (computed on every rank from the same seed).
TEST_P(LactCudaSharding, ShardedLayerMatchesUnshardedReference) {
  const ShardCase& c = GetParam();
  Communicator& comm = c.over_nccl ? static_cast<Communicator&>(*world().nccl)
                                   : static_cast<Communicator&>(*world().mpi);
  const int P = comm.size(), r = comm.rank();
  const int64_t D = c.dtype == DType::f32 ? 8 : (c.wide ? 64 : 32);
  const LactSizes s{2, c.seq_len, 2, D, 2 * D};
  const LactProblem p = rounded_to(random_lact_problem(s, 9100 + c.seq_len * 7 + c.chunk), c.dtype);
  const LactConfig cfg = c.options.config(c.chunk);
  LactLayer layer(comm, cfg);
  const LactResult<double> mine = run_lact_gpu_layer(layer, p, P, r, c.dtype);
  const LactResult<double> full = run_lact_kernel<double>(p, cfg);
  const bool f32 = c.dtype == DType::f32;
  expect_slices_match(mine, full, s, c.chunk, P, r,
                      {f32 ? kF32Tol : kBf16OutTol, f32 ? kF32Tol : kBf16GradTol,
                       f32 ? kF32Tol : kBf16RateGradTol});
}

std::vector<ShardCase> shard_cases() {
  std::vector<ShardCase> cases;
  for (const LactCase& o : all_lact_cases()) {
    cases.push_back({o, 48, 16, DType::f32, true});  // three full chunks
    cases.push_back({o, 40, 16, DType::f32, true});  // chunks of 16, 16 and 8
  }
  using S = LactSchedule;
  cases.push_back({{S::apply_then_update, true, true, true}, 32, 32, DType::f32, true});
  cases.push_back({{S::update_then_apply, true, true, true}, 48, 16, DType::f32, false});
  // bf16: chunks of at least 2 min(D, M) tokens (tests/test_cuda_lact.cpp says why).
  cases.push_back({{S::apply_then_update, true, true, true}, 256, 128, DType::bf16, true});
  cases.push_back({{S::update_then_apply, false, true, true}, 256, 128, DType::bf16, true});
  cases.push_back({{S::apply_then_update, true, true, true}, 400, 200, DType::bf16, true, true});
  cases.push_back({{S::update_then_apply, false, true, true}, 400, 200, DType::bf16, true, true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, LactCudaSharding, ::testing::ValuesIn(shard_cases()),
                         shard_case_name);

// ---- errors reach every rank, with no hang and nothing written -------------------------

class LactCudaErrorsMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!world().skip(true).empty()) GTEST_SKIP() << world().skip(true);
  }

  // Forward over NCCL with rank `culprit`'s input broken for `argument`.
  void expect_everywhere(const std::string& argument, int culprit, int reporter, int64_t chunk) {
    Communicator& comm = *world().nccl;
    const int P = comm.size(), r = comm.rank();
    LactConfig cfg;
    cfg.chunk = chunk;
    const LactSizes s{1, 4 * P, 2, 4, 6};
    LactProblem p = random_lact_problem(s, 31337);
    if (argument == "lr0" && r == culprit) p.lr0[1] = std::numeric_limits<double>::quiet_NaN();
    if (argument == "w1" && r == culprit) p.w1[3] += 1e-3;
    const int64_t Tl = s.seq_len / P;
    p.s.seq_len = Tl;  // this rank's slice-sized buffers (contents do not matter)
    DeviceLactRun d(p, DType::f32);
    const float sentinel = 12345.f;
    {
      std::vector<float> f(d.o.count, sentinel);
      std::vector<unsigned char> raw(f.size() * sizeof(float));
      std::memcpy(raw.data(), f.data(), raw.size());
      d.o.bytes.copy_from_host(raw);
    }
    const int64_t D = (argument == "k" && r == culprit) ? 3 : 4;
    LactForwardArgs a;
    a.q = d.q.view({1, Tl, 2, 4});
    a.k = d.k.view({1, Tl, 2, D});
    a.v = d.v.view({1, Tl, 2, 4});
    a.lr0 = d.lr0.view({1, Tl, 2});
    a.lr1 = d.lr1.view({1, Tl, 2});
    a.lr2 = d.lr2.view({1, Tl, 2});
    a.w0 = d.w0.view({2, 6, 4});
    a.w1 = d.w1.view({2, 4, 6});
    a.w2 = d.w2.view({2, 6, 4});
    a.o = d.o.view({1, Tl, 2, 4});
    LactLayer layer(comm, cfg);
    std::vector<float> o_host;
    expect_collective_error(
        comm,
        [&] {
          try {
            layer.forward(a);
          } catch (...) {
            const std::vector<double> o = d.o.read();
            o_host.assign(o.begin(), o.end());
            throw;
          }
        },
        argument, culprit, reporter, o_host, sentinel);
  }
};

TEST_F(LactCudaErrorsMpi, ChunkNotDivisibleByRanksFailsEveryRank) {
  const int P = world().nccl->size();
  if (P == 1) GTEST_SKIP() << "every chunk divides over one rank";
  expect_everywhere("chunk", 0, 0, 2 * P + 1);
}

TEST_F(LactCudaErrorsMpi, NanLearningRateOnLastRankFailsEveryRank) {
  const int last = world().nccl->size() - 1;
  expect_everywhere("lr0", last, last, 4);
}

TEST_F(LactCudaErrorsMpi, WrongShapeOnLastRankFailsEveryRank) {
  const int last = world().nccl->size() - 1;
  expect_everywhere("k", last, last, 4);
}

TEST_F(LactCudaErrorsMpi, InitialWeightsDisagreeingAcrossRanksFailEveryRank) {
  const int P = world().nccl->size();
  if (P == 1) GTEST_SKIP() << "needs two ranks to disagree";
  expect_everywhere("w1", 1, 0, 4);
}

}  // namespace
}  // namespace statescan::test
