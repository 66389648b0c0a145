// The --variant lact job of statescan-run: LactLayer (parallel/lact_layer.h)
// forward + backward over the ranks, timed step by step, checked against a
// single-rank LaCT run on rank 0, with the same table, JSON and .npy files as
// the mixer job.
//
// Layout: LaCT splits every chunk evenly over the ranks (rank r holds slice r
// of every chunk; kernels/cpu/lact.h), so the inputs are scattered and the
// outputs gathered with lact_shard / lact_unshard, not in contiguous shards.
#pragma once

#include "comm/communicator.h"
#include "launch/run_options.h"
#include "monitoring/metrics_exporter.h"
#include "launch/run_report.h"

namespace statescan::launch {

// Collective over `comm`. Returns kExitOk, or kExitWrong when the check found
// outputs over tolerance. Throws statescan::Error for faults in arguments and
// inputs (the same on every rank) and RuntimeFailure when writing the results
// failed; keeps `stage` current so that the caller maps errors to exit codes.
// `metrics` (null: none) gets every step: phases, the all-reduces under
// strategy "allreduce", tokens, counted FLOPs and memory.
int run_lact_job(Communicator& comm, const RunOptions& options, Stage& stage,
                 MetricsExporter* metrics);

}  // namespace statescan::launch
