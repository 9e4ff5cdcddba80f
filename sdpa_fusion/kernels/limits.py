"""The sizes a kernel is trusted with, and how a call past them is split into calls inside.

GPU attention kernels index their tensors with 32-bit offsets in places. Past 2^31 elements
ATen's cuDNN backward returns a wrong dQ with no error (b=1, 32 heads of 128: from 524,288
tokens on), ATen's varlen flash reads out of bounds (the CUDA context is lost), and
FlashAttention-4's varlen backward wraps ``cu_seqlens[i] * dout.stride(0)`` in 32 bits
(flash-attention issue 2611). So every kernel states its ``Limits``, and ``dense_pieces`` and
``packed_pieces`` cut a call past them into calls inside, each exact on its own (heads,
batch elements and packed sequences do not mix in attention):

    0. packed: consecutive sequences apart with every head, when each sequence fits so (their
       rows of [T, H, E] are one block: no copy in or out);
    1. groups of K/V heads (with their query heads), all batch elements at once if they fit;
    2. else batch elements apart, or consecutive packed sequences apart;
    3. else the query heads of one K/V head apart (their dK/dV summed);
    4. else (one head of one sequence is past the limit) nothing: ``too_long`` says why.

``pieces`` runs them, copying a piece's input that is a view past the limit first. All
functions here are pure.
"""

from __future__ import annotations

import dataclasses

import torch

ELEMENTS_32BIT = 1 << 31  # a 32-bit signed offset reaches elements [0, 2^31)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one call of a kernel may take: every tensor spanning at most ``elements``
    elements (``span``: a view of some heads of a [B, S, H, E] buffer spans all its rows), and
    at most ``elements`` per tensor even where the kernel widens K/V to every query head (GQA)
    or its workspaces add ``rows_per_sequence`` rows per sequence (``dense_size``,
    ``packed_rows``). ``why`` says where the limit comes from."""

    elements: int = ELEMENTS_32BIT
    rows_per_sequence: int = 0
    why: str = ""


def span(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last in memory (its strides included); 0 if empty."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))


def fits(t: torch.Tensor | None, limits: Limits | None) -> bool:
    """Whether a kernel of ``limits`` (None: no limit) may take ``t`` as it is (None:
    nothing to take)."""
    return t is None or limits is None or span(t) <= limits.elements


@dataclasses.dataclass(frozen=True)
class Piece:
    """One call of a split: batch elements ``batch``, K/V heads ``kv`` and query heads ``q``
    (slices), and for packed calls the sequences ``sequences`` (a slice of them, None: all).
    ``shares_kv``: other pieces have the same K/V heads (their dK/dV are summed)."""

    batch: slice
    q: slice
    kv: slice
    sequences: slice | None = None
    shares_kv: bool = False


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _head_plan(batch: int, heads: int, kv_heads: int, per_head: int, limit: int):
    """(batch elements per piece, K/V heads per piece, query heads per piece) of the fewest
    pieces of ``per_head`` elements per query head and batch element that keep each piece
    within ``limit``; None when one query head of one batch element is past it."""
    groups = heads // kv_heads
    best = None
    for kv in _divisors(kv_heads):
        per_element = kv * groups * per_head
        if per_element > limit:
            continue
        b = min(batch, limit // per_element)
        if best is None or b * kv > best[0] * best[1]:
            best = (b, kv, kv * groups)
    if best is not None:
        return best
    for q in _divisors(groups):  # the query heads of one K/V head apart
        if q * per_head <= limit:
            return 1, 1, q
    return None


def _head_pieces(batch: int, heads: int, kv_heads: int, plan) -> list[Piece]:
    b, kv, q = plan
    groups = heads // kv_heads
    pieces = []
    for b0 in range(0, batch, b):
        rows = slice(b0, min(b0 + b, batch))
        for kv0 in range(0, kv_heads, kv):
            for q0 in range(kv0 * groups, (kv0 + kv) * groups, q):
                pieces.append(Piece(rows, slice(q0, q0 + q), slice(kv0, kv0 + kv),
                                    shares_kv=q < kv * groups))
    return pieces


def dense_size(shape_q, shape_k, limits: Limits) -> int:
    """Elements a dense call on q [B, H, S_q, E] and k, v [B, H_kv, S_k, E] sizes its tensors
    and workspaces by: every query head over the longer side, padded."""
    batch, heads, s_q, e = shape_q
    return batch * heads * (max(s_q, shape_k[2]) + limits.rows_per_sequence) * e


def dense_pieces(shape_q, shape_k, limits: Limits | None) -> list[Piece] | None:
    """The pieces of a dense call on q [B, H, S_q, E] and k, v [B, H_kv, S_k, E] (shapes):
    ``[]`` when the whole call fits ``limits`` (None: no limit), else calls that fit, or
    None when one query head of one batch element does not."""
    if limits is None or dense_size(shape_q, shape_k, limits) <= limits.elements:
        return []
    batch, heads = shape_q[:2]
    kv_heads = shape_k[1]
    per_head = dense_size((1, 1, *shape_q[2:]), shape_k, limits)
    plan = _head_plan(batch, heads, kv_heads, per_head, limits.elements)
    return None if plan is None else _head_pieces(batch, heads, kv_heads, plan)


def packed_rows(lengths_q, lengths_k, limits: Limits) -> int:
    """Rows a packed call of sequences of ``lengths_q`` queries and ``lengths_k`` keys sizes
    its tensors and workspaces by: the longer side plus the rows padded per sequence."""
    return max(sum(lengths_q), sum(lengths_k)) + limits.rows_per_sequence * len(lengths_q)


def packed_pieces(lengths_q, lengths_k, heads: int, kv_heads: int, e: int,
                  limits: Limits | None) -> list[Piece] | None:
    """The pieces of a packed call of sequences of ``lengths_q`` queries and ``lengths_k``
    keys (lists), tensors [T, H, E]: ``[]`` when it fits, else steps 0 to 3 of the module
    docstring, or None when one head of one sequence does not fit."""
    if limits is None:
        return []
    limit, rows = limits.elements, packed_rows(lengths_q, lengths_k, limits)
    if rows * heads * e <= limit:
        return []
    runs = sequence_runs(lengths_q, lengths_k, limits, limit // (heads * e))
    if runs is not None:  # every head of each run: its rows of [T, H, E] are one block
        every_head = _head_pieces(1, heads, kv_heads, (1, kv_heads, heads))
        return [dataclasses.replace(p, sequences=r) for r in runs for p in every_head]
    plan = _head_plan(1, heads, kv_heads, rows * e, limit)
    if plan is not None:
        return _head_pieces(1, heads, kv_heads, plan)
    runs = sequence_runs(lengths_q, lengths_k, limits, limit // e)
    if runs is None:
        return None
    longest = max(packed_rows(lengths_q[r], lengths_k[r], limits) for r in runs)
    plan = _head_plan(1, heads, kv_heads, longest * e, limit)
    return [dataclasses.replace(p, sequences=r) for r in runs
            for p in _head_pieces(1, heads, kv_heads, plan)]


def sequence_runs(lengths_q, lengths_k, limits: Limits, rows: int) -> list[slice] | None:
    """Consecutive sequences grouped so that each group's ``packed_rows`` stays within
    ``rows``; None when one sequence alone is past it."""
    runs, start = [], 0
    while start < len(lengths_q):
        stop = start + 1
        if packed_rows(lengths_q[start:stop], lengths_k[start:stop], limits) > rows:
            return None
        while stop < len(lengths_q) and packed_rows(lengths_q[start:stop + 1],
                                                    lengths_k[start:stop + 1], limits) <= rows:
            stop += 1
        runs.append(slice(start, stop))
        start = stop
    return runs


def too_long(name: str, limits: Limits | None, rows: int, keys: int, head_dim: int) -> str | None:
    """Why kernel ``name`` cannot run a call of ``rows`` queries and ``keys`` keys of one head
    (the least piece a split leaves), or None when it can."""
    if limits is None:
        return None
    size = (max(rows, keys) + limits.rows_per_sequence) * head_dim
    if size <= limits.elements:
        return None
    padded = f" + {limits.rows_per_sequence} rows its workspaces add" \
        if limits.rows_per_sequence else ""
    return (f"kernel {name!r} takes at most {limits.elements:,} elements per tensor per call"
            f"{' (' + limits.why + ')' if limits.why else ''}, and one head of one sequence "
            f"here is ({max(rows, keys):,} tokens{padded}) x {head_dim} = {size:,}; no split "
            f"of heads, batch or sequences brings it inside")
