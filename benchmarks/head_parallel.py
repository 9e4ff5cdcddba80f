"""Head-parallel attention on P GPUs against one GPU running the same local problem.

    mpirun -np 4 python -m benchmarks.head_parallel                  # about 1 min on 4 H200s
    mpirun -np 4 --oversubscribe python -m benchmarks.head_parallel --tiny    # CPU ranks

Every rank holds H/P of the H heads (``schedules.get("head_parallel", mesh)``) and attends
them over the whole sequence with no communication, so the per-GPU rate should match one GPU
running that local problem alone: the goal is head_parallel / 1 GPU >= 0.95. The one-GPU
number is measured in the same run, on rank 0 with ``schedule=None`` and the same local
tensors, while the other ranks wait at a barrier. Timed iterations run back to back after a
barrier (the steady state of a training loop, where host work such as the ranks' agreement
on the inputs overlaps the GPU's); ``--sync-each`` puts a barrier before every iteration
instead, which times each step from an idle GPU, host work included. The reported time is
the slowest rank's median.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist

from benchmarks import common

NAME = "head_parallel"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=common.int_list, default=common.int_list("8k,16k,32k,64k"))
    p.add_argument("--tokens", type=common.int_list, default=[65536],
                   help="batch = tokens // seq_len, clamped to [--min-batch, --max-batch]")
    p.add_argument("--min-batch", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32, help="heads of the whole problem")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", choices=("both", "yes", "no"), default="yes")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--kernels", default="nvfuser,auto")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--layout", choices=("bhse", "bshe"), default="bhse")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=8)
    common.add_distributed_args(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_lens, args.tokens, args.heads, args.head_dim = [64, 128], [256], 8, 16
        args.warmup, args.iters = 1, 3
        if args.kernels == "nvfuser,auto":
            args.kernels = "nvfuser,auto,reference"
    args.kernels, args.modes = args.kernels.split(","), args.modes.split(",")
    args.causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return args


def batch_for(args, s: int) -> int:
    return max(args.min_batch, min(args.max_batch, args.tokens[0] // s))


def steps(kernel, schedule, causal, layout):
    """{mode: step(inputs)} for attention with ``kernel`` under ``schedule``."""
    import sdpa_fusion

    def fn(q, k, v):
        return sdpa_fusion.attention(q, k, v, causal=causal, layout=layout, kernel=kernel,
                                     schedule=schedule)

    def train(x):
        q, k, v, dout = x
        return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    return fn, {"fwd": lambda x: fn(x[0], x[1], x[2]), "fwd+bwd": train}


def check(fn, inputs, ref) -> float | None:
    try:
        with torch.no_grad():
            return common.relative_error(fn(*inputs), ref)
    except Exception:  # noqa: BLE001 -- the timed run records the failure
        return None


def run_case(args, mesh, sched, s: int, causal: bool) -> list[dict]:
    import sdpa_fusion

    P, H, E = mesh.world_size, args.heads, args.head_dim
    b, dtype = batch_for(args, s), DTYPES[args.dtype]
    full = common.random_inputs(b, H, s, E, dtype=dtype, device=mesh.device, requires_grad=False)
    local = [sched.shard(t, layout=args.layout).detach().clone() for t in full]
    del full
    inputs = [tuple(t.requires_grad_(i < 3) for i, t in enumerate(local))]
    spec = sdpa_fusion.AttentionSpec(batch=b, heads=H // P, kv_heads=H // P, q_len=s, kv_len=s,
                                     head_dim=E, dtype=dtype, causal=causal, layout=args.layout)
    with torch.no_grad():
        ref = sdpa_fusion.attention(*inputs[0][:3], causal=causal, layout=args.layout,
                                    kernel="reference" if mesh.device.type == "cpu" else "auto")
    fields = dict(batch=b, heads=H, local_heads=H // P, head_dim=E, causal=causal,
                  layout=args.layout, dtype=args.dtype, ranks=P)
    panel = f"{'causal' if causal else 'full'} " + "{mode}"
    rows = []

    each = dict(before_each=dist.barrier) if args.sync_each else dict(before_timing=dist.barrier)
    for kernel in args.kernels:
        fn, by_mode = steps(kernel, sched, causal, args.layout)
        rel_err = check(fn, inputs[0][:3], ref)
        for mode in args.modes:
            m = common.measure(by_mode[mode], inputs, warmup=args.warmup, iters=args.iters,
                               **each)
            m = common.combine_ranks(mesh.agree(m))
            rows.append(common.make_row(panel.format(mode=mode), f"head_parallel {kernel}", s, m,
                                        spec.flops(backward=mode == "fwd+bwd"), mode=mode,
                                        rel_err=rel_err, **fields))
    if mesh.rank == 0:
        sync = torch.cuda.synchronize if mesh.device.type == "cuda" else (lambda: None)
        each = dict(before_each=sync) if args.sync_each else dict(before_timing=sync)
        for kernel in args.kernels:
            fn, by_mode = steps(kernel, None, causal, args.layout)
            rel_err = check(fn, inputs[0][:3], ref)
            for mode in args.modes:
                m = common.measure(by_mode[mode], inputs, warmup=args.warmup, iters=args.iters,
                                   **each)
                rows.append(common.make_row(panel.format(mode=mode), f"1 GPU {kernel}", s, m,
                                            spec.flops(backward=mode == "fwd+bwd"), mode=mode,
                                            rel_err=rel_err, **fields))
    dist.barrier()
    del inputs, local, ref
    if mesh.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def one_gpu_peer(row) -> str | None:
    """What a row is compared with: "head_parallel <kernel>" with "1 GPU <kernel>"."""
    kind, _, kernel = row["impl"].partition(" ")
    return f"1 GPU {kernel}" if kind == "head_parallel" else None


def over_one_gpu(row, base, ratio) -> dict:
    """A ratio of head_parallel's per-GPU TFLOP/s over one GPU's on the same kernel."""
    return {"panel": row["panel"], "seq_len": row["seq_len"],
            "impl": f"{row['impl'].split(' ', 1)[1]}: hp / 1 GPU", "ratio": ratio, "status": "ok"}


def main(argv=None) -> int:
    args = parse_args(argv)
    import schedules
    import sdpa_fusion

    mesh = sdpa_fusion.init_mesh((-1,), ("heads",),
                                 timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        sched = schedules.get("head_parallel", mesh)
        name = NAME + ("_tiny" if args.tiny else "")
        record = {
            "title": f"head_parallel over {mesh.world_size} ranks vs 1 GPU",
            "environment": common.environment("benchmarks.head_parallel"),
            "settings": {
                "seq_lens": args.seq_lens, "heads": args.heads, "head_dim": args.head_dim,
                "batch_rule": f"clamp({args.tokens[0]} // seq_len, {args.min_batch}, "
                              f"{args.max_batch})",
                "dtype": args.dtype, "layout": args.layout, "kernels": args.kernels,
                "modes": args.modes, "warmup": args.warmup, "iters": args.iters,
                "timing": ("barrier before every iteration" if args.sync_each else
                           "back-to-back iterations after a barrier")
                + "; slowest rank's median; TFLOP/s per GPU from the local AttentionSpec.flops",
            },
            "rows": [],
        }
        deadline = common.Deadline(args.max_seconds)
        start = time.monotonic()
        for s in args.seq_lens:
            for causal in args.causals:
                if not mesh.agree(deadline.left() > 0)[0]:
                    continue
                rows = run_case(args, mesh, sched, s, causal)
                if mesh.rank == 0:
                    record["rows"] += rows
                    cells = ", ".join(f"{r['impl']}:{r['mode']}="
                                      + (common.number(r["tflops"]) if r["tflops"] else r["status"])
                                      for r in rows)
                    print(f"[{time.monotonic() - start:6.1f}s] s={common.short(s)} b="
                          f"{batch_for(args, s)} causal={causal}: {cells}", flush=True)
                    common.save(name, record, args, plot=False)
        if mesh.rank == 0:
            record["ratios"] = common.ratios(record["rows"], one_gpu_peer, entry=over_one_gpu)
            record["elapsed_s"] = round(time.monotonic() - start, 1)
            paths = common.save(name, record, args)
            print("\nTFLOP/s per GPU")
            print(common.format_table(record["rows"], row_keys=("panel", "seq_len")))
            if record["ratios"]:
                print("\nhead_parallel / 1 GPU (goal >= 0.95)")
                print(common.format_table(record["ratios"], row_keys=("panel", "seq_len"),
                                          value="ratio", fmt="{:.3f}"))
            common.print_failures(record["rows"])
            print(f"\nwrote {', '.join(str(p) for p in paths)} in {record['elapsed_s']} s")
    finally:
        sdpa_fusion.close_mesh()
    return 0


if __name__ == "__main__":
    common.run(main)
