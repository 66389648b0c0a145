#!/usr/bin/env bash
# carry-build.sh TARGET... — build GPU binaries here (no GPU needed) for sm_90a
# and pack them, xz-compressed, into <repo>/build-carry/ (git-ignored), for the GPU
# lending tool's `carry`; on the device machine `build-carry/unpack.sh` puts
# them in /tmp/carry (and prints that folder), ready to run.
#
# Why: a fresh device machine spends ~2 minutes of its device time building the
# CUDA library; a binary built here runs there in seconds. A test-only call
# (one suite, a gtest filter) then fits in what is left of a session's time.
# The binaries link the CUDA runtime dynamically (the device has the same CUDA
# major version); `carry` takes 64 MiB in all, so one or two binaries a call
# (test_cuda_cp is 98 MB, 42 MB gzipped; xz packs statescan-bench's 102 MB
# into 35 MB where gzip took 44, so that it travels with test_cuda_lact).
#
# Environment knobs:
#   BUILD_DIR  build folder (default /tmp/statescan-carry-build; configured on
#              first use: Release, CUDA on, MPI off, tests on)
#   JOBS       parallel build jobs (default: the CPU count)
set -euo pipefail

(($# > 0)) || { echo "usage: scripts/carry-build.sh TARGET..." >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-/tmp/statescan-carry-build}
CARRY=$ROOT/build-carry
LIMIT=$((64 * 1024 * 1024))

if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DSTATESCAN_WITH_CUDA=ON -DSTATESCAN_WITH_MPI=OFF -DSTATESCAN_WITH_TESTS=ON
fi
cmake --build "$BUILD" --target "$@" -j "${JOBS:-$(nproc)}"

rm -rf "$CARRY"
mkdir -p "$CARRY"
for target in "$@"; do
  bin=$(find "$BUILD" -type f -name "$target" -perm -u+x | head -1)
  [[ -n "$bin" ]] || { echo "carry-build: no executable named $target in $BUILD" >&2; exit 1; }
  # Stripped of host symbols and at xz's best (2026-12-06, H100 device: /usr/bin/xz):
  # carry's 64 MiB hold the repository too (statescan-bench 102 MB -> 35.1, gzip -9 44.3;
  # test_cuda_lact -> 15.0, gzip 18.5).
  strip -o "$CARRY/$target" "$bin"
  xz -9 -T0 "$CARRY/$target"
done
# The revision the binaries were built from (a stale pack is easy to carry).
{ git -C "$ROOT" rev-parse --short HEAD
  git -C "$ROOT" diff --quiet HEAD -- . ':!build-carry' || echo "with uncommitted changes"
} >"$CARRY/REVISION" 2>/dev/null || echo unknown >"$CARRY/REVISION"
cat >"$CARRY/unpack.sh" <<'EOF'
#!/usr/bin/env bash
# Unpacks the binaries beside this script into /tmp/carry and prints that
# folder (and, on stderr, the revision they were built from).
set -euo pipefail
echo "carried binaries built from: $(tr '\n' ' ' <"$(dirname "$0")/REVISION")" >&2
mkdir -p /tmp/carry
for packed in "$(dirname "$0")"/*.gz "$(dirname "$0")"/*.xz; do
  [[ -e "$packed" ]] || continue
  name=$(basename "${packed%.*}")
  case "$packed" in
    *.gz) gunzip -c "$packed" >"/tmp/carry/$name" ;;
    *.xz) xz -dc "$packed" >"/tmp/carry/$name" ;;
  esac
  chmod +x "/tmp/carry/$name"
done
echo /tmp/carry
EOF
chmod +x "$CARRY/unpack.sh"

total=$(du -cb "$CARRY" | tail -1 | cut -f1)
du -h "$CARRY"/*
if ((total > LIMIT)); then
  echo "carry-build: $CARRY holds $total bytes, over carry's 64 MiB: pack fewer targets" >&2
  exit 1
fi
echo "carry-build: pass carry=[\"build-carry\"]; on the device: export" \
  "LD_LIBRARY_PATH=/usr/local/cuda/lib64:\$LD_LIBRARY_PATH; d=\$(build-carry/unpack.sh); \$d/TARGET ..."
