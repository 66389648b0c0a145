#include "monitoring/metrics_exporter.h"

#include <cmath>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

#if defined(STATESCAN_HAS_PROMETHEUS)
#include <netdb.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

namespace statescan {

#if defined(STATESCAN_HAS_PROMETHEUS)
namespace {

// Whether this host can bind a TCP socket to `address` (IPv4, IPv6 in
// brackets or not, or a name that resolves to either) on `port` (0: on some
// free port).
bool address_bindable(std::string address, int port) {
  if (address.size() >= 2 && address.front() == '[' && address.back() == ']')
    address = address.substr(1, address.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* list = nullptr;
  if (::getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &list) != 0)
    return false;
  bool bound = false;
  for (const addrinfo* a = list; a != nullptr && !bound; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    bound = ::bind(fd, a->ai_addr, a->ai_addrlen) == 0;
    ::close(fd);
  }
  ::freeaddrinfo(list);
  return bound;
}

}  // namespace
#endif

namespace {

// `address` as it goes before ":port": an IPv6 literal in brackets
// ("::1" -> "[::1]"), anything else as given.
std::string with_port(const std::string& address, int port) {
  const bool bare_ipv6 = address.find(':') != std::string::npos && address.front() != '[';
  return (bare_ipv6 ? "[" + address + "]" : address) + ":" + std::to_string(port);
}

int index_of(Phase p) {
  return static_cast<int>(p);
}
int index_of(Exchange e) {
  return static_cast<int>(e);
}
int index_of(ErrorKind k) {
  return static_cast<int>(k);
}

}  // namespace

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::argument:
      return "argument";
    case ErrorKind::input:
      return "input";
    case ErrorKind::communication:
      return "communication";
    case ErrorKind::device:
      return "device";
    case ErrorKind::io:
      return "io";
    case ErrorKind::internal:
      return "internal";
  }
  return "?";
}

#if defined(STATESCAN_HAS_PROMETHEUS)
namespace {
// Step-time buckets from 1 ms to 2 min: a CP step of a million tokens lands in
// the middle, a small debugging run at the low end.
const std::vector<double> kStepSecondsBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                 0.5,   1,      2.5,   5,    10,    30,   60,  120};

const char* strategy_label(Exchange e) {
  // "auto" only when the mixer never reported the strategy it resolved.
  return e == Exchange::automatic ? "auto" : to_string(e);
}
}  // namespace

// The registry and the cached children: everything the hot path touches is a
// plain pointer to an already registered metric.
struct PrometheusMetrics {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<prometheus::Exposer> exposer;

  prometheus::Counter* tokens_total = nullptr;
  prometheus::Histogram* step_seconds = nullptr;
  prometheus::Gauge* tokens_per_second = nullptr;
  prometheus::Gauge* achieved_tflops = nullptr;
  std::array<prometheus::Counter*, kNumPhases> phase_seconds{};
  // Indexed by Exchange; the "auto" child is added only if ever needed.
  std::array<prometheus::Counter*, 4> exchange_bytes{};
  prometheus::Counter* allreduce_bytes = nullptr;  // added on first use
  prometheus::Family<prometheus::Counter>* exchange_family = nullptr;
  prometheus::Gauge* memory_current = nullptr;
  prometheus::Gauge* memory_peak = nullptr;
  std::array<prometheus::Counter*, kNumErrorKinds> errors{};

  // Builds every family with the constant labels rank and variant.
  explicit PrometheusMetrics(const MetricsOptions& o) {
    const prometheus::Labels labels = {{"rank", std::to_string(o.rank)}, {"variant", o.variant}};
    auto& r = *registry;
    tokens_total = &prometheus::BuildCounter()
                        .Name("statescan_tokens_total")
                        .Help("Tokens of this rank's shards processed (forward + backward = one)")
                        .Labels(labels)
                        .Register(r)
                        .Add({});
    step_seconds = &prometheus::BuildHistogram()
                        .Name("statescan_step_seconds")
                        .Help("Wall time of one training step on this rank")
                        .Labels(labels)
                        .Register(r)
                        .Add({}, kStepSecondsBuckets);
    tokens_per_second = &prometheus::BuildGauge()
                             .Name("statescan_tokens_per_second")
                             .Help("Tokens per second of this rank's last step")
                             .Labels(labels)
                             .Register(r)
                             .Add({});
    auto& phases = prometheus::BuildCounter()
                       .Name("statescan_phase_seconds_total")
                       .Help("Seconds spent per context-parallel phase (fwd and bwd are totals)")
                       .Labels(labels)
                       .Register(r);
    for (Phase p : {Phase::fwd, Phase::bwd, Phase::summary, Phase::exchange, Phase::merge})
      phase_seconds[index_of(p)] = &phases.Add({{"phase", to_string(p)}});
    exchange_family = &prometheus::BuildCounter()
                           .Name("statescan_exchange_bytes_total")
                           .Help("Bytes this rank sent in the boundary-state exchange "
                                 "(allreduce: LaCT's fast-weight gradients)")
                           .Labels(labels)
                           .Register(r);
    for (Exchange e : {Exchange::allgather, Exchange::ring, Exchange::tree})
      exchange_bytes[index_of(e)] = &exchange_family->Add({{"strategy", to_string(e)}});
    achieved_tflops = &prometheus::BuildGauge()
                           .Name("statescan_achieved_tflops")
                           .Help("Counted FLOPs per second of this rank's last step, in TFLOP/s")
                           .Labels(labels)
                           .Register(r)
                           .Add({});
    auto& memory = prometheus::BuildGauge()
                       .Name("statescan_device_memory_bytes")
                       .Help("Device memory in use by this rank (current) and its maximum (peak)")
                       .Labels(labels)
                       .Register(r);
    memory_current = &memory.Add({{"kind", "current"}});
    memory_peak = &memory.Add({{"kind", "peak"}});
    auto& error_family = prometheus::BuildCounter()
                             .Name("statescan_errors_total")
                             .Help("Errors this rank reported, by kind")
                             .Labels(labels)
                             .Register(r);
    for (int k = 0; k < kNumErrorKinds; ++k)
      errors[k] = &error_family.Add({{"kind", to_string(static_cast<ErrorKind>(k))}});
  }

  // Starts the HTTP server; civetweb reports bind failures as exceptions.
  void serve(const std::string& bind_address, int port) {
    const std::string where = with_port(bind_address, port);
    try {
      exposer = std::make_unique<prometheus::Exposer>(where, 1);
    } catch (const std::exception& e) {
      // civetweb does not say whether the address or the port failed, so
      // plain sockets ask: an address this host cannot bind on any port is
      // the address's fault, a port it cannot bind there the port's; where
      // both bind, the server itself cannot use the address (a civetweb
      // built without IPv6, say).
      SS_CHECK_ARG(address_bindable(bind_address, 0), "metrics-bind", "cannot serve metrics on ",
                   where, ": ", bind_address, " is not an address of this host (", e.what(), ")");
      SS_CHECK_ARG(port == 0 || address_bindable(bind_address, port), "metrics-port",
                   "cannot serve metrics on ", where, ": port ", port, " is taken (", e.what(),
                   ")");
      SS_FAIL("metrics-bind", "cannot serve metrics on ", where, ": the address and port are free,",
              " but the metrics server cannot serve on this address (", e.what(), ")");
    }
    exposer->RegisterCollectable(registry);
  }

  std::string text() const {
    std::ostringstream os;
    prometheus::TextSerializer().Serialize(os, registry->Collect());
    return os.str();
  }
};
#else
namespace {
constexpr const char* kWithoutPrometheus =
    "statescan was built without Prometheus (prometheus-cpp was not found at configure time; "
    "install prometheus-cpp-dev and reconfigure)";
}  // namespace

// Stand-in with the same calls, so that the exporter's bookkeeping is one code path.
struct PrometheusMetrics {
  explicit PrometheusMetrics(const MetricsOptions&) {}
  void serve(const std::string&, int) { SS_FAIL("metrics-port", kWithoutPrometheus); }
  std::string text() const { SS_FAIL("metrics", kWithoutPrometheus); }
};
#endif

struct MetricsExporter::Impl {
  MetricsOptions options;
  PrometheusMetrics prom;
  int bound_port = -1;

  mutable std::mutex mutex;  // guards everything below
  MetricsSnapshot totals;
  Exchange strategy = Exchange::automatic;

  explicit Impl(MetricsOptions o)
      : options(std::move(o)), prom(options), strategy(options.exchange) {}
};

bool MetricsExporter::serving_available() {
#if defined(STATESCAN_HAS_PROMETHEUS)
  return true;
#else
  return false;
#endif
}

MetricsExporter::MetricsExporter(MetricsOptions options) {
  SS_CHECK_ARG(options.port >= -1 && options.port <= 65535, "metrics-port", "port ", options.port,
               " is outside 0..65535");
  SS_CHECK_ARG(!options.bind_address.empty(), "metrics-bind", "the bind address is empty");
  impl_ = std::make_unique<Impl>(std::move(options));
  if (impl_->options.port < 0) return;
  impl_->prom.serve(impl_->options.bind_address, impl_->options.port);
#if defined(STATESCAN_HAS_PROMETHEUS)
  const std::vector<int> ports = impl_->prom.exposer->GetListeningPorts();
  SS_CHECK_ARG(!ports.empty(), "metrics-port", "the metrics server listens on no port");
  impl_->bound_port = ports.front();
#endif
}

MetricsExporter::~MetricsExporter() = default;

bool MetricsExporter::serving() const {
  return impl_->bound_port >= 0;
}
int MetricsExporter::port() const {
  return impl_->bound_port;
}

std::string MetricsExporter::address() const {
  if (!serving()) return {};
  return with_port(impl_->options.bind_address, impl_->bound_port);
}

void MetricsExporter::on_phase(Phase phase, double seconds, int64_t bytes) {
  check_phase(phase, seconds, bytes);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  record_phase(phase, seconds, bytes);
}

void MetricsExporter::on_exchange(Exchange strategy, double seconds, int64_t bytes) {
  check_phase(Phase::exchange, seconds, bytes);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->strategy = strategy;
  record_phase(Phase::exchange, seconds, bytes);
}

void MetricsExporter::check_phase(Phase phase, double seconds, int64_t bytes) {
  SS_CHECK_ARG(std::isfinite(seconds) && seconds >= 0, "seconds", "phase ", to_string(phase),
               " reported ", seconds, " s");
  SS_CHECK_ARG(bytes >= 0, "bytes", "phase ", to_string(phase), " reported ", bytes, " bytes");
}

void MetricsExporter::record_phase(Phase phase, double seconds, int64_t bytes) {
  const int p = index_of(phase);
  impl_->totals.phase_seconds[p] += seconds;
  const bool count_bytes = phase == Phase::exchange && bytes > 0;
  const int s = index_of(impl_->strategy);
  if (count_bytes) impl_->totals.exchange_bytes[s] += bytes;
#if defined(STATESCAN_HAS_PROMETHEUS)
  auto& prom = impl_->prom;
  prom.phase_seconds[p]->Increment(seconds);
  if (count_bytes) {
    // Only a mixer that never reports its strategy gets here with `automatic`:
    // a one-time registration, then cached like the others.
    if (prom.exchange_bytes[s] == nullptr)
      prom.exchange_bytes[s] =
          &prom.exchange_family->Add({{"strategy", strategy_label(impl_->strategy)}});
    prom.exchange_bytes[s]->Increment(static_cast<double>(bytes));
  }
#endif
}

void MetricsExporter::on_allreduce(double seconds, int64_t bytes) {
  SS_CHECK_ARG(std::isfinite(seconds) && seconds >= 0, "seconds", "an all-reduce reported ",
               seconds, " s");
  SS_CHECK_ARG(bytes >= 0, "bytes", "an all-reduce reported ", bytes, " bytes");
  const int p = index_of(Phase::exchange);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->totals.phase_seconds[p] += seconds;
  impl_->totals.allreduce_bytes += bytes;
#if defined(STATESCAN_HAS_PROMETHEUS)
  auto& prom = impl_->prom;
  prom.phase_seconds[p]->Increment(seconds);
  if (prom.allreduce_bytes == nullptr)
    prom.allreduce_bytes = &prom.exchange_family->Add({{"strategy", "allreduce"}});
  prom.allreduce_bytes->Increment(static_cast<double>(bytes));
#endif
}

void MetricsExporter::on_exchange_strategy(Exchange strategy) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->strategy = strategy;
}

void MetricsExporter::on_step(const StepSample& step) {
  SS_CHECK_ARG(step.tokens >= 0, "tokens", "a step reported ", step.tokens, " tokens");
  SS_CHECK_ARG(std::isfinite(step.seconds) && step.seconds > 0, "seconds", "a step reported ",
               step.seconds, " s (must be > 0)");
  SS_CHECK_ARG(std::isfinite(step.flops) && step.flops >= 0, "flops", "a step reported ",
               step.flops, " FLOPs");
  const double tokens_per_second = static_cast<double>(step.tokens) / step.seconds;
  const double tflops = step.flops / step.seconds * 1e-12;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto& t = impl_->totals;
  t.steps += 1;
  t.tokens_total += step.tokens;
  t.step_seconds_sum += step.seconds;
  t.tokens_per_second = tokens_per_second;
  if (step.flops > 0) t.achieved_tflops = tflops;
#if defined(STATESCAN_HAS_PROMETHEUS)
  auto& prom = impl_->prom;
  prom.tokens_total->Increment(static_cast<double>(step.tokens));
  prom.step_seconds->Observe(step.seconds);
  prom.tokens_per_second->Set(tokens_per_second);
  if (step.flops > 0) prom.achieved_tflops->Set(tflops);
#endif
}

void MetricsExporter::set_device_memory(int64_t current_bytes, int64_t peak_bytes) {
  SS_CHECK_ARG(current_bytes >= 0, "current_bytes", "is ", current_bytes, ", must be >= 0");
  SS_CHECK_ARG(peak_bytes >= current_bytes, "peak_bytes", "device memory ", current_bytes,
               " B current, ", peak_bytes, " B peak (need current <= peak)");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->totals.device_memory_current = current_bytes;
  impl_->totals.device_memory_peak = peak_bytes;
#if defined(STATESCAN_HAS_PROMETHEUS)
  impl_->prom.memory_current->Set(static_cast<double>(current_bytes));
  impl_->prom.memory_peak->Set(static_cast<double>(peak_bytes));
#endif
}

void MetricsExporter::count_error(ErrorKind kind) {
  const int k = index_of(kind);
  SS_CHECK_ARG(k >= 0 && k < kNumErrorKinds, "kind", "unknown error kind ", k);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->totals.errors[k] += 1;
#if defined(STATESCAN_HAS_PROMETHEUS)
  impl_->prom.errors[k]->Increment();
#endif
}

MetricsSnapshot MetricsExporter::snapshot() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->totals;
}

std::string MetricsExporter::exposition_text() const {
  return impl_->prom.text();
}

}  // namespace statescan
