"""Which documents of a packed batch go whole to one rank, and which are cut over all ranks.

A pure function of (document lengths, ranks, tolerance), the same on every rank. Each rank
pays per token for the rest of the model and per document about L^2 for causal attention,
so a rank's load is its tokens and its work (the sum of L^2 / 2 of its documents). A whole
document needs no communication; a cut document is split over every rank by the
load-balanced partition, so each rank gets about L / P of its tokens and L^2 / (2P) of its
work, and its K/V travel.

    lengths 9 7 3 3 2 2 1 1, P = 2: a rank's share is 14 tokens and 39.5 of work
    9 has more work than a share (40.5): cut, 4.5 tokens and 20.25 work on each rank
    placed: rank 0: 7 1      + cut    12.5 tokens, 45.25 work
            rank 1: 3 3 2 2 1 + cut   15.5 tokens, 33.75 work   (work 45.25 > 1.05 x 39.5)
    cut 7 too, place again:
            rank 0: 3 2 1 + cut       14 tokens, 39.5 work
            rank 1: 3 2 1 + cut       14 tokens, 39.5 work

The rule: documents longer than a rank's share of tokens, or with more work than a rank's
share, are cut; the others are placed largest first, each on the rank where it raises the
larger of (tokens / mean tokens, work / mean work) the least. While some rank's tokens or
work exceed (1 + tolerance) x the mean, the largest whole document is cut too and the rest
placed again. Bound: every rank's tokens and work are within (1 + tolerance) of the mean
(counting each cut document as L / P tokens and L^2 / (2P) work per rank), or every
document is cut (the load-balanced split of every document).
"""

from __future__ import annotations

import dataclasses

CUT = -1  # the owner of a document cut over every rank


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The owner rank of every document (``CUT``: split over all ranks) and what each rank
    holds: ``tokens`` and ``work`` (cut documents counted as their even shares)."""

    lengths: tuple[int, ...]
    parts: int
    owner: tuple[int, ...]
    tokens: tuple[float, ...]
    work: tuple[float, ...]

    @property
    def cut(self) -> tuple[int, ...]:
        """Indices of the cut documents, in batch order."""
        return tuple(i for i, o in enumerate(self.owner) if o == CUT)

    def whole(self, rank: int) -> tuple[int, ...]:
        """Indices of the documents ``rank`` holds whole, in batch order."""
        return tuple(i for i, o in enumerate(self.owner) if o == rank)

    @property
    def imbalance(self) -> tuple[float, float]:
        """(most tokens, most work) of a rank over the mean (1.0: even)."""
        return (_ratio(max(self.tokens), sum(self.tokens) / self.parts),
                _ratio(max(self.work), sum(self.work) / self.parts))


def work(length: int) -> float:
    """The causal attention work of one document of ``length`` tokens (pairs)."""
    return length * length / 2


def assign(lengths, parts: int, *, tolerance: float = 0.05) -> Assignment:
    """The ``Assignment`` of documents of ``lengths`` tokens over ``parts`` ranks (pure)."""
    lengths = tuple(int(n) for n in lengths)
    if parts < 1 or any(n < 0 for n in lengths):
        raise ValueError(f"assign takes lengths >= 0 and parts >= 1, got {lengths}, {parts}")
    total_tokens = sum(lengths)
    total_work = sum(work(n) for n in lengths)
    mean_tokens, mean_work = total_tokens / parts, total_work / parts
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cut = {i for i in order
           if parts > 1 and (lengths[i] > mean_tokens or work(lengths[i]) > mean_work)}
    limit = 1.0 + tolerance
    while True:
        owner, tokens, loads = _place(lengths, parts, order, cut, mean_tokens, mean_work)
        whole = [i for i in order if i not in cut]
        balanced = (max(tokens) <= limit * mean_tokens + 1e-9
                    and max(loads) <= limit * mean_work + 1e-9)
        if balanced or not whole:
            return Assignment(lengths, parts, tuple(owner), tuple(tokens), tuple(loads))
        cut.add(whole[0])


def _place(lengths, parts, order, cut, mean_tokens, mean_work):
    """(owner, tokens, work) after placing every document not in ``cut`` largest first."""
    shared_tokens = sum(lengths[i] for i in cut) / parts
    shared_work = sum(work(lengths[i]) for i in cut) / parts
    tokens, loads = [shared_tokens] * parts, [shared_work] * parts
    owner = [CUT] * len(lengths)
    for i in order:
        if i in cut:
            continue
        n, w = lengths[i], work(lengths[i])
        rank = min(range(parts), key=lambda r: (max(_ratio(tokens[r] + n, mean_tokens),
                                                    _ratio(loads[r] + w, mean_work)),
                                                tokens[r], r))
        owner[i] = rank
        tokens[rank] += n
        loads[rank] += w
    return owner, tokens, loads


def _ratio(value: float, mean: float) -> float:
    return value / mean if mean > 0 else 0.0
