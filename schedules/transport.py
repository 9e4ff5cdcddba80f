"""How data travels around the ring: each rank sends to the next and receives into its slots.

A ring schedule sends what travels (K/V blocks, dK/dV sums) to the next rank and receives the
previous rank's into *slots*, buffers of this call sized for what they carry. The ring asks
only "send this, give me the next":

    kv, sums = mover(comm, "auto", device).rings(
        [RingData((k.shape, v.shape), k.dtype, layout, slots=2), ...], device)
    pending = kv.shift((k, v))     # async: k, v (any memory) go to the next rank
    k_prev, v_prev = pending.wait()   # the previous rank's, in this rank's next slot

``shift(tensors, hops=h)`` sends to the rank h after this one and receives from the rank h
before; slots are used in turn. Every rank makes the same shifts in the same order. An
*exchange* (``Mover.exchange``) is an all-to-all of byte ranges: every rank puts pieces into
regions of other ranks' buffers (``Put``) and says what it takes from whom (``Take``). Two
transports move the bytes:

    p2p          torch.distributed batched isend/irecv (NCCL on GPUs, gloo on CPUs) into slots
                 allocated for the call; NCCL's kernels run on SMs beside the attention.
    copy_engine  the slots live in symmetric memory, kept for the next call. On a side
                 stream, behind the compute stream's work so far, a barrier says every rank is
                 ready (what it sends is written, the slot it receives into has been read);
                 each rank copies what it sends straight into the peer's slot, and a second
                 barrier says every slot is filled. The barriers are stream memory operations
                 (``stream_signals``) and the copies go by the copy engines over NVLink:
                 neither needs an SM, so both pass while an attention kernel holds every SM.

``auto`` is copy_engine for CUDA tensors on an NCCL group of one host when symmetric memory is
available, else p2p.
"""

from __future__ import annotations

import dataclasses
import socket

import torch
import torch.distributed as dist

from sdpa_fusion.layout import Layout

from . import stream_signals
from .buffers import to_buffer, views
from .comm import Pending

TRANSPORTS = ("auto", "p2p", "copy_engine")
_ALIGN = 512  # bytes: every slot starts aligned
_READY, _FILLED = 0, 1  # signal channels of a copy-engine transfer's two barriers


def check_transport(transport: str) -> str:
    """``transport`` if it names a transport, else a ValueError naming the choices."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not known; choose one of {TRANSPORTS}")
    return transport


@dataclasses.dataclass(frozen=True)
class RingData:
    """What a ring carries: logical tensors of ``shapes``, received into ``slots`` slots."""

    shapes: tuple
    dtype: torch.dtype
    layout: Layout
    slots: int = 2

    @property
    def used(self) -> int:
        """Bytes of the tensors (what a shift moves)."""
        return sum(torch.Size(s).numel() for s in self.shapes) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of one slot (``used``, aligned)."""
        return aligned(self.used)

    def empty(self, device) -> list[torch.Tensor]:
        """New tensors of these shapes (one allocation), such as what a rank sends."""
        flat = torch.empty(self.used // self.dtype.itemsize, dtype=self.dtype, device=device)
        return views(flat, self.shapes, self.layout)


@dataclasses.dataclass(frozen=True)
class Put:
    """A piece of an exchange: contiguous ``tensor`` to byte ``at`` of the rank ``hops`` on."""

    tensor: torch.Tensor
    hops: int
    at: int

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def bytes(self) -> torch.Tensor:
        """The tensor's bytes, flat (a view)."""
        return self.tensor.reshape(-1).view(torch.uint8)


@dataclasses.dataclass(frozen=True)
class Region:
    """Bytes [``base``, ``base`` + n) of a mover's receive buffer; ``flat`` is this rank's."""

    flat: torch.Tensor
    base: int


@dataclasses.dataclass(frozen=True)
class Take:
    """What arrives from the rank ``hops`` before: ``nbytes`` at byte ``at`` (its ``Put``)."""

    hops: int
    at: int
    nbytes: int


class Ring:
    """The slots of one ``RingData`` at ``offset`` in this call's flat byte buffer."""

    def __init__(self, data: RingData, flat: torch.Tensor, offset: int, mover: "Mover"):
        self.data, self._mover = data, mover
        self._offsets = [offset + i * data.nbytes for i in range(data.slots)]
        self._shifts = 0
        self._views = [views(flat[at:at + data.nbytes].view(data.dtype), data.shapes, data.layout)
                       for at in self._offsets]

    def tensors(self, slot: int) -> list[torch.Tensor]:
        """The logical tensors slot ``slot`` holds (views into the buffer)."""
        return list(self._views[slot])

    def shift(self, tensors, hops: int = 1) -> Pending:
        """Start sending ``tensors`` ``hops`` ranks on; ``wait()`` returns those received."""
        slot = self._shifts % self.data.slots
        self._shifts += 1
        works = self._mover.push(list(tensors), self, slot, hops)
        comm = self._mover.comm
        return comm.pending(works, self.tensors(slot), f"ring shift: send to rank "
                            f"{comm.peer(hops)}, receive from rank {comm.peer(-hops)}")

    def offset(self, slot: int) -> int:
        """Byte offset of slot ``slot`` in the flat buffer (the same on every rank)."""
        return self._offsets[slot]


class Mover:
    """Moves what rings send, and exchanges, between the ranks of ``comm``."""

    name = ""

    def __init__(self, comm):
        self.comm = comm

    def over(self, comm) -> "Mover":
        """A mover like this one over ``comm`` (a part of its line): p2p, which needs nothing
        of the ranks outside it."""
        return P2PMover(comm)

    @property
    def kept_bytes(self) -> int:
        """Bytes of buffer kept between calls, outside torch's caching allocator."""
        return 0

    def rings(self, datas, device) -> list[Ring]:
        """One ``Ring`` for each ``RingData``, all slots in one flat buffer."""
        flat = self.buffer(sum(d.slots * d.nbytes for d in datas), device)
        rings, offset = [], 0
        for d in datas:
            rings.append(Ring(d, flat, offset, self))
            offset += d.slots * d.nbytes
        return rings

    def buffer(self, nbytes: int, device) -> torch.Tensor:
        """A flat byte buffer of at least ``nbytes`` for this call's slots."""
        raise NotImplementedError

    def push(self, tensors, ring: Ring, slot: int, hops: int = 1) -> list:
        """Start a shift of ``ring`` into its slot ``slot``; the works to wait for."""
        raise NotImplementedError

    def reserve(self, nbytes: int, device) -> None:
        """Make the kept receive buffer hold ``nbytes`` (every rank alike, before any region)."""

    def region(self, base: int, nbytes: int, device) -> Region:
        """Bytes [base, base + nbytes) of the receive buffer (p2p: a fresh buffer)."""
        return Region(torch.empty(nbytes, dtype=torch.uint8, device=device), base)

    def exchange(self, puts, takes, region: Region) -> Pending:
        """Start an exchange into ``region`` of every rank; ``wait()`` returns ``region.flat``.
        Every rank calls it in the same order, the pieces of a pair of ranks in one order."""
        size, comm = self.comm.size, self.comm
        puts = [p for p in puts if p.nbytes]
        takes = [t for t in takes if t.nbytes and t.hops % size]
        comm.count(sum(p.nbytes for p in puts if p.hops % size), sum(t.nbytes for t in takes))
        works = self._exchange(puts, takes, region)
        peers = sorted({comm.peer(p.hops) for p in puts if p.hops % size})
        return comm.pending(works, region.flat, f"exchange with ranks {peers}")

    def _exchange(self, puts, takes, region: Region) -> list:
        raise NotImplementedError


class P2PMover(Mover):
    """Slots in a fresh buffer per call; shifts by batched isend/irecv."""

    name = "p2p"

    def buffer(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def push(self, tensors, ring, slot, hops=1):
        layout = ring.data.layout
        sends = [to_buffer(t, layout) for t in tensors]  # a copy only for tensors out of layout
        receives = [to_buffer(t, layout) for t in ring.tensors(slot)]
        self.comm.count(ring.data.used, ring.data.used)
        return self._start([(s, hops) for s in sends], [(r, -hops) for r in receives])

    def _exchange(self, puts, takes, region):
        size, sends, flat = self.comm.size, [], region.flat
        for p in puts:
            if p.hops % size:
                sends.append((p.bytes(), p.hops))
            else:
                flat[p.at:p.at + p.nbytes].copy_(p.bytes())
        return self._start(sends, [(flat[t.at:t.at + t.nbytes], -t.hops) for t in takes])

    def _start(self, sends, receives) -> list:
        """Start sending and receiving each (tensor, hops); the works keep what they send."""
        kept = [t for t, _ in sends]
        return [_Keep(work, kept) for work in self.comm.pairwise(sends, receives)]


class _Keep:
    """A work that reads ``tensors``: they stay alive until it has been waited for."""

    def __init__(self, work, tensors):
        self.work, self.tensors = work, tensors

    def wait(self, *timeout) -> None:
        self.work.wait(*timeout)
        self.tensors = None


class CopyEngineMover(Mover):
    """Slots in one symmetric-memory buffer kept across calls, filled by copy engines."""

    name = "copy_engine"

    def __init__(self, comm):
        super().__init__(comm)
        self._flat = self._handle = None
        self._peers: dict[int, torch.Tensor] = {}  # hops -> the buffer of the rank hops after
        self._stream = None
        self._ready = self._filled = None  # the two barriers of a transfer (StreamBarrier)

    @property
    def kept_bytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel()

    def buffer(self, nbytes: int, device) -> torch.Tensor:
        import torch.distributed._symmetric_memory as symm_mem

        if self._flat is None or self._flat.numel() < nbytes:
            flat = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
            # every rank's earlier transfers have finished before any old buffer goes away
            torch.cuda.synchronize(device)
            self._handle = symm_mem.rendezvous(flat, self.comm.group)
            self._flat, self._peers = flat, {}
            self._stream = torch.cuda.Stream(device=device)
            # on the new buffer's signal pads (zeros): every rank starts counting anew
            self._ready = stream_signals.StreamBarrier(self._handle, _READY)
            self._filled = stream_signals.StreamBarrier(self._handle, _FILLED)
        return self._flat

    def _peer(self, hops: int) -> torch.Tensor:
        """The buffer of the rank ``hops`` after this one, mapped here (made once)."""
        if hops not in self._peers:
            peer = dist.get_group_rank(self.comm.group, self.comm.peer(hops))
            self._peers[hops] = self._handle.get_buffer(peer, (self._flat.numel(),), torch.uint8, 0)
        return self._peers[hops]

    def push(self, tensors, ring, slot, hops=1):
        data, start = ring.data, ring.offset(slot)
        target = self._peer(hops)[start:start + data.nbytes].view(data.dtype)
        self.comm.count(data.used, data.used)
        return self._transfer(zip(views(target, data.shapes, data.layout), tensors))

    def reserve(self, nbytes, device):
        self.buffer(nbytes, device)

    def region(self, base, nbytes, device):
        if self._flat is None or self._flat.numel() < base + nbytes:
            raise RuntimeError(f"region [{base}, {base + nbytes}) lies beyond the reserved "
                               f"buffer; reserve every region of the call first")
        return Region(self._flat[base:base + nbytes], base)

    def _exchange(self, puts, takes, region):
        size, base = self.comm.size, region.base
        return self._transfer(
            (self._peer(p.hops)[base + p.at:base + p.at + p.nbytes] if p.hops % size
             else region.flat[p.at:p.at + p.nbytes], p.bytes()) for p in puts)

    def _transfer(self, copies) -> list:
        """Copy every (target, source) pair on the side stream between the two barriers."""
        stream = self._stream
        # the side stream goes on once the compute stream's work so far is done: what this
        # rank sends is written, and the slot it receives into has been read
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._ready.pass_()  # so has every other rank's
            for target, source in copies:
                target.copy_(source)
                source.record_stream(stream)  # its memory is not reused before the copy is done
            self._filled.pass_()  # every rank's slot is filled
            event = torch.cuda.Event()
            event.record(stream)
        return [event]  # its wait() holds the current stream


class InFlight:
    """An exchange in flight: ``finish()`` waits and returns ``place`` of what arrived."""

    def __init__(self, pending, place):
        self._pending, self._place = pending, place

    def finish(self):
        flat = self._pending.wait()
        self._pending = None
        return self._place(flat)


def sections(items, rows: int) -> tuple[list[int], int]:
    """(aligned section offsets, bytes) of ``rows`` rows of each (heads, E, dtype) ``item``."""
    offsets, total = [], 0
    for width, e, dtype in items:
        offsets.append(total)
        total += aligned(rows * width * e * dtype.itemsize)
    return offsets, total


def rows_at(flat: torch.Tensor, at: int, rows: int, item) -> torch.Tensor:
    """The [rows, heads, E] tensor of ``item`` (heads, E, dtype) at byte ``at`` of ``flat``."""
    width, e, dtype = item
    return flat[at:at + rows * width * e * dtype.itemsize].view(dtype).view(rows, width, e)


class Transported:
    """A schedule whose transfers go through the movers of its ``transport``."""

    def use_transport(self, transport: str) -> None:
        self.transport = check_transport(transport)
        self._movers: dict[torch.device, Mover] = {}

    def mover(self, device) -> Mover:
        """The transport's mover on ``device`` (made once)."""
        device = torch.device(device)
        if device not in self._movers:
            self._movers[device] = mover(self.comm, self.transport, device)
        return self._movers[device]

    @property
    def kept_bytes(self) -> int:
        """Bytes of buffers kept between calls (symmetric memory, not in memory_allocated)."""
        return sum(m.kept_bytes for m in self._movers.values())

    def keeps_buffers(self) -> bool:
        """Whether the receiving buffers are kept between calls (the copy-engine transport)."""
        movers = list(self._movers.values())
        if movers:
            return movers[0].name == "copy_engine"
        on_gpus = self.mesh is not None and self.mesh.device.type == "cuda"
        return self.transport == "copy_engine" or (self.transport == "auto" and on_gpus)


def mover(comm, transport: str, device: torch.device) -> Mover:
    """The mover of ``transport`` over ``comm`` on ``device`` (``auto`` resolved)."""
    if check_transport(transport) == "p2p":
        return P2PMover(comm)
    usable, why = _copy_engine_usable(device, comm.group)
    if transport == "copy_engine" and not usable:
        raise ValueError(f"transport='copy_engine' cannot run here: {why}; use transport='p2p'")
    return CopyEngineMover(comm) if usable else P2PMover(comm)


def _copy_engine_usable(device: torch.device, group) -> tuple[bool, str]:
    """(usable, why not). Every rank of ``group`` calls it alike (it gathers host names)."""
    if device.type != "cuda":
        return False, f"it needs CUDA tensors, got {device.type} tensors"
    if dist.get_backend(group) != "nccl":
        return False, f"it needs an NCCL process group, got {dist.get_backend(group)}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return False, f"torch has no symmetric memory ({e})"
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        return False, (f"its ranks are on {len(set(hosts))} hosts and copy engines reach "
                       f"only this one")
    return stream_signals.available()


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the alignment of a slot."""
    return -(-nbytes // _ALIGN) * _ALIGN
