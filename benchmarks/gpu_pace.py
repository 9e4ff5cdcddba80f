"""The pace of each GPU of the host alone: one GPU's causal forward+backward step on every GPU
in turn (0..N-1, then back N-1..0, so that drift over the run shows).

    python -m benchmarks.gpu_pace            # 2 H200: about a minute
    python -m benchmarks.gpu_pace --tiny     # seconds on a CPU: checks the script itself

A schedule over several GPUs goes at the pace of its slowest GPU, while "one GPU" in the
ratios of ``benchmarks.context_parallel`` is GPU 0 alone. ``summary`` gives, per kernel and
length, every GPU's step time against GPU 0's (the mean of its two turns): the most a ratio
to GPU 0 can reach when that GPU sets the pace. Default problem: b = 1, 32 heads of 128,
bf16, s = 32K and 128K, kernels fa4 and cudnn (``auto`` on CPU: the reference kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from benchmarks import common

NAME = "gpu_pace"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=common.int_list, default=common.int_list("32k,128k"))
    p.add_argument("--kernels", default="fa4,cudnn")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--max-seconds", type=float, default=0,
                   help="stop starting new cases after this long (0: no limit)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU")
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.kernels = [k for k in args.kernels.split(",") if k]
    args.dtype = torch.bfloat16
    if args.tiny:
        args.seq_lens, args.heads, args.head_dim, args.dtype = [128], 2, 16, torch.float32
        args.kernels, args.warmup, args.iters = ["reference"], 1, 2
    args.name = NAME + ("_tiny" if args.tiny else "")
    return args


def turns(count: int) -> list[int | None]:
    """The devices in the order they run: 0..N-1, then N-1..0 (None twice: the CPU)."""
    devices = list(range(count)) or [None]
    return devices + devices[::-1]


def step_row(args, s: int, kernel: str, device_index: int | None, turn: int) -> dict:
    """The measured step of one GPU (or the CPU) alone, as a result row."""
    import sdpa_fusion

    device = torch.device("cpu" if device_index is None else f"cuda:{device_index}")
    place = contextlib.nullcontext() if device_index is None else torch.cuda.device(device)
    with place:
        inputs = common.random_inputs(1, args.heads, s, args.head_dim, dtype=args.dtype,
                                      device=device)
        q, k, v, dout = inputs
        spec = sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=True)

        def step(x):
            q, k, v, dout = x
            out = sdpa_fusion.attention(q, k, v, causal=True, kernel=kernel)
            return torch.autograd.grad(out, (q, k, v), dout)

        m = common.measure(step, [inputs], warmup=args.warmup, iters=args.iters)
        del inputs, q, k, v, dout
    name = "CPU" if device_index is None else f"GPU {device_index}"
    return common.make_row(f"{kernel} s={common.short(s)}", f"{name}, turn {turn + 1}", s, m,
                           spec.flops(backward=True), kernel=kernel, device_index=device_index,
                           turn=turn + 1)


def summary(rows: list[dict]) -> list[dict]:
    """Per panel, every device's mean step time over its turns against the first device's."""
    out = []
    for panel, times in common.times_by(rows, "device_index").items():
        first = statistics.mean(next(iter(times.values())))
        for device_index, ms in times.items():
            out.append({"panel": panel, "device_index": device_index,
                        "mean_ms": statistics.mean(ms), "turns_ms": ms,
                        "pace_vs_first": first / statistics.mean(ms)})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    record = {"title": "each GPU alone, in turn: causal forward+backward step",
              "environment": common.environment("benchmarks.gpu_pace"),
              "settings": {"seq_lens": args.seq_lens, "kernels": args.kernels,
                           "heads": args.heads, "head_dim": args.head_dim,
                           "dtype": str(args.dtype), "warmup": args.warmup,
                           "iters": args.iters},
              "rows": []}
    order = turns(torch.cuda.device_count() if not args.tiny else 0)
    deadline = common.Deadline(args.max_seconds)
    for s in args.seq_lens:
        for kernel in args.kernels:
            if deadline.left() <= 0:  # a case's turns all run, or none
                continue
            for turn, device_index in enumerate(order):
                row = step_row(args, s, kernel, device_index, turn)
                record["rows"].append(row)
                print(f"[{time.monotonic() - start:6.1f}s] {row['panel']}: {row['impl']} "
                      f"{common.number(row['median_ms'])} ms ({row['status']})", flush=True)
    record["summary"] = summary(record["rows"])
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    for line in record["summary"]:
        print(f"{line['panel']}: device {line['device_index']} {line['mean_ms']:.2f} ms, "
              f"pace against the first {line['pace_vs_first']:.3f}")
    common.save(args.name, record, results_dir=args.results_dir, copy_to=args.copy_to,
                bars=True)
    common.print_failures(record["rows"])
    return 0 if all(r["status"] == "ok" for r in record["rows"]) else 1


if __name__ == "__main__":
    common.run(main)
