// A minimal fork-join loop over independent work items (the CPU path's
// (segment, head) pairs). Threads come from STATESCAN_NUM_THREADS, else the
// cores this process may run on (its CPU affinity); nested calls run
// serially; a worker thread that cannot be created leaves its items to the
// others. Exceptions from the body are rethrown
// on the caller's thread (the first one wins).
#pragma once

#include <cstdint>
#include <functional>

namespace statescan {

// The cores the calling thread may run on (its CPU affinity mask), else the
// machine's; at least 1.
int usable_cores();
int num_threads();
void parallel_for(int64_t n, const std::function<void(int64_t)>& body);

}  // namespace statescan
