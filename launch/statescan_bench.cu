// statescan-bench: kernel benchmarks of the CUDA forward path, in the manner
// of nccl-tests: a '#'-headed table with units on every column and a
// correctness column on every row, and the same rows as JSON.
//
//   statescan-bench [-v kda,deltanet,...] [-t 8192,32768,131072] [-b 1] [-H 16]
//                   [-d 128] [--dtype bf16] [-c 64] [-w 3] [-n 20] [--json out.json]
//
// Per variant and T: median forward time over n timed runs (after w warm-up
// runs), tokens/s, achieved TFLOP/s and GB/s against the counted model below,
// and two errors: the chunkwise output against the recurrent decode kernel on
// the whole problem, and against the fp64 reference on head 0's first 2048
// tokens (batch row 0).
//
// --cp-model prints the context-parallel scaling model of parallel/cp_model.h
// instead: predicted per-layer step time, overhead and weak-scaling efficiency
// for P = 2, 4, ... up to -P, per exchange, and what `auto` picks and why.
//   statescan-bench --cp-model [--variant kda] [--seq-len 131072] [-P 1024]
//                   [--link hierarchical|nvlink|ib] [--gpus-per-node 8]
//                   [--link-bw-GBps X] [--link-latency-us X] [--ib-bw-GBps X]
//                   [--ib-latency-us X] [--compose-TFLOPs X] [--overlap F]
//                   [--fwd-ms X] [--bwd-ms X] [--summary-fwd-ms X]
//                   [--summary-fwd-first-ms X] [--summary-bwd-ms X] [--merge-ms X]
//                   [--bwd-prepare-ms X] [--cp-measure] [--json F]
// It never touches CUDA (it runs on machines without a GPU); the local forward
// and backward times are --fwd-ms / --bwd-ms, else the H200 figures measured
// in README.md for the variant (scaled linearly in B*T*H; D=128, chunk 64,
// bf16 only), the summaries the counted work at rates calibrated on the
// measured KDA summary (parallel/cp_model.h). --cp-measure instead measures every piece on
// GPU 0 (local forward and backward, summary, pre-pass, merge: the overhead of
// issue 5) and feeds the model with them (launch/bench_cp_cuda.h).
//
// --lact (as the first argument) benchmarks the LaCT layer instead, with its
// own flags (launch/bench_lact.h), e.g. statescan-bench --lact --muon-steps 0.
// --lact-ns times the layer's Newton-Schulz alone in every mode (same flags).
//
// FLOP model: monitoring/flop_model.h (the products of the algorithm per token
// and head, multiply-add = 2 FLOP; for Dk = Dv = D and chunk C additive
// 2*C*D + 4*D^2, delta 5*C*D + 6*D^2), the model statescan-run's
// achieved-TFLOP/s metric uses too.
// Byte model: the unavoidable HBM traffic: read q, k, v, g, beta, write o;
// the per-chunk intermediates and states are not counted.
//
// --decode: the recurrent decode kernel (cuda::decode_forward) as a server
// steps it: T tokens (default 1) of each of B sequences from a random fp32
// state updated in place; time per call (replayed from a CUDA graph),
// tokens/s, GB/s of the state and tokens moved and its share of HBM's peak,
// and o and the new state of batch row 0 against the fp64 reference.
//   statescan-bench --decode [-v gated_deltanet] [-t 1] [-b 64] [-H 16] [-d 128] [--dv 256]
// (-d is Dk, --dv Dv when they differ: GLA's Dk = Dv / 2, Mamba-2's 128 x 64.)
//
// --backward: forward + backward rows instead (kernels/cuda/chunk_backward.cuh):
//   statescan-bench --backward [--recompute | --keep-prepared] [-v kda] [-t 32768,1048576]
//                   [-n 5] [--json F]
// (--recompute: forward saves no chunk states; backward recomputes them.
// --keep-prepared: the step is cuda::PreparedForward -> PreparedBackward, the
// backward adopting the forward's prepared tiles (Q^, K_, W, U, A, decay:
// 72 KB per chunk and head at D = 128, bf16) instead of re-running the
// prepare stage; its peak adds the high watermark of statescan's workspace
// allocator (core/device_pool.h), where those classes take their workspace.
// By default the forward of a delta rule without a vector gate also writes
// T = (I + diag(beta) KK)^{-1} in two parts into MixerParams::saved_t and the
// backward's prepare re-run reads it instead of forming KK and solving, as
// MixerConfig::save_t does in the layer; --no-save-t: not saved, the re-run solves again)
// Per variant and T: median forward time (saving chunk_states), median
// forward+backward time, tokens/s of the pair, TFLOP/s and GB/s of the pair
// against the counted models below, the peak device memory of the step
// (inputs, outputs, gradients, chunk states and one shared workspace:
// cudaMemGetInfo before and after allocating them; the kernels allocate
// nothing else), and err_grad: the largest relative RMS error over dq, dk, dv,
// dg, dbeta, dh0 of a separate 512-token, 2-head problem cut from the same
// inputs, against the fp64 reference backward.
// Backward FLOP model: monitoring/flop_model.h again (with the intra-chunk
// recomputation this design does; Dk = Dv = D: additive 5*C*D + 8*D^2, delta
// 14*C*D + 14*D^2).
// Backward bytes: read q, k, v, g, beta, dO and the fp32 chunk states
// (4*D^2/C per token), write dq, dk, dv, dg, dbeta; the forward of the pair
// also writes the chunk states.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "core/cli_parse.h"
#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/device_pool.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/options.h"
#include "core/text_file.h"
#include "kernels/cpu/reference.h"
#include "kernels/cuda/cp_kernels.h"
#include "kernels/cuda/cuda_mixer.h"
#include "launch/bench_cp_cuda.h"
#include "launch/bench_lact.h"
#include "launch/bench_plot.h"
#include "monitoring/flop_model.h"
#include "parallel/cp_model.h"
#include "parallel/exchange.h"

namespace statescan {
namespace {

struct Options {
  std::vector<Variant> variants{std::begin(kAllVariants), std::end(kAllVariants)};
  std::vector<int64_t> lengths{8192, 32768, 131072};
  int64_t batch = 1, heads = 16, dim = 128, chunk = 64;
  DType dtype = DType::bf16;
  int warmup = 3, iters = 20;
  std::string json;
  std::string plot;  // --plot FILE.png: tokens/s against T, one line per variant
  bool help = false;
  bool backward = false;  // --backward: forward + backward rows
  bool recompute = false;  // --recompute: with --backward, chunk states recomputed
  bool keep_prepared = false;  // --keep-prepared: with --backward, forward tiles kept
  bool save_t = true;  // --no-save-t: with --backward, forward saves no T (MixerParams::saved_t)
  bool decode = false;         // --decode: the recurrent decode kernel's rows
  int64_t dv = 0;              // --dv (--decode): Dv apart from -d, then Dk; 0: Dv = -d
  bool lengths_given = false;  // -t given (--decode's default is one token)

  // --cp-model (see the comment at the top); negative times mean "not given".
  bool cp_model = false, cp_measure = false;
  Variant cp_variant = Variant::kda;
  bool cp_variant_given = false;  // --cp-measure: one variant instead of kda and gdn
  int64_t cp_seq_len = 131072;
  int cp_max_ranks = 1024;
  LinkPreset link = LinkPreset::hierarchical;
  int gpus_per_node = 8;
  double link_bw_GBps = -1, link_latency_us = -1, ib_bw_GBps = -1, ib_latency_us = -1;
  double compose_tflops = -1, overlap = 0;
  double fwd_ms = -1, bwd_ms = -1, summary_fwd_ms = -1, summary_fwd_first_ms = -1,
         summary_bwd_ms = -1, merge_ms = -1, bwd_prepare_ms = -1;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// Upper bounds of the integer flags, far past any real run (their products
// are checked by check_tensor_elements).
constexpr int64_t kMaxTokens = int64_t{1} << 40, kMaxCount = int64_t{1} << 20;

// The modes that read each flag (the backward-only switches --recompute,
// --keep-prepared and --no-save-t have checks of their own below): a flag
// given to a mode that does not read it is refused, not ignored.
enum ModeBits : unsigned {
  kForward = 1,
  kBackward = 2,
  kModel = 4,
  kMeasure = 8,
  kDecode = 16,
  kTables = kForward | kBackward,
  kCp = kModel | kMeasure,
  kAllModes = 31
};
struct FlagModes {
  const char* name;
  const char* alias;  // or nullptr
  unsigned modes;
};
constexpr FlagModes kFlagModes[] = {
    {"--variants", "-v", kTables | kDecode},
    {"--lengths", "-t", kTables | kDecode},
    {"--batch", "-b", kTables | kModel | kDecode},
    {"--heads", "-H", kAllModes},
    {"--dim", "-d", kAllModes},
    {"--dv", nullptr, kDecode},
    {"--chunk", "-c", kTables | kCp},
    {"--dtype", nullptr, kAllModes},
    {"--warmup", "-w", kTables | kMeasure | kDecode},
    {"--iters", "-n", kTables | kMeasure | kDecode},
    {"--json", nullptr, kAllModes},
    {"--plot", nullptr, kForward},
    {"--variant", nullptr, kCp},
    {"--seq-len", nullptr, kCp},
    {"-P", nullptr, kCp},
    {"--link", nullptr, kCp},
    {"--gpus-per-node", nullptr, kCp},
    {"--overlap", nullptr, kCp},
    {"--link-bw-GBps", nullptr, kModel},
    {"--link-latency-us", nullptr, kModel},
    {"--ib-bw-GBps", nullptr, kModel},
    {"--ib-latency-us", nullptr, kModel},
    {"--compose-TFLOPs", nullptr, kModel},
    {"--fwd-ms", nullptr, kModel},
    {"--bwd-ms", nullptr, kModel},
    {"--summary-fwd-ms", nullptr, kModel},
    {"--summary-fwd-first-ms", nullptr, kModel},
    {"--summary-bwd-ms", nullptr, kModel},
    {"--merge-ms", nullptr, kModel},
    {"--bwd-prepare-ms", nullptr, kModel},
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      SS_CHECK_ARG(i + 1 < argc, arg, "needs a value");
      return argv[++i];
    };
    if (arg == "-v" || arg == "--variants") {
      o.variants.clear();
      for (auto& v : split(value())) o.variants.push_back(parse_variant(v, arg.c_str()));
    } else if (arg == "-t" || arg == "--lengths") {
      o.lengths.clear();
      for (auto& v : split(value())) o.lengths.push_back(parse_int(v, arg.c_str(), 1, kMaxTokens));
      o.lengths_given = true;
    } else if (arg == "-b" || arg == "--batch") {
      o.batch = parse_int(value(), arg.c_str(), 1, kMaxCount);
    } else if (arg == "-H" || arg == "--heads") {
      o.heads = parse_int(value(), arg.c_str(), 1, kMaxCount);
    } else if (arg == "-d" || arg == "--dim") {
      o.dim = parse_int(value(), arg.c_str(), 1, 256);
    } else if (arg == "--dv") {
      o.dv = parse_int(value(), arg.c_str(), 1, 4096);
    } else if (arg == "-c" || arg == "--chunk") {
      o.chunk = parse_int(value(), arg.c_str(), 1, 256);
    } else if (arg == "--dtype") {
      o.dtype = parse_dtype(value(), "--dtype");
    } else if (arg == "-w" || arg == "--warmup") {
      o.warmup = static_cast<int>(parse_int(value(), arg.c_str(), 0, kMaxCount));
    } else if (arg == "-n" || arg == "--iters") {
      o.iters = static_cast<int>(parse_int(value(), arg.c_str(), 1, kMaxCount));
    } else if (arg == "--json") {
      o.json = value();
    } else if (arg == "--plot") {
      o.plot = value();
      // Refused before the GPU work rather than after it.
      SS_CHECK_ARG(o.plot.size() > 4 && o.plot.compare(o.plot.size() - 4, 4, ".png") == 0, "--plot",
                   "'", o.plot, "' must end in .png");
    } else if (arg == "--backward") {
      o.backward = true;
    } else if (arg == "--decode") {
      o.decode = true;
    } else if (arg == "--recompute") {
      o.recompute = true;
    } else if (arg == "--keep-prepared") {
      o.keep_prepared = true;
    } else if (arg == "--no-save-t") {
      o.save_t = false;
    } else if (arg == "--cp-model") {
      o.cp_model = true;
    } else if (arg == "--cp-measure") {
      o.cp_model = o.cp_measure = true;
    } else if (arg == "--variant") {
      o.cp_variant = parse_variant(value(), "--variant");
      o.cp_variant_given = true;
    } else if (arg == "--seq-len") {
      o.cp_seq_len = parse_int(value(), "--seq-len", 1, kMaxTokens);
    } else if (arg == "-P") {
      o.cp_max_ranks = static_cast<int>(parse_int(value(), "-P", 2, kMaxCount));
    } else if (arg == "--link") {
      o.link = parse_link_preset(value(), "--link");
    } else if (arg == "--gpus-per-node") {
      o.gpus_per_node = static_cast<int>(parse_int(value(), "--gpus-per-node", 1, kMaxCount));
    } else if (arg == "--link-bw-GBps") {
      o.link_bw_GBps = parse_positive_number(value(), "--link-bw-GBps");
    } else if (arg == "--link-latency-us") {
      o.link_latency_us = parse_positive_number(value(), "--link-latency-us");
    } else if (arg == "--ib-bw-GBps") {
      o.ib_bw_GBps = parse_positive_number(value(), "--ib-bw-GBps");
    } else if (arg == "--ib-latency-us") {
      o.ib_latency_us = parse_positive_number(value(), "--ib-latency-us");
    } else if (arg == "--compose-TFLOPs") {
      o.compose_tflops = parse_positive_number(value(), "--compose-TFLOPs");
    } else if (arg == "--overlap") {
      const std::string v = value();
      o.overlap = parse_number(v, "--overlap");
      SS_CHECK_ARG(o.overlap >= 0 && o.overlap <= 1, "--overlap", "must be in [0, 1], got ", v);
    } else if (arg == "--fwd-ms") {
      o.fwd_ms = parse_positive_number(value(), "--fwd-ms");
    } else if (arg == "--bwd-ms") {
      o.bwd_ms = parse_positive_number(value(), "--bwd-ms");
    } else if (arg == "--summary-fwd-ms") {
      o.summary_fwd_ms = parse_positive_number(value(), "--summary-fwd-ms");
    } else if (arg == "--summary-fwd-first-ms") {
      o.summary_fwd_first_ms = parse_positive_number(value(), "--summary-fwd-first-ms");
    } else if (arg == "--summary-bwd-ms") {
      o.summary_bwd_ms = parse_positive_number(value(), "--summary-bwd-ms");
    } else if (arg == "--merge-ms") {
      o.merge_ms = parse_positive_number(value(), "--merge-ms");
    } else if (arg == "--bwd-prepare-ms") {
      o.bwd_prepare_ms = parse_positive_number(value(), "--bwd-prepare-ms");
    } else if (arg == "-h" || arg == "--help") {
      o.help = true;
    } else {
      // A stray word is named "arguments" (main's exit 2 reads the name).
      SS_CHECK_ARG(arg.rfind('-', 0) != 0, arg, "unknown option");
      SS_FAIL("arguments", "unknown positional argument '", arg, "'");
    }
  }
  // A serving step: one new token a sequence.
  if (o.decode && !o.lengths_given) o.lengths = {1};
  SS_CHECK_ARG(!(o.decode && (o.backward || o.cp_model)), "--decode",
               "cannot be combined with --backward, --cp-model or --cp-measure");
  for (const int64_t T : o.lengths) {
    check_tensor_elements({{"-b", o.batch}, {"-t", T}, {"-H", o.heads}, {"-d", o.dim}}, "-t");
    if (o.dv > 0)
      check_tensor_elements({{"-b", o.batch}, {"-t", T}, {"-H", o.heads}, {"--dv", o.dv}}, "-t");
  }
  SS_CHECK_ARG(!o.recompute || o.backward, "--recompute", "applies to --backward only");
  SS_CHECK_ARG(!o.keep_prepared || o.backward, "--keep-prepared", "applies to --backward only");
  SS_CHECK_ARG(o.save_t || o.backward, "--no-save-t", "applies to --backward only");
  SS_CHECK_ARG(!(o.keep_prepared && o.recompute), "--keep-prepared",
               "cannot be combined with --recompute (the kept tiles go with saved chunk states)");
  const unsigned mode = o.cp_measure ? kMeasure
                        : o.cp_model ? kModel
                        : o.backward ? kBackward
                        : o.decode   ? kDecode
                                     : kForward;
  const char* mode_name = o.cp_measure ? "--cp-measure"
                          : o.cp_model ? "--cp-model"
                          : o.backward ? "--backward"
                          : o.decode   ? "--decode"
                                       : "the forward table";
  for (int i = 1; i < argc; ++i)
    for (const FlagModes& f : kFlagModes)
      if (argv[i] == std::string(f.name) || (f.alias != nullptr && argv[i] == std::string(f.alias)))
        SS_CHECK_ARG((f.modes & mode) != 0, argv[i], "does not apply to ", mode_name,
                     " (it would be ignored)");
  return o;
}

// ---- device-side random inputs (host copies of 128K-token problems would be
// gigabytes of doubles) -----------------------------------------------------------

__device__ uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Standard normal sample number i of stream `seed` (Box-Muller on a hash).
__device__ float hashed_normal(uint64_t seed, uint64_t i) {
  const uint64_t r = mix64(seed * 0x9e3779b97f4a7c15ull + i);
  const float u1 = (static_cast<float>(r >> 40) + 0.5f) * (1.f / 16777216.f);
  const float u2 = static_cast<float>((r >> 16) & 0xffffff) * (1.f / 16777216.f);
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

enum class Fill { normal, log_gate, sigmoid };

// Fills n elements of dtype `t` (raw bytes at out) with DESIGN §7's
// distributions: N(0,1), logsigmoid(N(0,1) + 4) or sigmoid(N(0,1)).
__global__ void fill_random_kernel(void* out, DType t, int64_t n, uint64_t seed, Fill fill) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    float x = hashed_normal(seed, static_cast<uint64_t>(i));
    if (fill == Fill::log_gate) x = -log1pf(expf(-(x + 4.f)));
    if (fill == Fill::sigmoid) x = 1.f / (1.f + expf(-x));
    if (t == DType::f32) static_cast<float*>(out)[i] = x;
    if (t == DType::bf16) static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x);
    if (t == DType::f16) static_cast<__half*>(out)[i] = __float2half_rn(x);
  }
}

void fill_random(void* out, DType t, int64_t n, uint64_t seed, Fill fill) {
  fill_random_kernel<<<1024, 256>>>(out, t, n, seed, fill);
  SS_LAUNCH_CHECK("fill_random_kernel");
}

// rms(a - b) / rms(b); infinite if a holds a NaN/Inf.
template <typename B>
double rel_rms_host(const std::vector<float>& a, const std::vector<B>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double diff = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += diff * diff;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

std::vector<float> download(const void* data, DType t, int64_t n) {
  std::vector<unsigned char> bytes(static_cast<std::size_t>(n) * size_of(t));
  SS_CUDA_CHECK(cudaMemcpy(bytes.data(), data, bytes.size(), cudaMemcpyDeviceToHost));
  std::vector<float> f(static_cast<std::size_t>(n));
  convert_to_float(t, bytes.data(), f.data(), f.size());
  return f;
}

std::vector<double> as_double(const std::vector<float>& x) {
  return std::vector<double>(x.begin(), x.end());
}

// Bytes a token's inputs take in HBM: q, k (Dk wide), v (Dv) and beta (es bytes an
// element), the fp32 gate (Dk wide); o adds Dv es more. The byte models of every table
// start here.
double input_bytes_per_token(Variant variant, int64_t Dk, int64_t Dv, std::size_t es) {
  const double dk = static_cast<double>(Dk), dv = static_cast<double>(Dv);
  return (2.0 * dk + dv) * es +
         (has_gate(variant) ? (vector_gate(variant) ? 4.0 * dk : 4.0) : 0.0) +
         (has_beta(variant) ? es : 0.0);
}

// What a table row measured: the columns and JSON fields both tables share.
struct RowShape {
  std::string variant;
  int64_t batch = 0, seq_len = 0, heads = 0, dim = 0;
  std::string dtype;
};

RowShape row_shape(const Options& opt, Variant variant, int64_t T) {
  return {to_string(variant), opt.batch, T, opt.heads, opt.dim, to_string(opt.dtype)};
}

// The shared columns of a row, before the table's own.
void print_shape(const RowShape& r) {
  std::printf("  %-15s %8lld %3lld %4lld %4lld", r.variant.c_str(),
              static_cast<long long>(r.seq_len), static_cast<long long>(r.batch),
              static_cast<long long>(r.heads), static_cast<long long>(r.dim));
}

// A table: one row per (variant, length), printed as it is measured (each
// row by print_row after print_shape), then as a JSON array when --json is
// given: {"op": op, the shape's fields, then json_fields(out, row)}.
template <typename R, typename Bench, typename PrintRow, typename JsonFields>
std::vector<R> run_rows(const Options& opt, const char* op, Bench&& bench, PrintRow&& print_row,
                        JsonFields&& json_fields) {
  std::vector<R> rows;
  for (Variant variant : opt.variants) {
    for (int64_t T : opt.lengths) {
      const R r = bench(variant, T);
      rows.push_back(r);
      print_shape(r);
      print_row(r);
      std::fflush(stdout);
    }
  }
  if (!opt.json.empty()) {
    std::ostringstream out;
    out << "[\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const R& r = rows[i];
      out << "  {\"op\": \"" << op << "\", \"variant\": \"" << r.variant << "\", \"B\": " << r.batch
          << ", \"T\": " << r.seq_len << ", \"H\": " << r.heads << ", \"D\": " << r.dim
          << ", \"dtype\": \"" << r.dtype << "\"";
      json_fields(out, r);
      out << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    out << "]\n";
    write_text_file(opt.json, out.str(), "--json");
  }
  return rows;
}

struct Row : RowShape {
  double ms, tokens_per_s, tflops, gbps, err_decode, err_ref;
};

// Strided slice [tokens, head 0, D] of a [T, H, D] device tensor, to host.
std::vector<float> head0_slice(const void* data, DType t, int64_t tokens, int64_t heads,
                               int64_t d) {
  std::vector<float> all = download(data, t, tokens * heads * d);
  std::vector<float> out(static_cast<std::size_t>(tokens * d));
  for (int64_t i = 0; i < tokens; ++i)
    std::copy_n(all.begin() + (i * heads) * d, d, out.begin() + i * d);
  return out;
}

// Median of n timed calls of fn on `stream` (after `warmup` untimed ones).
// The timed calls lie in a profiler range (no-ops unprofiled), so that `ncu
// --profile-from-start off` sees their kernels alone, however many a call
// launches (scripts/gpu-check.sh NCU=1).
template <typename Fn>
double median_ms(Fn&& fn, int warmup, int iters, cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<cudaEvent_t> events(static_cast<std::size_t>(iters) + 1);
  for (auto& e : events) SS_CUDA_CHECK(cudaEventCreate(&e));
  SS_CUDA_CHECK(cudaProfilerStart());
  SS_CUDA_CHECK(cudaEventRecord(events[0], stream));
  for (int i = 0; i < iters; ++i) {
    fn();
    SS_CUDA_CHECK(cudaEventRecord(events[static_cast<std::size_t>(i) + 1], stream));
  }
  SS_CUDA_CHECK(cudaStreamSynchronize(stream));
  SS_CUDA_CHECK(cudaProfilerStop());
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    SS_CUDA_CHECK(cudaEventElapsedTime(&ms, events[i], events[i + 1]));
    times.push_back(ms);
  }
  for (auto& e : events) SS_CUDA_CHECK(cudaEventDestroy(e));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The device tensors of one forward + backward step, [B, T, H, *].
struct StepTensors {
  DeviceBuffer<unsigned char> q, k, v, o, d_o, dq, dk, dv, beta, dbeta;
  DeviceBuffer<float> g, dg, chunk_states, dh0;

  // D is Dk (q, k, a vector gate), Dv the width of v and o.
  // backward = false: the forward's tensors only (no d_o or gradients).
  StepTensors(Variant variant, int64_t B, int64_t T, int64_t H, int64_t D, int64_t Dv, DType t,
              int64_t num_chunks, bool backward = true)
      : q(B * T * H * D * size_of(t)),
        k(q.size()),
        v(B * T * H * Dv * size_of(t)),
        o(v.size()),
        d_o(backward ? v.size() : 0),
        dq(backward ? q.size() : 0),
        dk(dq.size()),
        dv(d_o.size()),
        beta(has_beta(variant) ? B * T * H * size_of(t) : 0),
        dbeta(backward ? beta.size() : 0),
        g(has_gate(variant) ? B * T * H * (vector_gate(variant) ? D : 1) : 0),
        dg(backward ? g.size() : 0),
        chunk_states(static_cast<std::size_t>(num_chunks * H * D * Dv)),
        dh0(backward ? static_cast<std::size_t>(B * H * D * Dv) : 0),
        dtype_(t),
        dv_(Dv),
        elems_(B * T * H * D),
        v_elems_(B * T * H * Dv),
        token_heads_(B * T * H) {}

  // Random inputs (and d_o): seeds seed + 1 .. seed + 6 for q, k, v, g, beta, d_o.
  void fill(uint64_t seed) {
    fill_random(q.data(), dtype_, elems_, seed + 1, Fill::normal);
    fill_random(k.data(), dtype_, elems_, seed + 2, Fill::normal);
    fill_random(v.data(), dtype_, v_elems_, seed + 3, Fill::normal);
    if (g.size())
      fill_random(g.data(), DType::f32, static_cast<int64_t>(g.size()), seed + 4, Fill::log_gate);
    if (beta.size()) fill_random(beta.data(), dtype_, token_heads_, seed + 5, Fill::sigmoid);
    if (d_o.size()) fill_random(d_o.data(), dtype_, v_elems_, seed + 6, Fill::normal);
  }

  // Forward and backward parameters over these tensors.
  // With no chunk_states buffer (num_chunks 0) the backward recomputes them.
  MixerBwdParams params(Variant variant, int64_t B, int64_t T, int64_t H, int64_t D, DType t,
                        int64_t chunk) {
    MixerBwdParams p;
    p.variant = variant;
    p.batch = B;
    p.seq_len = T;
    p.heads = H;
    p.dk = D;
    p.dv = dv_;
    p.chunk = chunk;
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    p.l2norm_qk = has_beta(variant);  // delta rules need unit-norm keys
    p.dtype = t;
    p.num_segments = B;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.g = g.size() ? g.data() : nullptr;
    p.beta = beta.size() ? beta.data() : nullptr;
    p.o = o.data();
    p.chunk_states = chunk_states.size() ? chunk_states.data() : nullptr;
    p.recompute_chunk_states = chunk_states.size() == 0;
    p.d_o = d_o.size() ? d_o.data() : nullptr;
    p.dq = dq.size() ? dq.data() : nullptr;
    p.dk_out = dk.size() ? dk.data() : nullptr;
    p.dv_out = dv.size() ? dv.data() : nullptr;
    p.dg = dg.size() ? dg.data() : nullptr;
    p.dbeta = dbeta.size() ? dbeta.data() : nullptr;
    p.d_initial_state = dh0.size() ? dh0.data() : nullptr;
    return p;
  }

 private:
  DType dtype_;
  int64_t dv_, elems_, v_elems_, token_heads_;
};

Row bench_one(const Options& opt, Variant variant, int64_t T) {
  const int64_t B = opt.batch, H = opt.heads, D = opt.dim;
  const DType t = opt.dtype;
  const std::size_t es = size_of(t);
  const int64_t tokens = B * T * H;
  const bool vec = vector_gate(variant);
  StepTensors x(variant, B, T, H, D, D, t, 0, /*backward=*/false);
  x.fill(0);
  DeviceBuffer<unsigned char> o_decode(tokens * D * es);
  DeviceBuffer<float> final_state(B * H * D * D), final_decode(B * H * D * D);
  MixerParams p = x.params(variant, B, T, H, D, t, opt.chunk);
  p.final_state = final_state.data();

  DeviceBuffer<unsigned char> workspace(cuda::forward_workspace_bytes(p));
  cudaStream_t stream;
  SS_CUDA_CHECK(cudaStreamCreate(&stream));
  const double ms = median_ms(
      [&] { cuda::mixer_forward(p, workspace.data(), workspace.size(), stream); }, opt.warmup,
      opt.iters, stream);

  // Correctness 1: the recurrent decode kernel on the whole problem.
  MixerParams pd = p;
  pd.o = o_decode.data();
  pd.final_state = final_decode.data();
  cuda::decode_forward(pd, stream);
  SS_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<float> o_host = download(x.o.data(), t, tokens * D);
  const std::vector<float> od_host = download(o_decode.data(), t, tokens * D);
  const double err_decode = rel_rms_host(o_host, od_host);

  // Correctness 2: fp64 reference on head 0 of batch row 0, first T_ref tokens
  // (the chunkwise output there does not depend on later tokens).
  const int64_t t_ref = std::min<int64_t>(T, 2048);
  ref::Problem rp;
  rp.variant = variant;
  rp.batch = 1;
  rp.seq_len = t_ref;
  rp.heads = 1;
  rp.dk = rp.dv = D;
  rp.scale = p.scale;
  rp.l2norm_qk = p.l2norm_qk;
  rp.q = as_double(head0_slice(x.q.data(), t, t_ref, H, D));
  rp.k = as_double(head0_slice(x.k.data(), t, t_ref, H, D));
  rp.v = as_double(head0_slice(x.v.data(), t, t_ref, H, D));
  if (x.g.size()) {
    rp.g = as_double(vec ? head0_slice(x.g.data(), DType::f32, t_ref, H, D)
                         : head0_slice(x.g.data(), DType::f32, t_ref, H, 1));
  }
  if (x.beta.size()) rp.beta = as_double(head0_slice(x.beta.data(), t, t_ref, H, 1));
  const ref::Outputs want = ref::forward(rp);
  const double err_ref = rel_rms_host(head0_slice(x.o.data(), t, t_ref, H, D), want.o);

  SS_CUDA_CHECK(cudaStreamDestroy(stream));

  const double flops = chunkwise_forward_flops({variant, tokens, 1, D, D, opt.chunk});
  const double bytes_per_token = input_bytes_per_token(variant, D, D, es) + D * es;
  Row r;
  static_cast<RowShape&>(r) = row_shape(opt, variant, T);
  r.ms = ms;
  r.tokens_per_s = B * T / (ms * 1e-3);
  r.tflops = flops / (ms * 1e-3) / 1e12;
  r.gbps = bytes_per_token * tokens / (ms * 1e-3) / 1e9;
  r.err_decode = err_decode;
  r.err_ref = err_ref;
  return r;
}

// ---- --decode: the recurrent kernel as a server steps it ----------------------

struct DecodeRow : RowShape {
  int64_t dv = 0;  // Dv (RowShape's dim is Dk)
  double us, tokens_per_s, gbps, err_ref;
};

// HBM's peak in GB/s from the device's memory clock and bus width (double
// data rate), for the decode table's share of it.
double hbm_peak_gbps(int device) {
  int clock_khz = 0, bus_bits = 0;
  SS_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
  SS_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
}

// The time of one cuda::decode_forward call (from CUDA graph replays of
// kDecodeGraphCalls calls): T tokens (default 1) of each of B sequences, from
// a random fp32 state the call updates in place (initial_state ==
// final_state, as a server keeps one state a sequence). Bytes: the state read
// and written (2 B H Dk Dv 4) plus the tokens' inputs and o; at T = 1 the
// state is nearly all of them, so GB/s against HBM's peak is the kernel's
// efficiency. err_ref: o and the new state of batch row 0 (every head), from
// the same start, against the fp64 reference: the larger.
constexpr int kDecodeGraphCalls = 10;

DecodeRow bench_decode(const Options& opt, Variant variant, int64_t T) {
  const int64_t B = opt.batch, H = opt.heads, D = opt.dim, Dv = opt.dv > 0 ? opt.dv : D;
  const DType t = opt.dtype;
  StepTensors x(variant, B, T, H, D, Dv, t, 0, /*backward=*/false);
  x.fill(0);
  const int64_t state_elems = B * H * D * Dv;
  DeviceBuffer<float> state(static_cast<std::size_t>(state_elems)),
      state0(static_cast<std::size_t>(state_elems));
  fill_random(state0.data(), DType::f32, state_elems, 7, Fill::normal);
  MixerParams p = x.params(variant, B, T, H, D, t, opt.chunk);
  p.initial_state = state.data();
  p.final_state = state.data();
  cudaStream_t stream;
  SS_CUDA_CHECK(cudaStreamCreate(&stream));
  auto restart = [&] {
    SS_CUDA_CHECK(cudaMemcpyAsync(state.data(), state0.data(), state.size() * sizeof(float),
                                  cudaMemcpyDeviceToDevice, stream));
  };
  restart();
  // A server replays its decode step from a CUDA graph, and a call of a few
  // µs is shorter than a launch from the host: time replays of a graph of
  // kDecodeGraphCalls calls (as fla_bench.py --decode times FLA's), a call
  // each. One call first, outside the capture, so a bad argument throws there.
  cuda::decode_forward(p, stream);
  cudaGraph_t graph = nullptr;
  SS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kDecodeGraphCalls; ++i) cuda::decode_forward(p, stream);
  SS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t replay = nullptr;
  SS_CUDA_CHECK(cudaGraphInstantiate(&replay, graph, 0));
  const double ms = median_ms([&] { SS_CUDA_CHECK(cudaGraphLaunch(replay, stream)); }, opt.warmup,
                              opt.iters, stream) /
                    kDecodeGraphCalls;
  SS_CUDA_CHECK(cudaGraphExecDestroy(replay));
  SS_CUDA_CHECK(cudaGraphDestroy(graph));

  // Correctness: one call from the start state again, batch row 0 of
  // [B, T, H, *] (its first T H elements) against the reference.
  restart();
  cuda::decode_forward(p, stream);
  SS_CUDA_CHECK(cudaStreamSynchronize(stream));
  SS_CUDA_CHECK(cudaStreamDestroy(stream));
  auto fetch = [](const void* data, DType type, int64_t n) {
    return as_double(download(data, type, n));
  };
  const int64_t row = T * H;
  ref::Problem rp;
  rp.variant = variant;
  rp.seq_len = T;
  rp.heads = H;
  rp.dk = D;
  rp.dv = Dv;
  rp.scale = p.scale;
  rp.l2norm_qk = p.l2norm_qk;
  rp.q = fetch(x.q.data(), t, row * D);
  rp.k = fetch(x.k.data(), t, row * D);
  rp.v = fetch(x.v.data(), t, row * Dv);
  if (x.g.size()) rp.g = fetch(x.g.data(), DType::f32, vector_gate(variant) ? row * D : row);
  if (x.beta.size()) rp.beta = fetch(x.beta.data(), t, row);
  rp.h0 = fetch(state0.data(), DType::f32, H * D * Dv);
  const ref::Outputs want = ref::forward(rp);
  const double err_o = rel_rms_host(download(x.o.data(), t, row * Dv), want.o);
  const double err_state = rel_rms_host(download(state.data(), DType::f32, H * D * Dv), want.ht);

  const std::size_t es = size_of(t);
  const double token_bytes = input_bytes_per_token(variant, D, Dv, es) + Dv * es;
  const double bytes = 2.0 * 4.0 * static_cast<double>(state_elems) + token_bytes * B * T * H;
  DecodeRow r;
  static_cast<RowShape&>(r) = row_shape(opt, variant, T);
  r.dv = Dv;
  r.us = ms * 1e3;
  r.tokens_per_s = B * T / (ms * 1e-3);
  r.gbps = bytes / (ms * 1e-3) / 1e9;
  r.err_ref = std::max(err_o, err_state);
  return r;
}

int run_decode_table(const Options& opt, const cudaDeviceProp& prop) {
  int device = 0;
  SS_CUDA_CHECK(cudaGetDevice(&device));
  const double peak = hbm_peak_gbps(device);
  std::printf(
      "# statescan-bench: recurrent decode (cuda::decode_forward) on %s (%d SMs, "
      "HBM peak %.0f GB/s)\n",
      prop.name, prop.multiProcessorCount, peak);
  std::printf(
      "# dtype %s, fp32 state updated in place, warm-up %d, timed %d (median) replays of a "
      "CUDA graph of %d calls, time a call; l2norm_qk on delta rules\n",
      to_string(opt.dtype), opt.warmup, opt.iters, kDecodeGraphCalls);
  std::printf(
      "# GB/s: the state read and written plus the tokens' inputs and o; err_ref: o and "
      "the new state of batch row 0 vs fp64\n#\n");
  std::printf("# %-15s %8s %3s %4s %4s %4s %10s %12s %9s %6s %11s\n", "variant", "T", "B", "H", "D",
              "Dv", "time(us)", "tokens/s", "GB/s", "%peak", "err_ref");
  run_rows<DecodeRow>(
      opt, "decode", [&](Variant v, int64_t T) { return bench_decode(opt, v, T); },
      [&](const DecodeRow& r) {
        std::printf(" %4lld %10.2f %12.4g %9.1f %6.1f %11.2e\n", static_cast<long long>(r.dv), r.us,
                    r.tokens_per_s, r.gbps, 100.0 * r.gbps / peak, r.err_ref);
      },
      [&](std::ostream& out, const DecodeRow& r) {
        out << ", \"Dv\": " << r.dv << ", \"us\": " << r.us
            << ", \"tokens_per_s\": " << r.tokens_per_s << ", \"gbps\": " << r.gbps
            << ", \"hbm_peak_gbps\": " << peak << ", \"err_ref\": " << json_number(r.err_ref);
      });
  return 0;
}

struct BwdRow : RowShape {
  double ms_fwd, ms_fwd_bwd, tokens_per_s, tflops, gbps, peak_gb, err_grad;
  bool saved_t = false;  // the forward saved T (MixerParams::saved_t)
};

// Head h's [tokens, d] slice of a [tokens, heads, d] host array, as doubles.
std::vector<double> head_slice(const std::vector<float>& all, int64_t tokens, int64_t heads,
                               int64_t h, int64_t d) {
  std::vector<double> out(static_cast<std::size_t>(tokens * d));
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t e = 0; e < d; ++e) out[i * d + e] = all[(i * heads + h) * d + e];
  return out;
}

// err_grad: forward + backward of a T_ref-token, 2-head problem whose inputs
// are the first tokens of the big one, against ref::backward on every head,
// through the path the row times: T saved or solved again (save_t), the
// forward's tiles kept for the backward or not (keep_prepared).
double gradient_error(Variant variant, int64_t D, DType t, int64_t chunk, bool recompute,
                      bool save_t, bool keep_prepared, uint64_t seed) {
  const int64_t T = 512, H = 2;
  MixerParams shape;
  shape.seq_len = T;
  shape.chunk = chunk;
  shape.batch = 1;
  shape.num_segments = 1;
  StepTensors x(variant, 1, T, H, D, D, t, recompute ? 0 : count_chunks(shape));
  x.fill(seed);
  MixerBwdParams p = x.params(variant, 1, T, H, D, t, chunk);
  DeviceBuffer<unsigned char> saved_t(
      save_t && cuda::saved_t_supported(p) ? cuda::saved_t_bytes(p) : 0);
  if (saved_t.size() != 0) p.saved_t = saved_t.data();
  if (keep_prepared) {
    const cudaStream_t stream = nullptr;  // the legacy default stream, as below
    cuda::PreparedForward fwd(p, stream);
    fwd.finish(stream);
    cuda::PreparedBackward bwd(p, fwd, stream);
    bwd.run(p, stream);
  } else {
    cuda::mixer_forward(p, nullptr);
    cuda::mixer_backward(p, nullptr);
  }
  SS_CUDA_CHECK(cudaDeviceSynchronize());

  const int64_t gw = vector_gate(variant) ? D : 1;
  const std::vector<float> q = download(x.q.data(), t, T * H * D),
                           k = download(x.k.data(), t, T * H * D),
                           v = download(x.v.data(), t, T * H * D),
                           d_o = download(x.d_o.data(), t, T * H * D),
                           dq = download(x.dq.data(), t, T * H * D),
                           dk = download(x.dk.data(), t, T * H * D),
                           dv = download(x.dv.data(), t, T * H * D),
                           dh0 = download(x.dh0.data(), DType::f32, H * D * D);
  std::vector<float> g, dg, beta, dbeta;
  if (x.g.size()) {
    g = download(x.g.data(), DType::f32, T * H * gw);
    dg = download(x.dg.data(), DType::f32, T * H * gw);
  }
  if (x.beta.size()) {
    beta = download(x.beta.data(), t, T * H);
    dbeta = download(x.dbeta.data(), t, T * H);
  }
  double worst = 0;
  for (int64_t h = 0; h < H; ++h) {
    ref::Problem rp;
    rp.variant = variant;
    rp.seq_len = T;
    rp.dk = rp.dv = D;
    rp.scale = p.scale;
    rp.l2norm_qk = p.l2norm_qk;
    rp.q = head_slice(q, T, H, h, D);
    rp.k = head_slice(k, T, H, h, D);
    rp.v = head_slice(v, T, H, h, D);
    if (!g.empty()) rp.g = head_slice(g, T, H, h, gw);
    if (!beta.empty()) rp.beta = head_slice(beta, T, H, h, 1);
    const ref::Grads want = ref::backward(rp, head_slice(d_o, T, H, h, D), {});
    auto err = [&](const std::vector<float>& got, int64_t width, const std::vector<double>& ref) {
      worst = std::max(worst, rel_rms_host(
                                  [&] {
                                    std::vector<float> s(static_cast<std::size_t>(T * width));
                                    for (int64_t i = 0; i < T; ++i)
                                      for (int64_t e = 0; e < width; ++e)
                                        s[i * width + e] = got[(i * H + h) * width + e];
                                    return s;
                                  }(),
                                  ref));
    };
    err(dq, D, want.dq);
    err(dk, D, want.dk);
    err(dv, D, want.dv);
    if (!dg.empty()) err(dg, gw, want.dg);
    if (!dbeta.empty()) err(dbeta, 1, want.dbeta);
    const std::vector<float> dh0_h(dh0.begin() + h * D * D, dh0.begin() + (h + 1) * D * D);
    worst = std::max(worst, rel_rms_host(dh0_h, want.dh0));
  }
  return worst;
}

BwdRow bench_backward_one(const Options& opt, Variant variant, int64_t T) {
  const int64_t B = opt.batch, H = opt.heads, D = opt.dim;
  const DType t = opt.dtype;
  const std::size_t es = size_of(t);
  const int64_t tokens = B * T * H;
  MixerParams shape;
  shape.batch = B;
  shape.seq_len = T;
  shape.chunk = opt.chunk;
  shape.num_segments = B;
  const int64_t num_chunks = count_chunks(shape);

  SS_CUDA_CHECK(cudaDeviceSynchronize());
  size_t free_before = 0, free_tensors = 0, free_after = 0, total = 0;
  SS_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  BwdRow r;
  std::size_t pool_high = 0;  // --keep-prepared: the step's workspace (core/device_pool.h)
  {
    // --recompute: forward keeps no chunk states; backward re-derives them.
    StepTensors x(variant, B, T, H, D, D, t, opt.recompute ? 0 : num_chunks);
    MixerBwdParams p = x.params(variant, B, T, H, D, t, opt.chunk);
    // T saved by the forward for the backward's prepare re-run (unless
    // --no-save-t), for the variants that have one (the table's header says which).
    DeviceBuffer<unsigned char> saved_t(
        opt.save_t && cuda::saved_t_supported(p) ? cuda::saved_t_bytes(p) : 0);
    if (saved_t.size() != 0) p.saved_t = saved_t.data();
    r.saved_t = saved_t.size() != 0;
    SS_CUDA_CHECK(cudaMemGetInfo(&free_tensors, &total));
    // One workspace serves both calls (they never overlap); with
    // --keep-prepared only the forward-only timing uses it.
    DeviceBuffer<unsigned char> workspace(
        opt.keep_prepared ? cuda::forward_workspace_bytes(p)
                          : std::max(cuda::forward_workspace_bytes(p),
                                     cuda::backward_workspace_bytes(p, p.recompute_chunk_states)));
    SS_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
    x.fill(0);

    cudaStream_t stream;
    SS_CUDA_CHECK(cudaStreamCreate(&stream));
    auto forward = [&] { cuda::mixer_forward(p, workspace.data(), workspace.size(), stream); };
    auto step = [&] {
      if (opt.keep_prepared) {
        cuda::PreparedForward fwd(p, stream);        // queues the prepare stage
        fwd.finish(stream);                          // scan + output
        cuda::PreparedBackward bwd(p, fwd, stream);  // adopts the tiles: no prepare
        bwd.run(p, stream);
        return;
      }
      forward();
      cuda::mixer_backward(p, workspace.data(), workspace.size(), stream);
    };
    r.ms_fwd = median_ms(forward, opt.warmup, opt.iters, stream);
    if (opt.keep_prepared) {
      SS_CUDA_CHECK(cudaStreamSynchronize(stream));
      pool_reset_in_use_high();  // the high watermark restarts from what is in use now
    }
    r.ms_fwd_bwd = median_ms(step, opt.warmup, opt.iters, stream);
    if (opt.keep_prepared) {
      SS_CUDA_CHECK(cudaStreamSynchronize(stream));
      pool_high = pool_in_use_high();
    }
    SS_CUDA_CHECK(cudaStreamDestroy(stream));
  }
  // The step's device memory: tensors and its workspace (the separate
  // forward-only workspace of --keep-prepared is not part of the step).
  r.peak_gb = static_cast<double>(opt.keep_prepared ? (free_before - free_tensors) + pool_high
                                                    : free_before - free_after) /
              1e9;
  r.err_grad =
      gradient_error(variant, D, t, opt.chunk, opt.recompute, opt.save_t, opt.keep_prepared, 100);

  const double C = static_cast<double>(opt.chunk), d = static_cast<double>(D);
  const double flops = chunkwise_step_flops({variant, tokens, 1, D, D, opt.chunk}, true);
  const double in_bytes = input_bytes_per_token(variant, D, D, es);
  const double state_bytes = 4.0 * d * d / C;
  // forward: inputs + o + chunk states; backward: inputs + dO + chunk states + gradients.
  const double bytes_per_token =
      (in_bytes + d * es + state_bytes) + (in_bytes + d * es + state_bytes + in_bytes);
  static_cast<RowShape&>(r) = row_shape(opt, variant, T);
  r.tokens_per_s = B * T / (r.ms_fwd_bwd * 1e-3);
  r.tflops = flops / (r.ms_fwd_bwd * 1e-3) / 1e12;
  r.gbps = bytes_per_token * tokens / (r.ms_fwd_bwd * 1e-3) / 1e9;
  return r;
}

int run_backward_table(const Options& opt, const cudaDeviceProp& prop) {
  std::printf("# statescan-bench --backward: chunkwise forward + backward on %s (%d SMs)\n",
              prop.name, prop.multiProcessorCount);
  std::printf("# dtype %s, chunk %lld, warm-up %d, timed %d (median), l2norm_qk on delta rules\n",
              to_string(opt.dtype), static_cast<long long>(opt.chunk), opt.warmup, opt.iters);
  std::printf("# chunk states: %s\n",
              opt.recompute ? "recomputed by backward (--recompute)"
                            : "saved by forward (fp32, 4 D^2 / chunk bytes per token-head)");
  std::printf(opt.save_t
                  ? "# T: saved by forward, two 16-bit parts (MixerParams::saved_t, 4 C bytes per\n"
                    "#   token-head; delta rules without a vector gate: the others have none)\n"
                  : "# T: not saved (--no-save-t): the backward's prepare re-run solves it "
                    "again\n");
  if (opt.keep_prepared)
    std::printf(
        "# prepared tiles: kept by forward for backward (--keep-prepared: PreparedForward ->\n"
        "#   PreparedBackward, no prepare re-run; peak includes the pool's high watermark)\n");
  std::printf(
      "# tokens/s, TFLOP/s, GB/s: of forward+backward; peak: device memory of the step;\n"
      "# err_grad: worst rel RMS of dq,dk,dv,dg,dbeta,dh0 vs fp64 (512 tokens, 2 heads)\n#\n");
  std::printf("# %-15s %8s %3s %4s %4s %9s %12s %12s %9s %9s %9s %10s\n", "variant", "T", "B", "H",
              "D", "fwd(ms)", "fwd+bwd(ms)", "tokens/s", "TFLOP/s", "GB/s", "peak(GB)", "err_grad");
  run_rows<BwdRow>(
      opt, "forward_backward", [&](Variant v, int64_t T) { return bench_backward_one(opt, v, T); },
      [](const BwdRow& r) {
        std::printf(" %9.3f %12.3f %12.4g %9.2f %9.1f %9.2f %10.2e\n", r.ms_fwd, r.ms_fwd_bwd,
                    r.tokens_per_s, r.tflops, r.gbps, r.peak_gb, r.err_grad);
      },
      [&](std::ostream& out, const BwdRow& r) {
        out << ", \"ms_fwd\": " << r.ms_fwd << ", \"ms_fwd_bwd\": " << r.ms_fwd_bwd
            << ", \"tokens_per_s\": " << r.tokens_per_s << ", \"tflops\": " << r.tflops
            << ", \"gbps\": " << r.gbps << ", \"peak_gb\": " << r.peak_gb
            << ", \"err_grad\": " << json_number(r.err_grad)
            << ", \"keep_prepared\": " << (opt.keep_prepared ? "true" : "false")
            << ", \"saved_t\": " << (r.saved_t ? "true" : "false");
      });
  return 0;
}

// --cp-model: local times (measured, given or defaulted, each labelled) fed
// to the scaling model, printed as a table and optionally as JSON.
int run_cp_model(const Options& opt) {
  CpLayer layer;
  layer.variant = opt.cp_variant;
  layer.batch = opt.batch;
  layer.seq_len = opt.cp_seq_len;
  layer.heads = opt.heads;
  layer.dk = layer.dv = opt.dim;
  layer.chunk = opt.chunk;
  layer.dtype = opt.dtype;
  std::vector<std::string> notes;
  char line[512];

  // The defaults are README.md's H200 figures (cp_h200_reference_128k), valid
  // for its shape only; B, T and H scale them linearly.
  const CpReferenceTimes ref = cp_h200_reference_128k(layer.variant);
  const bool readme_shape = layer.dk == 128 && layer.chunk == 64 && layer.dtype == DType::bf16;
  const double scale =
      static_cast<double>(layer.batch * layer.seq_len * layer.heads) / (131072.0 * 16.0);
  double fwd_ms = opt.fwd_ms;
  if (fwd_ms > 0) {
    notes.push_back("fwd: given by --fwd-ms");
  } else {
    SS_CHECK_ARG(readme_shape, "--fwd-ms",
                 "needed: the README default is for D=128, chunk 64, bf16 only");
    fwd_ms = ref.fwd_ms * scale;
    std::snprintf(line, sizeof line,
                  "fwd: NOT measured here: README H200 figure for %s at T=131072, H=16, D=128, "
                  "bf16 (%.3f ms) x %.4g (B*T*H scaling)",
                  to_string(layer.variant), ref.fwd_ms, scale);
    notes.push_back(line);
  }
  double bwd_ms = opt.bwd_ms;
  if (bwd_ms > 0) {
    notes.push_back("bwd: given by --bwd-ms");
  } else if (readme_shape) {
    bwd_ms = ref.bwd_ms() * scale;
    std::snprintf(line, sizeof line,
                  "bwd: NOT measured here: README H200 figure for %s at T=131072 (fwd+bwd %.2f - "
                  "fwd %.3f = %.3f ms) x %.4g (B*T*H scaling)",
                  to_string(layer.variant), ref.fwd_bwd_ms, ref.fwd_ms, ref.bwd_ms(), scale);
    notes.push_back(line);
  } else {
    // estimate_local_times applies the README ratio when bwd_ms < 0.
    std::snprintf(line, sizeof line,
                  "bwd: ASSUMED fwd x %.3f, the README H200 bwd/fwd ratio for %s at D=128, "
                  "chunk 64, bf16 (this shape differs; give --bwd-ms)",
                  ref.bwd_ms() / ref.fwd_ms, to_string(layer.variant));
    notes.push_back(line);
  }
  const CpGpuModel gpu;
  CpLocalTimes times = estimate_local_times(layer, fwd_ms, bwd_ms, gpu);
  const double first_share = times.summary_fwd_first_ms / times.summary_fwd_ms;
  if (opt.summary_fwd_ms > 0) times.summary_fwd_ms = opt.summary_fwd_ms;
  if (opt.summary_fwd_first_ms > 0) {
    times.summary_fwd_first_ms = opt.summary_fwd_first_ms;
  } else if (opt.summary_fwd_ms > 0) {
    times.summary_fwd_first_ms = first_share * opt.summary_fwd_ms;
  }
  if (opt.summary_bwd_ms > 0) times.summary_bwd_ms = opt.summary_bwd_ms;
  if (opt.merge_ms > 0) times.merge_ms = opt.merge_ms;
  // The backward's prepare stage (delta rules; the reverse exchange hides
  // behind it): given, else the reference's share of bwd where measured.
  if (opt.bwd_prepare_ms > 0) {
    times.bwd_prepare_ms = opt.bwd_prepare_ms;
    notes.push_back("bwd prepare: given by --bwd-prepare-ms");
  } else if (times.bwd_prepare_ms > 0) {
    std::snprintf(line, sizeof line,
                  "bwd prepare: NOT measured here: %.1f %% of bwd, its share in an H200 "
                  "--cp-measure run of %s at T=131072 (%.3f ms)",
                  100 * ref.bwd_prepare_share, to_string(layer.variant), times.bwd_prepare_ms);
    notes.push_back(line);
  }
  auto source = [](bool given) { return given ? "given" : "MODELLED"; };
  char first_source[64];
  std::snprintf(first_source, sizeof first_source, "%s",
                opt.summary_fwd_first_ms > 0 ? "given" : "MODELLED");
  if (opt.summary_fwd_first_ms < 0 && opt.summary_fwd_ms > 0)
    std::snprintf(first_source, sizeof first_source, "the modelled P = 2 share (%.3f) of the given",
                  first_share);
  std::snprintf(line, sizeof line,
                "summary fwd: %s, summary fwd first rank: %s, summary bwd: %s, merge: %s",
                source(opt.summary_fwd_ms > 0), first_source, source(opt.summary_bwd_ms > 0),
                source(opt.merge_ms > 0));
  notes.push_back(line);
  std::snprintf(line, sizeof line,
                "MODELLED = counted work at the summary rates calibrated on KDA's measured "
                "summary (%s: fwd %.1f, first rank %.1f, last rank's maps %.1f, "
                "bwd %.1f TFLOP/s effective), %.1f TB/s HBM floor, %.0f us launch; see "
                "parallel/cp_model.h",
                kSummaryCalibration, gpu.summary_fwd_flops_per_s / 1e12,
                gpu.summary_first_flops_per_s / 1e12, gpu.summary_maps_flops_per_s / 1e12,
                gpu.summary_bwd_flops_per_s / 1e12, gpu.hbm_Bps / 1e12, gpu.launch_s * 1e6);
  notes.push_back(line);

  CpModelConfig config;
  config.link = link_preset(opt.link, opt.gpus_per_node);
  const bool inter = opt.link == LinkPreset::hierarchical;
  // --link-* name the link ranks of one node share (the only link for nvlink
  // and ib); --ib-* the link between nodes of the hierarchical preset.
  if (opt.link_bw_GBps > 0) config.link.bandwidth_Bps = opt.link_bw_GBps * 1e9;
  if (opt.link_latency_us > 0) config.link.latency_s = opt.link_latency_us * 1e-6;
  SS_CHECK_ARG(inter || opt.ib_bw_GBps < 0, "--ib-bw-GBps",
               "applies to --link hierarchical only (use --link-bw-GBps)");
  SS_CHECK_ARG(inter || opt.ib_latency_us < 0, "--ib-latency-us",
               "applies to --link hierarchical only (use --link-latency-us)");
  if (opt.ib_bw_GBps > 0) config.link.inter_bandwidth_Bps = opt.ib_bw_GBps * 1e9;
  if (opt.ib_latency_us > 0) config.link.inter_latency_s = opt.ib_latency_us * 1e-6;
  if (opt.compose_tflops > 0) config.link.compose_flops_per_s = opt.compose_tflops * 1e12;
  config.overlap = opt.overlap;
  config.max_ranks = opt.cp_max_ranks;
  std::snprintf(
      line, sizeof line, "link preset: %s%s", to_string(opt.link),
      opt.link_bw_GBps > 0 || opt.link_latency_us > 0 || opt.ib_bw_GBps > 0 || opt.ib_latency_us > 0
          ? " (with overrides)"
          : "");
  notes.push_back(line);

  const CpModelResult result = predict_cp_scaling(layer, times, config);
  std::fputs(format_cp_model_table(layer, times, config, result, notes).c_str(), stdout);
  if (!opt.json.empty()) {
    write_text_file(opt.json, format_cp_model_json(result), "--json");
  }
  return 0;
}

int run(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  if (opt.help) {
    std::printf(
        "usage: statescan-bench [-v variants] [-t lengths] [-b B] [-H heads] [-d dim]\n"
        "                       [-c chunk] [--dtype bf16|f16|f32] [-w warmup] [-n iters]\n"
        "                       [--json file] [--plot file.png]\n"
        "                       [--backward [--recompute | --keep-prepared] [--no-save-t]]\n"
        "       statescan-bench --decode [-v variants] [-t tokens] [-b B] [-H heads] [-d dim] "
        "[--dv Dv]\n"
        "                       [--dtype bf16|f16|f32] [-w warmup] [-n iters] [--json file]\n"
        "       statescan-bench --cp-model [--variant kda] [--seq-len T] [-P 1024]\n"
        "                       [--link hierarchical|nvlink|ib] [--gpus-per-node 8]\n"
        "                       [--link-bw-GBps X] [--link-latency-us X] [--ib-bw-GBps X]\n"
        "                       [--ib-latency-us X] [--compose-TFLOPs X] [--overlap F]\n"
        "                       [--fwd-ms X] [--bwd-ms X] [--summary-fwd-ms X]\n"
        "                       [--summary-fwd-first-ms X] [--summary-bwd-ms X] [--merge-ms X]\n"
        "                       [--bwd-prepare-ms X] [--cp-measure] [--json F]\n"
        "%s",
        kLactBenchUsage);
    return 0;
  }
  // --cp-measure times every CP piece on this GPU (launch/bench_cp_cuda.h)
  // and feeds the scaling model with them.
  if (opt.cp_measure) {
    CpMeasureOptions m;
    if (opt.cp_variant_given) m.variants = {opt.cp_variant};
    m.seq_len = opt.cp_seq_len;
    m.heads = opt.heads;
    m.dim = opt.dim;
    m.chunk = opt.chunk;
    m.dtype = opt.dtype;
    m.warmup = opt.warmup;
    m.iters = opt.iters;
    m.link = opt.link;
    m.gpus_per_node = opt.gpus_per_node;
    m.max_ranks = opt.cp_max_ranks;
    m.overlap = opt.overlap;
    m.json_path = opt.json;
    return run_cp_measure(m, std::cout);
  }
  // Before any CUDA call: the model alone runs where no GPU is present.
  if (opt.cp_model) return run_cp_model(opt);
  cudaDeviceProp prop{};
  SS_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  if (opt.backward) return run_backward_table(opt, prop);
  if (opt.decode) return run_decode_table(opt, prop);
  std::printf("# statescan-bench: chunkwise forward on %s (%d SMs)\n", prop.name,
              prop.multiProcessorCount);
  std::printf("# dtype %s, chunk %lld, warm-up %d, timed %d (median), l2norm_qk on delta rules\n",
              to_string(opt.dtype), static_cast<long long>(opt.chunk), opt.warmup, opt.iters);
  std::printf(
      "# err_decode: rel RMS of o vs the recurrent kernel; err_ref: vs fp64, head 0, "
      "first 2048 tokens\n#\n");
  std::printf("# %-15s %8s %3s %4s %4s %10s %12s %9s %9s %11s %11s\n", "variant", "T", "B", "H",
              "D", "time(ms)", "tokens/s", "TFLOP/s", "GB/s", "err_decode", "err_ref");
  const std::vector<Row> rows = run_rows<Row>(
      opt, "forward", [&](Variant v, int64_t T) { return bench_one(opt, v, T); },
      [](const Row& r) {
        std::printf(" %10.3f %12.4g %9.2f %9.1f %11.2e %11.2e\n", r.ms, r.tokens_per_s, r.tflops,
                    r.gbps, r.err_decode, r.err_ref);
      },
      [](std::ostream& out, const Row& r) {
        out << ", \"ms\": " << r.ms << ", \"tokens_per_s\": " << r.tokens_per_s
            << ", \"tflops\": " << r.tflops << ", \"gbps\": " << r.gbps
            << ", \"err_decode\": " << json_number(r.err_decode)
            << ", \"err_ref\": " << json_number(r.err_ref);
      });
  if (!opt.plot.empty()) {
    // After the table and the JSON, so that a machine without gnuplot keeps them.
    std::vector<launch::ThroughputPoint> points;
    for (const Row& r : rows) points.push_back({r.variant, r.seq_len, r.tokens_per_s});
    char title[256];
    std::snprintf(title, sizeof title,
                  "statescan-bench: chunkwise forward, %s, B=%lld H=%lld D=%lld, %s",
                  to_string(opt.dtype), static_cast<long long>(opt.batch),
                  static_cast<long long>(opt.heads), static_cast<long long>(opt.dim), prop.name);
    launch::plot_throughput(points, opt.plot, title);
    std::printf("# plot: %s\n", opt.plot.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace statescan

int main(int argc, char** argv) {
  try {
    // The LaCT layer's benchmark has its own flags (launch/bench_lact.h).
    const bool lact = argc > 1 && (std::string(argv[1]) == "--lact" ||
                                   std::string(argv[1]) == "--lact-ns");
    if (lact && argc == 3 && (std::string(argv[2]) == "-h" || std::string(argv[2]) == "--help")) {
      std::printf("usage:\n%s", statescan::kLactBenchUsage);
      return 0;
    }
    if (argc > 1 && std::string(argv[1]) == "--lact")
      return statescan::run_lact_bench(argc, argv, std::cout);
    if (argc > 1 && std::string(argv[1]) == "--lact-ns")
      return statescan::run_lact_ns_bench(argc, argv, std::cout);
    return statescan::run(argc, argv);
  } catch (const statescan::Error& e) {
    // Exit codes as statescan-run's: 2 for a flag or its value (refused before
    // any GPU work), 3 for a run that failed; 1 stays the verdict of a run
    // that finished and missed its goal (--cp-measure), so a script can tell
    // them apart.
    std::fprintf(stderr, "statescan-bench: %s\n", e.what());
    return e.argument().rfind('-', 0) == 0 || e.argument() == "arguments" ? 2 : 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "statescan-bench: %s\n", e.what());
    return 3;
  }
}
