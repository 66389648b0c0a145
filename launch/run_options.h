// Command-line options of statescan-run. Parsing is a pure function of argv,
// so every rank of an mpirun job reaches the same options or the same error
// (no collective needed to agree on argument faults).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/options.h"
#include "kernels/cpu/lact.h"

namespace statescan::launch {

struct RunOptions {
  Variant variant = Variant::kda;  // unused when lact is set
  // --variant lact: the LaCT layer (parallel/lact_layer.h) instead of a
  // linear-attention mixer. D comes from --dk (q, k, v and o share it).
  bool lact = false;
  LactConfig lact_config;   // --lact-chunk --schedule --muon-steps --momentum --no-renorm
  int64_t lact_hidden = 0;  // --lact-hidden M; 0: 2 * D
  int64_t batch = 1;
  int64_t seq_len = 16384;
  int64_t heads = 4;
  int64_t dk = 64;
  int64_t dv = 64;
  int64_t chunk = 64;
  DType dtype = DType::f32;
  Exchange exchange = Exchange::automatic;
  int64_t iters = 3;
  int64_t warmup = 1;
  bool check = true;
  DeviceKind device = DeviceKind::automatic;
  // --cp-comm: the exchange's communicator with --device cuda and several
  // ranks (the CP mixer's, LaCT's all-reduces): nccl (on the GPU; one GPU per
  // rank), mpi (staged through host memory; ranks may share a GPU), auto
  // (launch/run_comm.h).
  enum class CpComm { automatic, nccl, mpi };
  CpComm cp_comm = CpComm::automatic;
  std::string load_dir;   // empty: synthetic inputs
  std::string save_dir;   // empty: nothing saved
  std::string json_path;  // empty: no JSON
  uint64_t seed = 0;
  bool l2norm = false;
  bool recompute_states = false;  // --recompute-states: backward recomputes chunk states
  bool keep_prepared = false;     // --keep-prepared: forward's prepared tiles kept for backward
  bool save_t = true;             // --no-save-t: forward saves no T (MixerConfig::save_t)
  bool check_finite = true;       // --no-check-finite: inputs not scanned for NaN/Inf
  double scale = -1.0;            // < 0: Dk^-1/2
  std::vector<int64_t> shards;    // empty: even contiguous split
  // Prometheus exporter of each rank on metrics_port + node-local rank (< 0:
  // off), bound to metrics_bind, kept up metrics_hold seconds after the run.
  int metrics_port = -1;
  std::string metrics_bind = "127.0.0.1";
  double metrics_hold = 0;
  // Progress line on stderr: automatic = on a terminal, once the run has
  // taken over ~2 s.
  enum class Progress { automatic, always, never };
  Progress progress = Progress::automatic;
  bool help = false;

  // Shape flags given explicitly (--batch, --seq-len, ...): with --load the
  // shapes come from the files, and these are reported as ignored.
  std::vector<std::string> shape_flags_given;

  // The LaCT hidden width M for head dim d.
  int64_t lact_hidden_for(int64_t d) const { return lact_hidden > 0 ? lact_hidden : 2 * d; }
};

// Parses argv[1..argc); throws statescan::Error naming the flag at fault
// (e.g. "--chunk") for unknown flags, missing or malformed values and values
// out of range, and for flags that do not apply to the chosen variant
// (--lact-* without --variant lact; --chunk, --dv != --dk, --exchange, ...
// with it).
RunOptions parse_run_options(int argc, const char* const* argv);

// The --help text.
std::string usage_text();

}  // namespace statescan::launch
