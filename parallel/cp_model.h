// Context-parallel scaling model (issue 5 item 5): predicts the per-layer step
// time of CpMixer for P ranks from single-GPU times and the exchange cost
// model of parallel/exchange.h (the same model `Exchange::automatic` uses).
//
// Weak scaling: every rank holds seq_len tokens whatever P is. Per layer,
// forward + backward:
//   t(1) = fwd + bwd
//   t(P) = fwd + bwd + summary_fwd(P) + summary_bwd + 2 * merge
//          + max(0, exchange_fwd - overlap * fwd)
//          + max(0, exchange_bwd - max(overlap * bwd, slack))
//   summary_fwd(2) = summary_fwd_first (the longer of the first rank's E and,
//                    for the delta rules, the last rank's first-segment maps),
//   summary_fwd(P >= 3) = summary_fwd (a middle rank's E and M).
// Why P = 2 differs: the first rank has no incoming state, so it sends E alone
// and skips M; the last rank sends nothing forward, and under the delta rules
// forms only its first segment's maps (for the backward's pre-pass), beside
// the first rank's E. From P = 3 on a middle rank computes both. In backward every rank but the
// first runs the pre-pass (summary_bwd), so it is on the critical path at every P >= 2. The summary
// does not depend on the incoming state, so nothing hides it: it is always on the critical path.
// State-independent local work (A, W, U of the chunkwise pass) may run while the exchange is in
// flight; `overlap` is the fraction of the local pass assumed to hide it (default 0, conservative).
// The "hidden" columns give the optimistic bound overlap = 1. slack (delta rules): the backward's
// prepare stage less the pre-pass, which CpMixer queues beside the pre-pass and the reverse
// exchange by construction (CpLocalTimes).
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
//                 chunk carry 2*C*Dk*Dv, compose E 2*Dk^2*Dv, and the first
//                 segment's H (cuda::FirstSegmentMaps: the M scan's outputs)
//                 Q^ P 2*C*Dk^2 + A V' 2*C^2*Dk
//   delta bwd:    D = sum_t H_t^T dO_t, one GEMM: 2*C*Dk*Dv (M_r^T is kept
//                 from forward)
//   additive:     diagonal M: chunk carry 2*C*Dk*Dv and a Dk*Dv scaling, both
//                 ways (their backward keeps the reverse-scan pre-pass)
double cp_summary_flops(const CpLayer& layer, bool backward);
// Counted work of the last rank's forward summary with delta rules: its first
// segment's maps alone (M's scan with H, no E), which P = 2 runs beside the
// first rank's E. 0 for additive rules (no maps).
double cp_summary_maps_flops(const CpLayer& layer);
// Counted work of the first rank's forward summary: E alone (chunk carry and
// composing E; delta rules skip the chunk transition's M and composing M).
// For Dk = Dv this is half of the delta rules' forward count, which matched
// the measurement while E and M ran one after the other (KDA, H200: E alone
// 5.71 ms of E+M 11.49 ms, 49.7 %); side by side (8.07 ms) E's own rate
// (CpGpuModel::summary_first_flops_per_s) carries the difference.
double cp_summary_first_flops(const CpLayer& layer);
// HBM bytes the summary reads: k, v (dtype), gates (fp32), beta (dtype); the
// delta rules' backward summary reads H and dO (dtype) instead.
double cp_summary_bytes(const CpLayer& layer, bool backward = false);

// Effective summary rates, calibrated on one H200 (141 GB HBM3e) from
// `statescan-bench --cp-measure`, KDA, B=1, T=131072, H=16, D=128, bf16,
// chunk 64 (2026-12-04, twenty-eighth session: the two-level summary, every
// row's chunks in runs scanned at once by the per-head kernel, transposed so
// that each warpgroup carries its own value columns with both products' A
// operands in registers, the two warpgroups in ping-pong, its tiles loaded by
// TMA, a run's E and maps as one cluster of two CTAs, the fold of the runs one
// launch (chain_maps); the pre-pass GEMMs of every run in one batched call,
// its Horner steps one launch): a middle rank's summary fwd (E beside the
// maps with H) 0.910 ms, the first rank's E alone 0.683 ms (its runs need
// their maps too, without H), the last rank's maps alone 0.648 ms (each the
// mean of two runs: 0.910 / 0.910, 0.677 / 0.688, 0.644 / 0.652), summary
// bwd (the H^T dO GEMMs, unchanged since the twenty-sixth session) 0.284 ms
// (the mean of its four runs then, 0.278-0.290: this one moves with the
// machine by a few per cent; 0.284 / 0.290 in this session's).
// Rate = counted FLOPs of that layer / measured time:
//   fwd:   2048 chunks x 16 heads x 15,728,640 FLOP = 515,396,075,520 FLOP
//   first: 2048 chunks x 16 heads x  6,291,456 FLOP = 206,158,430,208 FLOP
//   maps:  2048 chunks x 16 heads x  9,437,184 FLOP = 309,237,645,312 FLOP
//   bwd:   2048 chunks x 16 heads x  2,097,152 FLOP =  68,719,476,736 FLOP
// The forward summaries are sequential scans over chunks, cut into runs that
// fill the GPU but each still a chain (each chunk's composition waits for the
// previous one), far from throughput-bound: 566.4, 301.8 and 477.2 TFLOP/s
// against 989 dense bf16 peak (the first rank's E pays for its runs' maps,
// which the counted work leaves out). They are near HBM's, though: the
// middle rank's summary moves ~2.9 GB (K_, W, U, Q^, A in, H out; ncu), ~3.4
// TB/s at this pace, so the next gains need fewer bytes rather than shorter
// chains (kernels/cuda/PERF_NOTES.md, twenty-eighth session). The
// backward's GEMMs read 1.07 GB of H and dO (0.224 ms at 4.8 TB/s): 242.0
// TFLOP/s. The additive rules' backward keeps the reverse-scan pre-pass, at
// its rate of the fifteenth session (KDA's scan, 274,877,906,944 FLOP in
// 2.752 ms: 99.9 TFLOP/s). The check against a second measurement (Gated
// DeltaNet: 0.892 / 0.683 / 0.287 ms) is in tests/test_cp_model.cpp.
// (Before: the twenty-seventh session, the warpgroups in phase, 1.005 / 0.754
// / 0.654 / 0.284 ms at 512.8, 273.4, 472.8, 242.0 TFLOP/s; the twenty-sixth,
// the scan untransposed (an S copy and V' through shared memory, two CTA
// barriers a step), 1.078 / 0.787 / 0.663 / 0.284 ms; the twenty-fifth, the
// fold and the Horner steps one launch per map product, 1.113 / 0.790 / 0.678
// / 0.290 ms; the twenty-fourth, E and
// the maps as two grids and the pre-pass one GEMM call per run, 1.118 / 0.787
// / 0.663 / 0.374 ms, and with cp.async loads 2.005 / 1.311 / 1.064 / 0.377
// ms; the nineteenth, one scan per row, 3.888 / 2.029 / 3.016 / 0.362 ms at
// 132.6, 101.6, 102.5, 189.8 TFLOP/s; the fifteenth, the pre-pass a reverse
// scan, 3.100 / 2.038 / 2.752 ms; the twelfth 2.988 / 1.882 / 2.962 ms;
// 2026-12-01 3.135 / 1.916 / 3.897 ms; 2026-11-30 with the wmma scans: 8.07 /
// 5.53 / 8.21 ms; fourth session: E+M one after the other 11.49 ms, E 5.71, a
// prepare + scan pre-pass 23.53; tests that replay runs of those days use
// their own figures.)
inline constexpr double kSummaryFwdFlopsPerS = 515396075520.0 / 0.910e-3;    // 566.4 TFLOP/s
inline constexpr double kSummaryFirstFlopsPerS = 206158430208.0 / 0.683e-3;  // 301.8 TFLOP/s
inline constexpr double kSummaryMapsFlopsPerS = 309237645312.0 / 0.648e-3;   // 477.2 TFLOP/s
inline constexpr double kSummaryBwdFlopsPerS = 68719476736.0 / 0.284e-3;     // 242.0 TFLOP/s
inline constexpr double kPrepassScanFlopsPerS = 274877906944.0 / 2.752e-3;   // 99.9 TFLOP/s
// Where and when the rates above were measured (for the bench's notes).
inline constexpr char kSummaryCalibration[] = "H200, 2026-12-04";

// The GPU the summary and merge run on. Defaults: one H200, 4.8 TB/s HBM3e;
// the calibrated summary rates above; 5 us per kernel launch.
struct CpGpuModel {
  double summary_fwd_flops_per_s = kSummaryFwdFlopsPerS;
  double summary_first_flops_per_s = kSummaryFirstFlopsPerS;  // the first rank's E alone
  double summary_maps_flops_per_s = kSummaryMapsFlopsPerS;    // the last rank's maps alone
  double summary_bwd_flops_per_s = kSummaryBwdFlopsPerS;      // delta rules: the H^T dO GEMM
  double prepass_scan_flops_per_s = kPrepassScanFlopsPerS;    // additive rules' reverse scan
  double hbm_Bps = 4.8e12;
  double launch_s = 5e-6;
};

// Single-GPU times of one layer measured on one H200 at the README shape
// (B=1, T=131072, H=16, D=128, bf16, chunk 64; README.md's Performance
// table, cp_model.cpp names the session): the local forward, and forward +
// backward.
// bwd_prepare_share: the backward's prepare stage (its state-independent
// tiles) as a share of the local backward, both from one --cp-measure run
// (delta rules; 0 where not measured).
struct CpReferenceTimes {
  double fwd_ms = 0, fwd_bwd_ms = 0;
  double bwd_prepare_share = 0;
  double bwd_ms() const { return fwd_bwd_ms - fwd_ms; }
};
CpReferenceTimes cp_h200_reference_128k(Variant variant);

// Single-GPU times of one layer, ms. merge_ms is per direction (forward and
// backward each merge once). summary_fwd_ms is a middle rank's (E and the
// maps), summary_fwd_first_ms what P = 2 waits for: the slower of the first
// rank's E alone and the last rank's maps alone (delta rules; they run at
// the same time on the two ranks); < 0 means not known, and P = 2 then pays
// summary_fwd_ms (never a silent zero). A P = 2 time above the middle rank's
// is capped at it (both are parts of the middle rank's work).
// bwd_prepare_ms (delta rules): the backward's prepare stage, part of bwd_ms.
// CpMixer queues it on the compute stream while the pre-pass GEMMs and then
// the reverse exchange run on the exchange stream (parallel/cp_mixer_cuda.cpp,
// backward steps 1 and 2), and the local backward waits for both: the
// reverse exchange hides behind what is left of it after the pre-pass. < 0:
// not known, nothing hidden there. Additive rules run their pre-pass scan on
// the prepared tiles, so it is never beside anything.
struct CpLocalTimes {
  double fwd_ms = 0, bwd_ms = 0;
  double summary_fwd_ms = 0, summary_fwd_first_ms = -1, summary_bwd_ms = 0;
  double merge_ms = 0;
  double bwd_prepare_ms = -1;
};

// Fills the summary and merge times from the counted work (the larger of the
// FLOP time at the calibrated rate and the HBM time, plus one launch; merge:
// read and write one state in HBM, plus one launch), and, when bwd_ms < 0,
// bwd = fwd x the variant's measured bwd/fwd ratio of cp_h200_reference_128k
// (an assumption for other shapes, which the output must label); the
// backward's prepare stage as the reference's share of bwd, where measured.
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

// Output in the manner of nccl-tests: '#'-headed lines, units on every column.
// `notes` are printed as '#' lines before the column header (where the times
// came from). The JSON is an array of the same rows.
std::string format_cp_model_table(const CpLayer& layer, const CpLocalTimes& times,
                                  const CpModelConfig& config, const CpModelResult& result,
                                  const std::vector<std::string>& notes);
std::string format_cp_model_json(const CpModelResult& result);

}  // namespace statescan
