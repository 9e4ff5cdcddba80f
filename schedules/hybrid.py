"""``hybrid``: attention on a 2-D mesh, heads split across one dim and the sequence across the
other (USP's unified sequence parallelism, TransformerEngine's ``a2a+p2p``, LoongTrain's 2-D
attention).

    mesh = sdpa_fusion.init_mesh((2, 4), ("heads", "seq"))
    sched = schedules.get("hybrid", mesh, inner="ulysses", outer="ring")   # the defaults

The *outer* dim (``outer_dim``, by default the mesh's second) splits the sequence with the
outer schedule (``ring`` or ``allgather``, its ``partition`` and other options); the *inner*
dim (``inner_dim``, by default the mesh's first) splits the heads with the inner schedule.
Seen from the inner schedule, the outer schedule over this rank's line of the outer dim is
the local kernel, so the hybrid is the two 1-D schedules composed:

    inner="ulysses"        rank (i, o) holds S/(Pi Po) tokens of all H heads
        [B, H, S/(Pi Po), E]  --all-to-all over the inner line-->  [B, H/Pi, S/Po, E]
        --outer schedule over the outer line-->  out [B, H/Pi, S/Po, E]
        --all-to-all back-->  out [B, H, S/(Pi Po), E]
    inner="head_parallel"  rank (i, o) holds [B, H/Pi, S/Po, E]: the outer schedule runs on
        its heads, no inner communication; with kernel="nvfuser" the fusions carry the head
        split as an nvFuser DID annotation on the inner dim (``Kernel.split_heads``)

Either way the outer ring moves K/V blocks of H_kv/Pi heads: its bytes per step shrink by
the inner size. Tokens: outer rank o holds ``partition.indices(S, Po, o)``; with ulysses,
inner rank i holds the i-th contiguous 1/Pi of them. S = 16, 2 x 2, load_balanced:

    outer rank 0: tokens 0-3, 12-15    ulysses: (i=0, o=0) 0-3    (i=1, o=0) 12-15
    outer rank 1: tokens 4-7, 8-11              (i=0, o=1) 4-7    (i=1, o=1) 8-11

K/V with fewer heads than inner ranks (GQA): ulysses replicates them inside its all-to-all;
head_parallel gives every inner rank a copy of the K/V head its query heads use, whose
gradient is that rank's share (``unshard(..., heads=, copies="sum")`` adds the shares).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from sdpa_fusion.kernels import Kernel
from sdpa_fusion.layout import Layout, shard_layout, unshard_layout

from .allgather import AllGather
from .base import Description, Schedule
from .head_parallel import HeadParallel, fold_copies, heads_of
from .ring import Ring
from .ulysses import Ulysses

INNER = {"ulysses": Ulysses, "head_parallel": HeadParallel}
OUTER = {"ring": Ring, "allgather": AllGather}


@dataclasses.dataclass(frozen=True)
class DimCost:
    """What one mesh dim of the hybrid costs each rank: its schedule's description for the
    problem of one line of that dim."""

    dim: str
    description: Description

    @property
    def memory(self) -> int:
        """Bytes the dim's schedule holds at the peak of its forward beyond its outputs, kept
        buffers included (``Description.memory``; 0 for a schedule without buffers)."""
        m = self.description.memory
        return 0 if m is None else m.kept + m.forward

    @property
    def backward_memory(self) -> int:
        """The same at the peak of its backward (its gradients included)."""
        m = self.description.memory
        return 0 if m is None else m.kept + m.backward


@dataclasses.dataclass(frozen=True)
class HybridDescription(Description):
    """A ``Description`` of the whole step plus one ``DimCost`` per mesh dim (inner first)."""

    dims: tuple[DimCost, ...] = ()


class _OuterKernel(Kernel):
    """The outer schedule over this rank's outer line, as the local kernel of the inner one.
    ``spec`` is the hybrid's local spec; each call's shapes come from its tensors."""

    name = "outer"

    def __init__(self, outer: Schedule, kernel: Kernel, spec):
        self.outer, self.kernel, self.spec = outer, kernel, spec

    def split_heads(self, mesh, dim: str) -> "_OuterKernel":
        return _OuterKernel(self.outer, self.kernel.split_heads(mesh, dim), self.spec)

    def _local(self, q, k):
        layout = self.spec.layout
        return self.spec.replace(
            heads=q.shape[layout.head_dim], kv_heads=k.shape[layout.head_dim],
            q_len=q.shape[layout.seq_dim], kv_len=k.shape[layout.seq_dim],
        )

    def forward(self, q, k, v, *, causal, scale, dropout=None, window=None):
        return self.outer.forward(q, k, v, self._local(q, k), self.kernel, dropout)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, dropout=None, window=None):
        return self.outer.backward(dout, q, k, v, out, lse, self._local(q, k), self.kernel,
                                   dropout)


class Hybrid(Schedule):
    """``inner`` ("ulysses" | "head_parallel") over ``inner_dim`` composed with ``outer``
    ("ring" | "allgather", with ``partition`` and the other ``outer_options``) over
    ``outer_dim``. A mesh or option that cannot work is reported by ``validate`` (and by
    ``shard``, ``unshard``, ``describe``), so ``attention`` raises it on every rank."""

    name = "hybrid"
    takes_dtensors = False

    def __init__(self, mesh, *, inner: str = "ulysses", outer: str = "ring",
                 inner_dim: str | None = None, outer_dim: str | None = None,
                 partition="load_balanced", **outer_options):
        super().__init__(mesh)
        self.dim = None  # two dims: self.inner.dim and self.outer.dim
        self._inner = self._outer = None
        try:
            self._inner, self._outer = _compose(mesh, inner, outer, inner_dim, outer_dim,
                                                dict(outer_options, partition=partition))
            self._error = None
        except ValueError as e:
            self._error = str(e)

    # ---- the two schedules -----------------------------------------------------------------
    @property
    def inner(self) -> Schedule:
        """The schedule over the inner dim (a ValueError when the configuration is bad)."""
        self._check_configuration()
        return self._inner

    @property
    def outer(self) -> Schedule:
        """The schedule over the outer dim (a ValueError when the configuration is bad)."""
        self._check_configuration()
        return self._outer

    def _check_configuration(self) -> None:
        if self._error is not None:
            raise ValueError(self._error)

    def configuration(self) -> dict:
        return {**super().configuration(), "inner": self._inner, "outer": self._outer,
                "error": self._error}

    @contextlib.contextmanager
    def running(self, what: str):
        with self.inner.running(f"hybrid, {what}"), self.outer.running(f"hybrid, {what}"):
            yield

    @property
    def size(self) -> int:
        return self.inner.size * self.outer.size

    @property
    def partition(self):
        """The outer schedule's token partition (the sequence split across the outer dim)."""
        return self.outer.partition

    @property
    def splits_heads(self) -> bool:
        """Whether the local tensors hold a head shard (inner head_parallel), not all heads."""
        return self.inner.sharded_dim == 1

    @property
    def kept_bytes(self) -> int:
        """Bytes the outer schedule keeps between calls (the ring's symmetric memory)."""
        return getattr(self.outer, "kept_bytes", 0)

    # ---- the contract ----------------------------------------------------------------------
    def global_spec(self, spec):
        return self.outer.global_spec(self.inner.global_spec(spec))

    def validate(self, spec):
        self._check_configuration()
        if spec.layout.is_varlen:
            raise ValueError(
                "schedule 'hybrid' does not take layout='thd' yet; use 'bshe' (pad sequences "
                "to one length) or run packed sequences under a 1-D schedule"
            )
        for role, sched, local in (("inner", self.inner, spec),
                                   ("outer", self.outer, self._outer_spec(spec))):
            try:
                sched.validate(local)
            except ValueError as e:
                raise ValueError(f"schedule 'hybrid', {role} dim {sched.dim!r} ({sched.name} "
                                 f"over {sched.size} ranks): {e}") from e

    def _outer_spec(self, spec):
        """The local spec the outer schedule sees, from the hybrid's local ``spec``."""
        if self.splits_heads:
            return spec
        p = self.inner.size
        return spec.replace(heads=spec.heads // p, kv_heads=max(spec.kv_heads // p, 1),
                            q_len=spec.q_len * p, kv_len=spec.kv_len * p)

    def forward(self, q, k, v, spec, kernel, dropout=None):
        return self.inner.forward(q, k, v, spec, _OuterKernel(self.outer, kernel, spec), dropout)

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        return self.inner.backward(dout, q, k, v, out, lse, spec,
                                   _OuterKernel(self.outer, kernel, spec), dropout)

    # ---- full tensors ----------------------------------------------------------------------
    def indices(self, seq_len: int) -> torch.Tensor:
        """Global positions of the tokens this rank holds, in local order."""
        self._check_sequence(seq_len)
        tokens = self.outer.indices(seq_len)
        if self.splits_heads:
            return tokens
        return tokens[self.inner.indices(len(tokens))]

    def _check_sequence(self, seq_len: int) -> None:
        outer, inner = self.outer, self.inner
        outer.partition.check(seq_len, outer.size)
        line = seq_len // outer.size
        if not self.splits_heads and line % inner.size:
            multiple = math.lcm(outer.partition.multiple(outer.size), outer.size * inner.size)
            raise ValueError(
                f"sequence length {seq_len} gives each of the {outer.size} ranks of outer dim "
                f"{outer.dim!r} {line} tokens, which must be divisible by the {inner.size} ranks "
                f"of inner dim {inner.dim!r} (ulysses); pad the sequence to a multiple of "
                f"{multiple}"
            )

    def shard(self, t: torch.Tensor, *, layout: Layout | str = "auto") -> torch.Tensor:
        """This rank's tokens (and, with inner head_parallel, heads) of a full tensor. A
        tensor with fewer heads than inner ranks (K/V of GQA) gives each rank a copy of the
        head its query heads use."""
        layout = shard_layout(t, layout)
        if layout.is_varlen:
            raise ValueError("schedule 'hybrid' does not shard layout='thd' yet; use 'bshe'")
        local = t.index_select(2, self.indices(t.shape[2]).to(t.device))
        return layout.to(self._heads_of(local) if self.splits_heads else local)

    def _heads_of(self, t: torch.Tensor) -> torch.Tensor:
        """This inner rank's heads of ``t`` (a copy of one head when ``t`` has fewer heads
        than the inner ranks)."""
        return heads_of(t, self.inner.size, self.inner.index, self._inner_where)

    @property
    def _inner_where(self) -> str:
        return f"inner dim {self.inner.dim!r}"

    @property
    def token_splits(self) -> tuple:
        return self.outer.token_splits if self.splits_heads else (self.inner, self.outer)

    @property
    def head_split(self):
        return self.inner if self.splits_heads else None

    def unshard(self, t: torch.Tensor, *, layout: Layout | str = "auto",
                heads: int | None = None, copies: str | None = None) -> torch.Tensor:
        """The full tensor (same on every rank) from every rank's part; differentiable.

        ``heads`` < inner ranks (K/V of GQA under inner head_parallel): ``t`` is a copy of
        one of ``heads`` heads; ``copies="sum"`` adds the copies (gradients: each is its
        ranks' share), ``copies="first"`` takes one (values: the copies are equal)."""
        layout = unshard_layout(t, layout)
        line = self.inner.unshard(t, layout=layout)
        if heads is not None and heads != line.shape[1]:
            if not self.splits_heads:
                raise ValueError(
                    f"heads={heads} does not match the {line.shape[1]} heads of the tensor; "
                    f"leave heads out (only K/V copies under inner='head_parallel' need it)")
            line = fold_copies(line, heads, copies, self._inner_where)
        return self.outer.unshard(line, layout=layout)

    # ---- costs -----------------------------------------------------------------------------
    def describe(self, spec):
        """Steps, bytes and FLOPs per rank for the global ``spec``, with one ``DimCost`` per
        dim: the inner schedule for one inner line's problem (all heads, the S/Po tokens of
        an outer rank), the outer one for the heads of one inner rank (all tokens)."""
        inner, outer = self.inner, self.outer
        line = spec.replace(q_len=spec.q_len // outer.size, kv_len=spec.kv_len // outer.size)
        heads = spec.replace(heads=spec.heads // inner.size,
                             kv_heads=max(spec.kv_heads // inner.size, 1))
        dims = tuple(DimCost(s.dim, s.describe(d)) for s, d in ((inner, line), (outer, heads)))
        i, o = (d.description for d in dims)
        return HybridDescription(
            self.name, inner.size * outer.size, steps=o.steps,
            bytes_sent=i.bytes_sent + o.bytes_sent,
            bytes_received=i.bytes_received + o.bytes_received, flops=o.flops,
            backward_steps=o.backward_steps,
            backward_bytes_sent=i.backward_bytes_sent + o.backward_bytes_sent,
            backward_bytes_received=i.backward_bytes_received + o.backward_bytes_received,
            backward_flops=o.backward_flops, dims=dims,
            notes=f"{inner.name} over {inner.dim}={inner.size} x {outer.name} over "
                  f"{outer.dim}={outer.size}; steps and flops are the outer schedule's kernel "
                  f"calls on H/{inner.size} heads; bytes add both dims",
        )

    def __repr__(self) -> str:
        if self._error is not None:
            return f"<schedule hybrid, not configured: {self._error}>"
        return (f"<schedule hybrid: {self._inner.name} over {self._inner.dim}="
                f"{self._inner.size} x {self._outer.name} over {self._outer.dim}="
                f"{self._outer.size}>")


def _compose(mesh, inner: str, outer: str, inner_dim, outer_dim, outer_options):
    """(inner schedule, outer schedule) of a hybrid; a ValueError naming the fix when the mesh
    or an option cannot work."""
    for role, name, known in (("inner", inner, INNER), ("outer", outer, OUTER)):
        if name not in known:
            raise ValueError(f"{role}={name!r} is not known for schedule 'hybrid'; choose one "
                             f"of {sorted(known)}")
    names = tuple(mesh.names) if mesh is not None else ()
    if len(names) < 2:
        what = f"the 1-D mesh {names} of {mesh.world_size} ranks" if mesh is not None else "none"
        raise ValueError(
            f"schedule 'hybrid' needs a mesh of two dims (inner x outer), got {what}; build one "
            f"with sdpa_fusion.init_mesh((2, -1), ('heads', 'seq')), or use a 1-D schedule "
            f"('ring', 'ulysses', 'allgather', 'head_parallel')"
        )
    for role, dim in (("inner_dim", inner_dim), ("outer_dim", outer_dim)):
        if dim is not None and dim not in names:
            raise ValueError(f"{role}={dim!r} is not a dim of the mesh; its dims are {list(names)}")
    if inner_dim is not None and inner_dim == outer_dim:
        raise ValueError(f"inner_dim and outer_dim must be two different mesh dims, both are "
                         f"{inner_dim!r}; choose two of {list(names)}")
    inner_dim = inner_dim or next(n for n in names if n != outer_dim)
    outer_dim = outer_dim or next(n for n in names if n != inner_dim)
    inner_options = {"partition": "contiguous"} if inner == "ulysses" else {}
    return (INNER[inner](mesh, dim=inner_dim, **inner_options),
            OUTER[outer](mesh, dim=outer_dim, **outer_options))


