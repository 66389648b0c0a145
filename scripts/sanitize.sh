#!/usr/bin/env bash
# sanitize.sh [BUILD_DIR] — the CPU build (no CUDA; MPI and the exporter as
# found) under AddressSanitizer and UndefinedBehaviorSanitizer, and every
# ctest entry run in it; any sanitizer report fails the run. Not part of CI
# (the instrumented build takes ~25 minutes on 2 cores); run it after changes
# to host code that handles memory (the CPU kernels, the CP mixer, the
# launchers' file I/O).
# Leak checking is off: OpenMPI's own allocations (every MPI test, and
# statescan-run under mpirun) would drown it, and test_monitoring leaks its
# exporters on purpose (civetweb's slow shutdown; tests/test_monitoring.cpp).
# The suites without MPI pass it with leaks on (fifty-third session).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-/tmp/statescan-sanitize}
FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTATESCAN_WITH_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}"
export ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
status=0
ctest --test-dir "$BUILD" -j "${JOBS:-$(nproc)}" --no-tests=error >"$BUILD/sanitize.log" 2>&1 || status=1
grep -E "tests passed|tests failed" "$BUILD/sanitize.log" || tail -5 "$BUILD/sanitize.log"
# A report in a child process (statescan-run under mpirun) may not fail its
# test: look for them in every test's output as well.
if grep -m5 -E "runtime error:|ERROR: AddressSanitizer" "$BUILD/Testing/Temporary/LastTest.log"; then
  status=1
fi
((status == 0)) && echo "sanitize: every entry passed, no sanitizer report" || echo "sanitize: FAILED, see $BUILD/sanitize.log"
exit "$status"
