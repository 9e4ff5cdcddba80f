"""Packed batches split over P virtual ranks on one GPU: each rank's step timed alone.

    python -m benchmarks.virtual_ranks --ranks 2,4,8 --batches a,b,c,d        # one H200
    python -m benchmarks.virtual_ranks --tiny                                   # CPU smoke

Each of the P ranks of ``schedules.get(schedule, VirtualMesh(rank=r), partition=...)`` runs
on the one device. First all P run together, one thread each, their transfers served from a
mailbox (``VirtualMover``: what a rank sends is cloned into the receiver's queue); the
receives of the rank to be timed are recorded, the P ranks' outputs and gradients are put
back in batch order and checked on sampled rows against fp32 math (``benchmarks.check``).
Then that rank alone runs causal fwd+bwd again, timed, its receives copied from the record
(a copy stands for each transfer; its bytes are counted). A row is the slowest rank's median
time next to one GPU's on the whole batch (same run): the goal is slowest x P <= 1.1 x one
GPU. Batches (bf16, 32 heads of 128): a 15 documents of 1K-32K; b 2048 x 128; c 6 of 8K-24K
and 1,500 of 16-600; d log-normal lengths (median 600, sigma 1.2) in [16, 65536] packed to
262,144 tokens. JSON and PNG through ``benchmarks.common.save``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import threading
import time

import torch

from benchmarks import check, common
from benchmarks.thd import BATCHES as THD_BATCHES
from schedules.transport import Mover

NAME = "virtual_ranks"
K = 1024


def batches(tiny: bool) -> dict[str, list[int]]:
    """The four packed batches (their document lengths), or small ones for ``tiny``."""
    g = torch.Generator().manual_seed(0)
    if tiny:
        return {"a": [64, 32, 48], "b": [8] * 64, "c": [40, 56] + [2, 5, 9] * 10,
                "d": _lognormal(g, 12.0, 1.2, 2, 128, 512)}
    c = (torch.randint(8 * K, 24 * K + 1, (6,), generator=g).tolist()
         + torch.randint(16, 601, (1500,), generator=g).tolist())
    return {"a": THD_BATCHES["a"], "b": THD_BATCHES["b"], "c": c,
            "d": _lognormal(g, 600.0, 1.2, 16, 65536, 262144)}


def _lognormal(g, median, sigma, low, high, total) -> list[int]:
    lengths = []
    while sum(lengths) < total:
        n = int(median * math.exp(sigma * float(torch.randn((), generator=g))))
        lengths.append(min(max(n, low), high, total - sum(lengths)))
    return lengths


class Mailbox:
    """Transfers between the threads of virtual ranks: a queue per (sender, receiver), and
    the receives of rank ``target`` recorded in order (``replay`` serves them again)."""

    def __init__(self, parts: int, target: int, timeout_s: float = 600.0):
        self.parts, self.target, self.timeout_s = parts, target, timeout_s
        self.queues = collections.defaultdict(collections.deque)
        self.ready = threading.Condition()
        self.record: list[torch.Tensor] = []
        self.replaying, self.cursor = False, 0

    def send(self, src: int, dst: int, t: torch.Tensor) -> None:
        with self.ready:
            self.queues[(src, dst)].append(t.clone())
            self.ready.notify_all()

    def receive(self, src: int, dst: int, into: torch.Tensor) -> None:
        if self.replaying:
            into.copy_(self.record[self.cursor].view_as(into))
            self.cursor += 1
            return
        with self.ready:
            if not self.ready.wait_for(lambda: self.queues[(src, dst)], self.timeout_s):
                raise TimeoutError(f"virtual rank {dst} waited for rank {src}")
            t = self.queues[(src, dst)].popleft()
        into.copy_(t.view_as(into))
        if dst == self.target:
            self.record.append(t)


class VirtualComm:
    """The communicator of virtual rank ``index`` of ``size``: counts bytes, waits for nothing
    (the mailbox hands transfers over when they are made)."""

    def __init__(self, index: int, size: int):
        self.index, self.size = index, size
        self.bytes_sent = self.bytes_received = 0

    def peer(self, hops: int) -> int:
        return (self.index + hops) % self.size

    def count(self, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received

    def pending(self, works, result, what: str):
        return _Done(result)

    @contextlib.contextmanager
    def running(self, what: str):
        yield


class _Done:
    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result


class VirtualMover(Mover):
    """Ring shifts and exchanges of a virtual rank through the ``Mailbox``."""

    name = "virtual"

    def __init__(self, comm: VirtualComm, mailbox: Mailbox):
        super().__init__(comm)
        self.mailbox = mailbox

    def buffer(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def push(self, tensors, ring, slot, hops=1):
        comm, box = self.comm, self.mailbox
        for t in tensors:
            if not box.replaying:
                box.send(comm.index, comm.peer(hops), t)
        for into in ring.tensors(slot):
            box.receive(comm.peer(-hops), comm.index, into)
        comm.count(ring.data.used, ring.data.used)
        return []

    def _exchange(self, puts, takes, region):
        comm, box, flat = self.comm, self.mailbox, region.flat
        for p in puts:
            if p.hops % comm.size == 0:
                flat[p.at:p.at + p.nbytes].copy_(p.bytes())
            elif not box.replaying:
                box.send(comm.index, comm.peer(p.hops), p.bytes())
        for t in takes:
            box.receive(comm.peer(-t.hops), comm.index, flat[t.at:t.at + t.nbytes])
        return []


def virtual_schedule(name: str, parts: int, rank: int, device, mailbox: Mailbox, **options):
    """Schedule ``name`` of virtual rank ``rank`` of ``parts``, its transfers in ``mailbox``."""
    import schedules
    import sdpa_fusion

    mesh = sdpa_fusion.VirtualMesh((parts,), ("seq",), rank=rank, device=device)
    sched = schedules.get(name, mesh, transport="p2p", **options)
    comm = VirtualComm(rank, parts)
    sched.__dict__["comm"] = comm
    sched._movers[torch.device(device)] = VirtualMover(comm, mailbox)
    return sched


def run_ranks(args, parts: int, target: int, inputs, cu, partition: str):
    """All ``parts`` virtual ranks once, in threads: (schedules, each rank's results and
    packing, mailbox holding ``target``'s receives)."""
    import sdpa_fusion

    box = Mailbox(parts, target)
    scheds = [virtual_schedule(args.schedule, parts, r, inputs[0].device, box,
                               partition=partition) for r in range(parts)]
    results, errors = [None] * parts, []

    def rank(r):
        try:
            sched = scheds[r]
            local = sched.pack(cu)
            q, k, v = (local.shard(t).requires_grad_() for t in inputs[:3])
            out = sdpa_fusion.attention(q, k, v, layout="thd", causal=True, kernel=args.kernel,
                                        schedule=sched, cu_seqlens=local)
            out.backward(local.shard(inputs[3]))
            results[r] = (local, [t.detach() for t in (out, q.grad, k.grad, v.grad)])
        except BaseException as e:  # noqa: BLE001 -- raised again below
            errors.append(e)
            with box.ready:
                box.timeout_s = 0.0
                box.ready.notify_all()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return scheds, results, box


def assembled(results, total: int) -> list[torch.Tensor]:
    """out, dq, dk, dv of the whole batch from every rank's part."""
    full = []
    for i in range(4):
        like = results[0][1][i]
        t = like.new_zeros((total, *like.shape[1:]))
        for local, tensors in results:
            rows = local.token_index
            t[rows[rows >= 0]] = tensors[i][rows >= 0]
        full.append(t)
    return full


def rank_step(args, sched, inputs, cu, box: Mailbox):
    """(step, leaves): ``sched``'s rank alone, its receives replayed from ``box``."""
    import sdpa_fusion

    local = sched.pack(cu)
    leaves = [local.shard(t).detach() for t in inputs]
    box.replaying = True

    def step(x):
        box.cursor = 0
        q, k, v = (t.requires_grad_() for t in x[:3])
        out = sdpa_fusion.attention(q, k, v, layout="thd", causal=True, kernel=args.kernel,
                                    schedule=sched, cu_seqlens=local)
        return torch.autograd.grad(out, (q, k, v), x[3])

    return step, leaves


def batch_rows(args, batch: str, lengths: list[int]) -> list[dict]:
    import sdpa_fusion

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    total = sum(lengths)
    inputs = [torch.randn(total, args.heads, args.head_dim, device=device, generator=g)
              .to(args.dtype) for _ in range(4)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    spec = sdpa_fusion.AttentionSpec.from_tensors(*inputs[:3], layout="thd", cu_seqlens=cu,
                                                  causal=True)
    flops = spec.flops(backward=True)
    fields = dict(batch=batch, documents=len(lengths), tokens=total, heads=args.heads,
                  head_dim=args.head_dim, dtype=str(args.dtype), mode="fwd+bwd")
    panel, mean = f"batch {batch} ({len(lengths)} documents)", total // len(lengths)

    def whole(x):
        q, k, v = (t.detach().requires_grad_() for t in x[:3])
        out = sdpa_fusion.attention(q, k, v, layout="thd", causal=True, kernel=args.kernel,
                                    cu_seqlens=cu)
        return torch.autograd.grad(out, (q, k, v), x[3])

    one = common.measure(whole, [inputs], warmup=args.warmup, iters=args.iters)
    rows = [common.make_row(panel, f"1 GPU {args.kernel}", mean, one, flops, ranks=1, **fields)]
    for partition in args.partitions:
        for parts in args.ranks:
            rows.append(ranks_row(args, parts, partition, inputs, cu, one, flops, panel, mean,
                                  fields))
    return rows


def ranks_row(args, parts, partition, inputs, cu, one, flops, panel, mean, fields) -> dict:
    """The row of ``parts`` virtual ranks: each rank timed alone, the slowest kept."""
    per_rank, sent, report = [], [], None
    try:
        for r in range(parts):
            scheds, results, box = run_ranks(args, parts, r, inputs, cu, partition)
            if r == 0:
                report = check.check_packed(*inputs, *assembled(results, len(inputs[0])),
                                            cu.tolist(), causal=True).as_dict()
            comm = scheds[r].comm
            sent.append(comm.bytes_sent)
            step, leaves = rank_step(args, scheds[r], inputs, cu, box)
            per_rank.append(common.measure(step, [leaves], warmup=args.warmup,
                                           iters=args.iters))
            tokens = results[r][0].tokens
            fields = dict(fields, **{f"rank{r}_tokens": tokens})
            del scheds, results, box
        m = max(per_rank, key=lambda x: x.median_ms or math.inf)
        if report is not None and not report["right"]:
            m = common.Measurement(status="wrong", error=check.line(report))
    except Exception as e:  # noqa: BLE001 -- recorded
        m = common.failure(e)
    ratio = (m.median_ms * parts / one.median_ms) if m.median_ms and one.median_ms else None
    return common.make_row(panel, f"{partition} P={parts}", mean, m, flops / parts,
                           ranks=parts, partition=partition, slowest_x_p_over_one_gpu=ratio,
                           goal=1.1, bytes_sent_per_rank=sent,
                           check=None if report is None else check.line(report), **fields)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=common.int_list, default=[2, 4, 8])
    p.add_argument("--batches", default="a,b,c,d")
    p.add_argument("--partitions", default="documents,load_balanced")
    p.add_argument("--schedule", default="ring", help="ring or allgather")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="small batches, reference kernel, CPU")
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.batches = [b for b in args.batches.split(",") if b]
    args.partitions = [x for x in args.partitions.split(",") if x]
    args.dtype = torch.bfloat16
    if args.tiny:
        args.heads, args.head_dim, args.dtype, args.kernel = 4, 16, torch.float32, "reference"
        args.warmup, args.iters = 0, 1
        args.ranks = [r for r in args.ranks if r <= 4]
    args.name = NAME + ("_tiny" if args.tiny else "")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    record = {"title": f"packed batches over virtual ranks ({args.schedule}), one device",
              "environment": common.environment("benchmarks.virtual_ranks"),
              "settings": {k: str(v) if isinstance(v, torch.dtype) else v
                           for k, v in vars(args).items() if k not in ("results_dir",)},
              "rows": []}
    lengths = batches(args.tiny)
    for batch in args.batches:
        record["rows"] += batch_rows(args, batch, lengths[batch])
        print(f"[{time.monotonic() - start:6.1f}s] batch {batch}: " + ", ".join(
            f"{r['impl']}={common.number(r.get('slowest_x_p_over_one_gpu'))}"
            for r in record["rows"] if r["batch"] == batch), flush=True)
    record["elapsed_s"] = round(time.monotonic() - start, 1)
    paths = common.save(args.name, record, results_dir=args.results_dir, copy_to=args.copy_to,
                        metrics=("tflops",), bars=True)
    print(common.format_table(record["rows"], row_keys=("panel",)))
    common.print_failures(record["rows"])
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    common.run(main)
