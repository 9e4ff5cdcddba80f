"""Running a composed mask's kernel calls (``sdpa_fusion.mask_plan``) on one block of
queries and one of keys: ``MaskedCall``, one call of the schedules' loops.

The calls of a row are merged by their log-sum-exp (``Merged``); where calls share rows (dQ)
or keys (dK, dV) their gradients are summed in fp32, else each call's gradient is written
in place (no fp32 buffer). Partial tiles of a ``mask_mod`` run through a kernel that ``supports_mask`` (the
reference); other kernels' go through the reference's fp32 math (exact, on any device).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .kernels import get
from .kernels.base import layout_of
from .mask_plan import Piece, Tokens, batch_pieces, spec_tokens
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

    def forward(self, kernel, q, k, v, scale, dropout=None):
        out = layout_of(q).empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        self.forward_into(kernel, (out, lse), q, k, v, scale)
        return out, lse

    def forward_into(self, kernel, outputs, q, k, v, scale, dropout=None):
        out, lse = outputs
        if sum(len(range(q.shape[0])[b]) for b, _ in self.parts) < q.shape[0]:
            out.zero_()
            lse.fill_(float("-inf"))
        for b, pieces in self.parts:
            merged = Merged(out[b], lse[b], _most([p.rows for p in pieces], q.shape[2]))
            for p in pieces:
                into = merged.into(p.rows)
                result = _forward(p, kernel, q[b], k[b], v[b], scale, into)
                if into is None:
                    merged.add(*result, rows=p.rows)
                del result
            merged.finish()

    def backward(self, kernel, dout, q, k, v, out, lse, scale, dropout=None):
        return self.backward_into(kernel, (None, None, None), dout, q, k, v, out, lse, scale)

    @functools.cached_property
    def shared(self) -> tuple[bool, bool]:
        """(whether two calls of a part reach one row, one key)."""
        return tuple(any(_most([getattr(p, side) for p in pieces], n) > 1
                         for _, pieces in self.parts)
                     for side, n in (("rows", self.shape[0]), ("keys", self.shape[1])))

    def backward_into(self, kernel, targets, dout, q, k, v, out, lse, scale, dropout=None):
        """(dq, dk, dv) written into the given targets: summed over the calls in fp32 where
        calls share rows or keys, else each call's written in place."""
        done = [layout_of(like).empty(like.shape, dtype=like.dtype, device=like.device)
                if t is None else t for t, like in zip(targets, (q, k, v))]
        rows, keys = self.shared
        sums = [layout_of(t).empty(t.shape, dtype=torch.float32, device=t.device).zero_()
                if shared else t.zero_() for t, shared in zip(done, (rows, keys, keys))]
        for b, pieces in self.parts:
            for p in pieces:
                grads = _backward(p, kernel, dout[b], q[b], k[b], v[b], out[b], lse[b], scale)
                for acc, span, g in zip(sums, (p.rows, p.keys, p.keys), grads):
                    acc[b][:, :, span].add_(g)
                del grads
        for acc, target in zip(sums, done):
            if acc is not target:
                target.copy_(acc)
        return tuple(done)


@functools.lru_cache(maxsize=32)
def spec_call(spec) -> MaskedCall | None:
    """The ``MaskedCall`` of the whole (one-device) problem of ``spec``: dense [B, H, S, E]
    tensors, or packed ones as [1, H, T, E] views."""
    return block_call(spec.mask, *spec_tokens(spec), 1 if spec.layout.is_varlen else spec.batch)


def _most(spans, n: int) -> int:
    """The most of the slices ``spans`` of range(n) that reach one index."""
    depth = torch.zeros(n + 1, dtype=torch.long)
    for span in spans:
        start, stop, _ = span.indices(n)
        depth[start] += 1
        depth[stop] -= 1
    return int(depth.cumsum(0).max()) if n else 0


def block_call(mask: Mask, q: Tokens, k: Tokens, batch: int = 1) -> MaskedCall | None:
    """The ``MaskedCall`` of queries ``q`` vs keys ``k`` under ``mask`` on ``batch`` batch
    elements; None when no query sees a key."""
    parts = batch_pieces(mask, q, k, batch)
    return MaskedCall(parts, (len(q.pos), len(k.pos))) if parts else None


def _forward(self: Piece, kernel, q, k, v, scale, into=None):
    """(out, lse) of one piece (written into ``into`` = (out, lse) when given)."""
    r, c = self.rows, self.keys
    args = (q[:, :, r], k[:, :, c], v[:, :, c])
    if self.seen is not None:
        out, lse = _masking(kernel).masked_forward(*args, self.seen, scale)
        if into is not None:
            into[0].copy_(out)
            into[1].copy_(lse)
        return out, lse
    buffers = {} if into is None else dict(out=into[0], lse=into[1])
    return kernel.forward(*args, causal=self.causal, scale=scale, window=self.window, **buffers)


def _backward(self: Piece, kernel, dout, q, k, v, out, lse, scale):
    """(dq, dk, dv) of one piece, given the global out and lse of its rows."""
    r, c = self.rows, self.keys
    args = (dout[:, :, r], q[:, :, r], k[:, :, c], v[:, :, c], out[:, :, r],
            lse[:, :, r].contiguous())
    if self.seen is not None:
        return _masking(kernel).masked_backward(*args, self.seen, scale)
    return kernel.backward(*args, causal=self.causal, scale=scale, window=self.window)


def _masking(kernel):
    """The kernel that runs ``kernel``'s partial tiles."""
    return kernel if kernel.supports_mask else get("reference")
