#!/usr/bin/env bash
# Installs what is missing, builds statescan (Release, build/) and runs the
# default job: KDA forward + backward, T = 16384, on two ranks, checked
# against a single-rank run. Extra arguments go to statescan-run, e.g.
#   ./scripts/run-main.sh --variant gla --seq-len 65536 --exchange ring
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup-build.sh

statescan_install_packages
statescan_build
statescan_mpi_env
# --oversubscribe: two ranks must start even on a one-core machine.
exec mpirun -np "${STATESCAN_RANKS:-2}" --oversubscribe \
  "${STATESCAN_BUILD_DIR:-build}/launch/statescan-run" "$@"
