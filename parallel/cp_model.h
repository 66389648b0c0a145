// Context-parallel scaling model (issue 5 item 5): predicts the per-layer step
// time of CpMixer for P ranks from single-GPU times and the exchange cost
// model of parallel/exchange.h (the same model `Exchange::automatic` uses).
//
// Weak scaling: every rank holds seq_len tokens whatever P is. Per layer,
// forward + backward:
//   t(1) = fwd + bwd
//   t(P) = fwd + bwd + summary_fwd + summary_bwd + 2 * merge
//          + max(0, exchange_fwd - overlap * fwd) + max(0, exchange_bwd - overlap * bwd)
// The summary does not depend on the incoming state, so nothing hides it: it
// is always on the critical path. State-independent local work (A, W, U of the
// chunkwise pass) may run while the exchange is in flight; `overlap` is the
// fraction of the local pass assumed to hide it (default 0, conservative). The
// "hidden" columns give the optimistic bound overlap = 1.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/options.h"
#include "parallel/exchange.h"

namespace statescan {

// One mixer layer as one rank sees it (seq_len tokens per rank).
struct CpLayer {
  Variant variant = Variant::kda;
  int64_t batch = 1, seq_len = 131072, heads = 16, dk = 128, dv = 128, chunk = 64;
  DType dtype = DType::bf16;
};

// What the scan moves, as CpMixer counts it (DESIGN §5, all fp32): per rank
// the maps (M: Dk floats per head for additive rules, Dk*Dk for delta rules;
// E: Dk*Dv), the state (E only), and the flops of applying one rank's maps.
int64_t cp_map_bytes(const CpLayer& layer);
int64_t cp_state_bytes(const CpLayer& layer);
int64_t cp_apply_flops(const CpLayer& layer);

// Counted work of the summary (M_r, E_r) in forward and of (M_r^T, D_r) in
// backward, per rank. Per chunk and head:
//   delta fwd:    chunk transition 2*C*Dk^2, compose M 2*Dk^3,
//                 chunk carry 2*C*Dk*Dv, compose E 2*Dk^2*Dv
//   delta bwd:    chunk transition 2*C*Dk^2 (recomputed), propagate D 2*Dk^2*Dv,
//                 chunk gradient 2*C*Dk*Dv (M_r^T is kept from forward)
//   additive:     diagonal M: chunk carry 2*C*Dk*Dv and a Dk*Dv scaling, both ways
double cp_summary_flops(const CpLayer& layer, bool backward);
// HBM bytes the summary reads: k, v (dtype), gates (fp32), beta (dtype).
double cp_summary_bytes(const CpLayer& layer);

// The GPU the summary and merge run on. Defaults: one H200, 4.8 TB/s HBM3e;
// 300 TFLOP/s achievable for fp32-accumulate tensor-core GEMMs (an assumption:
// 989 TF32 dense peak); 5 us per kernel launch.
struct CpGpuModel {
  double flops_per_s = 300e12;
  double hbm_Bps = 4.8e12;
  double launch_s = 5e-6;
};

// Single-GPU times of one layer, ms. merge_ms is per direction (forward and
// backward each merge once).
struct CpLocalTimes {
  double fwd_ms = 0, bwd_ms = 0;
  double summary_fwd_ms = 0, summary_bwd_ms = 0;
  double merge_ms = 0;
};

// Fills the summary and merge times from the counted work (the larger of the
// FLOP time and the HBM time, plus one launch; merge: read and write one state
// in HBM, plus one launch), and bwd = 2 * fwd when bwd_ms < 0 (the GPU
// backward does not exist yet: an assumption the output must label).
CpLocalTimes estimate_local_times(const CpLayer& layer, double fwd_ms, double bwd_ms,
                                  const CpGpuModel& gpu = {});

struct CpModelConfig {
  LinkModel link = link_preset(LinkPreset::nvlink);
  double overlap = 0;    // fraction of the local pass that hides the exchange, [0, 1]
  int max_ranks = 1024;  // P = 2, 4, ... up to this
};

// One (P, exchange) prediction. Times in ms, fractions in [0, inf).
struct CpModelRow {
  int ranks = 0;
  int nodes = 0;  // ceil(P / gpus_per_node); 0 on a flat link (no nodes modelled)
  Exchange exchange = Exchange::ring;
  bool auto_pick = false;  // what resolve_exchange picks for this P
  int64_t bytes_per_rank = 0;
  double exchange_fwd_ms = 0, exchange_bwd_ms = 0;
  double step_ms = 0;         // with config.overlap
  double overhead = 0;        // step_ms / t(1) - 1
  double efficiency = 0;      // t(1) / step_ms
  double step_hidden_ms = 0;  // with overlap = 1
  double efficiency_hidden = 0;
};

// Why `auto` picked what it picked for one P.
struct CpAutoChoice {
  int ranks = 0;
  Exchange pick = Exchange::ring, runner_up = Exchange::ring;
  double pick_ms = 0, runner_up_ms = 0;  // one direction's exchange
  double pick_latency_share = 0;         // of pick_ms, what per-message latency costs
  double margin() const { return pick_ms > 0 ? runner_up_ms / pick_ms - 1 : 0; }
};

struct CpModelResult {
  double single_ms = 0;               // t(1) = fwd + bwd
  std::vector<CpModelRow> rows;       // P ascending, then allgather, ring, tree
  std::vector<CpAutoChoice> choices;  // one per P
};

// Throws statescan::Error naming the field at fault (times > 0, overlap in
// [0, 1], max_ranks >= 2, link figures > 0).
CpModelResult predict_cp_scaling(const CpLayer& layer, const CpLocalTimes& times,
                                 const CpModelConfig& config);

// Parses a strictly positive number given for CLI flag `flag` (e.g.
// "--link-bw-GBps"); throws statescan::Error naming `flag` otherwise.
double parse_positive_number(std::string_view value, const char* flag);

// Output in the manner of nccl-tests: '#'-headed lines, units on every column.
// `notes` are printed as '#' lines before the column header (where the times
// came from). The JSON is an array of the same rows.
std::string format_cp_model_table(const CpLayer& layer, const CpLocalTimes& times,
                                  const CpModelConfig& config, const CpModelResult& result,
                                  const std::vector<std::string>& notes);
std::string format_cp_model_json(const CpModelResult& result);

}  // namespace statescan
