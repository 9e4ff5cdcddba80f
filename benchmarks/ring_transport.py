"""Ring transports side by side: one ring shift of a K/V block, alone and during attention.

    mpirun -np 2 python -m benchmarks.ring_transport        # ~1 min on 2 H200s

For each sequence length s the block is what ring attention passes at every step: K and V of
s / P tokens (b=1, 32 heads of 128, bf16). Each transport (``schedules.transport``: NCCL
send/receive ``p2p``, symmetric-memory ``copy_engine``) shifts it around the ring:
  alone              the shift by itself (``gbps``: bytes received / time)
  during attention   the shift started, then a causal cuDNN attention forward over the local
                     tokens, then the wait: what a ring step costs when both overlap. The row
                     "attention alone" is the same attention without a transfer; the closer a
                     transport's time is to it, the better the transfer hides (NCCL's kernels
                     take SMs from attention, the copy engines do not).
Times are the slowest rank's median (ms).
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import common

NAME = "ring_transport"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=common.int_list, default=common.int_list("32k,64k,128k,256k"))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--transports", default="copy_engine,p2p")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    common.add_distributed_args(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_lens, args.heads, args.head_dim, args.iters = [64, 128], 4, 16, 3
    args.transports = [t for t in args.transports.split(",") if t]
    args.name = NAME + ("_tiny" if args.tiny else "")
    return args


def main(argv=None) -> int:
    import sdpa_fusion
    from schedules.comm import Communicator
    from schedules.transport import RingData, mover
    from sdpa_fusion.layout import Layout

    args = parse_args(argv)
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",),
                                 timeout=datetime.timedelta(seconds=args.timeout_s))
    comm = Communicator(mesh.group("seq"), mesh.ranks("seq"), mesh.coordinate("seq"),
                        timeout=mesh.timeout)
    record = {"title": f"ring transports over {mesh.world_size} ranks",
              "environment": common.environment("benchmarks.ring_transport"),
              "settings": {"seq_lens": args.seq_lens, "heads": args.heads,
                           "head_dim": args.head_dim, "dtype": "bf16",
                           "transports": args.transports, "warmup": args.warmup,
                           "iters": args.iters,
                           "timing": "slowest rank's median; iterations back to back after a "
                                     "barrier"},
              "rows": []}
    deadline, start = common.Deadline(args.max_seconds), time.monotonic()
    try:
        for s in args.seq_lens:
            if not mesh.agree(deadline.left() > 0)[0]:
                continue
            q, k, v = (torch.randn(1, args.heads, s // mesh.world_size, args.head_dim,
                                   dtype=torch.bfloat16, device=mesh.device) for _ in range(3))
            block = 2 * k.numel() * k.element_size()

            def attention():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            timed = _timer(args, mesh, [(q,)])
            record["rows"].append(_row("during attention", "attention alone", s, block,
                                       timed(lambda _: attention())))
            for transport in args.transports:
                try:
                    (ring,) = mover(comm, transport, mesh.device).rings(
                        [RingData((tuple(k.shape), tuple(v.shape)), k.dtype, Layout.BHSE)],
                        mesh.device)
                except Exception as e:  # noqa: BLE001 -- the same on every rank: recorded
                    failed = common.failure(e)
                    record["rows"] += [_row(p, transport, s, block, failed)
                                       for p in ("alone", "during attention")]
                    continue

                def overlapped(_):
                    pending = ring.shift((k, v))  # the own K/V, as the ring's first shift
                    attention()
                    pending.wait()

                record["rows"].append(_row("alone", transport, s, block,
                                           timed(lambda _: ring.shift((k, v)).wait())))
                record["rows"].append(_row("during attention", transport, s, block,
                                           timed(overlapped)))
                del ring
            if mesh.rank == 0:
                cells = ", ".join(f"{r['panel']}/{r['impl']}={common.number(r['median_ms'])} ms"
                                  for r in record["rows"] if r["seq_len"] == s)
                print(f"[{time.monotonic() - start:6.1f}s] s={common.short(s)}: {cells}",
                      flush=True)
                common.save(args.name, record, args, plot=False)
        if mesh.rank == 0:
            common.save(args.name, record, args, metrics=("median_ms", "gbps"))
            print(common.format_table(record["rows"], row_keys=("panel", "seq_len"),
                                      value="median_ms"))
            common.print_failures(record["rows"])
    finally:
        sdpa_fusion.close_mesh()
    return 0


def _timer(args, mesh, inputs):
    def timed(step):
        m = common.measure(step, inputs, warmup=args.warmup, iters=args.iters,
                           before_timing=dist.barrier)
        return common.combine_ranks(mesh.agree(m))

    return timed


def _row(panel, impl, s, block_bytes, m) -> dict:
    row = {"panel": panel, "impl": impl, "seq_len": s, "block_bytes": block_bytes,
           **m.as_dict()}
    transfer = panel == "alone" and m.status == "ok"
    row["gbps"] = block_bytes / (m.median_ms * 1e-3) / 1e9 if transfer else None
    return row


if __name__ == "__main__":
    common.run(main)
