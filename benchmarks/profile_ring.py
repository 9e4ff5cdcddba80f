"""Where the time of one ring step goes: a profile of ring attention on every rank.

    mpirun -np 4 python -m benchmarks.profile_ring --seq-len 32k [--transports p2p]

Runs causal forward+backward of ring (load-balanced, kernel auto) a few times, profiles the
last iterations with torch.profiler on rank 0 and prints the CUDA kernels by total time, the
wall time per iteration and the share of it the attention kernels take.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import schedules
import sdpa_fusion

from . import common


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=common.int_list, default=[32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--schedule", default="ring")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--transports", default="copy_engine,p2p",
                   help="ring transports to profile, one after the other")
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",))
    transports = args.transports.split(",") if args.schedule == "ring" else [None]
    for transport, s in itertools.product(transports, args.seq_len):
        options = {"transport": transport} if transport else {}
        sched = schedules.get(args.schedule, mesh, partition="load_balanced", **options)
        local = s // mesh.size()
        q, k, v, dout = (torch.randn(1, args.heads, local, args.head_dim, device=mesh.device,
                                     dtype=torch.bfloat16) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def step():
            out = sdpa_fusion.attention(q, k, v, causal=True, kernel=args.kernel, schedule=sched)
            out.backward(dout)

        sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
        for _ in range(2):
            step()
        sync()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            sync()
            wall = (time.perf_counter() - t0) / args.iters
        if mesh.rank == 0:
            print(f"== {args.schedule} {transport or ''} s={common.short(s)} "
                  f"P={mesh.size()}: {wall * 1e3:.2f} ms "
                  f"per fwd+bwd iteration (rank 0)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                            max_name_column_width=60))
        dist.barrier()
    return 0


if __name__ == "__main__":
    common.run(main)
