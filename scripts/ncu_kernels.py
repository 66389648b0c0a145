#!/usr/bin/env python3
"""Per-kernel GPU time per LaCT chunk from an Nsight Compute CSV.

usage: ncu_kernels.py NCU_CSV CHUNKS

NCU_CSV is `ncu --profile-from-start off --metrics gpu__time_duration.sum --csv`
of `statescan-bench --lact ... --warmup 0 --iters 1` (the bench brackets its timed
runs with cudaProfilerStart / Stop, so the reference GEMM is left out); CHUNKS is
the number of chunks one pass covers (seq_len / chunk). Prints, per kernel
name (template arguments kept, parameters dropped), the microseconds a chunk,
the launches a chunk, and the total, largest first.
"""
import collections
import csv
import sys


def without_parameters(name):
    """The name less its trailing parameter list only: demangled names hold
    parentheses before it too ("(anonymous namespace)", "(Mode)2"), and cutting
    at the first one merged different kernels into one row."""
    name = name.strip()
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i].strip()
    return name


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    rows = list(csv.reader(line for line in open(sys.argv[1]) if line.startswith('"')))
    if not rows:
        sys.exit(f"ncu_kernels.py: {sys.argv[1]}: no CSV rows")
    header = rows[0]
    try:
        name_at, value_at = header.index("Kernel Name"), header.index("Metric Value")
        unit_at = header.index("Metric Unit")
    except ValueError:
        sys.exit(f"ncu_kernels.py: {sys.argv[1]}: not an ncu --csv metrics table")
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
             "s": 1e6, "second": 1e6}
    chunks = float(sys.argv[2])
    if not chunks > 0:
        sys.exit(f"ncu_kernels.py: CHUNKS must be > 0, got {sys.argv[2]!r}")
    metric_at = header.index("Metric Name") if "Metric Name" in header else None
    total_us = collections.Counter()
    launches = collections.Counter()
    for r in rows[1:]:
        if len(r) != len(header):
            continue
        if metric_at is not None and r[metric_at] != "gpu__time_duration.sum":
            continue
        unit = r[unit_at]
        if unit not in scale:
            sys.exit(f"ncu_kernels.py: unknown time unit {unit!r}")
        name = without_parameters(r[name_at])
        total_us[name] += float(r[value_at].replace(",", "")) * scale[unit]
        launches[name] += 1
    print(f"# {'us/chunk':>9s} {'launches/chunk':>14s}  kernel")
    for name, us in total_us.most_common():
        print(f"  {us / chunks:9.1f} {launches[name] / chunks:14.2f}  {name[:120]}")
    print(f"  {sum(total_us.values()) / chunks:9.1f} {'':14s}  total")


if __name__ == "__main__":
    main()
