"""Running a composed mask's kernel calls (``sdpa_fusion.mask_plan``) on one block of
queries and one of keys: ``MaskedCall``, one call of the schedules' loops.

The plan knows how many calls reach each range of rows and of keys (``MaskedCall.ranges``,
``mask_plan.coverage``), and each result is written range by range:

    calls  out, lse (rows)               dQ (rows), dK and dV (keys)
    0      0, -inf                       0
    1      the call's                    the call's
    2      merged by log-sum-exp         the second call's added to the first's in the
                                         gradient's dtype (an fp32 sum, rounded once)
    3+     (``Merged``, fp32 past two)   summed in an fp32 buffer of the range's size

A call whose span holds only ranges it may write is handed views of the results (a kernel
that writes given buffers, FA4, copies nothing); else its results are copied in. Partial
tiles of a ``mask_mod`` run through a kernel that ``supports_mask`` (the reference); other
kernels' go through the reference's fp32 math (exact, on any device). The members of a
``Batch`` (short sequences' tiles) are gathered into one such call, each a batch element
padded to the largest (pads read nothing and see nothing), and put back in place.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math

import torch

from .kernels import get
from .kernels.base import layout_of
from .mask_plan import Piece, Tokens, batch_pieces, coverage, problem_of, problem_tokens
from .masks import Mask
from .merge import Merged


@dataclasses.dataclass(frozen=True, eq=False)
class MaskedCall:
    """The calls of a block: ``parts`` = ((batch slice, pieces), ...) on query and key blocks
    of ``shape`` = (rows, keys); a call of the schedules' loops over every row and key."""

    parts: tuple
    shape: tuple[int, int]
    rows = None
    keys = None

    @property
    def pieces(self) -> int:
        return sum(len(pieces) for _, pieces in self.parts)

    @property
    def pairs(self) -> int:
        """Query-key pairs the calls compute (per batch element)."""
        return sum(p.pairs(*self.shape) for _, pieces in self.parts for p in pieces)

    @functools.cached_property
    def ranges(self) -> tuple:
        """((row ranges, key ranges), ...) per part: (start, stop, calls reaching them)."""
        return tuple(tuple(coverage([getattr(p, side) for p in pieces], n)
                           for side, n in (("rows", self.shape[0]), ("keys", self.shape[1])))
                     for _, pieces in self.parts)

    @functools.cached_property
    def summed(self) -> tuple:
        """(row ranges, key ranges) that two calls or more reach in some part, as (start,
        stop, calls): where out is merged and dQ (rows), dK and dV (keys) are summed."""
        return tuple(tuple(sorted({r for part in self.ranges for r in part[side] if r[2] > 1}))
                     for side in (0, 1))

    def forward(self, kernel, q, k, v, scale, dropout=None):
        out = layout_of(q).empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        self.forward_into(kernel, (out, lse), q, k, v, scale)
        return out, lse

    def forward_into(self, kernel, outputs, q, k, v, scale, dropout=None):
        """(out, lse) written into ``outputs``: rows one call reaches straight from it, rows
        several reach merged, rows none reaches 0 and -inf."""
        out, lse = outputs
        if not self._every_element(q.shape[0]):
            out.zero_()
            lse.fill_(float("-inf"))
        for (b, pieces), (rows, _) in zip(self.parts, self.ranges):
            o, l = out[b], lse[b]
            for start, stop, calls in rows:
                if not calls:
                    o[:, :, start:stop].zero_()
                    l[:, :, start:stop].fill_(float("-inf"))
            starts = [r[0] for r in rows]
            reach = [max(r[2] for r in _inside(rows, starts, p.rows, self.shape[0])[1])
                     for p in pieces]
            if max(reach) > 1:  # first: Merged starts by clearing every row
                merged = Merged(o, l, max(reach))
                for p in (p for p, n in zip(pieces, reach) if n > 1):
                    into = merged.into(p.rows)
                    result = _forward(p, kernel, q[b], k[b], v[b], scale, into)
                    if into is None:
                        merged.add(*result, rows=p.rows)
                    del result
                merged.finish()
            for p in (p for p, n in zip(pieces, reach) if n == 1):
                _forward(p, kernel, q[b], k[b], v[b], scale, (o[:, :, p.rows], l[:, :, p.rows]))

    def backward(self, kernel, dout, q, k, v, out, lse, scale, dropout=None):
        return self.backward_into(kernel, (None, None, None), dout, q, k, v, out, lse, scale)

    def backward_into(self, kernel, targets, dout, q, k, v, out, lse, scale, dropout=None):
        """(dq, dk, dv) written into the given targets (new tensors where None), each range
        of rows or keys as the module says."""
        done = [layout_of(like).empty(like.shape, dtype=like.dtype, device=like.device)
                if t is None else t for t, like in zip(targets, (q, k, v))]
        if not self._every_element(q.shape[0]):
            for t in done:
                t.zero_()
        n_q, n_k = self.shape
        for (b, pieces), (rows, keys) in zip(self.parts, self.ranges):
            sums = [_Sum(t[b], ranges, n) for t, ranges, n in
                    zip(done, (rows, keys, keys), (n_q, n_k, n_k))]
            for p in pieces:
                spans = (p.rows, p.keys, p.keys)
                given = [s.into(span) for s, span in zip(sums, spans)]
                grads = _backward(p, kernel, dout[b], q[b], k[b], v[b], out[b], lse[b], scale,
                                  given)
                for s, span, g, written in zip(sums, spans, grads, given):
                    if written is None:
                        s.add(span, g)
                del grads
            for s in sums:
                s.finish()
        return tuple(done)

    def _every_element(self, batch: int) -> bool:
        """Whether the parts reach every one of ``batch`` batch elements."""
        return sum(len(range(batch)[b]) for b, _ in self.parts) == batch


class _Sum:
    """One gradient of a part (dQ along its rows, dK or dV along its keys), filled call by
    call over its ``ranges`` as the module says."""

    def __init__(self, target: torch.Tensor, ranges, n: int):
        self.target, self.ranges, self.n = target, ranges, n
        self.starts = [r[0] for r in ranges]
        self.written = set()  # ranges a call has written into the target
        self.buffers = {}  # fp32 sums of the ranges that more than two calls reach
        for start, stop, calls in ranges:
            if not calls:
                target[:, :, start:stop].zero_()

    def into(self, span: slice):
        """The target's rows of ``span`` when the call may write its gradient there itself
        (no call wrote them yet, no fp32 sum takes them), else None (``add`` it)."""
        _, inside = _inside(self.ranges, self.starts, span, self.n)
        if any(r in self.written or r[2] > 2 for r in inside):
            return None
        self.written.update(inside)
        return self.target[:, :, span]

    def add(self, span: slice, grad: torch.Tensor) -> None:
        """A call's gradient ``grad`` of the rows of ``span`` into their ranges."""
        offset, inside = _inside(self.ranges, self.starts, span, self.n)
        for r in inside:
            part = grad[:, :, r[0] - offset:r[1] - offset]
            if r[2] > 2:
                if r in self.buffers:
                    self.buffers[r].add_(part)
                else:
                    self.buffers[r] = part.to(torch.float32, copy=True)
            elif r in self.written:
                self.target[:, :, r[0]:r[1]].add_(part)
            else:
                self.target[:, :, r[0]:r[1]].copy_(part)
                self.written.add(r)

    def finish(self) -> None:
        for (start, stop, _), total in self.buffers.items():
            self.target[:, :, start:stop].copy_(total)
        self.buffers = {}


def _inside(ranges, starts, span: slice, n: int):
    """(span's first index, the ``ranges`` of range(n), beginning at ``starts``, inside
    ``span``); ranges are cut at every call's span, so each is inside or outside."""
    start, stop, _ = span.indices(n)
    return start, ranges[bisect.bisect_left(starts, start):bisect.bisect_left(starts, stop)]


def spec_call(spec) -> MaskedCall | None:
    """The ``MaskedCall`` of the whole (one-device) problem of ``spec``: dense [B, H, S, E]
    tensors, or packed ones as [1, H, T, E] views (made once per problem)."""
    return _problem_call(*problem_of(spec))


@functools.lru_cache(maxsize=32)
def _problem_call(mask: Mask, batch: int, q_len: int, kv_len: int, sequences):
    return block_call(mask, *problem_tokens(batch, q_len, kv_len, sequences), batch)


def block_call(mask: Mask, q: Tokens, k: Tokens, batch: int = 1) -> MaskedCall | None:
    """The ``MaskedCall`` of queries ``q`` vs keys ``k`` under ``mask`` on ``batch`` batch
    elements; None when no query sees a key."""
    parts = batch_pieces(mask, q, k, batch)
    return MaskedCall(parts, (len(q.pos), len(k.pos))) if parts else None


def _forward(self: Piece, kernel, q, k, v, scale, into=None):
    """(out, lse) of one piece (written into ``into`` = (out, lse) when given)."""
    if self.batch is not None:
        got = _batched_forward(self, _masking(kernel), q, k, v, scale)
        return got if into is None else tuple(t.copy_(g) for t, g in zip(into, got))
    r, c = self.rows, self.keys
    args = (q[:, :, r], k[:, :, c], v[:, :, c])
    if self.seen is not None:
        got = _masking(kernel).masked_forward(*args, self.seen, scale)
        return got if into is None else tuple(t.copy_(g) for t, g in zip(into, got))
    buffers = {} if into is None else dict(out=into[0], lse=into[1])
    return kernel.forward(*args, causal=self.causal, scale=scale, window=self.window, **buffers)


def _backward(self: Piece, kernel, dout, q, k, v, out, lse, scale, targets):
    """(dq, dk, dv) of one piece, given the global out and lse of its rows (written into the
    ``targets`` that are not None)."""
    if self.batch is not None:
        grads = _batched_backward(self, _masking(kernel), dout, q, k, v, out, lse, scale)
        return tuple(g if t is None else t.copy_(g) for g, t in zip(grads, targets))
    r, c = self.rows, self.keys
    args = (dout[:, :, r], q[:, :, r], k[:, :, c], v[:, :, c], out[:, :, r],
            lse[:, :, r].contiguous())
    if self.seen is None:
        return kernel.backward(*args, causal=self.causal, scale=scale, window=self.window,
                               dq=targets[0], dk=targets[1], dv=targets[2])
    grads = _masking(kernel).masked_backward(*args, self.seen, scale)
    return tuple(g if t is None else t.copy_(g) for g, t in zip(grads, targets))


# ---- a Batch: its members gathered into one call, their results put back -------------------
@dataclasses.dataclass(frozen=True)
class _Side:
    """One side (rows or keys) of a ``Batch`` on a device: ``index`` [n, m] (pads at 0),
    ``real`` [n, m] (False on pads), and the flat positions ``taken`` of the real entries
    with their rows ``at`` in the block (integer indices: no device sync)."""

    index: torch.Tensor
    real: torch.Tensor
    taken: torch.Tensor
    at: torch.Tensor

    @classmethod
    def of(cls, index: torch.Tensor, device) -> "_Side":
        real = index >= 0
        taken = real.flatten().nonzero()[:, 0]
        return cls(index.clamp(min=0).to(device), real.to(device), taken.to(device),
                   index.flatten()[taken].to(device))

    def gathered(self, t, fill=0.0):
        """This side's rows of ``t`` [B, H, S, ...] as [B * n, H, m, ...], ``fill`` on pads
        (a pad reads no value of ``t``)."""
        got = t[:, :, self.index]  # [B, H, n, m, ...]
        real = self.real.view(*self.real.shape, *([1] * (got.dim() - 4)))
        return torch.where(real, got, fill).transpose(1, 2).flatten(0, 1)

    def put(self, result, span: slice, length: int, fill=0.0):
        """A batched call's ``result`` [B * n, H, m, ...] as [B, H, rows of ``span``, ...]:
        each member's rows in place, ``fill`` on those no member holds."""
        n, m = self.index.shape
        result = result.unflatten(0, (-1, n)).transpose(1, 2).flatten(2, 3)  # [B, H, n m, ...]
        start, stop, _ = span.indices(length)
        out = result.new_full((*result.shape[:2], stop - start, *result.shape[3:]), fill)
        out[:, :, self.at - start] = result[:, :, self.taken]
        return out


def _sides(batch, device):
    """(rows, keys, seen [n, 1, 1, r, k]) of ``batch`` on ``device``, made once."""
    kept = batch.__dict__.setdefault("_on", {})
    if device not in kept:
        kept[device] = (_Side.of(batch.rows, device), _Side.of(batch.keys, device),
                        batch.seen.to(device)[:, None, None])
    return kept[device]


def _batched_forward(self: Piece, kernel, q, k, v, scale):
    rows, keys, seen = _sides(self.batch, q.device)
    o, l = kernel.masked_forward(rows.gathered(q), keys.gathered(k), keys.gathered(v),
                                 seen.repeat(q.shape[0], 1, 1, 1, 1), scale)
    return rows.put(o, self.rows, q.shape[2]), rows.put(l, self.rows, q.shape[2], -math.inf)


def _batched_backward(self: Piece, kernel, dout, q, k, v, out, lse, scale):
    rows, keys, seen = _sides(self.batch, q.device)
    dq, dk, dv = kernel.masked_backward(
        rows.gathered(dout), rows.gathered(q), keys.gathered(k), keys.gathered(v),
        rows.gathered(out), rows.gathered(lse, -math.inf), seen.repeat(q.shape[0], 1, 1, 1, 1),
        scale)
    return (rows.put(dq, self.rows, q.shape[2]), keys.put(dk, self.keys, k.shape[2]),
            keys.put(dv, self.keys, k.shape[2]))


def _masking(kernel):
    """The kernel that runs ``kernel``'s partial tiles."""
    return kernel if kernel.supports_mask else get("reference")
