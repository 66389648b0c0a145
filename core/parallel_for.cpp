#include "core/parallel_for.h"

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

int num_threads() {
  static const int n = [] {
    const int64_t forced = env_int("STATESCAN_NUM_THREADS", 0, 1, 1 << 16);
    if (forced > 0) return static_cast<int>(forced);
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(hw);
  }();
  return n;
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& body) {
  const int64_t workers = std::min<int64_t>(num_threads(), n);
  if (workers <= 1 || t_inside) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto run = [&] {
    t_inside = true;
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      try {
        body(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    }
    t_inside = false;
  };
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(run);
  run();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace statescan
