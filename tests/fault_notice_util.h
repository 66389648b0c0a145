// Helpers of the CP fault-notice tests (test_cp_mixer_mpi, test_cuda_cp_mpi):
// a rank that fails alone after its last collective of a forward, what every
// rank must then see, and the clean-up of what the survivors left posted.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "core/error.h"
#include "parallel/observer.h"

namespace statescan::test {

// An observer that fails (a metrics sink whose disk filled, say) after the
// forward's phases, on the rank that holds it.
class FailingObserver final : public CpObserver {
 public:
  void on_phase(Phase phase, double, int64_t) override {
    if (phase == Phase::fwd) SS_FAIL("observer", "injected: the metrics sink failed");
  }
};

// The victim (holding FailingObserver) keeps its own error; every survivor's
// error is the victim's notice, heard on a communicator of backend
// `survivor_argument` ("mpi", "nccl") well before its 30-second timeout.
inline void expect_told(const std::optional<Error>& e, double seconds, int rank, int victim,
                        int size, const char* survivor_argument) {
  ASSERT_TRUE(e) << "rank " << rank << " returned normally";
  if (rank == victim) {
    EXPECT_EQ(e->argument(), "observer") << e->what();
    EXPECT_FALSE(e->peers_know());
    return;
  }
  const std::string what = e->what();
  EXPECT_EQ(e->argument(), survivor_argument) << what;
  EXPECT_TRUE(e->peers_know());
  EXPECT_NE(what.find("rank " + std::to_string(victim) + " of this group of " +
                      std::to_string(size) + " failed on its own"),
            std::string::npos)
      << what;
  EXPECT_NE(what.find("injected: the metrics sink failed"), std::string::npos) << what;
  EXPECT_LT(seconds, 10.0) << "the peers waited instead of hearing the notice";
}

// The survivors' observer: records that this rank's forward got to its end
// (Phase::fwd is reported after the forward's last collective).
class ForwardEndObserver final : public CpObserver {
 public:
  void on_phase(Phase phase, double, int64_t) override {
    if (phase == Phase::fwd) reached = true;
  }
  bool reached = false;
};

// The clean-up after the notice, on every rank of the group (`world` holds
// the group's ranks; `group` is the group's MPI communicator). A survivor
// whose forward ended (`forward_ended`) went on to the backward's first
// agreement (collective_check: an all-reduce, max of one i64), posted it and
// stopped there at the notice, leaving it posted. A survivor can also hear
// the notice before its forward ends: the victim's part of the forward's last
// all-reduce can complete before a slower peer's, which then polls, finds the
// notice and stops without posting the agreement (test_cp_mixer_mpi hung at
// np 4 on 2 cores, sixty-ninth session, when the victim alone matched it).
// So every rank that did not post the agreement matches it on MPI directly
// (its communicator refuses calls after the notice) when any rank did, and
// nothing is pending when MPI finalises.
inline void match_agreement_late(Communicator& world, MPI_Comm group, bool forward_ended) {
  int64_t any_posted = forward_ended ? 1 : 0;
  world.all_reduce_max(&any_posted, 1, CommType::i64);
  if (forward_ended || any_posted == 0) return;
  int64_t lowest = 0;
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Iallreduce(MPI_IN_PLACE, &lowest, 1, MPI_INT64_T, MPI_MAX, group, &request);
  MPI_Wait(&request, MPI_STATUS_IGNORE);
}

}  // namespace statescan::test
