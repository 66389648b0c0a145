#!/usr/bin/env python3
"""Times flash-linear-attention's Triton chunk kernels (forward only) on the same
shapes as statescan-bench, for the side-by-side table of scripts/gpu-check.sh.

FLA's source is brought to the GPU machine as the ignored folder .fla/ (never
committed); run with PYTHONPATH=.fla. Ops that FLA refuses on this
Triton/GPU (gated-delta and simple-GLA on Triton 3.6 on Hopper) are reported
with their error instead of a time.

usage: fla_bench.py [--variants kda,deltanet,gla,linear] [--lengths 32768]
                    [-H 16] [-d 128] [-n 20] [--json out.json]
"""
import argparse
import json
import math
import sys
import traceback

import torch
import torch.nn.functional as F


def make_inputs(variant, T, H, D, device="cuda"):
    torch.manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(1, T, H, D, device=device, dtype=bf)
    k = torch.randn(1, T, H, D, device=device, dtype=bf)
    v = torch.randn(1, T, H, D, device=device, dtype=bf)
    vec = variant in ("gla", "kda")
    gshape = (1, T, H, D) if vec else (1, T, H)
    g = F.logsigmoid(torch.randn(*gshape, device=device, dtype=torch.float32) + 4.0)
    beta = torch.sigmoid(torch.randn(1, T, H, device=device, dtype=torch.float32)).to(bf)
    return q, k, v, g, beta


def op_for(variant):
    if variant == "kda":
        from fla.ops.kda import chunk_kda
        return lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, use_qk_l2norm_in_kernel=True)
    if variant == "deltanet":
        from fla.ops.delta_rule import chunk_delta_rule
        return lambda q, k, v, g, b: chunk_delta_rule(q, k, v, b, use_qk_l2norm_in_kernel=True)
    if variant == "gated_deltanet":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return lambda q, k, v, g, b: chunk_gated_delta_rule(
            q, k, v, g, b, use_qk_l2norm_in_kernel=True)
    if variant == "gla":
        from fla.ops.gla import chunk_gla
        return lambda q, k, v, g, b: chunk_gla(q, k, v, g)
    if variant == "retention":
        from fla.ops.simple_gla import chunk_simple_gla
        return lambda q, k, v, g, b: chunk_simple_gla(q, k, v, g)
    if variant == "linear":
        from fla.ops.linear_attn import chunk_linear_attn
        return lambda q, k, v, g, b: chunk_linear_attn(q, k, v, normalize=False)
    raise ValueError(variant)


def time_op(fn, args, warmup, iters):
    with torch.no_grad():
        for _ in range(warmup):
            fn(*args)
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
        for i in range(iters):
            fn(*args)
            events[i + 1].record()
        torch.cuda.synchronize()
    times = sorted(events[i].elapsed_time(events[i + 1]) for i in range(iters))
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="kda,deltanet,gla,linear")
    ap.add_argument("--lengths", default="32768")
    ap.add_argument("-H", type=int, default=16)
    ap.add_argument("-d", type=int, default=128)
    ap.add_argument("-w", type=int, default=3)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import triton
    print(f"# FLA forward, torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    rows = []
    for variant in args.variants.split(","):
        for T in (int(t) for t in args.lengths.split(",")):
            row = {"impl": "fla", "variant": variant, "T": T, "H": args.H, "D": args.d}
            try:
                fn = op_for(variant)
                ms = time_op(fn, make_inputs(variant, T, args.H, args.d), args.w, args.n)
                row["ms"] = ms
                print(f"  {variant:15s} {T:8d} {ms:10.3f} ms", flush=True)
            except Exception as e:  # FLA refuses some ops on this Triton/GPU
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"  {variant:15s} {T:8d}   failed: {row['error']}", flush=True)
                traceback.print_exc(file=sys.stderr)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
