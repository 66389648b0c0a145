// What cp_consumer and lact_consumer share: the error measure of their check
// against a single-rank run, and a main that turns a statescan::Error on any
// rank into an abort of the whole job (a rank that stops must not leave the
// others waiting in a collective).
#pragma once

#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <vector>

#include "comm/mpi_communicator.h"
#include "core/error.h"

namespace consumer {

// Relative RMS error of x against ref (infinite where x is not finite).
inline double rel_rms(const std::vector<float>& x, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double d = static_cast<double>(x[i]) - ref[i];
    if (!std::isfinite(d)) return INFINITY;
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// main's body: MPI up, run() on every rank; a statescan::Error aborts the
// job with 2, any other exception (out of memory, say) with 3, each after
// printing it (an uncaught one would end in std::terminate, unexplained).
template <typename Run>
int main_of(const char* name, int argc, char** argv, Run&& run) {
  statescan::MpiEnvironment mpi(&argc, &argv);
  try {
    return run(argc, argv);
  } catch (const statescan::Error& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  return 2;
}

}  // namespace consumer
