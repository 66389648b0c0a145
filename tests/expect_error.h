// expect_error: the one way the suites check that a call is refused with a
// statescan::Error naming a given argument.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"

namespace statescan::test {

// Expects `call` to throw statescan::Error naming `argument`.
template <typename F>
void expect_error(F&& call, const std::string& argument) {
  try {
    call();
    ADD_FAILURE() << "expected statescan::Error naming '" << argument << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
}

}  // namespace statescan::test
