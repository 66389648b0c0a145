#!/usr/bin/env bash
# CI: the installed package from a consumer's side. Builds statescan, installs
# it into a temporary prefix, builds examples/cp_consumer against that prefix
# with find_package(statescan) (nothing from the source tree), and runs its
# two programs under `mpirun -np 2`: cp_consumer (CP forward + backward on each
# rank's shard, checked against a single-rank run, with the metrics exporter
# serving on loopback) and lact_consumer (a LaCT layer with every chunk sharded
# over the ranks, checked the same way).
# Exits non-zero on any failure.
#
#   STATESCAN_BUILD_DIR   reuse this build directory (e.g. build/ after
#                         run-tests.sh) instead of a fresh one
#   STATESCAN_CMAKE_ARGS  extra configure arguments for a fresh build
#   CI_WORK_DIR           where the prefix and the consumer build go (default: a temp dir)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
source scripts/setup-build.sh

# prometheus-cpp-dev: the installed package must carry its find_dependency.
STATESCAN_PACKAGES+=(prometheus-cpp-dev)
statescan_install_packages
statescan_mpi_env

if [ -n "${CI_WORK_DIR:-}" ]; then
  WORK=$CI_WORK_DIR
else
  # A temp dir of its own: removed after a pass, kept (with its logs) after a failure.
  WORK=$(mktemp -d /tmp/statescan-consumer.XXXXXX)
  trap 'rc=$?; if [ "$rc" -eq 0 ]; then rm -rf "$WORK"; else echo "ci-consumer: logs kept in $WORK" >&2; fi' EXIT
fi
mkdir -p "$WORK"
PREFIX=$WORK/prefix
# A reused CI_WORK_DIR must not lend this run an earlier install (a header
# the new install forgot would still be found) or copy of the consumer.
rm -rf "$PREFIX" "$WORK/cp_consumer" "$WORK/consumer-build"
step() { echo "ci-consumer: $*"; }
fail() { echo "ci-consumer: FAILED: $*" >&2; exit 1; }

if [ -n "${STATESCAN_BUILD_DIR:-}" ]; then
  BUILD=$STATESCAN_BUILD_DIR
  # The cache may say Prometheus OFF from before prometheus-cpp-dev was
  # installed: ask CMake to look again.
  cmake -S "$ROOT" -B "$BUILD" -DSTATESCAN_WITH_PROMETHEUS=ON -DSTATESCAN_WITH_MPI=ON \
    >"$WORK/configure.log" 2>&1 ||
    { tail -30 "$WORK/configure.log"; fail "configure of $BUILD"; }
else
  BUILD=$WORK/build
  # shellcheck disable=SC2086
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DSTATESCAN_WITH_TESTS=OFF \
    ${STATESCAN_CMAKE_ARGS:-} >"$WORK/configure.log" 2>&1 ||
    { tail -30 "$WORK/configure.log"; fail "configure of $BUILD"; }
fi
grep -q '^STATESCAN_HAVE_PROMETHEUS:INTERNAL=ON' "$BUILD/CMakeCache.txt" ||
  fail "prometheus-cpp was not found by CMake although prometheus-cpp-dev is installed"
grep -q '^STATESCAN_HAVE_MPI:INTERNAL=ON' "$BUILD/CMakeCache.txt" ||
  fail "MPI was not found by CMake although OpenMPI is installed (see $WORK/configure.log)"

step "building statescan in $BUILD"
cmake --build "$BUILD" -j"$(nproc)" >"$WORK/build.log" 2>&1 ||
  { tail -40 "$WORK/build.log"; fail "build of statescan"; }

step "installing into $PREFIX"
cmake --install "$BUILD" --prefix "$PREFIX" >"$WORK/install.log" 2>&1 ||
  { tail -20 "$WORK/install.log"; fail "cmake --install"; }
for f in include/statescan/core/error.h include/statescan/parallel/cp_mixer.h \
         include/statescan/parallel/lact_layer.h include/statescan/kernels/cpu/lact.h \
         include/statescan/comm/mpi_communicator.h include/statescan/monitoring/metrics_exporter.h \
         lib/cmake/statescan/statescanConfig.cmake lib/cmake/statescan/statescanTargets.cmake; do
  [ -f "$PREFIX/$f" ] || fail "the install lacks $f"
done
# The modules' private headers (pieces their own sources share) stay out.
# No `| head` under pipefail: find killed by SIGPIPE would end the script
# (set -e) before the message below.
leaked=$(find "$PREFIX/include/statescan" -name '*_internal.h' -print -quit)
[ -z "$leaked" ] || fail "the install carries private headers: $leaked"

step "building examples/cp_consumer against the installed package"
# A copy outside the source tree: the consumer must not see the sources.
cp -r "$ROOT/examples/cp_consumer" "$WORK/cp_consumer"
cmake -S "$WORK/cp_consumer" -B "$WORK/consumer-build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PREFIX" >"$WORK/consumer-configure.log" 2>&1 ||
  { cat "$WORK/consumer-configure.log"; fail "find_package(statescan) from $PREFIX"; }
cmake --build "$WORK/consumer-build" -j"$(nproc)" >"$WORK/consumer-build.log" 2>&1 ||
  { tail -40 "$WORK/consumer-build.log"; fail "build of examples/cp_consumer"; }

# Ports for the two ranks' exporters: PORT and PORT + 1 (scripts/ci-ports.sh).
source scripts/ci-ports.sh
PORT=${CI_METRICS_PORT:-$(ci_free_port_base 20000 30000 2)}
step "running: mpirun -np 2 cp_consumer --metrics-port $PORT"
set +e
timeout 300 mpirun -np 2 --oversubscribe "$WORK/consumer-build/cp_consumer" --metrics-port "$PORT" \
  2>&1 | tee "$WORK/consumer-run.log"
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || fail "cp_consumer exited with $status"
grep -q '^check: .* ok$' "$WORK/consumer-run.log" || fail "cp_consumer printed no passing check"
grep -q '^exposition: statescan_tokens_total{' "$WORK/consumer-run.log" ||
  fail "cp_consumer printed no statescan_tokens_total"

step "running: mpirun -np 2 lact_consumer"
set +e
timeout 300 mpirun -np 2 --oversubscribe "$WORK/consumer-build/lact_consumer" 2>&1 |
  tee "$WORK/lact-run.log"
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || fail "lact_consumer exited with $status"
grep -q '^check: .* ok$' "$WORK/lact-run.log" || fail "lact_consumer printed no passing check"
step "OK (installed package at $PREFIX, consumer in $WORK/consumer-build)"
