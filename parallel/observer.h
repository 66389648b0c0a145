// The observer through which parallel/ reports timings. monitoring/ implements
// it for Prometheus; launch/ for its tables. No metrics types appear here.
#pragma once

#include <cstdint>

#include "core/options.h"

namespace statescan {

enum class Phase { fwd, bwd, summary, exchange, merge };
const char* to_string(Phase p);

class CpObserver {
 public:
  virtual ~CpObserver() = default;
  // Called once per phase and step, on the calling thread, after the phase.
  virtual void on_phase(Phase phase, double seconds, int64_t bytes) = 0;
  // The exchange strategy in use (Exchange::automatic resolved), so that an
  // observer can label the exchange bytes of later on_phase calls by it.
  // Default: ignored.
  virtual void on_exchange_strategy(Exchange /*strategy*/) {}
  // The exchange phase with the strategy it used, in one call: CpMixer
  // reports its exchange this way. Default: the two calls above. An observer
  // shared by mixers on several threads overrides it so that a strategy and
  // its bytes cannot be separated by another thread's report
  // (MetricsExporter).
  virtual void on_exchange(Exchange strategy, double seconds, int64_t bytes) {
    on_exchange_strategy(strategy);
    on_phase(Phase::exchange, seconds, bytes);
  }
};

}  // namespace statescan
