"""Token partitioners: which rank holds which tokens of a sequence, as permutations.

A partitioner maps a sequence of S tokens over P ranks. ``indices(S, P, r)`` lists the global
positions rank r holds, in the order it holds them (always increasing here, so a causal mask
over a rank's own tokens is the ordinary top-left mask). ``permutation(S, P)`` concatenates
all ranks' indices in rank order; ``inverse`` (its argsort) restores the original order.

S = 16, P = 4 (digits are the rank holding each token):

    contiguous     0000 1111 2222 3333        rank r: [r*S/P, (r+1)*S/P)
    load_balanced  0011 2233 3322 1100        rank r: chunks r and 2P-1-r of 2P chunks
    striped        0123 0123 0123 0123        rank r: tokens r, r+P, r+2P, ...

With a causal mask, contiguous ranks do unequal work (rank P-1 attends to everything, rank 0
to its own chunk); load-balanced pairs an early chunk with a late one so every rank does the
same work at every ring step.
"""

from __future__ import annotations

import abc

import torch


class Partition(abc.ABC):
    """A rule placing S tokens on P ranks; subclasses define ``_indices``."""

    name: str = ""

    def multiple(self, parts: int) -> int:
        """Sequence lengths must be divisible by this."""
        return parts

    def check(self, seq_len: int, parts: int) -> None:
        m = self.multiple(parts)
        if seq_len % m:
            raise ValueError(
                f"sequence length {seq_len} must be divisible by {m} for {self.name} sharding "
                f"over {parts} ranks; pad the sequence to a multiple of {m}"
            )

    def indices(self, seq_len: int, parts: int, rank: int) -> torch.Tensor:
        """Global token positions held by ``rank``, in local order."""
        self.check(seq_len, parts)
        return self._indices(seq_len, parts, rank)

    @abc.abstractmethod
    def _indices(self, seq_len: int, parts: int, rank: int) -> torch.Tensor:
        ...

    def permutation(self, seq_len: int, parts: int) -> torch.Tensor:
        """All ranks' indices, concatenated in rank order."""
        return torch.cat([self.indices(seq_len, parts, r) for r in range(parts)])

    def inverse(self, seq_len: int, parts: int) -> torch.Tensor:
        """Positions in ``permutation`` of tokens 0..S-1 (restores the original order)."""
        return torch.argsort(self.permutation(seq_len, parts))

    def __repr__(self) -> str:
        return self.name


class Contiguous(Partition):
    name = "contiguous"

    def _indices(self, seq_len, parts, rank):
        n = seq_len // parts
        return torch.arange(rank * n, (rank + 1) * n)


class LoadBalanced(Partition):
    name = "load_balanced"

    def multiple(self, parts):
        return 2 * parts

    def _indices(self, seq_len, parts, rank):
        c = seq_len // (2 * parts)
        late = 2 * parts - 1 - rank
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


class Striped(Partition):
    name = "striped"

    def _indices(self, seq_len, parts, rank):
        return torch.arange(rank, seq_len, parts)


class IndexMap(Partition):
    """A user's placement: ``index_map[r]`` lists the global tokens of rank r (e.g. intact
    2-D/3-D tiles of video tokens). Every rank holds the same number of tokens, each token
    exactly once."""

    name = "index_map"

    def __init__(self, index_map):
        rows = [torch.as_tensor(r).flatten() for r in index_map]
        if any(r.is_floating_point() or r.is_complex() or r.dtype == torch.bool for r in rows):
            raise ValueError("index_map must hold integer token positions, not "
                             f"{sorted({str(r.dtype) for r in rows})}")
        rows = [r.long() for r in rows]
        if not rows or len({len(r) for r in rows}) != 1:
            raise ValueError("index_map must give every rank the same number of tokens")
        self.rows = rows
        flat = torch.cat(rows)
        if not torch.equal(torch.sort(flat).values, torch.arange(flat.numel())):
            raise ValueError(
                f"index_map must hold each of the {flat.numel()} token positions exactly once"
            )

    def check(self, seq_len, parts):
        total = sum(len(r) for r in self.rows)
        if parts != len(self.rows) or seq_len != total:
            raise ValueError(
                f"index_map places {total} tokens on {len(self.rows)} ranks, but the sequence has "
                f"{seq_len} tokens over {parts} ranks; give one row per rank covering every token"
            )

    def _indices(self, seq_len, parts, rank):
        return self.rows[rank]

    @property
    def increasing(self) -> bool:
        return all(bool((r[1:] > r[:-1]).all()) for r in self.rows)


_NAMED = {cls.name: cls for cls in (Contiguous, LoadBalanced, Striped)}


def get(partition: "str | Partition | list") -> Partition:
    """A partitioner from its name, an instance, or a user's index map (one row per rank)."""
    if isinstance(partition, Partition):
        return partition
    if isinstance(partition, str):
        if partition not in _NAMED:
            raise ValueError(
                f"partition={partition!r} is not known; use one of {sorted(_NAMED)} or an index map"
            )
        return _NAMED[partition]()
    return IndexMap(partition)
