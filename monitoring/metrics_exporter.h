// MetricsExporter: the Prometheus exporter of one rank (pull model: Prometheus
// scrapes http://<bind>:<port>/metrics).
//
// It is the CpObserver that parallel/ reports phase timings to, plus the
// step-level calls that only the caller can make (a trainer or statescan-run
// knows where a step begins and ends, how many tokens it held and how much
// memory it used). Every metric family and child is built once, in the
// constructor; the observer and step calls only add to cached children.
//
// Families (every series also carries the labels rank and variant):
//   statescan_tokens_total                      counter    tokens this rank processed
//   statescan_step_seconds                      histogram  wall time per step
//   statescan_tokens_per_second                 gauge      of the last step
//   statescan_phase_seconds_total{phase}        counter    fwd|bwd|summary|exchange|merge
//   statescan_exchange_bytes_total{strategy}    counter    allgather|ring|tree, or
//                                                          allreduce (LaCT's fast-weight
//                                                          gradient all-reduces)
//   statescan_achieved_tflops                   gauge      of the last step (counted FLOPs)
//   statescan_device_memory_bytes{kind}         gauge      current|peak
//   statescan_errors_total{kind}                counter    see ErrorKind
//
// No Prometheus type appears in this header: a consumer compiles against it
// without prometheus-cpp's headers. In a build without prometheus-cpp
// (STATESCAN_WITH_PROMETHEUS=OFF) the exporter still records (snapshot()
// works), but asking it to serve a port throws "built without Prometheus".
//
// Usage (every rank):
//   MetricsOptions mo;
//   mo.rank = world->rank();  mo.variant = "kda";
//   mo.port = 9400 + world->local_rank();          // -1: record only, no HTTP
//   MetricsExporter metrics(mo);
//   CpMixer mixer(*cp, config, Exchange::automatic, &metrics);
//   ... mixer.forward(f); mixer.backward(b);
//   metrics.on_step({tokens_on_this_rank, step_seconds, step_flops});
//   MetricsSnapshot s = metrics.snapshot();
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "core/options.h"
#include "parallel/observer.h"

namespace statescan {

// What failed, as far as the errors_total counter distinguishes (a fixed set,
// so the label stays low-cardinality).
enum class ErrorKind { argument, input, communication, device, io, internal };
constexpr int kNumErrorKinds = 6;
const char* to_string(ErrorKind kind);

constexpr int kNumPhases = 5;             // Phase::fwd .. Phase::merge
constexpr int kNumResolvedExchanges = 3;  // allgather, ring, tree

// One training step of this rank, as its caller measured it.
struct StepSample {
  int64_t tokens = 0;  // tokens of this rank's shard processed in the step (B * T_local)
  double seconds = 0;  // wall time of the step (forward, backward, whatever it spans)
  double flops = 0;    // counted FLOPs of the step on this rank; 0: unknown (tflops untouched)
};

struct MetricsOptions {
  int rank = 0;                            // label "rank"
  std::string variant;                     // label "variant" (CLI name, e.g. "kda")
  std::string bind_address = "127.0.0.1";  // loopback unless the user opens it up
  int port = -1;  // -1: record only; 0: any free port (tests); else 1..65535
  // Strategy label for exchange bytes until the mixer reports the one it used
  // (on_exchange_strategy). Bytes reported while it is still `automatic` are
  // labelled strategy="auto".
  Exchange exchange = Exchange::automatic;
};

// Totals since construction, the same numbers the exporter serves.
struct MetricsSnapshot {
  int64_t steps = 0;
  int64_t tokens_total = 0;
  double step_seconds_sum = 0;
  double tokens_per_second = 0;                    // last step
  double achieved_tflops = 0;                      // last step with flops > 0
  std::array<double, kNumPhases> phase_seconds{};  // indexed by Phase
  // Indexed by Exchange (allgather, ring, tree, automatic = not yet resolved).
  std::array<int64_t, 4> exchange_bytes{};
  int64_t allreduce_bytes = 0;  // LaCT's all-reduces (on_allreduce)
  int64_t device_memory_current = 0, device_memory_peak = 0;
  std::array<int64_t, kNumErrorKinds> errors{};  // indexed by ErrorKind

  double phase(Phase p) const { return phase_seconds[static_cast<int>(p)]; }
  int64_t bytes(Exchange e) const { return exchange_bytes[static_cast<int>(e)]; }
  int64_t error_count(ErrorKind k) const { return errors[static_cast<int>(k)]; }
};

class MetricsExporter final : public CpObserver {
 public:
  // True when this build can serve metrics over HTTP (built with prometheus-cpp).
  static bool serving_available();

  // Builds every family; with options.port >= 0 also starts the HTTP server on
  // bind_address:port. Throws statescan::Error naming "metrics-port" when the
  // port is out of range, cannot be bound, or this build has no Prometheus.
  explicit MetricsExporter(MetricsOptions options);
  ~MetricsExporter() override;
  MetricsExporter(const MetricsExporter&) = delete;
  MetricsExporter& operator=(const MetricsExporter&) = delete;

  bool serving() const;
  int port() const;             // the bound port (resolves port 0); -1 when not serving
  std::string address() const;  // "127.0.0.1:9400"; empty when not serving

  // CpObserver (called by CpMixer on the calling thread). Negative or
  // non-finite values throw naming "seconds" / "bytes".
  void on_phase(Phase phase, double seconds, int64_t bytes) override;
  void on_exchange_strategy(Exchange strategy) override;
  // The strategy and its bytes under one lock (mixers on several threads).
  void on_exchange(Exchange strategy, double seconds, int64_t bytes) override;
  // A layer that exchanges by all-reduce (LaCT): its time counts in the
  // exchange phase, its bytes under strategy="allreduce". Negative or
  // non-finite values throw naming "seconds" / "bytes".
  void on_allreduce(double seconds, int64_t bytes);

  // Step-level calls of the trainer/launcher. Any thread; all are thread-safe.
  void on_step(const StepSample& step);
  void set_device_memory(int64_t current_bytes, int64_t peak_bytes);
  void count_error(ErrorKind kind);

  MetricsSnapshot snapshot() const;
  // The Prometheus text exposition (what /metrics serves). Throws "built
  // without Prometheus" in builds without prometheus-cpp.
  std::string exposition_text() const;

 private:
  static void check_phase(Phase phase, double seconds, int64_t bytes);
  void record_phase(Phase phase, double seconds, int64_t bytes);  // holds impl_->mutex
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace statescan
