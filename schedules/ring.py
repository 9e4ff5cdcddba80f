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

Backward: dQ accumulates locally; the fp32 dK/dV of a block start on the rank after its
owner, travel the ring with the block and end on the owner, P - 1 hops in all. Every step
uses the global out and lse of the forward.
"""

from __future__ import annotations

import enum

import torch

from sdpa_fusion.kernels.base import layout_of
from sdpa_fusion.merge import accumulators, finish, fold

from .base import Description
from .partition import Contiguous, LoadBalanced, Striped
from .sequence import SequenceSchedule


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


class Ring(SequenceSchedule):
    name = "ring"

    def validate(self, spec):
        super().validate(spec)
        if spec.causal and not isinstance(self.partition, (Contiguous, LoadBalanced, Striped)):
            raise ValueError(
                f"ring attention with causal=True takes partition 'load_balanced', 'contiguous' "
                f"or 'striped', not {self.partition.name!r}; use causal=False or one of those"
            )

    def _steps(self, causal: bool):
        """(step, source rank, block case) for every ring step of this rank."""
        for step in range(self.size):
            source = (self.index - step) % self.size
            yield step, source, block_case(self.index, source, causal, self.partition)

    def _block_buffers(self, k, v):
        """The two receive buffers of the double-buffered ring, shaped like k and v."""
        return [(torch.empty_like(k), torch.empty_like(v)) for _ in range(2)]

    def forward(self, q, k, v, spec, kernel, dropout=None):
        scale = spec.softmax_scale
        out_acc, lse_acc = accumulators(q)
        buffers, current, pending = self._block_buffers(k, v), (k, v), None
        for step, _, case in self._steps(spec.causal):
            if step + 1 < self.size:
                nxt = buffers[step % 2]
                pending = self.comm.ring_shift(list(current), list(nxt))
            if case is not Block.SKIP:
                rows, keys, causal = _ranges(case, q.shape[2], k.shape[2])
                kb, vb = (_rows(t, keys) for t in current)
                o, lse = kernel.forward(_rows(q, rows), kb, vb, causal=causal, scale=scale)
                out_acc, lse_acc = fold(out_acc, lse_acc, o, lse, rows=rows)
            if pending is not None:
                current, pending = tuple(pending.wait()), None
        return finish(out_acc, q.dtype, layout_of(q)), lse_acc

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        scale = spec.softmax_scale
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        own = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
        travelling = [[torch.zeros_like(g) for g in own] for _ in range(2)]
        buffers, current, pending_kv, pending_grad = self._block_buffers(k, v), (k, v), None, None
        for step, _, case in self._steps(spec.causal):
            if step + 1 < self.size:
                pending_kv = self.comm.ring_shift(list(current), list(buffers[step % 2]))
            grads = None
            if case is not Block.SKIP:
                rows, keys, causal = _ranges(case, q.shape[2], k.shape[2])
                kb, vb = (_rows(t, keys) for t in current)
                dq_b, *grads = kernel.backward(
                    _rows(dout, rows), _rows(q, rows), kb, vb, _rows(out, rows),
                    lse[:, :, rows].contiguous(), causal=causal, scale=scale,
                )
                _rows(dq, rows).add_(dq_b)
            acc = own if step == 0 else travelling[step % 2]
            if pending_grad is not None:
                pending_grad.wait()  # acc now holds the block's sums from the earlier ranks
            if grads is not None:
                for a, g in zip(acc, grads):
                    _rows(a, keys).add_(g)
            if step > 0:
                pending_grad = self.comm.ring_shift(acc, travelling[(step + 1) % 2])
            if pending_kv is not None:
                current, pending_kv = tuple(pending_kv.wait()), None
        if pending_grad is not None:
            for a, g in zip(own, pending_grad.wait()):
                a.add_(g)
        kv_layout = layout_of(k)
        return (
            finish(dq, q.dtype, layout_of(q)),
            finish(own[0], k.dtype, kv_layout),
            finish(own[1], v.dtype, kv_layout),
        )

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
            notes=f"partition {self.partition.name}; K/V blocks of {kv_bytes} bytes, "
                  f"fp32 dK/dV blocks of {kv_block * 4} bytes",
        )
