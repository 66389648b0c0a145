#!/usr/bin/env bash
# carry-build.sh TARGET... — build GPU binaries here (no GPU needed) for sm_90a
# and pack them, xz-compressed, into <repo>/build-carry/ (git-ignored), for the GPU
# lending tool's `carry`; on the device machine `build-carry/unpack.sh` puts
# them in /tmp/carry/build-carry (the pack folder's name: two packs unpacked in
# one call keep their binaries apart) and prints that folder, ready to run.
#
# Why: a fresh device machine spends ~2 minutes of its device time building the
# CUDA library; a binary built here runs there in seconds. A test-only call
# (one suite, a gtest filter) then fits in what is left of a session's time.
# The binaries link the CUDA runtime dynamically (the device has the same CUDA
# major version); `carry` takes 64 MiB in all, so one or two binaries a call
# (test_cuda_cp is 98 MB, 42 MB gzipped; xz packs statescan-bench's 102 MB
# into 35 MB where gzip took 44, so that it travels with test_cuda_lact).
#
# Beside the binaries goes entries.sh: every ctest entry that runs one of them
# (tests/CMakeLists.txt's knob entries: STATESCAN_FWD_OUTPUT=kernel through
# the delta-rule cases, and so on), with its environment and filter, so that
# the device runs what `ctest` would without a build tree:
#   build-carry/entries.sh [REGEX]   (entries whose name matches; default all)
# prints one line an entry (passed / skipped counts, or the failures) and
# exits 1 if any failed. Why: a knob entry nobody ran for sessions had been
# failing (test_cuda_cp_output_kernel, fifty-second session), while carried
# binaries were run by hand with the default environment only.
#
# Environment knobs:
#   BUILD_DIR  build folder (default /tmp/statescan-carry-build; configured on
#              first use: Release, CUDA on, MPI off, Prometheus off, tests on;
#              a folder configured with MPI on packs the MPI suites too: this
#              machine's OpenMPI 4.1 and the device's share libmpi.so.40)
#   CARRY_DIR  where the pack goes (default <repo>/build-carry; another
#              build-carry-* folder keeps two packs apart, e.g. base and new
#              binaries for an A/B in back-to-back calls)
#   JOBS       parallel build jobs (default: the CPU count)
#   SHARED=1   the project's libraries shared (BUILD_SHARED_LIBS=ON; default
#              BUILD_DIR /tmp/statescan-carry-build-shared), each packed once
#              beside the binaries that link it. Why: every static test binary
#              holds the kernels' ~100 MB of device code, so test_cuda_cp and
#              test_cuda_backward (66.5 MB packed) did not fit one call's
#              64 MiB with the working tree; shared, the suites are small and the
#              kernels travel once.
# A binary that links a library of the build tree (a shared build) finds it
# beside itself once unpacked: the build must put $ORIGIN in its run paths
# (configured here on first use; a BUILD_DIR without it is refused).
set -euo pipefail

(($# > 0)) || { echo "usage: scripts/carry-build.sh TARGET..." >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
shared=OFF
case "${SHARED:-0}" in
  0) ;;
  1) shared=ON ;;
  *) echo "carry-build: SHARED must be 0 or 1, not '$SHARED'" >&2; exit 2 ;;
esac
default_build=/tmp/statescan-carry-build
[[ $shared == OFF ]] || default_build+=-shared
BUILD=${BUILD_DIR:-$default_build}
CARRY=${CARRY_DIR:-$ROOT/build-carry}
LIMIT=$((64 * 1024 * 1024))

if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  # shellcheck disable=SC2016  # $ORIGIN is for the dynamic loader, not bash
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DSTATESCAN_WITH_CUDA=ON -DSTATESCAN_WITH_MPI=OFF -DSTATESCAN_WITH_PROMETHEUS=OFF \
    -DSTATESCAN_WITH_TESTS=ON -DBUILD_SHARED_LIBS=$shared '-DCMAKE_BUILD_RPATH=$ORIGIN'
elif [[ $shared == ON ]] && ! grep -qiE '^BUILD_SHARED_LIBS:[A-Z]*=(ON|1|TRUE|YES|Y)$' "$BUILD/CMakeCache.txt"; then
  echo "carry-build: SHARED=1, but $BUILD builds static libraries: give a BUILD_DIR" \
    "configured with -DBUILD_SHARED_LIBS=ON, or none (a fresh one is made)" >&2
  exit 1
fi
cmake --build "$BUILD" --target "$@" -j "${JOBS:-$(nproc)}"
build_real=$(realpath "$BUILD")
# The libraries of the build tree that FILE links, directly or not, one a
# line. ldd prints each path as the run path spells it (a symlinked BUILD_DIR,
# a space in it): resolved before comparing.
tree_libs() {
  local path
  ldd "$1" 2>/dev/null | sed -n 's/^[[:space:]]*[^[:space:]]* => \(.*\) (0x[0-9a-f]*)$/\1/p' |
    while IFS= read -r path; do
      path=$(realpath "$path")
      [[ $path == "$build_real"/* ]] && printf '%s\n' "$path"
    done
  return 0
}
# Has FILE a run path whose entry is exactly $ORIGIN (the pack is flat:
# $ORIGIN/../lib would not find what sits beside it)?
origin_runpath() {
  readelf -d "$1" 2>/dev/null | sed -n 's/.*(\(RUNPATH\|RPATH\)).*\[\(.*\)\]$/\2/p' |
    tr ':' '\n' | grep -qxF '$ORIGIN'
}

rm -rf "$CARRY"
mkdir -p "$CARRY"
bins=()  # the packed binaries' paths in the build tree (entries.sh below)
# The one executable named TARGET in the build tree, outside CMakeFiles and
# outside build trees nested in it (a folder with a CMakeCache.txt of its
# own). Why: the first match of a plain find was a stale statescan-bench and
# statescan-run in an old tree moved inside BUILD (bld-shared.away), packed
# in their place for two sessions (sixty-eighth session: "--decode: unknown
# option" on the device, and a run_ring check made with the old launcher).
# Two candidates left are an error naming both, never a guess.
find_binary() {
  local found=()
  mapfile -t found < <(find "$build_real" -mindepth 1 -type d \( -name CMakeFiles -o \
    -exec test -e '{}/CMakeCache.txt' \; \) -prune -o -type f -name "$1" -perm -u+x -print)
  if ((${#found[@]} > 1)); then
    echo "carry-build: ${#found[@]} executables named $1 in $BUILD: ${found[*]}" >&2
    return 1
  fi
  printf '%s\n' "${found[@]}"
}

for target in "$@"; do
  bin=$(find_binary "$target") || exit 1
  bins+=("$bin")
  [[ -n "$bin" ]] || { echo "carry-build: no executable named $target in $BUILD" >&2; exit 1; }
  # The device has no prometheus-cpp (its own builds turn the exporter off):
  # a binary linked against it fails there at load time, every rank of an MPI
  # test with it (statescan-run, fifty-third session).
  # grep reads all of ldd's lines (no -q): under pipefail, ldd killed by SIGPIPE
  # when grep -q quits at its match would turn the match into a miss.
  if ldd "$bin" 2>/dev/null | grep -E 'libprometheus|libcivetweb' >/dev/null; then
    echo "carry-build: $target links prometheus-cpp, which the device lacks: configure" \
      "$BUILD with -DSTATESCAN_WITH_PROMETHEUS=OFF" >&2
    exit 1
  fi
  # Stripped of host symbols and at xz's best (2026-12-06, H100 device: /usr/bin/xz):
  # carry's 64 MiB hold the repository too (statescan-bench 102 MB -> 35.1, gzip -9 44.3;
  # test_cuda_lact -> 15.0, gzip 18.5).
  strip -o "$CARRY/$target" "$bin"
  xz -9 -T0 "$CARRY/$target"
  # The build tree's own libraries it links (a shared build), once a pack.
  # ldd lists the indirect ones too (libstatescan_kernels.so's libstatescan_core.so).
  mapfile -t libs < <(tree_libs "$bin")
  # Every project library it needs must come from this build (not found, or
  # an installed copy, would be missing from the pack on the device).
  while read -r name _ path; do
    path=${path% (0x*}  # "PATH (0xADDRESS)", or "not found"
    [[ $(realpath -e "$path" 2>/dev/null) == "$build_real"/* ]] && continue
    echo "carry-build: $target needs $name from outside $BUILD ($path): not packed" >&2
    exit 1
  done < <(ldd "$bin" 2>/dev/null | grep -E '^[[:space:]]*libstatescan' || true)
  for f in "$bin" ${libs[@]+"${libs[@]}"}; do
    [[ -z $(tree_libs "$f") ]] || origin_runpath "$f" || {
      echo "carry-build: $f links libraries of $BUILD but has no \$ORIGIN run path, so it" \
        "would not find them unpacked: configure $BUILD with -DCMAKE_BUILD_RPATH='\$ORIGIN'" >&2
      exit 1
    }
  done
  for lib in ${libs[@]+"${libs[@]}"}; do
    name=$(basename "$lib")
    [[ -e "$CARRY/$name.xz" ]] && continue
    strip -o "$CARRY/$name" "$lib"
    xz -9 -T0 "$CARRY/$name"
  done
done
# The revision the binaries were built from (a stale pack is easy to carry).
# Outside a git work tree "unknown" (rev-parse fails; the diff alone would
# have written "with uncommitted changes").
if rev=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null); then
  { echo "$rev"
    git -C "$ROOT" diff --quiet HEAD -- . ':!build-carry' 2>/dev/null || echo "with uncommitted changes"
  } >"$CARRY/REVISION"
else
  echo unknown >"$CARRY/REVISION"
fi
# Each binary's path in the build tree: a test may run another binary by the
# path the build baked into it (test_run_cli runs statescan-run so), which
# unpack.sh then links to the unpacked copy.
for i in "${!bins[@]}"; do
  printf '%s %s\n' "$(basename "${bins[$i]}")" "$(realpath "${bins[$i]}")"
done >"$CARRY/PATHS"
cat >"$CARRY/unpack.sh" <<'EOF'
#!/usr/bin/env bash
# Unpacks the binaries beside this script into /tmp/carry/<this folder's name>
# and prints that folder (and, on stderr, the revision they were built from);
# links each binary's build-tree path (PATHS) to its copy where that path is
# free. Why a folder a pack: an A/B unpacks a base and a new pack in one call,
# whose binaries share their names.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
echo "carried binaries built from: $(tr '\n' ' ' <"$here/REVISION")" >&2
dest=/tmp/carry/$(basename "$here")
mkdir -p "$dest"
for packed in "$here"/*.gz "$here"/*.xz; do
  [[ -e "$packed" ]] || continue
  name=$(basename "${packed%.*}")
  # Unpacked already from this very pack: left as it is, so that a binary
  # running meanwhile (another entries.sh) is not rewritten ("Text file busy").
  sum=$(cksum <"$packed")
  [[ -x "$dest/$name" && "$(cat "$dest/.$name.cksum" 2>/dev/null)" == "$sum" ]] && continue
  case "$packed" in
    *.gz) gunzip -c "$packed" >"$dest/$name" ;;
    *.xz) xz -dc "$packed" >"$dest/$name" ;;
  esac
  chmod +x "$dest/$name"
  echo "$sum" >"$dest/.$name.cksum"
done
# A build-tree path is one place: of two packs with the same binary, the one
# unpacked last owns it.
if [[ -f "$here/PATHS" ]]; then
  while read -r name path; do
    [[ -e "$path" && ! -L "$path" ]] && continue  # a real build tree there: leave it
    mkdir -p "$(dirname "$path")" 2>/dev/null && ln -sfn "$dest/$name" "$path" || true
  done <"$here/PATHS"
fi
echo "$dest"
EOF
chmod +x "$CARRY/unpack.sh"

# The ctest entries of the packed binaries (ctest's JSON listing), each as one
# `entry NAME ENV... -- COMMAND...` line, the binary's path replaced by its
# unpacked one; a suite's discovered cases as one entry named after it.
{
  cat <<'EOF'
#!/usr/bin/env bash
# The ctest entries of the binaries beside this script (written by
# scripts/carry-build.sh): entries.sh [REGEX] runs those whose name matches.
# ENTRY_TIMEOUT: seconds an entry (default 600: test_cuda_cp's delta-rule entries
# took ~230 s on an H200, its two-level summary cases 12-27 s each).
# ENTRY_JOBS: entries run at once (default 1). Why: the knob entries of
# test_cuda_cp spend most of their time in the fp64 CPU references at 2 threads
# (STATESCAN_NUM_THREADS=2), so on the device's 16 cores several entries share
# the GPU in the time of one; their lines are printed in the listed order.
# ENTRY_ALLOW_NONE=1: a test_cuda* entry whose cases all skipped passes (by
# default it fails: on the GPU machine that means no device was seen).
set -uo pipefail
# The binaries link the CUDA runtime dynamically (see carry-build.sh).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
here=$(dirname "$0")
# Unpacked once, before any entry starts: a binary rewritten while another
# entry runs it fails with "Text file busy". The entries name their binary as
# @CARRIED@/NAME: this pack's folder under /tmp/carry.
carried=$("$here/unpack.sh") || exit 1
pattern=${1:-.}
jobs_max=${ENTRY_JOBS:-1}
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
count=0
entry() {
  [[ $1 =~ $pattern ]] || return 0
  count=$((count + 1))
  if ((jobs_max > 1)); then
    while (($(jobs -rp | wc -l) >= jobs_max)); do wait -n; done
    run_entry "$@" >"$results/$count" &
  else
    run_entry "$@" | tee "$results/$count"
  fi
}
# Waits for the entries still running, prints their lines in the listed order
# when they ran at once, and exits 1 if any failed.
finish() {
  wait
  local n failed=0
  for ((n = 1; n <= count; n++)); do
    ((jobs_max > 1)) && cat "$results/$n"
    grep -q '^[^ ].*: FAILED' "$results/$n" && failed=1
  done
  ((count > 0)) || { echo "no entry matches '$pattern'"; failed=1; }
  exit "$failed"
}
run_entry() {
  local name=$1 envs=() start=$SECONDS
  shift
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  local cmd=("${@//@CARRIED@/$carried}") log
  # No colour codes, and any left stripped: under mpiexec the ranks write to
  # a pseudo-terminal, so gtest colours its summary lines, which then matched
  # nothing below (every MPI entry read "(none ran)"). MPI entries print one
  # summary a rank: the same counts on every rank read once, "(each of N ranks)".
  log=$(env "${envs[@]}" timeout "${ENTRY_TIMEOUT:-600}" "${cmd[@]}" --gtest_brief=1 --gtest_color=no 2>&1 |
    sed -E $'s/\x1b\\[[0-9;]*m//g')
  local rc=$?
  local counts
  counts=$(grep -E '^\[  (PASSED|SKIPPED) ' <<<"$log" | sed -E 's/^\[  ([A-Z]+) +\] ([0-9]+).*/\2 \1/' |
    tr '[:upper:]' '[:lower:]' | sort -k2,2 -k1,1n | uniq -c |
    awk '{ n = $1; $1 = ""; sub(/^ +/, ""); printf "%s%s ", $0, (n > 1 ? " (each of " n " ranks)" : "") }')
  local none=0
  [[ $counts == *passed* && $counts != "0 passed"* ]] || none=1
  # Every case skipped is no test at all (no GPU, or a filter that matches
  # only cases this build or device cannot run). A CUDA entry that ran none
  # fails: these packs run on a GPU machine, where that means a broken driver
  # or a device the suites do not see (ENTRY_ALLOW_NONE=1 accepts it).
  if ((rc == 0 && none)) && [[ $name == test_cuda* && ${ENTRY_ALLOW_NONE:-0} != 1 ]]; then
    echo "$name: FAILED (no case ran: is a GPU visible?), ${counts:-no gtest summary }($((SECONDS - start)) s)"
  elif ((rc == 0)); then
    ((none)) && counts="$counts(none ran)"
    echo "$name: ok, ${counts:-no gtest summary }($((SECONDS - start)) s)"
  else
    # 124: stopped at the limit, which says nothing of the cases it had not reached.
    local why="exit $rc"
    ((rc == 124)) && why="timed out at ENTRY_TIMEOUT ${ENTRY_TIMEOUT:-600} s"
    echo "$name: FAILED ($why), ${counts:-no gtest summary }($((SECONDS - start)) s)"
    grep -E '^\[  FAILED  \]|Failure|exception' <<<"$log" | head -8 | sed 's/^/    /'
  fi
}
EOF
  (cd "$BUILD" && ctest -N --show-only=json-v1) | python3 -c '
import json, shlex, sys, os
bins = {os.path.realpath(p): os.path.basename(p) for p in sys.argv[1:]}
whole = set()  # binaries whose discovered cases are already one whole-suite entry
def emit(name, env, cmd):
    print(" ".join(["entry", shlex.quote(name)] + [shlex.quote(e) for e in env] + ["--"]
                   + [shlex.quote(c) for c in cmd]))
for t in json.load(sys.stdin).get("tests", []):
    cmd = t.get("command") or []
    hit = [bins[os.path.realpath(c)] for c in cmd if os.path.realpath(c) in bins]
    if not hit:
        continue
    env = []
    for prop in t.get("properties", []):
        if prop["name"] == "ENVIRONMENT":
            env = prop["value"]
    # gtest_discover_tests makes one entry a case (run with
    # --gtest_also_run_disabled_tests): one process for the whole suite instead.
    if "--gtest_also_run_disabled_tests" in cmd:
        if hit[0] not in whole:
            whole.add(hit[0])
            emit(hit[0], env, ["@CARRIED@/" + hit[0]])
        continue
    emit(t["name"], env, ["@CARRIED@/" + bins[os.path.realpath(c)]
                          if os.path.realpath(c) in bins else c for c in cmd])
' "${bins[@]}"
  echo finish
} >"$CARRY/entries.sh"
chmod +x "$CARRY/entries.sh"

total=$(du -cb "$CARRY" | tail -1 | cut -f1)
du -h "$CARRY"/*
if ((total > LIMIT)); then
  echo "carry-build: $CARRY holds $total bytes, over carry's 64 MiB: pack fewer targets" >&2
  exit 1
fi
rel=${CARRY#"$ROOT"/}
echo "carry-build: pass carry=[\"$rel\"]; on the device: export" \
  "LD_LIBRARY_PATH=/usr/local/cuda/lib64:\$LD_LIBRARY_PATH; d=\$($rel/unpack.sh); \$d/TARGET ..." \
  "or $rel/entries.sh [REGEX] for the ctest entries"
