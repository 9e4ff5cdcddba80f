"""``hybrid``: attention on a 2-D mesh, heads split across one dim and the sequence across the
other (USP's unified sequence parallelism, TransformerEngine's ``a2a+p2p``, LoongTrain's 2-D
attention).

    mesh = sdpa_fusion.init_mesh((2, 4), ("heads", "seq"))
    sched = schedules.get("hybrid", mesh, inner="ulysses", outer="ring")   # the defaults

The *outer* dim (default the mesh's second) splits the sequence with the outer schedule
(``ring`` or ``allgather``); the *inner* dim splits the heads with the inner schedule, whose
local kernel is the outer schedule over this rank's outer line:

    inner="ulysses"        rank (i, o) holds S/(Pi Po) tokens of all H heads
        [B, H, S/(Pi Po), E]  --all-to-all over the inner line-->  [B, H/Pi, S/Po, E]
        --outer schedule over the outer line-->  out [B, H/Pi, S/Po, E]
        --all-to-all back-->  out [B, H, S/(Pi Po), E]
    inner="head_parallel"  rank (i, o) holds [B, H/Pi, S/Po, E]: no inner communication

Outer rank o holds the tokens ``partition.indices(S, Po, o)``; with ulysses, inner rank i the
i-th contiguous 1/Pi of them. S = 16, 2 x 2, load_balanced:

    outer rank 0: tokens 0-3, 12-15    ulysses: (i=0, o=0) 0-3    (i=1, o=0) 12-15
    outer rank 1: tokens 4-7, 8-11              (i=0, o=1) 4-7    (i=1, o=1) 8-11

Packed sequences (THD): inner ulysses splits each sequence's outer part again over the inner
ranks (``NestedPacking``); its all-to-all puts the real tokens back in their rows:

    outer part (rank o)   a0 a1 .  .  | b0 b1 b6 b7
    (i=0, o)              a0 a1 | b0 b1        (i=1, o)   .  .  | b6 b7
"""

from __future__ import annotations

import contextlib
import math

import torch

from sdpa_fusion.kernels import Kernel
from sdpa_fusion.kernels.base import head_shards
from sdpa_fusion.layout import Layout, shard_layout, unshard_layout
from sdpa_fusion.local import packed_seqlens

from . import dry_run
from .allgather import AllGather
from .base import Schedule
from .calls import PackedCall
from .dim_costs import describe_dims
from .head_parallel import HeadParallel
from .packing import LocalPacking, NestedPacking
from .ring import Ring
from .sequence import checked_packing, packing_of
from .ulysses import Placement, Ulysses


class _LineUlysses(Ulysses):
    """``ulysses`` over the inner dim; packed, it hands the whole outer part to its kernel."""

    routes_packed = False  # the whole part's rows travel as blocks

    def _packed_plan(self, spec):
        split = spec.packing.split  # the outer part split again

        def build():
            real = [split.real[j].nonzero().flatten() for j in range(split.parts)]
            parts = [(rows.to(split.device), split.rows(j)[rows].to(split.device))
                     for j, rows in enumerate(real)]
            seqlens = packed_seqlens(split.cu_seqlens, split.cu_seqlens_padded)
            return (Placement(split.total_tokens, split.tokens, parts),
                    PackedCall(None, None, seqlens, spec.causal))

        return spec.packing.cached(("hybrid", spec.causal), build)


def _unmasked(spec):
    """``spec`` for the inner schedule: a composed mask is the outer one's."""
    return spec if spec.mask is None else spec.replace(mask=None)


INNER = {"ulysses": _LineUlysses, "head_parallel": HeadParallel}
OUTER = {"ring": Ring, "allgather": AllGather}


class _OuterKernel(Kernel):
    """The outer schedule over this rank's outer line as the inner one's local kernel."""

    name = "outer"
    native_varlen = True  # a packed call runs the outer schedule once
    limits = None  # the outer schedule's kernel calls stay inside the kernel's own

    def __init__(self, outer: Schedule, kernel: Kernel, spec):
        self.outer, self.kernel, self.spec = outer, kernel, spec

    def split_heads(self, mesh, dim: str) -> "_OuterKernel":
        return _OuterKernel(self.outer, head_shards(self.kernel, mesh, dim), self.spec)

    def _local(self, q, k):
        layout = self.spec.layout
        return self.spec.replace(
            heads=q.shape[layout.head_dim], kv_heads=k.shape[layout.head_dim],
            q_len=q.shape[layout.seq_dim], kv_len=k.shape[layout.seq_dim])

    def _forward(self, q, k, v, *, causal, scale, window, dropout, out, lse):
        return self.outer.forward(q, k, v, self._local(q, k), self.kernel, dropout)

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale, window, dropout, dq, dk, dv):
        return self.outer.backward(dout, q, k, v, out, lse, self._local(q, k), self.kernel,
                                   dropout)

    def _varlen_forward(self, q, k, v, seqlens, *, causal, scale, window, out=None, lse=None):
        out, lse = self.outer.forward(q, k, v, self._local(q, k), self.kernel, out=out,
                                      lse=None if lse is None else lse.unsqueeze(0))
        return out, lse[0]

    def _varlen_backward(self, dout, q, k, v, out, lse, seqlens, *, causal, scale, window,
                         dq=None, dk=None, dv=None):
        return self.outer.backward(dout, q, k, v, out, lse.unsqueeze(0), self._local(q, k),
                                   self.kernel, dq=dq, dk=dk, dv=dv)


class Hybrid(Schedule):
    """``inner`` ("ulysses" | "head_parallel") over ``inner_dim`` composed with ``outer``
    ("ring" | "allgather", its options) over ``outer_dim``; a bad mesh or option raises in
    ``validate``. K/V with fewer heads than inner ranks are replicated (ulysses) or copied."""

    name = "hybrid"
    supports_thd = True

    def __init__(self, mesh, *, inner: str = "ulysses", outer: str = "ring",
                 inner_dim: str | None = None, outer_dim: str | None = None,
                 partition="auto", **outer_options):
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
        """The schedule over the inner dim (a ValueError for a bad configuration)."""
        self._check_configuration()
        return self._inner

    @property
    def outer(self) -> Schedule:
        """The schedule over the outer dim (a ValueError for a bad configuration)."""
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
        """The outer schedule's token partition."""
        return self.outer.partition

    @property
    def splits_heads(self) -> bool:
        """Whether the local tensors hold a head shard (inner head_parallel)."""
        return self.inner.sharded_dim == 1

    @property
    def kept_bytes(self) -> int:
        """Bytes the outer schedule keeps between calls (the ring's symmetric memory)."""
        return getattr(self.outer, "kept_bytes", 0)

    # ---- the contract ----------------------------------------------------------------------
    def global_spec(self, spec):
        return self.outer.global_spec(self._line_spec(spec))

    def _line_spec(self, spec):
        """The problem of this rank's inner line (all heads), local to the outer schedule."""
        line = self.inner.global_spec(spec)
        if isinstance(spec.packing, NestedPacking):
            line = line.replace(packing=spec.packing.outer)
        return line

    def check_shards(self, q, k, v) -> None:
        if self.splits_heads:
            self.inner.check_shards(q, k, v)

    def validate(self, spec):
        self._check_configuration()
        for role, sched, local in (("inner", self.inner, spec),
                                   ("outer", self.outer, self._outer_spec(spec))):
            try:
                sched.validate(local)
            except ValueError as e:
                raise ValueError(f"schedule 'hybrid', {role} dim {sched.dim!r} ({sched.name} "
                                 f"over {sched.size} ranks): {e}") from e

    def kernel_calls(self, spec) -> int:
        """The outer schedule's calls (the inner one hands it the kernel's work whole)."""
        return self.outer.kernel_calls(self._outer_spec(spec))

    def _outer_spec(self, spec):
        """The local spec the outer schedule sees, from the hybrid's local ``spec``."""
        if self.splits_heads:
            return spec
        p = self.inner.size
        return self._line_spec(spec).replace(heads=spec.heads // p,
                                             kv_heads=max(spec.kv_heads // p, 1))

    def _kernel(self, kernel, spec) -> _OuterKernel:
        return _OuterKernel(self.outer, kernel, self._outer_spec(spec))

    def forward(self, q, k, v, spec, kernel, dropout=None):
        return self.inner.forward(q, k, v, _unmasked(spec), self._kernel(kernel, spec), dropout)

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        return self.inner.backward(dout, q, k, v, out, lse, _unmasked(spec),
                                   self._kernel(kernel, spec), dropout)

    # ---- packed sequences ------------------------------------------------------------------
    def pack(self, cu_seqlens, cu_seqlens_padded=None, *, device=None) -> LocalPacking:
        """This rank's part of the GLOBAL packing (a ``NestedPacking`` with inner ulysses)."""
        outer = self.outer.pack(cu_seqlens, cu_seqlens_padded, device=device)
        if self.splits_heads:
            return outer

        def nest():
            split = self.inner.split(*outer.split.part_packing(outer.rank), outer.device)
            return NestedPacking(split, self.inner.index, outer)

        return outer.cached(("nested", self.inner.size, self.inner.index), nest)

    @property
    def packing_owner(self) -> tuple:
        """The ``LocalPacking.owner`` of the packings this rank uses."""
        owner = self.outer.packing_owner
        return owner if self.splits_heads else owner + self.inner.packing_owner

    def local_packing(self, q, cu_seqlens, cu_seqlens_padded=None) -> LocalPacking:
        """This rank's packing for ``attention(q, ..., layout='thd', cu_seqlens=...)``."""
        return checked_packing(self, q, cu_seqlens, cu_seqlens_padded)

    # ---- full tensors ----------------------------------------------------------------------
    def indices(self, seq_len: int) -> torch.Tensor:
        """Global positions of the tokens this rank holds, in local order."""
        self._check_sequence(seq_len)
        tokens = self.outer.indices(seq_len)
        if self.splits_heads:
            return tokens
        return tokens[self.inner.indices(len(tokens))]

    def position_ids(self, seq_len: int, device=None) -> torch.Tensor:
        """Global positions (int64, on ``device``) of this rank's tokens of a sequence."""
        return self.indices(seq_len).to(device or "cpu")

    def _check_sequence(self, seq_len: int) -> None:
        outer, inner = self.outer, self.inner
        outer.partition.check(seq_len, outer.size)
        line = seq_len // outer.size
        if not self.splits_heads and line % inner.size:
            multiple = math.lcm(outer.partition.multiple(outer.size), outer.size * inner.size)
            raise ValueError(f"sequence length {seq_len} gives each of the {outer.size} ranks of "
                             f"outer dim {outer.dim!r} {line} tokens, which must be divisible by "
                             f"the {inner.size} ranks of inner dim {inner.dim!r} (ulysses); pad "
                             f"the sequence to a multiple of {multiple}")

    def shard(self, t: torch.Tensor, *, layout: Layout | str = "auto", cu_seqlens=None,
              cu_seqlens_padded=None) -> torch.Tensor:
        """This rank's tokens (and, with inner head_parallel, heads) of a full tensor."""
        layout = shard_layout(t, layout)
        if layout.is_varlen:
            local = packing_of(self, cu_seqlens, cu_seqlens_padded).shard(t)
        else:
            local = t.index_select(2, self.indices(t.shape[2]).to(t.device))
        if self.splits_heads:
            return self.inner.local_heads(local, layout, f"inner dim {self.inner.dim!r}")
        return local if layout.is_varlen else layout.to(local)

    def placements(self, shape) -> list:
        """DTensor placements: Shard(2) outer, Shard(1) (head_parallel) or Shard(2) inner."""
        from torch.distributed.tensor import Replicate, Shard

        if len(shape) != 4:
            raise ValueError(f"schedule 'hybrid' takes DTensors of the logical shape [B, H, S, "
                             f"E], got {list(shape)}; pass packed tensors as this rank's part "
                             f"(schedule.shard(t, layout='thd', cu_seqlens=...))")
        names = list(self.mesh.names)
        placements = [Replicate()] * len(names)
        seq_dims = sorted(names.index(s.dim) for s in (self.outer, self.inner)
                          if s is self.outer or not self.splits_heads)
        for d in seq_dims:
            placements[d] = Shard(2)
        if self.splits_heads:
            if shape[1] % self.inner.size:
                raise ValueError(f"heads {shape[1]} of a DTensor must be divisible by the "
                                 f"{self.inner.size} ranks of inner dim {self.inner.dim!r} "
                                 f"(Shard(1)); pass K/V with fewer heads as plain tensors from "
                                 f"schedule.shard(...)")
            placements[names.index(self.inner.dim)] = Shard(1)
        if shape[2] not in self._contiguous:
            chunk, chunks = 0, 1  # DTensor shards over the mesh dims in mesh order
            for d in seq_dims:
                chunk = chunk * self.mesh.size(names[d]) + self.mesh.coordinate(names[d])
                chunks *= self.mesh.size(names[d])
            mine = torch.arange(shape[2]).chunk(chunks)[chunk]
            self._contiguous[shape[2]] = torch.equal(self.indices(shape[2]), mine)
        if not self._contiguous[shape[2]]:
            raise ValueError(f"the tokens of this rank under schedule 'hybrid' are not the "
                             f"contiguous chunk that the DTensor placements {placements} give it; "
                             f"build the hybrid with partition='contiguous' (with inner='ulysses', "
                             f"also name the outer dim first in the mesh: init_mesh((Po, Pi), "
                             f"('seq', 'heads'))), or pass plain tensors from schedule.shard(...)")
        return placements

    @property
    def token_splits(self) -> tuple:
        return self.outer.token_splits if self.splits_heads else (self.inner, self.outer)

    @property
    def head_split(self):
        return self.inner if self.splits_heads else None

    def unshard(self, t: torch.Tensor, *, layout: Layout | str = "auto", cu_seqlens=None,
                cu_seqlens_padded=None, heads: int | None = None,
                copies: str | None = None) -> torch.Tensor:
        """The full tensor from every rank's part; ``heads`` and ``copies`` as for head_parallel."""
        layout = unshard_layout(t, layout)
        inner, outer = {}, {}  # the cu_seqlens= of each dim's unshard
        if layout.is_varlen:
            packing = packing_of(self, cu_seqlens, cu_seqlens_padded)
            if self.splits_heads:
                outer["cu_seqlens"] = packing
            else:
                inner["cu_seqlens"] = packing.split.part(packing.rank)
                outer["cu_seqlens"] = packing.outer
        if self.splits_heads:
            inner.update(heads=heads, copies=copies)
        elif heads is not None and isinstance(t, torch.Tensor) and heads != t.shape[1]:
            raise ValueError(
                f"heads={heads} does not match the {t.shape[1]} heads of the tensor; "
                f"leave heads out (only K/V copies under inner='head_parallel' need it)")
        line = self.inner.unshard(t, layout=layout, **inner)
        return self.outer.unshard(line, layout=layout, **outer)

    # ---- costs -----------------------------------------------------------------------------
    def describe(self, spec):
        """Steps, bytes and FLOPs per rank for the global ``spec``, with one ``DimCost`` per dim."""
        return describe_dims(self.inner, self.outer, spec, self._global_line(spec),
                             dry_run.memory_of(self, spec))

    def _global_line(self, spec):
        """The global problem of this rank's inner line: all heads of its outer rank's tokens."""
        outer = self.outer
        if not spec.layout.is_varlen:
            return spec.replace(q_len=spec.q_len // outer.size, kv_len=spec.kv_len // outer.size)
        split = outer.split(spec.cu_seqlens, spec.cu_seqlens_padded, "cpu")
        cu, padded = split.part_packing(outer.index)
        tokens = split.part(outer.index).tokens  # one count per rank, or per rank's documents
        return spec.replace(q_len=tokens, kv_len=tokens, cu_seqlens=cu,
                            cu_seqlens_padded=padded)

    def __repr__(self) -> str:
        if self._error is not None:
            return f"<schedule hybrid, not configured: {self._error}>"
        return (f"<schedule hybrid: {self._inner.name} over {self._inner.dim}="
                f"{self._inner.size} x {self._outer.name} over {self._outer.dim}="
                f"{self._outer.size}>")


def _compose(mesh, inner: str, outer: str, inner_dim, outer_dim, outer_options):
    """(inner schedule, outer schedule) of a hybrid; a ValueError naming the fix."""
    for role, name, known in (("inner", inner, INNER), ("outer", outer, OUTER)):
        if name not in known:
            raise ValueError(f"{role}={name!r} is not known for schedule 'hybrid'; choose one "
                             f"of {sorted(known)}")
    names = tuple(mesh.names) if mesh is not None else ()
    if len(names) < 2:
        what = f"the 1-D mesh {names} of {mesh.world_size} ranks" if mesh is not None else "none"
        raise ValueError(f"schedule 'hybrid' needs a mesh of two dims (inner x outer), got "
                         f"{what}; build one with sdpa_fusion.init_mesh((2, -1), ('heads', "
                         f"'seq')), or use a 1-D schedule ('ring', 'ulysses', 'allgather', "
                         f"'head_parallel')")
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


