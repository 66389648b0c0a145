// The metrics exporter: what /metrics serves over a real loopback socket after
// observer and step calls, the snapshot, argument checks, the FLOP model, and
// a CpMixer reporting through it.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "monitoring/flop_model.h"
#include "monitoring/metrics_exporter.h"
#include "tests/cp_test_util.h"

namespace statescan::test {
namespace {

// ---- a minimal HTTP client and exposition-format reader ----------------------

struct HttpResponse {
  int status = 0;
  std::string body;
};

// GET http://127.0.0.1:port/path with HTTP/1.0 (the server closes the
// connection after the body, so reading to EOF reads all of it).
HttpResponse http_get(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    throw std::runtime_error("connect() to port " + std::to_string(port) + " failed");
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  std::size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, 0);
    if (n <= 0) break;
    sent += static_cast<std::size_t>(n);
  }
  std::string raw;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;)
    raw.append(buf, static_cast<std::size_t>(n));
  ::close(fd);

  HttpResponse response;
  std::istringstream status_line(raw.substr(0, raw.find("\r\n")));
  std::string version;
  status_line >> version >> response.status;
  const std::size_t body = raw.find("\r\n\r\n");
  if (body != std::string::npos) response.body = raw.substr(body + 4);
  return response;
}

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Parses the sample lines of the Prometheus text format (comments skipped).
std::vector<Sample> parse_exposition(const std::string& text) {
  std::vector<Sample> samples;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    std::size_t pos = line.find_first_of("{ ");
    s.name = line.substr(0, pos);
    if (pos != std::string::npos && line[pos] == '{') {
      const std::size_t end = line.find('}', pos);
      std::string body = line.substr(pos + 1, end - pos - 1);
      std::size_t at = 0;
      while (at < body.size()) {
        const std::size_t eq = body.find('=', at);
        const std::size_t close = body.find('"', eq + 2);
        s.labels[body.substr(at, eq - at)] = body.substr(eq + 2, close - eq - 2);
        at = close + 2;  // past '",'
      }
      pos = end + 1;
    }
    s.value = std::strtod(line.c_str() + pos, nullptr);
    samples.push_back(s);
  }
  return samples;
}

// The value of the one sample with this name and (a superset of) these
// labels; NaN when there is none, +inf when there are several.
double value_of(const std::vector<Sample>& samples, const std::string& name,
                const std::map<std::string, std::string>& labels = {}) {
  double found = std::nan("");
  int matches = 0;
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool all = true;
    for (const auto& [k, v] : labels) {
      auto it = s.labels.find(k);
      all = all && it != s.labels.end() && it->second == v;
    }
    if (all) {
      found = s.value;
      ++matches;
    }
  }
  return matches > 1 ? INFINITY : found;
}

::testing::AssertionResult near(double actual, double expected) {
  if (std::isfinite(actual) &&
      std::abs(actual - expected) <= 1e-12 * std::max(1.0, std::abs(expected)))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << actual << " != " << expected;
}

const char* const kFamilies[] = {"statescan_tokens_total",         "statescan_step_seconds",
                                 "statescan_tokens_per_second",    "statescan_phase_seconds_total",
                                 "statescan_exchange_bytes_total", "statescan_achieved_tflops",
                                 "statescan_device_memory_bytes",  "statescan_errors_total"};

// ---- serving tests, parametrised over the variant label --------------------

class ServedMetrics : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    if (!MetricsExporter::serving_available()) GTEST_SKIP() << "built without Prometheus";
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    rank_ = static_cast<int>(rng_() % 64);
    MetricsOptions o;
    o.rank = rank_;
    o.variant = to_string(GetParam());
    o.port = 0;  // ephemeral: tests run in parallel
    metrics_ = std::make_unique<MetricsExporter>(o);
  }

  // civetweb's shutdown waits ~2 s once a request has been served; ctest runs
  // every test in its own process, so the exporter is left to process exit
  // instead (the test binaries' only intentional leak).
  void TearDown() override { metrics_.release(); }

  std::map<std::string, std::string> labels(std::map<std::string, std::string> extra = {}) const {
    extra["rank"] = std::to_string(rank_);
    extra["variant"] = to_string(GetParam());
    return extra;
  }

  std::vector<Sample> scrape() {
    const HttpResponse r = http_get(metrics_->port(), "/metrics");
    EXPECT_EQ(r.status, 200);
    return parse_exposition(r.body);
  }

  double uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng_);
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  int rank_ = 0;
  std::unique_ptr<MetricsExporter> metrics_;
};

TEST_P(ServedMetrics, ServesEveryFamilyOnLoopback) {
  EXPECT_TRUE(metrics_->serving());
  EXPECT_GT(metrics_->port(), 0);
  EXPECT_EQ(metrics_->address(), "127.0.0.1:" + std::to_string(metrics_->port()));
  const HttpResponse r = http_get(metrics_->port(), "/metrics");
  ASSERT_EQ(r.status, 200);
  for (const char* family : kFamilies) {
    EXPECT_NE(r.body.find(std::string("# TYPE ") + family + " "), std::string::npos) << family;
  }
  EXPECT_NE(r.body.find("# TYPE statescan_step_seconds histogram"), std::string::npos);
  EXPECT_NE(r.body.find("# TYPE statescan_tokens_total counter"), std::string::npos);
  EXPECT_NE(r.body.find("# TYPE statescan_tokens_per_second gauge"), std::string::npos);
}

TEST_P(ServedMetrics, EverySeriesCarriesRankAndVariantOnly) {
  const auto samples = scrape();
  ASSERT_FALSE(samples.empty());
  int ours = 0;
  for (const Sample& s : samples) {
    // prometheus-cpp adds its own exposer_* families to the endpoint.
    if (s.name.rfind("statescan_", 0) != 0) continue;
    ++ours;
    SCOPED_TRACE(s.name);
    EXPECT_EQ(s.labels.at("rank"), std::to_string(rank_));
    EXPECT_EQ(s.labels.at("variant"), to_string(GetParam()));
    // Beyond rank and variant: one family-specific label at most.
    for (const auto& [key, value] : s.labels) {
      EXPECT_TRUE(key == "rank" || key == "variant" || key == "phase" || key == "strategy" ||
                  key == "kind" || key == "le")
          << key;
    }
  }
  EXPECT_GT(ours, 0);
  // Every child exists from the start, at zero.
  for (const char* phase : {"fwd", "bwd", "summary", "exchange", "merge"})
    EXPECT_TRUE(
        near(value_of(samples, "statescan_phase_seconds_total", labels({{"phase", phase}})), 0));
  for (const char* strategy : {"allgather", "ring", "tree"})
    EXPECT_TRUE(near(
        value_of(samples, "statescan_exchange_bytes_total", labels({{"strategy", strategy}})), 0));
  EXPECT_TRUE(near(value_of(samples, "statescan_tokens_total", labels()), 0));
}

TEST_P(ServedMetrics, PhaseSecondsAreTheSumOfObserverCalls) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  std::map<std::string, double> expected;
  for (int step = 0; step < 7; ++step) {
    for (Phase p : {Phase::summary, Phase::exchange, Phase::merge, Phase::fwd, Phase::bwd}) {
      const double s = uniform(1e-6, 0.5);
      metrics_->on_phase(p, s, 0);
      expected[to_string(p)] += s;
    }
  }
  const auto samples = scrape();
  const MetricsSnapshot snap = metrics_->snapshot();
  for (Phase p : {Phase::summary, Phase::exchange, Phase::merge, Phase::fwd, Phase::bwd}) {
    SCOPED_TRACE(to_string(p));
    EXPECT_TRUE(
        near(value_of(samples, "statescan_phase_seconds_total", labels({{"phase", to_string(p)}})),
             expected[to_string(p)]));
    EXPECT_TRUE(near(snap.phase(p), expected[to_string(p)]));
  }
}

// Two mixers on two threads reporting their exchanges to one exporter: each
// strategy gets exactly its own bytes (the strategy used to be stored by one
// call and read by the next, so another thread's report could come between).
TEST_P(ServedMetrics, ConcurrentExchangesKeepTheirStrategies) {
  constexpr int kReports = 50000;
  std::atomic<int> ready{0};
  const auto report = [&](Exchange strategy, int64_t bytes) {
    ready.fetch_add(1);
    while (ready.load() < 2) {
    }  // both threads report at once
    for (int i = 0; i < kReports; ++i) {
      metrics_->on_exchange(strategy, 1e-6, bytes);
      std::this_thread::yield();  // hand the exporter to the other thread often
    }
  };
  std::thread ring(report, Exchange::ring, 1);
  std::thread tree(report, Exchange::tree, 1000);
  ring.join();
  tree.join();
  const MetricsSnapshot snap = metrics_->snapshot();
  EXPECT_EQ(snap.bytes(Exchange::ring), int64_t{kReports});
  EXPECT_EQ(snap.bytes(Exchange::tree), int64_t{kReports} * 1000);
  const auto samples = scrape();
  EXPECT_TRUE(
      near(value_of(samples, "statescan_exchange_bytes_total", labels({{"strategy", "tree"}})),
           1000.0 * kReports));
}

TEST_P(ServedMetrics, ExchangeBytesCarryTheReportedStrategy) {
  const int64_t ring_bytes = 1 + static_cast<int64_t>(rng_() % 100000);
  const int64_t tree_bytes = 1 + static_cast<int64_t>(rng_() % 100000);
  metrics_->on_exchange_strategy(Exchange::ring);
  metrics_->on_phase(Phase::exchange, 0.01, ring_bytes);
  metrics_->on_phase(Phase::exchange, 0.01, ring_bytes);
  metrics_->on_exchange_strategy(Exchange::tree);
  metrics_->on_phase(Phase::exchange, 0.01, tree_bytes);
  // Bytes on other phases are not exchange volume.
  metrics_->on_phase(Phase::fwd, 0.01, 12345);
  const auto samples = scrape();
  EXPECT_TRUE(
      near(value_of(samples, "statescan_exchange_bytes_total", labels({{"strategy", "ring"}})),
           2.0 * ring_bytes));
  EXPECT_TRUE(
      near(value_of(samples, "statescan_exchange_bytes_total", labels({{"strategy", "tree"}})),
           static_cast<double>(tree_bytes)));
  EXPECT_TRUE(near(
      value_of(samples, "statescan_exchange_bytes_total", labels({{"strategy", "allgather"}})), 0));
  // No "auto" series: every byte had a resolved strategy.
  EXPECT_TRUE(std::isnan(
      value_of(samples, "statescan_exchange_bytes_total", labels({{"strategy", "auto"}}))));
  EXPECT_EQ(metrics_->snapshot().bytes(Exchange::ring), 2 * ring_bytes);
}

TEST_P(ServedMetrics, UnreportedAutomaticStrategyIsLabelledAuto) {
  // The exporter was built with Exchange::automatic and nobody resolved it.
  metrics_->on_phase(Phase::exchange, 0.01, 640);
  const auto samples = scrape();
  EXPECT_TRUE(near(
      value_of(samples, "statescan_exchange_bytes_total", labels({{"strategy", "auto"}})), 640));
  EXPECT_EQ(metrics_->snapshot().bytes(Exchange::automatic), 640);
}

// LaCT's all-reduces: their time adds to the exchange phase, their bytes go
// under strategy="allreduce" (a series that exists only once reported).
TEST_P(ServedMetrics, AllReducesCountAsExchangeUnderTheirOwnStrategy) {
  const auto before = scrape();
  EXPECT_TRUE(std::isnan(value_of(before, "statescan_exchange_bytes_total",
                                  labels({{"strategy", "allreduce"}}))));
  const int64_t bytes = 1 + static_cast<int64_t>(rng_() % 100000);
  const double s1 = uniform(1e-6, 0.5), s2 = uniform(1e-6, 0.5);
  metrics_->on_allreduce(s1, bytes);
  metrics_->on_allreduce(s2, 2 * bytes);
  const auto samples = scrape();
  EXPECT_TRUE(near(
      value_of(samples, "statescan_exchange_bytes_total", labels({{"strategy", "allreduce"}})),
      3.0 * bytes));
  EXPECT_TRUE(
      near(value_of(samples, "statescan_phase_seconds_total", labels({{"phase", "exchange"}})),
           s1 + s2));
  for (const char* strategy : {"allgather", "ring", "tree"})
    EXPECT_TRUE(near(
        value_of(samples, "statescan_exchange_bytes_total", labels({{"strategy", strategy}})), 0));
  EXPECT_EQ(metrics_->snapshot().allreduce_bytes, 3 * bytes);
  EXPECT_TRUE(near(metrics_->snapshot().phase(Phase::exchange), s1 + s2));
}

TEST_P(ServedMetrics, StepsFeedTokensHistogramAndRates) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  int64_t tokens = 0;
  double seconds = 0;
  StepSample last;
  std::vector<double> step_times;
  for (int i = 0; i < 5; ++i) {
    last.tokens = 1 + static_cast<int64_t>(rng_() % 100000);
    last.seconds = uniform(0.0005, 3.0);
    last.flops = uniform(1e9, 1e12);
    metrics_->on_step(last);
    tokens += last.tokens;
    seconds += last.seconds;
    step_times.push_back(last.seconds);
  }
  const auto samples = scrape();
  EXPECT_TRUE(
      near(value_of(samples, "statescan_tokens_total", labels()), static_cast<double>(tokens)));
  EXPECT_TRUE(near(value_of(samples, "statescan_step_seconds_count", labels()), 5));
  EXPECT_TRUE(near(value_of(samples, "statescan_step_seconds_sum", labels()), seconds));
  int le_one = 0;
  for (double t : step_times) le_one += t <= 1.0 ? 1 : 0;
  EXPECT_TRUE(
      near(value_of(samples, "statescan_step_seconds_bucket", labels({{"le", "1"}})), le_one));
  EXPECT_TRUE(
      near(value_of(samples, "statescan_step_seconds_bucket", labels({{"le", "+Inf"}})), 5));
  EXPECT_TRUE(near(value_of(samples, "statescan_tokens_per_second", labels()),
                   static_cast<double>(last.tokens) / last.seconds));
  EXPECT_TRUE(near(value_of(samples, "statescan_achieved_tflops", labels()),
                   last.flops / last.seconds * 1e-12));

  const MetricsSnapshot snap = metrics_->snapshot();
  EXPECT_EQ(snap.steps, 5);
  EXPECT_EQ(snap.tokens_total, tokens);
  EXPECT_TRUE(near(snap.step_seconds_sum, seconds));
}

TEST_P(ServedMetrics, StepWithoutFlopsKeepsTheLastTflops) {
  metrics_->on_step({100, 0.5, 2e12});
  metrics_->on_step({100, 0.25, 0});
  const auto samples = scrape();
  EXPECT_TRUE(near(value_of(samples, "statescan_achieved_tflops", labels()), 4));
  EXPECT_TRUE(near(value_of(samples, "statescan_tokens_per_second", labels()), 400));
}

TEST_P(ServedMetrics, ErrorsAreCountedByKind) {
  metrics_->count_error(ErrorKind::communication);
  metrics_->count_error(ErrorKind::communication);
  metrics_->count_error(ErrorKind::input);
  const auto samples = scrape();
  for (int k = 0; k < kNumErrorKinds; ++k) {
    const auto kind = static_cast<ErrorKind>(k);
    const double expected = kind == ErrorKind::communication ? 2 : kind == ErrorKind::input ? 1 : 0;
    EXPECT_TRUE(near(
        value_of(samples, "statescan_errors_total", labels({{"kind", to_string(kind)}})), expected))
        << to_string(kind);
  }
  EXPECT_EQ(metrics_->snapshot().error_count(ErrorKind::communication), 2);
}

TEST_P(ServedMetrics, DeviceMemoryGaugesFollowTheLastReport) {
  metrics_->set_device_memory(1000, 5000);
  metrics_->set_device_memory(3000, 7000);
  const auto samples = scrape();
  EXPECT_TRUE(near(
      value_of(samples, "statescan_device_memory_bytes", labels({{"kind", "current"}})), 3000));
  EXPECT_TRUE(
      near(value_of(samples, "statescan_device_memory_bytes", labels({{"kind", "peak"}})), 7000));
}

TEST_P(ServedMetrics, ExpositionTextIsWhatHttpServes) {
  metrics_->on_step({4096, 0.125, 1e9});
  const std::string text = metrics_->exposition_text();
  // The served page also holds prometheus-cpp's own exposer_* families.
  std::istringstream served(http_get(metrics_->port(), "/metrics").body);
  std::string ours;
  for (std::string line; std::getline(served, line);) {
    if (line.rfind("statescan_", 0) == 0 || line.rfind("# HELP statescan_", 0) == 0 ||
        line.rfind("# TYPE statescan_", 0) == 0)
      ours += line + "\n";
  }
  EXPECT_EQ(ours, text);
}

// A real CpMixer on one rank reports every phase of forward and backward
// through the exporter (record-only: no HTTP needed, so this runs in builds
// without Prometheus too); fwd and bwd are totals that contain their parts.
class RecordedMetrics : public ::testing::TestWithParam<Variant> {};

TEST_P(RecordedMetrics, CpMixerReportsEveryPhase) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  MetricsOptions o;
  o.variant = to_string(GetParam());
  MetricsExporter metrics(o);
  ProblemSpec spec;
  spec.variant = GetParam();
  spec.seq_len = 45;
  const ref::Problem p = random_problem(spec, seed);
  std::mt19937_64 rng(seed + 1);
  const auto d_o = randn(static_cast<std::size_t>(p.batch * p.seq_len * p.heads * p.dv), rng);
  SingleRankCommunicator comm;
  MixerConfig config;
  config.variant = GetParam();
  config.chunk = 16;
  CpMixer mixer(comm, config, Exchange::allgather, &metrics);
  run_cp(mixer, p, 0, p.seq_len, d_o, {});

  const MetricsSnapshot snap = metrics.snapshot();
  EXPECT_GT(snap.phase(Phase::fwd), 0);
  EXPECT_GT(snap.phase(Phase::bwd), 0);
  const double parts =
      snap.phase(Phase::summary) + snap.phase(Phase::exchange) + snap.phase(Phase::merge);
  EXPECT_LE(parts, snap.phase(Phase::fwd) + snap.phase(Phase::bwd));
  EXPECT_EQ(snap.phase(Phase::fwd), mixer.last_forward_stats().total_s);
  EXPECT_EQ(snap.phase(Phase::bwd), mixer.last_backward_stats().total_s);
  // One rank sends nothing.
  for (int e = 0; e < 4; ++e) EXPECT_EQ(snap.exchange_bytes[e], 0);
}

std::string variant_name(const ::testing::TestParamInfo<Variant>& info) {
  return to_string(info.param);
}

INSTANTIATE_TEST_SUITE_P(Variants, ServedMetrics, ::testing::ValuesIn(kAllVariants), variant_name);
INSTANTIATE_TEST_SUITE_P(Variants, RecordedMetrics, ::testing::ValuesIn(kAllVariants),
                         variant_name);

// ---- construction and argument checks ----------------------------------------

// Runs `f`, expecting statescan::Error naming `argument` whose message
// contains `text`.
template <typename F>
void expect_error(F&& f, const std::string& argument, const std::string& text = "") {
  try {
    f();
    ADD_FAILURE() << "no error (expected one naming " << argument << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(MetricsExporterSetup, RecordsWithoutServingWhenNoPortIsGiven) {
  MetricsOptions o;
  o.variant = "kda";
  MetricsExporter metrics(o);
  EXPECT_FALSE(metrics.serving());
  EXPECT_EQ(metrics.port(), -1);
  EXPECT_EQ(metrics.address(), "");
  metrics.on_step({10, 0.5, 0});
  EXPECT_EQ(metrics.snapshot().tokens_total, 10);
  EXPECT_TRUE(near(metrics.snapshot().tokens_per_second, 20));
}

// A step that counts no FLOPs (0) leaves the last achieved TFLOP/s as it was,
// in the snapshot as on the served gauge (StepWithoutFlopsKeepsTheLastTflops).
TEST(MetricsExporterSetup, SnapshotKeepsTheLastTflopsOverAStepWithoutFlops) {
  MetricsOptions o;
  o.variant = "kda";
  MetricsExporter metrics(o);
  metrics.on_step({100, 0.5, 2e12});
  metrics.on_step({100, 0.25, 0});
  EXPECT_TRUE(near(metrics.snapshot().achieved_tflops, 4)) << metrics.snapshot().achieved_tflops;
  EXPECT_TRUE(near(metrics.snapshot().tokens_per_second, 400));
}

TEST(MetricsExporterSetup, BusyPortIsRefusedNamingMetricsPort) {
  if (!MetricsExporter::serving_available()) GTEST_SKIP() << "built without Prometheus";
  MetricsOptions o;
  o.port = 0;
  MetricsExporter first(o);
  o.port = first.port();
  expect_error([&] { MetricsExporter second(o); }, "metrics-port", std::to_string(first.port()));
}

TEST(MetricsExporterSetup, PortOutsideRangeIsRefused) {
  MetricsOptions o;
  o.port = 65536;
  expect_error([&] { MetricsExporter m(o); }, "metrics-port", "65536");
  o.port = -2;
  expect_error([&] { MetricsExporter m(o); }, "metrics-port", "-2");
}

TEST(MetricsExporterSetup, UnbindableAddressIsRefused) {
  if (!MetricsExporter::serving_available()) GTEST_SKIP() << "built without Prometheus";
  MetricsOptions o;
  o.port = 0;
  o.bind_address = "203.0.113.7";  // TEST-NET-3: never an address of this host
  // The address is at fault, not the port (civetweb's exception does not say).
  expect_error([&] { MetricsExporter m(o); }, "metrics-bind", "203.0.113.7");
}

// An IPv6 literal goes in brackets before the port ("::1:0" is no address),
// and where the server cannot serve it (civetweb built without IPv6) the
// address is named, not the free port.
TEST(MetricsExporterSetup, AnIpv6AddressIsServedOrRefusedNamingTheAddress) {
  if (!MetricsExporter::serving_available()) GTEST_SKIP() << "built without Prometheus";
  MetricsOptions o;
  o.port = 0;
  o.bind_address = "::1";
  try {
    MetricsExporter m(o);
    EXPECT_EQ(m.address(), "[::1]:" + std::to_string(m.port()));
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "metrics-bind") << e.what();
    EXPECT_NE(std::string(e.what()).find("[::1]:0"), std::string::npos) << e.what();
  }
}

TEST(MetricsExporterSetup, WithoutPrometheusAPortIsRefusedNotIgnored) {
  if (MetricsExporter::serving_available()) GTEST_SKIP() << "built with Prometheus";
  MetricsOptions o;
  o.port = 9400;
  expect_error([&] { MetricsExporter m(o); }, "metrics-port", "built without Prometheus");
  o.port = -1;
  MetricsExporter recorder(o);
  expect_error([&] { recorder.exposition_text(); }, "metrics", "built without Prometheus");
}

TEST(MetricsExporterSetup, InvalidReportsAreRefused) {
  MetricsExporter m(MetricsOptions{});
  expect_error([&] { m.on_phase(Phase::fwd, std::nan(""), 0); }, "seconds");
  expect_error([&] { m.on_phase(Phase::fwd, -1.0, 0); }, "seconds");
  expect_error([&] { m.on_phase(Phase::exchange, 0.1, -5); }, "bytes");
  expect_error([&] { m.on_step({-1, 1.0, 0}); }, "tokens");
  expect_error([&] { m.on_step({1, 0.0, 0}); }, "seconds");
  expect_error([&] { m.on_step({1, 1.0, INFINITY}); }, "flops");
  expect_error([&] { m.set_device_memory(10, 5); }, "peak_bytes");
  expect_error([&] { m.set_device_memory(-5, 10); }, "current_bytes");
  expect_error([&] { m.on_allreduce(-1.0, 8); }, "seconds");
  expect_error([&] { m.on_allreduce(0.1, -8); }, "bytes");
  // Refused reports leave the totals untouched.
  const MetricsSnapshot snap = m.snapshot();
  EXPECT_EQ(snap.steps, 0);
  EXPECT_EQ(snap.phase(Phase::fwd), 0);
  EXPECT_EQ(snap.allreduce_bytes, 0);
}

// ---- FLOP model ------------------------------------------------------------------

TEST(FlopModel, AdditiveMatchesHandCount) {
  // Per token and head, C = 4, Dk = 2, Dv = 3: 4*(2+3) + 4*2*3 = 44; 5 tokens.
  FlopShape s{Variant::linear, 5, 1, 2, 3, 4};
  EXPECT_DOUBLE_EQ(chunkwise_forward_flops(s), 5 * 44);
  // Backward: 4*(3*2 + 2*3) + 8*2*3 = 96.
  EXPECT_DOUBLE_EQ(chunkwise_backward_flops(s), 5 * 96);
  EXPECT_DOUBLE_EQ(chunkwise_step_flops(s, true), 5 * (44 + 96));
  EXPECT_DOUBLE_EQ(chunkwise_step_flops(s, false), 5 * 44);
}

TEST(FlopModel, DeltaRuleAddsTheWyWork) {
  // Extra per token: 4*2 + 4*(2+3) + 2*2*3 = 40.
  FlopShape s{Variant::deltanet, 5, 1, 2, 3, 4};
  EXPECT_DOUBLE_EQ(chunkwise_forward_flops(s), 5 * (44 + 40));
  // Backward extra per token: 4*(6*2 + 3*3) + 6*2*3 = 120.
  EXPECT_DOUBLE_EQ(chunkwise_backward_flops(s), 5 * (96 + 120));
}

TEST(FlopModel, SquareHeadsGiveTheBenchmarkFormula) {
  // statescan-bench's per-token forms for Dk = Dv = D.
  const double C = 64, D = 128;
  for (Variant v : kAllVariants) {
    FlopShape s{v, 1, 1, 128, 128, 64};
    const double expected = has_beta(v) ? 5 * C * D + 6 * D * D : 2 * C * D + 4 * D * D;
    EXPECT_DOUBLE_EQ(chunkwise_forward_flops(s), expected) << to_string(v);
    const double backward = has_beta(v) ? 14 * C * D + 14 * D * D : 5 * C * D + 8 * D * D;
    EXPECT_DOUBLE_EQ(chunkwise_backward_flops(s), backward) << to_string(v);
  }
}

TEST(FlopModel, ScalesWithTokensAndHeads) {
  FlopShape s{Variant::kda, 4096, 4, 64, 64, 64};
  const double base = chunkwise_forward_flops(s);
  s.tokens *= 3;
  s.heads *= 2;
  EXPECT_DOUBLE_EQ(chunkwise_forward_flops(s), 6 * base);
}

TEST(FlopModel, InvalidShapesAreRefused) {
  expect_error([] { chunkwise_forward_flops({Variant::kda, 64, 1, 64, 64, 0}); }, "chunk");
  expect_error([] { chunkwise_forward_flops({Variant::kda, -1, 1, 64, 64, 64}); }, "tokens");
  expect_error([] { chunkwise_backward_flops({Variant::kda, 64, 1, 64, 64, 0}); }, "chunk");
  expect_error([] { chunkwise_backward_flops({Variant::kda, 64, 1, -1, 64, 64}); }, "dk");
  expect_error([] { chunkwise_forward_flops({Variant::kda, 64, 1, 64, -1, 64}); }, "dv");
}

TEST(FlopModel, LactCountsItsTokenGemms) {
  // Forward per token-head: apply (3 products of 2 M D) and the fast-weight
  // gradient (6 more): 18 M D; with backward 64 M D. M = 6, D = 4, 10 token-heads.
  EXPECT_DOUBLE_EQ(lact_step_flops(10, 4, 6, false), 18.0 * 6 * 4 * 10);
  EXPECT_DOUBLE_EQ(lact_step_flops(10, 4, 6, true), 64.0 * 6 * 4 * 10);
  expect_error([] { lact_step_flops(-1, 4, 6, false); }, "tokens");
  expect_error([] { lact_step_flops(1, 4, -6, false); }, "hidden");
}

}  // namespace
}  // namespace statescan::test
