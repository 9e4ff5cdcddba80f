"""Token partitioners: which rank holds which tokens of a sequence, as permutations.

``indices(S, P, r)`` lists the global positions rank r holds, in the order it holds them;
``position(slot, S, P, r)`` is the same rule as a vectorized formula. ``permutation(S, P)``
concatenates all ranks' indices; ``inverse`` (its argsort) restores the original order.
S = 16, P = 4 (digits are the rank holding each token):

    contiguous     0000 1111 2222 3333        rank r: [r*S/P, (r+1)*S/P)
    load_balanced  0011 2233 3322 1100        rank r: chunks r and 2P-1-r of 2P chunks
    striped        0123 0123 0123 0123        rank r: tokens r, r+P, r+2P, ...

Under a causal mask load_balanced gives every rank the same work at every ring step. All
three keep each rank's tokens increasing, so its own causal mask is the top-left one.
"""

from __future__ import annotations

import abc
import math

import torch


class Partition(abc.ABC):
    """A rule placing S tokens on P ranks; subclasses define ``position``."""

    name: str = ""
    increasing: bool = True  # every rank holds its tokens in increasing order

    def multiple(self, parts: int) -> int:
        """Sequence lengths must be divisible by this."""
        return parts

    def stride(self, parts: int) -> int:
        """Distance between the positions of consecutive local tokens of one run (``bands``)."""
        return 1

    def check(self, seq_len: int, parts: int) -> None:
        m = self.multiple(parts)
        if seq_len % m:
            raise ValueError(f"sequence length {seq_len} must be divisible by {m} for {self.name} "
                             f"sharding over {parts} ranks; pad the sequence to a multiple of {m}")

    def padded_length(self, lengths: torch.Tensor, parts: int) -> torch.Tensor:
        """The length each sequence of ``lengths`` is split at: rounded up to ``multiple``."""
        m = self.multiple(parts)
        return (lengths + m - 1) // m * m

    def indices(self, seq_len: int, parts: int, rank: int) -> torch.Tensor:
        """Global token positions held by ``rank``, in local order."""
        self.check(seq_len, parts)
        slots = torch.arange(seq_len // parts)
        return self.position(slots, torch.full_like(slots, seq_len), parts, rank)

    @abc.abstractmethod
    def position(self, slot, length, parts: int, rank):
        """Position in a sequence of ``length`` tokens of the token ``rank`` holds at ``slot``."""

    def permutation(self, seq_len: int, parts: int) -> torch.Tensor:
        """All ranks' indices, concatenated in rank order."""
        return torch.cat([self.indices(seq_len, parts, r) for r in range(parts)])

    def inverse(self, seq_len: int, parts: int) -> torch.Tensor:
        """Positions in ``permutation`` of tokens 0..S-1 (restores the original order)."""
        return torch.argsort(self.permutation(seq_len, parts))

    @property
    def key(self) -> tuple:
        """What makes two partitions the same rule."""
        return (self.name,)

    def __eq__(self, other) -> bool:
        return isinstance(other, Partition) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return self.name


class Contiguous(Partition):
    name = "contiguous"

    def position(self, slot, length, parts, rank):
        return rank * (length // parts) + slot


class Concatenated(Contiguous):
    """Packed sequences one after another, split into contiguous runs of equal length
    (``packing.ConcatenatedSplit``: a sequence may span ranks); one sequence as ``contiguous``.
    The split of ``ulysses``' cut documents, whose heads' work is the same whatever the split."""

    name = "concatenated"


class LoadBalanced(Partition):
    name = "load_balanced"

    def multiple(self, parts):
        return 2 * parts

    def position(self, slot, length, parts, rank):
        c = length // (2 * parts)
        late = (2 * parts - 1 - rank) * c + slot - c
        return torch.where(slot < c, rank * c + slot, late)


class Documents(LoadBalanced):
    """Packed batches: documents whole where that balances the ranks, the others cut as
    ``load_balanced`` (``schedules.assign``, within ``tolerance`` of the mean), each over as
    few ranks as fit it: every rank, a half, a quarter, ... (``groups``; False: over every
    rank)."""

    name = "documents"

    def __init__(self, tolerance: float = 0.05, groups: bool = True):
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) \
                or not tolerance >= 0:
            raise ValueError(f"tolerance={tolerance!r} must be a number >= 0 (0.05: a rank may "
                             f"hold 5% more tokens or work than the mean)")
        if not isinstance(groups, bool):
            raise ValueError(f"groups={groups!r} must be True (cut each document over as few "
                             f"ranks as fit it) or False (over every rank)")
        self.tolerance, self.groups = float(tolerance), groups

    @property
    def key(self):
        return (self.name, self.tolerance, self.groups)

    def __repr__(self) -> str:
        options = [f"tolerance={self.tolerance}"] * (self.tolerance != 0.05)
        options += ["groups=False"] * (not self.groups)
        return f"{self.name}({', '.join(options)})" if options else self.name


class Auto(Documents):
    """The default: ``load_balanced``, or ``documents`` where ``schedules.choice`` takes it."""

    name = "auto"

    def check(self, seq_len, parts):
        LoadBalanced.check(LoadBalanced(), seq_len, parts)  # dense: split as load_balanced


class Striped(Partition):
    name = "striped"

    def stride(self, parts):
        return parts

    def position(self, slot, length, parts, rank):
        return rank + slot * parts


class _Fixed(Partition):
    """A placement of sequences of given sizes only: never padded."""

    def padded_length(self, lengths, parts):
        for n in lengths.unique().tolist():
            self.check(int(n), parts)
        return lengths


class IndexMap(_Fixed):
    """A user's placement: ``index_map[r]`` lists the global tokens of rank r."""

    name = "index_map"

    def __init__(self, index_map):
        rows = [torch.as_tensor(r).flatten() for r in index_map]
        if any(r.is_floating_point() or r.is_complex() or r.dtype == torch.bool for r in rows):
            raise ValueError("index_map must hold integer token positions, not "
                             f"{sorted({str(r.dtype) for r in rows})}")
        rows = [r.long() for r in rows]
        if not rows or len({len(r) for r in rows}) != 1:
            raise ValueError("index_map must give every rank the same number of tokens")
        self.rows = torch.stack(rows)
        flat = self.rows.flatten()
        if not torch.equal(torch.sort(flat).values, torch.arange(flat.numel())):
            raise ValueError(f"index_map must hold each of the {flat.numel()} token positions "
                             f"exactly once")
        self.increasing = bool((self.rows[:, 1:] > self.rows[:, :-1]).all())

    def check(self, seq_len, parts):
        total = self.rows.numel()
        if parts != len(self.rows) or seq_len != total:
            raise ValueError(f"index_map places {total} tokens on {len(self.rows)} ranks, but the "
                             f"sequence has {seq_len} tokens over {parts} ranks; give one row per "
                             f"rank covering every token")

    def position(self, slot, length, parts, rank):
        return self.rows[rank, slot]

    @property
    def key(self):
        return (self.name, tuple(self.rows.flatten().tolist()), len(self.rows))


class VideoTiles(_Fixed):
    """Video tokens of [F, H, W] grids in raster order, each rank keeping one intact tile.
    ``frame`` = (H, W); ``tiles`` = (tf, th, tw) along frames, rows and columns, one per
    rank, in raster order.

    F = 2, H = W = 4, tiles = (1, 2, 2) (digits: rank; both frames alike):

        0 0 1 1
        0 0 1 1        every rank holds a 2 x 2 x 2 box, its tokens in raster order
        2 2 3 3
        2 2 3 3
    """

    name = "video_tiles"

    def __init__(self, frame, tiles):
        if len(tuple(frame)) != 2 or len(tuple(tiles)) != 3:
            raise ValueError(f"VideoTiles takes frame=(H, W) and tiles=(tf, th, tw), got "
                             f"frame={frame!r}, tiles={tiles!r}")
        self.frame, self.tiles = tuple(int(x) for x in frame), tuple(int(x) for x in tiles)
        if min(self.frame + self.tiles) < 1:
            raise ValueError(f"frame={frame!r} and tiles={tiles!r} must hold positive sizes")
        for what, size, count in (("rows", self.frame[0], self.tiles[1]),
                                  ("columns", self.frame[1], self.tiles[2])):
            if size % count:
                raise ValueError(f"{count} tiles along the {size} {what} of a frame do not divide "
                                 f"it; choose tiles among the divisors of frame={self.frame}")

    def check(self, seq_len, parts):
        h, w = self.frame
        if math.prod(self.tiles) != parts:
            raise ValueError(f"tiles={self.tiles} make {math.prod(self.tiles)} tiles but the "
                             f"schedule has {parts} ranks; give one tile per rank")
        if seq_len % (h * w) or (seq_len // (h * w)) % self.tiles[0]:
            raise ValueError(f"a video sequence of {seq_len} tokens is not a whole number of "
                             f"{h}x{w} frames divisible into {self.tiles[0]} tiles along frames; "
                             f"give F*{h}*{w} tokens with F a multiple of {self.tiles[0]}")

    def position(self, slot, length, parts, rank):
        (h, w), (tf, th, tw) = self.frame, self.tiles
        box = (length // (h * w) // tf, h // th, w // tw)
        tile = (rank // (th * tw), (rank // tw) % th, rank % tw)
        inner = (slot // (box[1] * box[2]), (slot // box[2]) % box[1], slot % box[2])
        f, y, x = (t * b + i for t, b, i in zip(tile, box, inner))
        return (f * h + y) * w + x

    def coordinates(self, positions: torch.Tensor) -> torch.Tensor:
        """(f, h, w) grid coordinates [N, 3] of token ``positions`` (for 3-D RoPE)."""
        h, w = self.frame
        return torch.stack([positions // (h * w), (positions // w) % h, positions % w], dim=-1)

    @property
    def key(self):
        return (self.name, self.frame, self.tiles)


_NAMED = {cls.name: cls for cls in (Contiguous, LoadBalanced, Striped, Documents, Auto)}


def get(partition: "str | Partition | list") -> Partition:
    """A partitioner from its name, an instance, or a user's index map (one row per rank)."""
    if isinstance(partition, Partition):
        return partition
    if isinstance(partition, str):
        if partition not in _NAMED:
            raise ValueError(f"partition={partition!r} is not known; use one of {sorted(_NAMED)}, "
                             f"an index map or a VideoTiles")
        return _NAMED[partition]()
    return IndexMap(partition)
