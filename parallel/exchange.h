// The distributed scan of DESIGN §5: an exclusive scan across the ranks of a
// group of the affine maps S_out = M S_in + E that each rank's shard applies
// to the boundary state.
//
// One map per (row, head): M is Dk x Dk (delta rules) or its diagonal (Dk
// floats, additive rules), E is Dk x Dv. Forward runs in rank order with the
// maps as they are; backward runs in reverse rank order with (M^T, D) — the
// caller passes M already transposed. Every strategy computes
//   S_in(first) = 0,  S_in(next) = M S_in + E
// in fp32, and only the communication pattern differs:
//   allgather  one all-gather of every (M, E), each rank composes its predecessors
//   ring       hand-off to the next rank, pipelined in blocks along Dv
//   tree       Kogge-Stone scan of composed maps, ceil(log2 P) rounds + one shift
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "core/options.h"

namespace statescan {

struct ScanMaps {
  int64_t rows = 0, heads = 0, dk = 0, dv = 0;
  bool diagonal = false;  // M holds Dk floats per (row, head) instead of Dk*Dk
  std::vector<float> M;   // [rows, heads, Dk(, Dk)]
  std::vector<float> E;   // [rows, heads, Dk, Dv]

  int64_t m_size() const { return diagonal ? dk : dk * dk; }
  int64_t maps() const { return rows * heads; }
};

enum class ScanOrder { forward, reverse };

struct ScanResult {
  std::vector<float> incoming;  // S_in of this rank, [rows, heads, Dk, Dv]
  int64_t bytes_sent = 0;
};

// Collective over `comm`. `strategy` must be resolved (not automatic).
ScanResult exclusive_scan(Communicator& comm, Exchange strategy, const ScanMaps& maps,
                          ScanOrder order);

// Cost model for `auto` (DESIGN §5): latency-bandwidth estimate of each
// strategy for P ranks, per-rank map bytes (M + E), state bytes (E) and the
// flops of applying one rank's maps to a state (M S + E). The link defaults
// are for host MPI within a node; the NCCL issue calibrates them.
struct LinkModel {
  double latency_s = 5e-6;          // per message
  double bandwidth_Bps = 10e9;      // per direction
  double compose_flops_per_s = 20e9;  // host fp32 rate for composing maps
};
double predicted_exchange_seconds(Exchange e, int ranks, int64_t map_bytes, int64_t state_bytes,
                                  int64_t apply_flops, const LinkModel& link = {});
Exchange resolve_exchange(Exchange requested, int ranks, int64_t map_bytes, int64_t state_bytes,
                          int64_t apply_flops, const LinkModel& link = {});

}  // namespace statescan
