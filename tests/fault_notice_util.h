// Helpers of the CP fault-notice tests (test_cp_mixer_mpi, test_cuda_cp_mpi):
// a rank that fails alone after its last collective of a forward, what every
// rank must then see, and the clean-up of what the survivors left posted.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <optional>
#include <string>

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

// The survivors stopped in a backward's first agreement (collective_check:
// an all-reduce, max of one i64) and left it posted on `comm`: the victim,
// whose communicator refuses calls after its notice, matches it on MPI
// directly, so that nothing is pending when MPI finalises.
inline void match_agreement_late(MPI_Comm comm) {
  int64_t lowest = 0;
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Iallreduce(MPI_IN_PLACE, &lowest, 1, MPI_INT64_T, MPI_MAX, comm, &request);
  MPI_Wait(&request, MPI_STATUS_IGNORE);
}

}  // namespace statescan::test
