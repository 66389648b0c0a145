#include "launch/run_options.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string_view>

#include "core/cli_parse.h"
#include "core/error.h"

namespace statescan::launch {
namespace {

// A number in [0, 1) (the LaCT momentum).
double parse_unit_interval(const std::string& flag, const std::string& text) {
  const double value = parse_number(text, flag.c_str());
  SS_CHECK_ARG(value >= 0 && value < 1, flag, "must be in [0, 1), got ", text);
  return value;
}

// "a,b,c" -> {a, b, c}, each >= 1.
std::vector<int64_t> parse_shards(const std::string& flag, const std::string& text) {
  std::vector<int64_t> shards;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    const std::string_view piece(text.data() + start,
                                 (comma == std::string::npos ? text.size() : comma) - start);
    shards.push_back(parse_int(piece, flag.c_str(), 1, int64_t{1} << 40));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return shards;
}

struct OptionSpec {
  const char* name;
  bool takes_value;
  bool shape_flag;  // ignored under --load (the files give the shapes)
  std::function<void(RunOptions&, const std::string& flag, const std::string& value)> apply;
};

constexpr int64_t kMaxExtent = int64_t{1} << 40;

const std::vector<OptionSpec>& option_specs() {
  static const std::vector<OptionSpec> specs = {
      {"--variant", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         // LaCT is not a linear-attention Variant: it runs its own layer.
         o.lact = v == "lact";
         if (o.lact) return;
         for (Variant x : kAllVariants)
           if (v == to_string(x)) {
             o.variant = x;
             return;
           }
         SS_FAIL(f, "unknown variant '", v,
                 "' (expected linear, retention, gla, deltanet, gated_deltanet, kda or lact)");
       }},
      {"--batch", true, true,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.batch = parse_int(v, f.c_str(), 1, kMaxExtent);
       }},
      {"--seq-len", true, true,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.seq_len = parse_int(v, f.c_str(), 1, kMaxExtent);
       }},
      {"--heads", true, true,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.heads = parse_int(v, f.c_str(), 1, kMaxExtent);
       }},
      {"--dk", true, true,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.dk = parse_int(v, f.c_str(), 1, 256);
       }},
      {"--dv", true, true,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.dv = parse_int(v, f.c_str(), 1, 256);
       }},
      {"--chunk", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.chunk = parse_int(v, f.c_str(), 1, 1 << 20);
         SS_CHECK_ARG(o.chunk == 16 || o.chunk == 32 || o.chunk == 64, f, "chunk size ", o.chunk,
                      " is not supported (expected 16, 32 or 64)");
       }},
      {"--dtype", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.dtype = parse_dtype(v, f.c_str());
       }},
      {"--exchange", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.exchange = parse_exchange(v, f.c_str());
       }},
      {"--iters", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.iters = parse_int(v, f.c_str(), 1, 1000000);
       }},
      {"--warmup", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.warmup = parse_int(v, f.c_str(), 0, 1000000);
       }},
      {"--check", false, false,
       [](RunOptions& o, const std::string&, const std::string&) { o.check = true; }},
      {"--no-check", false, false,
       [](RunOptions& o, const std::string&, const std::string&) { o.check = false; }},
      {"--device", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.device = parse_device(v, f.c_str());
       }},
      {"--cp-comm", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         if (v == "auto") {
           o.cp_comm = RunOptions::CpComm::automatic;
         } else if (v == "nccl") {
           o.cp_comm = RunOptions::CpComm::nccl;
         } else if (v == "mpi") {
           o.cp_comm = RunOptions::CpComm::mpi;
         } else {
           SS_FAIL(f, "'", v, "' is not a communicator (auto, nccl, mpi)");
         }
       }},
      {"--load", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         SS_CHECK_ARG(!v.empty(), f, "expects a directory");
         o.load_dir = v;
       }},
      {"--save", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         SS_CHECK_ARG(!v.empty(), f, "expects a directory");
         o.save_dir = v;
       }},
      {"--json", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         SS_CHECK_ARG(!v.empty(), f, "expects a file name");
         o.json_path = v;
       }},
      {"--seed", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.seed = static_cast<uint64_t>(parse_int(v, f.c_str(), 0, INT64_MAX));
       }},
      {"--l2norm", false, false,
       [](RunOptions& o, const std::string&, const std::string&) { o.l2norm = true; }},
      {"--recompute-states", false, false,
       [](RunOptions& o, const std::string&, const std::string&) { o.recompute_states = true; }},
      {"--keep-prepared", false, false,
       [](RunOptions& o, const std::string&, const std::string&) { o.keep_prepared = true; }},
      {"--no-save-t", false, false,
       [](RunOptions& o, const std::string&, const std::string&) { o.save_t = false; }},
      {"--no-check-finite", false, false,
       [](RunOptions& o, const std::string&, const std::string&) { o.check_finite = false; }},
      {"--scale", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.scale = parse_positive_number(v, f.c_str());
       }},
      {"--shards", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.shards = parse_shards(f, v);
       }},
      {"--metrics-port", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.metrics_port = static_cast<int>(parse_int(v, f.c_str(), 1, 65535));
       }},
      {"--metrics-bind", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         SS_CHECK_ARG(!v.empty(), f, "expects an address, e.g. 127.0.0.1 or 0.0.0.0");
         o.metrics_bind = v;
       }},
      {"--metrics-hold", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.metrics_hold = parse_positive_number(v, f.c_str());
       }},
      {"--progress", false, false,
       [](RunOptions& o, const std::string&, const std::string&) {
         o.progress = RunOptions::Progress::always;
       }},
      {"--no-progress", false, false,
       [](RunOptions& o, const std::string&, const std::string&) {
         o.progress = RunOptions::Progress::never;
       }},
      {"--lact-chunk", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.lact_config.chunk = parse_int(v, f.c_str(), 1, kMaxExtent);
       }},
      {"--lact-hidden", true, true,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.lact_hidden = parse_int(v, f.c_str(), 1, 1 << 16);
       }},
      {"--schedule", true, false,
       [](RunOptions& o, const std::string& f, const std::string& v) {
         o.lact_config.schedule = parse_lact_schedule(v, f.c_str());
       }},
      {"--muon-steps", true, false,
       [](RunOptions& o, const std::string& f,
          const std::string&
              v) { o.lact_config.muon_steps = static_cast<int>(parse_int(v, f.c_str(), 0, 100)); }},
      {"--momentum", true, false,
       [](RunOptions& o, const std::string& f,
          const std::string& v) { o.lact_config.momentum = parse_unit_interval(f, v); }},
      {"--no-renorm", false, false,
       [](RunOptions& o, const std::string&, const std::string&) { o.lact_config.renorm = false; }},
      {"--help", false, false,
       [](RunOptions& o, const std::string&, const std::string&) { o.help = true; }},
  };
  return specs;
}

// The flag of argv[1..argc) named `flag` ("--flag" or "--flag=..."), or null.
const char* find_flag(int argc, const char* const* argv, const char* flag) {
  const std::string_view name(flag);
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg(argv[i]);
    if (arg == name ||
        (arg.rfind(name, 0) == 0 && arg.size() > name.size() && arg[name.size()] == '='))
      return flag;
  }
  return nullptr;
}

// Flags that mean nothing for the chosen variant are refused, not ignored.
void check_variant_flags(const RunOptions& o, int argc, const char* const* argv) {
  if (!o.lact) {
    for (const char* flag : {"--lact-chunk", "--lact-hidden", "--schedule", "--muon-steps",
                             "--momentum", "--no-renorm"})
      SS_CHECK_ARG(find_flag(argc, argv, flag) == nullptr, flag, "applies to --variant lact only");
    return;
  }
  // Linear-attention options the LaCT layer has no counterpart for.
  const std::pair<const char*, const char*> refused[] = {
      {"--chunk", "the LaCT chunk is --lact-chunk"},
      {"--exchange", "LaCT exchanges by one all-reduce per chunk"},
      {"--shards", "LaCT splits every chunk evenly over the ranks"},
      {"--scale", "LaCT has no q scale"},
      {"--l2norm", "LaCT takes q and k as given"},
      {"--recompute-states", "LaCT recomputes its per-chunk fast weights always"},
      {"--keep-prepared", "LaCT has no prepare stage"},
      {"--no-save-t", "LaCT has no T"},
      {"--no-check-finite", "LaCT always checks its inputs"},
  };
  for (const auto& [flag, why] : refused)
    SS_CHECK_ARG(find_flag(argc, argv, flag) == nullptr, flag, "does not apply to --variant lact (",
                 why, ")");
  // q, k, v and o share D: --dv may only repeat --dk (both are ignored under
  // --load, whose files give D).
  if (find_flag(argc, argv, "--dv") != nullptr && o.load_dir.empty())
    SS_CHECK_ARG(o.dv == o.dk, "--dv", "must equal --dk for --variant lact (q, k, v share D), got ",
                 "--dv ", o.dv, " and --dk ", o.dk);
}

}  // namespace

RunOptions parse_run_options(int argc, const char* const* argv) {
  RunOptions options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h") arg = "--help";
    // Accept both "--flag value" and "--flag=value".
    std::string value;
    bool inline_value = false;
    if (const std::size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      inline_value = true;
    }
    const OptionSpec* spec = nullptr;
    for (const auto& s : option_specs())
      if (arg == s.name) spec = &s;
    SS_CHECK_ARG(spec != nullptr, arg, "unknown ",
                 arg.rfind("-", 0) == 0 ? "option" : "positional argument",
                 " (see statescan-run --help)");
    if (spec->takes_value) {
      if (!inline_value) {
        SS_CHECK_ARG(i + 1 < argc, arg, "needs a value");
        value = argv[++i];
      }
    } else {
      SS_CHECK_ARG(!inline_value, arg, "takes no value");
    }
    spec->apply(options, arg, value);
    if (spec->shape_flag) options.shape_flags_given.push_back(arg);
  }
  // The other metrics flags mean nothing without a port: refuse, not ignore.
  if (options.metrics_port < 0) {
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      for (const char* flag : {"--metrics-bind", "--metrics-hold"})
        SS_CHECK_ARG(arg.rfind(flag, 0) != 0, flag, "needs --metrics-port");
    }
  }
  check_variant_flags(options, argc, argv);
  // The seed makes the synthetic inputs; loaded inputs have none to take.
  SS_CHECK_ARG(options.load_dir.empty() || find_flag(argc, argv, "--seed") == nullptr, "--seed",
               "does not apply with --load (the inputs come from the files)");
  SS_CHECK_ARG(!(options.keep_prepared && options.recompute_states), "--keep-prepared",
               "cannot be combined with --recompute-states (it reads the saved chunk states)");
  // Only the delta rules without a vector gate save T, and only from 16-bit
  // inputs (MixerConfig::save_t): elsewhere the flag would change nothing.
  SS_CHECK_ARG(options.save_t || options.lact ||
                   (has_beta(options.variant) && !vector_gate(options.variant) &&
                    options.dtype != DType::f32),
               "--no-save-t",
               "applies to deltanet and gated_deltanet with --dtype bf16 or f16 only (",
               to_string(options.variant), " with ", to_string(options.dtype), " saves no T)");
  // Each extent is capped, their product is not: a shape whose tensors no
  // machine holds (or whose element count overflows) is refused here, naming
  // the flags, not by an allocation's exception after the run set up.
  if (options.load_dir.empty())
    check_tensor_elements({{"--batch", options.batch},
                           {"--seq-len", options.seq_len},
                           {"--heads", options.heads},
                           {"max(--dk, --dv)", std::max(options.dk, options.dv)}},
                          "--seq-len");
  return options;
}

std::string usage_text() {
  return R"(statescan-run: context-parallel forward + backward of a linear-attention mixer,
timed step by step and checked against a single-rank run.

Usage:  mpirun -np P statescan-run [options]      (or plainly, as one rank)

Problem
  --variant NAME     linear | retention | gla | deltanet | gated_deltanet | kda
                     | lact (LaCT layer, see below)                                [kda]
  --batch B          batch rows                                                   [1]
  --seq-len T        tokens per row (the whole sequence, split over the ranks)   [16384]
  --heads H          heads                                                        [4]
  --dk D             q/k head dim (1..256)                                        [64]
  --dv D             v/o head dim (1..256)                                        [64]
  --chunk C          chunk size: 16, 32 or 64                                     [64]
  --dtype T          f32 | bf16 | f16: inputs are rounded to T (compute is fp32)  [f32]
  --scale X          q scale                                                      [Dk^-1/2]
  --l2norm           L2-normalise q and k inside the op (else the synthetic q, k
                     of delta variants are unit vectors already)
  --recompute-states keep no fp32 chunk states from forward to backward; backward
                     recomputes them (one more state scan, 4*Dk*Dv/chunk bytes per
                     token and head less memory between the passes)
  --keep-prepared    --device cuda: keep the forward's prepared tiles for backward,
                     which then skips its prepare stage (~1.9 KB per token and head
                     more memory between the passes at D = 128, bf16; under CP every
                     rank but the first keeps them)
  --no-save-t        --device cuda: the forward of DeltaNet / Gated DeltaNet (bf16,
                     f16) saves no T = (I + diag(beta) KK)^-1 for backward, whose
                     prepare re-run then solves it again (4*chunk bytes per token and
                     head less memory between the passes; default: saved)
  --no-check-finite  skip the NaN/Inf scan of the inputs and of do (one read of
                     them per pass; MixerConfig::check_finite); non-finite values
                     then reach the outputs instead of an error
  --seed N           seed of the synthetic inputs                                 [0]

LaCT (--variant lact; q, k, v share D = --dk; --dv may only repeat it)
  --lact-chunk C     tokens per fast-weight update; every chunk is split evenly
                     over the ranks (C and the last chunk divisible by P)         [2048]
  --lact-hidden M    hidden width of the SwiGLU fast weights                     [2*D]
  --schedule NAME    apply_then_update (causal) | update_then_apply  [apply_then_update]
  --muon-steps N     Newton-Schulz steps of Muon; 0 = off                         [5]
  --momentum MU      momentum of the fast-weight updates in [0, 1); 0 = off       [0]
  --no-renorm        keep the updated rows' norms (default: rescale every row to its
                     initial norm)
  --chunk, --exchange, --shards, --scale, --l2norm, --recompute-states,
  --keep-prepared, --no-save-t and --no-check-finite are refused with --variant lact.

Parallelism and device
  --exchange NAME    allgather | ring | tree | auto (cost model)                  [auto]
  --shards a,b,...   explicit shard lengths, one per rank, summing to T
                     (default: rank r gets [floor(rT/P), floor((r+1)T/P)))
  --device NAME      auto | cpu | cuda   (auto: cuda when every rank sees a GPU,
                     cpu when none does, an error for a mix; cuda without a
                     GPU is an error, never replaced silently). cuda: inputs
                     uploaded in --dtype; several ranks exchange over NCCL
                     when built with it (--cp-comm).                       [auto]
  --cp-comm NAME     auto | nccl | mpi: with --device cuda and several ranks, the
                     exchange over NCCL (one GPU per rank) or staged through host
                     memory over MPI (ranks may share a GPU); auto: nccl when
                     built with it and every node has a GPU per rank, else
                     mpi; nccl where it cannot run is an error               [auto]

Run
  --iters N          timed steps                                                  [3]
  --warmup N         untimed steps first                                          [1]
  --check / --no-check
                     compare every output and gradient with a single-rank run
                     on rank 0 (relative RMS; tolerance 1e-5, or 1e-2 for 16-bit
                     inputs on the GPU and 2e-2 for bf16 LaCT there)       [on]

Files
  --load DIR         read q.npy k.npy v.npy and, when present, g.npy beta.npy h0.npy
                     do.npy dht.npy cu_seqlens.npy (float32/float64; cu_seqlens
                     int64 with B = 1). B, T, H, Dk, Dv come from q.npy and v.npy;
                     --batch/--seq-len/--heads/--dk/--dv are then ignored.
                     Without do.npy only the forward runs.
                     --variant lact: q.npy k.npy v.npy [B,T,H,D], lr0.npy lr1.npy
                     lr2.npy [B,T,H] (> 0), w0.npy w2.npy [H,M,D], w1.npy [H,D,M],
                     optional do.npy.
  --save DIR         rank 0 writes o.npy ht.npy and, after a backward, dq.npy dk.npy
                     dv.npy dg.npy (decay variants) dbeta.npy (delta variants)
                     dh0.npy (with h0) as float32, full sequence [B,T,H,*]
                     (--variant lact: o.npy and, after a backward, dq dk dv dlr0
                     dlr1 dlr2 dw0 dw1 dw2)
  --json FILE        the table's rows as JSON (rank 0)
  --help             this text

Metrics and progress
  --metrics-port P   each rank serves Prometheus metrics on port P + its node-local
                     rank (http://ADDR:PORT/metrics); refused in a build without
                     prometheus-cpp, never silently dropped
  --metrics-bind A   address the exporters bind to                        [127.0.0.1]
  --metrics-hold S   keep the exporters up S seconds after the run for a last scrape
                     (SIGINT, SIGTERM or SIGUSR1 end the wait early)
  --progress / --no-progress
                     progress line on stderr (step, tokens/s, ETA)   [on a terminal,
                     once the run has taken over 2 s]

Exit status: 0 success, 1 the check found outputs over tolerance,
             2 invalid argument or input (the message names it), 3 runtime failure,
             4 the metrics exporter could not start (port taken, no Prometheus).

Examples
  mpirun -np 2 statescan-run
  mpirun -np 4 statescan-run --variant gated_deltanet --seq-len 65536 --exchange ring
  mpirun -np 3 statescan-run --variant gla --seq-len 1000 --shards 200,300,500 --no-check
  mpirun -np 2 statescan-run --load inputs/ --save outputs/ --iters 1 --warmup 0
  statescan-run --variant deltanet --dtype bf16 --json run.json
  mpirun -np 4 statescan-run --variant lact --lact-chunk 4096 --momentum 0.9
  mpirun -np 2 statescan-run --seq-len 262144 --iters 20 --metrics-port 9400
      (rank 0 serves :9400, rank 1 :9401: curl -s 127.0.0.1:9400/metrics)
)";
}

}  // namespace statescan::launch
