"""Writing your own schedule: ``gather_kv``, registered and run like the built-in ones.

    mpirun -np 4 python examples/custom_schedule.py

Each rank keeps S/P contiguous tokens of q, k and v. The schedule is a planner: its
``plan`` lists the ops of a call (``schedules.runner``), and the one runner of every
sequence schedule runs them. The forward gathers K and V and attends the rank's queries to
every key; the backward gathers them again, computes this rank's queries' share of dK and
dV for every key, and sums the shares over the ranks (a reduce-scatter). Its transfers go
through the schedule's communicator (``self.comm``), so ``describe()`` comes from a dry run
of this very code: its kernel calls, FLOPs, the bytes it moves and the memory it holds. No
mask: ``causal=True`` is refused by ``validate`` with the fix. The walk through this file is
docs/custom_schedule.md.
"""

from __future__ import annotations

import sys

import torch

import schedules
import sdpa_fusion
from schedules import Schedule, dry_run, runner
from schedules.calls import DenseCall


class GatherKV(Schedule):
    """q, k, v split along the sequence in contiguous chunks; K/V gathered on every rank."""

    name = "gather_kv"  # schedules.get("gather_kv", mesh)
    sharded_dim = 2  # the base class's shard/unshard cut dim 2 (the sequence) in P chunks

    def global_spec(self, spec):
        """The whole problem, from this rank's part of it."""
        return spec.replace(q_len=spec.q_len * self.size, kv_len=spec.kv_len * self.size)

    def validate(self, spec):
        super().validate(spec)  # packed layouts, windows, dropout: refused by the base class
        if spec.causal:
            raise ValueError(
                "schedule 'gather_kv' attends every query to every key; causal=True needs the "
                "positions of each rank's tokens: use schedule 'allgather' or 'ring'"
            )

    def plan(self, spec, *, backward: bool) -> runner.Plan:
        """This rank's ops: gather K and V, then one call of its queries over every key; in
        backward that call's dK and dV of every key (SUMS) go to their owners (Scatter)."""
        every_key = (DenseCall(slice(None), slice(None), causal=False),)
        stream = ("gather_kv", self.index)  # the call's dropout stream (none here)
        if backward:
            ops = [runner.Gather(0), runner.OpenDq(0, contributions=1), runner.KV(0, arrives=True),
                   runner.Grads(every_key, stream, runner.SUMS), runner.Drop(),
                   runner.FinishDq(), runner.Scatter(0)]
        else:
            ops = [runner.Gather(0), runner.KV(0, arrives=True), runner.Open(0, blocks=1),
                   runner.Fold(every_key, stream), runner.Finish()]
        return runner.Plan(tuple(ops), groups=1, sums=(torch.float32, 0),
                           transfers=Transfers(self, spec))

    def forward(self, q, k, v, spec, kernel, dropout=None):
        return runner.forward(self.plan(spec, backward=False), q, k, v, spec, kernel, None)

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        return runner.backward(self.plan(spec, backward=True), dout, q, k, v, out, lse, spec,
                               kernel, None)

    def describe(self, spec):
        """Kernel calls, FLOPs, bytes and memory per rank for the global ``spec``: what a dry
        run of this forward and backward does (data-less tensors, nothing moved)."""
        return dry_run.describe(self, spec)


class Transfers:
    """How a call's K/V come to every rank and their gradients go home (``Plan.transfers``)."""

    def __init__(self, schedule: GatherKV, spec):
        self.schedule, self.size, self.layout = schedule, schedule.size, spec.layout

    @property
    def comm(self):  # read when a call runs: a plan may be made on a VirtualMesh
        return self.schedule.comm

    def begin(self, tensors, groups, backward: bool) -> None:
        self.tensors = tensors  # the call's q, k, v, ... (and in backward dq, dk, dv)

    def gather(self, group):
        """Every rank's K and V, concatenated along the sequence in rank order."""
        every = [self.comm.all_gather(self.tensors[name]).wait() for name in ("k", "v")]
        return runner.Arriving([self.layout.to(torch.cat(t.unbind(0), dim=2)) for t in every])

    def scatter(self, group, parts, sums) -> None:
        """This rank's keys' dK and dV: every rank's share summed in fp32 (a reduce-scatter
        of the shares of each rank's keys)."""
        for name, grad_all in zip(("dk", "dv"), sums):
            shares = torch.stack(grad_all.chunk(self.size, dim=2))  # [P, B, H, S/P, E]
            self.tensors[name].copy_(self.comm.reduce_scatter(shares))


schedules.register(GatherKV)


def run(mesh, *, seq_len=None, heads=4, head_dim=32) -> dict[str, float]:
    """max |error| / max |one device| of out, dq, dk, dv under gather_kv."""
    seq_len = seq_len or 16 * mesh.size()
    g = torch.Generator(device=mesh.device).manual_seed(0)
    q, k, v, dout = (torch.randn(2, heads, seq_len, head_dim, generator=g, device=mesh.device)
                     for _ in range(4))
    sched = schedules.get("gather_kv", mesh)
    q_l, k_l, v_l = (sched.shard(t).requires_grad_() for t in (q, k, v))
    out_l = sdpa_fusion.attention(q_l, k_l, v_l, schedule=sched)
    out_l.backward(sched.shard(dout))
    got = [sched.unshard(t) for t in (out_l, q_l.grad, k_l.grad, v_l.grad)]
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    out1 = sdpa_fusion.attention(q1, k1, v1)
    out1.backward(dout)
    return {name: ((a - b).abs().max() / b.abs().max()).item()
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, (out1, q1.grad, k1.grad, v1.grad))}


def main() -> int:
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",))
    errors = run(mesh)
    ok = max(errors.values()) < 1e-5
    if mesh.rank == 0:
        print(f"gather_kv (registered: {'gather_kv' in schedules.names()}) over {mesh.size()} "
              f"ranks, fp32, vs one device: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
              + (" ok" if ok else " FAILED"))
    sdpa_fusion.close_mesh()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
