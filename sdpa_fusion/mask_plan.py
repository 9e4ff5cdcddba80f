"""A composed mask on a block of queries and a block of keys, compiled to kernel calls
(pure decisions, no kernel and no data; ``sdpa_fusion.masked`` runs them).

The rows of a block are ``Tokens``: each row's sequence (-1: padding, which sees nothing)
and position. A structured mask (``sdpa_fusion.masks``) is evaluated per pair of
*segments*, runs of rows whose positions step by the partition's stride and whose classes
(document, span, chunk, prefix) do not change: there it keeps a few disjoint intervals of
k - q, each a band that ``mask.cut`` turns into one call (none when empty, unmasked when
full, causal or a window otherwise):

    causal | bidirectional_spans([(4, 8)]) over 12 tokens: segments 0-3 | 4-7 | 8-11
    rows 0-3   keys 0-3 causal
    rows 4-7   keys 0-7 full          (keys 0-3 full and keys 4-7 the span, joined)
    rows 8-11  keys 0-7 full, keys 8-11 causal
    calls: rows 0-3 x keys 0-3 causal, rows 4-11 x keys 0-7 full, rows 8-11 x 8-11 causal

A band without a left edge and a right edge r > 0 runs as keys [0, r) unmasked and the
rest causal, so kernels without windows run every mask without ``masks.window`` or ``~``.
A ``mask_mod`` is evaluated per ``TILE`` x ``TILE`` tile, cut within each run of rows of one
sequence and each run of its keys (a call never reads another sequence's rows or keys, nor
padding): empty tiles make no call, full ones run unmasked (neighbours joined), partial ones
with the explicit mask, or as a causal call where that mask is (a diagonal tile).
Tiles that no other call reaches (short sequences) run together, ``Batch`` members of one
call, each attending its own rows and keys only:

    2,000 documents of 1-16 tokens under a causal mask_mod: 2,000 partial tiles, 17 calls
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools

import torch

from .mask import Window, band, cut, visible_pairs
from .masks import INF, Mask

TILE = 128  # rows and keys of a tile of a mask_mod
_FAR = INF >> 8  # a side this far is unbounded (cut divides sides by the stride)


@dataclasses.dataclass(frozen=True, eq=False)
class Tokens:
    """Sequence (-1: padding) and position of every row of a block; positions of a run
    step by ``stride``."""

    seq: torch.Tensor
    pos: torch.Tensor
    stride: int = 1

    @classmethod
    def dense(cls, positions: torch.Tensor, stride: int = 1) -> "Tokens":
        return cls(torch.zeros_like(positions), positions, stride)

    def of(self, b: int) -> "Tokens":
        """These rows as rows of batch element ``b``."""
        return Tokens(torch.where(self.seq >= 0, b, -1), self.pos, self.stride)


@dataclasses.dataclass(frozen=True, eq=False)
class Batch:
    """Tiles of short sequences run as one call: member i attends the rows ``rows[i]``
    (indices into the block; -1 pads) to the keys ``keys[i]`` under ``seen[i]`` [rows, keys]
    (False on pads)."""

    rows: torch.Tensor
    keys: torch.Tensor
    seen: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class Piece:
    """One kernel call: query ``rows`` vs ``keys`` (slices) with ``causal`` and ``window``
    (top-left in its own rows), or the explicit bool mask ``seen``, or the members of a
    ``batch`` inside ``rows`` x ``keys`` (rows and keys of those no member reaches none)."""

    rows: slice
    keys: slice
    causal: bool = False
    window: Window | None = None
    seen: torch.Tensor | None = None
    batch: Batch | None = None

    def pairs(self, n_q: int, n_k: int) -> int:
        if self.batch is not None:
            return int(self.batch.seen.sum())
        if self.seen is not None:
            return int(self.seen.sum())
        return visible_pairs(len(range(n_q)[self.rows]), len(range(n_k)[self.keys]),
                             band(self.causal, self.window))


def pieces(mask: Mask, q: Tokens, k: Tokens) -> list[Piece]:
    """The kernel calls of queries ``q`` vs keys ``k`` under ``mask``."""
    if not len(q.pos) or not len(k.pos):
        return []
    found = _banded(mask, q, k) if mask.structured else \
        _causal_tiles(_batched(_tiled(mask, q, k), len(q.pos), len(k.pos)))
    return _joined(found, len(q.pos), len(k.pos))


def packed_tokens(sequences, tokens: int) -> Tokens:
    """The ``Tokens`` of ``tokens`` packed rows holding ``sequences`` = [(start, length)]."""
    seq = torch.full((tokens,), -1, dtype=torch.long)
    pos = torch.zeros(tokens, dtype=torch.long)
    for i, (start, n) in enumerate(sequences):
        seq[start:start + n] = i
        pos[start:start + n] = torch.arange(n)
    return Tokens(seq, pos)


def problem_of(spec) -> tuple:
    """(mask, batch, q_len, kv_len, sequences or None): what a mask's calls over the whole
    problem of ``spec`` depend on, and nothing that holds a rank's packing (a cache key)."""
    sequences = tuple(spec.sequences()) if spec.layout.is_varlen else None
    return spec.mask, 1 if sequences is not None else spec.batch, spec.q_len, spec.kv_len, \
        sequences


def problem_tokens(batch: int, q_len: int, kv_len: int, sequences) -> tuple[Tokens, Tokens]:
    """(query, key) ``Tokens`` of a problem of ``problem_of`` (packed: one block of T rows)."""
    if sequences is not None:
        tokens = packed_tokens(sequences, q_len)
        return tokens, tokens
    return Tokens.dense(torch.arange(q_len)), Tokens.dense(torch.arange(kv_len))


def batch_pieces(mask: Mask, q: Tokens, k: Tokens, batch: int = 1) -> tuple:
    """((batch slice, pieces), ...) of queries ``q`` vs keys ``k`` on ``batch`` elements (one
    part for all when the mask is the same for all), none without pieces."""
    if mask.batched and batch > 1:
        parts = [(slice(b, b + 1), pieces(mask, q.of(b), k.of(b))) for b in range(batch)]
    else:
        parts = [(slice(None), pieces(mask, q, k))]
    return tuple((b, tuple(p)) for b, p in parts if p)


def coverage(spans, n: int) -> tuple[tuple[int, int, int], ...]:
    """(start, stop, calls) of the ranges that the slices ``spans`` cut range(n) into, with
    how many of them reach each (0: none)."""
    delta = {0: 0, n: 0}
    for span in spans:
        start, stop, _ = span.indices(n)
        if start < stop:
            delta[start] = delta.get(start, 0) + 1
            delta[stop] = delta.get(stop, 0) - 1
    edges = sorted(delta)
    depth, ranges = 0, []
    for start, stop in zip(edges, edges[1:]):
        depth += delta[start]
        ranges.append((start, stop, depth))
    return tuple(ranges)


def spec_pairs(spec) -> int:
    """Query-key pairs the mask of ``spec`` keeps, over the whole problem (once per problem:
    ``flops`` asks for it often)."""
    return _pairs(*problem_of(spec))


@functools.lru_cache(maxsize=32)
def _pairs(mask: Mask, batch: int, q_len: int, kv_len: int, sequences) -> int:
    q, k = problem_tokens(batch, q_len, kv_len, sequences)
    parts = batch_pieces(mask, q, k, batch)
    every = 1 if mask.batched else batch
    return every * sum(p.pairs(len(q.pos), len(k.pos)) for _, found in parts for p in found)


# ---- structured masks: segments and bands ----------------------------------------------------
# per segment: its first row, row count, first position, sequence, and each leaf's class
_Segments = collections.namedtuple("_Segments", "row count first seq classes")


def _segments(leaves, t: Tokens) -> _Segments:
    real = t.seq >= 0
    b = t.seq.clamp(min=0)
    pos = torch.where(real, t.pos, 0)  # padding's slots may lie past a table; no class read
    classes = [leaf.classes(b, pos) for leaf in leaves]
    start = real.clone()
    if len(start) > 1:
        change = (t.seq[1:] != t.seq[:-1]) | (t.pos[1:] != t.pos[:-1] + t.stride) | ~real[:-1]
        for c in classes:
            change |= c[1:] != c[:-1]
        start[1:] &= change
    first = start.nonzero()[:, 0]
    segment = torch.cumsum(start.long(), 0) - 1
    count = torch.bincount(segment[real], minlength=len(first))
    return _Segments(first, count, t.pos[first], t.seq[first], [c[first] for c in classes])


def _banded(mask: Mask, q: Tokens, k: Tokens) -> list[Piece]:
    leaves = [leaf for leaf in mask.leaves() if leaf.classed]
    sq, sk = _segments(leaves, q), _segments(leaves, k)
    cls = {id(leaf): (cq.unsqueeze(1), ck.unsqueeze(0))
           for leaf, cq, ck in zip(leaves, sq.classes, sk.classes)}
    lo, hi = mask.intervals(cls)
    shape = (len(sq.row), len(sk.row), lo.shape[-1])
    lo, hi = lo.expand(shape), hi.expand(shape)
    same = (sq.seq.unsqueeze(1) == sk.seq.unsqueeze(0)).unsqueeze(-1)
    a, b, s = (same & (lo <= hi)).nonzero().unbind(1)
    c = cut(sq.count[a], sk.count[b], sq.first[a] - sk.first[b], q.stride,
            (-lo[a, b, s], hi[a, b, s]))
    row0, key0 = sq.row[a] + c.row_cut, sk.row[b] + c.key_cut
    found = []
    for i in (c.rows > 0).nonzero()[:, 0].tolist():
        rows = slice(int(row0[i]), int(row0[i] + c.rows[i]))
        keys = slice(int(key0[i]), int(key0[i] + c.keys[i]))
        found += _lowered(rows, keys, bool(c.full[i]), int(c.left[i]), int(c.right[i]))
    return found


def _lowered(rows: slice, keys: slice, full: bool, left: int, right: int) -> list[Piece]:
    """The pieces of a band (left, right) on ``rows`` x ``keys``: one call, or keys [0, r)
    without a mask and the rest causal for a band (unbounded, r)."""
    if full:
        return [Piece(rows, keys)]
    left = None if left >= _FAR else left
    right = None if right >= _FAR else right
    if left is None and right == 0:
        return [Piece(rows, keys, causal=True)]
    if left is None and right is not None:
        split = keys.start + right
        return [Piece(rows, slice(keys.start, split)), Piece(rows, slice(split, keys.stop), True)]
    return [Piece(rows, keys, window=Window(left, right))]


# ---- mask_mod: tiles ------------------------------------------------------------------------
def _tiled(mask: Mask, q: Tokens, k: Tokens) -> list[Piece]:
    """Tiles cut within each run of rows of one sequence and each run of its keys: a call
    reads no other sequence's keys or rows, nor padding (masked entries still meet the
    values they are masked from: 0 * NaN). A run of rows that is one tile against its
    sequence's one run of keys, one tile too, is asked of the mask with others like it
    (``_single_tiles``)."""
    keys_of = collections.defaultdict(list)
    for s, start, stop in sequence_runs(k.seq):
        keys_of[s].append(slice(start, stop))
    found, single = [], []
    for s, start, stop in sequence_runs(q.seq):
        runs = keys_of[s]
        if stop - start <= TILE and len(runs) == 1 and runs[0].stop - runs[0].start <= TILE:
            single.append((s, slice(start, stop), runs[0]))
            continue
        for r0 in range(start, stop, TILE):
            rows = slice(r0, min(r0 + TILE, stop))
            b = torch.full((rows.stop - r0, 1), s, dtype=torch.long)
            pq = q.pos[rows].unsqueeze(1)
            for run in runs:
                seen = mask.visible(b, pq, k.pos[run].unsqueeze(0))
                found += _tiles(rows, run, seen.expand(len(b), run.stop - run.start))
    for at in range(0, len(single), SINGLE_TILES):
        found += _single_tiles(mask, q, k, single[at:at + SINGLE_TILES])
    return found


SINGLE_TILES = 256  # single tiles asked of a mask_mod in one call at most


def _single_tiles(mask: Mask, q: Tokens, k: Tokens, single) -> list[Piece]:
    """The pieces of ``single`` = [(sequence, rows, keys)], each one tile: the mask asked once
    for all of them, padded to the largest (pads at position 0, and never seen)."""
    n_r = max(rows.stop - rows.start for _, rows, _ in single)
    n_k = max(keys.stop - keys.start for _, _, keys in single)

    def side(spans, n: int, t: Tokens):
        first = torch.tensor([span.start for span in spans]).unsqueeze(1)
        size = torch.tensor([span.stop - span.start for span in spans]).unsqueeze(1)
        real = torch.arange(n).unsqueeze(0) < size
        at = torch.where(real, first + torch.arange(n).unsqueeze(0), 0)
        return torch.where(real, t.pos[at], 0), real

    pq, real_q = side([rows for _, rows, _ in single], n_r, q)
    pk, real_k = side([keys for _, _, keys in single], n_k, k)
    b = torch.tensor([s for s, _, _ in single]).view(-1, 1, 1)
    seen = mask.visible(b, pq.unsqueeze(2), pk.unsqueeze(1)) & real_q.unsqueeze(2) \
        & real_k.unsqueeze(1)
    counts = seen.sum((1, 2)).tolist()
    found = []
    for (_, rows, keys), count, tile in zip(single, counts, seen):
        r, c = rows.stop - rows.start, keys.stop - keys.start
        if count == r * c:
            found.append(Piece(rows, keys))
        elif count:
            found.append(Piece(rows, keys, seen=tile[:r, :c].clone()))
    return found


def sequence_runs(seq: torch.Tensor) -> list[tuple[int, int, int]]:
    """(sequence, start, stop) of each run of rows of one sequence (padding, -1, in none)."""
    if not len(seq):
        return []
    first = torch.ones(len(seq), dtype=torch.bool)
    first[1:] = seq[1:] != seq[:-1]
    starts = first.nonzero()[:, 0].tolist()
    return [(s, start, stop) for s, start, stop in
            zip(seq[starts].tolist(), starts, starts[1:] + [len(seq)]) if s >= 0]


def _tiles(rows: slice, keys: slice, seen: torch.Tensor) -> list[Piece]:
    """The pieces of ``rows`` x the run ``keys`` (``seen`` [rows, keys]) per ``TILE`` keys:
    none where empty, unmasked where full, the explicit mask otherwise (neighbours of a kind
    joined)."""
    n_r, n_k = seen.shape
    tiles = -(-n_k // TILE)
    padded = torch.zeros(n_r, tiles * TILE, dtype=torch.long)
    padded[:, :n_k] = seen
    counts = padded.view(n_r, tiles, TILE).sum((0, 2))
    widths = torch.full((tiles,), TILE)
    widths[-1] = n_k - (tiles - 1) * TILE
    kind = torch.where(counts == 0, 0, torch.where(counts == widths * n_r, 1, 2))
    found, t = [], 0
    for each, run in itertools.groupby(kind.tolist()):
        end = t + len(list(run))
        cols = slice(t * TILE, min(end * TILE, n_k))
        span = slice(keys.start + cols.start, keys.start + cols.stop)
        if each == 1:
            found.append(Piece(rows, span))
        elif each == 2:
            found.append(Piece(rows, span, seen=seen[:, cols].clone()))
        t = end
    return found


BATCH_TILES = 8  # a call of batched tiles spans this many tiles' rows at most


def _batched(found: list[Piece], n_q: int, n_k: int) -> list[Piece]:
    """Runs of tiles whose rows and keys no other piece reaches, in row order, each joined
    into one ``Batch`` call while ``_Run.takes`` the next."""
    depth = {side: _reached([getattr(p, side) for p in found], n)
             for side, n in (("rows", n_q), ("keys", n_k))}
    busy = {side: [0, *itertools.accumulate(d > 0 for d in at)] for side, at in depth.items()}
    alone = sorted((p for p in found if _small(p)
                    and all(max(depth[side][getattr(p, side)]) == 1 for side in depth)),
                   key=lambda p: p.rows.start)
    runs: list[_Run] = []
    for p in alone:
        if runs and runs[-1].takes(p, busy):
            runs[-1].add(p)
        else:
            runs.append(_Run(p))
    joined = [run.members for run in runs if len(run.members) > 1]
    taken = {id(p) for members in joined for p in members}
    return [p for p in found if id(p) not in taken] + [_batch(members) for members in joined]


class _Run:
    """Tiles joined into one batched call so far: its ``members``, the rows and keys it
    spans, how many of them its members hold, and its largest member's rows and keys."""

    SIDES = ("rows", "keys")

    def __init__(self, p: Piece):
        self.members = [p]
        self.span = {side: (getattr(p, side).start, getattr(p, side).stop) for side in self.SIDES}
        self.held = {side: b - a for side, (a, b) in self.span.items()}
        self.most = dict(self.held)

    def takes(self, p: Piece, busy: dict) -> bool:
        """Whether ``p`` joins: the rows and keys the run then spans are its members' or no
        piece's (``busy``: running counts of those some piece reaches), its rows span
        ``BATCH_TILES`` tiles at most, and its members padded to the largest hold as many
        scores as ``BATCH_TILES`` tiles at most."""
        span, held, most = self._with(p)
        rows = span["rows"]
        return (rows[1] - rows[0] <= BATCH_TILES * TILE
                and (len(self.members) + 1) * most["rows"] * most["keys"]
                <= BATCH_TILES * TILE * TILE
                and all(busy[side][b] - busy[side][a] == held[side]
                        for side, (a, b) in span.items()))

    def add(self, p: Piece) -> None:
        self.members.append(p)
        self.span, self.held, self.most = self._with(p)

    def _with(self, p: Piece) -> tuple[dict, dict, dict]:
        """(span, held, most) of this run with ``p`` joined."""
        span, held, most = {}, {}, {}
        for side in self.SIDES:
            own = getattr(p, side)
            span[side] = (min(self.span[side][0], own.start), max(self.span[side][1], own.stop))
            held[side] = self.held[side] + own.stop - own.start
            most[side] = max(self.most[side], own.stop - own.start)
        return span, held, most


def _causal_tiles(found: list[Piece]) -> list[Piece]:
    """Square partial tiles whose mask is causal (the diagonal tiles of a causal
    ``mask_mod``) as the kernel's causal calls: square, so that kernels aligning the mask
    bottom-right agree."""
    out = []
    for p in found:
        r, c = (0, 0) if p.seen is None else p.seen.shape
        if r == c and r and torch.equal(p.seen, torch.ones(r, r, dtype=torch.bool).tril()):
            out.append(Piece(p.rows, p.keys, causal=True))
        else:
            out.append(p)
    return out


def _small(p: Piece) -> bool:
    """Whether ``p`` is a partial tile, or a tile's unmasked piece (a short sequence's)."""
    return p.seen is not None or (_plain(p) and p.rows.stop - p.rows.start <= TILE
                                  and p.keys.stop - p.keys.start <= TILE)


def _reached(spans, n: int) -> list[int]:
    """How many of the slices ``spans`` reach each of range(n) (``coverage``, per index)."""
    return [calls for start, stop, calls in coverage(spans, n) for _ in range(start, stop)]


def _batch(run: list[Piece]) -> Piece:
    """One call of the tiles ``run`` (partial or unmasked), padded to the largest of them."""
    n_r = max(p.rows.stop - p.rows.start for p in run)
    n_k = max(p.keys.stop - p.keys.start for p in run)
    rows = torch.full((len(run), n_r), -1, dtype=torch.long)
    keys = torch.full((len(run), n_k), -1, dtype=torch.long)
    seen = torch.zeros(len(run), n_r, n_k, dtype=torch.bool)
    for i, p in enumerate(run):
        r, c = p.rows.stop - p.rows.start, p.keys.stop - p.keys.start
        rows[i, :r] = torch.arange(p.rows.start, p.rows.stop)
        keys[i, :c] = torch.arange(p.keys.start, p.keys.stop)
        seen[i, :r, :c] = True if p.seen is None else p.seen
    return Piece(slice(min(p.rows.start for p in run), max(p.rows.stop for p in run)),
                 slice(min(p.keys.start for p in run), max(p.keys.stop for p in run)),
                 batch=Batch(rows, keys, seen))


# ---- fewer, larger calls --------------------------------------------------------------------
def _joined(found: list[Piece], n_q: int, n_k: int) -> list[Piece]:
    """Unmasked pieces that meet joined: along the keys of one row range, then along the rows
    of one key range; a range of every row or key as ``slice(None)``."""
    found = _join(found, lambda p: (p.rows.start, p.rows.stop), lambda p: p.keys, "keys")
    found = _join(found, lambda p: (p.keys.start, p.keys.stop), lambda p: p.rows, "rows")
    return [dataclasses.replace(p, rows=_whole(p.rows, n_q), keys=_whole(p.keys, n_k))
            for p in found]


def _join(found, group, span, field):
    plain = sorted((p for p in found if _plain(p)), key=lambda p: (group(p), span(p).start))
    joined = []
    for p in plain:
        last = joined[-1] if joined else None
        if last is not None and group(last) == group(p) and span(last).stop == span(p).start:
            joined[-1] = dataclasses.replace(last, **{field: slice(span(last).start, span(p).stop)})
        else:
            joined.append(p)
    return joined + [p for p in found if not _plain(p)]


def _plain(p: Piece) -> bool:
    return not p.causal and p.window is None and p.seen is None and p.batch is None


def _whole(span: slice, n: int) -> slice:
    return slice(None) if (span.start, span.stop) == (0, n) else span
