// Numbers from the command line (statescan-run, statescan-bench): the whole
// text must be the number and in range, or statescan::Error names the flag
// (the same message on every rank, since argv is the same everywhere).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string_view>

namespace statescan {

// A decimal integer in [min, max].
int64_t parse_int(std::string_view text, const char* flag, int64_t min, int64_t max);

// A finite decimal number (strtod's forms: 1.5, 2e-3, ...).
double parse_number(std::string_view text, const char* flag);

// A finite number > 0.
double parse_positive_number(std::string_view text, const char* flag);

// One extent of a tensor's shape and the flag (or expression of flags) it came from.
struct NamedExtent {
  const char* name;
  int64_t value;
};

// Refuses extents whose product (the elements of one tensor) passes 2^48,
// naming `flag` and listing the extents ("--batch 4 x --seq-len 8 x ..."):
// each extent is capped on its own, their product is not, and it would
// overflow int64 (or be no tensor any machine holds).
void check_tensor_elements(std::initializer_list<NamedExtent> extents, const char* flag);

}  // namespace statescan
