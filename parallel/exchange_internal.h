// Pieces of the boundary-state exchange shared by its host scan
// (exchange.cpp) and its device scan (exchange_cuda.cpp), so that both walk
// the ranks in the same order and block the ring alike. Private to
// parallel/ (not installed: CMakeLists.txt leaves *_internal.h out).
#pragma once

#include <algorithm>
#include <cstdint>

namespace statescan::exchange_detail {

// Scan positions: forward order is rank order, reverse order the opposite.
struct Order {
  int rank, size;
  bool reverse;
  int pos() const { return reverse ? size - 1 - rank : rank; }
  // The rank at scan position p; -1 off either end (no peer).
  int rank_at(int p) const {
    if (p < 0 || p >= size) return -1;
    return reverse ? size - 1 - p : p;
  }
};

// The ring's blocks along Dv: the next rank starts on block j while this one
// receives block j + 1, so P hops cost about one state transfer plus P block
// latencies. kRingBlocks blocks (fewer where Dv is smaller) of this width, the
// last one possibly narrower; predicted_exchange_seconds models the same
// count.
constexpr int64_t kRingBlocks = 4;
inline int64_t ring_block_width(int64_t dv) {
  const int64_t blocks = std::min<int64_t>(kRingBlocks, dv);
  return (dv + blocks - 1) / blocks;
}

}  // namespace statescan::exchange_detail
