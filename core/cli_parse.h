// Numbers from the command line (statescan-run, statescan-bench): the whole
// text must be the number and in range, or statescan::Error names the flag
// (the same message on every rank, since argv is the same everywhere).
#pragma once

#include <cstdint>
#include <string_view>

namespace statescan {

// A decimal integer in [min, max].
int64_t parse_int(std::string_view text, const char* flag, int64_t min, int64_t max);

// A finite decimal number (strtod's forms: 1.5, 2e-3, ...).
double parse_number(std::string_view text, const char* flag);

// A finite number > 0.
double parse_positive_number(std::string_view text, const char* flag);

}  // namespace statescan
