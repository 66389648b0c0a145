#!/usr/bin/env bash
# lact-check.sh OUTDIR — on a machine with an NVIDIA Hopper GPU: configure for
# sm_90a, build the LaCT targets, run the GPU LaCT tests (the suite, every
# ctest entry that reruns it under a knob, the sharded suite over NCCL), the
# LaCT benchmark at the issue's shape (1M tokens as 256 chunks of 4096, H 4,
# D 256, M 512, bf16) without Muon and with 5 steps, and the no-Muon row once
# per opt-in knob; logs in OUTDIR, a short table last (with the fused
# kernels' registers, stack and local memory from cuobjdump, where it exists). One call fits the GPU
# lending tool's 10 minutes (~2 min of build, ~1 of tests, ~4 of benchmarks).
#
# Environment knobs:
#   BUILD_DIR   build folder (default <repo>/build-gpu)
#   KNOBS       the knobs to time against the default, space-separated
#               NAME=VALUE (default: one stream, dependent launches, the token
#               GEMM, the cuBLAS hidden layer); "" for none
#   TESTS=0     skip the tests;  TESTS=suite  the suite only (no knob reruns)
#   TEST_TIMEOUT  seconds before a hung test binary is killed (default 300:
#               a kernel that deadlocks must not eat the call's 10 minutes)
#   BENCH_TIMEOUT  the same for each benchmark row and ncu table (default 240)
#   MUON=0      skip the Muon row;  BENCH_ROWS=0  no benchmark rows at all
#               (the tests and ncu tables alone, for a short device call)
#   NCU=1       also the kernels' times a chunk under Nsight Compute
#               (scripts/ncu_kernels.py; clocks locked, 8 chunks)
#   NCU_KNOBS   with NCU=1, the same table once more under each of these
#               NAME=VALUE knobs (space-separated; default none): a kernel's
#               A/B in one call
#   NCU_INSITU=1  with NCU=1, the default's table once more with ncu's
#               cache flush and clock lock off (--cache-control none
#               --clock-control none): each kernel as it runs in the layer,
#               its inputs where the kernels before it left them (L2), at the
#               GPU's own clocks; still one kernel at a time, so the sum
#               against the benchmark's wall time tells what overlap and gaps
#               are worth
#   REF_SRC     a folder with another revision's source tree (e.g. made by
#               `git archive main | tar -x -C .ref`, git-ignored and passed to
#               the device tool in `carry`): its statescan-bench is built in
#               BUILD_DIR-ref, and the default no-Muon row runs REF_ROUNDS times
#               (default 2) alternating with the reference's, on the same
#               machine (and with NCU=1 the reference's kernel table too): an
#               A/B of a branch against main in one call
#   NCU_SOURCE  "LABEL=REGEX[@NAME=VALUE ...];..." one launch (the second) of
#               each kernel whose demangled name matches REGEX, under ncu
#               --set full at source level with the given knobs:
#               OUTDIR/src_LABEL.txt, its stall samples phase by phase
#               (scripts/ncu_phases.py) and its pipes' and shared memory's
#               utilisation (scripts/ncu_phases.py --raw)
#   BIN_DIR     a folder holding statescan-bench and test_cuda_lact built
#               elsewhere for sm_90a (scripts/carry-build.sh; build-carry/
#               unpack.sh prints the folder): nothing is built, the tests are
#               the suite alone (TESTS=suite), and SUITE_KNOBS (space-separated
#               NAME=VALUE) reruns its bf16 layer tests once under each
set -uo pipefail

OUT=${1:?usage: scripts/lact-check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-gpu}
KNOBS=${KNOBS-STATESCAN_LACT_STREAMS=1 STATESCAN_LACT_PDL=1 STATESCAN_LACT_TOKEN_GEMM=fused STATESCAN_LACT_HIDDEN=cublas}
BENCH=$BUILD/launch/statescan-bench
SUITE=$BUILD/tests/test_cuda_lact
if [[ -n "${BIN_DIR:-}" ]]; then
  BENCH=$BIN_DIR/statescan-bench SUITE=$BIN_DIR/test_cuda_lact
  [[ "${TESTS:-1}" == 0 ]] || TESTS=suite
fi
REF_BUILD=$BUILD-ref
REF_BENCH=$REF_BUILD/launch/statescan-bench
status=0
# A reused OUTDIR must not show an earlier run's rows or profiles as this
# run's: the table prints whatever files it finds.
rm -f "$OUT"/{build_ref,tests,tests_knobs}.log "$OUT"/tests_suite_knob*.log "$OUT"/bench*.log \
  "$OUT"/ncu_*.{csv,log,txt} "$OUT"/src_*.{log,txt} "$OUT/res_usage.txt"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >"$OUT/build.log" 2>&1 || true
[[ -n "${BIN_DIR:-}" ]] || {
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DSTATESCAN_WITH_CUDA=ON -DSTATESCAN_WITH_TESTS=ON &&
    if [[ "${TESTS:-1}" == 0 ]]; then cmake --build "$BUILD" --target statescan-bench -j16; else
      cmake --build "$BUILD" --target test_cuda_lact statescan-bench -j16; fi &&
    { [[ "${TESTS:-1}" == 0 ]] || ! grep -q "STATESCAN_HAVE_NCCL:INTERNAL=ON" "$BUILD/CMakeCache.txt" ||
      cmake --build "$BUILD" --target test_cuda_lact_mpi -j16; }
} >>"$OUT/build.log" 2>&1 || { echo "lact-check: build failed, see $OUT/build.log"; tail -40 "$OUT/build.log"; exit 1; }
if [[ -n "${REF_SRC:-}" ]]; then
  REF_SRC=$(cd "$REF_SRC" && pwd) || exit 1
  {
    cmake -S "$REF_SRC" -B "$REF_BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
      -DSTATESCAN_WITH_CUDA=ON -DSTATESCAN_WITH_TESTS=OFF &&
      cmake --build "$REF_BUILD" --target statescan-bench -j16
  } >"$OUT/build_ref.log" 2>&1 ||
    { echo "lact-check: the reference's build failed, see $OUT/build_ref.log"; tail -40 "$OUT/build_ref.log"; exit 1; }
fi

if [[ "${TESTS:-1}" != 0 ]]; then
  timeout "${TEST_TIMEOUT:-300}" "$SUITE" >"$OUT/tests.log" 2>&1
  rc=$?
  if [[ $rc != 0 ]]; then
    status=1
    echo "suite: exit $rc (124: killed after ${TEST_TIMEOUT:-300} s)"
    tail -3 "$OUT/tests.log"
  fi
  grep -E "^\[  (PASSED|FAILED) " "$OUT/tests.log" | sed 's/^/suite: /'
  grep -E "^\[  FAILED  \]" "$OUT/tests.log" | head -20
  # The knobs' reruns of the suite and the sharded suite (np 1 here; np 2
  # skips on one GPU).
  if [[ "${TESTS:-1}" != suite ]]; then
    (cd "$BUILD" && ctest -R '^test_cuda_lact_' --timeout "${TEST_TIMEOUT:-300}" --output-on-failure \
      --no-tests=error) \
      >"$OUT/tests_knobs.log" 2>&1 || status=1
    grep -E "tests passed|tests failed|\(Failed\)|Timeout" "$OUT/tests_knobs.log" | sed 's/^/knobs: /'
  fi
  i=0
  for knob in ${SUITE_KNOBS:-}; do
    timeout "${TEST_TIMEOUT:-300}" env "$knob" "$SUITE" --gtest_filter='*Bf16*' \
      >"$OUT/tests_suite_knob$i.log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED) " "$OUT/tests_suite_knob$i.log" | sed "s/^/$knob: /"
    grep -E "^\[  FAILED  \]" "$OUT/tests_suite_knob$i.log" | head -10
    i=$((i + 1))
  done
fi

# Registers, spills and stack of the fused hidden-layer kernels (this tree's
# and the reference's), from the objects' SASS resource usage.
res_usage() {  # res_usage BUILD_DIR LABEL
  local obj
  [[ -d "$1" ]] || return 0
  obj=$(find "$1" -name 'lact_hidden.cu.o' | head -1)
  [[ -n "$obj" ]] && command -v cuobjdump >/dev/null || return 0
  echo "# $2: lact_hidden.cu resource usage (cuobjdump -res-usage)"
  cuobjdump -res-usage "$obj" 2>/dev/null | awk '
    /Function/ { name = $2; sub(/:$/, "", name) }
    /REG:/ { cmd = "c++filt " name; cmd | getline dem; close(cmd)
             gsub(/statescan::cuda::lact_detail::(\(anonymous namespace\)::)?|^void /, "", dem)
             gsub(/\(LactHiddenMode\)/, "mode ", dem)
             sub(/\(LactHidden[A-Za-z]*Params.*$/, "", dem)
             printf "  %-48s %s %s %s\n", dem, $1, $2, $4 }'
}
{ [[ -n "${BIN_DIR:-}" ]] || res_usage "$BUILD" "this tree"; [[ -z "${REF_SRC:-}" ]] || res_usage "$REF_BUILD" "the reference"; } \
  >"$OUT/res_usage.txt" 2>&1

# One benchmark row: bench LOG [ENV...] -- [ARGS...] (BIN: the binary, by
# default this tree's)
bench() {
  local log=$1
  shift
  local envs=()
  while [[ $# -gt 0 && "$1" != "--" ]]; do envs+=("$1"); shift; done
  shift
  timeout "${BENCH_TIMEOUT:-240}" env "${envs[@]}" "${BIN:-$BENCH}" --lact "$@" >"$OUT/$log" 2>&1 ||
    status=1
}
ref_rounds=0
if [[ "${BENCH_ROWS:-1}" != 0 ]]; then
  bench bench.log -- --muon-steps 0
  if [[ -n "${REF_SRC:-}" ]]; then
    # The reference and this tree in turns; the first default row is above.
    ref_rounds=${REF_ROUNDS:-2}
    for ((r = 0; r < ref_rounds; ++r)); do
      BIN=$REF_BENCH bench "bench_ref$r.log" -- --muon-steps 0 --no-check
      ((r + 1 < ref_rounds)) && bench "bench_again$r.log" -- --muon-steps 0 --no-check
    done
  fi
  [[ "${MUON:-1}" != 0 ]] && bench bench_muon.log -- --no-check
  i=0
  for knob in $KNOBS; do
    bench "bench_knob$i.log" "$knob" -- --muon-steps 0 --no-check
    i=$((i + 1))
  done
fi

# The run both ncu passes profile: 8 chunks of the benchmark's shape, one
# iteration, no Muon and no check.
NCU_RUN=("$BENCH" --lact --muon-steps 0 --no-check -T 32768 --warmup 0 --iters 1)

# The kernels' times a chunk: ncu_table NAME [ENV...] writes $OUT/NAME.txt
# (BIN: the binary, by default this tree's).
# (NCU_FLAGS: more ncu options, as a string.)
ncu_table() {
  local name=$1
  shift
  local run=("${NCU_RUN[@]}")
  run[0]=${BIN:-$BENCH}
  local flags=()
  read -ra flags <<<"${NCU_FLAGS:-}"
  timeout "${BENCH_TIMEOUT:-240}" env "$@" ncu --profile-from-start off ${flags[@]+"${flags[@]}"} \
    --metrics gpu__time_duration.sum --csv "${run[@]}" \
    >"$OUT/$name.csv" 2>"$OUT/$name.log" &&
    { [[ $# -eq 0 ]] || echo "# under $*"; python3 "$ROOT/scripts/ncu_kernels.py" "$OUT/$name.csv" 8; } \
      >"$OUT/$name.txt" || echo "lact-check: the ncu table $name failed, see $OUT/$name.log"
}
ncu_names=()
if [[ "${NCU:-0}" == 1 ]] && command -v ncu >/dev/null; then
  ncu_table ncu_kernels && ncu_names+=(ncu_kernels)
  if [[ "${NCU_INSITU:-0}" == 1 ]]; then
    NCU_FLAGS="--cache-control none --clock-control none" ncu_table ncu_insitu &&
      { sed -i '1i # in situ: no cache flush, clocks not locked' "$OUT/ncu_insitu.txt"
        ncu_names+=(ncu_insitu); }
  fi
  if [[ -n "${REF_SRC:-}" ]]; then
    BIN=$REF_BENCH ncu_table ncu_ref
    [[ -s "$OUT/ncu_ref.txt" ]] &&
      { sed -i "1i # the reference ($REF_SRC)" "$OUT/ncu_ref.txt"; ncu_names+=(ncu_ref); }
  fi
  i=0
  for knob in ${NCU_KNOBS:-}; do
    ncu_table "ncu_knob$i" "$knob" && ncu_names+=("ncu_knob$i")
    i=$((i + 1))
  done
fi

# One launch of a kernel at source level: src LABEL REGEX [NAME=VALUE...]
src_profile() {
  local label=$1 regex=$2
  shift 2
  local rep="$BUILD/src_$label"
  mkdir -p "$BUILD"  # with BIN_DIR nothing was built here
  timeout 300 env "$@" ncu --set full --import-source yes --kernel-name-base demangled \
    -k "regex:$regex" --launch-skip 1 --launch-count 1 -o "$rep" -f "${NCU_RUN[@]}" \
    >"$OUT/src_$label.log" 2>&1 &&
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.csv" 2>>"$OUT/src_$label.log" &&
    ncu -i "$rep.ncu-rep" --page raw --csv >"$rep.raw.csv" 2>>"$OUT/src_$label.log" &&
    { [[ $# -eq 0 ]] || echo "# under $*"
      python3 "$ROOT/scripts/ncu_phases.py" "$rep.csv" --top 15 --raw "$rep.raw.csv"; } \
      >"$OUT/src_$label.txt" 2>&1 || echo "lact-check: the source profile $label failed, see $OUT/src_$label.log"
}
if [[ -n "${NCU_SOURCE:-}" ]] && command -v ncu >/dev/null; then
  IFS=';' read -ra specs <<<"$NCU_SOURCE"
  for spec in "${specs[@]}"; do
    label=${spec%%=*} rest=${spec#*=}
    envs=()
    [[ "$rest" == *@* ]] && read -ra envs <<<"${rest#*@}"
    src_profile "$label" "${rest%%@*}" ${envs[@]+"${envs[@]}"}
  done
fi

# The table: each row's fwd and fwd+bwd (ms, util against its own cuBLAS
# 4096^3 rate, which moves a few per cent between machines), the default's
# first; check = the small problem's error against fp64 (the default rows).
row() {  # row LABEL LOG
  [[ -f "$OUT/$2" ]] || return 0
  awk -v label="$1" '
    /^# cuBLAS bf16 GEMM/ && ref == "" { for (k = 1; k <= NF; ++k) if ($k == "4096^3") { ref = $(k + 1); break } }
    $1 == "fwd" { f = $2; fu = $6 }
    $1 == "fwd+bwd" { b = $2; bu = $6; e = ($NF == "-1.00e+00" ? "-" : $NF) }
    END { printf "  %-38s %9s %7s %9s %7s %9s %9s\n", label, f, fu, b, bu, ref, e }' "$OUT/$2"
}
echo
for name in ${ncu_names[@]+"${ncu_names[@]}"}; do
  [[ -f "$OUT/$name.txt" ]] && { cat "$OUT/$name.txt"; echo; }
done
[[ -s "$OUT/res_usage.txt" ]] && { cat "$OUT/res_usage.txt"; echo; }
for f in "$OUT"/src_*.txt; do
  [[ -f "$f" ]] && { echo "# $(basename "$f" .txt)"; cat "$f"; echo; }
done
echo "# LaCT, 1M tokens, 256 x 4096, H 4, D 256, M 512, bf16 (statescan-bench --lact, median of 5)"
printf "# %-38s %9s %7s %9s %7s %9s %9s\n" "row" "fwd_ms" "util%" "f+b_ms" "util%" "cuBLAS_TF" "check"
row "default, no Muon" bench.log
for ((r = 0; r < ref_rounds; ++r)); do
  row "reference, no Muon ($((r + 1)))" "bench_ref$r.log"
  row "default, no Muon (again, $((r + 2)))" "bench_again$r.log"
done
row "default, Muon 5" bench_muon.log
i=0
for knob in $KNOBS; do
  row "$knob, no Muon" "bench_knob$i.log"
  i=$((i + 1))
done
exit $status
