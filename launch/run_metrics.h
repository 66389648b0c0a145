// statescan-run's metrics and progress: this rank's Prometheus exporter
// (--metrics-port/--metrics-bind), what each step reports to it, the hold
// after the run (--metrics-hold), and the progress line on stderr.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "core/error.h"
#include "launch/run_options.h"
#include "monitoring/metrics_exporter.h"

namespace statescan::launch {

// The exporter could not start (port taken, address not local, a build
// without Prometheus): statescan-run's exit status 4.
class MetricsUnavailable : public Error {
 public:
  explicit MetricsUnavailable(const Error& e) : Error(e.argument(), e.what(), e.rank()) {}
};

// Collective. Starts this rank's exporter on options.metrics_port + its
// node-local rank (null when --metrics-port was not given). A rank that
// cannot start its exporter fails every rank alike, with MetricsUnavailable.
std::unique_ptr<MetricsExporter> start_metrics(Communicator& comm, int local_rank,
                                               const RunOptions& options);

// Resident memory of this process now and at its peak (Linux /proc), the
// device memory of the CPU path.
struct MemoryUse {
  int64_t current_bytes = 0, peak_bytes = 0;
};
MemoryUse process_memory();

// The memory of the device that computes, for statescan_device_memory_bytes:
// on the GPU path the bytes in use on the current GPU (every allocation, the
// stream-ordered pool's reserve included; cudaMemGetInfo, so other processes
// on the same GPU count too) and the most this process has seen at any call,
// as cudaMemGetInfo keeps no peak; process_memory() on the CPU path.
MemoryUse device_memory(DeviceKind device);

// Which errors_total kind a failure counts as. `writing_results`: the job
// was saving its outputs.
ErrorKind error_kind(const Error& error, bool writing_results);

// Installs the SIGUSR1 handler that ends hold_metrics() early (mpirun
// forwards SIGUSR1 to every rank). Call before the run, so that a SIGUSR1
// sent before the hold begins is not fatal (it then ends the hold at once).
void install_hold_signals();
// Keeps the process (and so its exporter) alive for `seconds`, or until
// SIGUSR1, or SIGINT / SIGTERM during the hold, arrives (those two keep
// their default meaning during the run). `started` runs once their handlers
// are in place (the "holding" message: a signal sent on reading it must end
// the hold, not the process). Returns true when a signal ended it.
bool hold_metrics(double seconds, const std::function<void()>& started = {});

// The progress line of rank 0: "step 7/20  1.2e+06 tokens/s  ETA 14 s",
// redrawn in place on a terminal once the run has taken over ~2 s (always
// with --progress, never with --no-progress; one line per update when
// stderr is not a terminal).
class ProgressLine {
 public:
  ProgressLine(RunOptions::Progress mode, int64_t total_steps, int64_t warmup_steps);
  // After step `done` (1-based) of this rank; tokens_per_s of that step.
  void update(int64_t done, double tokens_per_s);
  // Erases the line before other output goes to the terminal.
  void clear();
  ~ProgressLine() { clear(); }

 private:
  using Clock = std::chrono::steady_clock;
  RunOptions::Progress mode_;
  bool terminal_;
  int64_t total_steps_, warmup_steps_;
  Clock::time_point start_ = Clock::now();
  bool shown_ = false;  // a redrawn line is on the terminal now
};

}  // namespace statescan::launch
