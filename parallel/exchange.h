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
//   tree       exclusive Kogge-Stone scan of composed maps, ceil(log2 P) rounds
//              (the last one sends E only)
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
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

// Throws naming maps.<field> unless rows, heads, Dk and Dv are all >= 1 (the
// scans divide by Dv's blocks and size buffers by their products). Host and
// device maps alike.
void check_scan_dims(int64_t rows, int64_t heads, int64_t dk, int64_t dv);

// Collective over `comm`. `strategy` must be resolved (not automatic).
ScanResult exclusive_scan(Communicator& comm, Exchange strategy, const ScanMaps& maps,
                          ScanOrder order);

// Cost model for `auto` (DESIGN §5): latency-bandwidth estimate of each
// strategy for P ranks, per-rank map bytes (M + E), state bytes (E) and the
// flops of applying one rank's maps to a state (M S + E). The link defaults
// are for host MPI within a node; the NCCL issue calibrates them.
//
// The same model drives the scaling model of parallel/cp_model.h, which uses
// the GPU presets of link_preset(). With gpus_per_node > 0 the ranks form
// nodes of gpus_per_node consecutive ranks: a message between two ranks of one
// node uses (latency_s, bandwidth_Bps), a message between nodes uses
// (inter_latency_s, inter_bandwidth_Bps). gpus_per_node == 0 is one flat link.
struct LinkModel {
  double latency_s = 5e-6;          // per message
  double bandwidth_Bps = 10e9;      // per direction
  double compose_flops_per_s = 20e9;  // host fp32 rate for composing maps
  int gpus_per_node = 0;              // 0: every rank on the one link above
  double inter_latency_s = 0;         // per message between nodes
  double inter_bandwidth_Bps = 0;     // per direction per GPU between nodes
  // Set by measure_link*: the bandwidth above came from the large shift. False
  // when its extra time over the small shift was below the timing noise (on
  // some rank), and bandwidth_Bps is then the base's figure.
  bool bandwidth_measured = false;
};

// Named GPU links for the scaling model: NVLink within one node (every rank on
// NVLink), InfiniBand (every rank on its own NIC), and hierarchical (NVLink
// within nodes of gpus_per_node GPUs, InfiniBand between them).
enum class LinkPreset { nvlink, ib, hierarchical };
const char* to_string(LinkPreset p);
// Accepts "nvlink", "ib", "hierarchical"; throws statescan::Error naming `argument`.
LinkPreset parse_link_preset(std::string_view name, const char* argument = "link");
// The preset's figures (sources in exchange.cpp). Throws naming "gpus_per_node"
// unless it is >= 1.
LinkModel link_preset(LinkPreset preset, int gpus_per_node = 8);

// Collective over `comm` (host buffers): measures the group's link by timing
// ring shifts (every rank sends to the next, receives from the previous) of
// a small and a large message, medians of a few repetitions: latency = the
// small shift, bandwidth = the extra bytes over the extra time. The ranks
// agree on the slowest figures (all-reduce max), so every rank resolves
// `auto` alike. Where the large shift takes less than 1.25x the small one,
// its transfer time is lost in the latency's noise: the bandwidth is then
// the base's and `bandwidth_measured` false (never a fit of noise). compose_flops_per_s and the
// node layout come from `base`. A group of one returns `base`.
LinkModel measure_link(Communicator& comm, const LinkModel& base = {});

// What measure_link and its device twin (parallel/exchange_cuda.h) share:
// `shift(n)` lines the ranks up and returns the seconds of one ring shift of
// n floats; `agree_max(values, n)` replaces n doubles by their max over the
// ranks.
// Medians of 7 shifts after 2 warm-ups, of 2 floats and of `large` floats.
struct RingProbe {
  std::function<double(std::size_t floats)> shift;
  std::function<void(double* values, int n)> agree_max;
  std::size_t large = 0;
};
LinkModel link_from_ring_probe(const RingProbe& probe, const LinkModel& base);

double predicted_exchange_seconds(Exchange e, int ranks, int64_t map_bytes, int64_t state_bytes,
                                  int64_t apply_flops, const LinkModel& link = {});
Exchange resolve_exchange(Exchange requested, int ranks, int64_t map_bytes, int64_t state_bytes,
                          int64_t apply_flops, const LinkModel& link = {});
// Bytes the busiest rank sends in one scan (what exclusive_scan reports as
// bytes_sent): allgather (P-1) maps, ring one state, tree ceil(log2 P) - 1
// maps plus one state. 0 for P <= 1.
int64_t predicted_exchange_bytes(Exchange e, int ranks, int64_t map_bytes, int64_t state_bytes);

}  // namespace statescan
