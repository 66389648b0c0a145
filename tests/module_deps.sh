#!/usr/bin/env bash
# module_deps.sh ROOT [EXTRA_SOURCE...] — the dependency direction of the design
# notes' §1 (DESIGN.md, beside the repository; README's Architecture), from the
# sources' includes ("x/..." or <x/...>): core on nothing; kernels and comm on core; parallel on
# core, kernels and comm; monitoring on core and parallel (the observer it
# implements); launch on any. Exits 1 listing each include that points up or
# sideways as FILE:LINE: MODULE includes OTHER/, and each include through
# "../" (it would hide the module it reaches). A ROOT without the modules is an
# error, not a pass.
# EXTRA_SOURCE files are checked as part of kernels/ (the ctest entry
# module_deps_catches_an_upward_include passes one that includes comm/).
# Why: the arrows were kept by review alone; one include of comm/ in a kernel
# would tie the kernels to MPI and NCCL for every consumer of the library.
set -euo pipefail

(($# >= 1)) || { echo "usage: module_deps.sh ROOT [EXTRA_SOURCE...]" >&2; exit 2; }
ROOT=$1
shift
declare -A allowed=(
  [core]="core"
  [kernels]="core kernels"
  [comm]="core comm"
  [parallel]="core kernels comm parallel"
  [monitoring]="core parallel monitoring"
  [launch]="core kernels comm parallel monitoring launch"
)
modules="core kernels comm parallel monitoring launch"

bad=()
checked=0
check() {  # check MODULE FILE
  local module=$1 file=$2 line target
  ((++checked))
  while IFS=: read -r line target; do
    if [[ $target == .. ]]; then
      bad+=("$file:$line: $module includes through ../")
    elif [[ " ${allowed[$module]} " != *" $target "* ]]; then
      bad+=("$file:$line: $module includes $target/")
    fi
  done < <(awk -v mods=" $modules " '
    /^[ \t]*#[ \t]*include[ \t]*["<]\.\.\// { print FNR ":.." ; next }
    match($0, /^[ \t]*#[ \t]*include[ \t]*["<][a-z_]+\//) {
      s = substr($0, RSTART, RLENGTH); sub(/.*["<]/, "", s); sub(/\/$/, "", s)
      if (index(mods, " " s " ")) print FNR ":" s
    }' "$file")
}
for module in $modules; do
  [[ -d "$ROOT/$module" ]] || { echo "module_deps.sh: no $module/ in $ROOT" >&2; exit 2; }
  while IFS= read -r file; do
    check "$module" "$file"
  done < <(find "$ROOT/$module" -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' \
    -o -name '*.h' \) | sort)
done
for file in "$@"; do
  check kernels "$file"
done
if ((${#bad[@]} > 0)); then
  printf '%s\n' "${bad[@]}"
  echo "module_deps.sh: ${#bad[@]} include(s) against the modules' direction"
  exit 1
fi
echo "module_deps.sh: $checked files keep the modules' direction"
