#!/usr/bin/env bash
# carry_build_smoke.sh SCRIPT BUILD_DIR: scripts/carry-build.sh on CI's CPUs
# against this build (a device call must not be the first run of a change to
# it; two of its bugs were found on the device in the fifty-third session):
#   - it packs test_core (and test_comm_mpi in an MPI build) with REVISION,
#     PATHS, unpack.sh and entries.sh;
#   - entries.sh runs test_core's cases and counts them (CPU cases pass here),
#     and an MPI entry's, whose ranks gtest colours under mpiexec; with
#     ENTRY_JOBS=2 it runs entries at once, prints their lines in order and
#     fails if one failed; an entry stopped at ENTRY_TIMEOUT says so; a
#     pattern matching no entry fails;
#   - unpack.sh unpacks into a folder named after the pack's (two packs keep
#     their binaries apart); it links a binary's build-tree path to its copy
#     where that path is free, and leaves a real file there alone; it leaves a
#     copy from the same pack as it is and rewrites one from another;
#   - it refuses a binary linked against prometheus-cpp (where this build
#     links statescan-run against it).
# carry_build_smoke.sh SCRIPT BUILD_DIR shared: SHARED=1 instead, on a small
# shared build of its own (CPU only: test_core and libstatescan_core.so):
#   - a build without $ORIGIN in its run paths is refused, naming the fix;
#   - with it, the library is packed beside test_core, which runs unpacked
#     with the build tree's copy of the library gone;
#   - SHARED=1 on a static BUILD_DIR (BUILD_DIR's) is refused; SHARED=2 is a
#     usage error.
set -euo pipefail
script=$1 build=$2 mode=${3:-static}
out=$(mktemp -d)
# The packs' folder names are unique: unpack.sh writes to /tmp/carry/<name>.
pack=$out/smoke-pack-$$ moved=$out/smoke-moved-$$
trap 'rm -rf "$out" "/tmp/carry/${pack##*/}" "/tmp/carry/${moved##*/}"' EXIT
fail() {
  echo "carry-build smoke: $*"
  exit 1
}

if [[ $mode == shared ]]; then
  root=$(cd "$(dirname "$script")/.." && pwd)
  lib=$out/shared/core/libstatescan_core.so
  # shellcheck disable=SC2016  # $ORIGIN is for the dynamic loader
  configure() {  # configure BUILD_RPATH
    cmake -S "$root" -B "$out/shared" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
      -DSTATESCAN_WITH_CUDA=OFF -DSTATESCAN_WITH_MPI=OFF -DSTATESCAN_WITH_NCCL=OFF \
      -DSTATESCAN_WITH_PROMETHEUS=OFF -DSTATESCAN_WITH_TESTS=ON "-DCMAKE_BUILD_RPATH=$1" \
      >"$out/configure.log" 2>&1 || { cat "$out/configure.log"; fail "configure failed"; }
  }
  configure ""
  SHARED=1 CARRY_DIR=$pack BUILD_DIR=$out/shared JOBS=2 bash "$script" test_core \
    >"$out/norpath.log" 2>&1 && { cat "$out/norpath.log"; fail "packed a shared build without \$ORIGIN"; }
  grep -q 'has no \$ORIGIN run path.*-DCMAKE_BUILD_RPATH=' "$out/norpath.log" ||
    { cat "$out/norpath.log"; fail "the \$ORIGIN refusal does not say why"; }
  configure '$ORIGIN'
  SHARED=1 CARRY_DIR=$pack BUILD_DIR=$out/shared JOBS=2 bash "$script" test_core \
    >"$out/pack.log" 2>&1 || { cat "$out/pack.log"; fail "packing a shared test_core failed"; }
  [[ -s "$pack/libstatescan_core.so.xz" && -s "$pack/test_core.xz" ]] ||
    { ls -la "$pack"; fail "the shared pack lacks test_core or libstatescan_core.so"; }
  # A build tree nested in BUILD (an old one moved there) is not searched:
  # its stale test_core was packed in the real one's place before; a second
  # copy outside any nested tree is refused, both named.
  mkdir -p "$out/shared/old.away/tests" "$out/shared/copy"
  touch "$out/shared/old.away/CMakeCache.txt"
  printf '#!/bin/sh\necho stale\n' >"$out/shared/old.away/tests/test_core"
  chmod +x "$out/shared/old.away/tests/test_core"
  SHARED=1 CARRY_DIR=$out/nested BUILD_DIR=$out/shared JOBS=2 bash "$script" test_core \
    >"$out/nested.log" 2>&1 || { cat "$out/nested.log"; fail "a nested build tree broke packing"; }
  grep -qx "test_core $(realpath "$out/shared/tests/test_core")" "$out/nested/PATHS" ||
    { cat "$out/nested/PATHS"; fail "test_core was not taken from the build tree itself"; }
  cp "$out/shared/tests/test_core" "$out/shared/copy/test_core"
  SHARED=1 CARRY_DIR=$out/twice BUILD_DIR=$out/shared JOBS=2 bash "$script" test_core \
    >"$out/twice.log" 2>&1 && { cat "$out/twice.log"; fail "packed one of two test_core copies"; }
  grep -q "2 executables named test_core in .*copy/test_core" "$out/twice.log" ||
    { cat "$out/twice.log"; fail "two copies: the refusal does not name them"; }
  rm -r "$out/shared/old.away" "$out/shared/copy"
  [[ -f "$lib" ]] || fail "no $lib: is the build shared?"
  # Through a symlink to the build (ldd then spells the library's path so).
  ln -s "$out/shared" "$out/shared-link"
  SHARED=1 CARRY_DIR=$out/linked BUILD_DIR=$out/shared-link JOBS=2 bash "$script" test_core \
    >"$out/linked.log" 2>&1 || { cat "$out/linked.log"; fail "packing through a symlinked BUILD_DIR failed"; }
  [[ -s "$out/linked/libstatescan_core.so.xz" ]] || fail "a symlinked BUILD_DIR: the library was left out"
  rm "$lib"  # from here the unpacked test_core can find only the unpacked library
  carried=$(bash "$pack/unpack.sh" 2>/dev/null)
  "$carried/test_core" --gtest_brief=1 >"$out/run.log" 2>&1 ||
    { cat "$out/run.log"; fail "the unpacked test_core did not run beside its library"; }
  bash "$pack/entries.sh" '^test_core$' >"$out/entries.log" 2>&1 ||
    { cat "$out/entries.log"; fail "test_core's entry failed in the shared pack"; }
  if ! grep -qiE '^BUILD_SHARED_LIBS:[A-Z]*=(ON|1|TRUE|YES|Y)$' "$build/CMakeCache.txt"; then
    SHARED=1 CARRY_DIR=$out/static BUILD_DIR=$build bash "$script" test_core >"$out/static.log" 2>&1 &&
      fail "SHARED=1 packed from a static build"
    grep -q "builds static libraries" "$out/static.log" || { cat "$out/static.log"; fail "no reason given"; }
  fi
  rc=0
  SHARED=2 bash "$script" test_core >"$out/usage.log" 2>&1 || rc=$?
  ((rc == 2)) && grep -q "SHARED must be 0 or 1" "$out/usage.log" ||
    { cat "$out/usage.log"; fail "SHARED=2: exit $rc"; }
  # No BUILD_DIR: the default folder of each mode (a stub cmake records the
  # build it is asked for and stops the script there).
  mkdir -p "$out/stub"
  printf '#!/bin/sh\necho "$*" >>"%s"\ncase "$1" in --build) exit 1 ;; esac\n' "$out/cmake.args" \
    >"$out/stub/cmake"
  chmod +x "$out/stub/cmake"
  for want in "0 /tmp/statescan-carry-build" "1 /tmp/statescan-carry-build-shared"; do
    : >"$out/cmake.args"
    env -u BUILD_DIR PATH="$out/stub:$PATH" SHARED=${want%% *} CARRY_DIR=$out/default \
      bash "$script" test_core >"$out/default.log" 2>&1 || true
    grep -qx -- "--build ${want#* } --target test_core -j [0-9]*" "$out/cmake.args" ||
      { cat "$out/default.log" "$out/cmake.args"; fail "SHARED=${want%% *} without BUILD_DIR: not ${want#* }"; }
  done
  echo "carry-build smoke: ok (shared)"
  exit 0
fi

targets=(test_core)
mpi=0
if grep -q "STATESCAN_HAVE_MPI:INTERNAL=ON" "$build/CMakeCache.txt" && command -v mpiexec >/dev/null; then
  targets+=(test_comm_mpi)
  mpi=1
fi
CARRY_DIR=$pack BUILD_DIR=$build JOBS=1 bash "$script" "${targets[@]}" >"$out/pack.log" 2>&1 ||
  { cat "$out/pack.log"; fail "packing ${targets[*]} failed"; }
for f in REVISION PATHS entries.sh unpack.sh "${targets[@]/%/.xz}"; do
  [[ -s "$pack/$f" ]] || fail "the pack lacks $f"
done
core=$(realpath "$(find "$build" -type f -name test_core -perm -u+x | head -1)")
grep -qx "test_core $core" "$pack/PATHS" || { cat "$pack/PATHS"; fail "PATHS lacks test_core's path"; }
bash -n "$pack/entries.sh"

# entries.sh: the suite's cases as one entry, counted.
bash "$pack/entries.sh" '^test_core$' >"$out/entries.log" 2>&1 || { cat "$out/entries.log"; fail "test_core's entry failed"; }
grep -qE '^test_core: ok, [1-9][0-9]* passed' "$out/entries.log" || { cat "$out/entries.log"; fail "test_core's cases were not counted"; }
if ((mpi)); then
  bash "$pack/entries.sh" '^test_comm_mpi_np2$' >"$out/mpi.log" 2>&1 || { cat "$out/mpi.log"; fail "test_comm_mpi_np2 failed"; }
  grep -qE '^test_comm_mpi_np2: ok, [1-9][0-9]* passed \(each of 2 ranks\)' "$out/mpi.log" ||
    { cat "$out/mpi.log"; fail "test_comm_mpi_np2's two ranks' cases were not counted"; }
  ! grep -q "none ran" "$out/mpi.log" || { cat "$out/mpi.log"; fail "an MPI entry read '(none ran)'"; }
fi

# ENTRY_JOBS: entries at once, their lines in the listed order; a failed
# entry among them makes the script fail; a pattern matching none is an error.
cp "$pack/entries.sh" "$pack/entries-fail.sh"
sed -i 's/^finish$/entry zz_fails -- false\nfinish/' "$pack/entries-fail.sh"
ENTRY_JOBS=2 bash "$pack/entries-fail.sh" '^test_core$|^zz_fails$' >"$out/jobs.log" 2>&1 &&
  { cat "$out/jobs.log"; fail "entries.sh passed with a failed entry run at once"; }
[[ "$(grep -oE '^[a-z_]+: (ok|FAILED)' "$out/jobs.log" | tr '\n' ' ')" == "test_core: ok zz_fails: FAILED " ]] ||
  { cat "$out/jobs.log"; fail "ENTRY_JOBS=2 did not print both entries' lines in order"; }
sed -i 's/^entry zz_fails -- false$/entry zz_slow -- bash -c "sleep 5"/' "$pack/entries-fail.sh"
ENTRY_TIMEOUT=1 bash "$pack/entries-fail.sh" '^zz_slow$' >"$out/slow.log" 2>&1 &&
  { cat "$out/slow.log"; fail "entries.sh passed an entry stopped at its limit"; }
grep -q '^zz_slow: FAILED (timed out at ENTRY_TIMEOUT 1 s)' "$out/slow.log" ||
  { cat "$out/slow.log"; fail "an entry stopped at its limit does not say so"; }
# A CUDA entry whose cases all skipped (no device seen) fails, unless
# ENTRY_ALLOW_NONE=1; a CPU entry that ran none still reads "(none ran)".
sed -i 's/^entry zz_slow -- .*$/entry test_cuda_zz -- bash -c "echo \\"[  SKIPPED ] 3 tests\\""/' \
  "$pack/entries-fail.sh"
bash "$pack/entries-fail.sh" '^test_cuda_zz$' >"$out/skipped.log" 2>&1 &&
  { cat "$out/skipped.log"; fail "entries.sh passed a CUDA entry whose cases all skipped"; }
grep -q '^test_cuda_zz: FAILED (no case ran' "$out/skipped.log" ||
  { cat "$out/skipped.log"; fail "a CUDA entry that ran no case does not say so"; }
ENTRY_ALLOW_NONE=1 bash "$pack/entries-fail.sh" '^test_cuda_zz$' >"$out/allowed.log" 2>&1 ||
  { cat "$out/allowed.log"; fail "ENTRY_ALLOW_NONE=1 did not accept a CUDA entry that ran none"; }
grep -q '^test_cuda_zz: ok, 3 skipped (none ran)' "$out/allowed.log" ||
  { cat "$out/allowed.log"; fail "ENTRY_ALLOW_NONE=1: the entry's line is wrong"; }
bash "$pack/entries.sh" '^no_such_entry$' >"$out/none.log" 2>&1 &&
  { cat "$out/none.log"; fail "entries.sh passed a pattern that matches no entry"; }
grep -q "no entry matches" "$out/none.log" || { cat "$out/none.log"; fail "no reason for matching none"; }

# unpack.sh: a free build-tree path becomes a link to the copy; a real file stays.
cp -r "$pack" "$moved"
mkdir -p "$out/tree/taken"
echo real >"$out/tree/taken/test_core"
printf 'test_core %s\n' "$out/tree/free/tests/test_core" >"$moved/PATHS"
carry=$(bash "$moved/unpack.sh" 2>/dev/null)
[[ "$carry" == "/tmp/carry/${moved##*/}" ]] || fail "unpack.sh unpacked into $carry, not /tmp/carry/${moved##*/}"
[[ "$(readlink "$out/tree/free/tests/test_core")" == "$carry/test_core" ]] ||
  fail "unpack.sh did not link the free build-tree path"
# Two packs unpacked one after the other keep their binaries apart (an A/B in
# one call): the first pack's copy is not the second's.
first=$(bash "$pack/unpack.sh" 2>/dev/null)
[[ "$first" != "$carry" && -x "$first/test_core" && -x "$carry/test_core" ]] ||
  fail "two packs unpacked into one folder ($first, $carry)"
# unpack.sh again from the same pack leaves the copy alone (an entry may be
# running it); from another pack it writes it again.
touch -d @946684800 "$carry/test_core"
bash "$moved/unpack.sh" >/dev/null 2>&1
[[ "$(stat -c %Y "$carry/test_core")" == 946684800 ]] || fail "unpack.sh rewrote a binary unpacked from the same pack"
echo other >"$carry/.test_core.cksum"
bash "$moved/unpack.sh" >/dev/null 2>&1
[[ "$(stat -c %Y "$carry/test_core")" != 946684800 ]] || fail "unpack.sh kept a binary from another pack"
printf 'test_core %s\n' "$out/tree/taken/test_core" >"$moved/PATHS"
bash "$moved/unpack.sh" >/dev/null 2>&1
[[ ! -L "$out/tree/taken/test_core" && "$(cat "$out/tree/taken/test_core")" == real ]] ||
  fail "unpack.sh replaced a real file at a build-tree path"

# The exporter: the device has no prometheus-cpp.
run=$(find "$build" -type f -name statescan-run -perm -u+x | head -1)
if [[ -n "$run" ]] && ldd "$run" 2>/dev/null | grep libprometheus >/dev/null; then
  if CARRY_DIR=$out/refused BUILD_DIR=$build JOBS=1 bash "$script" statescan-run >"$out/refused.log" 2>&1; then
    fail "packed a statescan-run linked against prometheus-cpp"
  fi
  grep -q "links prometheus-cpp, which the device lacks" "$out/refused.log" ||
    { cat "$out/refused.log"; fail "the refusal does not say why"; }
fi
echo "carry-build smoke: ok (${targets[*]})"
