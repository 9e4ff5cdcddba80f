"""Which documents of a packed batch go whole to one rank, and which are cut over ranks.

A pure function of (document lengths, ranks, tolerance). A rank's load is its tokens and its
work: per document its L^2 / 2 causal query-key pairs plus ``TOKEN_PAIRS`` per token. A whole
document needs no communication; a cut one is split load-balanced over every rank (L / P of
its tokens and work each), and its K/V travel.

    (token_pairs=0 in this picture)
    lengths 9 7 3 3 2 2 1 1, P = 2: a rank's share is 14 tokens and 39.5 of work
    9 has more work than a share (40.5): cut, 4.5 tokens and 20.25 work on each rank
    placed: rank 0: 7 1      + cut    12.5 tokens, 45.25 work
            rank 1: 3 3 2 2 1 + cut   15.5 tokens, 33.75 work   (work 45.25 > 1.05 x 39.5)
    cut 7 too, place again:
            rank 0: 3 2 1 + cut       14 tokens, 39.5 work
            rank 1: 3 2 1 + cut       14 tokens, 39.5 work

The rule: documents with more tokens or work than a rank's share are cut; the others are
placed largest first, each on the rank where it raises the larger of (tokens / mean tokens,
work / mean work) the least. While some rank exceeds (1 + tolerance) x the mean, the largest
whole document is cut too and the rest placed again. Without the per-token term, batch (c)
of ``benchmarks.virtual_ranks`` cut all six long documents; by time only two need cutting.

``plan`` cuts over fewer ranks where it can: when the documents fit whole into groups of g
consecutive ranks (``assign`` over P / g groups cuts none), each group is assigned on its
own and its cut documents are split over its g ranks only, their K/V travelling inside it,
kept where every rank stays within the tolerance of the batch's mean:

    P = 4, two documents longer than a rank's share and many short ones
    assign over 4 ranks:  both cut over ranks 0-3, three of every four blocks travel
    plan, groups of 2:    one cut over ranks 0-1, the other over ranks 2-3, one block travels
"""

from __future__ import annotations

import dataclasses
import functools
import math

CUT = -1  # the owner of a cut document (split over the ranks of its group)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The owner rank of every document (``CUT``: split over the ranks of its group) and each
    rank's ``tokens`` and ``work`` (cut documents as their even shares). Groups are the runs
    of ``group_size`` consecutive ranks (one group of every rank by default); ``group`` names
    every document's."""

    lengths: tuple[int, ...]
    parts: int
    owner: tuple[int, ...]
    tokens: tuple[float, ...]
    work: tuple[float, ...]
    group_size: int = 0  # 0: every rank
    group: tuple[int, ...] = ()  # (): every document in group 0

    def __post_init__(self):
        if not self.group_size:
            object.__setattr__(self, "group_size", self.parts)
        if not self.group:
            object.__setattr__(self, "group", (0,) * len(self.lengths))

    @property
    def cut(self) -> tuple[int, ...]:
        """Indices of the cut documents, in batch order."""
        return tuple(i for i, o in enumerate(self.owner) if o == CUT)

    def cut_in(self, group: int) -> tuple[int, ...]:
        """Indices of the documents cut over the ranks of ``group``, in batch order."""
        return tuple(i for i in self.cut if self.group[i] == group)

    def whole(self, rank: int) -> tuple[int, ...]:
        """Indices of the documents ``rank`` holds whole, in batch order."""
        return tuple(i for i, o in enumerate(self.owner) if o == rank)

    @property
    def imbalance(self) -> tuple[float, float]:
        """(most tokens, most work) of a rank over the mean (1.0: even)."""
        return (_ratio(max(self.tokens), sum(self.tokens) / self.parts),
                _ratio(max(self.work), sum(self.work) / self.parts))


# What attention costs per token apart from its query-key pairs, in pairs: a least-squares
# fit of fwd+bwd time = pairs x 0.088 ms/M + tokens x 0.054 ms/K over the one-GPU rows of
# batches a-d in benchmarks/results/virtual_ranks.json (FA4, bf16, 32 heads of 128, H200):
# 617 pairs a token, within 2 ms of each batch's time.
TOKEN_PAIRS = 600


def work(length: int, token_pairs: float = TOKEN_PAIRS) -> float:
    """The causal attention work of a document of ``length`` tokens, in query-key pairs."""
    return length * length / 2 + token_pairs * length


def assign(lengths, parts: int, *, tolerance: float = 0.05,
           token_pairs: float = TOKEN_PAIRS) -> Assignment:
    """The ``Assignment`` of documents of ``lengths`` tokens over ``parts`` ranks (pure, cached)."""
    return _assign(tuple(int(n) for n in lengths), parts, tolerance, token_pairs)


@functools.lru_cache(maxsize=8)
def _assign(lengths: tuple[int, ...], parts: int, tolerance: float,
            token_pairs: float) -> Assignment:
    if parts < 1 or any(n < 0 for n in lengths):
        raise ValueError(f"assign takes lengths >= 0 and parts >= 1, got {lengths}, {parts}")
    works = tuple(work(n, token_pairs) for n in lengths)
    mean_tokens, mean_work = sum(lengths) / parts, sum(works) / parts
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cut = {i for i in order
           if parts > 1 and (lengths[i] > mean_tokens or works[i] > mean_work)}
    limit = 1.0 + tolerance
    while True:
        whole = [i for i in order if i not in cut]
        shared = (sum(lengths[i] for i in cut) / parts, sum(works[i] for i in cut) / parts)
        # the largest whole document past the bound on any rank, with the cut documents'
        # shares alone (by more than rounding): placing them all could only end in cutting it
        if whole and (shared[0] + lengths[whole[0]] > limit * mean_tokens + 1e-6
                      or shared[1] + works[whole[0]] > limit * mean_work + 1e-6):
            cut.add(whole[0])
            continue
        owner, tokens, loads = _place(lengths, works, parts, order, cut, shared, mean_tokens,
                                      mean_work)
        balanced = (max(tokens) <= limit * mean_tokens + 1e-9
                    and max(loads) <= limit * mean_work + 1e-9)
        if balanced or not whole:
            return Assignment(lengths, parts, tuple(owner), tuple(tokens), tuple(loads))
        cut.add(whole[0])


def plan(lengths, parts: int, *, tolerance: float = 0.05, groups: bool = True,
         token_pairs: float = TOKEN_PAIRS) -> Assignment:
    """``assign``'s plan, or (with ``groups``) the one of the fewest ranks per group
    (``_grouped``) where that cuts nothing across groups and keeps every rank within
    ``tolerance`` (pure, cached)."""
    return _plan(tuple(int(n) for n in lengths), parts, tolerance, groups, token_pairs)


@functools.lru_cache(maxsize=8)
def _plan(lengths: tuple[int, ...], parts: int, tolerance: float, groups: bool,
          token_pairs: float) -> Assignment:
    flat = _assign(lengths, parts, tolerance, token_pairs)
    if not (flat.cut and groups):
        return flat
    for size in range(2, parts):
        if parts % size == 0:
            grouped = _grouped(lengths, parts, size, tolerance, token_pairs)
            if grouped is not None:
                return grouped
    return flat


def _grouped(lengths, parts, size, tolerance, token_pairs) -> Assignment | None:
    """Documents whole to groups of ``size`` ranks, then each group's assigned over its ranks;
    None when a document must be cut across groups or a rank exceeds the tolerance."""
    top = _assign(lengths, parts // size, tolerance, token_pairs)
    if top.cut:
        return None
    owner, group = [CUT] * len(lengths), [0] * len(lengths)
    tokens, loads = [], []
    for g in range(parts // size):
        docs = top.whole(g)
        inner = _assign(tuple(lengths[i] for i in docs), size, tolerance, token_pairs)
        for i, o in zip(docs, inner.owner):
            owner[i], group[i] = (CUT if o == CUT else g * size + o), g
        tokens += inner.tokens
        loads += inner.work
    limit = 1.0 + tolerance
    if (max(tokens) > limit * sum(tokens) / parts + 1e-9
            or max(loads) > limit * sum(loads) / parts + 1e-9):
        return None
    return Assignment(lengths, parts, tuple(owner), tuple(tokens), tuple(loads), size,
                      tuple(group))


def _place(lengths, works, parts, order, cut, shared, mean_tokens, mean_work):
    """(owner, tokens, work) after placing every whole document largest first."""
    tokens, loads = [shared[0]] * parts, [shared[1]] * parts
    owner = [CUT] * len(lengths)
    for i in order:
        if i in cut:
            continue
        n, w = lengths[i], works[i]
        # the rank of least (max(tokens, work ratio after), tokens, rank): a loop, as this
        # runs for every document of every new packing
        rank, least, fewest = 0, math.inf, math.inf
        for r in range(parts):
            t = tokens[r]
            a = (t + n) / mean_tokens if mean_tokens > 0 else 0.0
            b = (loads[r] + w) / mean_work if mean_work > 0 else 0.0
            after = a if a > b else b
            if after < least or (after == least and t < fewest):
                rank, least, fewest = r, after, t
        owner[i] = rank
        tokens[rank] += n
        loads[rank] += w
    return owner, tokens, loads


def _ratio(value: float, mean: float) -> float:
    return value / mean if mean > 0 else 0.0
