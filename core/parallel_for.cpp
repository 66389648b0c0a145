#include "core/parallel_for.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/env_knob.h"

namespace statescan {
namespace {
thread_local bool t_inside = false;
}

int usable_cores() {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) == 0 && CPU_COUNT(&allowed) > 0)
    return CPU_COUNT(&allowed);
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

int num_threads() {
  static const int n = [] {
    const int64_t forced = env_int("STATESCAN_NUM_THREADS", 0, 1, 1 << 16);
    if (forced > 0) return static_cast<int>(forced);
    // The cores this process may run on, not the node's: under mpirun (each
    // rank bound to a core or two) or taskset, a thread per node core piles
    // them onto the same cores (statescan-run also splits a node's cores
    // among its ranks; a trainer linking the library gets this bound). Read
    // once, by the thread that asks first: normally the main thread, before
    // the trainer pins any worker.
    return usable_cores();
  }();
  return n;
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& body) {
  const int64_t workers = std::min<int64_t>(num_threads(), n);
  if (workers <= 1 || t_inside) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  // The error reported is the lowest failing item's, as the serial loop's
  // would be, whatever the threads' timing (two ranks, or two runs, then
  // report the same one). Items are taken in increasing order, so once item
  // e failed every item below it is already taken and runs to its end (one
  // of them may fail lower), and none above it need start.
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> stop{n};  // the lowest failing item so far, n if none
  std::exception_ptr error;
  std::mutex error_mutex;
  auto run = [&] {
    t_inside = true;
    for (int64_t i; (i = next.fetch_add(1)) < stop.load();) {
      try {
        body(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (i < stop.load()) {
          error = std::current_exception();
          stop.store(i);
        }
      }
    }
    t_inside = false;
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(workers - 1));
  // A thread that cannot be created (std::system_error at a container's pids
  // limit, std::bad_alloc for its stack or state) only means fewer workers:
  // the items are shared through `next`, so the threads already started and
  // this one still run all of them, with the same results. Whatever the
  // exception, it must not leave here: that would destroy joinable threads
  // (std::terminate).
  try {
    for (int64_t w = 1; w < workers; ++w) pool.emplace_back(run);
  } catch (...) {
  }
  run();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace statescan
