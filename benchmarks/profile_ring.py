"""Where the time of one ring step goes: a profile of ring attention on every rank.

    mpirun -np 2 python -m benchmarks.profile_ring --seq-len 32k [--transports p2p]
        [--kernel fa4] [--head-groups 2]

Runs causal forward+backward of ring (load-balanced, kernel auto) a few times, profiles the
last iterations with torch.profiler and prints, on rank 0, the CUDA kernels by total time and
the wall time per iteration; then, on every rank, each stream's busy time, the busy fraction
of the busiest (the attention) stream over the profiled window (goal at 32K on 2 GPUs: at
least 95%), and that stream's longest idle gaps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

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
    p.add_argument("--head-groups", default="auto", help="ring's head_groups: auto or a count")
    p.add_argument("--timeline", action="store_true",
                   help="also print every GPU op of the profiled window (stream, start, length)")
    args = p.parse_args(argv)
    groups = schedules.option_value(args.head_groups)
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",))
    transports = args.transports.split(",") if args.schedule == "ring" else [None]
    for transport, s in itertools.product(transports, args.seq_len):
        options = {"transport": transport, "head_groups": groups} if transport else {}
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
        for rank in range(mesh.world_size):
            if rank == mesh.rank and q.is_cuda:
                print(f"-- rank {rank}: streams and idle gaps of the busiest stream")
                print(stream_report(prof, timeline=args.timeline), flush=True)
            dist.barrier()
    return 0


def stream_report(prof, gaps: int = 12, timeline: bool = False) -> str:
    """Busy time of each CUDA stream over the profiled window, and the longest idle gaps of
    the busiest stream with the kernels around them (from the profiler's trace); with
    ``timeline``, every op in order of its start."""
    with tempfile.TemporaryDirectory() as folder:  # read back by name: the export may replace
        path = Path(folder) / "trace.json"          # the file rather than write into it
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    ops = [e for e in trace.get("traceEvents", [])
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not ops:
        return "no CUDA kernels in the trace"
    start = min(e["ts"] for e in ops)
    end = max(e["ts"] + e["dur"] for e in ops)
    streams = {}
    for e in ops:
        streams.setdefault(e["args"].get("stream"), []).append(e)
    lines = [f"window {(end - start) / 1e3:.2f} ms"]
    for stream, events in sorted(streams.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        lines.append(f"stream {stream}: {len(events)} ops, busy "
                     f"{sum(e['dur'] for e in events) / 1e3:.2f} ms")
    busiest = max(streams.values(), key=lambda events: sum(e["dur"] for e in events))
    busiest.sort(key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in busiest)
    lines.append(f"attention (busiest) stream busy {busy / (end - start):.1%} of the window "
                 f"(goal at 32K on 2 GPUs: 95%)")
    holes = [(b["ts"] - (a["ts"] + a["dur"]), a, b) for a, b in zip(busiest, busiest[1:])]
    lines.append(f"idle between ops of the busiest stream: "
                 f"{sum(max(h, 0) for h, _, _ in holes) / 1e3:.2f} ms; longest:")
    for hole, a, b in sorted(holes, key=lambda x: -x[0])[:gaps]:
        lines.append(f"  {hole / 1e3:7.3f} ms at {(a['ts'] + a['dur'] - start) / 1e3:8.2f} ms "
                     f"after {a['name'][:50]!r} before {b['name'][:50]!r}")
    if timeline:  # lag: from the host's launch to the op's start (small: the GPU waited)
        launched = {e["args"]["correlation"]: e["ts"] for e in trace["traceEvents"]
                    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e
                    and "correlation" in e["args"]}
        lines.append("timeline (stream, start ms, length ms, launch lag ms, op):")
        for e in sorted(ops, key=lambda e: e["ts"]):
            t = launched.get(e["args"].get("correlation"))
            lag = "-" if t is None else f"{(e['ts'] - t) / 1e3:.3f}"
            lines.append(f"  {e['args'].get('stream')} {(e['ts'] - start) / 1e3:9.3f} "
                         f"{e['dur'] / 1e3:8.3f} {lag:>7} {e['name'][:60]}")
    return "\n".join(lines)


if __name__ == "__main__":
    common.run(main)
