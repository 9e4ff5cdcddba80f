"""What each mesh dim of a ``hybrid`` costs a rank: its schedule's steps and bytes for the
problem of one line of that dim, and the bytes of the buffers its communication holds."""

from __future__ import annotations

import dataclasses

from .base import Description, Schedule


@dataclasses.dataclass(frozen=True)
class DimCost:
    """What one mesh dim of the hybrid costs each rank: its schedule's description for the
    problem of one line of that dim, and the bytes of the buffers its communication holds at
    its peak (see ``buffer_bytes``)."""

    dim: str
    description: Description
    memory: int
    backward_memory: int


@dataclasses.dataclass(frozen=True)
class HybridDescription(Description):
    """A ``Description`` of the whole step plus one ``DimCost`` per mesh dim (inner first)."""

    dims: tuple[DimCost, ...] = ()


def describe_dims(inner: Schedule, outer: Schedule, spec, line) -> HybridDescription:
    """The ``HybridDescription`` of ``inner`` x ``outer`` for the global ``spec``: the inner
    schedule on ``line`` (the global problem of this rank's inner line: all heads of the
    tokens of its outer rank), the outer one on the heads of one inner rank (all tokens)."""
    heads = spec.replace(heads=spec.heads // inner.size,
                         kv_heads=max(spec.kv_heads // inner.size, 1))
    dims = tuple(DimCost(s.dim, s.describe(d), *buffer_bytes(s, d))
                 for s, d in ((inner, line), (outer, heads)))
    i, o = (d.description for d in dims)
    return HybridDescription(
        "hybrid", inner.size * outer.size, steps=o.steps,
        bytes_sent=i.bytes_sent + o.bytes_sent,
        bytes_received=i.bytes_received + o.bytes_received, flops=o.flops,
        backward_steps=o.backward_steps,
        backward_bytes_sent=i.backward_bytes_sent + o.backward_bytes_sent,
        backward_bytes_received=i.backward_bytes_received + o.backward_bytes_received,
        backward_flops=o.backward_flops, dims=dims,
        notes=f"{inner.name} over {inner.dim}={inner.size} x {outer.name} over "
              f"{outer.dim}={outer.size}; steps and flops are the outer schedule's kernel "
              f"calls on H/{inner.size} heads; bytes add both dims",
    )


def buffer_bytes(sched: Schedule, spec) -> tuple[int, int]:
    """(forward, backward) bytes per rank of the buffers that schedule ``sched`` holds for its
    communication at its peak, for the global ``spec`` of its line (inputs, outputs, fp32
    accumulators and kernel workspace not counted; ring slots are also rounded up to 512
    bytes each):

        head_parallel  none
        ulysses        send and receive buffers of the all-to-all of q, k, v (forward) and
                       of dout, q, k, v, out (backward)
        ring           two K/V slots, and in backward two fp32 dK/dV slots (none when p = 1)
        allgather      every rank's K/V and the others' in token order; backward adds the
                       others' fp32 dK/dV and the fp32 input of the reduce-scatter
    """
    name, p = sched.name, sched.size
    if name == "head_parallel":
        return 0, 0
    size = spec.dtype.itemsize
    e, b = spec.head_dim, spec.batch
    rows = sched.local_tokens(spec)  # K/V rows per rank (packed: padding included)
    q_rows = rows if spec.layout.is_varlen else spec.q_len // p
    kv_block = 2 * b * spec.kv_heads * rows * e  # K and V of one rank's tokens
    if name == "ulysses":
        q = b * spec.heads * q_rows * e
        kv = b * max(spec.kv_heads // p, 1) * rows * p * e
        return 2 * (q + 2 * kv) * size, 2 * (3 * q + 2 * kv) * size
    if name == "ring":
        return (0, 0) if p == 1 else (2 * kv_block * size, 2 * kv_block * (size + 4))
    blocks = (2 * p - 1) * kv_block  # allgather
    return blocks * size, blocks * (size + 4)
