"""What a schedule's call allocates on each rank: the memory half of ``describe()``.

Every sequence schedule counts, for the problem it is given, the bytes of each buffer it
holds at the peak of its forward and of its backward (its module docstring lists them), so
that the memory of a step is designed, not measured afterwards; tests check the count against
what the schedule allocates on CPU ranks, and a GPU test against ``max_memory_allocated``.
Kernels' own workspace is counted as the fp32 dQ of a call's queries that FlashAttention and
cuDNN backwards keep, and with GQA FlashAttention-4's fp32 dK and dV (``kernel_workspace``).
"""

from __future__ import annotations

import dataclasses

from sdpa_fusion.spec import AttentionSpec

from .calls import PackedCall, gathered, keys_of, rows_of


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one rank allocates for one call of a schedule (the inputs q, k, v and dout not
    counted).

    outputs   out and lse, made by the forward and held (saved for backward) until it ends
    forward   the forward's peak beyond its outputs (slots, accumulators, kernel results)
    backward  the backward's peak beyond the saved outputs (dq, dk, dv included)
    kept      held between calls outside torch's caching allocator (the ring's symmetric
              slots), in forward and backward alike
    """

    outputs: int
    forward: int
    backward: int
    kept: int = 0

    @property
    def step(self) -> int:
        """The peak of a forward and backward step, kept buffers included: what the
        benchmarks call a step's memory."""
        return self.kept + self.outputs + max(self.forward, self.backward)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Bytes of the tensors of one rank's part of a problem: ``rows`` local query (and key)
    rows, ``groups`` head groups."""

    spec: AttentionSpec
    rows: int
    groups: int = 1

    def q(self, rows: int | None = None, itemsize: int | None = None) -> int:
        """Bytes of the query heads of a head group, over ``rows`` rows (all by default)."""
        return self._tensor(self.spec.heads, rows, itemsize)

    def kv(self, rows: int | None = None, itemsize: int | None = None) -> int:
        """Bytes of the K/V heads of a head group (one of K or V)."""
        return self._tensor(self.spec.kv_heads, rows, itemsize)

    def lse(self, rows: int | None = None) -> int:
        """Bytes of the fp32 lse of a head group's queries."""
        return self.spec.batch * self.spec.heads // self.groups * self._rows(rows) * 4

    def _rows(self, rows):
        return self.rows if rows is None else rows

    def _tensor(self, heads, rows, itemsize) -> int:
        itemsize = self.spec.dtype.itemsize if itemsize is None else itemsize
        return (self.spec.batch * heads // self.groups * self._rows(rows) * self.spec.head_dim
                * itemsize)


class Replay:
    """Bytes held as a schedule's allocations are replayed in order: ``add`` what is
    allocated (negative: freed), ``beside`` what is held only for a moment; ``peak`` is the
    most held at once."""

    def __init__(self):
        self.live = self.peak = 0

    def add(self, *nbytes: int) -> None:
        for n in nbytes:
            self.live += n
            self.peak = max(self.peak, self.live)

    def beside(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.live + nbytes)


def kernel_workspace(sizes: Sizes, rows: int, keys: int) -> int:
    """The backward workspace of a GPU kernel call over ``rows`` query rows and ``keys`` key
    rows of a head group: its fp32 dQ accumulator, and with GQA fp32 dK and dV accumulators
    (FlashAttention-4)."""
    gqa = sizes.spec.heads != sizes.spec.kv_heads
    return sizes.q(rows, itemsize=4) + (2 * sizes.kv(keys, itemsize=4) if gqa else 0)


def kernel_call(sizes: Sizes, keys: int, kv: int | None = None) -> Memory:
    """What one GPU kernel call over a head group's query rows (``sizes.rows``) and ``keys``
    key rows allocates: its out and lse (outputs); in backward dq, dk and dv (``kv``: bytes of
    one of dk and dv where they are not the group's K/V heads over ``keys`` rows) and its
    workspace."""
    kv = sizes.kv(keys) if kv is None else kv
    return Memory(outputs=sizes.q() + sizes.lse(), forward=0,
                  backward=sizes.q() + 2 * kv + kernel_workspace(sizes, sizes.rows, keys))


def local_memory(local: AttentionSpec) -> Memory:
    """What one GPU kernel call on the whole local problem ``local`` allocates (the schedules
    without communication)."""
    return kernel_call(Sizes(local, local.q_len), local.kv_len)


def input_bytes(local: AttentionSpec, backward: bool = True) -> int:
    """Bytes of a rank's inputs of the local problem ``local``, which the caller holds: q, k
    and v, and dout when ``backward``."""
    sizes = Sizes(local, local.q_len)
    return (2 if backward else 1) * sizes.q() + 2 * sizes.kv(local.kv_len)


def forward_call(sizes: Sizes, call, keys: int, acc_itemsize: int) -> int:
    """Bytes a forward kernel call holds beside the schedule's buffers, for a head group
    (``keys``: rows of the key block): its out and lse; a packed call also the rows it
    gathers for the kernel, then for the merge by index (into an accumulator of
    ``acc_itemsize``)."""
    r = rows_of(call, sizes.rows)
    gq, gk = gathered(call, sizes.rows, keys)
    merge = sizes.q(gq, acc_itemsize) + sizes.q(gq, 4) if gq else 0
    return sizes.q(r) + sizes.lse(r) + max(sizes.q(gq) + 2 * sizes.kv(gk), merge)


def backward_call(sizes: Sizes, call, keys: int, *, dq_temp: bool, kv_temps: bool) -> int:
    """Bytes a backward kernel call holds beside the schedule's buffers: its lse rows and
    workspace, its dQ when it is not written in place (``dq_temp``), its dK/dV when they are
    not (``kv_temps``; packed calls always return new gradients), and the rows a packed call
    gathers."""
    r, n = rows_of(call, sizes.rows), keys_of(call, keys)
    gq, gk = gathered(call, sizes.rows, keys)
    packed = isinstance(call, PackedCall)
    return (sizes.lse(r) + kernel_workspace(sizes, r, n)
            + (sizes.q(r) if dq_temp or packed else 0)
            + (2 * sizes.kv(n) if kv_temps or packed else 0) + 3 * sizes.q(gq) + 2 * sizes.kv(gk))
