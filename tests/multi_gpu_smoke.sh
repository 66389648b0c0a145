#!/usr/bin/env bash
# multi_gpu_smoke.sh MULTI_GPU BUILD_DIR — scripts/multi-gpu.sh needs a machine
# with several GPUs, which is lent rarely and for minutes that are counted; this
# runs the whole script on CI's CPUs instead: a stub nvidia-smi that lists two
# GPUs, DEVICE=cpu, the shapes shrunk, and BUILD_DIR's statescan-run (built with
# MPI) under the real mpirun. It fails if a flag the script passes is refused,
# if a run fails, or if a study's table lacks its rows, its exchange bytes or
# its efficiency: the contract between the script and statescan-run's --json.
set -uo pipefail

SCRIPT=${1:?usage: multi_gpu_smoke.sh path/to/multi-gpu.sh BUILD_DIR}
BUILD=${2:?usage: multi_gpu_smoke.sh path/to/multi-gpu.sh BUILD_DIR}
WORK=$(mktemp -d /tmp/statescan-multi-gpu.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() {
  echo "multi_gpu_smoke: $*"
  exit 1
}
[[ -x "$BUILD/launch/statescan-run" ]] || fail "no statescan-run in $BUILD/launch"
command -v mpirun >/dev/null || fail "no mpirun on PATH"

mkdir -p "$WORK/bin"
printf '#!/bin/sh\necho "GPU 0: stub (UUID: 0)"\necho "GPU 1: stub (UUID: 1)"\n' >"$WORK/bin/nvidia-smi"
chmod +x "$WORK/bin/nvidia-smi"

run_script() {  # run_script LOG: the script into $WORK/out
  PATH="$WORK/bin:$PATH" DEVICE=cpu SKIP_BUILD=1 SKIP_TESTS=1 BUILD_DIR="$BUILD" ITERS=2 MODEL_BIN= \
    VARIANTS=kda EXCHANGES="auto ring" TOKENS_PER_GPU=256 STRONG_TOKENS=512 HEADS=2 DIM=16 \
    LACT_TOKENS=64 LACT_HEADS=2 LACT_DIM=8 LACT_HIDDEN=16 RUN_TIMEOUT=120 \
    bash "$SCRIPT" "$WORK/out" >"$1" 2>&1
  local rc=$?
  cat "$1"
  [[ $rc -eq 0 ]] || fail "multi-gpu.sh exited $rc"
}
run_script "$WORK/log"
grep -q "multi-gpu: 2 GPU(s)" "$WORK/log" || fail "the stub's GPUs were not counted"
! grep -q "failed" "$WORK/log" || fail "a run failed"

# Each study's table: its P rows, each with 10 columns (weak_kda_ring has no
# P = 1 row of its own: it shares weak_kda's). The last, the scaling model's
# efficiency, is a number on the weak studies' P = 2 rows where the build has
# statescan-bench (CUDA builds), else "-".
table() {  # table STUDY [SUMMARY]: its rows (default: the first run's summary)
  awk -v s="# $1:" '/^# [a-z_]+:/ { on = index($0, s) == 1; next } /^#/ { next } on && NF' \
    "${2:-$WORK/out/summary.txt}"
}
p_list() {  # p_list STUDY [SUMMARY]: its rows' P, space-separated
  table "$@" | awk '{ printf "%s%s", (NR > 1 ? " " : ""), $1 }'
}
for study in weak_kda weak_kda_ring strong_kda lact; do
  rows=$(table "$study")
  [[ -n "$rows" ]] || fail "no table for $study"
  want="1 2"
  [[ $study == weak_kda_ring ]] && want="2"
  got=$(p_list "$study")
  [[ "$got" == "$want" ]] || fail "$study: rows for P = '$got', expected '$want'"
  # P = 2: bytes exchanged and an efficiency, both positive numbers.
  awk -v s="$study" '$1 == 2 {
      if (NF != 10 || $6 + 0 <= 0 || $9 + 0 <= 0) { print s ": P = 2 row lacks exchange bytes or efficiency: " $0; exit 1 }
    }' <<<"$rows" || exit 1
  model=$(awk '$1 == 2 { print $10 }' <<<"$rows")
  if [[ $study == weak_* && -x "$BUILD/launch/statescan-bench" ]]; then
    awk -v m="$model" 'BEGIN { exit !(m ~ /^[0-9.]+$/ && m > 0 && m <= 100) }' ||
      fail "$study: P = 2 model efficiency '$model', expected a percentage"
  else
    [[ "$model" == "-" ]] || fail "$study: P = 2 model column '$model', expected '-'"
  fi
done
# The same OUTDIR again, holding a row this run does not make (a P = 4 one,
# as a larger node's run would have left): the tables are this run's alone.
cp "$WORK/out/weak_kda_p2.json" "$WORK/out/weak_kda_p4.json"
run_script "$WORK/log2"
got=$(p_list weak_kda)
[[ "$got" == "1 2" ]] || fail "a reused OUTDIR: weak_kda rows for P = '$got', expected '1 2'"

# The cases below run the weak study alone: weak OUTDIR LOG [VAR=VALUE...]
# (the settings override the defaults).
weak() {
  local out=$1 log=$2
  shift 2
  env PATH="$WORK/bin:$PATH" DEVICE=cpu SKIP_BUILD=1 SKIP_TESTS=1 BUILD_DIR="$BUILD" ITERS=2 \
    MODEL_BIN= VARIANTS=kda STUDIES=weak TOKENS_PER_GPU=256 HEADS=2 DIM=16 RUN_TIMEOUT=120 "$@" \
    bash "$SCRIPT" "$out" >"$log" 2>&1
}

# BIN_DIR (a carried pack's folder): its statescan-run runs, nothing is built
# (BUILD_DIR names no build and SKIP_BUILD is unset), and each suite missing
# from the folder is named, not passed over in silence.
mkdir -p "$WORK/carried"
ln -s "$BUILD/launch/statescan-run" "$WORK/carried/statescan-run"
carried() {  # carried BIN_DIR LOG, into $WORK/out3
  weak "$WORK/out3" "$2" BIN_DIR="$1" BUILD_DIR="$WORK/no-build" SKIP_BUILD=0 SKIP_TESTS=0
}
carried "$WORK/carried" "$WORK/log3"
rc=$?
cat "$WORK/log3"
[[ $rc -eq 0 ]] || fail "BIN_DIR: multi-gpu.sh exited $rc"
[[ ! -e "$WORK/no-build" ]] || fail "BIN_DIR: the script configured a build"
for t in test_comm_nccl test_cuda_cp_mpi test_cuda_lact_mpi; do
  grep -q "multi-gpu: $t not in BIN_DIR, left out" "$WORK/log3" || fail "BIN_DIR: $t's absence not named"
done
got=$(p_list weak_kda "$WORK/out3/summary.txt")
[[ "$got" == "1 2" ]] || fail "BIN_DIR: weak_kda rows for P = '$got', expected '1 2'"
# No statescan-bench there: the model's command line for another machine.
grep -q "^#   model: no statescan-bench here; on any machine: statescan-bench --cp-model --variant kda --seq-len 256 " \
  "$WORK/out3/summary.txt" || fail "BIN_DIR: no model command line in the summary"
# A folder without statescan-run is refused before any run.
mkdir -p "$WORK/empty"
carried "$WORK/empty" "$WORK/log4" && fail "BIN_DIR without statescan-run: exit 0"
grep -q "multi-gpu: no statescan-run in BIN_DIR" "$WORK/log4" || { cat "$WORK/log4"; fail "BIN_DIR without statescan-run: no message"; }
# A model that fails: the tables still print, the script fails, naming it.
printf '#!/bin/sh\necho "stub model refused" >&2\nexit 3\n' >"$WORK/bin/bad-model"
chmod +x "$WORK/bin/bad-model"
weak "$WORK/out5" "$WORK/log5" MODEL_BIN="$WORK/bin/bad-model" &&
  { cat "$WORK/log5"; fail "a failing model: exit 0"; }
grep -q "^#   model: .*bad-model --cp-model .* failed (3): stub model refused" "$WORK/out5/summary.txt" ||
  { cat "$WORK/log5"; fail "a failing model: not named in the summary"; }
grep -q "^    2 " "$WORK/out5/summary.txt" || fail "a failing model: the table's P = 2 row is gone"
# A MODEL_BIN that is not there: named, the command line printed instead, exit 1.
weak "$WORK/out6" "$WORK/log6" MODEL_BIN="$WORK/no-such-bench" &&
  { cat "$WORK/log6"; fail "a missing MODEL_BIN: exit 0"; }
grep -q "MODEL_BIN $WORK/no-such-bench is not an executable" "$WORK/log6" &&
  grep -q "^#   model: no statescan-bench here" "$WORK/out6/summary.txt" ||
  { cat "$WORK/log6"; fail "a missing MODEL_BIN: not named, or no command line"; }
echo "multi_gpu_smoke: OK"
