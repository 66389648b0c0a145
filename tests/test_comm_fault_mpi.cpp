// Fault handling of MpiCommunicator: a rank that fails mid-exchange (throws
// before a collective, or never sends) must turn into a statescan::Error that
// names the timeout on every rank waiting for it, within the timeout plus a
// little slack, instead of a hang. Runs under mpirun -np 2, 3, 4 (main in
// mpi_gtest_main.cpp).
//
// Each fault happens on a communicator of its own ("doomed"), split from the
// world: after a timeout it is unusable. Once every survivor has timed out,
// the victim posts the matching call late, so the operations the survivors
// left posted complete and nothing is pending when MPI finalises. The world
// communicator only coordinates, with a generous timeout of its own so a bug
// here fails the test instead of hanging CI.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "comm/collective_check.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "tests/scoped_env.h"

namespace statescan {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kTimeout{1000};
// Oversubscribed CI (4 ranks on 2 cores) delays a rank's polling a little.
constexpr milliseconds kSlack{2500};
constexpr milliseconds kCoordinationTimeout{30000};

std::unique_ptr<MpiCommunicator> coordinator() {
  auto world = MpiCommunicator::world();
  world->set_timeout(kCoordinationTimeout);
  return world;
}

// What one rank saw of a call.
struct Outcome {
  bool threw = false;
  bool peers_know = false;
  std::string argument, what;
  milliseconds elapsed{0};
};

template <typename F>
Outcome timed(F&& call) {
  Outcome o;
  const Clock::time_point start = Clock::now();
  try {
    call();
  } catch (const Error& e) {
    o.threw = true;
    o.peers_know = e.peers_know();
    o.argument = e.argument();
    o.what = e.what();
  }
  o.elapsed = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  return o;
}

// Expects `o` to be the timeout error of operation `op` after kTimeout.
void expect_timeout(const Outcome& o, const std::string& op) {
  ASSERT_TRUE(o.threw) << op << " returned after " << o.elapsed.count() << " ms";
  EXPECT_EQ(o.argument, "mpi") << o.what;
  const std::string expected =
      "timed out after " + std::to_string(kTimeout.count()) + " ms in " + op;
  EXPECT_NE(o.what.find(expected), std::string::npos) << o.what;
  EXPECT_GE(o.elapsed, kTimeout);
  EXPECT_LT(o.elapsed, kTimeout + kSlack);
}

// ---- a victim skips a collective ----------------------------------------------------

enum class Op { all_gather, all_reduce_sum, all_reduce_max, broadcast, barrier, split };
enum class Victim { first, last };

const char* op_name(Op op) {
  switch (op) {
    case Op::all_gather:
      return "all_gather";
    case Op::all_reduce_sum:
      return "all_reduce_sum";
    case Op::all_reduce_max:
      return "all_reduce_max";
    case Op::broadcast:
      return "broadcast";
    case Op::barrier:
      return "barrier";
    case Op::split:
      return "split";
  }
  return "?";
}

struct Fault {
  Op op;
  Victim victim;
};

void PrintTo(const Fault& f, std::ostream* os) {
  *os << op_name(f.op) << ", victim " << (f.victim == Victim::first ? "first" : "last");
}

std::string fault_name(const ::testing::TestParamInfo<Fault>& info) {
  return std::string(op_name(info.param.op)) +
         (info.param.victim == Victim::first ? "_FirstRankFails" : "_LastRankFails");
}

// Buffers of one collective; they outlive the test body's late completion
// (a stranded operation writes into them when the victim finally joins).
struct Buffers {
  std::vector<int64_t> send = std::vector<int64_t>(4, 1);
  std::vector<int64_t> recv;
};

// Runs `op` on `comm`. Broadcast's root is rank 0, and only the first rank is
// a victim of it: the survivors wait for a root that never sends. (A missing
// receiver of a broadcast stalls nobody who could notice: the root's send
// completes without it.)
void run(Op op, Communicator& comm, Buffers& b) {
  switch (op) {
    case Op::all_gather:
      b.recv.assign(b.send.size() * comm.size(), 0);
      comm.all_gather(b.send.data(), b.recv.data(), b.send.size(), CommType::i64);
      return;
    case Op::all_reduce_sum:
      comm.all_reduce_sum(b.send.data(), b.send.size(), CommType::i64);
      return;
    case Op::all_reduce_max:
      comm.all_reduce_max(b.send.data(), b.send.size(), CommType::i64);
      return;
    case Op::broadcast:
      comm.broadcast(b.send.data(), b.send.size(), CommType::i64, 0);
      return;
    case Op::barrier:
      comm.barrier();
      return;
    case Op::split:
      (void)comm.split(0, comm.rank());
      return;
  }
}

class MpiFault : public ::testing::TestWithParam<Fault> {};

TEST_P(MpiFault, EveryOtherRankReportsTheTimeoutInTime) {
  const Fault fault = GetParam();
  const auto world = coordinator();
  const auto doomed = world->split(0, world->rank());
  doomed->set_timeout(kTimeout);
  const int victim = fault.victim == Victim::first ? 0 : doomed->size() - 1;
  const bool is_victim = doomed->rank() == victim;

  Buffers buffers;
  Outcome outcome;
  if (is_victim) {
    // Fails mid-exchange: throws before it joins the collective.
    outcome = timed([] { SS_FAIL("q", "injected fault before the collective"); });
    EXPECT_EQ(outcome.argument, "q");
  } else {
    outcome = timed([&] { run(fault.op, *doomed, buffers); });
    expect_timeout(outcome, op_name(fault.op));
    if (fault.op == Op::broadcast && victim == 0) {
      EXPECT_NE(outcome.what.find("(peer 0)"), std::string::npos) << outcome.what;
    }
    // After a timeout the communicator refuses every call at once.
    const Outcome refused =
        timed([&] { doomed->all_reduce_max(buffers.send.data(), 1, CommType::i64); });
    EXPECT_TRUE(refused.threw);
    EXPECT_NE(refused.what.find("unusable"), std::string::npos) << refused.what;
    EXPECT_LT(refused.elapsed, kTimeout);
  }

  world->barrier();  // every survivor has timed out
  if (is_victim) {
    // The late matching call completes what the survivors left posted
    // (split's timed all-gather of every rank's call, color and key is the
    // part they were waiting in; a late split would go on into
    // MPI_Comm_split, which they never join).
    Buffers late;
    if (fault.op == Op::split) {
      std::vector<int64_t> calls(3 * static_cast<std::size_t>(doomed->size()));
      doomed->all_gather(calls.data() + 3 * doomed->rank(), calls.data(), 3, CommType::i64);
    } else {
      run(fault.op, *doomed, late);
    }
  }
  world->barrier();
}

INSTANTIATE_TEST_SUITE_P(
    Collectives, MpiFault,
    ::testing::Values(Fault{Op::all_gather, Victim::last}, Fault{Op::all_reduce_sum, Victim::last},
                      Fault{Op::all_reduce_sum, Victim::first},
                      Fault{Op::all_reduce_max, Victim::last}, Fault{Op::broadcast, Victim::first},
                      Fault{Op::barrier, Victim::last}, Fault{Op::split, Victim::last}),
    fault_name);

// ---- split's agreement ----------------------------------------------------------------

// split gathers every rank's (call, color, key) before MPI_Comm_split, which
// cannot time out. Where it began with a barrier, a peer's barrier() matched
// it and the splitting ranks then waited in MPI_Comm_split for ever. Another
// kind of collective (a barrier) against that gather is an erroneous MPI
// program whose outcome is MPI's (here OpenMPI truncates the messages, fatal
// on MPI_COMM_WORLD's handler); a peer in an all-gather of the same shape is
// well defined, and every splitting rank must name it at once.
TEST(MpiSplit, APeerInAnotherCollectiveCallIsNamedAtOnce) {
  const auto world = coordinator();
  const auto comm = world->split(0, world->rank());
  comm->set_timeout(kTimeout);
  const int other = comm->size() - 1;
  if (comm->rank() == other) {
    std::vector<int64_t> values(3 * static_cast<std::size_t>(comm->size()), 7);
    const Outcome o = timed(
        [&] { comm->all_gather(values.data() + 3 * other, values.data(), 3, CommType::i64); });
    EXPECT_FALSE(o.threw) << o.what;
  } else {
    const Outcome o = timed([&] { (void)comm->split(0, comm->rank()); });
    ASSERT_TRUE(o.threw) << "split returned after " << o.elapsed.count() << " ms";
    EXPECT_EQ(o.argument, "split") << o.what;
    EXPECT_NE(o.what.find("rank " + std::to_string(other) + " made another collective call"),
              std::string::npos)
        << o.what;
    EXPECT_LT(o.elapsed, kTimeout);
  }
  world->barrier();
}

// A bad color on one rank is the same error on every rank, at once (it was
// thrown by that rank alone, and the others waited out the timeout).
TEST(MpiSplit, ABadColorOnOneRankFailsEveryRankAlike) {
  const auto world = coordinator();
  const auto comm = world->split(0, world->rank());
  comm->set_timeout(kTimeout);
  const int bad = comm->size() - 1;
  const Outcome o = timed([&] { (void)comm->split(comm->rank() == bad ? -2 : 0, comm->rank()); });
  ASSERT_TRUE(o.threw) << "split returned after " << o.elapsed.count() << " ms";
  EXPECT_EQ(o.argument, "color") << o.what;
  EXPECT_NE(o.what.find("is -2 on rank " + std::to_string(bad)), std::string::npos) << o.what;
  EXPECT_LT(o.elapsed, kTimeout);
  // The gather completed on every rank: the communicator is still usable.
  int64_t one = 1;
  comm->all_reduce_sum(&one, 1, CommType::i64);
  EXPECT_EQ(one, comm->size());
  world->barrier();
}

// ---- point to point -----------------------------------------------------------------

class MpiPointToPointFault : public ::testing::Test {
 protected:
  void SetUp() override {
    world_ = coordinator();
    doomed_ = world_->split(0, world_->rank());
    doomed_->set_timeout(kTimeout);
    victim_ = doomed_->size() - 1;
  }
  std::unique_ptr<MpiCommunicator> world_;
  std::unique_ptr<Communicator> doomed_;
  int victim_ = 0;
};

// Every survivor waits for a message the victim never sends; each names the
// victim. The receives are withdrawn on timeout, so nothing is left posted.
TEST_F(MpiPointToPointFault, ReceiversOfAMissingMessageNameThePeer) {
  int64_t value = -1;
  if (doomed_->rank() != victim_) {
    const Outcome o = timed([&] { doomed_->recv(&value, 1, CommType::i64, victim_, 3); });
    expect_timeout(o, "recv");
    EXPECT_NE(o.what.find("(peer " + std::to_string(victim_) + ")"), std::string::npos) << o.what;
    EXPECT_EQ(value, -1) << "a withdrawn receive must not be written";
  }
  world_->barrier();
}

// A send far above any eager limit cannot complete without the receiver; the
// victim receives late so the sends left posted complete.
TEST_F(MpiPointToPointFault, SendersToAMissingReceiverNameThePeer) {
  const std::size_t count = (4u << 20) / sizeof(float);
  std::vector<float> payload(count, 1.f);
  if (doomed_->rank() != victim_) {
    const Outcome o =
        timed([&] { doomed_->send(payload.data(), count, CommType::f32, victim_, 4); });
    expect_timeout(o, "send");
    EXPECT_NE(o.what.find("(peer " + std::to_string(victim_) + ")"), std::string::npos) << o.what;
  }
  world_->barrier();
  if (doomed_->rank() == victim_) {
    std::vector<float> sink(count);
    for (int r = 0; r < doomed_->size(); ++r) {
      if (r != victim_) doomed_->recv(sink.data(), count, CommType::f32, r, 4);
    }
  }
  world_->barrier();
}

// A ring hand-off (the CP "ring" exchange) in which the victim skips its
// send_recv: its successor times out naming it, every other rank completes.
TEST_F(MpiPointToPointFault, RingHandOffSuccessorOfTheVictimTimesOut) {
  const int P = doomed_->size(), me = doomed_->rank();
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  const int64_t mine = me;
  int64_t got = -1;
  if (me != victim_) {
    const Outcome o =
        timed([&] { doomed_->send_recv(&mine, 1, next, &got, 1, prev, CommType::i64, 7); });
    if (prev == victim_) {
      expect_timeout(o, "send_recv");
      EXPECT_NE(o.what.find("(peer " + std::to_string(victim_) + ")"), std::string::npos) << o.what;
    } else {
      EXPECT_FALSE(o.threw) << o.what;
      EXPECT_EQ(got, prev);
    }
  }
  world_->barrier();
  if (me == victim_) {
    // Late: the predecessor's message is waiting; the successor withdrew its
    // receive, so the small message to it is simply never matched.
    doomed_->send_recv(&mine, 1, next, &got, 1, prev, CommType::i64, 7);
    EXPECT_EQ(got, prev);
  }
  world_->barrier();
}

// ---- a victim fails on its own and says so --------------------------------------------

// What the victim's notice says: the text of its own error.
constexpr char kVictimError[] = "statescan error [rank 7] argument 'q': injected local fault";

// Expects `o` to be a survivor's error on the victim's notice in `op`, long
// before the (coordination-sized) timeout.
void expect_notice(const Outcome& o, const std::string& op, int victim, int size) {
  ASSERT_TRUE(o.threw) << op << " returned after " << o.elapsed.count() << " ms";
  EXPECT_EQ(o.argument, "mpi") << o.what;
  EXPECT_TRUE(o.peers_know) << "a notice is every rank's news: nothing to tell again";
  EXPECT_NE(o.what.find(" in " + op + " stopped waiting: rank " + std::to_string(victim) +
                        " of this group of " + std::to_string(size) + " failed on its own"),
            std::string::npos)
      << o.what;
  EXPECT_NE(o.what.find(std::string("Its error: ") + kVictimError), std::string::npos) << o.what;
  EXPECT_LT(o.elapsed, kSlack);
}

MPI_Comm native_of(const Communicator& comm) {
  return dynamic_cast<const MpiCommunicator&>(comm).native();
}

// The operation a survivor left posted, matched by the victim straight on
// MPI (its communicator refuses calls after its notice), so that nothing is
// pending when MPI finalises. The same non-blocking calls the survivors'
// MpiCommunicator posted (blocking ones would not match them).
void match_late(Op op, MPI_Comm comm, int size) {
  std::vector<int64_t> send(4, 1), recv(4 * static_cast<std::size_t>(size), 0);
  MPI_Request request = MPI_REQUEST_NULL;
  switch (op) {
    case Op::all_gather:
      MPI_Iallgather(send.data(), 4, MPI_INT64_T, recv.data(), 4, MPI_INT64_T, comm, &request);
      break;
    case Op::all_reduce_sum:
      MPI_Iallreduce(MPI_IN_PLACE, send.data(), 4, MPI_INT64_T, MPI_SUM, comm, &request);
      break;
    case Op::all_reduce_max:
      MPI_Iallreduce(MPI_IN_PLACE, send.data(), 4, MPI_INT64_T, MPI_MAX, comm, &request);
      break;
    case Op::broadcast:
      MPI_Ibcast(send.data(), 4, MPI_INT64_T, 0, comm, &request);
      break;
    case Op::barrier:
      MPI_Ibarrier(comm, &request);
      break;
    case Op::split:  // the survivors stopped in split's gather of (call, color, key)
      MPI_Iallgather(send.data(), 3, MPI_INT64_T, recv.data(), 3, MPI_INT64_T, comm, &request);
      break;
  }
  MPI_Wait(&request, MPI_STATUS_IGNORE);
}

class MpiNotice : public ::testing::TestWithParam<Fault> {};

// The victim tells its peers instead of joining the collective: every
// survivor throws within the slack, naming the victim and its error, though
// its timeout is 30 s; then the communicator refuses every call, the
// victim's too.
TEST_P(MpiNotice, EveryWaitingPeerFailsAtOnceNamingTheVictim) {
  const Fault fault = GetParam();
  const auto world = coordinator();
  const auto doomed = world->split(0, world->rank());
  doomed->set_timeout(kCoordinationTimeout);
  const int P = doomed->size();
  const int victim = fault.victim == Victim::first ? 0 : P - 1;
  const bool is_victim = doomed->rank() == victim;

  Buffers buffers;
  if (is_victim) {
    doomed->notify_failure(kVictimError);
    doomed->notify_failure("a second notice is not sent");
  } else {
    const Outcome o = timed([&] { run(fault.op, *doomed, buffers); });
    expect_notice(o, op_name(fault.op), victim, P);
  }
  const Outcome refused =
      timed([&] { doomed->all_reduce_max(buffers.send.data(), 1, CommType::i64); });
  EXPECT_TRUE(refused.threw);
  EXPECT_NE(refused.what.find("unusable"), std::string::npos) << refused.what;
  EXPECT_LT(refused.elapsed, kSlack);

  world->barrier();  // every survivor has heard
  if (is_victim) match_late(fault.op, native_of(*doomed), P);
  world->barrier();
}

INSTANTIATE_TEST_SUITE_P(
    Collectives, MpiNotice,
    ::testing::Values(Fault{Op::all_gather, Victim::last}, Fault{Op::all_reduce_sum, Victim::first},
                      Fault{Op::all_reduce_max, Victim::last}, Fault{Op::broadcast, Victim::first},
                      Fault{Op::barrier, Victim::last}, Fault{Op::split, Victim::last}),
    fault_name);

// A receive from the victim hears the notice too, and is withdrawn: its
// buffer stays as it was. A rank that waits for nobody but the victim's
// neighbours meets the notice at its next wait.
TEST(MpiNoticePointToPoint, AReceiverOfTheVictimStopsAtOnce) {
  const auto world = coordinator();
  const auto doomed = world->split(0, world->rank());
  doomed->set_timeout(kCoordinationTimeout);
  const int P = doomed->size(), victim = P - 1;
  if (doomed->rank() == victim) {
    doomed->notify_failure(kVictimError);
  } else {
    int64_t value = -1;
    const Outcome o = timed([&] { doomed->recv(&value, 1, CommType::i64, victim, 5); });
    expect_notice(o, "recv", victim, P);
    EXPECT_EQ(value, -1) << "a withdrawn receive must not be written";
  }
  world->barrier();
}

// tell_peers_on_failure: a local error is told (the peers' next collective
// fails at once naming this rank), an error collective_check agreed is not
// (every rank threw it; the communicator stays usable for the next call).
TEST(TellPeersOnFailure, ALocalErrorIsToldAnAgreedOneIsNot) {
  const auto world = coordinator();
  const auto group = world->split(0, world->rank());
  group->set_timeout(kCoordinationTimeout);
  const int P = group->size(), victim = P - 1;

  // Agreed: a bad argument on the victim alone, seen by every rank.
  const Outcome agreed = timed([&] {
    tell_peers_on_failure({group.get(), nullptr}, [&] {
      collective_check(*group, [&] {
        if (group->rank() == victim) SS_FAIL("lr", "injected bad argument");
      });
    });
  });
  ASSERT_TRUE(agreed.threw);
  EXPECT_EQ(agreed.argument, "lr") << agreed.what;
  EXPECT_TRUE(agreed.peers_know);
  int64_t sum = 1;
  group->all_reduce_sum(&sum, 1, CommType::i64);  // still usable everywhere
  EXPECT_EQ(sum, P);
  // Every rank out of that all-reduce before the victim fails: a notice that
  // reaches a peer still polling an operation the victim has already joined
  // makes the peer give that call up too (a call early; see
  // MpiCommunicator::take_notice), which is not what this part tests.
  world->barrier();

  // Local: the victim's body fails between collectives; the others wait in
  // the next one and hear it.
  const Outcome local = timed([&] {
    tell_peers_on_failure({group.get()}, [&] {
      if (group->rank() == victim) SS_FAIL("q", "injected local fault");
      group->barrier();
    });
  });
  ASSERT_TRUE(local.threw);
  if (group->rank() == victim) {
    EXPECT_EQ(local.argument, "q") << local.what;  // its own error, unchanged
    EXPECT_FALSE(local.peers_know);
  } else {
    EXPECT_EQ(local.argument, "mpi") << local.what;
    EXPECT_NE(local.what.find("barrier stopped waiting: rank " + std::to_string(victim)),
              std::string::npos)
        << local.what;
    EXPECT_NE(local.what.find("injected local fault"), std::string::npos) << local.what;
    EXPECT_LT(local.elapsed, kSlack);
  }
  world->barrier();
  if (group->rank() == victim) match_late(Op::barrier, native_of(*group), P);
  world->barrier();
}

// ---- a victim skips the construction ---------------------------------------------------

// STATESCAN_COMM_TIMEOUT_MS for one scope, then what was there.
struct ScopedTimeoutEnv : test::ScopedEnv {
  explicit ScopedTimeoutEnv(const char* value) : ScopedEnv("STATESCAN_COMM_TIMEOUT_MS", value) {}
};

// The survivors time out in the constructor's duplicate, which runs before
// the rest of the set-up: the message must still name this rank (as in a
// process that has made no communicator yet: no error rank set) and the
// group's size, not "[rank ?]" and "group of 1 ranks".
TEST(MpiTimeout, AConstructionAPeerSkipsNamesThisRankAndTheGroup) {
  const auto world = coordinator();
  const auto doomed = world->split(0, world->rank());
  const MPI_Comm parent = dynamic_cast<const MpiCommunicator&>(*doomed).native();
  const int victim = doomed->size() - 1;
  if (doomed->rank() != victim) {
    const ScopedTimeoutEnv env(std::to_string(kTimeout.count()).c_str());
    set_error_rank(-1);
    const Outcome o = timed([&] { MpiCommunicator never(parent); });
    set_error_rank(world->rank());
    expect_timeout(o, "MpiCommunicator construction");
    EXPECT_NE(o.what.find("[rank " + std::to_string(world->rank()) + "]"), std::string::npos)
        << o.what;
    EXPECT_NE(o.what.find("group of " + std::to_string(doomed->size()) + " ranks"),
              std::string::npos)
        << o.what;
  }
  world->barrier();  // every survivor has timed out
  if (doomed->rank() == victim) {
    // The late duplicate completes the survivors' posted ones. (An
    // MpiCommunicator would go on to a collective over the duplicate that
    // the survivors never join.)
    MPI_Comm late = MPI_COMM_NULL;
    MPI_Request request = MPI_REQUEST_NULL;
    EXPECT_EQ(MPI_Comm_idup(parent, &late, &request), MPI_SUCCESS);
    EXPECT_EQ(MPI_Wait(&request, MPI_STATUS_IGNORE), MPI_SUCCESS);
    if (late != MPI_COMM_NULL) MPI_Comm_free(&late);
  }
  world->barrier();
}

// ---- timeouts that must not fire, and configuration ------------------------------------

// A peer that is slow but within the timeout is waited for, not reported.
TEST(MpiTimeout, ASlowPeerWithinTheTimeoutIsNotAnError) {
  const auto world = coordinator();
  const auto comm = world->split(0, world->rank());
  comm->set_timeout(kTimeout);
  if (comm->rank() == comm->size() - 1) std::this_thread::sleep_for(kTimeout / 4);
  int64_t x = comm->rank();
  const Outcome o = timed([&] { comm->all_reduce_sum(&x, 1, CommType::i64); });
  EXPECT_FALSE(o.threw) << o.what;
  EXPECT_EQ(x, static_cast<int64_t>(comm->size()) * (comm->size() - 1) / 2);
  world->barrier();
}

TEST(MpiTimeout, SubGroupsInheritTheTimeout) {
  const auto world = coordinator();
  world->set_timeout(milliseconds(4321));
  const auto sub = world->split(world->rank() % 2, world->rank());
  EXPECT_EQ(sub->timeout(), milliseconds(4321));
}

// Negative, and past kMaxCommTimeout: a count of milliseconds that large
// overflowed the nanosecond clocks of the waits, which then timed out at once.
TEST(MpiTimeout, NegativeOrHugeTimeoutIsRejected) {
  const auto world = coordinator();
  for (const milliseconds bad :
       {milliseconds(-1), kMaxCommTimeout + milliseconds(1), milliseconds(INT64_MAX)}) {
    try {
      world->set_timeout(bad);
      ADD_FAILURE() << "a timeout of " << bad.count() << " ms was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "timeout") << e.what();
    }
  }
  EXPECT_EQ(world->timeout(), kCoordinationTimeout);
  world->set_timeout(kMaxCommTimeout);  // the bound itself is allowed
  EXPECT_EQ(world->timeout(), kMaxCommTimeout);
  world->set_timeout(kCoordinationTimeout);
}

TEST(MpiTimeout, EnvironmentSetsTheDefault) {
  {
    const ScopedTimeoutEnv env("2500");
    EXPECT_EQ(MpiCommunicator::world()->timeout(), milliseconds(2500));
  }
  {
    const ScopedTimeoutEnv env("0");  // wait forever
    EXPECT_EQ(MpiCommunicator::world()->timeout(), milliseconds(0));
  }
  {
    const ScopedTimeoutEnv env("");
    EXPECT_EQ(MpiCommunicator::world()->timeout(), kDefaultCommTimeout);
  }
}

// Every rank sees the same malformed value, so every rank throws before any
// communication and nobody is left waiting.
TEST(MpiTimeout, MalformedEnvironmentIsRejected) {
  for (const char* bad : {"soon", "-5", "10ms", "9223372036854775807"}) {
    const ScopedTimeoutEnv env(bad);
    try {
      (void)MpiCommunicator::world();
      ADD_FAILURE() << "STATESCAN_COMM_TIMEOUT_MS='" << bad << "' was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "STATESCAN_COMM_TIMEOUT_MS") << e.what();
    }
  }
}

}  // namespace
}  // namespace statescan
