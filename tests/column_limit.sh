#!/usr/bin/env bash
# column_limit.sh ROOT [EXTRA_SOURCE...] — every C++/CUDA source line of the
# modules, tests, examples and scripts within .clang-format's ColumnLimit (read
# from ROOT/.clang-format). Exits 1 listing each longer line as FILE:LINE: WIDTH.
# WIDTH is awk's length: bytes under mawk (Debian's awk), so a line with
# non-ASCII characters (µ, ≥) is held to a little less than clang-format's limit.
# EXTRA_SOURCE files are checked too (the ctest entry
# column_limit_catches_a_long_line passes one with a long line and expects it named).
# Why: the files are not clang-formatted whole (their hand layout of kernels
# and tables is kept), so nothing else caught lines that crept past the limit.
set -euo pipefail

(($# >= 1)) || { echo "usage: column_limit.sh ROOT [EXTRA_SOURCE...]" >&2; exit 2; }
ROOT=$1
shift
limit=$(sed -n 's/^ColumnLimit: *\([0-9][0-9]*\).*/\1/p' "$ROOT/.clang-format")
[[ -n $limit ]] || { echo "column_limit.sh: no ColumnLimit in $ROOT/.clang-format" >&2; exit 2; }

mapfile -t sources < <(find "$ROOT"/core "$ROOT"/kernels "$ROOT"/comm "$ROOT"/parallel \
  "$ROOT"/launch "$ROOT"/monitoring "$ROOT"/tests "$ROOT"/examples "$ROOT"/scripts -type f \
  \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.h' \) 2>/dev/null | sort)
sources+=("$@")

long=$(awk -v limit="$limit" \
  'length($0) > limit { printf "%s:%d: %d columns\n", FILENAME, FNR, length($0) }' "${sources[@]}")
if [[ -n $long ]]; then
  echo "$long"
  echo "column_limit.sh: $(wc -l <<<"$long") line(s) over $limit columns"
  exit 1
fi
echo "column_limit.sh: ${#sources[@]} files within $limit columns"
