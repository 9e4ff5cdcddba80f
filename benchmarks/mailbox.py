"""Virtual ranks of one schedule on one device: run as threads, one at a time, their transfers
handed over through a mailbox and recorded, then replayed to one rank running alone.

    box = Mailbox(parts, recording=range(parts), budget=40 << 30)
    scheds = virtual_schedules("ring", parts, device, box, cu_seqlens, partition="documents")
    thread r:  with box.baton(r): ... attention on scheds[r] ...    # sends clone into queues
    box.replay(r)                                                    # rank r alone, served
                                                                     # from its record

A rank holds the baton while it runs and lets go of it only to wait for a transfer, so a
kernel compiler or launcher never sees two ranks at once (FlashAttention-4's CuTe-DSL
launcher is not thread-safe). Receives of the ranks in ``recording`` are kept in order up to
``budget`` bytes; past it the highest recording rank's record is dropped (``recorded`` says
whose records are complete) and that rank is recorded by a later run.

A replayed rank's receives on a GPU run as the copy-engine transport runs them
(``schedules.transport``): on a side stream behind the rank's work so far, the rank's stream
waiting for them only where it reads what arrived, so that they pass beside its kernels
(``transfers="side"``); with ``transfers="inline"`` they run on the rank's stream where it
makes them, never beside its work. Either way into one buffer the rank keeps across calls,
as that transport keeps its own.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading

import torch

from schedules.transport import Mover, Region


TRANSFERS = ("side", "inline")  # where a replayed rank's receives run (see above)


class Stopped(RuntimeError):
    """A virtual rank stopped waiting because another one failed."""


class Mailbox:
    """Queues of transfers between virtual ranks, the baton, and the records."""

    def __init__(self, parts: int, *, recording=(), budget: float = math.inf,
                 timeout_s: float = 120.0, transfers: str = "side"):
        if transfers not in TRANSFERS:
            raise ValueError(f"transfers={transfers!r}: choose one of {TRANSFERS}")
        self.parts, self.budget, self.timeout_s = parts, budget, timeout_s
        self.transfers = transfers
        self.turn = threading.Condition()
        self.holder: int | None = None
        self.queues = collections.defaultdict(collections.deque)
        self.records: dict[int, list[torch.Tensor]] = {r: [] for r in recording}
        self.kept = 0
        self.failed: BaseException | None = None
        self.replaying: int | None = None
        self.cursor = 0
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    # ---- the baton --------------------------------------------------------------------------
    @contextlib.contextmanager
    def baton(self, rank: int):
        """Held while virtual rank ``rank`` runs (a failure stops every other rank's wait)."""
        with self.turn:
            self._wait(lambda: self.holder is None, f"virtual rank {rank} waited for its turn")
            self.holder = rank
        try:
            yield
        except BaseException as e:
            with self.turn:
                self.failed = self.failed or e
            raise
        finally:
            with self.turn:
                if self.holder == rank:
                    self.holder = None
                self.turn.notify_all()

    def _wait(self, ready, what: str) -> None:
        if not self.turn.wait_for(lambda: self.failed is not None or ready(), self.timeout_s):
            raise TimeoutError(f"{what} for {self.timeout_s:.0f} s (raise --timeout-s)")
        if self.failed is not None:
            raise Stopped(f"{what}: another virtual rank failed") from self.failed

    # ---- transfers --------------------------------------------------------------------------
    def send(self, src: int, dst: int, t: torch.Tensor) -> None:
        t = t.clone()
        with self.turn:
            self.queues[(src, dst)].append(t)
            self.turn.notify_all()

    def receive(self, src: int, dst: int, into: torch.Tensor) -> None:
        if self.replaying is not None:
            into.copy_(self.records[dst][self.cursor].view_as(into))
            self.cursor += 1
            return
        queue = self.queues[(src, dst)]
        with self.turn:
            if not queue:  # let the sender run
                self.holder = None
                self.turn.notify_all()
                self._wait(lambda: queue and self.holder is None,
                           f"virtual rank {dst} waited for rank {src}")
                self.holder = dst
            t = queue.popleft()
            self._keep(dst, t)
        into.copy_(t.view_as(into))

    def side_stream(self, device) -> "torch.cuda.Stream | None":
        """The stream a replayed rank's receives on ``device`` run on (None: its own)."""
        device = torch.device(device)
        if self.replaying is None or device.type != "cuda" or self.transfers != "side":
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device=device)
        return self.streams[device]

    def _keep(self, rank: int, t: torch.Tensor) -> None:
        if rank not in self.records:
            return
        self.records[rank].append(t)
        self.kept += t.numel() * t.element_size()
        while self.kept > self.budget and self.records:
            dropped = self.records.pop(max(self.records))
            self.kept -= sum(x.numel() * x.element_size() for x in dropped)

    @property
    def recorded(self) -> list[int]:
        """Ranks whose every receive is recorded."""
        return sorted(self.records)

    def replay(self, rank: int) -> None:
        """From now on rank ``rank`` runs alone: its receives come from its record."""
        self.replaying, self.cursor = rank, 0

    def drop(self, rank: int) -> None:
        """Free ``rank``'s record."""
        self.records.pop(rank, None)


class VirtualComm:
    """The communicator of virtual rank ``index`` of ``size``: counts bytes, waits for nothing
    (the mailbox hands transfers over when they are made)."""

    def __init__(self, index: int, size: int, first: int = 0, whole: "VirtualComm" = None):
        self.index, self.size, self.first, self.whole = index, size, first, whole
        self.bytes_sent = self.bytes_received = 0

    def peer(self, hops: int) -> int:
        """The virtual rank ``hops`` after this one (``peer(0)``: this one)."""
        return self.first + (self.index + hops) % self.size

    def line(self, first: int, size: int) -> "VirtualComm":
        """Ranks [first, first + size) of this line (as ``Communicator.line``)."""
        return VirtualComm(self.index - first, size, self.first + first, self)

    def count(self, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        if self.whole is not None:
            self.whole.count(sent, received)

    def pending(self, works, result, what: str):
        return _Done(result, works)

    @contextlib.contextmanager
    def running(self, what: str):
        yield


class _Done:
    """A transfer that has been made; ``wait()`` holds the current stream for ``events``."""

    def __init__(self, result, events=()):
        self.result, self.events = result, list(events)

    def wait(self):
        for event in self.events:
            event.wait()
        self.events = []
        return self.result


class VirtualMover(Mover):
    """Ring shifts and exchanges of a virtual rank through the ``Mailbox``."""

    name = "virtual"

    def __init__(self, comm: VirtualComm, mailbox: Mailbox):
        super().__init__(comm)
        self.mailbox = mailbox
        self._flat = None  # the buffer a replayed rank keeps

    def over(self, comm: VirtualComm) -> "VirtualMover":
        return VirtualMover(comm, self.mailbox)

    def buffer(self, nbytes: int, device) -> torch.Tensor:
        """A fresh buffer while the ranks record; a replayed rank keeps one across calls, as
        the copy-engine transport does (a larger one replaces it), so that its timed steps
        allocate no buffer the real transport would not."""
        if self.mailbox.replaying is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        if self._flat is None or self._flat.numel() < nbytes:
            self._flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._flat

    def reserve(self, nbytes: int, device) -> None:
        self.buffer(nbytes, device)

    def region(self, base: int, nbytes: int, device):
        if self.mailbox.replaying is None:
            return super().region(base, nbytes, device)
        return Region(self.buffer(base + nbytes, device)[base:base + nbytes], base)

    def push(self, tensors, ring, slot, hops=1):
        comm, box = self.comm, self.mailbox
        me = comm.peer(0)
        for t in tensors:
            if box.replaying is None:
                box.send(me, comm.peer(hops), t)
        comm.count(ring.data.used, ring.data.used)
        return self._land([(into, -hops) for into in ring.tensors(slot)])

    def _exchange(self, puts, takes, region):
        comm, box, flat = self.comm, self.mailbox, region.flat
        me = comm.peer(0)
        local = []
        for p in puts:
            if p.hops % comm.size == 0:
                local.append((flat[p.at:p.at + p.nbytes], p.bytes()))
            elif box.replaying is None:
                box.send(me, comm.peer(p.hops), p.bytes())
        return self._land(local + [(flat[t.at:t.at + t.nbytes], -t.hops) for t in takes])

    def _land(self, copies) -> list:
        """Fill each (target, source): a tensor, or the hops (negative: back) to the rank
        whose transfer it takes; on the mailbox's side stream when it has one (the events to
        wait for), else now."""
        if not copies:
            return []
        side = self.mailbox.side_stream(copies[0][0].device)
        if side is None:
            self._copy(copies)
            return []
        # behind this rank's work so far: what it sends is written, the slot has been read
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._copy(copies)
            for target, source in copies:  # their memory is not reused before the copy is done
                target.record_stream(side)
                if isinstance(source, torch.Tensor):  # a put to this rank itself
                    source.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        return [event]

    def _copy(self, copies) -> None:
        box, comm = self.mailbox, self.comm
        for target, source in copies:
            if isinstance(source, torch.Tensor):
                target.copy_(source)
            else:
                box.receive(comm.peer(source), comm.peer(0), target)


def virtual_schedules(name: str, parts: int, device, mailbox: Mailbox, cu_seqlens,
                      **options) -> list:
    """Schedule ``name`` of every virtual rank of ``parts``, transfers in ``mailbox``; all
    read one split of the packing ``cu_seqlens`` (made once: planning it is host work that
    grows with the documents)."""
    import schedules
    import sdpa_fusion

    scheds = []
    for rank in range(parts):
        mesh = sdpa_fusion.VirtualMesh((parts,), ("seq",), rank=rank, device=device)
        sched = schedules.get(name, mesh, transport="p2p", **options)
        comm = VirtualComm(rank, parts)
        sched.__dict__["comm"] = comm
        sched._movers[torch.device(device)] = VirtualMover(comm, mailbox)
        scheds.append(sched)
    key = (tuple(int(x) for x in cu_seqlens), None, torch.device(device))
    split = scheds[0].split(*key)
    for sched in scheds[1:]:
        sched._splits[key] = split
    return scheds
