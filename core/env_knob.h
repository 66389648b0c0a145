// Tuning and A/B switches read from the environment (STATESCAN_*). A value
// outside a switch's documented set is a statescan::Error naming the variable,
// never a silent fallback to the default: a typo would otherwise time or test
// the default kernel while the caller believes it is the other one. An empty
// value counts as unset (`STATESCAN_X= cmd`).
#pragma once

#include <cstdint>
#include <initializer_list>

namespace statescan {

// The position of the variable's value in `allowed`, or -1 when unset.
int env_choice(const char* name, std::initializer_list<const char*> allowed);

// The variable as a whole number in [lo, hi]; `fallback` when unset.
int64_t env_int(const char* name, int64_t fallback, int64_t lo, int64_t hi);

}  // namespace statescan
