// A minimal fork-join loop over independent work items (the CPU path's
// (segment, head) pairs). Threads come from STATESCAN_NUM_THREADS, else the
// hardware; nested calls run serially. Exceptions from the body are rethrown
// on the caller's thread (the first one wins).
#pragma once

#include <cstdint>
#include <functional>

namespace statescan {

int num_threads();
void parallel_for(int64_t n, const std::function<void(int64_t)>& body);

}  // namespace statescan
