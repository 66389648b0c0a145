#!/usr/bin/env python3
"""Where a kernel's warps stall, phase by phase, from an Nsight Compute source view.

usage: ncu_phases.py SASS_CSV [--top N] [--raw RAW_CSV]

SASS_CSV is the source page of one profiled launch as CSV:

    ncu --set full --import-source yes -k regex:NAME --launch-count 1 -o rep ./app
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv

The kernels here are block-synchronous: every phase ends at a barrier. The
SASS is split after each BAR.SYNC / BAR.RED (and EXIT), and for each piece
the script prints its share of the warp stall samples, the instructions it
issues per warp, its most executed opcodes and its main stall reasons. That
maps a profile onto the source's phases without the CUDA-line correlation
(which the source page may lack), and shows what bounds each phase: barrier
waits (load imbalance, one warp's serial work), long_sb (global memory),
short_sb / mio (shared memory), wait / math (dependent arithmetic).
With --top N, the N instructions with the most samples follow, each with its
index, share, main stall reason and text. With --raw (the same report's
`ncu -i rep.ncu-rep --page raw --csv`), the launch's duration and its pipes',
shared memory's, issue slots' and DRAM's utilisation come first: whether the
tensor pipe or the operands' shared-memory reads bound the kernel.
(kernels/cuda/PERF_NOTES.md, "Sixteenth session", has two such profiles.)
"""
import argparse
import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def opcode(text):
    parts = text.split()
    if parts and parts[0].startswith("@"):  # predicate
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


RAW_METRICS = re.compile(
    r"^(gpu__time_duration\.sum|sm__throughput\.avg\.pct_of_peak_sustained_elapsed"
    r"|dram__throughput\.avg\.pct_of_peak_sustained_elapsed"
    r"|sm__pipe_tensor_op_hmma_cycles_active\.avg\.pct_of_peak_sustained_active"
    r"|sm__ops_path_tensor_src_bf16_dst_fp32\.avg\.pct_of_peak_sustained_elapsed"
    r"|smsp__issue_active\.avg\.pct_of_peak_sustained_active"
    r"|l1tex__data_pipe_lsu_wavefronts_mem_shared\.avg\.pct_of_peak_sustained_elapsed"
    r"|l1tex__data_bank_conflicts_pipe_lsu_mem_shared\.sum)$")


def print_raw(path):
    rows = list(csv.reader(open(path, newline="", errors="replace")))
    if len(rows) < 3:
        print(f"# {path}: no launch in the raw page")
        return
    names, units, values = rows[0], rows[1], rows[2]
    for n, u, v in zip(names, units, values):
        if RAW_METRICS.search(n) and v not in ("", "n/a"):
            print(f"# {n} = {v} {u}".rstrip())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=0, help="also list the N costliest instructions")
    ap.add_argument("--raw", help="ncu --page raw --csv output of the same report")
    args = ap.parse_args()
    if args.raw:
        print_raw(args.raw)

    rows = list(csv.reader(open(args.csv, newline="", errors="replace")))
    header_at = next((i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r), None)
    if header_at is None:
        sys.exit(f"ncu_phases.py: {args.csv}: no '{SAMPLES}' column (was the source page "
                 "exported with --set full or a sampling section?)")
    header = rows[header_at]
    col = {h: i for i, h in enumerate(header)}
    data = [r for r in rows[header_at + 1:] if len(r) == len(header)]
    if not data:
        sys.exit(f"ncu_phases.py: {args.csv}: no instruction rows")
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def num(r, h):
        try:
            return int(float(r[col[h]] or 0))
        except ValueError:
            return 0

    total = sum(num(r, SAMPLES) for r in data) or 1
    # Warps per launch: the first instruction runs once per warp.
    warps = max(num(data[0], EXECUTED), 1)

    by_reason = collections.Counter()
    for r in data:
        for h in stalls:
            by_reason[h[len("stall_"):]] += num(r, h)
    print(f"# {len(data)} instructions, {total} stall samples, {warps} warps")
    print("# stall reasons: " + ", ".join(f"{k} {100 * v / total:.1f}%"
                                          for k, v in by_reason.most_common(8)))
    print(f"# {'instructions':>13s} {'samples':>8s} {'inst/warp':>9s}  top opcodes (% of executed)"
          "  |  top stalls (% of the phase's samples)")
    phase = []
    for i, r in enumerate(data):
        phase.append(i)
        text = r[col["Source"]]
        if "BAR.SYNC" in text or "BAR.RED" in text or "EXIT" in text or i == len(data) - 1:
            s = sum(num(data[j], SAMPLES) for j in phase)
            ex = sum(num(data[j], EXECUTED) for j in phase)
            ops, why = collections.Counter(), collections.Counter()
            for j in phase:
                ops[opcode(data[j][col["Source"]])] += num(data[j], EXECUTED)
                for h in stalls:
                    why[h[len("stall_"):]] += num(data[j], h)
            print(f"  {phase[0]:5d}-{phase[-1]:5d} {100 * s / total:7.1f}% {ex / warps:9.0f}  "
                  + " ".join(f"{k}:{100 * v // max(ex, 1)}" for k, v in ops.most_common(5))
                  + "  |  " + " ".join(f"{k}:{100 * v // max(s, 1)}" for k, v in why.most_common(3)))
            phase = []

    if args.top > 0:
        print(f"# the {args.top} instructions with the most samples")
        top = sorted(range(len(data)), key=lambda i: -num(data[i], SAMPLES))[: args.top]
        for i in sorted(top):
            r = data[i]
            main_reason = max(stalls, key=lambda h: num(r, h))[len("stall_"):] if stalls else "-"
            print(f"  {i:5d} {100 * num(r, SAMPLES) / total:5.2f}% {main_reason:14s} "
                  f"{r[col['Source']].strip()[:80]}")


if __name__ == "__main__":
    main()
