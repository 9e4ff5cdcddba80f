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

``plan`` cuts each document over as few ranks as it can, level by level: the ranks are
halves (or thirds, ... by the smallest factor of their number), and ``assign`` over the
halves says which documents fit one half whole; the others are cut over every rank of the
level, and each half is planned the same way with its documents, the cut documents' shares
counted as already there. A document is thus cut over every rank, a half, a quarter, ...,
its K/V travelling inside those ranks only; the plan is kept where every rank stays within
the tolerance of the batch's mean (else ``assign``'s, every cut document over every rank),
and under an exchange that takes no ring steps (``ulysses``) where its slowest rank costs
less than under ``assign``'s, exchanges counted (below):

    P = 4, one document with 61% of the work, one with 38%, many short ones (batch d)
    assign over 4 ranks:   the first cut over ranks 0-3; the second whole on rank 0, which
                           then holds 4.3% more work than the mean (the others' tokens are
                           at the bound)
    plan:                  the first cut over ranks 0-3, the second over ranks 0-1 (it does
                           not fit rank 0 beside its share of the first): every rank within
                           0.6% of the mean

A rank's exchanges of its cut documents cost it beyond its share of the work, by the
schedule's ``Exchange``: the ring's a step per rank of each group it is in and a little per
token of the documents those groups cut (``RING``); ``ulysses``' per token the rank holds of
them (``ULYSSES``: its all-to-alls carry the rank's share of each cut document, whatever the
group's size). Where they differ between ranks (groups of a plan), ``plan`` places the whole
documents again, the cuts kept: largest first, each on the rank of least work and exchanges
that it keeps within the tolerance of the mean tokens; the placement is kept where it lowers
the slowest rank's work and exchanges within the same bounds:

    batch (c), P = 8: ranks 0-3 share one document over 0-3 and one over their pair, 6 ring
    steps; ranks 4-7 one or two over their pair, 2 steps. Placed by work alone, every rank
    held 130-133 M pairs of work and ranks 0-3 152 M with their rings; placed again, ranks
    0-3 hold 127 M (148 M with their rings: -2.9%) and ranks 4-7 134-137 M. Under
    ``ulysses`` ranks 0-3 hold 10.4 K tokens of cut documents, ranks 6-7 12.6 K: the
    placement for the ring (ranks 6-7 of least exchanges) made those two the slowest.

    batch (a), P = 8, under ``ulysses``: cut over halves and pairs, ranks 0, 1, 4 and 5
    hold 32.8 K tokens of cut documents and the most work, the others 24.6 K; every cut
    document over every rank evens both (-1.9% on the slowest rank): ``assign``'s plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math

CUT = -1  # the owner of a cut document (split over the ranks of its group)
Group = tuple  # (first rank, ranks): the consecutive ranks a cut document is split over


# What a rank's exchanges cost beyond its share of the work, in pairs. The ring's: a
# least-squares fit over the ranks' steps replayed as CUDA graphs (docs/benchmarks.md, the
# costs table: 0.235 ms a ring step and 0.0193 ms per K tokens its rings cut, beside 0.0925
# ms per M pairs). ``ulysses``': the same over its ranks (the ulysses_costs table, one H100:
# per K tokens held of cut documents 0.206 ms beside 0.087 ms per M pairs, 0.155 ms beside
# 0.086 with keep_forward; its groups' number and sizes add nothing measurable).
STEP_PAIRS = 2_500_000  # per ring step: a block moved, merged and summed, the launches
CUT_TOKEN_PAIRS = 200  # per token of the documents the rank's rings cut


@dataclasses.dataclass(frozen=True)
class Exchange:
    """What a schedule's exchanges of cut documents cost a rank beyond its share of the
    work, in pairs: per ring step (each rank of each group it is in), per token of the
    documents its groups cut, per token it holds of them."""

    name: str
    per_step: float = 0.0
    per_cut_token: float = 0.0
    per_held_token: float = 0.0

    def cost(self, steps: int, cut_tokens: float, held_tokens: float) -> float:
        """Pairs that ``steps`` ring steps over documents of ``cut_tokens`` tokens, of which
        the rank holds ``held_tokens``, cost it."""
        return (self.per_step * steps + self.per_cut_token * cut_tokens
                + self.per_held_token * held_tokens)


RING = Exchange("ring", per_step=STEP_PAIRS, per_cut_token=CUT_TOKEN_PAIRS)
ULYSSES = Exchange("ulysses", per_held_token=2_400)  # per token the rank holds of cut documents
ULYSSES_KEPT = Exchange("ulysses:keep_forward", per_held_token=1_800)  # its backward sends less


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The owner rank of every document (``CUT``: split over the ranks ``over`` names) and
    each rank's ``tokens`` and ``work`` (cut documents as their even shares over their
    ranks). ``over`` defaults to every rank for each cut document; ``exchange`` prices each
    rank's exchanges of them (``exchanges``), ``RING`` by default."""

    lengths: tuple[int, ...]
    parts: int
    owner: tuple[int, ...]
    tokens: tuple[float, ...]
    work: tuple[float, ...]
    over: tuple[Group, ...] = ()  # per document: (first, ranks) it is cut over; (r, 1) whole
    exchange: Exchange = RING  # what exchanging the cut documents costs a rank

    def __post_init__(self):
        if not self.over:
            object.__setattr__(self, "over", tuple((0, self.parts) if o == CUT else (o, 1)
                                                   for o in self.owner))

    @functools.cached_property
    def cut(self) -> tuple[int, ...]:
        """Indices of the cut documents, in batch order."""
        return tuple(i for i, o in enumerate(self.owner) if o == CUT)

    def cut_over(self, group: Group) -> tuple[int, ...]:
        """Indices of the documents cut over the ranks ``group``, in batch order."""
        return tuple(i for i in self.cut if self.over[i] == tuple(group))

    @functools.cached_property
    def groups(self) -> tuple[Group, ...]:
        """The groups of ranks some document is cut over, most ranks first, then by rank."""
        return tuple(sorted({self.over[i] for i in self.cut}, key=lambda g: (-g[1], g[0])))

    def groups_of(self, rank: int) -> tuple[Group, ...]:
        """The groups ``rank`` is in that cut some document, most ranks first (its rows'
        order: whole documents, then each group's cut packing)."""
        return tuple(g for g in self.groups if g[0] <= rank < g[0] + g[1])

    def whole(self, rank: int) -> tuple[int, ...]:
        """Indices of the documents ``rank`` holds whole, in batch order."""
        return tuple(i for i, o in enumerate(self.owner) if o == rank)

    def cost_terms(self, rank: int) -> tuple[float, float, int, int, float]:
        """(causal query-key pairs, tokens, ring steps, tokens cut, tokens held cut) of
        ``rank``: its whole documents and its shares of the cut ones, the ranks of each group
        it is in (a ring over n ranks takes n steps), the tokens of the documents those
        groups cut, and its shares of them (1/n of each)."""
        pairs = sum(self.lengths[i] ** 2 / 2 for i in self.whole(rank))
        groups = self.groups_of(rank)
        cut = [(i, size) for first, size in groups for i in self.cut_over((first, size))]
        pairs += sum(self.lengths[i] ** 2 / 2 / size for i, size in cut)
        return (pairs, self.tokens[rank], sum(size for _, size in groups),
                sum(self.lengths[i] for i, _ in cut),
                sum(self.lengths[i] / size for i, size in cut))

    @functools.cached_property
    def exchanges(self) -> tuple[float, ...]:
        """What each rank's exchanges of its cut documents cost it beyond its share of the
        work, in pairs (by ``exchange``)."""
        return tuple(self.exchange.cost(*self.cost_terms(r)[2:]) for r in range(self.parts))

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
    _check(lengths, parts)
    works = tuple(work(n, token_pairs) for n in lengths)
    owner, tokens, loads = _owners(lengths, works, parts, tolerance)
    return Assignment(lengths, parts, tuple(owner), tuple(tokens), tuple(loads))


def _check(lengths: tuple[int, ...], parts: int) -> None:
    if parts < 1 or any(n < 0 for n in lengths):
        raise ValueError(f"assign takes lengths >= 0 and parts >= 1, got {lengths}, {parts}")


def _past_share(lengths, works, parts: int, base=(0.0, 0.0)) -> set:
    """The documents with more tokens or work than a rank's share (over ``parts`` ranks that
    each hold ``base`` already): ``_owners`` cuts them whatever it places."""
    mean_tokens = base[0] + sum(lengths) / parts
    mean_work = base[1] + sum(works) / parts
    return {i for i, (n, w) in enumerate(zip(lengths, works))
            if parts > 1 and (n > mean_tokens or w > mean_work)}


def _owners(lengths, works, parts, tolerance, base=(0.0, 0.0)):
    """(owner, tokens, work) of ``assign``'s rule over ``parts`` bins that each hold ``base``
    (tokens, work) already (the shares of documents cut at an outer level of ``plan``)."""
    mean_tokens = base[0] + sum(lengths) / parts
    mean_work = base[1] + sum(works) / parts
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cut = _past_share(lengths, works, parts, base)
    limit = 1.0 + tolerance
    while True:
        whole = [i for i in order if i not in cut]
        shared = (base[0] + sum(lengths[i] for i in cut) / parts,
                  base[1] + sum(works[i] for i in cut) / parts)
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
            return owner, tokens, loads
        cut.add(whole[0])


def plan(lengths, parts: int, *, tolerance: float = 0.05, groups: bool = True,
         token_pairs: float = TOKEN_PAIRS, exchange: Exchange = RING,
         exchanges: bool = True) -> Assignment:
    """``assign``'s plan when it cuts nothing or ``groups`` is False; else each document cut
    over as few ranks as the levels allow (``_nested``), where that keeps every rank within
    ``tolerance`` of the mean, and its whole documents placed again counting what each
    rank's exchanges cost by ``exchange`` where that lowers the slowest rank; under an
    exchange of no ring steps, ``assign``'s plan where its slowest rank costs less
    (``exchanges=False``: by work alone; pure, cached)."""
    return _plan(tuple(int(n) for n in lengths), parts, tolerance, groups, token_pairs,
                 exchange, exchanges)


@functools.lru_cache(maxsize=8)
def _plan(lengths: tuple[int, ...], parts: int, tolerance: float, groups: bool,
          token_pairs: float, exchange: Exchange, exchanges: bool) -> Assignment:
    _check(lengths, parts)

    def flat():
        return dataclasses.replace(_assign(lengths, parts, tolerance, token_pairs),
                                   exchange=exchange)

    # assign's plan is made only where it is the answer: a document too large for a rank
    # says that it cuts one without placing the others (almost half of batch c's planning)
    if not groups or _factor(parts) == parts or not (
            _past_share(lengths, [work(n, token_pairs) for n in lengths], parts)
            or _assign(lengths, parts, tolerance, token_pairs).cut):
        return flat()
    nested = _nested(lengths, parts, tolerance, token_pairs, exchange)
    if not _within(nested, tolerance):
        return flat()
    if not exchanges:
        return nested
    nested = _placed_with_exchanges(nested, tolerance, token_pairs)
    if exchange.per_step:
        return nested
    # an exchange that takes no ring steps (ulysses) saves nothing by cutting over fewer
    # ranks but what the balance gives: every cut over every rank where that costs less
    every = flat()
    return every if _slowest(every) < _slowest(nested) else nested


def _slowest(a: Assignment) -> float:
    """The most work and exchanges of a rank of ``a``, in pairs."""
    return max(w + x for w, x in zip(a.work, a.exchanges))


def _within(a: Assignment, tolerance: float) -> bool:
    """Whether every rank's tokens and work are within ``tolerance`` of the mean."""
    limit = (1.0 + tolerance) / a.parts
    return (max(a.tokens) <= limit * sum(a.tokens) + 1e-9
            and max(a.work) <= limit * sum(a.work) + 1e-9)


def _placed_with_exchanges(a: Assignment, tolerance: float, token_pairs: float) -> Assignment:
    """``a`` with its whole documents placed again, the cuts kept: largest first, each on the
    rank of least work and exchanges (``exchanges``) among those it keeps within
    ``tolerance`` of the mean tokens; ``a`` where that is not within ``tolerance`` or does
    not lower the slowest rank's work and exchanges."""
    if min(a.exchanges) == max(a.exchanges):
        return a
    lengths, parts = a.lengths, a.parts
    works = tuple(work(n, token_pairs) for n in lengths)
    placed = [i for i, o in enumerate(a.owner) if o != CUT and lengths[i]]
    tokens, loads = list(a.tokens), [w + r for w, r in zip(a.work, a.exchanges)]
    for i in placed:
        tokens[a.owner[i]] -= lengths[i]
        loads[a.owner[i]] -= works[i]
    bound = (1.0 + tolerance) * sum(lengths) / parts + 1e-9
    owner = list(a.owner)
    for i in sorted(placed, key=lambda i: (-lengths[i], i)):
        n, rank, least = lengths[i], -1, math.inf  # a loop: this runs for every document
        for r in range(parts):
            if tokens[r] + n <= bound and loads[r] < least:
                rank, least = r, loads[r]
        if rank < 0:  # fits no rank: the fewest tokens (the bounds below then refuse it)
            rank = min(range(parts), key=lambda r: (tokens[r], r))
        owner[i] = rank
        tokens[rank] += lengths[i]
        loads[rank] += works[i]
    again = Assignment(lengths, parts, tuple(owner), tuple(tokens),
                       tuple(x - r for x, r in zip(loads, a.exchanges)),
                       tuple(a.over[i] if o == CUT else (o, 1) for i, o in enumerate(owner)),
                       a.exchange)
    if not _within(again, tolerance) or max(loads) >= _slowest(a) - 1e-9:
        return a
    return again


def _nested(lengths, parts, tolerance, token_pairs, exchange) -> Assignment:
    """Level by level: ``_owners`` over the f groups of a level (f the smallest factor of
    its ranks) cuts what fits none whole over the level's ranks; each group is planned the
    same way with the documents it holds, the level's cut shares its base."""
    works = tuple(work(n, token_pairs) for n in lengths)
    owner, over = [0] * len(lengths), [(0, 1)] * len(lengths)  # empty documents: rank 0
    levels = [(tuple(i for i, n in enumerate(lengths) if n), 0, parts, (0.0, 0.0))]
    while levels:
        docs, first, size, base = levels.pop()
        if size == 1:
            for i in docs:
                owner[i], over[i] = first, (first, 1)
            continue
        f = _factor(size)
        sub = size // f
        bins, _, _ = _owners([lengths[i] for i in docs], [works[i] for i in docs], f,
                             tolerance, (base[0] * sub, base[1] * sub))
        cut = [i for i, b in zip(docs, bins) if b == CUT]
        for i in cut:
            owner[i], over[i] = CUT, (first, size)
        base = (base[0] + sum(lengths[i] for i in cut) / size,
                base[1] + sum(works[i] for i in cut) / size)
        for b in range(f):
            levels.append((tuple(i for i, o in zip(docs, bins) if o == b), first + b * sub,
                           sub, base))
    tokens, loads = [0.0] * parts, [0.0] * parts
    for i, (first, size) in enumerate(over):
        for r in range(first, first + size):
            tokens[r] += lengths[i] / size
            loads[r] += works[i] / size
    return Assignment(lengths, parts, tuple(owner), tuple(tokens), tuple(loads), tuple(over),
                      exchange)


def _factor(n: int) -> int:
    """The smallest factor of ``n`` above 1 (``n`` itself when prime; 1 for 1)."""
    return next((f for f in range(2, math.isqrt(n) + 1) if n % f == 0), n)


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
