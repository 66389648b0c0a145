// statescan-bench --lact: throughput of the GPU LaCT layer (kernels/cuda/
// lact_cuda.h) against a counted GEMM FLOP model and the bf16 cuBLAS GEMM
// rate measured in the same run (DESIGN §8).
//
// Default shape (issue 6): bf16, B = 1, T = 1,048,576 as 256 chunks of 4096,
// H = 4, D = 256, M = 512, Muon 5 steps, renorm on, no momentum, causal.
// Flags (all optional): --batch/-B, --seq-len/-T, --chunk/-C, --heads/-H,
// --dim/-D, --hidden/-M, --dtype f32|bf16, --schedule S, --momentum MU,
// --muon-steps S, --no-renorm, --warmup N, --iters N, --forward-only,
// --no-check. "--lact" itself is accepted and ignored.
//
// FLOP model (per token and fast-weight head, D x M products, 2 FLOPs per
// multiply-add): forward 18 M D (apply 6: q W0^T, q W2^T, gate W1^T;
// update gradient 12: k W0^T, k W2^T, v W1, and G0, G1, G2 over the chunk);
// backward 46 M D (apply backward 16: recomputed hidden 4, dgate 2, dW 6,
// dq 4; gradient backward 30: recomputed key side 6, u0..2 6, dk/dv from dG 6,
// dW 6, dk/dv through the hidden 6). Muon's Newton-Schulz products are
// counted separately (NS column): they depend on the chunk count, not T.
// bf16 with Muon also runs the update gradient's low bf16 terms (6 M D per
// token forward, kernels/cuda/lact_cuda_impl.cuh split_update_): executed,
// not counted.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "core/dtype.h"
#include "kernels/cpu/lact.h"

namespace statescan {

struct LactBenchOptions {
  int64_t batch = 1, seq_len = int64_t(1) << 20, chunk = 4096, heads = 4, dim = 256, hidden = 512;
  DType dtype = DType::bf16;
  LactSchedule schedule = LactSchedule::apply_then_update;
  double momentum = 0.0;
  int muon_steps = kDefaultMuonSteps;
  bool renorm = true;
  int warmup = 1, iters = 5;
  bool backward = true;  // also time forward + backward
  bool check = true;     // correctness column on a small problem of the same options
};

// Parses the flags above (argv[0] is the program); throws statescan::Error
// naming the flag on bad input.
LactBenchOptions parse_lact_bench_options(int argc, char** argv);

// The usage lines of --lact and --lact-ns (statescan-bench --help prints
// them too; `statescan-bench --lact --help` prints them alone).
extern const char* const kLactBenchUsage;

// One measured configuration.
struct LactBenchResult {
  double fwd_ms = 0, fwd_bwd_ms = 0;              // medians
  double fwd_flops = 0, fwd_bwd_flops = 0;        // token GEMM FLOP model
  double ns_fwd_flops = 0, ns_fwd_bwd_flops = 0;  // Newton-Schulz products
  double gemm_square_tflops = 0;                  // bf16 cuBLAS 4096^3 (fp32 accumulate)
  double gemm_lact_tflops = 0;                    // bf16 cuBLAS at LaCT's hidden-projection shape
  double host_fwd_ms = 0, host_bwd_ms = 0;  // host enqueue time (launch-bound when ~ GPU time)
};

// Runs the benchmark on the current GPU (throws statescan::Error without one).
LactBenchResult measure_lact(const LactBenchOptions& options);

// Parses, measures and prints the `#`-headed table; returns 0, or 1 when the
// correctness check failed. Bad arguments and a missing device throw
// statescan::Error (naming the flag, or "cuda").
int run_lact_bench(int argc, char** argv, std::ostream& out);

// statescan-bench --lact-ns: Muon's Newton-Schulz of one chunk alone (the
// bf16 layer's 3 B H matrices of min(D, M) x max(D, M), --muon-steps steps)
// in every mode of STATESCAN_LACT_NS (bf16x3, cluster, fused, fp32) in one
// process, forward and forward + backward, median of --iters after at least
// two warm-up calls. Takes the flags above (--batch, --heads, --dim,
// --hidden, --muon-steps, --warmup, --iters, --forward-only; --dtype must be
// bf16; the sequence flags are accepted and unused). Returns 0; bad arguments
// and a missing device throw as run_lact_bench's do.
int run_lact_ns_bench(int argc, char** argv, std::ostream& out);

}  // namespace statescan
