"""Base of the context-parallel schedules: q, k, v split along the sequence by a partitioner.

Rank r of the mesh dim holds the tokens ``partition.indices(S, P, r)`` of q, k and v (and
of out and the gradients). ``shard`` picks them out of a full tensor; ``unshard`` gathers
every rank's tokens and restores the original order on every rank.
"""

from __future__ import annotations

import torch

from sdpa_fusion.layout import Layout

from . import partition as partitions
from .base import Schedule


class SequenceSchedule(Schedule):
    """A schedule splitting the sequence dim over one mesh dim (default: the last)."""

    sharded_dim = 2

    def __init__(self, mesh, *, dim: str | None = None, partition="load_balanced"):
        super().__init__(mesh, dim=dim)
        self.partition = partitions.get(partition)
        self._positions: dict[tuple[int, torch.device], list[torch.Tensor]] = {}

    def global_spec(self, spec):
        return spec.replace(q_len=spec.q_len * self.size, kv_len=spec.kv_len * self.size)

    def validate(self, spec):
        super().validate(spec)
        full = self.global_spec(spec)
        for length in {full.q_len, full.kv_len}:
            self.partition.check(length, self.size)
        if spec.causal and spec.q_len != spec.kv_len:
            raise ValueError(
                f"causal context parallelism needs q and k/v of one length per rank, got "
                f"q_len={spec.q_len} and kv_len={spec.kv_len}; shard q, k, v of one sequence alike"
            )
        if spec.causal and not self.partition_is_ordered:
            raise ValueError(
                f"causal attention needs each rank's tokens in increasing order; the "
                f"{self.partition.name} partition reorders them. Use partition='load_balanced'"
            )

    @property
    def partition_is_ordered(self) -> bool:
        return getattr(self.partition, "increasing", True)

    def indices(self, seq_len: int, rank: int | None = None) -> torch.Tensor:
        """Global positions of the tokens ``rank`` (this rank by default) holds."""
        return self.partition.indices(seq_len, self.size, self.index if rank is None else rank)

    def positions(self, seq_len: int, device) -> list[torch.Tensor]:
        """Every rank's ``indices`` on ``device``, made once per length and device, so that
        forward and backward do not copy index tensors to the device on every call."""
        key = (seq_len, torch.device(device))
        if key not in self._positions:
            self._positions[key] = [self.indices(seq_len, r).to(device) for r in range(self.size)]
        return self._positions[key]

    def shard(self, t: torch.Tensor, *, layout: Layout | str = Layout.BHSE) -> torch.Tensor:
        layout = Layout.of(layout)
        if layout.is_varlen:
            raise ValueError(f"schedule {self.name!r} does not shard layout='thd' yet; use 'bshe'")
        index = self.indices(t.shape[2]).to(t.device)
        return layout.to(t.index_select(2, index))

    def unshard(self, t: torch.Tensor, *, layout: Layout | str = Layout.BHSE) -> torch.Tensor:
        layout = Layout.of(layout)
        full = self.gather(t, 2)
        inverse = self.partition.inverse(full.shape[2], self.size).to(t.device)
        return layout.to(full.index_select(2, inverse))
