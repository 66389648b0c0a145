// gtest main for MPI suites: initialises MPI, keeps every rank's printer (a
// failure on rank 3 must be visible) and makes the exit code agree across ranks so that mpirun
// reports a failure seen by any rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
  // FUNNELED, as statescan::MpiEnvironment asks: the library runs worker
  // threads beside the one that calls MPI.
  int provided = MPI_THREAD_SINGLE;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  if (provided < MPI_THREAD_FUNNELED) {
    std::fprintf(stderr, "MPI provides thread level %d, below MPI_THREAD_FUNNELED\n", provided);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  ::testing::InitGoogleTest(&argc, argv);
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
