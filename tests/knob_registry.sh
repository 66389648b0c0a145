#!/usr/bin/env bash
# knob_registry.sh ROOT [EXTRA_SOURCE...] — the environment variables the
# library and its tools read (each "STATESCAN_..." string in core, kernels,
# comm, parallel, launch, monitoring) against where they are documented and run:
#   - each is named in README.md;
#   - each runs in the tests: a ctest entry sets it (KNOB= in tests/CMakeLists.txt), a
#     test source passes its quoted name (to setenv / ScopedEnv), or it is set through the
#     API listed in API_SET below, which a test source must name;
#   - each variable of README's A/B-switch table (rows "| `STATESCAN_X` |") is
#     still read.
# Exits 1 listing every miss. EXTRA_SOURCE files count as library sources (the
# ctest entry knob_registry_catches_a_new_knob passes one with an undocumented,
# untested variable and expects the failure).
# Why: three documented A/B switches had no ctest entry until the fifty-second
# session, and their first run found a test that assumed the default path.
set -euo pipefail

(($# >= 1)) || { echo "usage: knob_registry.sh ROOT [EXTRA_SOURCE...]" >&2; exit 2; }
ROOT=$1
shift

# Variables the tests reach through an API instead of by name, and that API.
declare -A API_SET=(
  [STATESCAN_CP_LINEAR]=set_summary_linear_part
  [STATESCAN_SUMMARY_SCAN]=SummaryScanScope
)

mapfile -t sources < <(find "$ROOT"/core "$ROOT"/kernels "$ROOT"/comm "$ROOT"/parallel \
  "$ROOT"/launch "$ROOT"/monitoring -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' \
  -o -name '*.h' \) 2>/dev/null)
((${#sources[@]} > 0)) || { echo "knob_registry: no library sources under $ROOT" >&2; exit 2; }
mapfile -t knobs < <(grep -hoE '"STATESCAN_[A-Z0-9_]+"' "${sources[@]}" "$@" | tr -d '"' | sort -u)
((${#knobs[@]} > 0)) || { echo "knob_registry: no STATESCAN_ variable read under $ROOT" >&2; exit 2; }
test_sources=("$ROOT"/tests/*.cpp "$ROOT"/tests/*.h)

misses=0
miss() {
  echo "knob_registry: $*"
  misses=$((misses + 1))
}
for knob in "${knobs[@]}"; do
  # Whole names only: STATESCAN_LINEAR must not pass on STATESCAN_LINEAR_GROUP_CHUNKS.
  grep -qE "${knob}([^A-Z0-9_]|$)" "$ROOT/README.md" || miss "$knob is read but README.md does not name it"
  # Set, not merely named: KNOB= in a ctest entry's environment, or the
  # quoted name a test passes to setenv / ScopedEnv (a comment naming it
  # runs nothing).
  if grep -qE "${knob}=" "$ROOT/tests/CMakeLists.txt" || grep -qF "\"${knob}\"" "${test_sources[@]}"; then
    continue
  fi
  api=${API_SET[$knob]:-}
  if [[ -z $api ]]; then
    miss "$knob is read but no ctest entry or test source sets it"
  elif ! grep -q "$api" "${test_sources[@]}"; then
    miss "$knob is set through $api, which no test source uses"
  fi
done
# The A/B table's rows (a removed switch says so in its first cell). Looked up
# in an array, not piped into `grep -q`: under pipefail the writer's SIGPIPE,
# when grep quits at its first match, failed the pipeline at random (CI on 5922cd7).
declare -A read_knobs=()
for knob in "${knobs[@]}"; do read_knobs[$knob]=1; done
while read -r listed; do
  [[ -n ${read_knobs[$listed]:-} ]] ||
    miss "README's A/B table lists $listed, which nothing reads"
done < <(grep -oE '^\| `STATESCAN_[A-Z0-9_]+` \|' "$ROOT/README.md" | grep -oE 'STATESCAN_[A-Z0-9_]+')

if ((misses > 0)); then
  echo "knob_registry: $misses miss(es) among ${#knobs[@]} variables"
  exit 1
fi
echo "knob_registry: ${#knobs[@]} variables, each documented and run by the tests"
