#!/usr/bin/env bash
# Installs what is missing, builds statescan (Release, build/) and runs every
# test suite with ctest (MPI suites run under mpirun with 2-4 ranks; GPU
# suites skip themselves where there is no GPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup-build.sh

# prometheus-cpp-dev: the metrics exporter is built and its HTTP tests run;
# gnuplot-nox: the benchmark plot test draws a real PNG; python3: the
# multi-GPU script's smoke test (its summary tables) runs on CI's CPUs too;
# xz-utils: scripts/kernel-probe.sh packs its probes with xz (its smoke test).
STATESCAN_PACKAGES+=(prometheus-cpp-dev gnuplot-nox python3 xz-utils)
statescan_install_packages
statescan_build
statescan_mpi_env
# No tests registered (a build folder configured with STATESCAN_WITH_TESTS=OFF,
# or GoogleTest not found) is a failure, not a pass.
ctest --test-dir "${STATESCAN_BUILD_DIR:-build}" --output-on-failure --no-tests=error -j2
