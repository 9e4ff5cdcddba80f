"""What a schedule's call allocates and does, from a dry run of its own code.

    memory = dry_run.memory(schedule, spec)     # spec: the global problem; this rank's bytes
    d = dry_run.describe(schedule, spec)        # its kernel calls, FLOPs, bytes and memory

The schedule runs on meta tensors, through a communicator and a kernel (``WorkspaceKernel``)
that move and compute nothing but allocate what the real ones do; ``Allocations`` counts every
storage, so the peak is that of the code that runs, not of a second model of it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from sdpa_fusion.kernels.base import Kernel, layout_of
from sdpa_fusion.mask import call_pairs
from sdpa_fusion.spec import FORWARD_AND_BACKWARD, AttentionSpec

from .base import Description, Schedule
from .comm import Communicator
from .memory import Memory
from .transport import Mover, P2PMover, Region

META = torch.device("meta")
BACKWARD = FORWARD_AND_BACKWARD - 1  # a backward's matmul FLOPs over its forward's


class Allocations(TorchDispatchMode):
    """Peak bytes of the storages ops allocate while active (views, in-place ops and ``out=``
    reuse their inputs'), and the bytes alive now (a finalizer says when each dies)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._storages: set[int] = set()
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage(), inputs)
        return out

    def _count(self, storage, inputs) -> None:
        key, nbytes = _key(storage), storage.nbytes()
        if nbytes == 0 or key in inputs or key in self._storages:
            return
        with self._lock:
            self._storages.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._storages.discard(key)
            self.live -= nbytes


def _key(t) -> int:
    """The identity of a tensor's (or storage's) storage, meta ones too (no data pointer)."""
    storage = t.untyped_storage() if isinstance(t, torch.Tensor) else t
    return storage._cdata


class WorkspaceKernel(Kernel):
    """Allocates what FlashAttention and cuDNN allocate per call (results; in backward an fp32
    dQ workspace, with GQA fp32 dK and dV as FlashAttention-4 keeps) and computes nothing
    (zeros). ``calls`` and ``flops`` count its calls and their matmul FLOPs."""

    name = "workspace"
    gpu_only = False
    supports_window = True
    native_varlen = True

    def __init__(self):
        self.calls, self.flops = 0, 0.0

    def _forward(self, q, k, v, *, causal, scale, window, dropout, out, lse):
        self._count(q, [(q.shape[2], k.shape[2])] * q.shape[0], causal, window, 1.0)
        return _zeros_like(q), torch.zeros(q.shape[:3], device=q.device)

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale, window, dropout, dq, dk, dv):
        self._count(q, [(q.shape[2], k.shape[2])] * q.shape[0], causal, window, BACKWARD)
        return self._grads((dq, dk, dv), q, k, v)

    def _varlen_forward(self, q, k, v, seqlens, *, causal, scale, window, out=None, lse=None):
        self._count(q, list(zip(seqlens.lengths_q, seqlens.lengths_k)), causal, window, 1.0)
        return (_zeros_like(q) if out is None else out.zero_(),
                torch.zeros(q.shape[1], q.shape[0], device=q.device) if lse is None
                else lse.zero_())

    def _varlen_backward(self, dout, q, k, v, out, lse, seqlens, *, causal, scale, window,
                         dq=None, dk=None, dv=None):
        self._count(q, list(zip(seqlens.lengths_q, seqlens.lengths_k)), causal, window,
                    BACKWARD)
        return self._grads((dq, dk, dv), q, k, v)

    def _count(self, q, lengths, causal, window, times: float) -> None:
        """One call over sequences of (query rows, key rows) ``lengths`` of q's heads."""
        pairs = sum(call_pairs(n_q, n_k, causal, window) for n_q, n_k in lengths)
        self.calls += 1
        self.flops += times * 4.0 * q.shape[1] * q.shape[-1] * pairs

    @staticmethod
    def _grads(given, q, k, v):
        """dq, dk, dv (into ``given`` buffers where there are), beside the workspace."""
        workspace = [torch.empty(q.shape, dtype=torch.float32, device=q.device)]
        if q.shape[1] != k.shape[1]:  # GQA ([B, H, S, E] and packed [T, H, E] alike)
            workspace += [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
        grads = tuple(_zeros_like(t) if g is None else g.zero_() for g, t in zip(given, (q, k, v)))
        del workspace
        return grads


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 3:  # packed [T, H, E]
        return torch.zeros_like(t)
    return layout_of(t).empty(t.shape, dtype=t.dtype, device=t.device).zero_()


class _Done:
    """A transfer that has landed; ``wait`` lets go of what it read."""

    def __init__(self, keeps=()):
        self.keeps = keeps

    def wait(self, *timeout) -> None:
        self.keeps = ()


class DryComm(Communicator):
    """A communicator whose collectives allocate their results and count their bytes only."""

    def __init__(self, index: int, size: int):
        self.group, self.ranks, self.index, self.size = None, list(range(size)), index, size
        self.timeout, self._arrivals, self._watch = None, None, None
        self._count_from_zero()

    def line(self, first: int, size: int) -> "DryComm":
        part = DryComm(self.index - first, size)
        part.whole = self
        return part

    def _start(self, collective, out, t) -> _Done:
        return _Done((t,))

    def pairwise(self, sends, receives) -> list:
        return [_Done([t for t, _ in sends])] if sends or receives else []

    def wait(self, work, what: str, step: int) -> None:
        work.wait()


class DryP2PMover(P2PMover):
    """p2p's slots and the copies it sends, held until waited for; nothing moves."""

    def over(self, comm) -> "DryP2PMover":
        return DryP2PMover(comm)


class DryCopyEngineMover(Mover):
    """The copy-engine transport's one receive buffer, uncounted (``kept_bytes``); nothing moves."""

    name = "copy_engine"

    def __init__(self, comm):
        super().__init__(comm)
        self._kept = 0

    @property
    def kept_bytes(self) -> int:
        return self._kept

    def buffer(self, nbytes, device):
        self.reserve(nbytes, device)
        return _uncounted(nbytes, device)

    def reserve(self, nbytes, device):
        self._kept = max(self._kept, nbytes)

    def region(self, base, nbytes, device):
        return Region(_uncounted(nbytes, device), base)

    over = DryP2PMover.over

    def push(self, tensors, ring, slot, hops=1):
        self.comm.count(ring.data.used, ring.data.used)
        return []

    def _exchange(self, puts, takes, region):
        for p in puts:
            p.bytes()  # a contiguous source when the piece is not one
        return []


def _uncounted(nbytes: int, device) -> torch.Tensor:
    """A byte buffer outside ``Allocations``' count (the kept symmetric buffer)."""
    with _disable_current_modes():
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def memory_of(schedule: Schedule, spec: AttentionSpec) -> Callable[[], Memory]:
    """``memory(schedule, spec)``, computed when a ``Description`` is asked for its memory."""
    return functools.partial(memory, schedule, spec)


def memory(schedule: Schedule, spec: AttentionSpec) -> Memory:
    """What ``schedule`` allocates on this rank for a forward and backward on global ``spec``."""
    return run(schedule, spec)[2]


def describe(schedule: Schedule, spec: AttentionSpec) -> Description:
    """``schedule``'s ``Description`` for the global ``spec`` from a dry run of its code."""
    forward, backward, used = run(schedule, spec)
    return Description(
        schedule.name, schedule.size, steps=forward.calls, bytes_sent=forward.sent,
        bytes_received=forward.received, flops=forward.flops, backward_steps=backward.calls,
        backward_bytes_sent=backward.sent, backward_bytes_received=backward.received,
        backward_flops=backward.flops, notes="from a dry run of the schedule",
        memory_of=lambda: used)


@dataclasses.dataclass(frozen=True)
class Counts:
    """Kernel calls, FLOPs and bytes sent and received by a forward or backward."""

    calls: int
    flops: float
    sent: int
    received: int

    def __sub__(self, other: "Counts") -> "Counts":
        return Counts(*(getattr(self, f.name) - getattr(other, f.name)
                        for f in dataclasses.fields(self)))


def run(schedule: Schedule, spec: AttentionSpec) -> tuple[Counts, Counts, Memory]:
    """(forward, backward, memory) of a dry run of ``schedule`` on the global ``spec``."""
    done: dict = {}
    dry = _dry(schedule, done)
    local, (q, k, v, dout) = local_problem(dry, spec)
    kernel = WorkspaceKernel()

    def so_far() -> Counts:
        stats = [c.__dict__["comm"].stats for c in done.values() if "comm" in c.__dict__]
        return Counts(kernel.calls, kernel.flops, sum(s.bytes_sent for s in stats),
                      sum(s.bytes_received for s in stats))

    kept = {"kept": {}} if dry.keeps_forward else {}
    with torch.no_grad():
        with Allocations() as allocated:
            out, lse = dry.forward(q, k, v, local, kernel, **kept)
        forward = so_far()
        outputs = _bytes(out) + _bytes(lse) + sum(map(_bytes, _tensors(kept)))
        forward_peak = allocated.peak - outputs
        with Allocations() as allocated:
            grads = dry.backward(dout, q, k, v, out, lse, local, kernel, **kept)
            del grads
        backward = so_far() - forward
    return forward, backward, Memory(outputs, forward_peak, allocated.peak,
                                     getattr(dry, "kept_bytes", 0))


def _bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _tensors(kept) -> list[torch.Tensor]:
    """The tensors of what a forward kept (dicts and lists of them, nested)."""
    if isinstance(kept, torch.Tensor):
        return [kept]
    parts = kept.values() if isinstance(kept, dict) else kept
    return [t for part in parts for t in _tensors(part)]


def _dry(schedule, done: dict):
    """A copy of ``schedule`` (and of the schedules it holds) whose transfers are dry."""
    if id(schedule) in done:
        return done[id(schedule)]
    dry = done[id(schedule)] = schedule.copy_without_caches()
    for name, value in list(vars(dry).items()):
        if isinstance(value, Schedule):
            setattr(dry, name, _dry(value, done))
    if schedule.mesh is not None and schedule.dim is not None:
        comm = dry.__dict__["comm"] = DryComm(schedule.index, schedule.size)
        if hasattr(dry, "_movers"):
            mover = DryCopyEngineMover if schedule.keeps_buffers() else DryP2PMover
            dry._movers = {META: mover(comm)}
    return dry


def local_problem(schedule, spec: AttentionSpec):
    """(local spec, this rank's meta q, k, v and dout) of the global ``spec``: the shards of
    data-less full tensors, as ``attention`` would see them on this rank."""
    layout, e = spec.layout, spec.head_dim
    packing = schedule.pack(spec.cu_seqlens, spec.cu_seqlens_padded, device="cpu") \
        if layout.is_varlen else None

    def full(heads, length):
        if layout.is_varlen:
            t = torch.empty(length, heads, e, dtype=spec.dtype, device=META)
        else:
            t = layout.empty((spec.batch, heads, length, e), dtype=spec.dtype, device=META)
        return schedule.shard(t, layout=layout, cu_seqlens=packing)

    q, dout = full(spec.heads, spec.q_len), full(spec.heads, spec.q_len)
    k, v = full(spec.kv_heads, spec.kv_len), full(spec.kv_heads, spec.kv_len)
    cu = packing and (packing.cu_seqlens, packing.cu_seqlens_padded)
    local = AttentionSpec.from_tensors(
        q, k, v, layout=layout, causal=spec.causal, scale=spec.scale, window=spec.window,
        **(dict(zip(("cu_seqlens", "cu_seqlens_padded"), cu)) if cu else {}),
    ).replace(packing=packing, mask=spec.mask)
    return local, (q, k, v, dout)
