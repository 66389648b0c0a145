#include "launch/run_metrics.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "comm/collective_check.h"
#ifdef STATESCAN_HAS_CUDA
#include "core/cuda_check.h"
#endif

namespace statescan::launch {
namespace {

volatile std::sig_atomic_t g_hold_signal = 0;

extern "C" void on_hold_signal(int) {
  g_hold_signal = 1;
}

// "VmRSS:     1234 kB" -> 1234 * 1024; 0 if absent.
int64_t status_kilobytes(const std::string& text, const std::string& key) {
  const std::size_t at = text.find(key + ":");
  if (at == std::string::npos) return 0;
  std::istringstream in(text.substr(at + key.size() + 1));
  int64_t kb = 0;
  in >> kb;
  return kb * 1024;
}

}  // namespace

std::unique_ptr<MetricsExporter> start_metrics(Communicator& comm, int local_rank,
                                               const RunOptions& options) {
  if (options.metrics_port < 0) return nullptr;
  std::unique_ptr<MetricsExporter> exporter;
  try {
    collective_check(comm, [&] {
      const int port = options.metrics_port + local_rank;
      SS_CHECK_ARG(port <= 65535, "--metrics-port", options.metrics_port, " + local rank ",
                   local_rank, " is beyond port 65535");
      MetricsOptions mo;
      mo.rank = comm.rank();
      mo.variant = options.lact ? "lact" : to_string(options.variant);
      mo.bind_address = options.metrics_bind;
      mo.port = port;
      mo.exchange = options.exchange;
      exporter = std::make_unique<MetricsExporter>(mo);
    });
  } catch (const Error& e) {
    throw MetricsUnavailable(e);
  }
  return exporter;
}

MemoryUse process_memory() {
  std::ifstream file("/proc/self/status");
  std::stringstream text;
  text << file.rdbuf();
  MemoryUse use;
  use.current_bytes = status_kilobytes(text.str(), "VmRSS");
  use.peak_bytes = std::max(use.current_bytes, status_kilobytes(text.str(), "VmHWM"));
  return use;
}

MemoryUse device_memory(DeviceKind device) {
#ifdef STATESCAN_HAS_CUDA
  if (device == DeviceKind::cuda) {
    static std::atomic<int64_t> peak{0};
    std::size_t free = 0, total = 0;
    SS_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    MemoryUse use;
    use.current_bytes = static_cast<int64_t>(total - free);
    int64_t seen = peak.load();
    while (seen < use.current_bytes && !peak.compare_exchange_weak(seen, use.current_bytes)) {
    }
    use.peak_bytes = std::max(seen, use.current_bytes);
    return use;
  }
#endif
  SS_CHECK_ARG(device != DeviceKind::cuda, "--device", "cuda: this build has no CUDA");
  return process_memory();
}

ErrorKind error_kind(const Error& error, bool writing_results) {
  const std::string& arg = error.argument();
  if (arg == "mpi" || arg == "nccl") return ErrorKind::communication;
  if (arg == "cuda" || arg == "--device") return ErrorKind::device;
  if (writing_results || arg == "--save" || arg == "--json" || arg == "--load")
    return ErrorKind::io;
  if (arg.rfind("--", 0) == 0) return ErrorKind::argument;
  return arg.empty() ? ErrorKind::internal : ErrorKind::input;
}

void install_hold_signals() {
  std::signal(SIGUSR1, on_hold_signal);
}

bool hold_metrics(double seconds, const std::function<void()>& started) {
  // SIGINT and SIGTERM end the hold only from here: during the run they keep
  // their usual meaning (Ctrl-C, a batch system's end of job stop the job).
  using Handler = void (*)(int);
  const Handler old_int = std::signal(SIGINT, on_hold_signal);
  const Handler old_term = std::signal(SIGTERM, on_hold_signal);
  if (started) started();
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (g_hold_signal == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (old_int != SIG_ERR) std::signal(SIGINT, old_int);
  if (old_term != SIG_ERR) std::signal(SIGTERM, old_term);
  return g_hold_signal != 0;
}

ProgressLine::ProgressLine(RunOptions::Progress mode, int64_t total_steps, int64_t warmup_steps)
    : mode_(mode),
      terminal_(::isatty(STDERR_FILENO) != 0),
      total_steps_(total_steps),
      warmup_steps_(warmup_steps) {}

void ProgressLine::update(int64_t done, double tokens_per_s) {
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  // Short runs print their table and are done; a line would only flicker.
  const bool show = mode_ == RunOptions::Progress::always ||
                    (mode_ == RunOptions::Progress::automatic && terminal_ && elapsed > 2.0);
  if (!show || done >= total_steps_) return;
  const double eta = elapsed / static_cast<double>(done) * static_cast<double>(total_steps_ - done);
  // Numbered as the table numbers its rows: warm-up steps apart.
  const bool warming = done <= warmup_steps_;
  const int64_t shown = warming ? done : done - warmup_steps_;
  const int64_t of = warming ? warmup_steps_ : total_steps_ - warmup_steps_;
  char line[160];
  std::snprintf(line, sizeof line, "statescan-run: %s %lld/%lld  %.3g tokens/s  ETA %.0f s",
                warming ? "warm-up" : "step", static_cast<long long>(shown),
                static_cast<long long>(of), tokens_per_s, eta);
  if (terminal_) {
    std::fprintf(stderr, "\r\033[K%s", line);
    shown_ = true;
  } else {
    std::fprintf(stderr, "%s\n", line);
  }
  std::fflush(stderr);
}

void ProgressLine::clear() {
  if (!shown_) return;
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
  shown_ = false;
}

}  // namespace statescan::launch
