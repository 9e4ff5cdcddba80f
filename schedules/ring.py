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

Packed sequences: each step is one varlen kernel call over every sequence, the step's case
applied to each sequence's part and cut to its real tokens (``packed_call``; the rows are
made once per packing). The blocks are the whole local K/V, padding included, so every
block has one size.

Sliding windows: each step's calls come from ``bands`` (every call a window in its own rows
and keys; none for a block the window does not reach), and the ring takes only the steps at
which some rank's queries see a key of the block. A shift then sends the block, and in
backward its dK/dV sums, straight to the rank of its next step: several hops at once.
"""

from __future__ import annotations

import enum

import torch

from sdpa_fusion.kernels.base import layout_of
from sdpa_fusion.merge import accumulators, finish

from .bands import check_runs, ring_plan, window_band
from .base import Description
from .calls import (DenseCall, PackedCall, add_rows, as_block, as_packed, fold_calls, part_call,
                    put_rows)
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


def _ranges(case: Block, s_q, s_kv):
    """(query span, key span, causal) that a block case computes, for blocks of ``s_q``
    queries and ``s_kv`` keys (ints, or per-sequence tensors for packed blocks)."""
    return {
        Block.FULL: ((0, s_q), (0, s_kv), False),
        Block.CAUSAL: ((0, s_q), (0, s_kv), True),
        Block.EARLY_KEYS: ((0, s_q), (0, s_kv // 2), False),
        Block.LATE_QUERIES: ((s_q // 2, s_q), (0, s_kv), False),
        Block.SHIFTED: ((1, s_q), (0, s_kv - 1), True),
    }[case]


def _span(span, n: int) -> slice:
    return slice(None) if span == (0, n) else slice(*span)


def dense_call(case: Block, s_q: int, s_kv: int) -> DenseCall | None:
    """The kernel call of a block case on dense blocks (None for SKIP)."""
    if case is Block.SKIP:
        return None
    rows, keys, causal = _ranges(case, s_q, s_kv)
    return DenseCall(_span(rows, s_q), _span(keys, s_kv), causal)


def packed_call(case: Block, packing, source: int) -> PackedCall | None:
    """The varlen call of a block case on the parts of every packed sequence: the dense case
    applied to each sequence's part, cut to its real tokens (None when nothing is left)."""
    if case is Block.SKIP:
        return None
    storage = packing.split.storage
    rows, keys, causal = _ranges(case, storage, storage)
    return part_call(packing, source, rows, keys, causal)


def _all(rows) -> bool:
    return rows is None or (isinstance(rows, slice) and rows == slice(None))


def _start_sums(acc, grads, keys) -> None:
    """Set the fp32 sums ``acc`` to a block's first gradients (zero where they are None or
    outside ``keys``)."""
    for a, g in zip(acc, grads or (None,) * len(acc)):
        if g is None or not _all(keys):
            a.zero_()
        if g is not None:
            put_rows(a, keys, g)


def _add_rows(acc, grads, keys) -> None:
    """Add gradients of the key rows ``keys`` into the fp32 sums ``acc`` (nothing for None)."""
    for a, g in zip(acc, grads or ()):
        add_rows(a, keys, g)


def _sum_calls(calls, grads_of, arrive, *, start: bool = False):
    """Add the dK/dV of every call (``grads_of(i, call)``) into the fp32 sums that ``arrive()``
    returns, called once the first call's gradients exist (so that a transfer bringing the
    sums overlaps that call); with ``start`` the sums begin here (``_start_sums``). Returns
    the sums."""
    acc = None
    for n, call in enumerate(calls):
        grads = grads_of(n, call)
        if n == 0:
            acc = arrive()
        if n == 0 and start:
            _start_sums(acc, grads, call.keys)
        else:
            _add_rows(acc, grads, call.keys)
        del grads  # free the call's dK/dV before the next kernel call
    if acc is None:
        acc = arrive()
        if start:
            _start_sums(acc, None, None)
    return acc


class Ring(SequenceSchedule):
    """Pass-KV ring attention; ``transport`` picks how blocks travel (see ``transport``)."""

    name = "ring"

    def __init__(self, mesh, *, dim=None, partition="load_balanced", transport="auto"):
        super().__init__(mesh, dim=dim, partition=partition)
        self.transport = check_transport(transport)
        self._movers: dict[torch.device, Mover] = {}

    def validate(self, spec):
        super().validate(spec)
        if window_band(spec) is not None:  # causal is part of the window's band
            check_runs(spec, self.partition, self.size, self.name)
        elif spec.causal and not isinstance(self.partition, (Contiguous, LoadBalanced, Striped)):
            raise ValueError(
                f"ring attention with causal=True takes partition 'load_balanced', 'contiguous' "
                f"or 'striped', not {self.partition.name!r}; use causal=False, one of those, or "
                f"schedule 'ulysses' (causal with any partition)"
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

    def _steps(self, spec, s_q: int, s_kv: int) -> list[tuple[int, list]]:
        """(step, kernel calls) of every ring step this rank takes, in order: at step i the
        block of rank (r - i) mod P. Every step without a window; with one, only the steps
        at which some rank's queries see a key (``bands.ring_plan``). Packed calls are made
        once per packing."""
        mask = window_band(spec)
        if mask is not None:
            return ring_plan(spec, mask, self.partition, self.size, self.index)
        calls = self._calls(spec, s_q, s_kv)
        return [(step, [] if call is None else [call]) for step, call in enumerate(calls)]

    def _calls(self, spec, s_q: int, s_kv: int) -> list:
        """The kernel call (or None) of every ring step of this rank without a window."""
        sources = [(self.index - step) % self.size for step in range(self.size)]

        def case(source):
            return block_case(self.index, source, spec.causal, self.partition)

        packing = spec.packing
        if packing is None:
            return [dense_call(case(j), s_q, s_kv) for j in sources]
        return packing.cached(("ring", spec.causal),
                              lambda: [packed_call(case(j), packing, j) for j in sources])

    def _step_count(self, spec) -> int:
        """Steps every rank takes for the global ``spec`` (the own block's included)."""
        if window_band(spec) is None:
            return self.size
        local = self.local_spec(spec)
        return len(self._steps(local, local.q_len, local.kv_len))

    def _ring_buffers(self, k, v, *dtypes):
        """A double-buffered ring buffer of blocks shaped like k and v, one per dtype."""
        layout = layout_of(k)
        datas = [RingData((tuple(k.shape), tuple(v.shape)), dtype, layout) for dtype in dtypes]
        return self.mover(k.device).ring_buffers(datas, k.device)

    def _streams(self, dropout, step: int):
        """The dropout streams of this rank's queries against the block of ring step ``step``,
        one per kernel call of the step (``streams(i)``); None without dropout."""
        if dropout is None:
            return None
        source = (self.index - step) % self.size
        return lambda call: dropout.stream("ring", self.index, source, call)

    def forward(self, q, k, v, spec, kernel, dropout=None):
        packed = spec.layout.is_varlen
        if packed:
            q, k, v = (as_block(t) for t in (q, k, v))
        scale = spec.softmax_scale
        out_acc, lse_acc = accumulators(q)
        steps = self._steps(spec, q.shape[2], k.shape[2])
        current, pending = (k, v), None
        if len(steps) > 1:
            (blocks,) = self._ring_buffers(k, v, k.dtype)
            blocks.load(0, (k, v))
        for i, (step, calls) in enumerate(steps):
            if i + 1 < len(steps):  # the next step's block, straight from the rank holding it
                pending = blocks.shift(i % 2, (i + 1) % 2, hops=steps[i + 1][0] - step)
            out_acc, lse_acc = fold_calls(calls, kernel, q, *current, scale, out_acc, lse_acc,
                                          self._streams(dropout, step))
            if pending is not None:
                current, pending = tuple(pending.wait()), None
        out = finish(out_acc, q.dtype, layout_of(q))
        return (as_packed(out) if packed else out), lse_acc

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        packed = spec.layout.is_varlen
        if packed:
            dout, q, k, v, out = (as_block(t) for t in (dout, q, k, v, out))
        dq = accumulators(q)[0]
        (_, own), *remote = self._steps(spec, q.shape[2], k.shape[2])

        def grads_of(kb, vb, step):
            streams = self._streams(dropout, step)

            def grads(i, call):
                """(dK, dV) of the key rows of the step's call i; its dQ goes into dq."""
                dq_b, *g = call.backward(kernel, dout, q, kb, vb, out, lse, spec.softmax_scale,
                                         streams and streams(i))
                add_rows(dq, call.rows, dq_b)
                return g
            return grads

        if remote:
            blocks, sums = self._ring_buffers(k, v, k.dtype, torch.float32)
            blocks.load(0, (k, v))
            pending_kv, pending_sums = blocks.shift(0, 1, hops=remote[0][0]), None
        for i, (step, calls) in enumerate(remote, start=1):
            current = pending_kv.wait()
            # to the rank of the next step with this block, or home after the last one
            hops = (remote[i][0] if i < len(remote) else self.size) - step
            if i < len(remote):
                pending_kv = blocks.shift(i % 2, (i + 1) % 2, hops=hops)
            if pending_sums is None:  # the block's sums start here
                slot = sums.tensors(i % 2)
                _sum_calls(calls, grads_of(*current, step), lambda: slot, start=True)
            else:  # the slot holds the block's sums from the earlier ranks once they arrive
                _sum_calls(calls, grads_of(*current, step), pending_sums.wait)
            pending_sums = sums.shift(i % 2, (i + 1) % 2, hops=hops)
        # the own block last: its backward runs while the own sums make their last hop home
        home = _sum_calls(own, grads_of(k, v, 0), pending_sums.wait if remote else
                          lambda: [accumulators(t)[0] for t in (k, v)])
        dq = finish(dq, q.dtype, layout_of(q))
        kv_layout = layout_of(k)
        dk, dv = (finish(g, t.dtype, kv_layout) for g, t in zip(home, (k, v)))
        if packed:
            dq, dk, dv = (as_packed(t) for t in (dq, dk, dv))
        return dq, dk, dv

    def describe(self, spec):
        p = self.size
        steps = self._step_count(spec)
        kv_block = 2 * spec.batch * spec.kv_heads * self.local_tokens(spec) * spec.head_dim
        kv_bytes = kv_block * spec.dtype.itemsize
        forward = spec.flops() / p
        shifts = steps - 1
        return Description(
            self.name, p, steps=steps, bytes_sent=shifts * kv_bytes,
            bytes_received=shifts * kv_bytes, flops=forward, backward_steps=steps,
            backward_bytes_sent=shifts * (kv_bytes + kv_block * 4),
            backward_bytes_received=shifts * (kv_bytes + kv_block * 4),
            backward_flops=spec.flops(backward=True) / p - forward,
            notes=f"partition {self.partition.name}; transport {self.transport}; K/V blocks of "
                  f"{kv_bytes} bytes, fp32 dK/dV blocks of {kv_block * 4} bytes",
        )
