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

// The argument named by the statescan::Error that `call` throws, or
// "<no error>": for loops over cases that expect different arguments.
template <typename F>
std::string error_argument(F&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.argument();
  }
  return "<no error>";
}

}  // namespace statescan::test
