#!/usr/bin/env bash
# kernel-probe.sh NAME=FILE.cu ... — A/B probes of the fused LaCT kernels for a
# device call: each FILE.cu is a variant of kernels/cuda/lact_hidden.cu (the
# file itself for the baseline); each is compiled with the flags that matter
# to the library's CUDA files (-O3, sm_90a, its two defines; a copy here, as
# the build folder's generator files differ between Make and Ninja), linked
# with scripts/probe/lact_hidden_probe.cu against that build's libraries into
# probe_NAME, and packed (xz) into <repo>/build-probe/ (git-
# ignored) with run.sh, which unpacks them on the device and runs every probe
# in every mode of MODES, alternating, REPEAT times:
#   run({command: "build-probe/run.sh", carry: ["build-probe"]})
# A probe is ~0.4 MB packed: a dozen variants and the two carried binaries
# (scripts/carry-build.sh) fit in one call. PERF_NOTES (fiftieth session)
# has the first such comparison.
#
# Environment knobs:
#   BUILD_DIR  a configured CUDA build (default /tmp/statescan-carry-build, as
#              scripts/carry-build.sh), whose statescan_kernels and
#              statescan_core libraries are built here if missing
#   MODES      probe modes (default "grad"; also key, apply_backward)
#   DS         D values (default "256")
#   REPEAT     rounds over the probes (default 2)
#   PROBE_DIR  where the probes go (default <repo>/build-probe)
#   EXTRA_INC  an include folder searched before the repository (a variant of
#              a header, e.g. kernels/cuda/lact_math.cuh, for every probe)
#   LIBS_AS_BUILT=1  link the build's libraries as they are, without
#              rebuilding them first (a header change that only the variants
#              use, e.g. a new device helper, would otherwise rebuild every
#              kernel that includes the header: ~20 minutes on 2 cores)
set -euo pipefail

(($# > 0)) || { echo "usage: scripts/kernel-probe.sh NAME=FILE.cu ..." >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-/tmp/statescan-carry-build}
OUTDIR=${PROBE_DIR:-$ROOT/build-probe}
for spec in "$@"; do
  name=${spec%%=*} file=${spec#*=}
  [[ "$name" != "$spec" && "$name" =~ ^[A-Za-z0-9_]+$ && -f "$file" ]] ||
    { echo "kernel-probe: '$spec' is not NAME=FILE.cu with a plain NAME and an existing FILE" >&2; exit 2; }
done
[[ -f "$BUILD/CMakeCache.txt" ]] || { echo "kernel-probe: $BUILD is not a configured build (scripts/carry-build.sh configures one)" >&2; exit 1; }
ARCH=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$BUILD/CMakeCache.txt")
[[ "$ARCH" == 90a ]] || { echo "kernel-probe: $BUILD is built for '$ARCH', the fused kernels need 90a" >&2; exit 1; }
[[ "${LIBS_AS_BUILT:-0}" == 1 ]] ||
  cmake --build "$BUILD" --target statescan_kernels statescan_core -j "${JOBS:-$(nproc)}" >/dev/null
KERNELS=$(find "$BUILD" -name libstatescan_kernels.a | head -1)
CORE=$(find "$BUILD" -name libstatescan_core.a | head -1)
if [[ -z "$KERNELS" || -z "$CORE" ]]; then
  # The probes run on the device without the build tree: static libraries only.
  if grep -Eq "^BUILD_SHARED_LIBS:[A-Z]*=(ON|1|TRUE|YES)$" "$BUILD/CMakeCache.txt"; then
    echo "kernel-probe: $BUILD builds shared libraries; the probes travel alone and" \
      "link the static ones (configure another BUILD_DIR without BUILD_SHARED_LIBS)" >&2
  else
    echo "kernel-probe: no statescan_kernels / statescan_core in $BUILD" >&2
  fi
  exit 1
fi
FLAGS=(-O3 -DNDEBUG -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a
       -DSTATESCAN_CUDA_SM90A=1 -DSTATESCAN_HAS_CUDA=1)
INC=(-I"$ROOT")
[[ -z "${EXTRA_INC:-}" ]] || INC=(-I"$EXTRA_INC" "${INC[@]}")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

nvcc "${FLAGS[@]}" "${INC[@]}" -c "$ROOT/scripts/probe/lact_hidden_probe.cu" -o "$WORK/main.o"
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"
names=()
for spec in "$@"; do
  name=${spec%%=*} file=${spec#*=}
  # The variant compiled from the repository root's include path, as the
  # library's own copy is: its relative includes resolve the same way.
  nvcc "${FLAGS[@]}" "${INC[@]}" -c "$file" -o "$WORK/$name.o"
  nvcc -gencode arch=compute_90a,code=sm_90a "$WORK/main.o" "$WORK/$name.o" "$KERNELS" "$CORE" \
    -lcuda -o "$WORK/probe_$name"
  xz -9 -c "$WORK/probe_$name" >"$OUTDIR/probe_$name.xz"
  names+=("$name")
done
cat >"$OUTDIR/run.sh" <<RUN
#!/usr/bin/env bash
# Written by scripts/kernel-probe.sh: unpacks the probes and runs them,
# alternating, REPEAT times.
set -uo pipefail
cd "\$(dirname "\$0")"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-}
# Exits 1 if any unpacking or probe failed (not only the last probe's status).
rc=0
for p in probe_*.xz; do xz -dc "\$p" >"/tmp/\${p%.xz}" && chmod +x "/tmp/\${p%.xz}" || rc=1; done
for r in \$(seq ${REPEAT:-2}); do
  for mode in ${MODES:-grad}; do for d in ${DS:-256}; do for name in ${names[*]}; do
    "/tmp/probe_\$name" "\$mode" "\$d" "\$name" || { echo "probe_\$name \$mode \$d failed"; rc=1; }
  done; done; done
done
exit \$rc
RUN
chmod +x "$OUTDIR/run.sh"
du -sh "$OUTDIR"
echo "kernel-probe: pass carry=[\"build-probe\"] and run build-probe/run.sh"
