"""What each mesh dim of a ``hybrid`` costs a rank: its schedule's steps, bytes and memory for
the problem of one line of that dim, and what the two dims together allocate.

Memory has one source, a dry run of the schedules' own code (``schedules.dry_run``): each
dim's is its 1-D schedule's for the line's problem, the whole step's the hybrid's own."""

from __future__ import annotations

import dataclasses

from .base import Description, Schedule


@dataclasses.dataclass(frozen=True)
class DimCost:
    """What one mesh dim of the hybrid costs each rank: its schedule's description for the
    problem of one line of that dim."""

    dim: str
    description: Description

    @property
    def memory(self) -> int:
        """Bytes the dim's schedule holds at the peak of its forward beyond its outputs, kept
        buffers included (``Description.memory``; 0 for a schedule that does not say)."""
        m = self.description.memory
        return 0 if m is None else m.kept + m.forward

    @property
    def backward_memory(self) -> int:
        """The same at the peak of its backward (its gradients included)."""
        m = self.description.memory
        return 0 if m is None else m.kept + m.backward


@dataclasses.dataclass(frozen=True)
class HybridDescription(Description):
    """A ``Description`` of the whole step plus one ``DimCost`` per mesh dim (inner first)."""

    dims: tuple[DimCost, ...] = ()


def describe_dims(inner: Schedule, outer: Schedule, spec, line, memory_of) -> HybridDescription:
    """The ``HybridDescription`` of ``inner`` x ``outer`` for the global ``spec``: the inner
    schedule on ``line`` (the global problem of this rank's inner line: all heads of the
    tokens of its outer rank), the outer one on the heads of one inner rank (all tokens);
    ``memory_of``: the whole step's ``Description.memory_of``."""
    dims = tuple(DimCost(s.dim, s.describe(d))
                 for s, d in ((inner, line), (outer, _heads(spec, inner.size))))
    i, o = (d.description for d in dims)
    return HybridDescription(
        "hybrid", inner.size * outer.size, steps=o.steps,
        bytes_sent=i.bytes_sent + o.bytes_sent,
        bytes_received=i.bytes_received + o.bytes_received, flops=o.flops,
        backward_steps=o.backward_steps,
        backward_bytes_sent=i.backward_bytes_sent + o.backward_bytes_sent,
        backward_bytes_received=i.backward_bytes_received + o.backward_bytes_received,
        backward_flops=o.backward_flops, dims=dims, memory_of=memory_of,
        notes=f"{inner.name} over {inner.dim}={inner.size} x {outer.name} over "
              f"{outer.dim}={outer.size}; steps and flops are the outer schedule's kernel "
              f"calls on H/{inner.size} heads; bytes add both dims",
    )


def _heads(spec, parts: int):
    """``spec`` with the heads of one of ``parts`` inner ranks (a K/V head at least)."""
    return spec.replace(heads=spec.heads // parts, kv_heads=max(spec.kv_heads // parts, 1))
