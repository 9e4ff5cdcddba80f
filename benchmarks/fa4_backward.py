"""FlashAttention-4's backward of a ring's rows on one Hopper GPU: its own entry point, call by
call, against ours (``sdpa_fusion.kernels.fa4_rows.QueryRows``: FA4's kernels in 80-row tiles,
one preprocess, one fp32 dQ accumulator and one conversion for all calls on the rows).

    python -m benchmarks.fa4_backward          # one H200: about a minute

What a ring of two GPUs does with one rank's s rows of a sequence of 2s on one of its two
head groups (b = 1, 16 of 32 heads of 128, bf16; the same out, lse and dout for both): a
causal square call on the s rows, then a full call against the other rank's keys, in the
load-balanced partition either ``all rows`` vs s/2 keys (rank 1) or ``last half`` of the
rows vs s keys (rank 0: off the 80-row tiles at s = 8K, 16K, 64K). FA4: two entry-point
calls (each with its own preprocess, dQ accumulator and conversion; causal calls in 64-row
tiles) and a dQ add into the second half's rows; ours: ``QueryRows``.

Rounds alternate the two implementations (``--rounds``) so that both meet the same clocks;
the JSON keeps every round, the summary the median per case. On a machine without FA4 on
Hopper every row says why it did not run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks import common

NAME = "fa4_backward"
IMPLS = ("FA4 entry point", "fa4_rows (ours)")
SHAPES = ("all rows", "last half")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=common.int_list, default=common.int_list("8k,16k,64k"),
                   help="rows of one rank")
    p.add_argument("--heads", type=int, default=16, help="heads of one head group")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=8)
    common.add_output_args(p)
    return p.parse_args(argv)


def unavailable() -> str | None:
    """Why the comparison cannot run here, or None."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return "needs a Hopper (sm90) GPU: fa4_rows runs FA4's sm90 backward"
    from sdpa_fusion.kernels.fa4_entry import import_error

    return import_error()


def steps(shape: str, s: int, heads: int, scale: float):
    """(FA4's step, our step, backward FLOPs) of one rank's rows of one head group."""
    from sdpa_fusion.kernels import fa4_rows, get

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(n):
        return torch.randn(1, n, heads, 128, device="cuda", dtype=torch.bfloat16,
                           generator=g).transpose(1, 2)

    q, dout, k, v = rand(s), rand(s), rand(s), rand(s)
    rows = slice(None) if shape == "all rows" else slice(s // 2, None)
    k2, v2 = (rand(s // 2), rand(s // 2)) if shape == "all rows" else (rand(s), rand(s))
    kernel = get("fa4")  # its backward: FA4's entry point, one call each
    out, lse = kernel.forward(q, k, v, causal=True, scale=scale)

    def fa4(_):
        dq, _, _ = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=scale)
        dq2, _, _ = kernel.backward(dout[:, :, rows], q[:, :, rows], k2, v2, out[:, :, rows],
                                    lse[:, :, rows].contiguous(), causal=False, scale=scale)
        dq[:, :, rows].add_(dq2)

    def ours(_):
        shared = fa4_rows.QueryRows(q, dout, out, lse, scale=scale)
        shared.call(slice(None), k, v, torch.empty_like(k), torch.empty_like(v), causal=True)
        shared.call(rows, k2, v2, torch.empty_like(k2), torch.empty_like(v2), causal=False)
        shared.finish(torch.empty_like(q))

    pairs = s * s / 2 + len(range(s)[rows]) * k2.shape[2]
    return fa4, ours, 2.5 * 4 * heads * 128 * pairs  # backward: 2.5x the forward's FLOPs


def cases(args):
    """(shape, rows) of every measurement."""
    return [(shape, s) for s in args.rows for shape in SHAPES]


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    record = {"title": "FA4 backward of a ring's rows: its entry point vs fa4_rows (one GPU)",
              "environment": common.environment("benchmarks.fa4_backward"),
              "settings": {"rows": args.rows, "heads": args.heads, "head_dim": 128,
                           "dtype": "bf16", "rounds": args.rounds, "iters": args.iters},
              "rows": []}
    reason = unavailable()
    for shape, s in cases(args):
        panel = f"{common.short(s)} rows, {shape}"
        if reason is not None:
            m = common.Measurement(status="unavailable", error=reason)
            record["rows"] += [common.make_row(panel, impl, s, m, 0.0) for impl in IMPLS]
            continue
        fa4, ours, flops = steps(shape, s, args.heads, 128 ** -0.5)
        on_gpu = [torch.empty(1, device="cuda")]  # timed with CUDA events
        for round_ in range(args.rounds):
            for impl, step in zip(IMPLS, (fa4, ours)):
                m = common.measure(step, [on_gpu], warmup=2, iters=args.iters)
                record["rows"].append(common.make_row(panel, impl, s, m, flops, shape=shape,
                                                      round=round_ + 1))
        del fa4, ours
        torch.cuda.empty_cache()
        print(f"[{time.monotonic() - start:6.1f}s] {panel} done", flush=True)
    record["summary"] = summary(record["rows"])
    for line in record["summary"]:
        print(line)
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    common.save(NAME, record, results_dir=args.results_dir,
                copy_to=args.copy_to, plot=reason is None, metrics=("median_ms",), bars=True)
    return 0


def summary(rows: list[dict]) -> list[dict]:
    """Per case: each implementation's median time over its rounds, and ours over FA4's."""
    out = []
    for panel, times in common.times_by(rows, "impl").items():
        if all(impl in times for impl in IMPLS):
            ms = {impl: statistics.median(times[impl]) for impl in IMPLS}
            out.append({"panel": panel, **{f"{impl} ms": round(t, 4) for impl, t in ms.items()},
                        "ours / FA4": round(ms[IMPLS[1]] / ms[IMPLS[0]], 4)})
    return out


if __name__ == "__main__":
    common.run(main)
