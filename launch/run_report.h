// The statescan-run report: a '#'-headed table in the manner of nccl-tests
// (units on every column, a #wrong correctness column on every row, '# Avg'
// and check lines at the end) and the same rows as JSON.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

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
  double hidden_pct = -1;      // exchange time hidden behind compute, % of it
                               // over all ranks; < 0: no exchange (N/A)
};

// Where one rank's pass went, in seconds (CpMixer's CpStepStats): the local
// kernels, the CP summary (forward) or pre-pass (backward), the exchange
// (waiting for the other ranks included), the merge, and the wall time of the
// call; wall minus those four is host work (checks, agreement, launches). The
// sixth, the prepare stage, is a part of one of the first three (GPU path).
struct PassPhases {
  static constexpr int kFields = 6;
  double s[kFields] = {};  // local, summary, exchange, merge, wall, prepare
  PassPhases& operator+=(const PassPhases& o) {
    for (int i = 0; i < kFields; ++i) s[i] += o.s[i];
    return *this;
  }
};

// One rank's exchange in the last timed step (forward + backward), and its
// phases' means over the timed steps.
struct RankExchange {
  double exchange_ms = 0;
  int64_t exchange_bytes = 0;
  double hidden_pct = 0;    // of this rank's exchange time
  bool has_phases = false;  // fwd/bwd below were measured
  PassPhases fwd, bwd;      // mean seconds per step
  // GPU path: device memory in use (every allocation, the stream-ordered
  // pool's reserve included) after the first and after the last timed step;
  // 0 = not measured. Growth between the two means the pool could not reuse
  // what earlier steps freed.
  double mem_first_bytes = 0, mem_last_bytes = 0;
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
  std::vector<RankExchange> ranks;  // per rank, last step; empty: not reported

  int total_wrong() const;
};

// Lines of the table, each ending in '\n'.
std::string format_header(const Report& report);
std::string format_column_header();
std::string format_row(const StepRow& row);
std::string format_footer(const Report& report);

// The whole report as one JSON object.
std::string to_json(const Report& report);

// ---- shared by the jobs of statescan-run (mixer and LaCT) ---------------------

enum ExitCode : int {
  kExitOk = 0,
  kExitWrong = 1,
  kExitBadInput = 2,
  kExitRuntime = 3,
  kExitMetrics = 4,  // the exporter could not start (port taken, built without Prometheus)
};

// Where the job is; decides the exit code of a statescan::Error.
enum class Stage { setup, steps, results };

// A failure while producing results (writing files), agreed on every rank.
class RuntimeFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Relative RMS error rms(a - ref) / rms(ref); +inf for NaN/Inf or a size
// mismatch (so they always count as wrong); absolute RMS for a zero reference.
double relative_rms(const std::vector<float>& a, const std::vector<float>& ref);

// One result file of --save: <name>.npy of the given shape.
struct NamedArray {
  std::string name;
  Shape shape;
  const std::vector<float>* data = nullptr;
};

// Creates the --save directory and checks that the --json file's folder
// exists, so that a bad location is refused before the run, not after it.
// Empty paths are skipped. Throws statescan::Error naming "--save"/"--json".
void prepare_output_locations(const std::string& save_dir, const std::string& json_path);

// Relative RMS of each array of `run` against the same-named one of
// `reference` (same order) into `errors`; returns how many exceed `tolerance`
// (NaN counts as wrong).
int count_wrong(const std::vector<NamedArray>& run, const std::vector<NamedArray>& reference,
                double tolerance, std::vector<std::pair<std::string, double>>& errors);

// Writes every array as float32 <dir>/<name>.npy: under a staging name first,
// renamed all at the end; on any failure it removes what it wrote (staged or
// already renamed), so a failed save leaves none of the result files behind.
// Throws statescan::Error naming "--save".
void save_npy_files(const std::string& dir, const std::vector<NamedArray>& arrays);

// to_json(report) into `path` through a temporary file and a rename. Throws
// statescan::Error naming "--json".
void write_report_json(const std::string& path, const Report& report);

// A run's results, all or none: the JSON report into json_path (when not
// empty), then the arrays into save_dir (when not empty); if the arrays fail,
// the report just written is removed, so a failed write leaves neither.
void write_results(const std::string& json_path, const Report& report, const std::string& save_dir,
                   const std::vector<NamedArray>& arrays);

// ---- the timed-step loop pieces both jobs share ---------------------------------

// One rank's timing of one step.
struct StepTimes {
  double fwd_s = 0, bwd_s = 0, exchange_s = 0, exchange_bytes = 0;
  double hidden_s = 0;  // of exchange_s, the part that overlapped compute
  PassPhases fwd, bwd;  // zeros where the job does not split its passes
};

// Every rank's exchange of `mine` (the last step) and, when `phases` is
// given, its phase means over the timed steps, and when `memory` is, its two
// device-memory samples (RankExchange::mem_*; all-gather, collective), for
// the per-rank lines of the footer.
std::vector<RankExchange> gather_rank_exchange(Communicator& comm, const StepTimes& mine,
                                               const StepTimes* phases = nullptr,
                                               const double* memory = nullptr);

// The table row of a step: maxima over the ranks of `comm` (collective).
// `backward` says whether the run has a backward pass; `tokens` is B*T.
StepRow reduce_step(Communicator& comm, const StepTimes& mine, int64_t step, bool backward,
                    double tokens);

// Rank 0 prints the row (the header lines first, on the first row, from
// `header`); every rank records it.
void print_row(Report& report, const StepRow& row, bool root,
               const std::vector<std::pair<std::string, std::string>>& header);

// The end of a run: rank 0 prints the footer and runs `write` (the --save
// files and --json); the agreement turns a failure there into the same
// RuntimeFailure on every rank. Returns the exit code.
int finish_report(Communicator& comm, const Report& report, const std::function<void()>& write);

}  // namespace statescan::launch
