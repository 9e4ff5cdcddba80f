"""Packed sequences (THD) split over the ranks of a sequence schedule.

The caller holds the global packing (``cu_seqlens``, and ``cu_seqlens_padded`` when sequences
sit in larger slots), the same on every rank. The partition splits every sequence on its own,
its slot rounded up to the partition's multiple; each rank stores its part of every sequence
in sequence order, real tokens first, padding last:

    load_balanced, P = 2, sequences a (5 tokens) and b (8); chunks of 2, '.' is padding
    sequence a, padded to 8     [a0 a1] [a2 a3] [a4 . ] [.  . ]
    rank 0 (chunks 0 and 3)     a0 a1 .  .  | b0 b1 b6 b7     cu_seqlens        [0, 2, 6]
    rank 1 (chunks 1 and 2)     a2 a3 a4 .  | b2 b3 b4 b5     cu_seqlens        [0, 3, 7]
                                                              cu_seqlens_padded [0, 4, 8]

Every rank stores the same number of tokens, so ring blocks keep one size. Padding tokens are
zeros, never reach a kernel and get zero gradient; ``unshard`` drops them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from sdpa_fusion.layout import check_offsets, check_padding, cu_seqlens_values

from .partition import Concatenated, Partition


def global_packing(cu_seqlens, cu_seqlens_padded=None, *, device=None
                   ) -> tuple[tuple, tuple | None]:
    """The checked global packing as tuples: (cu_seqlens, cu_seqlens_padded or None)."""
    padded = None
    if cu_seqlens_padded is not None:
        padded = cu_seqlens_values("cu_seqlens_padded", cu_seqlens_padded, device)
    cu = cu_seqlens_values("cu_seqlens", cu_seqlens, device)
    ends = cu if padded is None else padded
    tokens = ends[-1] if ends else 0
    if padded is not None:
        check_offsets("cu_seqlens_padded", padded, tokens)
    check_offsets("cu_seqlens", cu, tokens, exact=padded is None)
    if padded is not None:
        check_padding(cu, padded)
    return tuple(cu), None if padded is None else tuple(padded)


def hold(split, key: tuple, **fields) -> None:
    """Keep the computed ``fields`` on the frozen ``split``, with its ``key`` and no parts yet."""
    for name, value in dict(fields, key=key, key_hash=hash(key), _parts={}).items():
        object.__setattr__(split, name, value)


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """Every rank's part of every sequence of one global packing (host tensors)."""

    partition: Partition
    parts: int
    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...] | None
    device: torch.device
    gather: object = dataclasses.field(default=None, repr=False)  # all ranks' parts, dim 0

    def __post_init__(self):
        cu = torch.tensor(self.cu_seqlens)
        room = torch.tensor(self.cu_seqlens_padded or self.cu_seqlens)
        lengths = cu.diff()
        split_lengths = self.partition.padded_length(room.diff(), self.parts)
        storage = split_lengths // self.parts
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(storage, 0)])
        seq = torch.repeat_interleave(torch.arange(len(lengths)), storage)
        slot = torch.arange(len(seq)) - offsets[seq]
        ranks = torch.arange(self.parts).unsqueeze(1)
        positions = self.partition.position(slot[None], split_lengths[seq][None], self.parts, ranks)
        real = positions < lengths[seq]
        counts = torch.zeros(self.parts, len(lengths), dtype=torch.long)
        counts.index_add_(1, seq, real.long())
        if not torch.equal(real, slot < counts[:, seq]):
            raise ValueError(f"partition {self.partition.name!r} places padding tokens between "
                             f"the real tokens of a rank's part; give it sequences without padding "
                             f"(no cu_seqlens_padded, lengths it divides) or use partition "
                             f"'load_balanced'")
        self._hold(lengths=lengths, starts=room[:-1], storage=storage, offsets=offsets, seq=seq,
                   slot=slot, positions=positions, real=real, counts=counts)

    def _hold(self, **fields) -> None:
        hold(self, (self.partition, self.parts, self.cu_seqlens, self.cu_seqlens_padded,
                    self.device), **fields)

    @functools.cached_property
    def tokens(self) -> int:
        """Tokens every rank stores (padding included)."""
        return int(self.offsets[-1])

    @property
    def total_tokens(self) -> int:
        """Tokens of the global packed tensor."""
        return (self.cu_seqlens_padded or self.cu_seqlens)[-1]

    @functools.cached_property
    def longest_share(self) -> int:
        """The most real tokens one rank holds of one sequence (0 when there are none)."""
        return int(self.counts.max()) if self.counts.numel() else 0

    def part_packing(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(cu_seqlens, cu_seqlens_padded) of ``rank``'s part, as tuples (no device sync)."""
        real = torch.cumsum(self.counts[rank], 0)
        return (0, *real.tolist()), tuple(self.offsets.tolist())

    def sequence(self, rank: int) -> torch.Tensor:
        """The sequence of each of ``rank``'s tokens (padding: the sequence it pads), host."""
        return self.seq

    def rows(self, rank: int) -> torch.Tensor:
        """Row of each of ``rank``'s tokens in the packed tensor split here (-1: padding), host."""
        return torch.where(self.real[rank], self.starts[self.sequence(rank)] +
                           self.positions[rank], -1)

    def part(self, rank: int) -> "LocalPacking":
        """Rank ``rank``'s view (made once)."""
        if rank not in self._parts:
            self._parts[rank] = LocalPacking(self, rank)
        return self._parts[rank]

    @functools.cached_property
    def _unshard_index(self):
        """(rows of the real tokens in all ranks' parts concatenated, their global tokens)."""
        flat = self.real.flatten().nonzero().flatten()
        starts = torch.stack([self.starts[self.sequence(r)] for r in range(self.parts)])
        tokens = (starts + self.positions).flatten()[flat]
        return flat.to(self.device), tokens.to(self.device)


@dataclasses.dataclass(frozen=True, eq=False)
class ConcatenatedSplit(Split):
    """The sequences of one packing, one after another, split into ``parts`` contiguous runs
    of equal length (the last padded): rank r holds tokens [r * n, (r + 1) * n) of the
    concatenation, whatever sequences they belong to. A schedule that attends the whole
    packing in one call after an exchange (``ulysses``) then finds every rank's tokens in
    the order it attends them. Sequences, not only their parts, may span ranks:

        sequences a (5 tokens) and b (3), P = 2     rank 0   a0 a1 a2 a3    cu_seqlens [0, 4, 4]
                                                    rank 1   a4 b0 b1 b2    cu_seqlens [0, 1, 4]
    """

    def __post_init__(self):
        cu = torch.tensor(self.cu_seqlens)
        if self.cu_seqlens_padded is not None:
            raise ValueError("a concatenated split takes sequences without padding "
                             "(cu_seqlens_padded=None)")
        lengths, total, p = cu.diff(), int(cu[-1]), self.parts
        n = -(-total // p)
        token = torch.arange(p).unsqueeze(1) * n + torch.arange(n)
        real = token < total
        # padding rows: the sequence of the last token (the last sequence that has one)
        seqs = torch.searchsorted(cu[1:], token.clamp(max=max(total - 1, 0)), right=True)
        positions = torch.where(real, token - cu[seqs], 0)
        counts = torch.zeros(p, len(lengths), dtype=torch.long)
        counts.scatter_add_(1, seqs, real.long())
        self._hold(lengths=lengths, starts=cu[:-1], storage=None, offsets=None, seq=None,
                   seqs=seqs, slot=None, positions=positions, real=real, counts=counts, tokens=n)

    def part_packing(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        real = (0, *torch.cumsum(self.counts[rank], 0).tolist())
        return real, (*real[:-1], self.tokens)

    def sequence(self, rank: int) -> torch.Tensor:
        return self.seqs[rank]


def split_by_partition(partition: Partition, parts: int, cu: tuple, padded: tuple | None,
                       device, gather=None) -> Split:
    """Every rank's part of the packing ``cu``/``padded`` under ``partition``."""
    kind = ConcatenatedSplit if isinstance(partition, Concatenated) else Split
    return kind(partition, parts, cu, padded, device, gather=gather)


def _of_split(name: str, doc: str) -> property:
    """A read-only property that is the ``split``'s attribute ``name``."""
    return property(lambda self: getattr(self.split, name), doc=doc)


@dataclasses.dataclass(frozen=True, eq=False)
class LocalPacking:
    """One rank's part of a global packing, to pass as ``attention(..., cu_seqlens=local)``."""

    split: Split
    rank: int

    partition = _of_split("partition", "The ``Partition`` of the split.")
    parts = _of_split("parts", "The ranks the packing is split over.")
    device = _of_split("device", "The device of the packing's tensors.")
    tokens = _of_split("tokens", "T_local: tokens of the local part, padding included.")
    total_tokens = _of_split("total_tokens", "T: tokens of the global packed tensor.")
    counts = _of_split("counts", "Real tokens of each sequence on each rank, [P, N] (host).")
    longest_share = _of_split("longest_share", "The most real tokens a rank holds of a sequence.")

    def _on_device(self, t: torch.Tensor, dtype=torch.long) -> torch.Tensor:
        return t.to(device=self.device, dtype=dtype)

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """Cumulative real lengths of the local part, int32 [N+1]."""
        return self._on_device(torch.tensor(self.offsets[0]), torch.int32)

    @functools.cached_property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """Where each sequence's part starts in the local tensor, int32 [N+1]."""
        return self._on_device(torch.tensor(self.offsets[1]), torch.int32)

    @functools.cached_property
    def offsets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(cu_seqlens, cu_seqlens_padded) of the local part as host tuples (no device sync)."""
        return self.split.part_packing(self.rank)

    @functools.cached_property
    def seqlens(self) -> torch.Tensor:
        """Real tokens of each sequence on this rank, int32 [N]."""
        return self._on_device(self.counts[self.rank], torch.int32)

    @functools.cached_property
    def position_ids(self) -> torch.Tensor:
        """Position of every local token inside its sequence, int64 [T_local] (0 for padding)."""
        real = self.split.real[self.rank]
        return self._on_device(torch.where(real, self.split.positions[self.rank], 0))

    @functools.cached_property
    def token_index(self) -> torch.Tensor:
        """Row of each local token in the global packed tensor, int64 [T_local] (-1: padding)."""
        return self._on_device(self.split.rows(self.rank))

    @property
    def coordinates(self) -> torch.Tensor:
        """Grid coordinates [T_local, 3] of the local tokens (``VideoTiles``; padding: 0's)."""
        return _coordinates(self.partition, self.position_ids)

    @property
    def owner(self) -> tuple:
        """(partition, parts, rank) of every split that made this part, outermost first."""
        return ((self.partition, self.parts, self.rank),)

    @functools.cached_property
    def _real_rows(self):
        """(local rows of the real tokens, their global rows) on the device."""
        rows = (self.split.rows(self.rank) >= 0).nonzero().flatten()
        return self._on_device(rows), self.token_index[self._on_device(rows)]

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a global packed tensor (padding zeros); differentiable."""
        self._check_rows(t, self.total_tokens, "the global packed tensor")
        rows, tokens = self._real_rows
        local = t.new_zeros((self.tokens, *t.shape[1:]))
        return local.index_copy(0, rows, t.index_select(0, tokens))

    def unshard(self, t: torch.Tensor) -> torch.Tensor:
        """The global [T, ...] tensor on every rank from every rank's part; differentiable."""
        self._check_rows(t, self.tokens, "this rank's part")
        full = t if self.parts == 1 else self.split.gather(self._to_gather(t))
        flat, tokens = self.split._unshard_index
        whole = t.new_zeros((self.split.total_tokens, *t.shape[1:]))
        return whole.index_copy(0, tokens, full.index_select(0, flat))

    def _to_gather(self, t: torch.Tensor) -> torch.Tensor:
        """What this rank gathers of its part ``t`` (one size on every rank)."""
        return t

    def _check_rows(self, t: torch.Tensor, want: int, what: str) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != want:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"t ({shape}) must have {want} tokens along dim 0, the size of "
                             f"{what} ({split_by(self.owner)})")
        if t.device != self.device and not t.is_meta:  # meta: data-less, any indices do
            raise ValueError(f"t is on {t.device} but cu_seqlens was on {self.device}; pack "
                             f"cu_seqlens on the tensors' device")

    def cached(self, key, build):
        """``build()``, made once per key for this packing (schedules keep their calls here)."""
        memo = self.__dict__.setdefault("_memo", {})
        if key not in memo:
            memo[key] = build()
        return memo[key]

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is type(self) and self.rank == other.rank
                                 and self.split.key == other.split.key)

    def __hash__(self) -> int:
        return hash((self.split.key_hash, self.rank))

    def __repr__(self) -> str:
        return (f"LocalPacking(rank {self.rank} of {self.parts}, partition {self.partition.name}, "
                f"{len(self.split.lengths)} sequences, {self.tokens} of {self.total_tokens} "
                f"tokens)")


@dataclasses.dataclass(frozen=True, eq=False)
class NestedPacking(LocalPacking):
    """One rank's part of a global packing split twice: ``outer`` is its part under the first
    split, which ``split``/``rank`` split again, each sequence's slot (padding included) the
    room it is split in:

        outer part (rank o)     a0 a1 .  .  | b0 b1 b6 b7        slots of 4 and 4
        split again over 2      rank 0: a0 a1 | b0 b1    rank 1: .  .  | b6 b7

    ``cu_seqlens``, ``tokens``, ``counts`` and ``cached`` are the second split's;
    ``position_ids``, ``token_index``, ``shard`` and ``unshard`` reach the global packing
    through ``outer``."""

    outer: LocalPacking

    @property
    def total_tokens(self) -> int:
        return self.outer.total_tokens

    @functools.cached_property
    def _outer_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(whether each local token is real, its row of the outer part, 0 for padding)."""
        rows = self._on_device(self.split.rows(self.rank))
        return rows >= 0, rows.clamp(min=0)

    @functools.cached_property
    def position_ids(self) -> torch.Tensor:
        real, rows = self._outer_rows
        return torch.where(real, self.outer.position_ids[rows], 0)

    @functools.cached_property
    def token_index(self) -> torch.Tensor:
        real, rows = self._outer_rows
        return torch.where(real, self.outer.token_index[rows], -1)

    @property
    def coordinates(self) -> torch.Tensor:
        return _coordinates(self.outer.partition, self.position_ids)

    @property
    def owner(self) -> tuple:
        return self.outer.owner + super().owner

    def unshard(self, t: torch.Tensor) -> torch.Tensor:
        return self.outer.unshard(super().unshard(t))

    def __eq__(self, other) -> bool:
        return super().__eq__(other) and self.outer == other.outer

    def __hash__(self) -> int:
        return hash((super().__hash__(), hash(self.outer)))

    def __repr__(self) -> str:
        return (f"NestedPacking(rank {self.rank} of {self.parts}, partition "
                f"{self.partition.name}, {self.tokens} tokens, of {self.outer!r})")


def split_by(owner: tuple) -> str:
    """``LocalPacking.owner`` in words."""
    return "; then ".join(f"rank {rank} of {parts}, partition {partition.name}"
                          for partition, parts, rank in owner)


def _coordinates(partition: Partition, positions: torch.Tensor) -> torch.Tensor:
    if not hasattr(partition, "coordinates"):
        raise ValueError(f"partition {partition.name!r} has no grid coordinates; use "
                         f"position_ids, or partition=VideoTiles(...) for video tokens")
    return partition.coordinates(positions)
