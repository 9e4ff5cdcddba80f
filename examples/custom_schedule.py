"""Writing your own schedule: ``gather_kv``, registered and run like the built-in ones.

    mpirun -np 4 python examples/custom_schedule.py

Each rank keeps S/P contiguous tokens of q, k and v. The forward all-gathers K and V and
attends the rank's queries to every key with the local kernel; the backward gathers them
again, computes this rank's queries' share of dK and dV for every key, and sums the shares
over the ranks (a reduce-scatter). Its transfers go through the schedule's communicator
(``self.comm``), so ``describe()`` comes from a dry run of this very code: its kernel calls,
FLOPs, the bytes it moves and the memory it holds. No mask: ``causal=True`` is refused by ``validate`` with the fix. The walk
through this file is docs/custom_schedule.md.
"""

from __future__ import annotations

import sys

import torch

import schedules
import sdpa_fusion
from schedules import Schedule, dry_run


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

    def _gather(self, t: torch.Tensor, spec) -> torch.Tensor:
        """Every rank's ``t`` concatenated along the sequence, in the spec's layout."""
        parts = self.comm.all_gather(t).wait()  # [P, B, H, S/P, E], in rank order
        return spec.layout.to(torch.cat(parts.unbind(0), dim=2))

    def forward(self, q, k, v, spec, kernel, dropout=None):
        k_all, v_all = self._gather(k, spec), self._gather(v, spec)
        return kernel.forward(q, k_all, v_all, causal=False, scale=spec.softmax_scale)

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        k_all, v_all = self._gather(k, spec), self._gather(v, spec)
        dq, dk_all, dv_all = kernel.backward(dout, q, k_all, v_all, out, lse, causal=False,
                                             scale=spec.softmax_scale)
        return dq, self._sum_shares(dk_all, k), self._sum_shares(dv_all, v)

    def _sum_shares(self, grad_all: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's keys' gradient: every rank's share summed in fp32 (a reduce-scatter
        of the shares of each rank's keys), in the layout and dtype of ``like``."""
        shares = torch.stack(grad_all.float().chunk(self.size, dim=2))  # [P, B, H, S/P, E]
        return torch.empty_like(like).copy_(self.comm.reduce_scatter(shares))

    def describe(self, spec):
        """Kernel calls, FLOPs, bytes and memory per rank for the global ``spec``: what a dry
        run of this forward and backward does (data-less tensors, nothing moved)."""
        return dry_run.describe(self, spec)


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
