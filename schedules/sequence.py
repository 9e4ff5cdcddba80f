"""Base of the context-parallel schedules: q, k, v split along the sequence by a partitioner.

Rank r of the mesh dim holds the tokens ``partition.indices(S, P, r)`` of q, k, v, out and
the gradients; ``unshard`` gathers them in the original order on every rank. Packed sequences
(``layout="thd"``) are split each on its own (``schedules.packing``): ``attention`` takes the
global ``cu_seqlens`` or this rank's ``pack(cu_seqlens)``.
"""

from __future__ import annotations

import collections

import torch

from sdpa_fusion.layout import Layout, shard_layout, unshard_layout

from . import heads, runner
from . import partition as partitions
from .base import Schedule
from .packing import LocalPacking, Split, global_packing, split_by, split_by_partition

_KEPT_PACKINGS = 4  # global packings whose splits (and kernel calls) a schedule keeps


class SequenceSchedule(Schedule):
    """A schedule splitting the sequence dim over one mesh dim (default: the last)."""

    sharded_dim = 2
    supports_thd = True
    # Attends each rank's tokens in the partition's order: causal needs increasing tokens.
    needs_ordered_tokens = True
    # Partition 'documents': how the documents cut over a group of ranks are split over it.
    cut_partition = partitions.LoadBalanced()

    def __init__(self, mesh, *, dim: str | None = None, partition="load_balanced",
                 head_groups="auto"):
        super().__init__(mesh, dim=dim)
        self.partition = partitions.get(partition)
        self.head_groups = heads.check_option(head_groups)
        self._positions: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
        self._splits: collections.OrderedDict[tuple, Split] = collections.OrderedDict()

    def global_spec(self, spec):
        if spec.packing is not None:
            split = spec.packing.split
            return spec.replace(q_len=split.total_tokens, kv_len=split.total_tokens,
                                cu_seqlens=split.cu_seqlens,
                                cu_seqlens_padded=split.cu_seqlens_padded, packing=None)
        return spec.replace(q_len=spec.q_len * self.size, kv_len=spec.kv_len * self.size)

    def validate(self, spec):
        super().validate(spec)
        if not spec.layout.is_varlen:
            full = self.global_spec(spec)
            for length in {full.q_len, full.kv_len}:
                self.partition.check(length, self.size)
        if spec.causal and spec.q_len != spec.kv_len:
            raise ValueError(f"causal context parallelism needs q and k/v of one length per rank, "
                             f"got q_len={spec.q_len} and kv_len={spec.kv_len}; shard q, k, v of "
                             f"one sequence alike")
        if self.head_groups != "auto":
            heads.check_divides(self.head_groups, spec.kv_heads, self.name)
            self.check_groups(self.head_groups, spec)
        if spec.causal and self.needs_ordered_tokens and not self.partition.increasing:
            raise ValueError(f"causal attention needs each rank's tokens in increasing order; the "
                             f"{self.partition.name} partition reorders them. Use "
                             f"partition='load_balanced', or schedule 'ulysses' (which attends the "
                             f"whole sequence in order)")

    # ---- the plan (schedules.runner) -------------------------------------------------------
    def plan(self, spec, q, k, *, backward: bool):
        """This rank's ``runner.Plan`` of a forward (or ``backward``) on the local ``spec``."""
        raise NotImplementedError(f"schedule {self.name!r} has no plan")

    def rings_mover(self, device):
        """The mover of the plans' K/V and dK/dV rings on ``device`` (None: they have none)."""
        return None

    def forward(self, q, k, v, spec, kernel, dropout=None, *, out=None, lse=None, beside=(),
                kept=None):
        """(out, lse); ``beside``: other work to run where transfers are in flight
        (``runner.with_beside``); ``kept``: where forward leaves what backward reuses
        (``keeps_forward``)."""
        plan = self._planned(spec, q, k, False, len(beside))
        return runner.forward(plan, q, k, v, spec, kernel, self.rings_mover(k.device), dropout,
                              out=out, lse=lse, beside=beside, kept=kept)

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None, *, dq=None, dk=None,
                 dv=None, beside=(), kept=None):
        """(dq, dk, dv); ``beside`` and ``kept`` as for ``forward``."""
        plan = self._planned(spec, q, k, True, len(beside))
        return runner.backward(plan, dout, q, k, v, out, lse, spec, kernel,
                               self.rings_mover(k.device), dropout, dq=dq, dk=dk, dv=dv,
                               beside=beside, kept=kept)

    def _planned(self, spec, q, k, backward: bool, pieces: int):
        plan = self.plan(spec, *runner.blocks(spec, q, k), backward=backward)
        return runner.with_beside(plan, pieces) if pieces else plan

    # ---- head groups (schedules.heads) ----------------------------------------------------
    def check_groups(self, groups: int, spec) -> None:
        """A ValueError when this schedule cannot run ``groups`` head groups of local ``spec``."""

    def group_count(self, heads_q: int, kv_heads: int, rows: int, least: int = 1) -> int:
        """Head groups of a local problem of ``rows`` query rows per rank."""
        return heads.choose(self.head_groups, heads=heads_q, kv_heads=kv_heads, rows=rows,
                            fits=lambda g: self.groups_fit(g, heads_q, kv_heads), least=least)

    def least_groups(self, spec) -> int:
        """The groups ``auto`` takes at least for a call on ``spec``."""
        return 1

    def groups_fit(self, groups: int, heads_q: int, kv_heads: int) -> bool:
        """Whether ``auto`` may take ``groups`` head groups."""
        return True

    def group_rows(self, rows: int, spec) -> int:
        """The rows that size the head groups of blocks of ``rows`` query rows."""
        return rows

    def groups_for(self, spec) -> int:
        """Head groups of a call on the global ``spec``."""
        if spec.layout.is_varlen:  # each sequence is its own problem: sized by the longest
            rows = self.packed_rows(self.split(spec.cu_seqlens, spec.cu_seqlens_padded, "cpu"))
        else:
            rows = self.local_tokens(spec)
        return self.group_count(spec.heads, spec.kv_heads, self.group_rows(rows, spec),
                                self.least_groups(spec))

    def packed_rows(self, split) -> int:
        """The query rows that size the head groups of a call on the packing ``split``: the
        most tokens a rank holds of one sequence."""
        return split.longest_share

    def groups_of(self, q, k, spec) -> list[heads.HeadGroup]:
        """The head groups of local q and k of the local ``spec``."""
        rows = q.shape[2] if spec.packing is None else self.packed_rows(spec.packing.split)
        count = self.group_count(q.shape[1], k.shape[1], self.group_rows(rows, spec),
                                 self.least_groups(spec))
        return heads.groups_of(count, q.shape[1], k.shape[1])

    def indices(self, seq_len: int, rank: int | None = None) -> torch.Tensor:
        """Global positions of the tokens ``rank`` (this rank by default) holds."""
        return self.partition.indices(seq_len, self.size, self.index if rank is None else rank)

    def positions(self, seq_len: int, device) -> list[torch.Tensor]:
        """Every rank's ``indices`` on ``device``, made once per length and device."""
        key = (seq_len, torch.device(device))
        if key not in self._positions:
            self._positions[key] = [self.indices(seq_len, r).to(device) for r in range(self.size)]
        return self._positions[key]

    def position_ids(self, seq_len: int, device=None) -> torch.Tensor:
        """Global positions (int64, on ``device``) of this rank's tokens of a sequence."""
        return self.positions(seq_len, device or "cpu")[self.index]

    # ---- packed sequences ----------------------------------------------------------------
    def pack(self, cu_seqlens, cu_seqlens_padded=None, *, rank: int | None = None,
             device=None) -> LocalPacking:
        """This rank's (or ``rank``'s) part of the GLOBAL packing ``cu_seqlens``, on ``device``."""
        device = packing_device(self, cu_seqlens, device)
        cu, padded = global_packing(cu_seqlens, cu_seqlens_padded, device=device)
        if rank is not None and not (isinstance(rank, int) and 0 <= rank < self.size):
            raise ValueError(f"rank={rank!r} must be an integer in [0, {self.size})")
        return self.split(cu, padded, device).part(self.index if rank is None else rank)

    def split(self, cu: tuple, padded: tuple | None, device) -> Split:
        """Every rank's part of the packing ``cu``/``padded`` (tuples), made once per packing."""
        key = (cu, padded, torch.device(device))
        if key in self._splits:
            self._splits.move_to_end(key)
        else:
            self._splits[key] = self._make_split(cu, padded, key[2])
            if len(self._splits) > _KEPT_PACKINGS:
                self._splits.popitem(last=False)
        return self._splits[key]

    def _make_split(self, cu: tuple, padded: tuple | None, device: torch.device):
        return split_by_partition(self.partition, self.size, cu, padded, device,
                                  gather=self._gather_tokens)

    def _gather_tokens(self, t: torch.Tensor) -> torch.Tensor:
        return self.gather(t, 0)

    def local_packing(self, q, cu_seqlens, cu_seqlens_padded=None) -> LocalPacking:
        """This rank's packing for ``attention(q, ..., layout='thd', cu_seqlens=...)``."""
        return checked_packing(self, q, cu_seqlens, cu_seqlens_padded)

    @property
    def packing_owner(self) -> tuple:
        """The ``LocalPacking.owner`` of the packings this rank uses."""
        return ((self.partition, self.size, self.index),)

    def local_spec(self, spec):
        """This rank's part of the global ``spec`` (packed: with its packing, on the host)."""
        if spec.layout.is_varlen:
            split = self.split(spec.cu_seqlens, spec.cu_seqlens_padded, "cpu")
            return spec.replace(packing=split.part(self.index))
        return spec.replace(q_len=spec.q_len // self.size, kv_len=spec.kv_len // self.size)

    def local_tokens(self, spec) -> int:
        """Tokens (K/V rows) each rank holds for the global ``spec``."""
        if spec.layout.is_varlen:
            return self.split(spec.cu_seqlens, spec.cu_seqlens_padded, "cpu").tokens
        return spec.kv_len // self.size

    # ---- shard / unshard -----------------------------------------------------------------
    def shard(self, t: torch.Tensor, *, layout: Layout | str = "auto", cu_seqlens=None,
              cu_seqlens_padded=None) -> torch.Tensor:
        layout = shard_layout(t, layout)
        if layout.is_varlen:
            return packing_of(self, cu_seqlens, cu_seqlens_padded, _device(t)).shard(t)
        index = self.indices(t.shape[2]).to(t.device)
        return layout.to(t.index_select(2, index))

    def unshard(self, t: torch.Tensor, *, layout: Layout | str = "auto", cu_seqlens=None,
                cu_seqlens_padded=None) -> torch.Tensor:
        layout = unshard_layout(t, layout)
        if layout.is_varlen:
            return packing_of(self, cu_seqlens, cu_seqlens_padded, _device(t)).unshard(t)
        return layout.to(self.gather_tokens(t, 2))

    @property
    def token_splits(self) -> tuple:
        return (self,)

    def gather_tokens(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's tokens along ``dim`` of ``t`` in the original order; differentiable."""
        full = self.gather(t, dim)
        inverse = self.partition.inverse(full.shape[dim], self.size).to(t.device)
        return full.index_select(dim, inverse)


def packing_device(schedule, cu_seqlens, device=None) -> torch.device:
    """``device``, else ``cu_seqlens``' own when it is a tensor, else the schedule's mesh's."""
    if device is not None:
        return torch.device(device)
    if isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens.device
    mesh = schedule.mesh
    return mesh.device if mesh is not None else torch.device("cpu")


def packing_of(schedule, cu_seqlens, cu_seqlens_padded=None, device=None) -> LocalPacking:
    """``schedule.pack`` of the global ``cu_seqlens``, or ``cu_seqlens`` itself when it is the
    rank's LocalPacking (else a ValueError saying whose it is)."""
    if not isinstance(cu_seqlens, LocalPacking):
        return schedule.pack(cu_seqlens, cu_seqlens_padded, device=device)
    if cu_seqlens_padded is not None:
        raise ValueError("cu_seqlens_padded goes with the global cu_seqlens tensor; a "
                         "LocalPacking already holds the padding: leave cu_seqlens_padded out")
    if cu_seqlens.owner != schedule.packing_owner:
        raise ValueError(f"cu_seqlens is {cu_seqlens!r}, not this rank's part under schedule "
                         f"{schedule.name!r} ({split_by(schedule.packing_owner)}); pass "
                         f"schedule.pack(cu_seqlens) of this schedule, or the global cu_seqlens")
    return cu_seqlens


def checked_packing(schedule, q, cu_seqlens, cu_seqlens_padded=None) -> LocalPacking:
    """``packing_of``, checking q's device and token count against the packing."""
    packing = packing_of(schedule, cu_seqlens, cu_seqlens_padded, _device(q))
    if isinstance(q, torch.Tensor) and q.dim() == 3:
        if q.device != packing.device:
            raise ValueError(f"cu_seqlens is on {packing.device} but q on {q.device}; pass "
                             f"cu_seqlens on the tensors' device")
        if q.shape[0] != packing.tokens:
            raise ValueError(f"q has {q.shape[0]} tokens but this rank's part of the packing has "
                             f"{packing.tokens} ({split_by(packing.owner)}; every sequence padded "
                             f"where needed). cu_seqlens is the GLOBAL packing: shard q, k, v with "
                             f"schedule.shard(t, layout='thd', cu_seqlens=cu_seqlens) or "
                             f"schedule.pack(cu_seqlens).shard(t)")
    return packing


def _device(t) -> torch.device | None:
    """``t``'s device, or None when it is no tensor (the checks that follow say so)."""
    return t.device if isinstance(t, torch.Tensor) else None
