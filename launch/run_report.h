// The statescan-run report: a '#'-headed table in the manner of nccl-tests
// (units on every column, a #wrong correctness column on every row, '# Avg'
// and check lines at the end) and the same rows as JSON.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace statescan::launch {

// One timed step, maxima over ranks.
struct StepRow {
  int64_t step = 0;
  double fwd_ms = 0;
  double bwd_ms = -1;          // < 0: no backward in this run
  double exchange_ms = 0;      // forward + backward exchange
  int64_t exchange_bytes = 0;  // bytes sent by one rank, forward + backward
  double tokens_per_s = 0;     // B*T / (fwd + bwd)
  int wrong = -1;              // outputs over tolerance; < 0: not checked
};

// Relative RMS error of each output/gradient against the single-rank run.
struct CheckSummary {
  bool enabled = false;
  double tolerance = 0;
  std::vector<std::pair<std::string, double>> errors;  // of the last step
};

struct Report {
  // Header fields in print order, e.g. {"variant", "kda"}.
  std::vector<std::pair<std::string, std::string>> header;
  std::vector<StepRow> rows;
  CheckSummary check;

  int total_wrong() const;
};

// Lines of the table, each ending in '\n'.
std::string format_header(const Report& report);
std::string format_column_header();
std::string format_row(const StepRow& row);
std::string format_footer(const Report& report);

// The whole report as one JSON object.
std::string to_json(const Report& report);

}  // namespace statescan::launch
