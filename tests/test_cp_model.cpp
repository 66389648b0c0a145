// The context-parallel scaling model (parallel/cp_model.h) and the exchange
// cost model it extends (parallel/exchange.h): growth in P of each exchange,
// a hand-calculated overhead, `auto` = argmin, presets and parse errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "parallel/cp_model.h"
#include "parallel/exchange.h"

namespace statescan {
namespace {

// Throws statescan::Error naming `argument`; fails the test otherwise.
template <typename F>
void expect_error_naming(const std::string& argument, F&& f) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
}

CpLayer layer_of(Variant v) {
  CpLayer l;
  l.variant = v;
  return l;  // B=1, T=128K per rank, H=16, D=128, chunk 64, bf16
}

double exchange_s(Exchange e, int P, const CpLayer& l, const LinkModel& link) {
  return predicted_exchange_seconds(e, P, cp_map_bytes(l), cp_state_bytes(l), cp_apply_flops(l),
                                    link);
}

struct LinkCase {
  LinkPreset preset;
  Variant variant;
};

class CpModelGrowth : public ::testing::TestWithParam<LinkCase> {};

// Ring: P-1 dependent hops, so each doubling of P adds twice the previous
// doubling's time (linear in P). On the hierarchical link every 8th hop is
// an IB hop, so linearity holds once P covers whole nodes.
TEST_P(CpModelGrowth, RingIsLinearInP) {
  const CpLayer l = layer_of(GetParam().variant);
  const LinkModel link = link_preset(GetParam().preset);
  for (int P = 16; P <= 256; P *= 2) {
    const double d1 =
        exchange_s(Exchange::ring, 2 * P, l, link) - exchange_s(Exchange::ring, P, l, link);
    const double d2 =
        exchange_s(Exchange::ring, 4 * P, l, link) - exchange_s(Exchange::ring, 2 * P, l, link);
    EXPECT_NEAR(d2 / d1, 2.0, 1e-9) << "P=" << P;
  }
}

// Tree: one more round per doubling of P (log P), a constant increment once
// every round crosses the slowest link.
TEST_P(CpModelGrowth, TreeIsLogarithmicInP) {
  const CpLayer l = layer_of(GetParam().variant);
  const LinkModel link = link_preset(GetParam().preset);
  const double step =
      exchange_s(Exchange::tree, 32, l, link) - exchange_s(Exchange::tree, 16, l, link);
  EXPECT_GT(step, 0);
  for (int P = 32; P <= 512; P *= 2) {
    const double d =
        exchange_s(Exchange::tree, 2 * P, l, link) - exchange_s(Exchange::tree, P, l, link);
    EXPECT_NEAR(d / step, 1.0, 1e-9) << "P=" << P;
  }
}

// All-gather: every rank receives (and forwards) every other rank's maps.
TEST_P(CpModelGrowth, AllgatherBytesGrowWithP) {
  const CpLayer l = layer_of(GetParam().variant);
  const int64_t map = cp_map_bytes(l), state = cp_state_bytes(l);
  for (int P = 2; P < 1024; P *= 2) {
    EXPECT_EQ(predicted_exchange_bytes(Exchange::allgather, 2 * P, map, state), (2 * P - 1) * map);
    EXPECT_GT(predicted_exchange_bytes(Exchange::allgather, 2 * P, map, state),
              predicted_exchange_bytes(Exchange::allgather, P, map, state));
    EXPECT_EQ(predicted_exchange_bytes(Exchange::ring, P, map, state), state);
  }
}

// `auto` is the argmin of the predicted exchange times, for every P.
TEST_P(CpModelGrowth, AutoIsArgmin) {
  const CpLayer l = layer_of(GetParam().variant);
  CpModelConfig config;
  config.link = link_preset(GetParam().preset);
  const CpModelResult r = predict_cp_scaling(l, estimate_local_times(l, 16.0, -1), config);
  ASSERT_EQ(r.rows.size(), 30u);  // P = 2..1024, three exchanges each
  for (std::size_t i = 0; i < r.rows.size(); i += 3) {
    const auto best = std::min_element(r.rows.begin() + i, r.rows.begin() + i + 3,
                                       [](const CpModelRow& a, const CpModelRow& b) {
                                         return a.exchange_fwd_ms < b.exchange_fwd_ms;
                                       });
    int picks = 0;
    for (std::size_t j = i; j < i + 3; ++j) picks += r.rows[j].auto_pick;
    EXPECT_EQ(picks, 1);
    EXPECT_TRUE(best->auto_pick) << "P=" << best->ranks;
    const CpAutoChoice& c = r.choices[i / 3];
    EXPECT_EQ(c.pick, best->exchange);
    EXPECT_GE(c.margin(), 0);
    EXPECT_GE(c.pick_latency_share, 0);
    EXPECT_LE(c.pick_latency_share, 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Links, CpModelGrowth,
                         ::testing::Values(LinkCase{LinkPreset::nvlink, Variant::kda},
                                           LinkCase{LinkPreset::ib, Variant::gated_deltanet},
                                           LinkCase{LinkPreset::hierarchical, Variant::kda},
                                           LinkCase{LinkPreset::hierarchical, Variant::gla}),
                         [](const auto& info) {
                           return std::string(to_string(info.param.preset)) + "_" +
                                  to_string(info.param.variant);
                         });

// The performance item's shape: KDA, T = 128K per rank, H = 16, D = 128,
// bf16, fwd 16.362 ms (README's H200 figure), bwd assumed 2 x fwd, NVLink
// preset, P = 2. By hand:
//   summary fwd: per chunk and head 2*64*128^2 + 2*128^3 + 2*64*128^2 + 2*128^3
//                = 12,582,912 FLOP, x 2048 chunks x 16 heads = 4.1232e11 FLOP
//                at 300 TFLOP/s = 1.37439 ms (+ 5 us launch)
//   summary bwd: 8,388,608 x 32768 = 2.7488e11 FLOP = 0.91626 ms (+ 5 us)
//   merge:       2 x 1 MiB at 4.8 TB/s + 5 us = 0.0054369 ms, twice
//   exchange:    auto = allgather: 8 us + 2 MiB / 360 GB/s + 6.7e7 FLOP / 300 TFLOP/s
//                = 14.049 us per direction
//   overhead = (1.37939 + 0.92126 + 0.01087 + 0.02810) / 49.086 = 4.766 %
TEST(CpModel, KdaOverheadMatchesHandCalculation) {
  const CpLayer l = layer_of(Variant::kda);
  const CpLocalTimes t = estimate_local_times(l, 16.362, -1);
  EXPECT_NEAR(t.bwd_ms, 32.724, 1e-12);
  EXPECT_NEAR(t.summary_fwd_ms, 1.37939, 1e-5);
  EXPECT_NEAR(t.summary_bwd_ms, 0.92126, 1e-5);
  EXPECT_NEAR(t.merge_ms, 0.0054369, 1e-7);
  CpModelConfig config;  // NVLink preset, overlap 0
  const CpModelResult r = predict_cp_scaling(l, t, config);
  EXPECT_NEAR(r.single_ms, 49.086, 1e-9);
  const CpModelRow& p2 = r.rows[0];
  ASSERT_EQ(p2.ranks, 2);
  ASSERT_EQ(p2.exchange, Exchange::allgather);
  EXPECT_TRUE(p2.auto_pick);
  EXPECT_NEAR(p2.exchange_fwd_ms, 0.014049, 1e-6);
  EXPECT_NEAR(p2.overhead, 0.04766, 5e-5);
  EXPECT_NEAR(p2.efficiency, 1 / 1.04766, 5e-5);
  // With the exchange hidden, only the summary and the merges remain.
  EXPECT_NEAR(p2.step_hidden_ms, 49.086 + 1.37939 + 0.92126 + 2 * 0.0054369, 1e-5);
}

// Overlap hides the exchange behind the local pass, never the summary.
TEST(CpModel, OverlapHidesExchangeNotSummary) {
  const CpLayer l = layer_of(Variant::kda);
  const CpLocalTimes t = estimate_local_times(l, 16.362, -1);
  CpModelConfig config;
  config.link = link_preset(LinkPreset::hierarchical);
  config.overlap = 1;
  const CpModelResult r = predict_cp_scaling(l, t, config);
  const double floor_ms = r.single_ms + t.summary_fwd_ms + t.summary_bwd_ms + 2 * t.merge_ms;
  for (const CpModelRow& row : r.rows) {
    EXPECT_GE(row.step_ms, floor_ms - 1e-12);
    EXPECT_DOUBLE_EQ(row.step_ms, row.step_hidden_ms);
  }
}

// Up to one node the hierarchical link is NVLink; beyond it IB is paid.
TEST(CpModel, HierarchicalIsNvlinkWithinANode) {
  const CpLayer l = layer_of(Variant::kda);
  const LinkModel nv = link_preset(LinkPreset::nvlink),
                  hier = link_preset(LinkPreset::hierarchical, 8);
  for (Exchange e : {Exchange::allgather, Exchange::ring, Exchange::tree}) {
    for (int P = 2; P <= 8; P *= 2)
      EXPECT_DOUBLE_EQ(exchange_s(e, P, l, hier), exchange_s(e, P, l, nv)) << to_string(e);
    EXPECT_GT(exchange_s(e, 16, l, hier), exchange_s(e, 16, l, nv)) << to_string(e);
  }
}

// The flat defaults CpMixer uses behave as before the extension: the ring
// costs (P-1 + blocks-1) equal pipelined hops.
TEST(CpModel, FlatDefaultLinkUnchanged) {
  const LinkModel link;  // host MPI defaults
  EXPECT_EQ(link.gpus_per_node, 0);
  const int64_t map = 1 << 20, state = 1 << 19, flops = 1 << 24;
  const double apply = flops / link.compose_flops_per_s;
  for (int P : {2, 3, 7, 64}) {
    const double hop = link.latency_s + state / 4.0 / link.bandwidth_Bps + apply / 4;
    EXPECT_NEAR(predicted_exchange_seconds(Exchange::ring, P, map, state, flops, link),
                (P - 1 + 3) * hop, 1e-15);
    EXPECT_NEAR(predicted_exchange_seconds(Exchange::allgather, P, map, state, flops, link),
                (P - 1) * (link.latency_s + map / link.bandwidth_Bps + apply), 1e-15);
  }
}

TEST(CpModel, TableAndJsonHaveRowsUpTo1024) {
  const CpLayer l = layer_of(Variant::gated_deltanet);
  const CpLocalTimes t = estimate_local_times(l, 12.763, -1);
  const CpModelConfig config;
  const CpModelResult r = predict_cp_scaling(l, t, config);
  const std::string table = format_cp_model_table(l, t, config, r, {"note"});
  EXPECT_NE(table.find("\n   1024 "), std::string::npos) << table;
  EXPECT_NE(table.find("(ms)"), std::string::npos);
  const std::string json = format_cp_model_json(r);
  EXPECT_EQ(std::count(json.begin(), json.end(), '{'), 30);
  EXPECT_NE(json.find("\"P\": 1024"), std::string::npos);
}

TEST(CpModel, ParseErrorsNameTheArgument) {
  expect_error_naming("--link", [] { parse_link_preset("nvlnk", "--link"); });
  expect_error_naming("--link-bw-GBps", [] { parse_positive_number("fast", "--link-bw-GBps"); });
  expect_error_naming("--link-bw-GBps", [] { parse_positive_number("-3", "--link-bw-GBps"); });
  expect_error_naming("--link-latency-us", [] { parse_positive_number("", "--link-latency-us"); });
  expect_error_naming("--fwd-ms", [] { parse_positive_number("12ms", "--fwd-ms"); });
  expect_error_naming("gpus_per_node", [] { link_preset(LinkPreset::hierarchical, 0); });
  EXPECT_EQ(parse_link_preset("hierarchical"), LinkPreset::hierarchical);
  EXPECT_DOUBLE_EQ(parse_positive_number("450", "--link-bw-GBps"), 450.0);
}

TEST(CpModel, BadModelInputsNameTheField) {
  const CpLayer l = layer_of(Variant::kda);
  const CpLocalTimes t = estimate_local_times(l, 16.0, -1);
  CpModelConfig config;
  config.overlap = 1.5;
  expect_error_naming("overlap", [&] { predict_cp_scaling(l, t, config); });
  config = CpModelConfig{};
  config.max_ranks = 1;
  expect_error_naming("P", [&] { predict_cp_scaling(l, t, config); });
  config = CpModelConfig{};
  config.link.bandwidth_Bps = 0;
  expect_error_naming("link-bw-GBps", [&] { predict_cp_scaling(l, t, config); });
  expect_error_naming("fwd-ms", [&] { estimate_local_times(l, 0, -1); });
}

}  // namespace
}  // namespace statescan
