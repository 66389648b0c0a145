#include "launch/run_report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "comm/collective_check.h"
#include "core/error.h"
#include "core/npy.h"
#include "core/text_file.h"

namespace statescan::launch {
namespace {

std::string printf_string(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string printf_string(const char* format, ...) {
  char buffer[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  return buffer;
}

// The length of the well-formed UTF-8 sequence at s[i] (1 to 4 bytes), or 0
// where the bytes there are none (a stray continuation byte, a truncated or
// overlong sequence, a surrogate, a code point past U+10FFFF).
std::size_t utf8_length(const std::string& s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return 1;
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;  // overlong
    if (b0 == 0xED) hi = 0x9F;  // surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;  // overlong
    if (b0 == 0xF4) hi = 0x8F;  // past U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size() || byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  return n;
}

// A JSON string literal of `s`. JSON text is UTF-8: bytes of `s` that are
// not (a path from --load, say) become U+FFFD rather than invalid JSON.
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (static_cast<unsigned char>(c) >= 0x80) {
      const std::size_t n = utf8_length(s, i);
      if (n == 0) {
        out += "\\ufffd";
      } else {
        out.append(s, i, n);
        i += n - 1;
      }
      continue;
    }
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += printf_string("\\u%04x", c);
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

struct Averages {
  double fwd_ms = 0, bwd_ms = 0, exchange_ms = 0, tokens_per_s = 0;
  bool backward = false;
};

Averages averages(const std::vector<StepRow>& rows) {
  Averages a;
  if (rows.empty()) return a;
  // Throughput over the steps is their tokens over their time, not the mean
  // of the steps' rates (which a single fast step would inflate).
  double tokens = 0, seconds = 0;
  for (const auto& r : rows) {
    const double step_s = 1e-3 * (r.fwd_ms + (r.bwd_ms >= 0 ? r.bwd_ms : 0));
    a.fwd_ms += r.fwd_ms;
    a.bwd_ms += r.bwd_ms >= 0 ? r.bwd_ms : 0;
    a.exchange_ms += r.exchange_ms;
    tokens += r.tokens_per_s * step_s;
    seconds += step_s;
    a.backward = a.backward || r.bwd_ms >= 0;
  }
  const double n = static_cast<double>(rows.size());
  a.fwd_ms /= n;
  a.bwd_ms /= n;
  a.exchange_ms /= n;
  a.tokens_per_s = seconds > 0 ? tokens / seconds : 0;
  return a;
}

}  // namespace

int Report::total_wrong() const {
  int wrong = 0;
  for (const auto& r : rows) wrong += r.wrong > 0 ? r.wrong : 0;
  return wrong;
}

std::string format_header(const Report& report) {
  // Fields packed onto lines of at most ~90 characters.
  std::string out = "# statescan-run: context-parallel forward + backward\n#";
  std::size_t line_length = 1;
  for (const auto& [key, value] : report.header) {
    const std::string field = "  " + key + " " + value;
    if (line_length + field.size() > 90) {
      out += "\n#";
      line_length = 1;
    }
    out += field;
    line_length += field.size();
  }
  return out + "\n#\n";
}

std::string format_column_header() {
  std::string units = printf_string("# %6s %10s %10s %10s %13s %7s %12s", "", "(ms)", "(ms)",
                                    "(ms)", "(B/rank)", "(%)", "(tokens/s)");
  return printf_string("# %6s %10s %10s %10s %13s %7s %12s %7s\n", "step", "fwd", "bwd", "exchange",
                       "exchange", "hidden", "throughput", "#wrong") +
         units + "\n";
}

std::string format_row(const StepRow& r) {
  const std::string bwd = r.bwd_ms >= 0 ? printf_string("%10.2f", r.bwd_ms) : "       N/A";
  const std::string wrong = r.wrong >= 0 ? std::to_string(r.wrong) : "N/A";
  const std::string hidden = r.hidden_pct >= 0 ? printf_string("%7.1f", r.hidden_pct) : "    N/A";
  return printf_string("  %6lld %10.2f %s %10.3f %13lld %s %12.4g %7s\n",
                       static_cast<long long>(r.step), r.fwd_ms, bwd.c_str(), r.exchange_ms,
                       static_cast<long long>(r.exchange_bytes), hidden.c_str(), r.tokens_per_s,
                       wrong.c_str());
}

namespace {

// "local 9.12  summary 1.90  exchange 0.21  merge 0.01  other 0.30  wall 11.54
// (prepare 7.50)"
std::string format_phases(const PassPhases& p, const char* summary_name) {
  double other = p.s[4];
  for (int i = 0; i < 4; ++i) other -= p.s[i];
  return printf_string(
      "local %.2f  %s %.2f  exchange %.2f  merge %.2f  other %.2f  wall %.2f  (prepare %.2f)",
      1e3 * p.s[0], summary_name, 1e3 * p.s[1], 1e3 * p.s[2], 1e3 * p.s[3], 1e3 * other,
      1e3 * p.s[4], 1e3 * p.s[5]);
}

std::string json_phases(const PassPhases& p) {
  static const char* const names[PassPhases::kFields] = {"local_ms", "summary_ms", "exchange_ms",
                                                         "merge_ms", "wall_ms",    "prepare_ms"};
  std::string out = "{";
  for (int i = 0; i < PassPhases::kFields; ++i)
    out += std::string(i ? ", " : "") + "\"" + names[i] + "\": " + json_number(1e3 * p.s[i]);
  return out + "}";
}

}  // namespace

std::string format_footer(const Report& report) {
  const Averages a = averages(report.rows);
  std::string out = printf_string("# Avg fwd %.2f ms", a.fwd_ms);
  if (a.backward) out += printf_string("  bwd %.2f ms", a.bwd_ms);
  out += printf_string(
      "  exchange %.3f ms  throughput %.4g tokens/s  (over %zu steps, max over ranks)\n",
      a.exchange_ms, a.tokens_per_s, report.rows.size());
  for (std::size_t r = 0; r < report.ranks.size(); ++r) {
    const RankExchange& x = report.ranks[r];
    out += printf_string("# rank %zu (last step): exchange %.3f ms  %lld B sent  %.1f%% hidden\n",
                         r, x.exchange_ms, static_cast<long long>(x.exchange_bytes), x.hidden_pct);
  }
  for (std::size_t r = 0; r < report.ranks.size(); ++r) {
    const RankExchange& x = report.ranks[r];
    if (!x.has_phases) continue;
    if (r == 0)
      out +=
          "# phases (mean ms per step; other = wall - the four: host checks, agreement, "
          "launches)\n";
    out += printf_string("# rank %zu  fwd %s\n", r, format_phases(x.fwd, "summary").c_str());
    if (x.bwd.s[4] > 0)
      out += printf_string("# rank %zu  bwd %s\n", r, format_phases(x.bwd, "pre-pass").c_str());
  }
  for (std::size_t r = 0; r < report.ranks.size(); ++r) {
    const RankExchange& x = report.ranks[r];
    if (x.mem_last_bytes > 0)
      out += printf_string(
          "# rank %zu  device memory in use: %.2f GB after the first timed step, %.2f GB after "
          "the last\n",
          r, x.mem_first_bytes * 1e-9, x.mem_last_bytes * 1e-9);
  }
  if (report.check.enabled) {
    out += printf_string("# check: rel RMS vs a single-rank run (tolerance %.0e):",
                         report.check.tolerance);
    for (const auto& [name, err] : report.check.errors)
      out += printf_string(" %s %.2e", name.c_str(), err);
    out += "\n";
    const int wrong = report.total_wrong();
    out += printf_string("# Wrong outputs: %d %s\n", wrong, wrong == 0 ? "OK" : "FAILED");
  } else {
    out += "# check: off (--no-check)\n";
  }
  return out;
}

std::string to_json(const Report& report) {
  std::ostringstream os;
  os << "{\n  \"config\": {";
  for (std::size_t i = 0; i < report.header.size(); ++i)
    os << (i ? ", " : "") << json_string(report.header[i].first) << ": "
       << json_string(report.header[i].second);
  os << "},\n  \"rows\": [";
  for (std::size_t i = 0; i < report.rows.size(); ++i) {
    const StepRow& r = report.rows[i];
    os << (i ? ",\n" : "\n") << "    {\"step\": " << r.step
       << ", \"fwd_ms\": " << json_number(r.fwd_ms)
       << ", \"bwd_ms\": " << (r.bwd_ms >= 0 ? json_number(r.bwd_ms) : "null")
       << ", \"exchange_ms\": " << json_number(r.exchange_ms)
       << ", \"exchange_bytes\": " << r.exchange_bytes
       << ", \"exchange_hidden_pct\": " << (r.hidden_pct >= 0 ? json_number(r.hidden_pct) : "null")
       << ", \"tokens_per_s\": " << json_number(r.tokens_per_s)
       << ", \"wrong\": " << (r.wrong >= 0 ? std::to_string(r.wrong) : "null") << "}";
  }
  os << "\n  ],\n";
  const Averages a = averages(report.rows);
  os << "  \"avg\": {\"fwd_ms\": " << json_number(a.fwd_ms)
     << ", \"bwd_ms\": " << (a.backward ? json_number(a.bwd_ms) : "null")
     << ", \"exchange_ms\": " << json_number(a.exchange_ms)
     << ", \"tokens_per_s\": " << json_number(a.tokens_per_s) << "},\n";
  if (!report.ranks.empty()) {
    os << "  \"ranks\": [";
    for (std::size_t r = 0; r < report.ranks.size(); ++r)
      os << (r ? ", " : "") << "{\"exchange_ms\": " << json_number(report.ranks[r].exchange_ms)
         << ", \"exchange_bytes\": " << report.ranks[r].exchange_bytes
         << ", \"hidden_pct\": " << json_number(report.ranks[r].hidden_pct)
         << (report.ranks[r].has_phases ? ", \"fwd\": " + json_phases(report.ranks[r].fwd) +
                                              ", \"bwd\": " + json_phases(report.ranks[r].bwd)
                                        : std::string())
         << (report.ranks[r].mem_last_bytes > 0
                 ? ", \"mem_first_gb\": " + json_number(report.ranks[r].mem_first_bytes * 1e-9) +
                       ", \"mem_last_gb\": " + json_number(report.ranks[r].mem_last_bytes * 1e-9)
                 : std::string())
         << "}";
    os << "],\n";
  }
  os << "  \"check\": ";
  if (report.check.enabled) {
    os << "{\"tolerance\": " << json_number(report.check.tolerance)
       << ", \"wrong\": " << report.total_wrong() << ", \"rel_rms\": {";
    for (std::size_t i = 0; i < report.check.errors.size(); ++i)
      os << (i ? ", " : "") << json_string(report.check.errors[i].first) << ": "
         << json_number(report.check.errors[i].second);
    os << "}}";
  } else {
    os << "null";
  }
  os << "\n}\n";
  return os.str();
}

double relative_rms(const std::vector<float>& a, const std::vector<float>& ref) {
  if (a.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], r = ref[i];
    if (!std::isfinite(x) || !std::isfinite(r)) return std::numeric_limits<double>::infinity();
    num += (x - r) * (x - r);
    den += r * r;
  }
  if (den == 0) return std::sqrt(num / static_cast<double>(std::max<std::size_t>(a.size(), 1)));
  return std::sqrt(num / den);
}

void save_npy_files(const std::string& dir, const std::vector<NamedArray>& arrays) {
  namespace fs = std::filesystem;
  const std::string staging_prefix = ".statescan-partial-" + std::to_string(::getpid()) + "-";
  std::vector<std::pair<fs::path, fs::path>> staged;  // (staging, final)
  std::vector<fs::path> renamed;
  // The folder holds one run's results: an output an earlier run left there
  // that this one does not write (dq.npy after a forward-only run, dbeta.npy
  // after a variant without beta) would read as this run's. Removed once
  // this run's files are staged and before any is renamed into place, so
  // that a failed removal leaves none of them behind either.
  static const char* const kOutputNames[] = {"o",   "ht",   "dq",   "dk",   "dv",  "dg",  "dbeta",
                                             "dh0", "dlr0", "dlr1", "dlr2", "dw0", "dw1", "dw2"};
  try {
    for (const NamedArray& a : arrays) {
      const fs::path final_path = fs::path(dir) / (a.name + ".npy");
      const fs::path staging = fs::path(dir) / (staging_prefix + a.name + ".npy");
      staged.emplace_back(staging, final_path);
      SS_CHECK_ARG(a.data != nullptr && static_cast<int64_t>(a.data->size()) == numel(a.shape),
                   "--save", a.name, " holds ", a.data ? a.data->size() : 0, " values, but ",
                   shape_string(a.shape), " needs ", numel(a.shape));
      write_npy(staging.string(), a.shape, a.data->data());
    }
    for (const char* name : kOutputNames) {
      const bool written = std::any_of(arrays.begin(), arrays.end(),
                                       [&](const NamedArray& a) { return a.name == name; });
      if (written) continue;
      const fs::path stale = fs::path(dir) / (std::string(name) + ".npy");
      std::error_code ec;
      if (!fs::is_regular_file(stale, ec)) continue;
      fs::remove(stale, ec);
      SS_CHECK_ARG(!ec, "--save", "cannot remove ", stale.string(),
                   " left by an earlier run: ", ec.message());
    }
    for (const auto& [staging, final_path] : staged) {
      std::error_code ec;
      fs::rename(staging, final_path, ec);
      SS_CHECK_ARG(!ec, "--save", "cannot rename ", staging.string(), " to ", final_path.string(),
                   ": ", ec.message());
      renamed.push_back(final_path);
    }
  } catch (...) {
    std::error_code ec;
    for (const auto& [staging, final_path] : staged) fs::remove(staging, ec);
    for (const auto& path : renamed) fs::remove(path, ec);
    throw;
  }
}

void write_report_json(const std::string& path, const Report& report) {
  write_text_file(path, to_json(report), "--json");
}

void write_results(const std::string& json_path, const Report& report, const std::string& save_dir,
                   const std::vector<NamedArray>& arrays) {
  if (!json_path.empty()) write_report_json(json_path, report);
  if (save_dir.empty()) return;
  try {
    save_npy_files(save_dir, arrays);
  } catch (...) {
    if (!json_path.empty()) std::remove(json_path.c_str());
    throw;
  }
}

void prepare_output_locations(const std::string& save_dir, const std::string& json_path) {
  if (!save_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(save_dir, ec);
    SS_CHECK_ARG(std::filesystem::is_directory(save_dir), "--save", "cannot create directory '",
                 save_dir, "'", ec ? ": " + ec.message() : "");
  }
  if (!json_path.empty()) {
    const std::filesystem::path parent = std::filesystem::absolute(json_path).parent_path();
    SS_CHECK_ARG(std::filesystem::is_directory(parent), "--json", "directory '", parent.string(),
                 "' does not exist");
    // Found now, not by the final rename after the whole run.
    SS_CHECK_ARG(!std::filesystem::is_directory(json_path), "--json", "'", json_path,
                 "' is a directory");
  }
}

int count_wrong(const std::vector<NamedArray>& run, const std::vector<NamedArray>& reference,
                double tolerance, std::vector<std::pair<std::string, double>>& errors) {
  SS_CHECK_ARG(run.size() == reference.size(), "--check", "the run has ", run.size(),
               " outputs but the reference ", reference.size());
  errors.clear();
  int wrong = 0;
  for (std::size_t i = 0; i < run.size(); ++i) {
    const double err = relative_rms(*run[i].data, *reference[i].data);
    errors.emplace_back(run[i].name, err);
    if (!(err <= tolerance)) ++wrong;
  }
  return wrong;
}

StepRow reduce_step(Communicator& comm, const StepTimes& mine, int64_t step, bool backward,
                    double tokens) {
  double maxima[4] = {mine.fwd_s, mine.bwd_s, mine.exchange_s, mine.exchange_bytes};
  comm.all_reduce_max(maxima, 4, CommType::f64);
  double sums[2] = {mine.hidden_s, mine.exchange_s};
  comm.all_reduce_sum(sums, 2, CommType::f64);
  StepRow row;
  row.step = step;
  row.fwd_ms = maxima[0] * 1e3;
  row.bwd_ms = backward ? maxima[1] * 1e3 : -1;
  row.exchange_ms = maxima[2] * 1e3;
  row.exchange_bytes = static_cast<int64_t>(maxima[3]);
  row.tokens_per_s = tokens / (maxima[0] + maxima[1]);
  row.hidden_pct = sums[1] > 0 ? 100.0 * sums[0] / sums[1] : -1;
  return row;
}

std::vector<RankExchange> gather_rank_exchange(Communicator& comm, const StepTimes& mine,
                                               const StepTimes* phases, const double* memory) {
  constexpr int kPhase = 2 * PassPhases::kFields, kMemory = 3 + kPhase, kFields = kMemory + 2;
  double fields[kFields] = {mine.exchange_s, mine.exchange_bytes, mine.hidden_s};
  if (phases != nullptr)
    for (int i = 0; i < PassPhases::kFields; ++i) {
      fields[3 + i] = phases->fwd.s[i];
      fields[3 + PassPhases::kFields + i] = phases->bwd.s[i];
    }
  if (memory != nullptr) {
    fields[kMemory] = memory[0];
    fields[kMemory + 1] = memory[1];
  }
  std::vector<double> all(static_cast<std::size_t>(kFields * comm.size()));
  comm.all_gather(fields, all.data(), kFields, CommType::f64);
  std::vector<RankExchange> ranks(static_cast<std::size_t>(comm.size()));
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const double* f = all.data() + kFields * r;
    ranks[r].exchange_ms = f[0] * 1e3;
    ranks[r].exchange_bytes = static_cast<int64_t>(f[1]);
    ranks[r].hidden_pct = f[0] > 0 ? 100.0 * f[2] / f[0] : 0.0;
    ranks[r].has_phases = phases != nullptr;
    for (int i = 0; i < PassPhases::kFields; ++i) {
      ranks[r].fwd.s[i] = f[3 + i];
      ranks[r].bwd.s[i] = f[3 + PassPhases::kFields + i];
    }
    ranks[r].mem_first_bytes = f[kMemory];
    ranks[r].mem_last_bytes = f[kMemory + 1];
  }
  return ranks;
}

void print_row(Report& report, const StepRow& row, bool root,
               const std::vector<std::pair<std::string, std::string>>& header) {
  if (root) {
    if (report.rows.empty()) {
      report.header = header;
      std::fputs(format_header(report).c_str(), stdout);
      std::fputs(format_column_header().c_str(), stdout);
    }
    std::fputs(format_row(row).c_str(), stdout);
    std::fflush(stdout);
  }
  report.rows.push_back(row);
}

int finish_report(Communicator& comm, const Report& report, const std::function<void()>& write) {
  const bool root = comm.rank() == 0;
  if (root) {
    std::fputs(format_footer(report).c_str(), stdout);
    std::fflush(stdout);
  }
  try {
    collective_check(comm, [&] {
      if (root) write();
    });
  } catch (const Error& e) {
    throw RuntimeFailure(e.what());
  }
  return report.total_wrong() > 0 ? kExitWrong : kExitOk;
}

}  // namespace statescan::launch
