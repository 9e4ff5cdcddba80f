"""What NVLink traffic costs a GPU's own work: every rank runs one GPU's causal
forward+backward step while its copy engines write into the next rank's memory.

    mpirun -np 2 python -m benchmarks.nvlink_tax      # 2 H200: about 2 minutes per kernel
    python -m benchmarks.nvlink_tax --tiny            # seconds on a CPU: checks the script

Every schedule of context parallelism moves K/V (and dK/dV) between GPUs while they compute;
``ring`` does it through the copy engines into the next rank's symmetric memory, which needs
no SM. This benchmark takes the attention out of the question: each rank runs the whole
one-GPU problem on its own data, as "every GPU" does in ``benchmarks.context_parallel``, and a
side thread copies from this rank's memory into the next rank's symmetric buffer (mapped here,
as the ring's ``copy_engine`` transport does), in one of these patterns, rounds alternating:

    none              no traffic (every GPU alone)
    1 MiB / 5 ms      a trickle: 0.2 GB/s
    64 MiB / 8 ms     about the bytes a ring on 2 GPUs moves per second (8 GB/s)
    512 MiB / 100 ms  the same bytes in bursts, the links idle between them

``summary`` gives, per kernel and length, each pattern's step time against no traffic (the
median over rounds): the pace a GPU keeps when its links carry traffic, which bounds what any
schedule that communicates during the step can reach against one GPU. On a CPU (``--tiny``)
the copies go into a buffer of this rank. Default problem: b = 1, 32 heads of 128, bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time

import torch

from benchmarks import common

NAME = "nvlink_tax"
PATTERNS = {"none": None, "1 MiB / 5 ms": (1 << 20, 0.005), "64 MiB / 8 ms": (64 << 20, 0.008),
            "512 MiB / 100 ms": (512 << 20, 0.1)}
BUFFER_BYTES = 64 << 20  # the symmetric buffer; larger patterns go in pieces of this size


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=common.int_list, default=common.int_list("32k,128k"))
    p.add_argument("--kernels", default="cudnn,fa4")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="rounds over the patterns")
    p.add_argument("--hold-seconds", type=float, default=2.0,
                   help="untimed steps before each timed run (the clock settles)")
    common.add_distributed_args(p)
    args = p.parse_args(argv)
    args.kernels = [k for k in args.kernels.split(",") if k]
    args.dtype = torch.bfloat16
    if args.tiny:
        args.seq_lens, args.heads, args.head_dim, args.dtype = [128], 2, 16, torch.float32
        args.kernels, args.rounds, args.hold_seconds = ["reference"], 1, 0.05
    scale = 1 / 128 if args.tiny else 1  # tiny: the same patterns, 128 times smaller and faster
    args.patterns = {k: v and (int(v[0] * scale), v[1] * scale) for k, v in PATTERNS.items()}
    args.buffer_bytes = int(BUFFER_BYTES * scale)
    args.name = NAME + ("_tiny" if args.tiny else "")
    return args


class Traffic:
    """A thread that copies ``pattern`` (bytes, pause) from ``source`` into ``target`` on its
    own stream, over and over, in pieces of at most the buffers' size; ``pattern`` None stops
    the copies. ``sent`` counts bytes; ``error`` is what stopped the thread, if anything."""

    def __init__(self, source: torch.Tensor, target: torch.Tensor, owners=()):
        self.source, self.target = source, target
        self._owners = owners  # what keeps target mapped (a symmetric buffer and its handle)
        self.pattern, self.sent, self.error, self._stop = None, 0, None, False
        self._stream = torch.cuda.Stream(source.device) if source.is_cuda else None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._stream is not None:
                torch.cuda.set_device(self.source.device)
            while not self._stop:
                if self.pattern is None:
                    time.sleep(0.002)
                    continue
                nbytes, pause = self.pattern
                self._copy(nbytes)
                self.sent += nbytes
                time.sleep(pause)
        except Exception as e:  # noqa: BLE001 -- reported by check()
            self.error = e

    def _copy(self, nbytes: int) -> None:
        size = self.source.numel()
        on_stream = contextlib.nullcontext() if self._stream is None else torch.cuda.stream(
            self._stream)
        with on_stream:
            for start in range(0, nbytes, size):
                n = min(size, nbytes - start)
                self.target[:n].copy_(self.source[:n], non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()

    def check(self) -> None:
        """Raise if the copies stopped with an error (a measurement without its traffic)."""
        if self.error is not None:
            raise RuntimeError(f"the traffic thread stopped: {type(self.error).__name__}: "
                               f"{self.error}") from self.error

    def close(self) -> None:
        self._stop = True
        self._thread.join()


def peer_buffer(mesh, nbytes: int):
    """(this rank's source, the next rank's symmetric buffer mapped here, what keeps it
    mapped); on a CPU or one rank, a buffer of this rank."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=mesh.device)
    if mesh.device.type != "cuda" or mesh.world_size == 1:
        return source, torch.empty_like(source), ()
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = mesh.group("seq")
    flat = symm_mem.empty(nbytes, dtype=torch.uint8, device=mesh.device)
    handle = symm_mem.rendezvous(flat, group)
    peer = dist.get_group_rank(group, mesh.ranks("seq")[(mesh.rank + 1) % mesh.world_size])
    return source, handle.get_buffer(peer, (nbytes,), torch.uint8, 0), (flat, handle)


def summary(rows: list[dict]) -> list[dict]:
    """Per panel and pattern, the median step time over rounds against no traffic's."""
    out = []
    for panel, times in common.times_by(rows, "pattern").items():
        if "none" not in times:
            continue
        alone = statistics.median(times["none"])
        for pattern, ms in times.items():
            out.append({"panel": panel, "pattern": pattern, "median_ms": statistics.median(ms),
                        "rounds_ms": ms, "pace_vs_none": alone / statistics.median(ms)})
    return out


def case_rows(args, mesh, traffic: Traffic, s: int, kernel: str) -> list[dict]:
    """Every round's row of one kernel and length, patterns alternating."""
    import torch.distributed as dist

    import sdpa_fusion

    inputs = common.random_inputs(1, args.heads, s, args.head_dim, dtype=args.dtype,
                                  device=mesh.device)
    spec = sdpa_fusion.AttentionSpec.from_tensors(*inputs[:3], causal=True)

    def step(x):
        q, k, v, dout = x
        out = sdpa_fusion.attention(q, k, v, causal=True, kernel=kernel)
        return torch.autograd.grad(out, (q, k, v), dout)

    iters = 3 if s > 65536 else 8
    rows = []
    for rnd in range(args.rounds):
        for pattern, copies in args.patterns.items():
            traffic.pattern = copies
            sent, t0 = traffic.sent, time.monotonic()
            m = common.measure(step, [inputs], warmup=1, iters=iters, hold_s=args.hold_seconds,
                               agree=lambda go: any(mesh.agree(go)), before_timing=dist.barrier)
            gbps = (traffic.sent - sent) / (time.monotonic() - t0) / 1e9
            traffic.pattern = None
            traffic.check()
            m = common.combine_ranks(mesh.agree(m))
            rows.append(common.make_row(f"{kernel} s={common.short(s)}", f"{kernel}, {pattern}",
                                        s, m, spec.flops(backward=True), kernel=kernel,
                                        pattern=pattern, round=rnd + 1,
                                        gbps=max(mesh.agree(gbps))))
    del inputs
    return rows


def main(argv=None) -> int:
    import sdpa_fusion

    args = parse_args(argv)
    start = time.monotonic()
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",), timeout=args.timeout_s)
    record = {"title": "every GPU's own causal forward+backward step, with and without "
                       "copy-engine traffic into the next GPU",
              "environment": common.environment("benchmarks.nvlink_tax"),
              "settings": {"seq_lens": args.seq_lens, "kernels": args.kernels,
                           "heads": args.heads, "head_dim": args.head_dim,
                           "dtype": str(args.dtype), "rounds": args.rounds,
                           "hold_s": args.hold_seconds, "ranks": mesh.world_size,
                           "patterns": {k: v and {"bytes": v[0], "pause_s": v[1]}
                                        for k, v in args.patterns.items()}},
              "rows": []}
    traffic = Traffic(*peer_buffer(mesh, args.buffer_bytes))
    deadline = common.Deadline(args.max_seconds)
    try:
        for s in args.seq_lens:
            for kernel in args.kernels:
                if not all(mesh.agree(deadline.left() > 0)):  # a case runs on every rank or none
                    continue
                rows = case_rows(args, mesh, traffic, s, kernel)
                record["rows"] += rows
                if mesh.rank == 0:
                    for row in rows:
                        print(f"[{time.monotonic() - start:6.1f}s] {row['impl']} s={s}: "
                              f"{common.number(row['median_ms'])} ms, {row['gbps']:.1f} GB/s "
                              f"({row['status']})", flush=True)
    finally:
        traffic.close()
    record["summary"] = summary(record["rows"])
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    if mesh.rank == 0:
        for line in record["summary"]:
            print(f"{line['panel']}: {line['pattern']}: {line['median_ms']:.2f} ms, pace "
                  f"against no traffic {line['pace_vs_none']:.4f}")
        common.save(args.name, record, results_dir=args.results_dir, copy_to=args.copy_to,
                    bars=True)
        common.print_failures(record["rows"])
    sdpa_fusion.close_mesh()
    return 0 if all(r["status"] == "ok" for r in record["rows"]) else 1


if __name__ == "__main__":
    common.run(main)
