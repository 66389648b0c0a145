// The expectation shared by the MPI error suites: a bad input on rank
// `culprit` must give every rank the same statescan::Error, raised by rank
// `reporter`, leave the output untouched and let every rank reach a barrier.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"

namespace statescan::test {

// `call` runs the collective operation on this rank; `output` was filled with
// `sentinel` before it. A cross-rank disagreement is seen by every rank and
// reported by the lowest; its message must then name the culprit.
template <typename F>
void expect_collective_error(Communicator& comm, F&& call, const std::string& argument, int culprit,
                             int reporter, const std::vector<float>& output, float sentinel) {
  const int r = comm.rank();
  bool threw = false;
  try {
    call();
  } catch (const Error& e) {
    threw = true;
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_EQ(e.rank(), reporter) << e.what();
    if (reporter != culprit) {
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(culprit)), std::string::npos)
          << e.what();
    }
  }
  EXPECT_TRUE(threw) << "rank " << r << " did not get the error";
  for (float x : output)
    ASSERT_EQ(x, sentinel) << "rank " << r << " wrote output despite the error";
  comm.barrier();  // reaching this on every rank is the no-hang check
}

}  // namespace statescan::test
