#!/usr/bin/env bash
# configure_smoke.sh SOURCE_DIR — CMake keeps each STATESCAN_WITH_<X> as the
# user's request: a dependency missing at one configure (here prometheus-cpp,
# hidden by CMAKE_DISABLE_FIND_PACKAGE) turns the feature off for that
# configure only (STATESCAN_HAVE_<X> OFF), and the next configure, with the
# package back, builds it again. (The option used to be forced OFF in the
# cache: installing the package and reconfiguring changed nothing.) Skips
# (exit 77) where prometheus-cpp is not installed at all.
set -euo pipefail
SRC=${1:?usage: configure_smoke.sh SOURCE_DIR}
WORK=$(mktemp -d /tmp/statescan-configure.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
have() { grep -q "^STATESCAN_HAVE_$1:INTERNAL=$2\$" "$WORK/build/CMakeCache.txt"; }
configure() {
  cmake -S "$SRC" -B "$WORK/build" -DSTATESCAN_WITH_CUDA=OFF -DSTATESCAN_WITH_MPI=OFF \
    -DSTATESCAN_WITH_TESTS=OFF "$@" >"$WORK/configure.log" 2>&1 ||
    { cat "$WORK/configure.log"; exit 1; }
}

configure
grep -q "^STATESCAN_HAVE_PROMETHEUS:INTERNAL=" "$WORK/build/CMakeCache.txt" ||
  { echo "FAILED: configure wrote no STATESCAN_HAVE_PROMETHEUS"; exit 1; }
# Whether prometheus-cpp is installed, from CMake's own record of the search.
grep -q "^prometheus-cpp_DIR:PATH=.*-NOTFOUND\$" "$WORK/build/CMakeCache.txt" &&
  { echo "configure_smoke: skipped: no prometheus-cpp here"; exit 77; }
have PROMETHEUS ON || { echo "FAILED: prometheus-cpp is installed, STATESCAN_HAVE_PROMETHEUS is not ON"; exit 1; }
rm -rf "$WORK/build"

configure -DCMAKE_DISABLE_FIND_PACKAGE_prometheus-cpp=TRUE
have PROMETHEUS OFF || { echo "FAILED: prometheus-cpp hidden, yet STATESCAN_HAVE_PROMETHEUS is not OFF"; exit 1; }
grep -q "^STATESCAN_WITH_PROMETHEUS:BOOL=ON\$" "$WORK/build/CMakeCache.txt" ||
  { echo "FAILED: the request STATESCAN_WITH_PROMETHEUS was rewritten in the cache"; exit 1; }
grep -q "statescan: PROMETHEUS off: prometheus-cpp not found" "$WORK/configure.log" ||
  { echo "FAILED: configure did not say why the exporter is off"; exit 1; }

configure -UCMAKE_DISABLE_FIND_PACKAGE_prometheus-cpp
have PROMETHEUS ON || { echo "FAILED: reconfiguring with prometheus-cpp back did not find it"; exit 1; }

configure -DSTATESCAN_WITH_PROMETHEUS=OFF
have PROMETHEUS OFF || { echo "FAILED: STATESCAN_WITH_PROMETHEUS=OFF was not honoured"; exit 1; }
echo "configure_smoke: OK"
