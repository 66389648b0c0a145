#!/usr/bin/env bash
# Installs what is missing, builds statescan (Release, build/) and runs every
# test suite with ctest (MPI suites run under mpirun with 2-4 ranks; GPU
# suites skip themselves where there is no GPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup-build.sh

statescan_install_packages
statescan_build
statescan_mpi_env
ctest --test-dir "${STATESCAN_BUILD_DIR:-build}" --output-on-failure -j2
