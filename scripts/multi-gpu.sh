#!/usr/bin/env bash
# multi-gpu.sh OUTDIR — on one node with >= 2 NVIDIA GPUs: build the multi-GPU
# suites and statescan-run for sm_90a, run the NCCL tests on every GPU, then
# the context-parallel scaling runs of issue 8 (weak: 128K tokens per GPU;
# strong: 1M tokens over P GPUs; LaCT: one 1M-token chunk sharded over P) and
# print one table per study. Logs and JSON rows land in OUTDIR.
#
# Environment knobs:
#   BUILD_DIR   build folder (default <repo>/build-gpu)
#   VARIANTS    CP variants (default "kda gated_deltanet")
#   ITERS       timed steps per run (default 10, after 3 warm-up steps)
#   STUDIES     which scaling studies (default "weak strong lact")
#   EXCHANGES   the exchanges of the weak study (default "auto"; e.g. "auto ring
#               tree": one table each, all against the same P = 1 run)
#   RUN_ARGS    extra statescan-run arguments for every CP run of the weak and
#               strong studies (e.g. "--keep-prepared")
#   SKIP_TESTS=1 leave the test suites out (and their build)
#   PROFILE_LACT=1 after the LaCT study, profile one P = 1 and one P = 2 LaCT run
#               with nsys (where installed): per-kernel and per-API time tables in
#               OUTDIR/nsys_lact_p*.txt, to see what the sharded forward does not halve
#   RUN_TIMEOUT seconds a statescan-run may take (default 300)
# The shapes default to issue 8's; tests/multi_gpu_smoke.sh shrinks them and
# runs the whole script on CI's CPUs (DEVICE=cpu, a stub nvidia-smi, the
# build given by BUILD_DIR with SKIP_BUILD=1), so that the flags it passes and
# the JSON its tables read are checked before a several-GPU machine is lent:
#   DEVICE      statescan-run's --device (default cuda)
#   TOKENS_PER_GPU, STRONG_TOKENS, HEADS, DIM: the weak and strong studies
#               (default 131072, 1048576, 16, 128)
#   LACT_TOKENS, LACT_HEADS, LACT_DIM, LACT_HIDDEN: the LaCT study's one chunk
#               (default 1048576, 4, 256, 512)
#   SKIP_BUILD=1 use BUILD_DIR as it is
#   MODEL_BIN   the statescan-bench whose --cp-model fills the weak tables' model%
#               column from this node's P = 1 run (default: BIN_DIR's or the
#               build's where there; else the summary prints the command line,
#               which any machine runs: the model needs no GPU). A model that
#               fails fails the script, after every table.
#   BIN_DIR     run the binaries in this folder instead of a build's: a pack from
#               scripts/carry-build.sh unpacked on the device (BIN_DIR=$(build-carry-X/
#               unpack.sh)), so that a several-GPU machine, whose minutes count
#               several times, spends none of them building. It needs
#               statescan-run for the studies; a suite that is not there is
#               named and left out (SKIP_TESTS=1 runs none). No build.
#               Packed static, statescan-run, test_comm_nccl and
#               test_cuda_lact_mpi take 49 MB of carry's 64 MiB and
#               test_cuda_cp_mpi (33 MB) needs a call of its own; with
#               carry-build's SHARED=1 all four and statescan-bench take ~36 MB
#               (2026-12-07).
set -uo pipefail

OUT=${1:?usage: scripts/multi-gpu.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build-gpu}
# Where statescan-run and the test suites are: the build's, or BIN_DIR's.
RUN_BIN=$BUILD/launch/statescan-run
TEST_DIR=$BUILD/tests
if [[ -n "${BIN_DIR:-}" ]]; then
  RUN_BIN=$BIN_DIR/statescan-run
  TEST_DIR=$BIN_DIR
fi
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
ITERS=${ITERS:-10}
DEVICE=${DEVICE:-cuda}
TOKENS_PER_GPU=${TOKENS_PER_GPU:-131072}
STRONG_TOKENS=${STRONG_TOKENS:-1048576}
HEADS=${HEADS:-16}
DIM=${DIM:-128}
LACT_TOKENS=${LACT_TOKENS:-1048576}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# NVLink SHARP (multicast) stays off on these machines (see the device notes).
export NCCL_NVLS_ENABLE=0
status=0
# The summary reads every NAME_pP.json in OUTDIR: a reused one must not lend
# it an earlier run's rows (a failed run writes none; a larger node's P).
rm -f "$OUT"/*_p*.json "$OUT"/*_p*.log "$OUT"/nsys_lact_p*.txt "$OUT/summary.txt"
echo "multi-gpu: $NGPU GPU(s)"
[[ "$NGPU" -ge 2 ]] || { echo "multi-gpu: needs >= 2 GPUs"; exit 1; }

studies=" ${STUDIES:-weak strong lact} "
if [[ -n "${BIN_DIR:-}" ]]; then
  [[ -d "$BIN_DIR" ]] || { echo "multi-gpu: BIN_DIR $BIN_DIR is not a folder"; exit 1; }
  # Carried binaries link the CUDA runtime dynamically (carry-build.sh), as
  # the pack's entries.sh says too.
  export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # Every study (and the profile) runs statescan-run: refuse now, not one
  # failed row at a time.
  if [[ -n "${studies// /}" || "${PROFILE_LACT:-0}" != 0 ]] && [[ ! -x "$RUN_BIN" ]]; then
    echo "multi-gpu: no statescan-run in BIN_DIR $BIN_DIR"
    exit 1
  fi
fi
[[ "${SKIP_BUILD:-0}" != 0 || -n "${BIN_DIR:-}" ]] || {
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DSTATESCAN_WITH_CUDA=ON -DSTATESCAN_WITH_TESTS=ON &&
    if [[ "${SKIP_TESTS:-0}" == 0 ]]; then
      cmake --build "$BUILD" -j"$(nproc)" --target statescan-run test_comm_nccl test_cuda_cp_mpi \
        test_cuda_lact_mpi
    else
      cmake --build "$BUILD" -j"$(nproc)" --target statescan-run
    fi
} >"$OUT/build.log" 2>&1 || { echo "multi-gpu: build failed, see $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }

# P = 2, 4, 8 up to the GPUs present.
ranks=()
for p in 2 4 8; do [[ $p -le $NGPU ]] && ranks+=("$p"); done

if [[ "${SKIP_TESTS:-0}" == 0 ]]; then
  for t in test_comm_nccl test_cuda_cp_mpi test_cuda_lact_mpi; do
    if [[ ! -x "$TEST_DIR/$t" ]]; then
      # A build just made every suite; a carried folder may hold some.
      [[ -z "${BIN_DIR:-}" ]] || echo "multi-gpu: $t not in BIN_DIR, left out"
      continue
    fi
    for p in "${ranks[@]}"; do
      timeout 400 mpirun -np "$p" --oversubscribe --bind-to none "$TEST_DIR/$t" >"$OUT/${t}_np$p.log" 2>&1 || status=1
      echo "$t np$p: $(grep -aE '\[  (PASSED|FAILED|SKIPPED) ' "$OUT/${t}_np$p.log" | tr -d '\033' | sed 's/\[[0-9;]*m//g' | tr '\n' ' ')"
      grep -aE "\[  FAILED  \]" "$OUT/${t}_np$p.log" | head -10
    done
  done
fi

# One statescan-run row: run NAME P ARGS... -> OUT/NAME_pP.json. OpenMPI binds
# each of up to 2 ranks to one core by default: --bind-to none lets a rank's
# host threads (input set-up, NCCL's proxy) use the node's cores.
run() {
  local name=$1 p=$2 t0=$SECONDS
  shift 2
  timeout "${RUN_TIMEOUT:-300}" mpirun -np "$p" --oversubscribe --bind-to none "$RUN_BIN" --device "$DEVICE" \
    --iters "$ITERS" --warmup 3 --json "$OUT/${name}_p$p.json" "$@" >"$OUT/${name}_p$p.log" 2>&1 ||
    { echo "multi-gpu: $name P=$p failed, see $OUT/${name}_p$p.log"; tail -5 "$OUT/${name}_p$p.log"; status=1; }
  # One line per run as it ends, so a cut-off session still shows progress.
  echo "multi-gpu: $name P=$p $((SECONDS - t0)) s: $(grep -a '^# Avg' "$OUT/${name}_p$p.log")"
  grep -aE '^# rank [0-9]+  (fwd|bwd) ' "$OUT/${name}_p$p.log" | sed "s/^/multi-gpu: $name P=$p /"
}
for v in ${VARIANTS:-kda gated_deltanet}; do
  for p in 1 "${ranks[@]}"; do
    if [[ "$studies" == *" weak "* ]]; then
      # P = 1 exchanges nothing: one run serves every exchange's table.
      for x in ${EXCHANGES:-auto}; do
        name="weak_$v"
        [[ "$x" == auto ]] || name="weak_${v}_$x"
        [[ $p -eq 1 && "$x" != auto ]] && continue
        # shellcheck disable=SC2086
        run "$name" "$p" --variant "$v" --seq-len $((TOKENS_PER_GPU * p)) --heads "$HEADS" \
          --dk "$DIM" --dv "$DIM" --dtype bf16 --exchange "$x" --no-check ${RUN_ARGS:-}
      done
    fi
    # shellcheck disable=SC2086
    [[ "$studies" == *" strong "* ]] && run "strong_$v" "$p" --variant "$v" --seq-len "$STRONG_TOKENS" --heads "$HEADS" \
      --dk "$DIM" --dv "$DIM" --dtype bf16 --exchange auto --no-check ${RUN_ARGS:-}
  done
done
lact_args=(--variant lact --seq-len "$LACT_TOKENS" --lact-chunk "$LACT_TOKENS" --heads "${LACT_HEADS:-4}"
  --dk "${LACT_DIM:-256}" --lact-hidden "${LACT_HIDDEN:-512}" --dtype bf16 --no-check)
if [[ "$studies" == *" lact "* ]]; then
  for p in 1 "${ranks[@]}"; do
    run lact "$p" "${lact_args[@]}"
  done
fi
if [[ "${PROFILE_LACT:-0}" != 0 ]]; then
  if command -v nsys >/dev/null; then
    for p in 1 2; do
      # One report per rank (%q{OMPI_COMM_WORLD_RANK}); the stats of rank 0.
      timeout "${RUN_TIMEOUT:-300}" mpirun -np "$p" --oversubscribe --bind-to none \
        nsys profile -t cuda,nvtx,osrt -o "$OUT/nsys_lact_p${p}_r%q{OMPI_COMM_WORLD_RANK}" -f true \
        "$RUN_BIN" --device cuda --iters 3 --warmup 1 "${lact_args[@]}" \
        >"$OUT/nsys_lact_p$p.log" 2>&1 || echo "multi-gpu: nsys LaCT P=$p failed, see $OUT/nsys_lact_p$p.log"
      nsys stats -r cuda_gpu_kern_sum,cuda_api_sum -f csv "$OUT/nsys_lact_p${p}_r0.nsys-rep" \
        >"$OUT/nsys_lact_p$p.txt" 2>&1 || true
      echo "multi-gpu: nsys LaCT P=$p: $(grep -c . "$OUT/nsys_lact_p$p.txt") lines in nsys_lact_p$p.txt"
    done
  else
    echo "multi-gpu: PROFILE_LACT=1 but nsys is not installed"
  fi
fi

# The scaling model beside the weak study (issue 8: measurements against
# `statescan-bench --cp-model`): it runs on any CPU, so it is taken from
# BIN_DIR or the build where there, else the summary prints its command line.
if [[ -z "${MODEL_BIN:-}" ]]; then
  for c in "${BIN_DIR:+$BIN_DIR/statescan-bench}" "$BUILD/launch/statescan-bench"; do
    [[ -n "$c" && -x "$c" ]] && { MODEL_BIN=$c; break; }
  done
elif [[ ! -x "$MODEL_BIN" ]]; then
  echo "multi-gpu: MODEL_BIN $MODEL_BIN is not an executable"
  MODEL_BIN=  # the tables print the model's command line instead
  status=1
fi
MODEL_BIN=${MODEL_BIN:-} TOKENS_PER_GPU=$TOKENS_PER_GPU HEADS=$HEADS DIM=$DIM \
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt" || status=1
import glob, json, os, re, subprocess, sys, tempfile
out = sys.argv[1]
rows = {}
for f in glob.glob(os.path.join(out, "*_p*.json")):
    m = re.match(r"(.*)_p(\d+)\.json$", os.path.basename(f))
    try:
        rows[(m.group(1), int(m.group(2)))] = json.load(open(f))
    except Exception as e:  # a failed run leaves a partial file
        print(f"# {f}: unreadable ({e})")
studies = sorted({k[0] for k in rows})
model_bin = os.environ.get("MODEL_BIN", "")
failed = []


def model_efficiency(study, base):
    """({P: predicted efficiency %}, a note for after the table) of a weak
    study from `statescan-bench --cp-model` fed this node's P = 1 times."""
    # The exchange each run used, by P: `auto` resolves on the link
    # statescan-run measured, the model's pick on its preset, so the run's own
    # choice (config.exchange, "ring (auto; link ...)") names the model's row.
    used = {p: r["config"]["exchange"].split()[0] for (n, p), r in rows.items() if n == study}
    m = re.match(r"weak_(.+?)(?:_(allgather|ring|tree))?$", study)
    if not m or not base or max(used) < 2:
        return {}, None
    variant = m.group(1)
    b = base["avg"]
    if not b.get("fwd_ms") or not b.get("bwd_ms"):
        return {}, "#   model: none (the P = 1 run has no forward + backward time to feed it)"
    cmd = ["--cp-model", "--variant", variant, "--seq-len", os.environ["TOKENS_PER_GPU"],
           "-H", os.environ["HEADS"], "-d", os.environ["DIM"], "--dtype", "bf16", "-P", str(max(used)),
           "--fwd-ms", f"{b['fwd_ms']:.6g}", "--bwd-ms", f"{b['bwd_ms']:.6g}"]
    if not model_bin:
        return {}, f"#   model: no statescan-bench here; on any machine: statescan-bench {' '.join(cmd)}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.json")
        try:
            r = subprocess.run([model_bin, *cmd, "--json", path], capture_output=True, text=True)
            why = None if r.returncode == 0 and os.path.exists(path) else \
                f"failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}"
        except OSError as e:
            why = f"failed: {e}"
        if why:
            failed.append(study)  # the tables go on; the script fails at the end
            return {}, f"#   model: {model_bin} {' '.join(cmd)} {why}"
        pred = json.load(open(path))
    return {x["P"]: 100 * x["efficiency"] for x in pred if used.get(x["P"]) == x["exchange"]}, None


for s in studies:
    print(f"#\n# {s}: step = fwd + bwd per rank (ms); efficiency vs P = 1"
          f" ({'weak: tokens per GPU fixed' if s.startswith('weak') else 'strong: total tokens fixed' if s.startswith('strong') else 'one chunk sharded'})"
          f"; model% = the scaling model's efficiency from this P = 1 run")
    print(f"# {'P':>3} {'fwd_ms':>9} {'bwd_ms':>9} {'step_ms':>9} {'xchg_ms':>8} {'xchg_B/rank':>12} {'hidden%':>8} {'Mtok/s':>9} {'eff%':>6} {'model%':>6}")
    # weak_<variant>_<exchange> tables share weak_<variant>'s P = 1 run.
    base = rows.get((s, 1)) or rows.get((re.sub(r"_(allgather|ring|tree)$", "", s), 1))
    model, note = model_efficiency(s, base)
    for (name, p), r in sorted(rows.items()):
        if name != s:
            continue
        a = r["avg"]
        step = a["fwd_ms"] + (a["bwd_ms"] or 0)
        # The LaCT runs report no per-rank list: their rows carry the bytes
        # (the max over ranks) and no hidden fraction.
        last = r["rows"][-1] if r.get("rows") else {}
        ranks = r.get("ranks") or [{"exchange_bytes": last.get("exchange_bytes", 0),
                                    "hidden_pct": last.get("exchange_hidden_pct")}]
        xb = max(x.get("exchange_bytes", 0) for x in ranks)
        hid = min((x.get("hidden_pct") or 0) for x in ranks) if p > 1 else 0
        eff = ""
        if base:
            b = base["avg"]
            bstep = b["fwd_ms"] + (b["bwd_ms"] or 0)
            eff = f"{100 * bstep / step:6.1f}" if s.startswith("weak") else f"{100 * bstep / (p * step):6.1f}"
        pred = f"{model[p]:6.1f}" if p in model else "-"
        print(f"  {p:>3} {a['fwd_ms']:9.3f} {(a['bwd_ms'] or 0):9.3f} {step:9.3f} {a['exchange_ms']:8.3f} {xb:12d} {hid:8.1f} {a['tokens_per_s']/1e6:9.2f} {eff:>6} {pred:>6}")
    if note:
        print(note)
sys.exit(1 if failed else 0)
PY
exit $status
