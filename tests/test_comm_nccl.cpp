// Tests of NcclCommunicator on device buffers against host expectations.
// Registered under mpirun -np 1 (world size 1 on one GPU) and -np 2 (two
// GPUs); every test skips, on every rank alike, when the job has fewer GPUs
// per node than ranks (CI has none: there the suite compiles and skips).
// Every rank runs every test, so checks before a collective use EXPECT, not
// ASSERT (a rank that returned early would leave the others waiting).
//
// The timeout path needs a peer that stays away, so it runs only with two
// ranks or more (NcclFault below); with one rank nothing can be waited for.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_communicator.h"
#include "comm/nccl_communicator.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "tests/comm_test_util.h"

namespace statescan {
namespace {

using namespace statescan::test;  // NOLINT: shared comm test helpers

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Why this job cannot run the NCCL tests, or "" if it can: a rank without a
// GPU, or two ranks on one GPU (by the rule create() applies, so one visible
// GPU per rank runs). Agreed over MPI so that every rank skips or none does.
std::string why_skip(MpiCommunicator& mpi) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    devices = 0;
    (void)cudaGetLastError();  // no device is no error of the tests
  }
  int64_t without_gpu = devices == 0 ? 1 : 0;
  mpi.all_reduce_max(&without_gpu, 1, CommType::i64);
  if (without_gpu != 0) return "needs a GPU per rank; a rank sees none";
  const std::string conflict = NcclCommunicator::gpu_conflict(mpi);
  return conflict.empty() ? "" : "needs a GPU per rank; " + conflict;
}

// One MPI world, one NCCL communicator over it on this rank's GPU, and a
// stream of that GPU. Skips (on every rank) when the job lacks GPUs.
class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    mpi_ = MpiCommunicator::world();
    const std::string skip = why_skip(*mpi_);
    if (!skip.empty()) GTEST_SKIP() << skip;
    ASSERT_EQ(cudaSetDevice(NcclCommunicator::device_for(*mpi_)), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    comm_ = NcclCommunicator::create(*mpi_, stream_);
  }
  void TearDown() override {
    comm_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // A device copy of `host`, made before anything is enqueued.
  static DeviceBuffer<unsigned char> on_device(const Bytes& host) {
    return DeviceBuffer<unsigned char>(host);
  }
  // Waits (watched) for the stream, then copies `d` back.
  Bytes on_host(const DeviceBuffer<unsigned char>& d) {
    comm_->wait();
    return d.to_host();
  }

  std::unique_ptr<MpiCommunicator> mpi_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<NcclCommunicator> comm_;
};

// ---- collectives and point to point, per element type -------------------------------

class NcclCollective : public NcclTest, public ::testing::WithParamInterface<CommType> {
 protected:
  CommType type() const { return GetParam(); }
  std::size_t elem() const { return size_of(type()); }
  const std::size_t count_ = 1001;  // odd, not a multiple of any vector width
};

std::string case_name(const ::testing::TestParamInfo<CommType>& info) {
  return type_name(info.param);
}

TEST_P(NcclCollective, AllGatherCollectsEveryRanksData) {
  const int P = comm_->size();
  auto send = on_device(contribution(comm_->rank(), count_, type()));
  DeviceBuffer<unsigned char> recv(P * count_ * elem());
  comm_->all_gather(send.data(), recv.data(), count_, type());
  const Bytes got = on_host(recv);
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(mismatches(got, r * count_, count_, type(),
                         [&](std::size_t i) { return value_of(r, i, type()); }),
              0u)
        << "slot of rank " << r;
  }
}

TEST_P(NcclCollective, AllGatherInPlace) {
  const int P = comm_->size(), me = comm_->rank();
  Bytes host(P * count_ * elem(), 0);
  const Bytes mine = contribution(me, count_, type());
  std::copy(mine.begin(), mine.end(), host.begin() + me * count_ * elem());
  auto data = on_device(host);
  comm_->all_gather(data.data() + me * count_ * elem(), data.data(), count_, type());
  const Bytes got = on_host(data);
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(mismatches(got, r * count_, count_, type(),
                         [&](std::size_t i) { return value_of(r, i, type()); }),
              0u)
        << "slot of rank " << r;
  }
}

TEST_P(NcclCollective, AllReduceSumAddsOverRanksOrRejectsBytes) {
  const int P = comm_->size();
  auto data = on_device(contribution(comm_->rank(), count_, type()));
  if (type() == CommType::u8) {
    expect_error([&] { comm_->all_reduce_sum(data.data(), count_, type()); }, "type");
    return;
  }
  comm_->all_reduce_sum(data.data(), count_, type());
  EXPECT_EQ(mismatches(on_host(data), 0, count_, type(),
                       [&](std::size_t i) {
                         double sum = 0;
                         for (int r = 0; r < P; ++r) sum += value_of(r, i, type());
                         return sum;
                       }),
            0u);
}

TEST_P(NcclCollective, AllReduceMaxTakesTheLargest) {
  const int P = comm_->size();
  auto data = on_device(contribution(comm_->rank(), count_, type()));
  comm_->all_reduce_max(data.data(), count_, type());
  EXPECT_EQ(mismatches(on_host(data), 0, count_, type(),
                       [&](std::size_t i) {
                         double best = value_of(0, i, type());
                         for (int r = 1; r < P; ++r) best = std::max(best, value_of(r, i, type()));
                         return best;
                       }),
            0u);
}

TEST_P(NcclCollective, BroadcastFromTheLastRank) {
  const int root = comm_->size() - 1;
  auto data = on_device(contribution(comm_->rank(), count_, type()));
  comm_->broadcast(data.data(), count_, type(), root);
  EXPECT_EQ(mismatches(on_host(data), 0, count_, type(),
                       [&](std::size_t i) { return value_of(root, i, type()); }),
            0u);
}

// With one rank the ring is rank 0 exchanging with itself.
TEST_P(NcclCollective, SendRecvRing) {
  const int P = comm_->size(), me = comm_->rank();
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  auto send = on_device(contribution(me, count_, type()));
  DeviceBuffer<unsigned char> recv(count_ * elem());
  comm_->send_recv(send.data(), count_, next, recv.data(), count_, prev, type(), 0);
  EXPECT_EQ(mismatches(on_host(recv), 0, count_, type(),
                       [&](std::size_t i) { return value_of(prev, i, type()); }),
            0u);
}

TEST_P(NcclCollective, SendRecvInPlaceRotates) {
  const int P = comm_->size(), me = comm_->rank();
  const int prev = (me + P - 1) % P;
  auto data = on_device(contribution(me, count_, type()));
  comm_->send_recv(data.data(), count_, (me + 1) % P, data.data(), count_, prev, type(), 0);
  EXPECT_EQ(mismatches(on_host(data), 0, count_, type(),
                       [&](std::size_t i) { return value_of(prev, i, type()); }),
            0u);
}

// Open ends: rank 0 receives nothing, the last rank sends nothing.
TEST_P(NcclCollective, SendRecvShiftWithOpenEnds) {
  const int P = comm_->size(), me = comm_->rank();
  auto send = on_device(contribution(me, count_, type()));
  const Bytes untouched = contribution(P + 7, count_, type());
  auto recv = on_device(untouched);
  comm_->send_recv(send.data(), count_, me + 1 < P ? me + 1 : -1, recv.data(), count_,
                   me > 0 ? me - 1 : -1, type(), 0);
  const Bytes got = on_host(recv);
  if (me == 0) {
    EXPECT_EQ(got, untouched);
  } else {
    EXPECT_EQ(mismatches(got, 0, count_, type(),
                         [&](std::size_t i) { return value_of(me - 1, i, type()); }),
              0u);
  }
}

// All-to-all through one group: a send to and a receive from every rank,
// oneself included.
TEST_P(NcclCollective, GroupedSendsAndReceivesToEveryRank) {
  const int P = comm_->size(), me = comm_->rank();
  auto send = on_device(contribution(me, count_, type()));
  DeviceBuffer<unsigned char> recv(P * count_ * elem());
  comm_->group_start();
  for (int r = 0; r < P; ++r) {
    comm_->send(send.data(), count_, type(), r, 0);
    comm_->recv(recv.data() + r * count_ * elem(), count_, type(), r, 0);
  }
  comm_->group_end();
  const Bytes got = on_host(recv);
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(mismatches(got, r * count_, count_, type(),
                         [&](std::size_t i) { return value_of(r, i, type()); }),
              0u)
        << "from rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Types, NcclCollective,
                         ::testing::Values(CommType::f32, CommType::f64, CommType::i64,
                                           CommType::u8),
                         case_name);

// ---- shape, arguments, sub-groups, barrier -------------------------------------------

TEST_F(NcclTest, MatchesTheMpiGroupAndItsGpu) {
  EXPECT_EQ(comm_->rank(), mpi_->rank());
  EXPECT_EQ(comm_->size(), mpi_->size());
  EXPECT_STREQ(comm_->backend(), "nccl");
  EXPECT_EQ(comm_->device(), NcclCommunicator::device_for(*mpi_));
  EXPECT_EQ(comm_->stream(), stream_);
  int nccl_device = -1;
  EXPECT_EQ(ncclCommCuDevice(comm_->native(), &nccl_device), ncclSuccess);
  EXPECT_EQ(nccl_device, comm_->device());
}

TEST_F(NcclTest, HostBuffersAndBadArgumentsThrowBeforeEnqueueing) {
  const int P = comm_->size(), me = comm_->rank();
  std::vector<float> host(8, 1.f);
  DeviceBuffer<float> device(8);
  expect_error([&] { comm_->all_reduce_sum(host.data(), 8, CommType::f32); }, "data");
  expect_error([&] { comm_->all_gather(device.data(), host.data(), 1, CommType::f32); }, "recv");
  expect_error([&] { comm_->broadcast(device.data(), 8, CommType::f32, P); }, "root");
  expect_error([&] { comm_->send(device.data(), 8, CommType::f32, P, 0); }, "peer");
  expect_error([&] { comm_->send(device.data(), 8, CommType::f32, me, 0); }, "peer");
  expect_error([&] { comm_->recv(device.data(), 8, CommType::f32, -2, 0); }, "peer");
  // send_recv names the half at fault.
  expect_error(
      [&] { comm_->send_recv(device.data(), 4, P, device.data() + 4, 4, -1, CommType::f32, 0); },
      "dest");
  expect_error(
      [&] { comm_->send_recv(device.data(), 4, -1, device.data() + 4, 4, -2, CommType::f32, 0); },
      "source");
  expect_error([&] { comm_->send(device.data(), 8, CommType::f32, -1, -1); }, "tag");
  expect_error([&] { comm_->split(-1, 0); }, "color");
  expect_error([&] { comm_->group_end(); }, "group_end");
  expect_error([&] { comm_->set_timeout(milliseconds(-1)); }, "timeout");
  if (P > 1) {
    // Overlapping send and receive (not the in-place layout).
    expect_error(
        [&] {
          comm_->send_recv(device.data(), 4, (me + 1) % P, device.data() + 2, 4, (me + P - 1) % P,
                           CommType::f32, 0);
        },
        "recv");
  }
  comm_->barrier();  // nothing was enqueued by the refused calls
}

TEST_F(NcclTest, BarrierWaitsForWorkEnqueuedBeforeIt) {
  const std::size_t count = 1 << 20;
  DeviceBuffer<float> data(count);
  ASSERT_EQ(cudaMemsetAsync(data.data(), 0, count * sizeof(float), stream_), cudaSuccess);
  comm_->all_reduce_sum(data.data(), count, CommType::f32);
  comm_->barrier();
  EXPECT_EQ(cudaStreamQuery(stream_), cudaSuccess);
}

TEST_F(NcclTest, SplitIntoEvenAndOddGroups) {
  const int P = comm_->size(), me = comm_->rank();
  const auto sub = comm_->split(me % 2, me);
  EXPECT_EQ(sub->size(), me % 2 == 0 ? (P + 1) / 2 : P / 2);
  EXPECT_EQ(sub->rank(), me / 2);
  EXPECT_STREQ(sub->backend(), "nccl");
  EXPECT_EQ(sub->timeout(), comm_->timeout());
  auto& nccl_sub = dynamic_cast<NcclCommunicator&>(*sub);
  EXPECT_EQ(nccl_sub.device(), comm_->device());
  EXPECT_EQ(nccl_sub.stream(), stream_);
  DeviceBuffer<int64_t> members(sub->size());
  DeviceBuffer<int64_t> mine(std::vector<int64_t>{me});
  sub->all_gather(mine.data(), members.data(), 1, CommType::i64);
  nccl_sub.wait();
  const std::vector<int64_t> got = members.to_host();
  for (int i = 0; i < sub->size(); ++i) EXPECT_EQ(got[i], me % 2 + 2 * i);
}

// A bad color on one rank is every rank's error (agreed over the parent
// before ncclCommSplit), and the parent stays usable: a rank that threw alone
// left the others in ncclCommSplit until the timeout aborted the parent.
TEST_F(NcclTest, ABadColorOnOneRankFailsEveryRankAlike) {
  const int P = comm_->size(), me = comm_->rank();
  try {
    (void)comm_->split(me == P - 1 ? -2 : 0, me);
    ADD_FAILURE() << "split returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "color") << e.what();
    EXPECT_NE(std::string(e.what()).find("is -2"), std::string::npos) << e.what();
  }
  DeviceBuffer<int64_t> one(std::vector<int64_t>{1});
  comm_->all_reduce_sum(one.data(), 1, CommType::i64);
  comm_->wait();
  EXPECT_EQ(one.to_host()[0], P);
}

// A bad timeout on one rank is every rank's error, before any NCCL call.
TEST_F(NcclTest, ABadTimeoutOnOneRankFailsEveryCreate) {
  NcclCommunicator::Options options;
  if (mpi_->rank() == mpi_->size() - 1) options.timeout = milliseconds(-5);
  expect_error([&] { (void)NcclCommunicator::create(*mpi_, stream_, options); }, "timeout");
}

TEST_F(NcclTest, SplitOrdersByKey) {
  const int P = comm_->size(), me = comm_->rank();
  const auto reversed = comm_->split(0, -me);
  EXPECT_EQ(reversed->size(), P);
  EXPECT_EQ(reversed->rank(), P - 1 - me);
}

// A communicator over a sub-group stays on each rank's GPU: the world's
// node-local rank picks it, not the rank's index among the group's ranks on
// the node (0 in every group of one here, which put every rank on GPU 0).
TEST_F(NcclTest, ASubGroupKeepsEachRanksGpu) {
  const auto alone = mpi_->split(mpi_->rank(), 0);
  auto& mpi_alone = dynamic_cast<MpiCommunicator&>(*alone);
  EXPECT_EQ(NcclCommunicator::gpu_conflict(mpi_alone), "");
  const auto nccl = NcclCommunicator::create(mpi_alone, stream_);
  EXPECT_EQ(nccl->device(), comm_->device());
  EXPECT_EQ(NcclCommunicator::gpu_conflict(*mpi_), "");
}

// A communicator destroyed inside an open group (an exception between
// group_start and group_end) closes NCCL's per-thread group: left open, it
// would hold back this thread's later calls on every other communicator.
TEST_F(NcclTest, DestroyingInsideAGroupClosesTheGroup) {
  {
    const auto other = NcclCommunicator::create(*mpi_, stream_);
    other->group_start();
  }
  // No group is open any more: ending one is refused.
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage);
  DeviceBuffer<int64_t> one(std::vector<int64_t>{1});
  comm_->all_reduce_sum(one.data(), 1, CommType::i64);
  comm_->wait();
  EXPECT_EQ(one.to_host()[0], comm_->size());
}

TEST_F(NcclTest, TimeoutComesFromTheEnvironmentOrTheOptions) {
  EXPECT_EQ(comm_->timeout(), comm_timeout_from_env());
  NcclOptions options;
  options.timeout = milliseconds(4321);
  const auto other = NcclCommunicator::create(*mpi_, stream_, options);
  EXPECT_EQ(other->timeout(), milliseconds(4321));
}

// abort() is local; every rank aborts here, so no peer is left waiting.
TEST_F(NcclTest, AnAbortedCommunicatorRefusesEveryCall) {
  DeviceBuffer<float> data(4);
  comm_->abort("the test gave up");
  EXPECT_TRUE(comm_->aborted());
  try {
    comm_->all_reduce_sum(data.data(), 4, CommType::f32);
    ADD_FAILURE() << "an aborted communicator accepted a call";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "nccl");
    EXPECT_NE(std::string(e.what()).find("the test gave up"), std::string::npos) << e.what();
  }
  expect_error([&] { comm_->barrier(); }, "nccl");
  expect_error([&] { comm_->wait(); }, "nccl");
}

// ---- fault handling ------------------------------------------------------------------

// Blocks a stream for `ms` milliseconds from the host (cudaLaunchHostFunc).
void CUDART_CB sleep_on_stream(void* ms) {
  std::this_thread::sleep_for(milliseconds(*static_cast<int*>(ms)));
}

// The watchdog on one rank: a stream that does not drain (here held by a
// slow host callback, as a kernel waiting for a dead peer would hold it)
// makes wait() abort and throw the timeout, and the communicator refuses
// later calls. Every rank does the same, so every rank aborts.
TEST_F(NcclTest, WaitAbortsAndThrowsWhenTheStreamDoesNotDrainInTime) {
  comm_->set_timeout(milliseconds(500));
  static int hold_ms = 1500;
  ASSERT_EQ(cudaLaunchHostFunc(stream_, sleep_on_stream, &hold_ms), cudaSuccess);
  const Clock::time_point start = Clock::now();
  std::string what;
  try {
    comm_->wait();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "nccl") << e.what();
    what = e.what();
  }
  const auto elapsed = Clock::now() - start;
  EXPECT_NE(what.find("wait timed out after 500 ms"), std::string::npos) << "got: '" << what << "'";
  EXPECT_GE(elapsed, milliseconds(500));
  // Not below 1500 ms: ncclCommAbort frees device memory, which may wait for
  // the device to go idle, i.e. for the callback (a stuck NCCL kernel would
  // have been released by the abort itself).
  EXPECT_LT(elapsed, milliseconds(1500 + 3000));
  EXPECT_TRUE(comm_->aborted());
  expect_error([&] { comm_->barrier(); }, "nccl");
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

// ---- fault handling (two ranks or more) ----------------------------------------------

constexpr milliseconds kTimeout{2000};
constexpr milliseconds kSlack{3000};

// What a survivor saw of an all-reduce of `data` and its wait for it.
struct Waited {
  std::string argument, what;  // empty when nothing threw
  bool peers_know = false;
  Clock::duration elapsed{};
};

Waited all_reduce_and_wait(NcclCommunicator& comm, DeviceBuffer<float>& data) {
  Waited w;
  const Clock::time_point start = Clock::now();
  try {
    comm.all_reduce_sum(data.data(), data.size(), CommType::f32);
    comm.wait();
  } catch (const Error& e) {
    w.argument = e.argument();
    w.what = e.what();
    w.peers_know = e.peers_know();
  }
  w.elapsed = Clock::now() - start;
  return w;
}

// The last rank fails mid-exchange (throws before the all-reduce); every
// other rank's wait() must throw the timeout within kTimeout + slack and
// abort its communicator, which also ends its stuck NCCL kernel. NCCL wants
// every active rank to call ncclCommAbort, so the victim aborts too, once the
// others have timed out (earlier, they might see its abort as a remote error
// instead of the timeout under test).
TEST_F(NcclTest, EveryOtherRankReportsAPeerThatSkipsACollective) {
  const int P = comm_->size(), me = comm_->rank();
  if (P < 2) GTEST_SKIP() << "the timeout path needs a peer that stays away: 2 ranks or more";
  comm_->set_timeout(kTimeout);
  DeviceBuffer<float> data(1024);
  ASSERT_EQ(cudaMemsetAsync(data.data(), 0, data.bytes(), stream_), cudaSuccess);
  // Connections are set up lazily by the first collective; make them now, so
  // what times out below is the stuck all-reduce kernel itself.
  comm_->barrier();
  const int victim = P - 1;
  if (me == victim) {
    expect_error([] { SS_FAIL("q", "injected fault before the all-reduce"); }, "q");
    std::this_thread::sleep_for(kTimeout + milliseconds(500));
    comm_->abort("injected fault");
  } else {
    const Waited w = all_reduce_and_wait(*comm_, data);
    EXPECT_EQ(w.argument, "nccl") << w.what;
    EXPECT_NE(w.what.find("timed out after " + std::to_string(kTimeout.count()) + " ms"),
              std::string::npos)
        << "got: '" << w.what << "'";
    EXPECT_GE(w.elapsed, kTimeout);
    EXPECT_LT(w.elapsed, kTimeout + kSlack);
    EXPECT_TRUE(comm_->aborted());
    // The abort released the stuck kernel: the stream drains.
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }
  mpi_->barrier();
  // The CUDA context stays usable for everyone.
  DeviceBuffer<float> after(std::vector<float>{1.f, 2.f});
  EXPECT_EQ(after.to_host(), (std::vector<float>{1.f, 2.f}));
}

// The last rank fails on its own and says so (notify_failure) instead of
// joining the all-reduce: every other rank's wait() must hear the notice over
// the communicator's MPI channel and throw at once, naming it and its error,
// though its timeout is 30 s, and abort (its stuck kernel ends). The victim
// aborted itself, so every rank is aborted. On one rank only the victim's
// side runs.
TEST_F(NcclTest, APeerThatFailsAndSaysSoStopsTheOthersAtOnce) {
  const int P = comm_->size(), me = comm_->rank();
  comm_->set_timeout(milliseconds(30000));
  DeviceBuffer<float> data(1024);
  ASSERT_EQ(cudaMemsetAsync(data.data(), 0, data.bytes(), stream_), cudaSuccess);
  comm_->barrier();
  const int victim = P - 1;
  if (me == victim) {
    comm_->notify_failure("statescan error [rank 7] argument 'q': injected local fault");
    EXPECT_TRUE(comm_->aborted());
    expect_error([&] { comm_->all_reduce_sum(data.data(), 1024, CommType::f32); }, "nccl");
  } else {
    const Waited w = all_reduce_and_wait(*comm_, data);
    EXPECT_EQ(w.argument, "nccl") << w.what;
    EXPECT_LT(w.elapsed, kSlack);
    EXPECT_NE(w.what.find("stopped waiting: rank " + std::to_string(victim) + " of this group of " +
                          std::to_string(P) + " failed on its own"),
              std::string::npos)
        << "got: '" << w.what << "'";
    EXPECT_NE(w.what.find("injected local fault"), std::string::npos) << w.what;
    EXPECT_TRUE(w.peers_know);
    EXPECT_TRUE(comm_->aborted());
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }
  mpi_->barrier();
}

}  // namespace
}  // namespace statescan
