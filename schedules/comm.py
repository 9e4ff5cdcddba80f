"""The communicator of sequence schedules: the collectives they use, with byte counters.

Every transfer of a schedule goes through one ``Communicator``, so that what a call moved can
be compared with what ``describe()`` promises. On CPU ranks (gloo) a transfer that does not
complete within the mesh's timeout raises ``MeshTimeout`` naming the schedule, the call, the
transfer and the ranks that did not arrive; NCCL transfers are watched from a thread
(``StallWatch``) that logs the same before NCCL's watchdog ends the process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime

import torch
import torch.distributed as dist

from sdpa_fusion.waiting import Arrivals, MeshTimeout, StallWatch


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

    def __init__(self, comm: "Communicator", waits, result=None):
        self._comm, self._waits, self.result = comm, waits, result

    def wait(self):
        for work, what, step in self._waits:
            self._comm.wait(work, what, step)
        self._waits = []
        return self.result


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Communicator:
    """Collectives over one line of the mesh (``ranks``: global ranks in line order)."""

    whole: "Communicator | None" = None  # the line's communicator, for one of a part of it

    def __init__(self, group, ranks: list[int], index: int, *, timeout: datetime.timedelta):
        self.group, self.ranks, self.index = group, ranks, index
        self.size = len(ranks)
        self.timeout = timeout
        self._count_from_zero()
        arrivals = Arrivals(group.group_name, ranks, timeout)
        gloo = dist.get_backend(group) == "gloo"
        self._arrivals = arrivals if gloo else None
        self._watch = None if gloo else StallWatch(arrivals, timeout)

    def _count_from_zero(self) -> None:
        self.stats = CommStats()
        self._running = "a schedule"  # what the transfers belong to (see ``running``)
        self._started = 0  # transfers before that began
        self._transfers = 0  # transfers ever started (every rank counts alike)

    @contextlib.contextmanager
    def running(self, what: str):
        """Name ``what`` (schedule, call) in the timeouts of the transfers inside."""
        before = self._running, self._started
        self._running, self._started = what, self._transfers
        try:
            yield
        finally:
            self._running, self._started = before

    def pending(self, works, result, what: str) -> Pending:
        """``works`` of the transfer just counted as in flight; ``what`` names its peers."""
        step = self._transfers
        name = f"transfer {step - self._started} ({what})"
        return Pending(self, [(w, name, step) for w in works], result)

    def wait(self, work, what: str, step: int) -> None:
        """Wait for ``work`` of transfer ``step`` (a MeshTimeout when it fails)."""
        try:
            if self._arrivals is None:
                work.wait()  # NCCL: the current stream waits, watched behind an event
                done = torch.cuda.Event()
                done.record()
                self._watch.add(done, f"{self._running}: {what}", step)
            else:
                self._arrivals.wait(work, step)
        except RuntimeError as e:
            who = self._arrivals.missing(step) if self._arrivals is not None else str(e)
            raise MeshTimeout(
                f"{self._running}: {what} did not complete: {who}; every rank of {self.ranks} "
                f"must make the same transfers in the same order ({e})"
            ) from e

    def peer(self, hops: int) -> int:
        """Global rank ``hops`` after this one on the ring of the line (before when < 0)."""
        return self.ranks[(self.index + hops) % self.size]

    def line(self, first: int, size: int) -> "Communicator":
        """The communicator of ranks [first, first + size) of this line (this rank among
        them): peers among them, its own transfer count (every rank of the part counts
        alike), bytes counted here too (``schedules.groups``)."""
        part = Communicator(self.group, self.ranks[first:first + size], self.index - first,
                            timeout=self.timeout)
        part.whole = self
        return part

    def count(self, sent: int, received: int) -> None:
        """Record a transfer of ``sent`` and ``received`` bytes (on the whole line's
        communicator too, for a part of it)."""
        self._transfers += 1
        for stats in (self.stats, self.whole and self.whole.stats):
            if stats is not None:
                stats.bytes_sent += sent
                stats.bytes_received += received
                stats.transfers += 1

    def all_gather(self, t: torch.Tensor) -> Pending:
        """Start gathering every rank's ``t``: the result is [size, *t.shape]."""
        t = t.contiguous()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        # flat views: gloo wants the output as the inputs concatenated along dim 0
        work = self._start(dist.all_gather_into_tensor, out.view(-1), t.view(-1))
        self.count(_nbytes(t) * (self.size - 1), _nbytes(t) * (self.size - 1))
        return self.pending([work], out, f"all-gather over ranks {self.ranks}")

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum [size, *shape] over ranks and keep this rank's slice [*shape]."""
        t = t.contiguous()
        out = torch.empty(t.shape[1:], dtype=t.dtype, device=t.device)
        work = self._start(dist.reduce_scatter_tensor, out.view(-1), t.view(-1))  # flat for gloo
        part = _nbytes(out)
        self.count(part * (self.size - 1), part * (self.size - 1))
        return self.pending([work], out, f"reduce-scatter over ranks {self.ranks}").wait()

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """Exchange slices of [size, ...] ``t``: slice i goes to rank i, and comes from it
        (on a part of the line, pairwise among its ranks: the others take no part)."""
        t = t.contiguous()
        out = torch.empty_like(t)
        if self.whole is None:
            works = [self._start(dist.all_to_all_single, out, t)]
        else:
            out[self.index].copy_(t[self.index])
            others = [j for j in range(self.size) if j != self.index]
            works = self.pairwise([(t[j], j - self.index) for j in others],
                                  [(out[j], j - self.index) for j in others])
        part = _nbytes(t) // self.size
        self.count(part * (self.size - 1), part * (self.size - 1))
        return self.pending(works, out, f"all-to-all over ranks {self.ranks}").wait()

    def pairwise(self, sends, receives) -> list:
        """Start sending and receiving each (tensor, hops) between this rank and the peer
        ``hops`` on (back for a receive's negative hops); the works (not counted here)."""
        ops = [dist.P2POp(dist.isend, t, self.peer(h), self.group) for t, h in sends]
        ops += [dist.P2POp(dist.irecv, t, self.peer(h), self.group) for t, h in receives]
        return dist.batch_isend_irecv(ops) if ops else []

    def _start(self, collective, out: torch.Tensor, t: torch.Tensor):
        """Start ``collective(out, t)`` over the group (the whole line's: a part of it has
        no group of its own, and its ranks alone would wait for the others); its work."""
        if self.whole is not None:
            raise NotImplementedError(f"{collective.__name__} over ranks {self.ranks}, a part "
                                      f"of the line {self.whole.ranks}")
        return collective(out, t, group=self.group, async_op=True)
