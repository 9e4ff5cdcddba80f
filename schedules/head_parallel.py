"""``head_parallel``: q, k, v and their gradients split over heads on one mesh dim.

Rank r of P holds heads [r*H/P, (r+1)*H/P) of q and [r*H_kv/P, (r+1)*H_kv/P) of k and v and
attends them over the full sequence with no communication (H a multiple of P). With fewer
K/V heads than ranks (P % H_kv == 0) each rank holds a copy of the K/V head its query heads
use, whose gradient is that rank's share::

    k_l = sched.shard(k)                      # a copy of one of H_kv heads (it says so)
    sched.unshard(k_l)                        # k: shard's copies fold back by themselves
    sched.unshard(k_l.grad, heads=H_kv, copies="sum")      # dK of the full k
    sched.unshard(out)                        # attention's output: its H heads

Inside a replicated model, ``shard(t, replicated=True)`` splits the heads of a tensor every
rank computed alike (its gradient all-reduced in backward: Megatron's "f"); ``unshard``
gathers them back (Megatron's "g")::

    q_l = sched.shard(q, replicated=True)          # q, k, v: [B, H, S, E] on every rank
    out = sched.unshard(attention(q_l, k_l, v_l, schedule=sched))
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdpa_fusion.kernels.base import head_shards
from sdpa_fusion.layout import Layout, shard_layout, unshard_layout
from sdpa_fusion.local import local_backward, local_forward

from . import dry_run
from .base import Description, Schedule


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks of ``group``."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_gradients(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` itself, whose gradient is summed over the ranks of ``group`` (Megatron's "f")."""
    return _SumGradients.apply(t, group)


def heads_of(t: torch.Tensor, parts: int, index: int, where: str) -> torch.Tensor:
    """Rank ``index``'s heads (dim 1) of ``t``: a 1/parts share, or a copy of one head."""
    h = t.shape[1]
    if h % parts and parts % h:
        raise ValueError(f"heads {h} must be divisible by the {parts} ranks of {where} (or divide "
                         f"{parts}, for K/V heads that ranks then share); use a multiple of "
                         f"{parts} heads")
    return t.narrow(1, index * h // parts, max(h // parts, 1))


_FULL_HEADS = "_sdpa_fusion_full_heads"  # attribute of a local part: its full tensor's heads


def full_heads(t) -> int | None:
    """The heads of the full tensor of ``t``, where ``shard`` or ``attention`` recorded them."""
    return getattr(t, _FULL_HEADS, None)


def record_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``t``, recorded as this rank's part of a full tensor of ``heads`` heads."""
    setattr(t, _FULL_HEADS, heads)
    return t


def fold_copies(t: torch.Tensor, heads: int, copies: str | None, where: str) -> torch.Tensor:
    """[B, P, S, E] gathered from P ranks, rank i holding a copy of head i * heads // P ->
    [B, heads, S, E]: ``copies="sum"`` adds the copies, ``"first"`` takes one."""
    check_copies(t.shape[1], heads, copies, where)
    grouped = t.unflatten(1, (heads, t.shape[1] // heads))
    return grouped.sum(2) if copies == "sum" else grouped.select(2, 0)


def check_copies(p: int, heads: int, copies: str | None, where: str) -> None:
    """A ValueError unless ``p`` gathered heads fold into ``heads`` heads by ``copies``."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or p % heads:
        raise ValueError(f"heads={heads} does not match the {p} heads gathered from the ranks of "
                         f"{where}; pass the full tensor's head count (it differs only for K/V "
                         f"with fewer heads than ranks)")
    if copies not in ("sum", "first"):
        raise ValueError(f"the {p} ranks of {where} hold copies of heads={heads} heads; pass "
                         f"copies='sum' for gradients (each copy holds its ranks' share) or "
                         f"copies='first' for values (the copies are equal), not copies={copies!r}")


class HeadParallel(Schedule):
    name = "head_parallel"
    sharded_dim = 1
    supports_thd = True  # whole packed sequences on every rank

    def __init__(self, mesh, *, dim: str | None = None):
        super().__init__(mesh, dim=dim)
        self._copied: set[int] = set()  # head counts of the tensors shard() handed copies of

    def global_spec(self, spec):
        return spec.replace(heads=spec.heads * self.size, kv_heads=spec.kv_heads * self.size)

    @property
    def head_split(self):
        return self if self.size > 1 else None

    def _kernel(self, kernel):
        return head_shards(kernel, self.mesh, self.dim) if self.size > 1 else kernel

    def _dropout(self, dropout):
        """Each rank's heads draw their own dropout stream."""
        return dropout.stream("heads", self.index) if dropout is not None else None

    def check_shards(self, q, k, v) -> None:
        heads = full_heads(q)
        if self.size > 1 and heads is not None and heads % self.size:
            raise ValueError(self._indivisible(f"q is a copy of one head of a tensor of {heads}"))

    def _indivisible(self, what: str) -> str:
        p = self.size
        return (
            f"{what} heads, not a multiple of the {p} ranks of {self._where}, which splits "
            f"the query heads over them (only K/V heads may be fewer than the ranks: each rank "
            f"then holds a copy of the one its query heads use); use a multiple of {p} query "
            f"heads, or a sequence schedule such as 'ring' or 'allgather'")

    def forward(self, q, k, v, spec, kernel, dropout=None):
        out, lse = local_forward(self._kernel(kernel), q, k, v, spec, self._dropout(dropout))
        return record_heads(out, spec.heads * self.size), lse

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        return local_backward(self._kernel(kernel), dout, q, k, v, out, lse, spec,
                              self._dropout(dropout))

    @property
    def _where(self) -> str:
        return f"schedule 'head_parallel' over {self.dim}={self.size}"

    def shard(self, t: torch.Tensor, *, layout: Layout | str = "auto", cu_seqlens=None,
              cu_seqlens_padded=None, replicated: bool = False) -> torch.Tensor:
        """This rank's heads of a full tensor; ``replicated``: its gradient is summed over ranks."""
        layout = shard_layout(t, layout)
        if self.size == 1:
            return layout.to(t)
        if replicated:
            t = sum_gradients(t, self.group)
        return self.local_heads(t, layout)

    def local_heads(self, t: torch.Tensor, layout: Layout, where: str | None = None):
        """This rank's heads of ``t`` in ``layout``: its 1/P share, or a copy of one head (K/V of
        GQA) that records the full head count. ``where`` names the ranks in errors."""
        heads = t.shape[1]
        local = layout.to(heads_of(t, self.size, self.index, where or self._where))
        if heads < self.size:
            self._copied.add(heads)
            record_heads(local, heads)
        return local

    def unshard(self, t: torch.Tensor, *, layout: Layout | str = "auto", cu_seqlens=None,
                cu_seqlens_padded=None, heads: int | None = None,
                copies: str | None = None) -> torch.Tensor:
        """The full tensor (same on every rank) from every rank's heads; differentiable. ``heads``
        < ranks: ``t`` is a copy of one of ``heads`` heads, folded by ``copies`` ("sum" for
        gradients, "first" for values). Shard's copies and attention's output fold by
        themselves; once copies were handed out, other one-head tensors need both."""
        layout = unshard_layout(t, layout)
        if self.size == 1:
            return layout.to(t)
        fold = error = None
        try:
            fold = self._fold(t, heads, copies)
        except ValueError as e:
            error = e
        full = self.gather(t, 1, error=error, alike={"fold": repr(fold)})
        return layout.to(full if fold is None else fold_copies(full, *fold, self._where))

    def _fold(self, t, heads, copies) -> tuple[int, str] | None:
        """(heads, copies) that unshard folds the gathered heads of ``t`` into, or None."""
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            return None  # the gather reports it
        gathered = t.shape[1] * self.size
        if heads is None and full_heads(t) is not None:
            heads, copies = full_heads(t), copies or "first"  # shard's copy, or an output
        if heads is None:
            if t.shape[1] == 1 and self._copied:
                raise ValueError(self._ambiguous(gathered))
            return None
        if heads == gathered:
            return None
        check_copies(gathered, heads, copies, self._where)
        return heads, copies

    def _ambiguous(self, gathered: int) -> str:
        kv = " or ".join(map(str, sorted(self._copied)))
        return (
            f"unshard cannot tell what a tensor of one head per rank is: {self._where} handed "
            f"out copies of K/V heads (a tensor of {kv} heads), and this may be the gradient of "
            f"such a copy or a tensor of {gathered} heads. Pass heads={kv}, copies='sum' for "
            f"the gradient of a copied K/V tensor (each copy holds its ranks' share: their sum "
            f"is the gradient of the full tensor), heads={kv}, copies='first' for values equal "
            f"on the ranks that share a head, or heads={gathered} for a tensor of {gathered} "
            f"heads")

    def describe(self, spec):
        if spec.heads % self.size:
            raise ValueError(self._indivisible(f"the problem's {spec.heads} query"))
        return Description(
            self.name, self.size, steps=1, bytes_sent=0, bytes_received=0,
            flops=spec.flops() / self.size, backward_steps=1,
            backward_flops=(spec.flops(backward=True) - spec.flops()) / self.size,
            notes=f"{spec.heads // self.size} of {spec.heads} heads per rank, no communication",
            memory_of=dry_run.memory_of(self, spec))
