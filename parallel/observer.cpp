#include "parallel/observer.h"

namespace statescan {

const char* to_string(Phase p) {
  switch (p) {
    case Phase::fwd: return "fwd";
    case Phase::bwd: return "bwd";
    case Phase::summary: return "summary";
    case Phase::exchange: return "exchange";
    case Phase::merge: return "merge";
  }
  return "?";
}

}  // namespace statescan
