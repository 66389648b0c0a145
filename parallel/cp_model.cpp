#include "parallel/cp_model.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "core/error.h"

namespace statescan {
namespace {

bool diagonal_maps(const CpLayer& l) {
  return !has_beta(l.variant);
}

int64_t chunks_of(const CpLayer& l) {
  return (l.seq_len + l.chunk - 1) / l.chunk;
}

void check_layer(const CpLayer& l) {
  SS_CHECK_ARG(l.batch >= 1, "batch", "must be >= 1, got ", l.batch);
  SS_CHECK_ARG(l.seq_len >= 1, "seq_len", "must be >= 1, got ", l.seq_len);
  SS_CHECK_ARG(l.heads >= 1, "heads", "must be >= 1, got ", l.heads);
  SS_CHECK_ARG(l.dk >= 1 && l.dv >= 1, "dk", "head dims must be >= 1, got ", l.dk, "x", l.dv);
  SS_CHECK_ARG(l.chunk >= 1, "chunk", "must be >= 1, got ", l.chunk);
}

void check_link(const LinkModel& m) {
  SS_CHECK_ARG(m.latency_s >= 0, "link-latency-us", "must be >= 0");
  SS_CHECK_ARG(m.bandwidth_Bps > 0, "link-bw-GBps", "must be > 0");
  SS_CHECK_ARG(m.compose_flops_per_s > 0, "compose-TFLOPs", "must be > 0");
  if (m.gpus_per_node > 0) {
    SS_CHECK_ARG(m.inter_latency_s >= 0, "ib-latency-us", "must be >= 0");
    SS_CHECK_ARG(m.inter_bandwidth_Bps > 0, "ib-bw-GBps", "must be > 0");
  }
}

// What the reverse exchange can hide behind (CpLocalTimes::bwd_prepare_ms):
// the backward's prepare stage less the pre-pass queued beside it (counted
// whole: beside the prepare it shares HBM and hides little, PERF_NOTES,
// twenty-eighth session). Zero for additive rules and where not known.
double prepare_slack_ms(const CpLayer& layer, const CpLocalTimes& t) {
  if (diagonal_maps(layer) || t.bwd_prepare_ms <= 0) return 0;
  return std::max(0.0, t.bwd_prepare_ms - t.summary_bwd_ms);
}

// The forward summary P = 2 waits for (CpLocalTimes); when not known (< 0),
// the full one; never more than the full one.
double first_rank_summary_ms(const CpLocalTimes& t) {
  return t.summary_fwd_first_ms < 0 ? t.summary_fwd_ms
                                    : std::min(t.summary_fwd_first_ms, t.summary_fwd_ms);
}

}  // namespace

int64_t cp_map_bytes(const CpLayer& l) {
  const int64_t m = diagonal_maps(l) ? l.dk : l.dk * l.dk;
  return l.batch * l.heads * (m + l.dk * l.dv) * 4;
}

int64_t cp_state_bytes(const CpLayer& l) {
  return l.batch * l.heads * l.dk * l.dv * 4;
}

int64_t cp_apply_flops(const CpLayer& l) {
  // Same count CpMixer passes to resolve_exchange.
  return 2 * l.batch * l.heads * (diagonal_maps(l) ? l.dk : l.dk * l.dk) * l.dv;
}

double cp_summary_flops(const CpLayer& l, bool backward) {
  const double C = static_cast<double>(l.chunk), k = static_cast<double>(l.dk),
               v = static_cast<double>(l.dv);
  double per_chunk;
  if (diagonal_maps(l)) {
    per_chunk = 2 * C * k * v + k * v;
  } else if (!backward) {
    per_chunk = 2 * C * k * k + 2 * k * k * k + 2 * C * k * v + 2 * k * k * v +
                (2 * C * k * k + 2 * C * C * k);
  } else {
    per_chunk = 2 * C * k * v;
  }
  return per_chunk * static_cast<double>(chunks_of(l) * l.batch * l.heads);
}

double cp_summary_maps_flops(const CpLayer& l) {
  if (diagonal_maps(l)) return 0.0;
  const double C = static_cast<double>(l.chunk), k = static_cast<double>(l.dk);
  const double per_chunk = 2 * C * k * k + 2 * k * k * k + (2 * C * k * k + 2 * C * C * k);
  return per_chunk * static_cast<double>(chunks_of(l) * l.batch * l.heads);
}

double cp_summary_first_flops(const CpLayer& l) {
  const double C = static_cast<double>(l.chunk), k = static_cast<double>(l.dk),
               v = static_cast<double>(l.dv);
  // Additive rules: M is the gates' running product (Dk per chunk, not
  // counted), so E is the whole count.
  const double per_chunk = diagonal_maps(l) ? 2 * C * k * v + k * v : 2 * C * k * v + 2 * k * k * v;
  return per_chunk * static_cast<double>(chunks_of(l) * l.batch * l.heads);
}

double cp_summary_bytes(const CpLayer& l, bool backward) {
  const double es = static_cast<double>(size_of(l.dtype));
  if (backward && !diagonal_maps(l))
    return es * static_cast<double>(l.dk + l.dv) *
           static_cast<double>(l.batch * l.seq_len * l.heads);
  const double gates =
      has_gate(l.variant) ? (vector_gate(l.variant) ? 4.0 * static_cast<double>(l.dk) : 4.0) : 0.0;
  const double per_token =
      es * static_cast<double>(l.dk + l.dv) + gates + (has_beta(l.variant) ? es : 0.0);
  return per_token * static_cast<double>(l.batch * l.seq_len * l.heads);
}

CpReferenceTimes cp_h200_reference_128k(Variant v) {
  // README.md's Performance tables: statescan-bench --backward on one H200,
  // B=1, T=131072, H=16, D=128, bf16, chunk 64, 2026-12-02, forward ms (with
  // the chunk states saved) and forward + backward ms of the same run, all
  // six from one call of the eighteenth session (DeltaNet and Gated DeltaNet
  // with T saved by the forward, their default since then).
  switch (v) {
    case Variant::linear:
      return {1.948, 5.839};
    case Variant::retention:
      return {4.520, 11.701};
    case Variant::gla:
      return {5.948, 18.809};
    // The backward's prepare stage as a share of the local backward:
    // --cp-measure on one H200, same shape, 2026-12-04 (twenty-eighth
    // session; medians of 20): KDA 4.272 of 19.868 ms, Gated DeltaNet 2.636
    // of 13.300 and 2.646 of 13.296 (DeltaNet not measured).
    case Variant::deltanet:
      return {5.622, 16.392};
    case Variant::gated_deltanet:
      return {5.794, 18.407, 0.1986};
    case Variant::kda:
      return {7.402, 27.170, 0.2150};
  }
  SS_FAIL("variant", "no H200 reference times");
}

CpLocalTimes estimate_local_times(const CpLayer& layer, double fwd_ms, double bwd_ms,
                                  const CpGpuModel& gpu) {
  check_layer(layer);
  SS_CHECK_ARG(fwd_ms > 0, "fwd-ms", "must be > 0, got ", fwd_ms);
  SS_CHECK_ARG(gpu.summary_fwd_flops_per_s > 0 && gpu.summary_first_flops_per_s > 0 &&
                   gpu.summary_maps_flops_per_s > 0 && gpu.summary_bwd_flops_per_s > 0 &&
                   gpu.prepass_scan_flops_per_s > 0,
               "summary-TFLOPs", "must be > 0");
  SS_CHECK_ARG(gpu.hbm_Bps > 0, "hbm-GBps", "must be > 0");
  CpLocalTimes t;
  t.fwd_ms = fwd_ms;
  const CpReferenceTimes ref = cp_h200_reference_128k(layer.variant);
  t.bwd_ms = bwd_ms < 0 ? fwd_ms * ref.bwd_ms() / ref.fwd_ms : bwd_ms;
  if (!diagonal_maps(layer) && ref.bwd_prepare_share > 0)
    t.bwd_prepare_ms = ref.bwd_prepare_share * t.bwd_ms;
  // Counted FLOPs at the rate calibrated on the measured summary (a sequential
  // scan over chunks); the reads of k, v, gates, beta are the floor when the
  // FLOPs are few (additive rules).
  auto summary_ms = [&](double flops, double flops_per_s, bool backward = false) {
    const double byte_s = cp_summary_bytes(layer, backward) / gpu.hbm_Bps;
    return 1e3 * (std::max(flops / flops_per_s, byte_s) + gpu.launch_s);
  };
  t.summary_fwd_ms = summary_ms(cp_summary_flops(layer, false), gpu.summary_fwd_flops_per_s);
  // P = 2: the first rank's E beside the last rank's maps (delta rules).
  t.summary_fwd_first_ms = summary_ms(cp_summary_first_flops(layer), gpu.summary_first_flops_per_s);
  if (!diagonal_maps(layer))
    t.summary_fwd_first_ms =
        std::max(t.summary_fwd_first_ms,
                 summary_ms(cp_summary_maps_flops(layer), gpu.summary_maps_flops_per_s));
  t.summary_bwd_ms = summary_ms(cp_summary_flops(layer, true),
                                diagonal_maps(layer) ? gpu.prepass_scan_flops_per_s
                                                     : gpu.summary_bwd_flops_per_s,
                                true);
  // Merge: the incoming state is written where the local pass reads its
  // initial state: one read and one write of the fp32 state.
  t.merge_ms =
      1e3 * (2.0 * static_cast<double>(cp_state_bytes(layer)) / gpu.hbm_Bps + gpu.launch_s);
  return t;
}

CpModelResult predict_cp_scaling(const CpLayer& layer, const CpLocalTimes& times,
                                 const CpModelConfig& config) {
  check_layer(layer);
  check_link(config.link);
  SS_CHECK_ARG(times.fwd_ms > 0, "fwd-ms", "must be > 0, got ", times.fwd_ms);
  SS_CHECK_ARG(times.bwd_ms > 0, "bwd-ms", "must be > 0, got ", times.bwd_ms);
  SS_CHECK_ARG(times.summary_fwd_ms >= 0 && times.summary_bwd_ms >= 0, "summary-ms",
               "must be >= 0");
  SS_CHECK_ARG(times.merge_ms >= 0, "merge-ms", "must be >= 0");
  SS_CHECK_ARG(times.bwd_prepare_ms <= times.bwd_ms, "bwd-prepare-ms",
               "must not exceed the backward it is part of: ", times.bwd_prepare_ms, " > ",
               times.bwd_ms);
  SS_CHECK_ARG(config.overlap >= 0 && config.overlap <= 1, "overlap", "must be in [0, 1], got ",
               config.overlap);
  SS_CHECK_ARG(config.max_ranks >= 2, "P", "must be >= 2, got ", config.max_ranks);

  const int64_t map_bytes = cp_map_bytes(layer), state_bytes = cp_state_bytes(layer);
  const int64_t apply_flops = cp_apply_flops(layer);
  CpModelResult out;
  out.single_ms = times.fwd_ms + times.bwd_ms;
  // P = 2 waits for the first rank's E alone, P >= 3 for a middle rank's E
  // and M (see the header); E is a part of the middle rank's work.
  const double first_ms = first_rank_summary_ms(times);
  const double bwd_slack = prepare_slack_ms(layer, times);
  auto step = [&](int P, double exchange_ms, double overlap) {
    const double summary_fwd_ms = P == 2 ? first_ms : times.summary_fwd_ms;
    // Backward's reverse scan has the same sizes as forward's scan.
    return out.single_ms + summary_fwd_ms + times.summary_bwd_ms + 2 * times.merge_ms +
           std::max(0.0, exchange_ms - overlap * times.fwd_ms) +
           std::max(0.0, exchange_ms - std::max(overlap * times.bwd_ms, bwd_slack));
  };
  for (int P = 2; P <= config.max_ranks; P *= 2) {
    const Exchange pick =
        resolve_exchange(Exchange::automatic, P, map_bytes, state_bytes, apply_flops, config.link);
    CpAutoChoice choice;
    choice.ranks = P;
    choice.pick = pick;
    choice.runner_up_ms = INFINITY;
    for (Exchange e : {Exchange::allgather, Exchange::ring, Exchange::tree}) {
      const double x_ms =
          1e3 * predicted_exchange_seconds(e, P, map_bytes, state_bytes, apply_flops, config.link);
      CpModelRow r;
      r.ranks = P;
      r.nodes = config.link.gpus_per_node > 0
                    ? (P + config.link.gpus_per_node - 1) / config.link.gpus_per_node
                    : 0;
      r.exchange = e;
      r.auto_pick = e == pick;
      r.bytes_per_rank = predicted_exchange_bytes(e, P, map_bytes, state_bytes);
      r.exchange_fwd_ms = r.exchange_bwd_ms = x_ms;
      r.step_ms = step(P, x_ms, config.overlap);
      r.overhead = r.step_ms / out.single_ms - 1;
      r.efficiency = out.single_ms / r.step_ms;
      r.step_hidden_ms = step(P, x_ms, 1.0);
      r.efficiency_hidden = out.single_ms / r.step_hidden_ms;
      out.rows.push_back(r);
      if (e == pick) {
        choice.pick_ms = x_ms;
      } else if (x_ms < choice.runner_up_ms) {
        choice.runner_up_ms = x_ms;
        choice.runner_up = e;
      }
    }
    // Why: the share of the pick's time that is per-message latency (the rest
    // is bandwidth and composing), from the same model with zero latency.
    LinkModel no_latency = config.link;
    no_latency.latency_s = no_latency.inter_latency_s = 0;
    const double bandwidth_ms =
        1e3 * predicted_exchange_seconds(pick, P, map_bytes, state_bytes, apply_flops, no_latency);
    choice.pick_latency_share = choice.pick_ms > 0 ? 1 - bandwidth_ms / choice.pick_ms : 0;
    out.choices.push_back(choice);
    if (P > config.max_ranks / 2) break;  // avoids overflow at INT_MAX
  }
  return out;
}

namespace {

std::string fmt(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* format, ...) {
  char buf[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buf, sizeof buf, format, args);
  va_end(args);
  return buf;
}

std::string link_text(const LinkModel& m) {
  std::string s =
      fmt("%.0f GB/s per direction, %.1f us per message", m.bandwidth_Bps / 1e9, m.latency_s * 1e6);
  if (m.gpus_per_node > 0)
    s += fmt(" within nodes of %d GPUs; between nodes %.0f GB/s, %.1f us", m.gpus_per_node,
             m.inter_bandwidth_Bps / 1e9, m.inter_latency_s * 1e6);
  return s;
}

}  // namespace

std::string format_cp_model_table(const CpLayer& layer, const CpLocalTimes& times,
                                  const CpModelConfig& config, const CpModelResult& result,
                                  const std::vector<std::string>& notes) {
  std::string s;
  s += "# statescan-bench --cp-model: predicted per-layer step time (forward + backward) under\n";
  s += "# context parallelism, weak scaling (every rank holds T tokens)\n";
  s += fmt("#  variant %s  B %lld  T/rank %lld  H %lld  Dk %lld  Dv %lld  chunk %lld  dtype %s\n",
           to_string(layer.variant), static_cast<long long>(layer.batch),
           static_cast<long long>(layer.seq_len), static_cast<long long>(layer.heads),
           static_cast<long long>(layer.dk), static_cast<long long>(layer.dv),
           static_cast<long long>(layer.chunk), to_string(layer.dtype));
  s += fmt("#  maps %lld B/rank (%s M + E, fp32), state %lld B/rank, apply %.3g FLOP\n",
           static_cast<long long>(cp_map_bytes(layer)),
           diagonal_maps(layer) ? "diagonal" : "full Dk x Dk",
           static_cast<long long>(cp_state_bytes(layer)),
           static_cast<double>(cp_apply_flops(layer)));
  s +=
      fmt("#  local fwd %.3f ms  bwd %.3f ms  summary fwd %.3f ms (P = 2: %.3f ms)  "
          "bwd %.3f ms  merge %.4f ms x2\n",
          times.fwd_ms, times.bwd_ms, times.summary_fwd_ms, first_rank_summary_ms(times),
          times.summary_bwd_ms, times.merge_ms);
  for (const std::string& n : notes) s += "#  " + n + "\n";
  s += "#  link: " + link_text(config.link) +
       fmt("; compose %.0f TFLOP/s\n", config.link.compose_flops_per_s / 1e12);
  s += "#  t(1) = fwd + bwd; t(P) = t(1) + summary fwd(P) + summary bwd + 2 merge\n";
  s += "#         + max(0, exch - overlap*fwd) + max(0, exch - max(overlap*bwd, slack))\n";
  const double slack = prepare_slack_ms(layer, times);
  if (slack > 0)
    s +=
        fmt("#  slack %.3f ms = the backward's prepare stage (%.3f ms) less the pre-pass, which\n"
            "#  CpMixer runs beside it with the reverse exchange after it (delta rules)\n",
            slack, times.bwd_prepare_ms);
  else
    s +=
        "#  slack 0: no prepare stage beside the reverse exchange (additive rules, or not known)\n";
  s += "#  summary fwd(2) = the first rank's E or the last rank's maps (delta rules), the "
       "slower;\n";
  s += "#  summary fwd(P >= 3) = a middle rank's E beside its maps; summary bwd = delta rules:\n";
  s += "#  one H^T dO GEMM from the forward's maps, additive rules: the reverse-scan pre-pass\n";
  s += fmt("#  overlap %.2f of the local pass hides the exchange (state-independent A/W/U work);\n",
           config.overlap);
  s += "#  the *_hid columns are the optimistic bound overlap = 1. The summary is never hidden:\n";
  s += "#  it produces what the exchange sends.\n";
  s += fmt("#  t(1) = %.3f ms\n#\n", result.single_ms);
  s += fmt("# %5s %5s %9s %12s %10s %10s %10s %9s %7s %10s %7s %4s\n", "P", "nodes", "exchange",
           "bytes/rank", "exch_fwd", "exch_bwd", "step", "overhead", "eff", "step_hid", "eff_hid",
           "auto");
  s += fmt("# %5s %5s %9s %12s %10s %10s %10s %9s %7s %10s %7s %4s\n", "(GPU)", "", "", "(B)",
           "(ms)", "(ms)", "(ms)", "(%)", "(%)", "(ms)", "(%)", "(*)");
  for (const CpModelRow& r : result.rows)
    s += fmt("  %5d %5s %9s %12lld %10.4f %10.4f %10.3f %9.2f %7.1f %10.3f %7.1f %4s\n", r.ranks,
             r.nodes > 0 ? std::to_string(r.nodes).c_str() : "-", to_string(r.exchange),
             static_cast<long long>(r.bytes_per_rank), r.exchange_fwd_ms, r.exchange_bwd_ms,
             r.step_ms, 100 * r.overhead, 100 * r.efficiency, r.step_hidden_ms,
             100 * r.efficiency_hidden, r.auto_pick ? "*" : "-");
  s += "#\n# (*) the exchange `auto` picks: resolve_exchange takes the smallest predicted\n"
       "# exchange time (one direction). The latency share of that time says why:\n"
       "# latency-bound, fewer messages win; bandwidth-bound, fewer bytes win.\n";
  for (const CpAutoChoice& c : result.choices)
    s += fmt("#  P %5d: %-9s %9.4f ms (%2.0f%% latency); next best %-9s %9.4f ms (%.0f%% slower)\n",
             c.ranks, to_string(c.pick), c.pick_ms, 100 * c.pick_latency_share,
             to_string(c.runner_up), c.runner_up_ms, 100 * c.margin());
  // Issue 5's goal: summary + exchange + merge under 5 % of local fwd + bwd.
  double lo = INFINITY, hi = 0;
  int lo_p = 0, hi_p = 0;
  for (const CpModelRow& r : result.rows) {
    if (!r.auto_pick) continue;
    if (r.overhead < lo) lo = r.overhead, lo_p = r.ranks;
    if (r.overhead > hi) hi = r.overhead, hi_p = r.ranks;
  }
  s +=
      fmt("# overhead with auto: %.2f %% (P %d) to %.2f %% (P %d); summary + pre-pass alone "
          "%.2f %% (P >= 3); goal < 5 %%\n",
          100 * lo, lo_p, 100 * hi, hi_p,
          100 * (times.summary_fwd_ms + times.summary_bwd_ms) / result.single_ms);
  return s;
}

std::string format_cp_model_json(const CpModelResult& result) {
  std::ostringstream out;
  out.precision(6);
  out << "[\n";
  for (std::size_t i = 0; i < result.rows.size(); ++i) {
    const CpModelRow& r = result.rows[i];
    const CpAutoChoice& c = result.choices[i / 3];
    out << "  {\"op\": \"cp_model\", \"P\": " << r.ranks << ", \"nodes\": " << r.nodes
        << ", \"exchange\": \"" << to_string(r.exchange)
        << "\", \"auto_pick\": " << (r.auto_pick ? "true" : "false")
        << ", \"auto_margin\": " << c.margin()
        << ", \"auto_latency_share\": " << c.pick_latency_share
        << ", \"bytes_per_rank\": " << r.bytes_per_rank
        << ", \"exchange_fwd_ms\": " << r.exchange_fwd_ms
        << ", \"exchange_bwd_ms\": " << r.exchange_bwd_ms << ", \"step_ms\": " << r.step_ms
        << ", \"single_ms\": " << result.single_ms << ", \"overhead\": " << r.overhead
        << ", \"efficiency\": " << r.efficiency << ", \"step_hidden_ms\": " << r.step_hidden_ms
        << ", \"efficiency_hidden\": " << r.efficiency_hidden << "}"
        << (i + 1 < result.rows.size() ? "," : "") << "\n";
  }
  out << "]\n";
  return out.str();
}

}  // namespace statescan
