"""A packed batch split by whole documents (partition ``documents``): each rank's tokens.

``schedules.assign`` gives some documents whole to one rank and cuts the others over a group
of ranks (every rank, a half, a quarter, ...: ``assign.plan``); the documents cut over one
group form its "cut packing", split load-balanced over the group (``packing.Split``; for a
schedule that attends a cut packing whole after one exchange, ``ulysses``, into contiguous
runs of its documents one after another: ``partition.Concatenated``). Rank r
stores its whole documents first, in batch order, then its part of each cut packing of its
groups, most ranks first; only those parts travel:

    documents a (2 tokens), b (8), c (3), d (1), P = 2; b is cut, chunks of 2
    rank 0   c0 c1 c2 | b0 b1 b6 b7          cu_seqlens        [0, 3, 7]
    rank 1   a0 a1 d0 | b2 b3 b4 b5          cu_seqlens        [0, 2, 3, 7]
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .assign import RING, Assignment, Exchange, plan
from .packing import LocalPacking, Split, hold, split_by_partition
from .partition import LoadBalanced, Partition


@dataclasses.dataclass(frozen=True, eq=False)
class DocumentSplit:
    """Every rank's part of one global packing under partition ``documents`` (host tensors)."""

    partition: Partition
    parts: int
    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...] | None
    device: torch.device
    gather: object = dataclasses.field(default=None, repr=False)
    exchange: Exchange = RING  # what the schedule's exchanges of cut documents cost
    cut_partition: Partition = LoadBalanced()  # how each group's cut packing is split

    def __post_init__(self):
        cu = torch.tensor(self.cu_seqlens)
        lengths = cu.diff()
        starts = torch.tensor(self.cu_seqlens_padded or self.cu_seqlens)[:-1]
        assignment = plan(lengths.tolist(), self.parts, tolerance=self.partition.tolerance,
                          groups=self.partition.groups, exchange=self.exchange)
        cut_docs, cuts = {}, {}
        for group in assignment.groups:
            docs = torch.tensor(assignment.cut_over(group), dtype=torch.long)
            cut_docs[group] = docs
            cut_cu = (0, *torch.cumsum(lengths[docs], 0).tolist())
            cuts[group] = split_by_partition(self.cut_partition, group[1], cut_cu, None,
                                             self.device)
        key = (self.partition, self.parts, self.cu_seqlens, self.cu_seqlens_padded, self.device,
               self.exchange, self.cut_partition)
        hold(self, key, lengths=lengths, starts=starts, assignment=assignment, cuts=cuts,
             cut_docs=cut_docs)

    total_tokens = Split.total_tokens

    def cuts_of(self, rank: int) -> list[tuple[tuple[int, int], Split]]:
        """(group, split of its cut packing) of every group of ``rank`` that cuts a
        document, in the order of the rank's rows."""
        return [(g, self.cuts[g]) for g in self.assignment.groups_of(rank)]

    def cut_tokens(self, rank: int) -> int:
        """Tokens ``rank`` stores of its groups' cut packings (padding included)."""
        return sum(cut.tokens for _, cut in self.cuts_of(rank))

    def whole(self, rank: int) -> torch.Tensor:
        """The documents ``rank`` holds whole, in batch order (host)."""
        return torch.tensor(self.assignment.whole(rank), dtype=torch.long)

    def tokens_of(self, rank: int) -> int:
        """Tokens ``rank`` stores: its whole documents' and its parts of the cut packings."""
        return int(self.lengths[self.whole(rank)].sum()) + self.cut_tokens(rank)

    @functools.cached_property
    def most_tokens(self) -> int:
        """The most tokens a rank stores (what ``unshard`` pads every part to)."""
        return max(self.tokens_of(r) for r in range(self.parts))

    @functools.cached_property
    def longest_share(self) -> int:
        """The most real tokens one rank holds of one document."""
        whole = [int(self.lengths[i]) for i, o in enumerate(self.assignment.owner) if o >= 0]
        return max([*whole, *(cut.longest_share for cut in self.cuts.values())], default=0)

    def part_packing(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(cu_seqlens, cu_seqlens_padded) of ``rank``'s part: whole documents, then cut ones."""
        whole = torch.cumsum(self.lengths[self.whole(rank)], 0).tolist()
        cu, padded = [0, *whole], [0, *whole]
        for (first, _), cut in self.cuts_of(rank):
            cut_cu, cut_padded = cut.part_packing(rank - first)
            cu += [cu[-1] + n for n in cut_cu[1:]]
            padded += [padded[-1] + n for n in cut_padded[1:]]
        return tuple(cu), tuple(padded)

    def rows(self, rank: int) -> torch.Tensor:
        """Row of each of ``rank``'s tokens in the global packed tensor (-1: padding), host."""
        docs = self.whole(rank)
        n = self.lengths[docs]
        first = torch.repeat_interleave(self.starts[docs] - (torch.cumsum(n, 0) - n), n)
        parts = [first + torch.arange(int(n.sum()))]
        for group, cut in self.cuts_of(rank):
            i = rank - group[0]
            rows = self.starts[self.cut_docs[group]][cut.sequence(i)] + cut.positions[i]
            parts.append(torch.where(cut.real[i], rows, -1))
        return torch.cat(parts)

    def positions(self, rank: int) -> torch.Tensor:
        """Position of each of ``rank``'s tokens inside its document (0 for padding), host."""
        n = self.lengths[self.whole(rank)]
        parts = [torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)]
        for (first, _), cut in self.cuts_of(rank):
            i = rank - first
            parts.append(torch.where(cut.real[i], cut.positions[i], 0))
        return torch.cat(parts)

    def part(self, rank: int) -> "DocumentPacking":
        """Rank ``rank``'s view (made once)."""
        if rank not in self._parts:
            self._parts[rank] = DocumentPacking(self, rank)
        return self._parts[rank]

    @functools.cached_property
    def _unshard_index(self):
        """(rows of the real tokens in all ranks' parts padded to ``most_tokens``, global rows)."""
        rows = [self.rows(r) for r in range(self.parts)]
        flat = torch.cat([(r >= 0).nonzero().flatten() + j * self.most_tokens
                          for j, r in enumerate(rows)])
        tokens = torch.cat([r[r >= 0] for r in rows])
        return flat.to(self.device), tokens.to(self.device)


@dataclasses.dataclass(frozen=True, eq=False)
class DocumentPacking(LocalPacking):
    """One rank's part under partition ``documents``: its whole documents (``whole_tokens``
    rows), then its part of each of its groups' cut packings (``cuts``)."""

    @functools.cached_property
    def tokens(self) -> int:
        """T_local: this rank's tokens, padding of the cut part included."""
        return self.split.tokens_of(self.rank)

    @property
    def assignment(self) -> Assignment:
        return self.split.assignment

    @functools.cached_property
    def whole_lengths(self) -> tuple[int, ...]:
        """Lengths of the documents this rank holds whole, in batch order."""
        return tuple(self.split.lengths[list(self.whole_documents)].tolist())

    @functools.cached_property
    def whole_documents(self) -> tuple[int, ...]:
        """The indices in the batch of the documents this rank holds whole, in batch order."""
        return tuple(self.split.whole(self.rank).tolist())

    @property
    def whole_tokens(self) -> int:
        """Rows of the whole documents (the first rows of the local part)."""
        return sum(self.whole_lengths)

    @functools.cached_property
    def cuts(self) -> tuple[tuple[tuple[int, int], slice, LocalPacking], ...]:
        """(group, its rows here, this rank's part of its cut packing) of every group of
        this rank that cuts a document, in row order (after the whole documents)."""
        out, start = [], self.whole_tokens
        for group, cut in self.split.cuts_of(self.rank):
            out.append((group, slice(start, start + cut.tokens), cut.part(self.rank - group[0])))
            start += cut.tokens
        return tuple(out)

    @property
    def longest_share(self) -> int:
        return self.split.longest_share

    @functools.cached_property
    def offsets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.split.part_packing(self.rank)

    @functools.cached_property
    def whole_offsets(self) -> tuple[int, ...]:
        """cu_seqlens of the whole documents (the first ``whole_tokens`` rows)."""
        return self.offsets[0][:len(self.whole_lengths) + 1]

    @functools.cached_property
    def counts(self) -> torch.Tensor:
        """Real tokens of each local sequence (whole documents, then cut ones), [N_local]."""
        return torch.tensor(self.offsets[0]).diff()

    @functools.cached_property
    def seqlens(self) -> torch.Tensor:
        return self._on_device(self.counts, torch.int32)

    @functools.cached_property
    def position_ids(self) -> torch.Tensor:
        return self._on_device(self.split.positions(self.rank))

    @functools.cached_property
    def token_index(self) -> torch.Tensor:
        return self._on_device(self.split.rows(self.rank))

    def _to_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` padded to the longest part (``unshard`` gathers parts of one size)."""
        pad = t.new_zeros((self.split.most_tokens - t.shape[0], *t.shape[1:]))
        return torch.cat([t, pad])

    def __repr__(self) -> str:
        cuts = ", ".join(f"{len(self.assignment.cut_over(g))} cut over ranks {g[0]}-"
                         f"{g[0] + g[1] - 1}" for g, _, _ in self.cuts) or "none cut"
        return (f"DocumentPacking(rank {self.rank} of {self.parts}, "
                f"{len(self.whole_lengths)} whole documents, {cuts}, {self.tokens} of "
                f"{self.total_tokens} tokens)")
