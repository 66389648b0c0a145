// statescan-bench --cp-measure (issue 5): what context parallelism adds to one
// GPU's work, measured. For each variant, on one GPU at seq_len tokens per
// rank: the local forward (prepare + scan + output, saving chunk states), the
// summary (M, E) from the same prepared tiles, the local backward, the
// backward pre-pass (state gradient only) and the merge-side map work
// (S <- M S + E and the transpose of M for backward). CUDA events, warm-up,
// medians. Then
//   overhead = (summary + pre-pass + 2 * merge) / (fwd + bwd)
// — what every rank pays beyond its local pass whatever the exchange — and
// the scaling model of parallel/cp_model.h fed with these measured times.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/options.h"
#include "parallel/exchange.h"

namespace statescan {

struct CpMeasureOptions {
  std::vector<Variant> variants{Variant::kda, Variant::gated_deltanet};
  int64_t seq_len = 131072;  // tokens per rank
  int64_t heads = 16;
  int64_t dim = 128;  // Dk = Dv
  int64_t chunk = 64;
  DType dtype = DType::bf16;
  int warmup = 2;
  int iters = 10;
  // The scaling model fed with the measured times.
  LinkPreset link = LinkPreset::nvlink;
  int gpus_per_node = 8;
  int max_ranks = 1024;
  double overlap = 0;
  std::string json_path;  // the measured rows as JSON; empty: none
};

// Measures on the current GPU and prints '#'-headed tables to `out`. Returns
// 0, or 1 when a measured overhead is above the 5% target of issue 5 (the
// table says which). Throws statescan::Error on bad options or without a GPU.
int run_cp_measure(const CpMeasureOptions& options, std::ostream& out);

}  // namespace statescan
