"""What each mesh dim of a ``hybrid`` costs a rank: its schedule's steps, bytes and memory
(``schedules.dry_run``) for the problem of one line of that dim."""

from __future__ import annotations

import dataclasses

from .base import Description, Schedule


@dataclasses.dataclass(frozen=True)
class DimCost:
    """What one mesh dim of the hybrid costs each rank, for the problem of one line of it."""

    dim: str
    description: Description

    @property
    def memory(self) -> int:
        """Bytes the dim's schedule holds at its forward's peak beyond outputs, kept included."""
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
    """The ``HybridDescription`` of ``inner`` (on ``line``) x ``outer`` for the global ``spec``."""
    heads = spec.replace(heads=spec.heads // inner.size,  # a K/V head at least
                         kv_heads=max(spec.kv_heads // inner.size, 1))
    dims = tuple(DimCost(s.dim, s.describe(d)) for s, d in ((inner, line), (outer, heads)))
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
              f"calls on H/{inner.size} heads; bytes add both dims")
