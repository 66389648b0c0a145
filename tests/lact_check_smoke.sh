#!/usr/bin/env bash
# lact_check_smoke.sh LACT_CHECK — scripts/lact-check.sh runs only where a GPU
# is lent, for minutes that are counted; this drives it on CI's machine with
# stub cmake, nvidia-smi, ncu and cuobjdump binaries first on PATH, so that a
# broken control flow (a row that reads the wrong log, the reference's rows
# running this tree's binary, a build failure that does not stop the script)
# shows here instead of in a device call. The stub statescan-bench prints a
# benchmark table whose fwd ms names the binary that ran (1 = this tree, 2 =
# the reference) and the row's position in the run.
set -uo pipefail

SCRIPT=${1:?usage: lact_check_smoke.sh path/to/lact-check.sh}
WORK=$(mktemp -d /tmp/statescan-lact-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
STUBS=$WORK/bin
mkdir -p "$STUBS" "$WORK/ref-src"
fail() { echo "lact_check_smoke: $*"; exit 1; }

# cmake -S SRC -B DIR ... configures; cmake --build DIR ... builds a stub
# statescan-bench into DIR (FAIL_BUILD=DIR makes that build fail).
cat >"$STUBS/cmake" <<'EOF'
#!/usr/bin/env bash
dir=
while [[ $# -gt 0 ]]; do
  case "$1" in -B | --build) dir=$2; shift ;; esac
  shift
done
[[ -n "$dir" ]] || exit 2
[[ "${FAIL_BUILD:-}" == "$dir" ]] && { echo "stub: build of $dir fails"; exit 1; }
mkdir -p "$dir/launch" "$dir/kernels"
: >"$dir/kernels/lact_hidden.cu.o"
tag=1
[[ "$dir" == *-ref ]] && tag=2
cat >"$dir/launch/statescan-bench" <<EOS
#!/usr/bin/env bash
n=\$(cat "$dir/../count" 2>/dev/null || echo 0); n=\$((n + 1)); echo \$n >"$dir/../count"
echo "# cuBLAS bf16 GEMM 4096^3 700.0 TFLOP/s"
echo "fwd $tag.\$n 1 2 3 53.0 -"
echo "fwd+bwd 9$tag.\$n 1 2 3 53.5 2.00e-03"
EOS
chmod +x "$dir/launch/statescan-bench"
EOF
printf '#!/usr/bin/env bash\nexit 1\n' >"$STUBS/nvidia-smi"
# ncu: records which binary it profiled and whether the cache flush was
# turned off (the CSV is not parsed further here).
printf '#!/usr/bin/env bash\nfor a in "$@"; do [[ "$a" == */statescan-bench ]] && echo "profiled $a"; [[ "$a" == --cache-control ]] && echo "cache flush set"; done\nexit 0\n' \
  >"$STUBS/ncu"
cat >"$STUBS/cuobjdump" <<'EOF'
#!/usr/bin/env bash
echo " Function _ZN9statescan4cuda11lact_detail12_GLOBAL__N_123lact_hidden_grad_kernelENS1_20LactHiddenGradParamsENS2_8GradMapsE:"
echo "  REG:168 STACK:16 SHARED:0 LOCAL:0 CONSTANT[0]:900 TEXTURE:0 SURFACE:0 SAMPLER:0"
EOF
chmod +x "$STUBS"/*
export PATH="$STUBS:$PATH"

# 1. The benchmark rows with a reference: this tree, reference, this tree,
#    reference, in that order, each from its own binary.
out=$(BUILD_DIR="$WORK/build" TESTS=0 MUON=0 KNOBS="" REF_SRC="$WORK/ref-src" \
  bash "$SCRIPT" "$WORK/out1") || fail "exit $? with a reference"
printf '%s\n' "$out"
rows=$(printf '%s\n' "$out" | awk '/^  (default|reference)/ { sub(/,$/, "", $1); print $1, $(NF - 5) }')
expect=$(printf '%s\n' "default 1.1" "reference 2.2" "default 1.3" "reference 2.4")
[[ "$rows" == "$expect" ]] || fail "rows (label, fwd ms) were:"$'\n'"$rows"$'\n'"expected:"$'\n'"$expect"
# Here-strings, not `printf | grep -q`: under pipefail printf's SIGPIPE, when
# grep -q quits at its first match, fails the pipeline at random.
grep -q 'lact_hidden_grad_kernel .*REG:168 STACK:16 LOCAL:0' <<<"$out" ||
  fail "no resource-usage line"
[[ $(printf '%s\n' "$out" | grep -c 'resource usage') == 2 ]] || fail "resource usage not for both trees"

# 2. The kernel tables: this tree's binary first, then the reference's; with
#    NCU_INSITU=1 once more with ncu's cache flush set (to none), only there.
BUILD_DIR="$WORK/build" TESTS=0 MUON=0 KNOBS="" BENCH_ROWS=0 NCU=1 NCU_INSITU=1 \
  REF_SRC="$WORK/ref-src" bash "$SCRIPT" "$WORK/out2" >/dev/null 2>"$WORK/out2.err" ||
  { cat "$WORK/out2.err"; fail "exit $? with NCU=1"; }
grep -qx "profiled $WORK/build/launch/statescan-bench" "$WORK/out2/ncu_kernels.csv" ||
  fail "the kernel table did not profile this tree's binary"
grep -qx "cache flush set" "$WORK/out2/ncu_insitu.csv" ||
  fail "the in-place table did not pass --cache-control"
grep -q "cache flush set" "$WORK/out2/ncu_kernels.csv" &&
  fail "the default kernel table passed --cache-control"
grep -qx "profiled $WORK/build-ref/launch/statescan-bench" "$WORK/out2/ncu_ref.csv" ||
  fail "the reference's kernel table did not profile the reference's binary"

# 3. A failing build stops the script with exit 1 and says which log to read,
#    this tree's and the reference's alike.
for broken in "$WORK/build" "$WORK/build-ref"; do
  if msg=$(FAIL_BUILD="$broken" BUILD_DIR="$WORK/build" TESTS=0 MUON=0 KNOBS="" \
    REF_SRC="$WORK/ref-src" bash "$SCRIPT" "$WORK/out3"); then
    fail "a failing build of $broken was not reported"
  fi
  grep -q "build.*failed, see" <<<"$msg" || fail "no build-failure message for $broken"
done
# 4. Carried binaries (BIN_DIR): nothing is configured or built, the rows
#    come from BIN_DIR's statescan-bench, the suite runs once and once more
#    per SUITE_KNOBS entry with that variable set (a failing rerun fails the
#    script).
BIN=$WORK/carried
mkdir -p "$BIN"
cat >"$BIN/statescan-bench" <<'EOS'
#!/usr/bin/env bash
echo "# cuBLAS bf16 GEMM 4096^3 700.0 TFLOP/s"
echo "fwd 7.${STATESCAN_LACT_STREAMS:-0} 1 2 3 53.0 -"
echo "fwd+bwd 97.0 1 2 3 53.5 2.00e-03"
EOS
cat >"$BIN/test_cuda_lact" <<'EOS'
#!/usr/bin/env bash
echo "[  PASSED  ] 3 tests (filter ${*:-none}, knob ${STATESCAN_LACT_STREAMS:-unset})."
[[ "${STATESCAN_LACT_STREAMS:-}" != 1 ]]
EOS
chmod +x "$BIN"/*
printf '#!/usr/bin/env bash\necho cmake ran >>"%s"\nexit 1\n' "$WORK/cmake_calls" >"$STUBS/cmake"
if out=$(BIN_DIR="$BIN" MUON=0 KNOBS="STATESCAN_LACT_STREAMS=2" \
  SUITE_KNOBS="STATESCAN_LACT_STREAMS=2 STATESCAN_LACT_STREAMS=1" bash "$SCRIPT" "$WORK/out4"); then
  fail "a failing suite rerun under SUITE_KNOBS did not fail the script"
fi
printf '%s\n' "$out"
[[ ! -e "$WORK/cmake_calls" ]] || fail "cmake ran with BIN_DIR set"
grep -q '^suite: .*knob unset' <<<"$out" || fail "no plain suite run"
grep -q '^STATESCAN_LACT_STREAMS=2: .*filter --gtest_filter=\*Bf16\*, knob 2' <<<"$out" ||
  fail "no suite rerun under STATESCAN_LACT_STREAMS=2"
grep -q '^  STATESCAN_LACT_STREAMS=2, no Muon  *7.2 ' <<<"$out" ||
  fail "the knob's row did not come from BIN_DIR's statescan-bench"
grep -q '^  default, no Muon  *7.0 ' <<<"$out" || fail "no default row from BIN_DIR"
# 5. BENCH_ROWS=0 runs no row, the knobs' included, and a reused OUTDIR
#    (out4's, whose rows are above) shows none of the earlier run's rows.
out=$(BIN_DIR="$BIN" TESTS=0 BENCH_ROWS=0 KNOBS="STATESCAN_LACT_STREAMS=2" \
  bash "$SCRIPT" "$WORK/out4") || fail "exit $? with BENCH_ROWS=0"
grep -q 'no Muon' <<<"$out" && fail "BENCH_ROWS=0 printed rows:"$'\n'"$out"
compgen -G "$WORK/out4/bench*.log" >/dev/null && fail "the earlier run's bench logs are still in OUTDIR"
echo "lact_check_smoke: OK"
