#!/usr/bin/env python3
"""Times flash-linear-attention's Triton chunk kernels on the same shapes as
statescan-bench, for the side-by-side tables of scripts/gpu-check.sh: the
forward ("ms") and, with --backward, forward + backward ("ms_fwd_bwd": the op,
then torch.autograd.grad of its output w.r.t. q, k, v, g, beta with a random
dO) — the same row shape, so one summary script reads both.

FLA's source is brought to the GPU machine as the ignored folder .fla/ (never
committed); run with PYTHONPATH=.fla. Ops that FLA refuses on this
Triton/GPU (gated-delta and simple-GLA on Triton 3.6 on Hopper) are reported
with their error instead of a time.

With --decode, FLA's fused recurrent kernels instead, as statescan-bench
--decode steps its own: one token of each of B sequences (--batches) from an
fp32 state [B, H, D, D], the L2 norm on the delta rules; µs a call (replayed
from a CUDA graph of 10 calls, so Python's launch path is not timed) and GB/s
with statescan-bench's byte model (the state read and written, the token's
q, k, v, beta, fp32 gate and o).

With --profile, each timed op's forward + backward is also run under
torch.profiler and the per-kernel CUDA time table printed (FLA's kernels
next to statescan's `ncu` split: which stage the difference is in).

usage: fla_bench.py [--variants kda,deltanet,gla,linear] [--lengths 32768]
                    [-H 16] [-d 128] [-n 20] [--backward] [--profile]
                    [--decode --batches 1,16,128,512] [--json out.json]
"""
import argparse
import json
import math
import os
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


def decode_op_for(variant):
    """FLA's fused recurrent kernel for `variant`: (q, k, v, g, beta, h0) ->
    (o, new state); FLA writes the new state to a buffer of its own."""
    if variant == "kda":
        from fla.ops.kda import fused_recurrent_kda
        return lambda q, k, v, g, b, h: fused_recurrent_kda(
            q, k, v, g, b, initial_state=h, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    if variant == "gated_deltanet":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        return lambda q, k, v, g, b, h: fused_recurrent_gated_delta_rule(
            q, k, v, g, b, initial_state=h, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    if variant == "deltanet":
        from fla.ops.delta_rule import fused_recurrent_delta_rule
        return lambda q, k, v, g, b, h: fused_recurrent_delta_rule(
            q, k, v, b, initial_state=h, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    if variant == "gla":
        from fla.ops.gla import fused_recurrent_gla
        return lambda q, k, v, g, b, h: fused_recurrent_gla(
            q, k, v, gk=g, initial_state=h, output_final_state=True)
    if variant == "retention":
        from fla.ops.simple_gla import fused_recurrent_simple_gla
        return lambda q, k, v, g, b, h: fused_recurrent_simple_gla(
            q, k, v, g, initial_state=h, output_final_state=True)
    if variant == "linear":
        from fla.ops.linear_attn import fused_recurrent_linear_attn
        return lambda q, k, v, g, b, h: fused_recurrent_linear_attn(
            q, k, v, initial_state=h, output_final_state=True)
    raise ValueError(variant)


def decode_bytes(variant, B, H, D):
    """statescan-bench --decode's byte model: the fp32 state read and written,
    the token's bf16 q, k, v (and beta), its fp32 gate, and o."""
    gate = 4 * D if variant in ("gla", "kda") else (4 if variant in ("retention",
                                                                      "gated_deltanet") else 0)
    beta = 2 if variant in ("deltanet", "gated_deltanet", "kda") else 0
    token = 3 * D * 2 + gate + beta + D * 2
    return 2.0 * B * H * D * D * 4 + B * H * token


def time_graph(fn, args, warmup, iters, reps=10):
    """Median ms of one call, replayed from a CUDA graph of `reps` calls:
    a decode step of a few µs is shorter than Python's launch path, which
    per-call events would time instead (statescan's C++ launch is ~5 µs)."""
    with torch.no_grad():
        for _ in range(max(warmup, 1)):  # Triton compiles outside the capture
            fn(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn(*args)
        graph.replay()
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
        for i in range(iters):
            graph.replay()
            events[i + 1].record()
        torch.cuda.synchronize()
    times = sorted(events[i].elapsed_time(events[i + 1]) / reps for i in range(iters))
    return times[len(times) // 2]


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


def output_of(result):
    """FLA ops return (o, final_state); o alone otherwise."""
    return result[0] if isinstance(result, (tuple, list)) else result


def fwd_bwd_step(fn, inputs, d_o):
    """One forward + backward: gradients of o w.r.t. every input (unused ones,
    e.g. g for linear attention, come back as None)."""
    with torch.enable_grad():
        o = output_of(fn(*inputs))
        return torch.autograd.grad(o, inputs, d_o, allow_unused=True)


def time_fwd_bwd(fn, inputs, warmup, iters):
    inputs = [x.detach().requires_grad_(True) for x in inputs]
    d_o = torch.randn_like(inputs[2])
    for _ in range(warmup):
        fwd_bwd_step(fn, inputs, d_o)
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        fwd_bwd_step(fn, inputs, d_o)
        events[i + 1].record()
    torch.cuda.synchronize()
    times = sorted(events[i].elapsed_time(events[i + 1]) for i in range(iters))
    return times[len(times) // 2]


def profile_fwd_bwd(fn, inputs, steps=5):
    """Per-kernel CUDA time of `steps` forward + backward steps (after the
    timing's warm-up, so no autotuning is inside)."""
    from torch.profiler import ProfilerActivity, profile
    inputs = [x.detach().requires_grad_(True) for x in inputs]
    d_o = torch.randn_like(inputs[2])
    fwd_bwd_step(fn, inputs, d_o)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd_bwd_step(fn, inputs, d_o)
        torch.cuda.synchronize()
    print(f"# per-kernel CUDA time over {steps} forward + backward steps", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20,
                                    max_name_column_width=60), flush=True)


def counts(ap, flag, text, what):
    """A comma-separated list of counts >= 1, or the parser's error naming flag."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        ap.error(f"{flag}: comma-separated {what}, got {text!r}")
    if min(values) < 1:
        ap.error(f"{flag}: {what} must be >= 1, got {text!r}")
    return values


def record_failure(row, label, error):
    """A row FLA refused: its error in the row and the table, the trace on stderr."""
    row["error"] = f"{type(error).__name__}: {error}"[:300]
    print(f"{label}   failed: {row['error']}", flush=True)
    traceback.print_exc(file=sys.stderr)


def save_rows(path, rows):
    """The rows so far, after every row: a run cut off by a timeout keeps what
    it timed (written aside, then moved, so the file is never half-written)."""
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="kda,deltanet,gla,linear")
    ap.add_argument("--lengths", default="32768")
    ap.add_argument("-H", type=int, default=16)
    ap.add_argument("-d", type=int, default=128)
    ap.add_argument("-w", type=int, default=3)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--backward", action="store_true",
                    help="also time forward + backward (ms_fwd_bwd)")
    ap.add_argument("--profile", action="store_true",
                    help="also print each op's per-kernel CUDA times (torch.profiler)")
    ap.add_argument("--decode", action="store_true",
                    help="time FLA's fused recurrent kernels: one token of each of B sequences")
    ap.add_argument("--batches", default="1,16,128,512",
                    help="with --decode: the batch sizes B")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.H < 1 or args.d < 1 or args.n < 1 or args.w < 0:
        ap.error("-H, -d and -n must be >= 1 and -w >= 0")
    if args.decode:
        if args.backward or args.profile:
            ap.error("--decode times the forward step only: drop --backward/--profile")
        return run_decode(args, counts(ap, "--batches", args.batches, "batch sizes"))
    lengths = counts(ap, "--lengths", args.lengths, "token counts")
    import triton
    what = "forward + backward" if args.backward else "forward"
    print(f"# FLA {what}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    rows = []
    for variant in args.variants.split(","):
        for T in lengths:
            row = {"impl": "fla", "variant": variant, "T": T, "H": args.H, "D": args.d}
            try:
                fn = op_for(variant)
                ms = time_op(fn, make_inputs(variant, T, args.H, args.d), args.w, args.n)
                row["ms"] = ms
                line = f"  {variant:15s} {T:8d} {ms:10.3f} ms"
                if args.backward:
                    ms_fb = time_fwd_bwd(fn, make_inputs(variant, T, args.H, args.d), args.w,
                                         args.n)
                    row["ms_fwd_bwd"] = ms_fb
                    line += f"  fwd+bwd {ms_fb:10.3f} ms"
                print(line, flush=True)
                if args.profile:
                    profile_fwd_bwd(fn, make_inputs(variant, T, args.H, args.d))
            except Exception as e:  # FLA refuses some ops on this Triton/GPU
                record_failure(row, f"  {variant:15s} {T:8d}", e)
            rows.append(row)
            save_rows(args.json, rows)


def run_decode(args, batches):
    import triton
    print(f"# FLA fused recurrent decode (1 token, fp32 state), torch {torch.__version__}, "
          f"triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    print(f"  {'variant':15s} {'B':>5s} {'us':>10s} {'GB/s':>8s}", flush=True)
    rows = []
    for variant in args.variants.split(","):
        for B in batches:
            row = {"impl": "fla", "mode": "decode", "variant": variant, "B": B, "H": args.H,
                   "D": args.d}
            try:
                fn = decode_op_for(variant)
                q, k, v, g, beta = make_inputs(variant, B, args.H, args.d)
                # [1, B, ...] -> [B, 1, ...]: B sequences of one token
                q, k, v, g, beta = (x.transpose(0, 1).contiguous() for x in (q, k, v, g, beta))
                h0 = torch.randn(B, args.H, args.d, args.d, device="cuda", dtype=torch.float32)
                us = 1e3 * time_graph(fn, (q, k, v, g, beta, h0), args.w, args.n)
                gbps = decode_bytes(variant, B, args.H, args.d) / (us * 1e3)
                row.update(us=us, gbps=gbps)
                print(f"  {variant:15s} {B:5d} {us:10.2f} {gbps:8.0f}", flush=True)
            except Exception as e:  # FLA refuses some ops on this Triton/GPU
                record_failure(row, f"  {variant:15s} {B:5d}", e)
            rows.append(row)
            save_rows(args.json, rows)


if __name__ == "__main__":
    main()
