"""``ring``: context parallelism by passing K/V blocks around the ring of ranks (pass-KV).

At step i rank r holds the K/V block of rank (r - i) mod P. While it attends its queries to
that block, the block travels on to rank r + 1 and the next one arrives from rank r - 1
(async point-to-point, double-buffered). Each step's (out, lse) is folded into fp32
accumulators by ``fold``.

Causal masks per step come from ``block_case`` (no communication). With the load-balanced
partition every rank holds an early chunk and a late chunk of the sequence, and every step
after the first costs half a block:

    own block            causal over the local tokens
    block of a rank < r  all local queries vs the block's first (early) chunk
    block of a rank > r  the local late chunk vs the whole block

Backward: dQ accumulates locally; the fp32 dK/dV sums of a block start on the rank after its
owner, travel the ring with the block and end on the owner, P - 1 hops in all. The owner
works on its own block last, while its sums make their last hop, and adds its own dK/dV to
them. Every step uses the global out and lse of the forward.

The blocks and sums travel in the slots of ``transport`` (NCCL/gloo send-receive, or copy
engines pulling from symmetric memory on GPUs).
"""

from __future__ import annotations

import enum

import torch

from sdpa_fusion.kernels.base import layout_of
from sdpa_fusion.merge import accumulators, finish, fold

from .base import Description
from .partition import Contiguous, LoadBalanced, Striped
from .sequence import SequenceSchedule
from .transport import Mover, RingData, check_transport, mover


class Block(enum.Enum):
    """Which queries of this rank meet which keys of a ring block, and with what mask."""

    FULL = "all queries vs all keys"
    CAUSAL = "all vs all, causal"
    EARLY_KEYS = "all queries vs the first half of the keys"
    LATE_QUERIES = "second half of the queries vs all keys"
    SHIFTED = "queries 1.. vs keys ..-1, causal"
    SKIP = "nothing"


def block_case(rank: int, source: int, causal: bool, partition) -> Block:
    """The mask case of the block that ``source`` owns, seen from ``rank`` (pure)."""
    if not causal:
        return Block.FULL
    if source == rank:
        return Block.CAUSAL
    earlier = source < rank
    if isinstance(partition, LoadBalanced):
        return Block.EARLY_KEYS if earlier else Block.LATE_QUERIES
    if isinstance(partition, Contiguous):
        return Block.FULL if earlier else Block.SKIP
    if isinstance(partition, Striped):
        return Block.CAUSAL if earlier else Block.SHIFTED
    raise ValueError(f"ring has no causal mask for partition {partition.name!r}")


def _ranges(case: Block, s_q: int, s_kv: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) that a block case computes."""
    return {
        Block.FULL: (slice(None), slice(None), False),
        Block.CAUSAL: (slice(None), slice(None), True),
        Block.EARLY_KEYS: (slice(None), slice(0, s_kv // 2), False),
        Block.LATE_QUERIES: (slice(s_q // 2, None), slice(None), False),
        Block.SHIFTED: (slice(1, None), slice(0, s_kv - 1), True),
    }[case]


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t if rows == slice(None) else t[:, :, rows]


def _start_sums(acc, grads, keys: slice) -> None:
    """Set the fp32 sums ``acc`` to a block's first gradients (zero where they are None or
    outside ``keys``)."""
    for a, g in zip(acc, grads or (None,) * len(acc)):
        if g is None or keys != slice(None):
            a.zero_()
        if g is not None:
            _rows(a, keys).copy_(g)


def _add_rows(acc, grads, keys: slice) -> None:
    """Add gradients of the key rows ``keys`` into the fp32 sums ``acc`` (nothing for None)."""
    for a, g in zip(acc, grads or ()):
        _rows(a, keys).add_(g)


class Ring(SequenceSchedule):
    """Pass-KV ring attention; ``transport`` picks how blocks travel (see ``transport``)."""

    name = "ring"

    def __init__(self, mesh, *, dim=None, partition="load_balanced", transport="auto"):
        super().__init__(mesh, dim=dim, partition=partition)
        self.transport = check_transport(transport)
        self._movers: dict[torch.device, Mover] = {}

    def validate(self, spec):
        super().validate(spec)
        if spec.causal and not isinstance(self.partition, (Contiguous, LoadBalanced, Striped)):
            raise ValueError(
                f"ring attention with causal=True takes partition 'load_balanced', 'contiguous' "
                f"or 'striped', not {self.partition.name!r}; use causal=False or one of those"
            )

    def mover(self, device) -> Mover:
        """The transport's mover of this schedule's blocks on ``device`` (made once)."""
        device = torch.device(device)
        if device not in self._movers:
            self._movers[device] = mover(self.comm, self.transport, device)
        return self._movers[device]

    @property
    def kept_bytes(self) -> int:
        """Bytes of ring buffers kept between calls (the copy-engine transport's symmetric
        memory, which torch.cuda.memory_allocated does not count)."""
        return sum(m.kept_bytes for m in self._movers.values())

    def _steps(self, causal: bool):
        """(step, source rank, block case) for every ring step of this rank."""
        for step in range(self.size):
            source = (self.index - step) % self.size
            yield step, source, block_case(self.index, source, causal, self.partition)

    def _ring_buffers(self, k, v, *dtypes):
        """A double-buffered ring buffer of blocks shaped like k and v, one per dtype."""
        layout = layout_of(k)
        datas = [RingData((tuple(k.shape), tuple(v.shape)), dtype, layout) for dtype in dtypes]
        return self.mover(k.device).ring_buffers(datas, k.device)

    def forward(self, q, k, v, spec, kernel, dropout=None):
        scale = spec.softmax_scale
        out_acc, lse_acc = accumulators(q)
        current, pending = (k, v), None
        if self.size > 1:
            (blocks,) = self._ring_buffers(k, v, k.dtype)
            blocks.load(0, (k, v))
        for step, _, case in self._steps(spec.causal):
            if step + 1 < self.size:
                pending = blocks.shift(step % 2, (step + 1) % 2)
            if case is not Block.SKIP:
                rows, keys, causal = _ranges(case, q.shape[2], k.shape[2])
                kb, vb = (_rows(t, keys) for t in current)
                o, lse = kernel.forward(_rows(q, rows), kb, vb, causal=causal, scale=scale)
                out_acc, lse_acc = fold(out_acc, lse_acc, o, lse, rows=rows)
                del o, lse  # free the block's output before the next kernel call
            if pending is not None:
                current, pending = tuple(pending.wait()), None
        return finish(out_acc, q.dtype, layout_of(q)), lse_acc

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        (_, _, own_case), *remote = self._steps(spec.causal)

        def block_grads(case, kb, vb):
            """(dK, dV, key rows) of one block; its dQ goes into dq."""
            if case is Block.SKIP:
                return None, slice(None)
            rows, keys, causal = _ranges(case, q.shape[2], k.shape[2])
            dq_b, *grads = kernel.backward(
                _rows(dout, rows), _rows(q, rows), _rows(kb, keys), _rows(vb, keys),
                _rows(out, rows), lse[:, :, rows].contiguous(), causal=causal,
                scale=spec.softmax_scale,
            )
            _rows(dq, rows).add_(dq_b)
            return grads, keys

        if remote:
            blocks, sums = self._ring_buffers(k, v, k.dtype, torch.float32)
            blocks.load(0, (k, v))
            pending_kv, pending_sums = blocks.shift(0, 1), None
        for step, _, case in remote:
            current = pending_kv.wait()
            if step + 1 < self.size:
                pending_kv = blocks.shift(step % 2, (step + 1) % 2)
            grads, keys = block_grads(case, *current)
            acc = sums.tensors(step % 2)
            if pending_sums is None:
                _start_sums(acc, grads, keys)
            else:
                pending_sums.wait()  # acc holds the block's sums from the earlier ranks
                _add_rows(acc, grads, keys)
            del grads  # free the block's dK/dV before the next kernel call
            pending_sums = sums.shift(step % 2, (step + 1) % 2)
        # the own block last: its backward runs while the own sums make their last hop home
        grads, keys = block_grads(own_case, k, v)
        dq = finish(dq, q.dtype, layout_of(q))
        if remote:
            home = pending_sums.wait()
            _add_rows(home, grads, keys)
            grads = home
        kv_layout = layout_of(k)
        dk, dv = (finish(g, t.dtype, kv_layout) for g, t in zip(grads, (k, v)))
        return dq, dk, dv

    def describe(self, spec):
        p = self.size
        kv_block = 2 * spec.batch * spec.kv_heads * (spec.kv_len // p) * spec.head_dim
        kv_bytes = kv_block * spec.dtype.itemsize
        forward = spec.flops() / p
        return Description(
            self.name, p, steps=p, bytes_sent=(p - 1) * kv_bytes, bytes_received=(p - 1) * kv_bytes,
            flops=forward, backward_steps=p,
            backward_bytes_sent=(p - 1) * (kv_bytes + kv_block * 4),
            backward_bytes_received=(p - 1) * (kv_bytes + kv_block * 4),
            backward_flops=spec.flops(backward=True) / p - forward,
            notes=f"partition {self.partition.name}; transport {self.transport}; K/V blocks of "
                  f"{kv_bytes} bytes, fp32 dK/dV blocks of {kv_block * 4} bytes",
        )
