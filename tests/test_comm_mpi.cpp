// Multi-rank tests of MpiCommunicator and collective_check. Every test runs on
// every rank (mpirun -np 2, 3, 4; main in mpi_gtest_main.cpp), so every rank
// makes the same collective calls in the same order. Checks before a
// collective use EXPECT, not ASSERT: a rank that returned early would leave
// the others waiting in that collective.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/collective_check.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "tests/comm_test_util.h"

namespace statescan {
namespace {

using namespace statescan::test;  // NOLINT: shared comm test helpers

// ---- collectives, per element type and piece size ---------------------------------

// kWhole: every message in one MPI call. 3: pieces of 3 elements, so the
// piecewise path that counts above INT_MAX take is exercised with small buffers.
constexpr std::size_t kWhole = 0;

struct Case {
  CommType type;
  std::size_t max_piece;
};

// Readable parameter in failure messages (instead of gtest's byte dump).
void PrintTo(const Case& c, std::ostream* os) {
  *os << type_name(c.type) << ", max piece "
      << (c.max_piece == kWhole ? std::string("whole") : std::to_string(c.max_piece));
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return type_name(info.param.type) + (info.param.max_piece == kWhole
                                           ? std::string("_whole")
                                           : "_pieces" + std::to_string(info.param.max_piece));
}

class MpiCollective : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    comm_ = MpiCommunicator::world();
    if (GetParam().max_piece != kWhole) comm_->set_max_piece_elements(GetParam().max_piece);
  }
  CommType type() const { return GetParam().type; }
  std::size_t elem() const { return size_of(type()); }

  std::unique_ptr<MpiCommunicator> comm_;
  const std::size_t count_ = 11;  // not a multiple of the piece size
};

TEST_P(MpiCollective, AllGatherCollectsEveryRanksData) {
  const int P = comm_->size();
  const Bytes send = contribution(comm_->rank(), count_, type());
  Bytes recv(P * count_ * elem(), 0);
  comm_->all_gather(send.data(), recv.data(), count_, type());
  for (int r = 0; r < P; ++r) {
    const Bytes slot(recv.begin() + r * count_ * elem(), recv.begin() + (r + 1) * count_ * elem());
    EXPECT_EQ(
        mismatches(slot, count_, type(), [&](std::size_t i) { return value_of(r, i, type()); }), 0u)
        << "slot of rank " << r;
  }
}

TEST_P(MpiCollective, AllGatherInPlace) {
  const int P = comm_->size(), me = comm_->rank();
  Bytes data(P * count_ * elem(), 0);
  const Bytes mine = contribution(me, count_, type());
  std::copy(mine.begin(), mine.end(), data.begin() + me * count_ * elem());
  comm_->all_gather(data.data() + me * count_ * elem(), data.data(), count_, type());
  for (int r = 0; r < P; ++r) {
    const Bytes slot(data.begin() + r * count_ * elem(), data.begin() + (r + 1) * count_ * elem());
    EXPECT_EQ(
        mismatches(slot, count_, type(), [&](std::size_t i) { return value_of(r, i, type()); }), 0u)
        << "slot of rank " << r;
  }
}

TEST_P(MpiCollective, AllReduceSumAddsOverRanksOrRejectsBytes) {
  const int P = comm_->size();
  Bytes data = contribution(comm_->rank(), count_, type());
  if (type() == CommType::u8) {
    // Rejected locally on every rank, before any communication.
    expect_error([&] { comm_->all_reduce_sum(data.data(), count_, type()); }, "type");
    return;
  }
  comm_->all_reduce_sum(data.data(), count_, type());
  EXPECT_EQ(mismatches(data, count_, type(),
                       [&](std::size_t i) {
                         double sum = 0;
                         for (int r = 0; r < P; ++r) sum += value_of(r, i, type());
                         return sum;
                       }),
            0u);
}

TEST_P(MpiCollective, AllReduceMaxTakesTheLargest) {
  const int P = comm_->size();
  Bytes data = contribution(comm_->rank(), count_, type());
  comm_->all_reduce_max(data.data(), count_, type());
  EXPECT_EQ(mismatches(data, count_, type(),
                       [&](std::size_t i) {
                         double best = value_of(0, i, type());
                         for (int r = 1; r < P; ++r) best = std::max(best, value_of(r, i, type()));
                         return best;
                       }),
            0u);
}

TEST_P(MpiCollective, BroadcastFromTheLastRank) {
  const int root = comm_->size() - 1;
  Bytes data = contribution(comm_->rank(), count_, type());
  comm_->broadcast(data.data(), count_, type(), root);
  EXPECT_EQ(
      mismatches(data, count_, type(), [&](std::size_t i) { return value_of(root, i, type()); }),
      0u);
}

TEST_P(MpiCollective, SendRecvShiftsRightWithOpenEnds) {
  const int P = comm_->size(), me = comm_->rank();
  const Bytes send = contribution(me, count_, type());
  const Bytes untouched = contribution(P + 7, count_, type());
  Bytes recv = untouched;
  comm_->send_recv(send.data(), count_, me + 1 < P ? me + 1 : -1, recv.data(), count_,
                   me > 0 ? me - 1 : -1, type(), 5);
  if (me == 0) {
    EXPECT_EQ(recv, untouched);
  } else {
    EXPECT_EQ(mismatches(recv, count_, type(),
                         [&](std::size_t i) { return value_of(me - 1, i, type()); }),
              0u);
  }
}

TEST_P(MpiCollective, SendRecvInPlaceRotates) {
  const int P = comm_->size(), me = comm_->rank();
  Bytes data = contribution(me, count_, type());
  comm_->send_recv(data.data(), count_, (me + 1) % P, data.data(), count_, (me + P - 1) % P, type(),
                   6);
  const int from = (me + P - 1) % P;
  EXPECT_EQ(
      mismatches(data, count_, type(), [&](std::size_t i) { return value_of(from, i, type()); }),
      0u);
}

TEST_P(MpiCollective, SendRecvRing) {
  const int P = comm_->size(), me = comm_->rank();
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  const Bytes send = contribution(me, count_, type());
  Bytes recv(send.size(), 0);
  // Even ranks send first and odd ranks receive first, so blocking sends
  // complete for any ring length.
  if (me % 2 == 0) {
    comm_->send(send.data(), count_, type(), next, 9);
    comm_->recv(recv.data(), count_, type(), prev, 9);
  } else {
    comm_->recv(recv.data(), count_, type(), prev, 9);
    comm_->send(send.data(), count_, type(), next, 9);
  }
  EXPECT_EQ(
      mismatches(recv, count_, type(), [&](std::size_t i) { return value_of(prev, i, type()); }),
      0u);
}

INSTANTIATE_TEST_SUITE_P(TypesAndPieces, MpiCollective,
                         ::testing::Values(Case{CommType::f32, kWhole}, Case{CommType::f64, kWhole},
                                           Case{CommType::i64, kWhole}, Case{CommType::u8, kWhole},
                                           Case{CommType::f32, 3}, Case{CommType::f64, 3},
                                           Case{CommType::i64, 3}, Case{CommType::u8, 3}),
                         case_name);

// ---- shape, point-to-point details, large messages ----------------------------------

class Mpi : public ::testing::Test {
 protected:
  void SetUp() override { comm_ = MpiCommunicator::world(); }
  std::unique_ptr<MpiCommunicator> comm_;
};

TEST_F(Mpi, MatchesTheWorldCommunicator) {
  int world_rank = -1, world_size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  EXPECT_EQ(comm_->rank(), world_rank);
  EXPECT_EQ(comm_->size(), world_size);
  EXPECT_STREQ(comm_->backend(), "mpi");
  EXPECT_EQ(error_rank(), world_rank);
  int same = MPI_UNEQUAL;
  MPI_Comm_compare(comm_->native(), MPI_COMM_WORLD, &same);
  EXPECT_EQ(same, MPI_CONGRUENT) << "must be a duplicate, not MPI_COMM_WORLD itself";
}

TEST_F(Mpi, EnvironmentLeavesAnInitialisedMpiAlone) {
  {
    MpiEnvironment env;
    EXPECT_FALSE(env.initialised_here());
  }
  int finalised = 1;
  MPI_Finalized(&finalised);
  EXPECT_EQ(finalised, 0);
  comm_->barrier();
}

TEST_F(Mpi, NodeLocalRanksCoverEveryRankOnce) {
  // Node-agnostic check: each node's local rank 0 reports its node's size;
  // those sizes add up to the whole group.
  EXPECT_GE(comm_->local_rank(), 0);
  EXPECT_LT(comm_->local_rank(), comm_->local_size());
  int64_t leaders_total = comm_->local_rank() == 0 ? comm_->local_size() : 0;
  comm_->all_reduce_sum(&leaders_total, 1, CommType::i64);
  EXPECT_EQ(leaders_total, comm_->size());
  EXPECT_EQ(local_rank(), comm_->local_rank());
  EXPECT_EQ(local_size(), comm_->local_size());
}

// GPUs are picked by the world's node-local rank (NcclCommunicator::
// device_for): a sub-group numbers its node-local ranks from 0 again, the
// world's stays what it was.
TEST_F(Mpi, TheWorldsNodeLocalRankOutlivesASplit) {
  const auto sub = comm_->split(comm_->rank() / 2, comm_->rank());
  const auto& pair = dynamic_cast<const MpiCommunicator&>(*sub);
  EXPECT_EQ(local_rank(), comm_->local_rank());
  EXPECT_EQ(local_size(), comm_->local_size());
  // On one host (CI) the pairs' node-local ranks are 0 and 1, while the
  // world's node-local rank (the GPU choice's) stays the world rank: ranks 2
  // and 3 would otherwise take ranks 0's and 1's GPUs.
  if (comm_->local_size() == comm_->size()) {
    EXPECT_EQ(pair.local_rank(), comm_->rank() % 2);
    EXPECT_EQ(local_rank(), comm_->rank());
    EXPECT_EQ(local_size(), comm_->size());
  }
}

// shared_device, the identity check behind NcclCommunicator::create, with
// made-up device names: distinct ones are not shared, an empty one claims
// nothing, and one device of one host claimed twice names both ranks.
TEST_F(Mpi, SharedDeviceNamesTwoRanksOnOneDeviceOfAHost) {
  const int P = comm_->size(), me = comm_->rank();
  EXPECT_EQ(shared_device(*comm_, "dev-" + std::to_string(me)), "");
  EXPECT_EQ(shared_device(*comm_, ""), "");
  // Every rank sees the same local size, so every rank takes this branch or
  // none does.
  if (comm_->local_size() == P) {
    const std::string text =
        shared_device(*comm_, me == P - 1 ? "dev-0" : "dev-" + std::to_string(me));
    EXPECT_NE(text.find("ranks 0 and " + std::to_string(P - 1) + " would both use dev-0 on host "),
              std::string::npos)
        << text;
  }
}

TEST_F(Mpi, MessagesWithOneTagArriveInOrder) {
  const int P = comm_->size(), me = comm_->rank();
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  const int64_t first = 100 * me + 1, second = 100 * me + 2;
  int64_t got_first = 0, got_second = 0;
  if (me % 2 == 0) {
    comm_->send(&first, 1, CommType::i64, next, 4);
    comm_->send(&second, 1, CommType::i64, next, 4);
    comm_->recv(&got_first, 1, CommType::i64, prev, 4);
    comm_->recv(&got_second, 1, CommType::i64, prev, 4);
  } else {
    comm_->recv(&got_first, 1, CommType::i64, prev, 4);
    comm_->recv(&got_second, 1, CommType::i64, prev, 4);
    comm_->send(&first, 1, CommType::i64, next, 4);
    comm_->send(&second, 1, CommType::i64, next, 4);
  }
  EXPECT_EQ(got_first, 100 * prev + 1);
  EXPECT_EQ(got_second, 100 * prev + 2);
}

// 4 MiB each way between partners (0,1), (2,3), ...: both sides send at once,
// far above any eager limit, so a naive send-then-receive would deadlock.
TEST_F(Mpi, LargeSendRecvInBothDirectionsAtOnce) {
  const int P = comm_->size(), me = comm_->rank();
  const int partner = (me % 2 == 0) ? (me + 1 < P ? me + 1 : -1) : me - 1;
  const std::size_t count = (4u << 20) / sizeof(float);
  std::vector<float> send(count), recv(count, -1.f);
  for (std::size_t i = 0; i < count; ++i) send[i] = static_cast<float>(me * 1000003 + i % 4096);
  comm_->send_recv(send.data(), count, partner, recv.data(), count, partner, CommType::f32, 2);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const float expected = partner < 0 ? -1.f : static_cast<float>(partner * 1000003 + i % 4096);
    wrong += recv[i] != expected;
  }
  EXPECT_EQ(wrong, 0u);
}

// Every rank sends 4 MiB right and receives 4 MiB from the left at the same
// time; the ends are open (-1).
TEST_F(Mpi, LargeShiftWithOpenEnds) {
  const int P = comm_->size(), me = comm_->rank();
  const std::size_t count = (4u << 20) / sizeof(double);
  std::vector<double> send(count), recv(count, -1.0);
  for (std::size_t i = 0; i < count; ++i) send[i] = me + 0.25 * static_cast<double>(i);
  comm_->send_recv(send.data(), count, me + 1 < P ? me + 1 : -1, recv.data(), count,
                   me > 0 ? me - 1 : -1, CommType::f64, 8);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const double expected = me == 0 ? -1.0 : (me - 1) + 0.25 * static_cast<double>(i);
    wrong += recv[i] != expected;
  }
  EXPECT_EQ(wrong, 0u);
}

// A receive naming a different count than was sent throws on the receiver
// (shorter: "count"; longer than the buffer: also "count", not a bare MPI code).
TEST_F(Mpi, RecvCountMismatchThrowsOnTheReceiver) {
  const int me = comm_->rank();
  std::vector<float> buf(8, 1.f);
  if (me == 0) {
    comm_->send(buf.data(), 4, CommType::f32, 1, 11);
    comm_->send(buf.data(), 8, CommType::f32, 1, 12);
  } else if (me == 1) {
    expect_error([&] { comm_->recv(buf.data(), 8, CommType::f32, 0, 11); }, "count");
    expect_error([&] { comm_->recv(buf.data(), 4, CommType::f32, 0, 12); }, "count");
  }
  comm_->barrier();
}

// The same across pieces (4-element pieces): a receive of fewer or more
// whole pieces than were sent throws on the receiver at once. Before the
// trailing piece, receiving 4 of 8 elements succeeded with the rest unread,
// and 8 of 4 waited for the timeout. send_recv splits the same way.
TEST_F(Mpi, RecvCountMismatchAcrossPiecesThrowsOnTheReceiver) {
  const int me = comm_->rank();
  comm_->set_max_piece_elements(4);
  std::vector<float> buf(12, 1.f);
  if (me == 0) {
    comm_->send(buf.data(), 8, CommType::f32, 1, 21);
    comm_->send(buf.data(), 4, CommType::f32, 1, 22);
    comm_->send(buf.data(), 8, CommType::f32, 1, 23);  // as many pieces as 11, not 12
    comm_->send_recv(buf.data(), 8, 1, nullptr, 0, -1, CommType::f32, 24);
  } else if (me == 1) {
    expect_error([&] { comm_->recv(buf.data(), 4, CommType::f32, 0, 21); }, "count");
    expect_error([&] { comm_->recv(buf.data(), 8, CommType::f32, 0, 22); }, "count");
    expect_error([&] { comm_->recv(buf.data(), 11, CommType::f32, 0, 23); }, "count");
    expect_error([&] { comm_->send_recv(nullptr, 0, -1, buf.data(), 4, 0, CommType::f32, 24); },
                 "recv_count");
    // The longer sends' trailing empty pieces, left unmatched by the errors
    // (a message still queued at MPI_Finalize is erroneous).
    comm_->recv(buf.data(), 0, CommType::f32, 0, 21);
    comm_->recv(buf.data(), 0, CommType::f32, 0, 24);
  }
  comm_->barrier();
}

// A message of a whole number of pieces (8 elements in pieces of 4: two full
// and the trailing empty one) arrives whole, by recv and by send_recv.
TEST_F(Mpi, WholePiecesArriveWhole) {
  const int me = comm_->rank();
  comm_->set_max_piece_elements(4);
  std::vector<float> buf(8);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(i) + 0.5f;
  std::vector<float> got(8, -1.f), got2(8, -1.f);
  if (me == 0) {
    comm_->send(buf.data(), 8, CommType::f32, 1, 31);
    comm_->send_recv(buf.data(), 8, 1, nullptr, 0, -1, CommType::f32, 32);
  } else if (me == 1) {
    comm_->recv(got.data(), 8, CommType::f32, 0, 31);
    comm_->send_recv(nullptr, 0, -1, got2.data(), 8, 0, CommType::f32, 32);
    EXPECT_EQ(got, buf);
    EXPECT_EQ(got2, buf);
  }
  comm_->barrier();
}

TEST_F(Mpi, BadPeersRootsAndTagsThrowBeforeCommunicating) {
  const int P = comm_->size(), me = comm_->rank();
  float x = 0.f;
  expect_error([&] { comm_->send(&x, 1, CommType::f32, P, 0); }, "peer");
  expect_error([&] { comm_->recv(&x, 1, CommType::f32, -2, 0); }, "peer");
  expect_error([&] { comm_->send(&x, 1, CommType::f32, me, 0); }, "peer");
  // send_recv names the half at fault.
  float y = 0.f;
  expect_error([&] { comm_->send_recv(&x, 1, P, &y, 1, -1, CommType::f32, 0); }, "dest");
  expect_error([&] { comm_->send_recv(&x, 1, -1, &y, 1, -2, CommType::f32, 0); }, "source");
  expect_error([&] { comm_->send_recv(&x, 1, (me + 1) % P, &y, 1, P, CommType::f32, 0); },
               "source");
  expect_error([&] { comm_->send(&x, 1, CommType::f32, (me + 1) % P, -1); }, "tag");
  expect_error([&] { comm_->broadcast(&x, 1, CommType::f32, P); }, "root");
  expect_error([&] { comm_->set_max_piece_elements(0); }, "elements");
  expect_error([&] { comm_->split(-1, 0); }, "color");
  comm_->barrier();
}

// MPI failures come back as codes on the library's communicator (not an abort)
// and SS_MPI_CHECK turns them into an Error naming the call and MPI's reason.
TEST_F(Mpi, MpiFailuresBecomeErrorsNamingTheCall) {
  float x = 0.f;
  char reason[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(MPI_ERR_COUNT, reason, &length);
  try {
    SS_MPI_CHECK(MPI_Send(&x, -1, MPI_FLOAT, 0, 0, comm_->native()));
    ADD_FAILURE() << "a negative count was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.argument(), "mpi");
    EXPECT_NE(what.find("MPI_Send"), std::string::npos) << what;
    EXPECT_NE(what.find(std::string(reason, length)), std::string::npos) << what;
  }
  comm_->barrier();
}

// ---- sub-groups ---------------------------------------------------------------------

TEST_F(Mpi, SplitIntoEvenAndOddGroups) {
  const int P = comm_->size(), me = comm_->rank();
  const auto sub = comm_->split(me % 2, me);
  const int expected_size = me % 2 == 0 ? (P + 1) / 2 : P / 2;
  EXPECT_EQ(sub->size(), expected_size);
  EXPECT_EQ(sub->rank(), me / 2);
  EXPECT_STREQ(sub->backend(), "mpi");
  int64_t sum = me;
  sub->all_reduce_sum(&sum, 1, CommType::i64);
  int64_t expected_sum = 0;
  for (int r = me % 2; r < P; r += 2) expected_sum += r;
  EXPECT_EQ(sum, expected_sum);
  // The sub-group's traffic stays in it: gather world ranks in group order.
  std::vector<int64_t> members(sub->size(), -1);
  const int64_t mine = me;
  sub->all_gather(&mine, members.data(), 1, CommType::i64);
  for (int i = 0; i < sub->size(); ++i) EXPECT_EQ(members[i], me % 2 + 2 * i);
}

TEST_F(Mpi, SplitOrdersByKey) {
  const int P = comm_->size(), me = comm_->rank();
  const auto reversed = comm_->split(0, -me);
  EXPECT_EQ(reversed->size(), P);
  EXPECT_EQ(reversed->rank(), P - 1 - me);
}

// ---- collective_check ---------------------------------------------------------------

// Runs collective_check with a check that fails on `failing` ranks with the
// given arguments; returns what this rank caught (empty argument: nothing).
struct Caught {
  bool threw = false;
  std::string argument, what;
  int rank = -2;
};

Caught run_collective_check(Communicator& comm, const std::function<void()>& check) {
  Caught c;
  try {
    collective_check(comm, check);
  } catch (const Error& e) {
    c.threw = true;
    c.argument = e.argument();
    c.what = e.what();
    c.rank = e.rank();
  }
  return c;
}

TEST_F(Mpi, CollectiveCheckPassesWhenEveryRankPasses) {
  int ran = 0;
  const Caught c = run_collective_check(*comm_, [&] { ++ran; });
  EXPECT_FALSE(c.threw) << c.what;
  EXPECT_EQ(ran, 1);
  comm_->barrier();
}

TEST_F(Mpi, CollectiveCheckFailureOnRankOneReachesEveryRank) {
  const Caught c = run_collective_check(*comm_, [&] {
    if (comm_->rank() == 1) SS_FAIL("q", "has a NaN at token ", 17);
  });
  EXPECT_TRUE(c.threw);
  EXPECT_EQ(c.argument, "q");
  EXPECT_EQ(c.rank, 1);
  EXPECT_NE(c.what.find("[rank 1]"), std::string::npos) << c.what;
  EXPECT_NE(c.what.find("has a NaN at token 17"), std::string::npos) << c.what;
  comm_->barrier();  // nobody is stuck in a collective
}

TEST_F(Mpi, CollectiveCheckFailureOnTheLastRankReachesEveryRank) {
  const int last = comm_->size() - 1;
  const Caught c = run_collective_check(*comm_, [&] {
    if (comm_->rank() == last) SS_FAIL("q", "shard length differs");
  });
  EXPECT_TRUE(c.threw);
  EXPECT_EQ(c.argument, "q");
  EXPECT_EQ(c.rank, last);
  EXPECT_NE(c.what.find("[rank " + std::to_string(last) + "]"), std::string::npos) << c.what;
  comm_->barrier();
}

TEST_F(Mpi, CollectiveCheckReportsTheLowestFailingRank) {
  const int P = comm_->size(), me = comm_->rank();
  // Ranks P-2 and P-1 fail with different arguments (ranks 0 and 1 when P = 2).
  const Caught c = run_collective_check(*comm_, [&] {
    if (me == P - 1) SS_FAIL("late", "second fault");
    if (me == P - 2) SS_FAIL("early", "first fault");
  });
  EXPECT_TRUE(c.threw);
  EXPECT_EQ(c.argument, "early");
  EXPECT_EQ(c.rank, P - 2);
  EXPECT_NE(c.what.find("first fault"), std::string::npos) << c.what;
  comm_->barrier();
}

TEST_F(Mpi, CollectiveCheckTurnsOtherExceptionsIntoUnknown) {
  const Caught c = run_collective_check(*comm_, [&] {
    if (comm_->rank() == 1) throw std::runtime_error("disk full");
  });
  EXPECT_TRUE(c.threw);
  EXPECT_EQ(c.argument, "unknown");
  EXPECT_EQ(c.rank, 1);
  EXPECT_NE(c.what.find("disk full"), std::string::npos) << c.what;
  comm_->barrier();
}

// In a sub-group the reported rank is the failing process's world rank (the
// one its message names), not its index in the sub-group.
TEST_F(Mpi, CollectiveCheckInASubGroupReportsTheWorldRank) {
  const int P = comm_->size(), me = comm_->rank();
  const auto odd_even = comm_->split(me % 2, me);
  const int failing_world = P - 1;
  const Caught c = run_collective_check(*odd_even, [&] {
    if (me == failing_world) SS_FAIL("beta", "out of range");
  });
  const bool my_group_failed = me % 2 == failing_world % 2;
  EXPECT_EQ(c.threw, my_group_failed);
  if (my_group_failed) {
    EXPECT_EQ(c.argument, "beta");
    EXPECT_EQ(c.rank, failing_world);
  }
  comm_->barrier();
}

}  // namespace
}  // namespace statescan
