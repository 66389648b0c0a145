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
  // Called once per forward/backward call, before that call's on_phase calls,
  // with the exchange strategy the call used (Exchange::automatic resolved),
  // so that an observer can label exchange bytes by strategy. Default: ignored.
  virtual void on_exchange_strategy(Exchange /*strategy*/) {}
};

}  // namespace statescan
