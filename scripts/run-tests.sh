#!/usr/bin/env bash
# Installs what is missing, builds statescan (Release, build/) and runs every
# test suite with ctest (MPI suites run under mpirun with 2-4 ranks; GPU
# suites skip themselves where there is no GPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup-build.sh

# prometheus-cpp-dev: the metrics exporter is built and its HTTP tests run;
# gnuplot-nox: the benchmark plot test draws a real PNG.
STATESCAN_PACKAGES+=(prometheus-cpp-dev gnuplot-nox)
statescan_install_packages
statescan_build
statescan_mpi_env
ctest --test-dir "${STATESCAN_BUILD_DIR:-build}" --output-on-failure -j2
