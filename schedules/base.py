"""The Schedule contract: how one attention problem is spread over a mesh dim.

A schedule sees the *local* tensors of its rank. ``validate`` checks the local spec (pure,
so that every rank, given every rank's spec, raises the same error); ``forward`` and
``backward`` run the local kernel and the communication; ``shard``/``unshard`` move between
full and local tensors; ``describe`` reports what one call costs each rank.
"""

from __future__ import annotations

import abc
import dataclasses
import functools

import torch
import torch.distributed as dist

from sdpa_fusion.kernels import Dropout, Kernel
from sdpa_fusion.layout import Layout
from sdpa_fusion.mesh import Mesh
from sdpa_fusion.spec import AttentionSpec

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
    memory: Memory | None = None  # bytes the call allocates on each rank (sequence schedules)


class Schedule(abc.ABC):
    """Base of all schedules; subclasses set ``name`` and ``sharded_dim`` (logical dim)."""

    name: str = ""
    sharded_dim: int | None = None  # logical dim of q/k/v split over the mesh (None: replicated)
    supports_thd: bool = False  # takes packed layout='thd' tensors on more than one rank
    takes_dtensors: bool = True  # False: attention() refuses DTensor inputs

    def __init__(self, mesh: Mesh | None, *, dim: str | None = None):
        self.mesh = mesh
        self.agreed: set[AttentionSpec] = set()  # local problems all ranks have checked
        if mesh is not None:
            self.dim = dim or mesh.names[-1 if self.sharded_dim != 1 else 0]
            mesh.size(self.dim)  # a clear error for an unknown dim name
        else:
            self.dim = dim

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
        return Communicator(self.group, self.mesh.ranks(self.dim), self.index)

    # ---- the contract --------------------------------------------------------------------
    def global_spec(self, spec: AttentionSpec) -> AttentionSpec:
        """The spec of the full problem whose local part on this rank is ``spec``."""
        return spec

    def validate(self, spec: AttentionSpec) -> None:
        """Raise ValueError (argument and fix) when this schedule cannot run local ``spec``."""
        if spec.layout.is_varlen and self.size > 1 and not self.supports_thd:
            raise ValueError(
                f"schedule {self.name!r} does not take layout='thd' yet; use 'bshe' (pad "
                f"sequences to one length) or run packed sequences with schedule=None"
            )
        if spec.dropout_p > 0 and self.size > 1:
            raise ValueError(
                f"dropout_p={spec.dropout_p} is not supported under the multidevice schedule "
                f"{self.name!r} (shards would draw the same random mask); use dropout_p=0"
            )

    @abc.abstractmethod
    def forward(self, q, k, v, spec: AttentionSpec, kernel: Kernel, dropout: Dropout | None = None):
        """(out, lse) of the local queries; lse fp32 [B, H, S_local]."""

    @abc.abstractmethod
    def backward(self, dout, q, k, v, out, lse, spec: AttentionSpec, kernel: Kernel,
                 dropout: Dropout | None = None):
        """(dq, dk, dv) of the local shards."""

    @abc.abstractmethod
    def describe(self, spec: AttentionSpec) -> Description:
        """Steps, bytes and FLOPs per rank for the *global* ``spec``."""

    def local_packing(self, q, cu_seqlens, cu_seqlens_padded=None):
        """The ``LocalPacking`` of packed tensors under a schedule that splits tokens; None
        here: the local tensors keep every token and ``cu_seqlens`` is taken as given."""
        if isinstance(cu_seqlens, LocalPacking):
            raise ValueError(
                f"cu_seqlens is a LocalPacking, but schedule {self.name!r} does not split tokens; "
                f"pass the global cu_seqlens tensor"
            )
        return None

    def shard(self, t: torch.Tensor, *, layout: Layout | str = Layout.BHSE, cu_seqlens=None,
              cu_seqlens_padded=None) -> torch.Tensor:
        """This rank's part of a full tensor, in ``layout`` (differentiable); packed tensors
        (``layout='thd'``) take the global ``cu_seqlens`` (and ``cu_seqlens_padded``)."""
        layout = Layout.of(layout)
        if self.sharded_dim is None or self.size == 1:
            return layout.to(t)
        _check_divisible(t, self.sharded_dim, self.size, self.name)
        return layout.to(t.chunk(self.size, dim=self.sharded_dim)[self.index])

    def unshard(self, t: torch.Tensor, *, layout: Layout | str = Layout.BHSE, cu_seqlens=None,
                cu_seqlens_padded=None) -> torch.Tensor:
        """The full tensor (same on every rank) from every rank's local part; differentiable,
        the gradient of the full tensor flowing back to this rank's part."""
        layout = Layout.of(layout)
        if self.sharded_dim is None or self.size == 1:
            return layout.to(t)
        full = gather_cat(t, self.sharded_dim, self.group, self.size, self.index)
        return layout.to(full)

    def __repr__(self) -> str:
        where = f"{self.dim}={self.size}" if self.mesh is not None else "one device"
        return f"<schedule {self.name} over {where}>"


def _check_divisible(t: torch.Tensor, dim: int, parts: int, name: str) -> None:
    what = {1: "heads", 2: "sequence length"}.get(dim, f"dim {dim}")
    if t.shape[dim] % parts:
        raise ValueError(
            f"{what} {t.shape[dim]} must be divisible by the {parts} ranks of schedule "
            f"{name!r}; pad it to a multiple of {parts}"
        )


class _GatherCat(torch.autograd.Function):
    """All ranks' parts concatenated along ``dim``. The result is replicated: each rank's
    copy stands for the one full tensor, so its gradient flows back to this rank's own part
    only (as DTensor's Shard -> Replicate does), with no communication."""

    @staticmethod
    def forward(ctx, t, dim: int, group, size: int, index: int):
        parts = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        ctx.dim, ctx.size, ctx.index = dim, size, index
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.index], None, None, None, None


def gather_cat(t: torch.Tensor, dim: int, group, size: int, index: int) -> torch.Tensor:
    """Every rank's ``t`` (same shape on all ranks) concatenated along ``dim`` in group
    order; differentiable (see ``_GatherCat``)."""
    return _GatherCat.apply(t, dim, group, size, index)
