"""The communicator of sequence schedules: the collectives they use, with byte counters.

Every transfer of a schedule goes through one ``Communicator`` so that what a call moved can
be compared with what ``describe()`` promises (tests do). Collectives run asynchronously where
the caller can overlap them with compute: NCCL runs them on its own streams, and ``wait()``
makes the current stream wait for the result.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass
class CommStats:
    """Bytes this rank sent and received, and how many transfers it started."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers: int = 0

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.transfers = 0


class Pending:
    """Transfers in flight; ``wait()`` returns ``result`` once they have landed."""

    def __init__(self, works, result=None):
        self._works, self.result = works, result

    def wait(self):
        for w in self._works:
            w.wait()
        self._works = []
        return self.result


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Communicator:
    """Collectives over one line of the mesh (``ranks`` are global ranks in line order)."""

    def __init__(self, group, ranks: list[int], index: int):
        self.group, self.ranks, self.index = group, ranks, index
        self.size = len(ranks)
        self.stats = CommStats()

    def peer(self, hops: int) -> int:
        """Global rank ``hops`` after this one on the ring of the line (before when < 0)."""
        return self.ranks[(self.index + hops) % self.size]

    def count(self, sent: int, received: int) -> None:
        """Record a transfer of ``sent`` and ``received`` bytes."""
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received
        self.stats.transfers += 1

    def all_gather(self, t: torch.Tensor) -> Pending:
        """Start gathering every rank's ``t``: the result is [size, *t.shape]."""
        t = t.contiguous()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        # flat views: gloo wants the output as the inputs concatenated along dim 0
        work = dist.all_gather_into_tensor(out.view(-1), t.view(-1), group=self.group, async_op=True)
        self.count(_nbytes(t) * (self.size - 1), _nbytes(t) * (self.size - 1))
        return Pending([work], out)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum [size, *shape] over ranks and keep this rank's slice [*shape]."""
        t = t.contiguous()
        out = torch.empty(t.shape[1:], dtype=t.dtype, device=t.device)
        dist.reduce_scatter_tensor(out.view(-1), t.view(-1), group=self.group)  # flat for gloo
        part = _nbytes(out)
        self.count(part * (self.size - 1), part * (self.size - 1))
        return out

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """Exchange slices: ``t`` is [size, ...]; slice i goes to rank i; result [size, ...]
        holds slice ``index`` of every rank, in rank order."""
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.group)
        part = _nbytes(t) // self.size
        self.count(part * (self.size - 1), part * (self.size - 1))
        return out
