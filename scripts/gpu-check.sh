#!/usr/bin/env bash
# gpu-check.sh OUTDIR — on a machine with an NVIDIA GPU: configure for sm_90a,
# build the CUDA targets, run the GPU tests and statescan-bench (and FLA's
# Triton kernels for comparison when .fla/ holds FLA's source and torch is
# importable), leave logs and JSON in OUTDIR and print a short table last.
#
# Environment knobs:
#   BUILD_DIR        build folder (default <repo>/build-gpu)
#   BENCH_ARGS       extra statescan-bench arguments (default: its defaults)
#   GTEST_FILTER     restrict the GPU tests
#   FLA=0            skip the FLA comparison; FLA_ARGS extra fla_bench.py args (--profile: FLA's per-kernel times);
#                    FLA_TIMEOUT seconds for it (default 900).
#                    FLA's autotuning (minutes per op on a fresh machine) is
#                    cached in TRITON_CACHE_DIR (default <repo>/.fla/triton-cache,
#                    FLA_CACHE_RESULTS=1); the tuned configs are also packed
#                    into OUTDIR/fla_autotune.tgz (small: the *.autotune.json
#                    files), to unpack into .fla/triton-cache where the next
#                    machine starts fresh (the GPU lending tool carries .fla)
#   DECODE=0         skip the recurrent decode rows (`statescan-bench --decode`,
#                    one token of each of B sequences for B in DECODE_BATCHES,
#                    default "16 512", into bench_decode.log) and, with FLA,
#                    FLA's fused recurrent kernels on the same rows (both timed
#                    from CUDA graph replays; fla_decode.json, compared last)
#   BWD=0            skip the backward: test_cuda_backward, `statescan-bench
#                    --backward` (BWD_ARGS, default "-t 32768") and its 1M-token
#                    KDA row with peak memory (BWD_1M=0 skips that row), once
#                    with the chunk states saved and once recomputed (--recompute;
#                    RECOMPUTE=0 skips that one)
#   RUN_CLI=0        skip statescan-run's --device cuda cases of test_run_cli
#                    (3 ranks sharing this GPU: the exchange over MPI by default,
#                    --cp-comm nccl refused; log in BUILD_DIR/run_cli.log)
#   LINEAR_ALT=0     skip linear attention's other scans: their tests (groups of
#                    2 chunks; the sequential scan, STATESCAN_LINEAR=scan) and
#                    the sequential scan's forward and forward+backward rows at
#                    32K and 128K into bench_linear_scan.log
#   OPT_IN=0         skip the opt-in paths not yet made the default and the
#                    forced ones: their ctest entries (`_ds_f32`: STATESCAN_BWD_DS=f32; `_t_solve`: STATESCAN_BWD_T=solve;
#                    `test_cuda_lact_ns_*`: STATESCAN_LACT_NS=fp32 / fused / cluster;
#                    `test_cuda_lact_split_k`: STATESCAN_LACT_SPLIT_K=4;
#                    `_output_kernel` / `_output_scan`: where delta rules form o;
#                    `_cluster_1` / `_2` / `_8`: STATESCAN_SCAN_CLUSTER;
#                    `_prepare_fp32`, `_scan_bv_16` / `_32`, `_linear_tiles`:
#                    STATESCAN_PREPARE, STATESCAN_SCAN_BV, STATESCAN_LINEAR=tiles)
#                    and their rows against the default's (bench_opt_in.log:
#                    DeltaNet forward+backward at 32K, the LaCT benchmark with
#                    the automatic split-K, the delta rules' forward through
#                    the separate output kernel)
#   SANITIZE=1       also run the compute-sanitizer ctest entries (memcheck of
#                    the four GPU suites and, with MPI and NCCL, of
#                    test_cuda_cp_mpi, test_cuda_lact_mpi and test_comm_nccl;
#                    initcheck and racecheck of the chunkwise ones:
#                    tests/CMakeLists.txt statescan_sanitize_test; ~5 minutes on
#                    an H100) into tests_sanitize.log
#   KEEP=0           skip the forward+backward table with the forward's prepared
#                    tiles kept for the backward (`--backward --keep-prepared`,
#                    BWD_ARGS' lengths)
#   NCU=1            also time each kernel of one forward separately at 32K with
#                    Nsight Compute (clocks left alone), for NCU_VARIANTS
#                    (default "kda deltanet linear"), with each kernel's
#                    speed-of-light throughputs (SM, L1/shared, L2, DRAM: what
#                    bounds the delta scan's step? PERF_NOTES, forward "Next
#                    steps")
#   NCU_SOURCE=<regex>  one launch of the kernel matching it under
#                    `ncu --set full --import-source yes` (statescan-bench
#                    NCU_SOURCE_ARGS, default "-v deltanet -t 32768 --backward"),
#                    its SASS source view in OUTDIR/ncu_source_sass.csv and the
#                    stall samples per barrier-delimited phase in
#                    OUTDIR/ncu_phases.txt (scripts/ncu_phases.py)
set -uo pipefail

OUT=${1:?usage: scripts/gpu-check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-gpu}
status=0
# A reused OUTDIR must not show an earlier run's files as this run's (a step
# that fails or is skipped writes nothing). The FLA autotune pack stays: it
# is the next fresh machine's start.
rm -f "$OUT"/{build,nccl,tests,tests_bwd,tests_linear_alt,tests_opt_in,tests_sanitize,fla,ncu_source}.log \
  "$OUT"/{tests,tests_bwd,bench,bench_bwd,bench_bwd_keep,bench_bwd_1m,fla}.json \
  "$OUT"/bench{,_linear_scan,_opt_in,_bwd,_bwd_keep,_bwd_1m,_bwd_1m_recompute}.log \
  "$OUT"/ncu_*.log "$OUT"/{ncu_summary,ncu_phases,summary}.txt "$OUT/ncu_source_sass.csv"

# A device call runs for at most 10 minutes. Every step after the build is
# bounded by what is left of CALL_SECONDS (default 570, from the script's
# start) less 30 s kept for the final table, and by its own cap, so that a
# kernel that hangs costs its step and the call still prints what finished.
CALL_SECONDS=${CALL_SECONDS:-570}
left() {  # left CAP: seconds for the next step: at most CAP, at least 1
  local cap=$1 rest=$((CALL_SECONDS - 30 - SECONDS))
  ((rest < cap)) && cap=$rest
  ((cap < 1)) && cap=1
  echo "$cap"
}
have() {  # have FEATURE: whether this build has it (STATESCAN_HAVE_<FEATURE>, after configure)
  grep -q "STATESCAN_HAVE_$1:INTERNAL=ON" "$BUILD/CMakeCache.txt"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
  nvcc --version | tail -1
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DSTATESCAN_WITH_CUDA=ON -DSTATESCAN_WITH_TESTS=ON &&
    cmake --build "$BUILD" --target test_cuda_forward statescan-bench -j16 &&
    { [[ "${BWD:-1}" == 0 ]] || cmake --build "$BUILD" --target test_cuda_backward -j16; } &&
    { ! have NCCL ||
      cmake --build "$BUILD" --target test_comm_nccl -j16; }
} >"$OUT/build.log" 2>&1 || { echo "gpu-check: build failed, see $OUT/build.log"; tail -40 "$OUT/build.log"; exit 1; }

# The NCCL communicator at world size 1 on this GPU (the 2-rank half skips
# unless a second GPU is present).
if [[ -x "$BUILD/tests/test_comm_nccl" ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
  timeout "$(left 300)" mpirun -np 1 --oversubscribe "$BUILD/tests/test_comm_nccl" >"$OUT/nccl.log" 2>&1 || status=1
  # gtest colours its output under mpirun: match past the escape codes.
  grep -aE "\[  (PASSED|FAILED|SKIPPED) |tests ran" "$OUT/nccl.log" | sed 's/^/nccl: /' | tail -5
  grep -aE "\[  FAILED  \]" "$OUT/nccl.log" | head -20
fi

# statescan-run on this GPU with more ranks than GPUs (MPI builds only).
if [[ "${RUN_CLI:-1}" != 0 ]] && have MPI; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  rm -f "$BUILD/run_cli.log"  # the build folder outlives calls: no old lines
  { cmake --build "$BUILD" --target test_run_cli statescan-run -j16 >>"$OUT/build.log" 2>&1 &&
    timeout "$(left 300)" "$BUILD/tests/test_run_cli" \
      --gtest_filter='RunCli.SharedGpu*:RunCli.CudaDevice*' >"$BUILD/run_cli.log" 2>&1; } || status=1
  grep -aE "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]" "$BUILD/run_cli.log" 2>/dev/null |
    sed 's/^/run_cli: /' | head -8
fi

timeout "$(left 300)" "$BUILD/tests/test_cuda_forward" --gtest_filter="${GTEST_FILTER:-*}" \
  --gtest_output="json:$OUT/tests.json" >"$OUT/tests.log" 2>&1 || status=1
grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" "$OUT/tests.log" | tail -5
grep -E "^\[  FAILED  \]" "$OUT/tests.log" | head -40

# shellcheck disable=SC2086
timeout "$(left 300)" "$BUILD/launch/statescan-bench" --json "$OUT/bench.json" ${BENCH_ARGS:-} \
  >"$OUT/bench.log" 2>&1 || status=1

# The recurrent decode as a server steps it, one JSON a batch size (a table
# holds one B).
if [[ "${DECODE:-1}" != 0 ]]; then
  for b in ${DECODE_BATCHES:-16 512}; do
    timeout "$(left 120)" "$BUILD/launch/statescan-bench" --decode -b "$b" \
      --json "$OUT/bench_decode_b$b.json" >>"$OUT/bench_decode.log" 2>&1 || status=1
  done
fi

# Linear attention's scans other than the default (groups of 16 chunks): the
# suites' linear cases in groups of 2 and with the sequential scan, and the
# sequential scan's rows for comparison.
if [[ "${LINEAR_ALT:-1}" != 0 ]]; then
  cmake --build "$BUILD" --target test_cuda_backward test_cuda_cp -j16 >>"$OUT/build.log" 2>&1 &&
    (cd "$BUILD" && timeout "$(left 300)" ctest --timeout 120 -R '_linear_(groups_of_2|scan)$' \
      --output-on-failure --no-tests=error) \
      >"$OUT/tests_linear_alt.log" 2>&1 || status=1
  grep -E "tests passed|tests failed|Failed" "$OUT/tests_linear_alt.log" | sed 's/^/linear alt: /' | head -8
  # Each command's own `|| status=1`: without set -e a group's status is its
  # last command's, and the first one's failure was lost.
  {
    STATESCAN_LINEAR=scan timeout "$(left 120)" "$BUILD/launch/statescan-bench" -v linear \
      -t 32768,131072 || status=1
    STATESCAN_LINEAR=scan timeout "$(left 120)" "$BUILD/launch/statescan-bench" --backward -v linear \
      -t 32768,131072 || status=1
  } >"$OUT/bench_linear_scan.log" 2>&1
fi

# Opt-in paths (kernels/cuda/cuda_backward.cu ds_in_t, lact_cuda_impl.cuh's
# fused Newton-Schulz GEMM): their tests, then each against the default.
if [[ "${OPT_IN:-1}" != 0 ]]; then
  cmake --build "$BUILD" --target test_cuda_backward test_cuda_cp test_cuda_lact -j16 \
    >>"$OUT/build.log" 2>&1 &&
    (cd "$BUILD" && timeout "$(left 400)" ctest --timeout 150 \
      -R '_ds_f32$|_t_solve$|test_cuda_lact_ns_|test_cuda_lact_split_k|_output_(kernel|scan)$|_cluster_[128]$|_prepare_fp32$|_scan_bv_(16|32)$|_linear_tiles$' \
      --output-on-failure --no-tests=error) \
      >"$OUT/tests_opt_in.log" 2>&1 || status=1
  grep -E "Test +#|tests passed|tests failed" "$OUT/tests_opt_in.log" | sed 's/^/opt-in: /' | head -16
  {
    # Every row's failure counts (the group's status is only its last row's).
    bench() { timeout "$(left 120)" "$BUILD/launch/statescan-bench" "$@" || status=1; }
    bench --backward -v deltanet -t 32768
    STATESCAN_BWD_DS=f32 bench --backward -v deltanet -t 32768
    # Without the saved T (the default): the old solve path whole, and the
    # default path's no-T comparison.
    STATESCAN_BWD_T=solve bench --backward --no-save-t -v deltanet,gated_deltanet -t 32768
    bench --backward --no-save-t -v deltanet,gated_deltanet -t 32768,131072
    bench --lact
    STATESCAN_LACT_NS=fused bench --lact
    STATESCAN_LACT_NS=cluster bench --lact
    STATESCAN_LACT_SPLIT_K=0 bench --lact
    STATESCAN_FWD_OUTPUT=kernel bench -v deltanet,kda -t 32768,131072
  } >"$OUT/bench_opt_in.log" 2>&1
fi

# The GPU suites under compute-sanitizer (their ctest entries skip, 77, where
# the sanitizer is not installed, which ctest reports as skipped).
if [[ "${SANITIZE:-0}" == 1 ]]; then
  sanitized=(test_cuda_backward test_cuda_cp test_cuda_lact)
  # The suites linked with NCCL and MPI have memcheck entries of their own.
  if have MPI && have NCCL; then
    sanitized+=(test_cuda_cp_mpi test_cuda_lact_mpi test_comm_nccl)
  fi
  cmake --build "$BUILD" --target "${sanitized[@]}" -j16 >>"$OUT/build.log" 2>&1 &&
    (cd "$BUILD" && timeout "$(left 420)" ctest --timeout 200 -R '_(memcheck|initcheck|racecheck)$' \
      --output-on-failure --no-tests=error) >"$OUT/tests_sanitize.log" 2>&1 || status=1
  grep -E "Test +#|tests passed|tests failed" "$OUT/tests_sanitize.log" | sed 's/^/sanitize: /' |
    head -12
fi

# Backward: tests, the forward+backward table, and KDA at T = 1M with its peak memory.
if [[ "${BWD:-1}" != 0 ]]; then
  timeout "$(left 300)" "$BUILD/tests/test_cuda_backward" --gtest_filter="${GTEST_FILTER_BWD:-*}" \
    --gtest_output="json:$OUT/tests_bwd.json" >"$OUT/tests_bwd.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran" "$OUT/tests_bwd.log" | sed 's/^/backward: /' | tail -5
  grep -E "^\[  FAILED  \]" "$OUT/tests_bwd.log" | head -40
  # shellcheck disable=SC2086
  timeout "$(left 300)" "$BUILD/launch/statescan-bench" --backward --json "$OUT/bench_bwd.json" \
    ${BWD_ARGS:--t 32768} \
    >"$OUT/bench_bwd.log" 2>&1 || status=1
  if [[ "${KEEP:-1}" != 0 ]]; then
    # shellcheck disable=SC2086
    timeout "$(left 300)" "$BUILD/launch/statescan-bench" --backward --keep-prepared \
      --json "$OUT/bench_bwd_keep.json" \
      ${BWD_ARGS:--t 32768} >"$OUT/bench_bwd_keep.log" 2>&1 || status=1
  fi
  if [[ "${BWD_1M:-1}" != 0 ]]; then
    timeout "$(left 300)" "$BUILD/launch/statescan-bench" --backward -v kda -t 1048576 -H 16 -d 128 \
      --dtype bf16 -w 1 -n 3 --json "$OUT/bench_bwd_1m.json" >"$OUT/bench_bwd_1m.log" 2>&1 ||
      status=1
    if [[ "${RECOMPUTE:-1}" != 0 ]]; then
      timeout "$(left 300)" "$BUILD/launch/statescan-bench" --backward --recompute -v kda -t 1048576 \
        -H 16 -d 128 --dtype bf16 -w 1 -n 3 >"$OUT/bench_bwd_1m_recompute.log" 2>&1 || status=1
    fi
  fi
fi

# Per-kernel split (prepare / scan / output) of one timed forward at 32K.
if [[ "${NCU:-0}" != 0 ]] && command -v ncu >/dev/null; then
  for v in ${NCU_VARIANTS:-kda deltanet linear}; do
    timeout "$(left 180)" ncu --clock-control none --section SpeedOfLight --metrics gpu__time_duration.sum \
      --profile-from-start off \
      "$BUILD/launch/statescan-bench" -v "$v" -t 32768 -w 1 -n 1 >"$OUT/ncu_$v.log" 2>&1 ||
      echo "gpu-check: ncu $v failed, see $OUT/ncu_$v.log"
    # Every kernel of the one timed forward (the bench's profiler range),
    # however many the variant's path launches.
    awk -v v="$v" '/, Context [0-9]+, Stream [0-9]+/ { name = $0; sub(/^ +(void )?/, "", name); sub(/[<(].*/, "", name); sub(/.*::/, "", name) }
      /gpu__time_duration.sum/ { print "ncu " v ": " name " " $NF " " $(NF-1) }
      /Throughput/ { line = $0; gsub(/  +/, " ", line); print "ncu " v ": " name line }' "$OUT/ncu_$v.log" |
      tee -a "$OUT/ncu_summary.txt"
  done
fi

# One launch of one kernel at source level: its stall samples phase by phase
# (scripts/ncu_phases.py; the sixteenth session's method, PERF_NOTES).
if [[ -n "${NCU_SOURCE:-}" ]] && command -v ncu >/dev/null; then
  # shellcheck disable=SC2086
  timeout "$(left 300)" ncu --clock-control none --set full --import-source yes \
    -k regex:"$NCU_SOURCE" --launch-skip 1 --launch-count 1 -o "$BUILD/ncu_source" -f \
    "$BUILD/launch/statescan-bench" ${NCU_SOURCE_ARGS:--v deltanet -t 32768 --backward} -w 1 -n 1 \
    >"$OUT/ncu_source.log" 2>&1 &&
    ncu -i "$BUILD/ncu_source.ncu-rep" --page source --csv --print-source sass \
      >"$OUT/ncu_source_sass.csv" 2>>"$OUT/ncu_source.log" &&
    python3 "$ROOT/scripts/ncu_phases.py" "$OUT/ncu_source_sass.csv" --top 12 \
      >"$OUT/ncu_phases.txt" 2>&1 ||
    echo "gpu-check: the source-level profile failed, see $OUT/ncu_source.log"
fi

if [[ "${FLA:-1}" != 0 && -d "$ROOT/.fla/fla" ]] && python3 -c "import torch, triton" 2>/dev/null; then
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$ROOT/.fla/triton-cache} FLA_CACHE_RESULTS=1
  mkdir -p "$TRITON_CACHE_DIR"
  # The last run's tuned configs (a fresh machine's cache is empty).
  [[ -s "$OUT/fla_autotune.tgz" ]] && tar xzf "$OUT/fla_autotune.tgz" -C "$TRITON_CACHE_DIR" 2>/dev/null
  # A bound on FLA's run (its autotuning takes minutes per op on a fresh
  # machine: KDA's alone outlasted 4 minutes in the sixteenth session), so
  # that the call keeps time for the table; fla.log keeps what finished.
  # shellcheck disable=SC2086,SC2046
  PYTHONPATH="$ROOT/.fla${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    timeout "$(left "${FLA_TIMEOUT:-900}")" python3 "$ROOT/scripts/fla_bench.py" --json "$OUT/fla.json" \
    $([[ "${BWD:-1}" != 0 ]] && echo --backward) ${FLA_ARGS:-} \
    >"$OUT/fla.log" 2>&1 || echo "gpu-check: FLA comparison failed or ran past FLA_TIMEOUT, see $OUT/fla.log"
  if [[ "${DECODE:-1}" != 0 ]]; then
    PYTHONPATH="$ROOT/.fla${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
      timeout "$(left 300)" python3 "$ROOT/scripts/fla_bench.py" --decode \
      --variants linear,retention,gla,deltanet,gated_deltanet,kda \
      --batches "$(echo ${DECODE_BATCHES:-16 512} | tr ' ' ,)" --json "$OUT/fla_decode.json" \
      >"$OUT/fla_decode.log" 2>&1 || echo "gpu-check: FLA's decode failed, see $OUT/fla_decode.log"
  fi
  # Packed under another name and moved into place only when it holds a
  # config: a failed or untuned run must not replace a good pack.
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 |
    tar czf "$OUT/fla_autotune.tgz.new" --null -T -) 2>/dev/null
  if [[ -n "$(tar tzf "$OUT/fla_autotune.tgz.new" 2>/dev/null | head -1)" ]]; then
    mv "$OUT/fla_autotune.tgz.new" "$OUT/fla_autotune.tgz"
  else
    rm -f "$OUT/fla_autotune.tgz.new"
  fi
fi

echo
cat "$OUT/bench.log"
for f in bench_decode.log bench_linear_scan.log bench_opt_in.log bench_bwd.log bench_bwd_keep.log bench_bwd_1m.log bench_bwd_1m_recompute.log ncu_phases.txt; do [[ -f "$OUT/$f" ]] && { echo; cat "$OUT/$f"; }; done
# statescan vs FLA, row by row where both timed the same problem: the
# chunkwise tables by (variant, T, H, D) at B=1 (FLA runs B=1 in bf16, so
# other statescan rows are left out), the decode's by (variant, B, H, D) at
# T=1. KEY is the column that varies (T or B); OURS is one JSON or a glob.
compare() {  # compare OURS FLA_JSON FIELD KEY TITLE
  python3 - "$1" "$2" "$3" "$4" "$5" <<'PY' | tee -a "$OUT/summary.txt" || status=1
import glob, json, sys
ours_glob, fla_path, field, key, title = sys.argv[1:6]
fixed = "B" if key == "T" else "T"
ours = {(r["variant"], r[key], r["H"], r["D"]): r for path in sorted(glob.glob(ours_glob))
        for r in json.load(open(path)) if r.get("dtype") == "bf16" and r.get(fixed) == 1}
unit, digits, width = ("us", 2, 5) if field == "us" else ("ms", 3, 8)
print(f"#\n# statescan vs FLA ({title}, same GPU, same run; {fixed}=1, bf16)")
print(f"# {'variant':15s} {key:>{width}s} {'H':>3s} {'D':>4s} {'statescan(' + unit + ')':>14s} "
      f"{'FLA(' + unit + ')':>10s} {'FLA/statescan':>14s}")
for f in json.load(open(fla_path)):
    o = ours.get((f["variant"], f[key], f["H"], f["D"]))
    mine = f"{o[field]:.{digits}f}" if o else "-"
    head = f"  {f['variant']:15s} {f[key]:{width}d} {f['H']:3d} {f['D']:4d} {mine:>14s}"
    if field in f:
        ratio = f"{f[field] / o[field]:.2f}" if o else "-"
        print(f"{head} {f[field]:10.{digits}f} {ratio:>14s}")
    else:
        print(f"{head} {'refused':>10s}   ({f.get('error', 'not timed')[:60]})")
PY
}
if [[ -f "$OUT/fla.json" && -f "$OUT/bench.json" ]]; then
  compare "$OUT/bench.json" "$OUT/fla.json" ms T forward
  [[ -f "$OUT/bench_bwd.json" ]] &&
    compare "$OUT/bench_bwd.json" "$OUT/fla.json" ms_fwd_bwd T "forward + backward"
fi
[[ -f "$OUT/fla_decode.json" ]] &&
  compare "$OUT/bench_decode_b*.json" "$OUT/fla_decode.json" us B \
    "recurrent decode, CUDA graph replays"
exit $status
