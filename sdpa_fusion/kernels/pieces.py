"""Run a kernel call as the pieces that keep it inside the kernel's limits (``limits``).

A call that fits goes to the kernel as it is. Otherwise every piece is one kernel call on
views of the call's tensors; a view past the limit is copied into a buffer of its own, and
the piece's results are written into the call's outputs (straight from the kernel where the
output's view fits). Pieces that share K/V heads add their dK/dV in fp32. With dropout every
piece draws its own stream (``Dropout.stream``), the same in forward and backward. Rows of a
packed call outside every piece's sequences get out 0, lse -inf and gradient 0.
"""

from __future__ import annotations

import functools
import math

import torch

from ..layout import layout_of
from .limits import Piece, dense_pieces, fits, packed_pieces

_WHOLE = Piece(slice(None), slice(None), slice(None))


def _split(pieces, tensors, limits, what: str):
    """The pieces to run: ``pieces`` when the call is split, one piece of everything when it
    fits but some tensor is a view past the limit, none when all fit; a ValueError when no
    split fits (the call's planning should have refused it)."""
    if pieces is None:
        raise ValueError(what)
    if pieces or all(fits(t, limits) for t in tensors):
        return pieces
    return [_WHOLE]


def _own(t: torch.Tensor, limits) -> torch.Tensor:
    """``t`` as a kernel may take it: itself when it fits, else a copy in its layout."""
    if fits(t, limits):
        return t
    return t.contiguous() if t.dim() != 4 else layout_of(t).to(t)


def _target(t: torch.Tensor, limits, contiguous: bool = False):
    """``t`` as an output buffer the kernel may write, or None (it allocates; we copy)."""
    if not fits(t, limits) or (contiguous and not t.is_contiguous()):
        return None
    return t


def _stream(dropout, i: int, p: Piece):
    """The dropout stream of piece ``i``: its own for the pieces of a split, which depends
    on the shapes alone (so forward and backward draw alike), the call's otherwise."""
    if dropout is None or p is _WHOLE:
        return dropout
    return dropout.stream("piece", i)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor shaped like ``t`` in its layout (BHSE or BSHE)."""
    return layout_of(t).empty(t.shape, dtype=t.dtype, device=t.device)


# ---- dense ----------------------------------------------------------------------------------
def dense_forward(kernel, q, k, v, mask, dropout, out, lse):
    limits = kernel.limits
    split = _split(dense_pieces(q.shape, k.shape, limits), (q, k, v, out),
                   limits, kernel.too_long(q.shape[2], k.shape[2], q.shape[3]))
    if not split:
        return written(kernel._forward(q, k, v, dropout=dropout, out=out, lse=lse, **mask),
                        (out, lse))
    out = empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if lse is None else lse
    for i, p in enumerate(split):
        views = (out[p.batch, p.q], lse[p.batch, p.q])
        results = kernel._forward(
            *(_own(t, limits) for t in (q[p.batch, p.q], k[p.batch, p.kv], v[p.batch, p.kv])),
            dropout=_stream(dropout, i, p),
            out=_target(views[0], limits), lse=_target(views[1], limits, contiguous=True), **mask)
        written(results, views)
    return out, lse


def dense_backward(kernel, dout, q, k, v, out, lse, mask, dropout, grads):
    limits = kernel.limits
    split = _split(dense_pieces(q.shape, k.shape, limits), (dout, q, k, v, out, *grads),
                   limits, kernel.too_long(q.shape[2], k.shape[2], q.shape[3]))
    dq, dk, dv = grads
    if not split:
        return written(kernel._backward(dout, q, k, v, out, lse, dropout=dropout, dq=dq, dk=dk,
                                         dv=dv, **mask), grads)
    grads = tuple(empty_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))
    shared = {}  # fp32 dK/dV sums of K/V heads shared by pieces
    for i, p in enumerate(split):
        heads = (p.q, p.q, p.kv, p.kv, p.q)
        args = [_own(t[p.batch, h], limits) for t, h in zip((dout, q, k, v, out), heads)]
        views = tuple(g[p.batch, h] for g, h in zip(grads, heads[1:4]))
        targets = [_target(views[0], limits)] + \
                  [None if p.shares_kv else _target(t, limits) for t in views[1:]]
        results = kernel._backward(*args, lse[p.batch, p.q].contiguous(),
                                   dropout=_stream(dropout, i, p), dq=targets[0],
                                   dk=targets[1], dv=targets[2], **mask)
        _write_grads(results, views, p, shared, (p.batch.start, p.kv.start))
    _write_sums(shared)
    return grads


def _write_grads(results, views, p: Piece, shared: dict, key) -> None:
    """Piece ``p``'s (dq, dk, dv) into its ``views``; the dK/dV of pieces that share K/V
    heads summed in fp32 under ``key`` in ``shared`` instead (``_write_sums`` writes them)."""
    written(results[:1], views[:1])
    if not p.shares_kv:
        written(results[1:], views[1:])
    elif key not in shared:
        shared[key] = [r.float() for r in results[1:]], views[1:]
    else:
        for acc, r in zip(shared[key][0], results[1:]):
            acc.add_(r)


def _write_sums(shared: dict) -> None:
    for sums, views in shared.values():
        for view, total in zip(views, sums):
            view.copy_(total)


def written(results, targets):
    """``results`` written into the ``targets`` that are given (where the kernel did not
    write them itself); returns the targets, or the results where no target was given."""
    done = []
    for result, target in zip(results, targets):
        if target is not None and not _same(result, target):
            target.copy_(result)
        done.append(result if target is None else target)
    return tuple(done)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of the same elements (nothing to copy)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype)


# ---- packed ---------------------------------------------------------------------------------
def _packed_split(kernel, q, k, seqlens, tensors):
    pieces = _packed_pieces(seqlens, q.shape[1], k.shape[1], q.shape[2], kernel.limits)
    if pieces is None:  # the message of the longest sequence's refusal
        longest = max(zip(seqlens.lengths_q, seqlens.lengths_k), key=max, default=(0, 0))
        raise ValueError(kernel.too_long(*longest, q.shape[2]))
    # where the sequences fit and a tensor does not (rows outside every sequence, or a view
    # of a wider buffer), ``_split`` gives one piece of all: ``_rows`` takes its sequences'
    # rows, ``_own`` copies what is still past the limit
    return _split(pieces, tensors, kernel.limits, None)


@functools.lru_cache(maxsize=256)
def _packed_pieces(seqlens, heads: int, kv_heads: int, e: int, limits):
    """``packed_pieces`` of one call's sequences, made once per (pack, shape, limits)."""
    return packed_pieces(seqlens.lengths_q, seqlens.lengths_k, heads, kv_heads, e, limits)


def _rows(seqlens, p: Piece):
    """(query rows, key rows, the piece's Seqlens counted from its first rows): the rows of
    its sequences (all of them for ``sequences`` None), none outside."""
    a, b = (0, len(seqlens.lengths_q)) if p.sequences is None else \
        (p.sequences.start, p.sequences.stop)
    cu_q, cu_k = seqlens.cu_q[a:b + 1], seqlens.cu_k[a:b + 1]
    local = type(seqlens)(tuple(c - cu_q[0] for c in cu_q), tuple(c - cu_k[0] for c in cu_k))
    return slice(cu_q[0], cu_q[-1]), slice(cu_k[0], cu_k[-1]), local


def packed_lse(q: torch.Tensor) -> torch.Tensor:
    """A new fp32 lse [H, T_q] for packed ``q``."""
    return torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)


def packed_forward(kernel, q, k, v, seqlens, mask, outputs=(None, None)):
    limits = kernel.limits
    split = _packed_split(kernel, q, k, seqlens, (q, k, v))
    out, lse = outputs
    if not split:
        return written(kernel._varlen_forward(q, k, v, seqlens, **mask, out=out, lse=lse),
                        outputs)
    out = torch.empty_like(q) if out is None else out
    lse = packed_lse(q) if lse is None else lse
    for p in split:
        rows, keys, local = _rows(seqlens, p)
        views = (out[rows, p.q], lse[p.q, rows])
        if rows.stop == rows.start or keys.stop == keys.start:  # no call: what kernels give
            views[0].zero_()
            views[1].fill_(-math.inf)
            continue
        results = kernel._varlen_forward(
            *(_own(t, limits) for t in (q[rows, p.q], k[keys, p.kv], v[keys, p.kv])), local,
            **mask, out=_target(views[0], limits, contiguous=True),
            lse=_target(views[1], limits, contiguous=True))
        written(results, views)
    for a, b in _outside(seqlens.cu_q, q.shape[0]):  # rows of no sequence
        out[a:b] = 0
        lse[:, a:b] = -math.inf
    return out, lse


def _outside(cu, rows: int) -> list[tuple[int, int]]:
    """The row ranges of a packed tensor of ``rows`` rows outside sequences ``cu``."""
    return [(a, b) for a, b in ((0, cu[0]), (cu[-1], rows)) if b > a]


def packed_backward(kernel, dout, q, k, v, out, lse, seqlens, mask, grads=(None, None, None)):
    limits = kernel.limits
    split = _packed_split(kernel, q, k, seqlens, (dout, q, k, v, out))
    if not split:
        dq, dk, dv = grads
        return written(kernel._varlen_backward(dout, q, k, v, out, lse, seqlens, **mask, dq=dq,
                                                dk=dk, dv=dv), grads)
    grads = tuple(torch.empty_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))
    shared = {}
    for p in split:
        rows, keys, local = _rows(seqlens, p)
        views = (grads[0][rows, p.q], grads[1][keys, p.kv], grads[2][keys, p.kv])
        if rows.stop == rows.start or keys.stop == keys.start:  # no call: gradients 0
            for view in views:
                view.zero_()
            continue
        targets = [_target(views[0], limits, contiguous=True)] + \
                  [None if p.shares_kv else _target(t, limits, contiguous=True)
                   for t in views[1:]]
        results = kernel._varlen_backward(
            *(_own(t, limits) for t in (dout[rows, p.q], q[rows, p.q], k[keys, p.kv],
                                        v[keys, p.kv], out[rows, p.q])),
            lse[p.q, rows].contiguous(), local, **mask, dq=targets[0], dk=targets[1],
            dv=targets[2])
        _write_grads(results, views, p, shared, (p.sequences and p.sequences.start, p.kv.start))
    _write_sums(shared)
    for grad, cu in zip(grads, (seqlens.cu_q, seqlens.cu_k, seqlens.cu_k)):
        for a, b in _outside(cu, grad.shape[0]):  # rows of no sequence
            grad[a:b] = 0
    return grads
