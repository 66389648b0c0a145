#!/usr/bin/env bash
# kernel_probe_smoke.sh SCRIPT BUILD_DIR SOURCE: scripts/kernel-probe.sh on
# CI's CPUs with the library's own lact_hidden.cu as the one variant: the
# probe compiles and links against this build, is packed, and run.sh is
# written to run it in each mode asked for (a device call must not be the
# first run of the script). A bad NAME=FILE is refused before any build.
set -euo pipefail
script=$1 build=$2 source=$3
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

if bash "$script" "bad name=$source" >"$out/refused.log" 2>&1; then
  echo "kernel-probe accepted 'bad name=...'"; exit 1
fi
grep -q "is not NAME=FILE.cu" "$out/refused.log" || { cat "$out/refused.log"; exit 1; }

PROBE_DIR=$out/probes BUILD_DIR=$build MODES="grad key" DS="128 256" REPEAT=1 JOBS=1 \
  bash "$script" "base=$source"
[[ -s "$out/probes/probe_base.xz" ]] || { echo "no probe_base.xz"; exit 1; }
xz -t "$out/probes/probe_base.xz"
bash -n "$out/probes/run.sh"
grep -q 'for mode in grad key; do for d in 128 256; do for name in base; do' "$out/probes/run.sh" ||
  { cat "$out/probes/run.sh"; exit 1; }
xz -dc "$out/probes/probe_base.xz" >"$out/probe_base"
# The probe holds the fused kernels' sm_90a code.
grep -aq "lact_hidden_grad_kernel" "$out/probe_base" || { echo "probe_base lacks the grad kernel"; exit 1; }
echo "kernel-probe smoke: ok"
