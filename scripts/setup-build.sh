#!/usr/bin/env bash
# Shared by run-main.sh and run-tests.sh (source it, do not run it):
# installs the build dependencies that are missing (Debian/Ubuntu, apt-get),
# then configures build/ in Release and builds everything.
#
#   STATESCAN_BUILD_DIR   build directory            (default: build)
#   STATESCAN_CMAKE_ARGS  extra arguments for cmake  (e.g. -DSTATESCAN_WITH_CUDA=OFF)

STATESCAN_PACKAGES=(cmake g++ make openmpi-bin libopenmpi-dev libgtest-dev)

statescan_install_packages() {
  local missing=()
  if command -v dpkg-query >/dev/null 2>&1; then
    local pkg
    for pkg in "${STATESCAN_PACKAGES[@]}"; do
      if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
      fi
    done
  fi
  if [ "${#missing[@]}" -eq 0 ]; then
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "statescan: missing packages (${missing[*]}) and no apt-get; install them by hand" >&2
    return 1
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "statescan: need root or sudo to install: ${missing[*]}" >&2
      return 1
    fi
    sudo=(sudo)
  fi
  echo "statescan: installing ${missing[*]}"
  "${sudo[@]}" apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    "${missing[@]}"
}

statescan_build() {
  local build_dir="${STATESCAN_BUILD_DIR:-build}"
  # CUDA, NCCL and Prometheus are auto-detected by CMake (see CMakeLists.txt).
  # shellcheck disable=SC2086
  cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release ${STATESCAN_CMAKE_ARGS:-}
  cmake --build "$build_dir" -j"$(nproc)"
}

# mpirun refuses to start as root unless told that it is intended
# (containers and CI runners usually are root).
statescan_mpi_env() {
  if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
}
