"""``attention(q, k, v, ...)``: the differentiable entry point, on one device or a mesh."""

from __future__ import annotations

import dataclasses
import logging

import torch

from . import kernels
from .kernels import Dropout, Kernel
from .kernels.base import like_layout
from .layout import Layout, tensor_layout
from .spec import AttentionSpec

log = logging.getLogger("sdpa_fusion")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``attention`` will run: the local spec, the kernel and why, and the schedule."""

    spec: AttentionSpec
    kernel: Kernel
    skipped: tuple[str, ...]
    schedule: object
    why: str = ""  # why ``auto`` chose the kernel

    def __str__(self) -> str:
        lines = [
            f"schedule: {self.schedule}",
            f"local problem: {self.spec}",
            f"kernel: {self.kernel.name}",
        ]
        lines += [f"  {self.why}"] if self.why else []
        lines += [f"  skipped: {reason}" for reason in self.skipped]
        if getattr(self.schedule, "mesh", None) is not None:
            lines.append(f"per rank: {self.schedule.describe(self.schedule.global_spec(self.spec))}")
        return "\n".join(lines)


def _default_schedule():
    from schedules.replicated import Replicated

    return Replicated(None)


def plan(q, k, v, *, causal=False, scale=None, layout="auto", kernel="auto", schedule=None,
         dropout_p=0.0, cu_seqlens=None, cu_seqlens_padded=None, window=None) -> Plan:
    """Validate the call on every rank and choose the kernel; raises the same ValueError on
    every rank of the schedule's mesh when any rank's input is bad, before any data moves."""
    schedule = schedule if schedule is not None else _default_schedule()
    error, spec, chosen = None, None, None
    try:
        packing = schedule.local_packing(q, cu_seqlens, cu_seqlens_padded) \
            if tensor_layout("q", q, layout).is_varlen else None
        if packing is not None:  # the global packing, split: this rank's lengths
            cu_seqlens, cu_seqlens_padded = packing.cu_seqlens, packing.cu_seqlens_padded
        spec = AttentionSpec.from_tensors(
            q, k, v, layout=layout, causal=causal, scale=scale, dropout_p=dropout_p,
            cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded, window=window,
        ).replace(packing=packing)
        schedule.validate(spec)
        chosen = kernels.select(kernel, spec, q.device)
    except ValueError as e:
        error = e
    mesh = getattr(schedule, "mesh", None)
    # A problem every rank already agreed on skips the exchange (a training step's hot path).
    # Kept as the global problem: no rank's packing of a past step stays alive.
    problem = None if error is not None else schedule.global_spec(spec)
    if mesh is not None and mesh.world_size > 1 and (error is not None or problem not in schedule.agreed):
        _agree_on(mesh, schedule, problem, error)
        schedule.agreed.add(problem)
    if error is not None:
        raise error
    return Plan(spec, chosen.kernel, tuple(chosen.skipped), schedule, chosen.why)


def _agree_on(mesh, schedule, problem, error) -> None:
    """Exchange every rank's verdict (its error, or its global problem) and raise the first
    rank's error on all ranks, or an error when the problems differ."""
    verdicts = mesh.agree((str(error) if error else None, problem))
    for rank, (message, _) in enumerate(verdicts):
        if message is not None:
            raise ValueError(f"rank {rank}: {message}") from (error if rank == mesh.rank else None)
    specs = {s for _, s in verdicts}
    if len(specs) > 1:
        shown = "; ".join(f"rank {r}: {s}" for r, (_, s) in enumerate(verdicts))
        raise ValueError(
            f"schedule {schedule.name!r} needs the same local problem on every rank, got (as "
            f"global problems) {shown}; shard every tensor with schedule.shard(...), packed "
            f"tensors with the same global cu_seqlens on every rank"
        )


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: Plan):
        q, k, v = (plan.spec.layout.to(t) for t in (q, k, v))  # layout="auto": one layout
        dropout = Dropout.draw(plan.spec.dropout_p) if plan.spec.dropout_p > 0 else None
        out, lse = plan.schedule.forward(q, k, v, plan.spec, plan.kernel, dropout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.dropout = plan, dropout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        dout = plan.spec.layout.to(dout) if plan.spec.layout.is_varlen else like_layout(dout, q)
        dq, dk, dv = plan.schedule.backward(dout, q, k, v, out, lse, plan.spec, plan.kernel, ctx.dropout)
        return dq, dk, dv, None


def attention(q, k, v, *, causal: bool = False, scale: float | None = None,
              layout: Layout | str = "auto", kernel: str | Kernel = "auto", schedule=None,
              dropout_p: float = 0.0, cu_seqlens=None, cu_seqlens_padded=None,
              window=None) -> torch.Tensor:
    """Scaled-dot-product attention of q [B,H,S,E] over k, v [B,H_kv,S_kv,E] (or packed THD).

    ``schedule=None`` runs on one device; a schedule from ``schedules.get`` runs over its
    mesh on this rank's shards. ``kernel`` names the local kernel ("auto", "cudnn", "fa4",
    "flash", "nvfuser", "reference"). ``window=(left, right)`` keeps key j for query i when
    ``i - left <= j <= i + right`` (top-left aligned, per sequence when packed; None on a side
    is unbounded). ``layout="auto"`` reads each tensor's memory order (k and v are copied to
    q's when they differ); an explicit layout a tensor contradicts is a ValueError.
    Differentiable in q, k, v. DTensors sharded the way the schedule shards
    are accepted and a DTensor is returned.
    """
    from .dtensor import unwrap_dtensors

    (q, k, v), rewrap = unwrap_dtensors((q, k, v), schedule)
    p = plan(q, k, v, causal=causal, scale=scale, layout=layout, kernel=kernel, schedule=schedule,
             dropout_p=dropout_p, cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded,
             window=window)
    if p.skipped:
        log.info("%s (skipped: %s)", p.why, "; ".join(p.skipped))
    return rewrap(_Attention.apply(q, k, v, p))


def explain(q, k, v, **kwargs) -> Plan:
    """The plan ``attention(q, k, v, **kwargs)`` would run: kernel chosen (and why), schedule
    and per-rank cost. Accepts the same keywords as ``attention``."""
    return plan(q, k, v, **kwargs)
