#!/usr/bin/env bash
# CI: the Prometheus round trip. Runs `mpirun -np 2 statescan-run` with its
# exporters on two loopback ports, checks the plain /metrics text of each
# rank, then starts a real Prometheus server (Debian package `prometheus`) on
# a loopback port that scrapes both ranks, and reads statescan_tokens_total
# back through Prometheus' HTTP query API; then the same exporter under a
# --variant lact job (labels, all-reduce bytes, tokens). Exits non-zero on any
# failure.
#
#   STATESCAN_BUILD_DIR   reuse this build directory (e.g. build/ after
#                         run-tests.sh) instead of a fresh CPU-only one
#   CI_WORK_DIR           where logs, configs and the TSDB go (default: a temp dir)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
source scripts/setup-build.sh

STATESCAN_PACKAGES+=(prometheus prometheus-cpp-dev curl jq)
statescan_install_packages
statescan_mpi_env

# A temp dir of its own (no CI_WORK_DIR) is removed after a pass and kept,
# with its logs, after a failure (cleanup below).
OWN_WORK=""
if [ -n "${CI_WORK_DIR:-}" ]; then
  WORK=$CI_WORK_DIR
else
  WORK=$(mktemp -d /tmp/statescan-metrics.XXXXXX)
  OWN_WORK=$WORK
fi
mkdir -p "$WORK"
step() { echo "ci-metrics: $*"; }
fail() {
  echo "ci-metrics: FAILED: $*" >&2
  for log in "$WORK/run.log" "$WORK/prometheus.log"; do
    [ -f "$log" ] && { echo "--- $log (last lines)" >&2; tail -20 "$log" >&2; }
  done
  exit 1
}

# ---- build statescan-run with the exporter -----------------------------------
if [ -n "${STATESCAN_BUILD_DIR:-}" ]; then
  BUILD=$STATESCAN_BUILD_DIR
  # A build folder configured by an older statescan (or before OpenMPI was
  # installed) may hold a forced OFF; the run needs both.
  cmake -S "$ROOT" -B "$BUILD" -DSTATESCAN_WITH_PROMETHEUS=ON -DSTATESCAN_WITH_MPI=ON \
    >"$WORK/configure.log" 2>&1 ||
    fail "configure of $BUILD (see $WORK/configure.log)"
else
  BUILD=$WORK/build
  # The round trip is about metrics: the CPU path is enough and quick to build.
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DSTATESCAN_WITH_CUDA=OFF \
    -DSTATESCAN_WITH_TESTS=OFF >"$WORK/configure.log" 2>&1 ||
    fail "configure of $BUILD (see $WORK/configure.log)"
fi
grep -q '^STATESCAN_HAVE_PROMETHEUS:INTERNAL=ON' "$BUILD/CMakeCache.txt" ||
  fail "prometheus-cpp was not found by CMake although prometheus-cpp-dev is installed"
grep -q '^STATESCAN_HAVE_MPI:INTERNAL=ON' "$BUILD/CMakeCache.txt" ||
  fail "MPI was not found by CMake although OpenMPI is installed (see $WORK/configure.log)"
step "building statescan-run in $BUILD"
cmake --build "$BUILD" --target statescan-run -j"$(nproc)" >"$WORK/build.log" 2>&1 ||
  { tail -40 "$WORK/build.log"; fail "build of statescan-run"; }

# ---- the run: two ranks, exporters on METRICS_PORT and METRICS_PORT + 1 -------
# Random free ports below the kernel's ephemeral range (scripts/ci-ports.sh).
source scripts/ci-ports.sh
# Six ports from METRICS_PORT: the mixer job's two ranks, then the LaCT
# job's, then the interrupted run's, then the failing run's.
METRICS_PORT=${CI_METRICS_PORT:-$(ci_free_port_base 20000 30000 6)}
PROM_PORT=${CI_PROMETHEUS_PORT:-$(ci_free_port_base 10000 19000 1)}
SEQ_LEN=8192 WARMUP=1 ITERS=3
# Every step counts, warm-up included: the tokens of both ranks add up to T per step.
EXPECTED_TOKENS=$(((WARMUP + ITERS) * SEQ_LEN))

RUN_PID="" PROM_PID=""
cleanup() {
  local rc=$?
  [ -n "$PROM_PID" ] && kill "$PROM_PID" 2>/dev/null && wait "$PROM_PID" 2>/dev/null
  [ -n "$RUN_PID" ] && kill "$RUN_PID" 2>/dev/null && wait "$RUN_PID" 2>/dev/null
  if [ -n "$OWN_WORK" ]; then
    if [ "$rc" -eq 0 ]; then rm -rf "$OWN_WORK"; else echo "ci-metrics: logs kept in $OWN_WORK" >&2; fi
  fi
  return 0
}
trap cleanup EXIT

# Waits until the run in the background ($RUN_PID, logging to run.log) has
# printed its table's footer: its steps are done and its exporters hold.
wait_for_steps() {
  for _ in $(seq 600); do
    grep -q '^# Avg' "$WORK/run.log" && return 0
    kill -0 "$RUN_PID" 2>/dev/null || fail "$1 ended before its metrics could be read"
    sleep 0.2
  done
  fail "$1 did not finish its steps within 120 s"
}
# Ends the hold (SIGUSR1) and expects a clean exit.
stop_run() {
  kill -USR1 "$RUN_PID"
  local status=0
  wait "$RUN_PID" || status=$?
  RUN_PID=""
  [ "$status" -eq 0 ] || fail "$1 exited with $status after the hold was ended"
}

step "mpirun -np 2 statescan-run --metrics-port $METRICS_PORT --metrics-hold 300"
mpirun -np 2 --oversubscribe "$BUILD/launch/statescan-run" --device cpu --variant kda \
  --seq-len "$SEQ_LEN" --warmup "$WARMUP" --iters "$ITERS" --no-check \
  --metrics-port "$METRICS_PORT" --metrics-hold 300 >"$WORK/run.log" 2>&1 &
RUN_PID=$!

wait_for_steps statescan-run
cat "$WORK/run.log"

# ---- 1. the plain /metrics text of each rank -----------------------------------
total=0
for rank in 0 1; do
  port=$((METRICS_PORT + rank))
  curl -sf --max-time 10 "http://127.0.0.1:$port/metrics" >"$WORK/metrics-rank$rank.txt" ||
    fail "GET http://127.0.0.1:$port/metrics"
  for family in statescan_tokens_total statescan_step_seconds statescan_tokens_per_second \
                statescan_phase_seconds_total statescan_exchange_bytes_total \
                statescan_achieved_tflops statescan_device_memory_bytes statescan_errors_total; do
    grep -q "^# TYPE $family " "$WORK/metrics-rank$rank.txt" || fail "rank $rank serves no $family"
  done
  line=$(grep "^statescan_tokens_total{" "$WORK/metrics-rank$rank.txt") ||
    fail "rank $rank serves no statescan_tokens_total sample"
  [[ "$line" == *"rank=\"$rank\""* && "$line" == *'variant="kda"'* ]] ||
    fail "rank $rank: unexpected labels in: $line"
  grep -q "^statescan_step_seconds_count{.*} $((WARMUP + ITERS))\$" "$WORK/metrics-rank$rank.txt" ||
    fail "rank $rank: statescan_step_seconds_count is not $((WARMUP + ITERS))"
  tokens=${line##* }
  step "rank $rank /metrics: $line"
  total=$((total + ${tokens%.*}))
done
[ "$total" -eq "$EXPECTED_TOKENS" ] ||
  fail "statescan_tokens_total over the ranks is $total, expected $EXPECTED_TOKENS"

# ---- 2. a real Prometheus scrapes both ranks -------------------------------------
cat >"$WORK/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: statescan
    static_configs:
      - targets: ['127.0.0.1:$METRICS_PORT', '127.0.0.1:$((METRICS_PORT + 1))']
EOF
step "prometheus on 127.0.0.1:$PROM_PORT scraping 127.0.0.1:$METRICS_PORT and :$((METRICS_PORT + 1))"
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
PROM_PID=$!

query() {  # prints the first result's value of an instant query, or nothing
  curl -sf --max-time 10 "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode "query=$1" |
    jq -r 'select(.status == "success") | .data.result[0].value[1] // empty'
}
got=""
for _ in $(seq 120); do
  kill -0 "$PROM_PID" 2>/dev/null || fail "prometheus exited"
  got=$(query 'sum(statescan_tokens_total{job="statescan"})' 2>/dev/null || true)
  [ "$got" = "$EXPECTED_TOKENS" ] && [ "$(query 'count(up{job="statescan"} == 1)')" = 2 ] && break
  sleep 0.5
done
[ "$got" = "$EXPECTED_TOKENS" ] ||
  fail "Prometheus returned sum(statescan_tokens_total) = '${got}', expected $EXPECTED_TOKENS"
{ curl -sf --max-time 10 "http://127.0.0.1:$PROM_PORT/api/v1/query" \
    --data-urlencode 'query=statescan_tokens_total' |
    jq -c '.data.result[] | {rank: .metric.rank, variant: .metric.variant, instance: .metric.instance, tokens: .value[1]}'; } ||
  fail "the per-rank statescan_tokens_total query"
step "Prometheus query API: sum(statescan_tokens_total) = $got (expected $EXPECTED_TOKENS)"

# ---- the run ends cleanly when told to stop holding --------------------------------
stop_run statescan-run

# ---- 3. the LaCT job exports too: variant "lact", all-reduce bytes ----------------
LACT_PORT=$((METRICS_PORT + 2))
LACT_T=512
step "mpirun -np 2 statescan-run --variant lact --metrics-port $LACT_PORT"
: >"$WORK/run.log"  # empty before the job starts: the first job's '# Avg' must not count
mpirun -np 2 --oversubscribe "$BUILD/launch/statescan-run" --device cpu --variant lact \
  --seq-len "$LACT_T" --lact-chunk 128 --heads 2 --dk 16 --lact-hidden 32 --warmup "$WARMUP" \
  --iters "$ITERS" --no-check --metrics-port "$LACT_PORT" --metrics-hold 300 >>"$WORK/run.log" 2>&1 &
RUN_PID=$!
wait_for_steps "statescan-run --variant lact"
total=0
for rank in 0 1; do
  port=$((LACT_PORT + rank))
  curl -sf --max-time 10 "http://127.0.0.1:$port/metrics" >"$WORK/lact-rank$rank.txt" ||
    fail "GET :$port/metrics (lact)"
  line=$(grep "^statescan_tokens_total{" "$WORK/lact-rank$rank.txt") ||
    fail "lact rank $rank serves no statescan_tokens_total sample"
  [[ "$line" == *'variant="lact"'* ]] || fail "lact rank $rank: unexpected labels in: $line"
  bytes=$(grep '^statescan_exchange_bytes_total{.*strategy="allreduce"' "$WORK/lact-rank$rank.txt") ||
    fail "lact rank $rank serves no all-reduce bytes"
  [ "${bytes##* }" != 0 ] || fail "lact rank $rank: all-reduce bytes are 0"
  step "lact rank $rank /metrics: $line; $bytes"
  tokens=${line##* }
  total=$((total + ${tokens%.*}))
done
[ "$total" -eq $(((WARMUP + ITERS) * LACT_T)) ] ||
  fail "lact: statescan_tokens_total over the ranks is $total, expected $(((WARMUP + ITERS) * LACT_T))"
stop_run "statescan-run --variant lact"

# ---- 4. with --metrics-hold, SIGTERM during the run still stops the job -----------
# (The hold's handlers for SIGINT / SIGTERM are installed only for the hold: they
# used to be set before the run, which then ignored both until it finished. A
# batch system's stop is SIGTERM; SIGINT cannot be tested so, since a script's
# background jobs start with it ignored.)
INT_PORT=$((METRICS_PORT + 4))
step "statescan-run --metrics-hold 300, SIGTERM during the run"
: >"$WORK/run.log"
"$BUILD/launch/statescan-run" --device cpu --variant kda --seq-len "$SEQ_LEN" --warmup 0 \
  --iters 100000 --no-check --metrics-port "$INT_PORT" --metrics-hold 300 >>"$WORK/run.log" 2>&1 &
RUN_PID=$!
for _ in $(seq 300); do
  curl -sf --max-time 2 "http://127.0.0.1:$INT_PORT/metrics" >/dev/null && break
  kill -0 "$RUN_PID" 2>/dev/null || fail "the interrupted run ended before it was interrupted"
  sleep 0.2
done
kill -TERM "$RUN_PID"
for _ in $(seq 100); do kill -0 "$RUN_PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$RUN_PID" 2>/dev/null && fail "statescan-run kept running 10 s after SIGTERM during its steps"
status=0
wait "$RUN_PID" || status=$?
RUN_PID=""
[ "$status" -eq 143 ] || fail "the interrupted run exited with $status, expected 143 (SIGTERM)"
grep -q '^# Avg' "$WORK/run.log" && fail "the interrupted run finished its steps"
step "SIGTERM during the run ended it (exit $status)"

# ---- 5. a run that fails loading its inputs counts the error and holds ------------
# (Setting up the mixer's device and inputs ran before the error accounting
# once, so such a failure exited at once and no scrape saw it.)
FAIL_PORT=$((METRICS_PORT + 5))
step "statescan-run --load <missing> --metrics-hold 300: errors_total{kind=\"io\"} while it holds"
: >"$WORK/run.log"
"$BUILD/launch/statescan-run" --device cpu --variant kda --load "$WORK/no-such-inputs" \
  --no-check --metrics-port "$FAIL_PORT" --metrics-hold 300 >>"$WORK/run.log" 2>&1 &
RUN_PID=$!
seen=""
for _ in $(seq 300); do
  if curl -sf --max-time 2 "http://127.0.0.1:$FAIL_PORT/metrics" >"$WORK/fail.txt" 2>/dev/null &&
    grep -q '^statescan_errors_total{.*kind="io".*} 1$' "$WORK/fail.txt"; then
    seen=1
    break
  fi
  kill -0 "$RUN_PID" 2>/dev/null || fail "the failing run exited before its error could be scraped"
  sleep 0.2
done
[ -n "$seen" ] || fail "the failing run never served statescan_errors_total{kind=\"io\"} 1"
kill -USR1 "$RUN_PID"
status=0
wait "$RUN_PID" || status=$?
RUN_PID=""
[ "$status" -eq 2 ] || fail "the failing run exited with $status after its hold, expected 2"
grep -q "argument '--load'" "$WORK/run.log" || fail "the failing run did not name --load"
step "the failing run served errors_total{kind=\"io\"} 1 while it held, then exited 2"
step "OK"
