"""The Schedule contract: how one attention problem is spread over a mesh dim.

A schedule sees the *local* tensors of its rank: ``forward`` and ``backward`` run the local
kernel and the communication, ``shard``/``unshard`` move between full and local tensors.
``describe``, ``validate``, ``shard`` and ``repr`` never communicate. The ranks of the
``control`` group agree on every call on the global problem and on ``configuration()``, the
public attributes, fixed when the schedule is built; keep caches in ``_private`` attributes.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from sdpa_fusion.agreement import agree, canonical
from sdpa_fusion.kernels import Dropout, Kernel, spec_extent
from sdpa_fusion.layout import Layout, shard_layout, unshard_layout
from sdpa_fusion.mesh import Mesh
from sdpa_fusion.spec import AttentionSpec
from sdpa_fusion.waiting import MeshTimeout

from .comm import Communicator
from .memory import Memory
from .packing import LocalPacking


@dataclasses.dataclass(frozen=True)
class Description:
    """What one forward (and backward) of a schedule costs each rank."""

    schedule: str
    ranks: int
    steps: int
    bytes_sent: int
    bytes_received: int
    flops: float
    backward_steps: int = 0
    backward_bytes_sent: int = 0
    backward_bytes_received: int = 0
    backward_flops: float = 0.0
    notes: str = ""
    memory_of: Callable[[], Memory] | None = dataclasses.field(default=None, compare=False,
                                                               repr=False)

    @functools.cached_property
    def memory(self) -> Memory | None:
        """Bytes the call allocates on each rank (``schedules.dry_run``); None when not said."""
        return None if self.memory_of is None else self.memory_of()


DESCRIBED = ("steps", "backward_steps", "bytes_sent", "bytes_received", "backward_bytes_sent",
             "backward_bytes_received", "flops", "backward_flops")  # a Description's numbers


class Schedule(abc.ABC):
    """Base of all schedules; subclasses set ``name`` and ``sharded_dim`` (logical dim)."""

    name: str = ""
    sharded_dim: int | None = None  # logical dim of q/k/v split over the mesh (None: replicated)
    supports_thd: bool = False  # takes packed layout='thd' tensors on more than one rank
    takes_dtensors: bool = True  # False: attention() refuses DTensor inputs
    # True: forward(..., kept={}) leaves there what backward(..., kept=) reuses, not sent again
    keeps_forward: bool = False

    def __init__(self, mesh: Mesh | None, *, dim: str | None = None):
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ValueError(f"mesh={mesh!r} must be a sdpa_fusion.Mesh (from "
                             f"sdpa_fusion.init_mesh) or None")
        self.mesh = mesh
        self._contiguous: dict[int, bool] = {}  # per length: does shard() cut contiguous chunks?
        if mesh is not None:
            self.dim = dim or mesh.names[-1 if self.sharded_dim != 1 else 0]
            mesh.size(self.dim)  # a clear error for an unknown dim name
        else:
            self.dim = dim

    def copy_without_caches(self) -> "Schedule":
        """A shallow copy without what is made per object (configuration fields, kept plans)."""
        other = copy.copy(self)
        for name in ("_configuration_fields", "_kept_plans", "_twins"):
            other.__dict__.pop(name, None)
        return other

    @property
    def kept_plans(self) -> collections.OrderedDict:
        """The plans of recent ``attention`` calls (``sdpa_fusion.api``'s cache)."""
        return self.__dict__.setdefault("_kept_plans", collections.OrderedDict())

    # ---- mesh helpers --------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.mesh.size(self.dim) if self.mesh is not None else 1

    @property
    def index(self) -> int:
        return self.mesh.coordinate(self.dim) if self.mesh is not None else 0

    @property
    def group(self):
        return self.mesh.group(self.dim)

    @functools.cached_property
    def comm(self) -> Communicator:
        """The communicator over this schedule's mesh dim (counts the bytes it moves)."""
        return Communicator(self.group, self.mesh.ranks(self.dim), self.index,
                            timeout=self.mesh.timeout)

    @property
    def control(self):
        """The control group of the ranks that run each call together (None without a mesh)."""
        return self.mesh.control_group(self.dim) if self.mesh is not None else None

    def configuration(self) -> dict:
        """What every rank must have alike: name, mesh and options (public attributes)."""
        options = {k: v for k, v in vars(self).items()
                   if not k.startswith("_") and k not in ("mesh", "comm")}
        return {"schedule": self.name, "mesh": self.mesh, **options}

    def configuration_fields(self) -> dict[str, str]:
        """``configuration()`` as canonical text per entry, made once (options are fixed)."""
        return self._configuration_fields

    @functools.cached_property
    def _configuration_fields(self) -> dict[str, str]:
        return {name if name == "schedule" else f"schedule.{name}": canonical(value)
                for name, value in self.configuration().items()}

    @contextlib.contextmanager
    def running(self, what: str):
        """Name ``what`` (e.g. "forward of call 3") in the timeouts of the transfers inside."""
        if self.mesh is None or self.dim is None:
            yield
            return
        with self.comm.running(f"schedule {self.name!r} over {self.dim}={self.size}, {what}"):
            yield

    def placements(self, shape) -> list:
        """The DTensor placements (one per mesh dim) of this rank's shards of a tensor of global
        ``shape``; a ValueError when none describes them."""
        from torch.distributed.tensor import Replicate, Shard

        placements = [Replicate()] * len(self.mesh.names)
        if self.sharded_dim is None or self.size == 1:
            return placements
        length = shape[self.sharded_dim] if len(shape) > self.sharded_dim else 1
        if length not in self._contiguous:
            probe = torch.arange(length).view([length if d == self.sharded_dim else 1 for d in range(4)])
            mine = self.shard(probe).flatten()
            self._contiguous[length] = torch.equal(mine, probe.flatten().chunk(self.size)[self.index])
        if not self._contiguous[length]:
            raise ValueError(f"schedule {self.name!r} holds a partition of dim {self.sharded_dim} "
                             f"that is not contiguous chunks, which is what the DTensor placement "
                             f"Shard({self.sharded_dim}) means; build the schedule with "
                             f"partition='contiguous' to take Shard({self.sharded_dim}) DTensors, "
                             f"or pass plain tensors from schedule.shard(...)")
        placements[self.mesh.names.index(self.dim)] = Shard(self.sharded_dim)
        return placements

    # ---- the contract --------------------------------------------------------------------
    def global_spec(self, spec: AttentionSpec) -> AttentionSpec:
        """The spec of the full problem whose local part on this rank is ``spec``."""
        return spec

    def call_extent(self, spec: AttentionSpec) -> tuple[int, int]:
        """(rows, keys) per head of this rank's largest kernel call (here the whole problem's)."""
        return spec_extent(self.global_spec(spec))

    def kernel_calls(self, spec: AttentionSpec) -> int:
        """Kernel calls this rank makes for the local ``spec`` in a forward."""
        return 1

    def validate(self, spec: AttentionSpec) -> None:
        """Raise ValueError (argument and fix) when this schedule cannot run local ``spec``."""
        if spec.layout.is_varlen and self.size > 1 and not self.supports_thd:
            raise ValueError(f"schedule {self.name!r} does not take layout='thd' yet; use 'bshe' "
                             f"(pad sequences to one length) or run packed sequences with "
                             f"schedule=None")

    @abc.abstractmethod
    def forward(self, q, k, v, spec: AttentionSpec, kernel: Kernel, dropout: Dropout | None = None):
        """(out, lse) of the local queries; lse fp32 [B, H, S_local]."""

    @abc.abstractmethod
    def backward(self, dout, q, k, v, out, lse, spec: AttentionSpec, kernel: Kernel,
                 dropout: Dropout | None = None):
        """(dq, dk, dv) of the local shards."""

    def backward_reads_inputs(self, spec: AttentionSpec) -> bool:
        """Whether a backward given what its forward kept (``keeps_forward``) still reads the
        local q, k, v and out of ``spec``; where not, ``attention`` holds their shapes alone
        and hands the backward its gradients' buffers in their place."""
        return True

    @abc.abstractmethod
    def describe(self, spec: AttentionSpec) -> Description:
        """Steps, bytes and FLOPs per rank for the *global* ``spec``."""

    def check_shards(self, q, k, v) -> None:
        """Raise ValueError (argument and fix) when local q, k, v cannot be this rank's shards."""

    def local_packing(self, q, cu_seqlens, cu_seqlens_padded=None):
        """The ``LocalPacking`` of packed tensors; None here: every rank keeps every token."""
        if isinstance(cu_seqlens, LocalPacking):
            raise ValueError(f"cu_seqlens is a LocalPacking, but schedule {self.name!r} does not "
                             f"split tokens; pass the global cu_seqlens tensor")
        return None

    def shard(self, t: torch.Tensor, *, layout: Layout | str = "auto", cu_seqlens=None,
              cu_seqlens_padded=None) -> torch.Tensor:
        """This rank's part of a full tensor, in ``layout`` (differentiable)."""
        layout = shard_layout(t, layout)
        if self.sharded_dim is None or self.size == 1:
            return layout.to(t)
        _check_divisible(t, self.sharded_dim, self.size, self.name)
        return layout.to(t.chunk(self.size, dim=self.sharded_dim)[self.index])

    def unshard(self, t: torch.Tensor, *, layout: Layout | str = "auto", cu_seqlens=None,
                cu_seqlens_padded=None) -> torch.Tensor:
        """The full tensor (same on every rank) from every rank's local part; differentiable."""
        layout = unshard_layout(t, layout)
        if self.sharded_dim is None or self.size == 1:
            return layout.to(t)
        return layout.to(self.gather(t, self.sharded_dim))

    def gather(self, t: torch.Tensor, dim: int, *, error: Exception | None = None,
               alike: dict[str, str] | None = None) -> torch.Tensor:
        """Every rank's part ``t`` concatenated along ``dim`` in mesh order, once the ranks
        agree on its shape, dtype, device type and ``alike``, and none had an ``error`` (else a
        ValueError on every rank); differentiable (``_GatherCat``)."""
        fields = None
        if not isinstance(t, torch.Tensor):
            error = error or ValueError(f"unshard takes a torch.Tensor, got {type(t).__name__}")
        elif error is None:
            fields = {"shape": str(list(t.shape)), "dtype": str(t.dtype), "device": t.device.type,
                      **(alike or {})}
        agree(self.control, fields, error, what="unshard",
              fix="unshard on every rank this rank's part of one tensor (e.g. the output of "
                  "attention with this schedule)")
        return _GatherCat.apply(t, dim, self.group, self.size, self.index)

    # ---- a model's batch (schedules.batch) ------------------------------------------------
    @property
    def token_splits(self) -> tuple:
        """The sequence schedules that split a batch's tokens over the ranks, inner first."""
        return ()

    @property
    def head_split(self):
        """The ``head_parallel`` schedule that splits a model's heads over the ranks, or None."""
        return None

    def __repr__(self) -> str:
        where = f"{self.dim}={self.size}" if self.mesh is not None else "one device"
        return f"<schedule {self.name} over {where}>"


def _check_divisible(t: torch.Tensor, dim: int, parts: int, name: str) -> None:
    what = {1: "heads", 2: "sequence length"}.get(dim, f"dim {dim}")
    if t.shape[dim] % parts:
        raise ValueError(f"{what} {t.shape[dim]} must be divisible by the {parts} ranks of "
                         f"schedule {name!r}; pad it to a multiple of {parts}")


class _GatherCat(torch.autograd.Function):
    """All ranks' parts concatenated along ``dim``; the replicated result's gradient flows back
    to this rank's own part only (as DTensor's Shard -> Replicate), with no communication."""

    @staticmethod
    def forward(ctx, t, dim: int, group, size: int, index: int):
        parts = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(size)]
        work = dist.all_gather(parts, t.contiguous(), group=group, async_op=True)
        try:
            work.wait()
        except RuntimeError as e:
            raise MeshTimeout(f"the all-gather of unshard did not complete: {e}") from e
        ctx.dim, ctx.size, ctx.index = dim, size, index
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.index], None, None, None, None

