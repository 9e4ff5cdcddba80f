"""How data travels around the ring: slots, and the transports that shift them.

A ring schedule keeps what travels (K/V blocks, fp32 dK/dV sums) in *slots*: equal pieces of
one flat byte buffer per rank. ``shift(src, dst)`` fills this rank's slot ``dst`` with the
previous rank's slot ``src`` while this rank's slot ``src`` goes to the next rank
(``hops=h``: the rank h before, the rank h after; a ring that skips steps). Every rank makes
the same shifts in the same order.

    blocks, sums = mover(comm, "auto", device).ring_buffers(
        [RingData((k.shape, v.shape), k.dtype, layout), ...], device)
    blocks.load(0, (k, v))
    pending = blocks.shift(0, 1)         # async; pending.wait() -> blocks.tensors(1)

Two transports move the bytes:

    p2p          torch.distributed batched isend/irecv: NCCL on GPUs, gloo on CPUs. NCCL's
                 send/receive kernels run on SMs beside the attention kernels.
    copy_engine  the buffer is symmetric memory (torch.distributed._symmetric_memory) that the
                 neighbour maps; each rank pulls its neighbour's slot with one device-to-device
                 copy on a side stream, after a device-side barrier of the ring. The GPU's copy
                 engines move the data over NVLink and attention keeps every SM. The buffer is
                 kept for the next call (it grows, collectively, when a call needs more).

``auto`` is copy_engine for CUDA tensors on an NCCL group of one host when symmetric memory is
available, else p2p.
"""

from __future__ import annotations

import dataclasses
import socket

import torch
import torch.distributed as dist

from sdpa_fusion.layout import Layout

from .buffers import views
from .comm import Pending

TRANSPORTS = ("auto", "p2p", "copy_engine")
_ALIGN = 512  # bytes: every slot starts aligned


def check_transport(transport: str) -> str:
    """``transport`` if it names a transport, else a ValueError naming the choices."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} is not known; choose one of {TRANSPORTS}")
    return transport


@dataclasses.dataclass(frozen=True)
class RingData:
    """What one slot holds: logical tensors of ``shapes`` in ``dtype`` and ``layout``."""

    shapes: tuple
    dtype: torch.dtype
    layout: Layout

    @property
    def used(self) -> int:
        """Bytes of the tensors (what a shift moves)."""
        return sum(torch.Size(s).numel() for s in self.shapes) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of a slot (``used``, aligned)."""
        return _aligned(self.used)


class _StreamEvent:
    """A copy-engine transfer: the current stream waits for ``event`` on ``wait()``."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class RingBuffer:
    """Two slots of ``data`` at ``offset`` in the flat byte buffer ``flat`` of this rank."""

    def __init__(self, data: RingData, flat: torch.Tensor, offset: int, mover):
        self.data, self._flat, self._mover = data, flat, mover
        self._offsets = [offset, offset + data.nbytes]

    def tensors(self, slot: int) -> list[torch.Tensor]:
        """The logical tensors slot ``slot`` holds (views into the buffer)."""
        start = self._offsets[slot]
        elements = self._flat[start:start + self.data.nbytes].view(self.data.dtype)
        return views(elements, self.data.shapes, self.data.layout)

    def load(self, slot: int, tensors) -> None:
        """Copy ``tensors`` (logical, of this buffer's shapes) into slot ``slot``."""
        for target, t in zip(self.tensors(slot), tensors):
            target.copy_(t)

    def shift(self, src: int, dst: int, hops: int = 1) -> Pending:
        """Start filling slot ``dst`` with slot ``src`` of the rank ``hops`` before this one
        (this rank's slot ``src`` goes to the rank ``hops`` after it); ``wait()`` returns
        ``tensors(dst)``."""
        works = self._mover.shift(self._flat, self._offsets[src], self._offsets[dst],
                                  self.data.used, hops)
        comm = self._mover.comm
        return comm.pending(works, self.tensors(dst), f"ring shift: send to rank "
                            f"{comm.peer(hops)}, receive from rank {comm.peer(-hops)}")


class Mover:
    """Moves slots between the ranks of ``comm`` (one line of the mesh)."""

    name = ""

    def __init__(self, comm):
        self.comm = comm

    @property
    def kept_bytes(self) -> int:
        """Bytes of buffer kept between calls, outside torch's caching allocator."""
        return 0

    def ring_buffers(self, datas, device) -> list[RingBuffer]:
        """One double-buffered ``RingBuffer`` for each ``RingData``, all in one flat buffer."""
        flat = self.buffer(sum(2 * d.nbytes for d in datas), device)
        buffers, offset = [], 0
        for d in datas:
            buffers.append(RingBuffer(d, flat, offset, self))
            offset += 2 * d.nbytes
        return buffers

    def buffer(self, nbytes: int, device) -> torch.Tensor:
        """A flat byte buffer of at least ``nbytes`` for this call's slots."""
        raise NotImplementedError

    def shift(self, flat: torch.Tensor, src: int, dst: int, nbytes: int, hops: int = 1) -> list:
        """Start moving ``flat[src:src+nbytes]`` to the rank ``hops`` after this one and that
        of the rank ``hops`` before into ``flat[dst:dst+nbytes]``; the works to wait for."""
        raise NotImplementedError


class P2PMover(Mover):
    """Slots in a fresh buffer per call; shifts by batched isend/irecv."""

    name = "p2p"

    def buffer(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def shift(self, flat, src, dst, nbytes, hops=1):
        comm = self.comm
        send, recv = flat[src:src + nbytes], flat[dst:dst + nbytes]
        ops = [dist.P2POp(dist.isend, send, comm.peer(hops), comm.group),
               dist.P2POp(dist.irecv, recv, comm.peer(-hops), comm.group)]
        comm.count(nbytes, nbytes)
        return dist.batch_isend_irecv(ops)


class CopyEngineMover(Mover):
    """Slots in one symmetric-memory buffer kept across calls; shifts pull the previous
    rank's slot with a device-to-device copy on a side stream after a ring barrier."""

    name = "copy_engine"

    def __init__(self, comm):
        super().__init__(comm)
        self._flat = self._handle = None
        self._peers: dict[int, torch.Tensor] = {}  # hops -> the buffer of the rank hops before
        self._stream = None
        self._timeout_ms = int(comm.timeout.total_seconds() * 1000)  # the mesh's timeout

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
        # no neighbour still reads this buffer for an earlier call
        self._handle.barrier(channel=0, timeout_ms=self._timeout_ms)
        return self._flat

    def _peer(self, hops: int) -> torch.Tensor:
        """The buffer of the rank ``hops`` before this one, mapped here (made once)."""
        if hops not in self._peers:
            peer = dist.get_group_rank(self.comm.group, self.comm.peer(-hops))
            self._peers[hops] = self._handle.get_buffer(peer, (self._flat.numel(),), torch.uint8, 0)
        return self._peers[hops]

    def shift(self, flat, src, dst, nbytes, hops=1):
        stream = self._stream
        peer = self._peer(hops)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # after the barrier every rank has finished its work so far, so the source rank's
            # slot src is ready and the rank that read our slot dst has read it
            self._handle.barrier(channel=0, timeout_ms=self._timeout_ms)
            flat[dst:dst + nbytes].copy_(peer[src:src + nbytes])
            event = torch.cuda.Event()
            event.record(stream)
        self.comm.count(nbytes, nbytes)
        return [_StreamEvent(event)]


def mover(comm, transport: str, device: torch.device) -> Mover:
    """The mover of ``transport`` for ring shifts over ``comm`` on ``device`` (``auto``
    resolved); a ValueError when copy_engine cannot run there."""
    if check_transport(transport) == "p2p":
        return P2PMover(comm)
    usable, why = _copy_engine_usable(device, comm.group)
    if transport == "copy_engine" and not usable:
        raise ValueError(f"transport='copy_engine' cannot run here: {why}; use transport='p2p'")
    return CopyEngineMover(comm) if usable else P2PMover(comm)


def _copy_engine_usable(device: torch.device, group) -> tuple[bool, str]:
    """(usable, why not). Every rank of ``group`` calls it alike: the last check gathers the
    ranks' host names over the group."""
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
        return False, f"its ranks are on {len(set(hosts))} hosts and copy engines reach only this one"
    return True, ""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
