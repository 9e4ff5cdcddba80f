"""``head_parallel``: q, k, v and their gradients split over heads on one mesh dim.

Rank r of P holds heads [r*H/P, (r+1)*H/P) of q and [r*H_kv/P, (r+1)*H_kv/P) of k and v, so
every rank attends its own heads over the full sequence with no communication. With fewer
K/V heads than ranks (P % H_kv == 0) each rank holds a copy of the K/V head its query heads
use, as ``ulysses`` does; the copy's gradient is that rank's share (``unshard(...,
heads=H_kv, copies="sum")`` adds the shares). With the ``nvfuser`` kernel the fusions carry
the split as nvFuser DID annotations (a loop split of the head axis, parallelized on
``mesh_x``), as nvFuser's own multidevice SDPA tests do.

Inside a model whose other layers are replicated (every rank computes the same q, k, v from
the same weights), ``shard(t, replicated=True)`` splits the heads of such a tensor: identity
forward, all-reduce of its gradient backward (Megatron's "f"), so the replicated weights
before it get the whole gradient on every rank; ``unshard`` gathers the heads back (its
backward keeps this rank's heads: Megatron's "g")::

    q_l = sched.shard(q, replicated=True)          # q, k, v: [B, H, S, E] on every rank
    out = sched.unshard(attention(q_l, k_l, v_l, schedule=sched))
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdpa_fusion.kernels.base import head_shards
from sdpa_fusion.layout import Layout, shard_layout, unshard_layout
from sdpa_fusion.local import local_backward, local_forward

from .base import Description, Schedule
from .memory import Memory, local_memory


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
    """``t`` itself, whose gradient is summed over the ranks of ``group`` in backward: the step
    before splitting a tensor that every rank computed alike (Megatron's "f")."""
    return _SumGradients.apply(t, group)


def heads_of(t: torch.Tensor, parts: int, index: int, where: str) -> torch.Tensor:
    """Rank ``index``'s heads (dim 1) of ``t`` among ``parts`` ranks: a 1/parts share, or a copy
    of the one head its query heads use when ``t`` has fewer heads than ranks (K/V of GQA)."""
    h = t.shape[1]
    if h % parts and parts % h:
        raise ValueError(
            f"heads {h} must be divisible by the {parts} ranks of {where} (or divide {parts}, "
            f"for K/V heads that ranks then share); use a multiple of {parts} heads"
        )
    return t.narrow(1, index * h // parts, max(h // parts, 1))


def fold_copies(t: torch.Tensor, heads: int, copies: str | None, where: str) -> torch.Tensor:
    """[B, P, S, E] gathered from P ranks, rank i holding a copy of head i * heads // P ->
    [B, heads, S, E]: ``copies="sum"`` adds the copies (gradients: each is its ranks' share),
    ``copies="first"`` takes one (values: the copies are equal)."""
    p = t.shape[1]
    if p % heads:
        raise ValueError(
            f"heads={heads} does not match the {p} heads gathered from the ranks of {where}; "
            f"pass the full tensor's head count (it differs only for K/V with fewer heads "
            f"than ranks)"
        )
    if copies not in ("sum", "first"):
        raise ValueError(
            f"the {p} ranks of {where} hold copies of heads={heads} heads; pass copies='sum' "
            f"for gradients (each copy holds its ranks' share) or copies='first' for values "
            f"(the copies are equal), not copies={copies!r}"
        )
    grouped = t.unflatten(1, (heads, p // heads))
    return grouped.sum(2) if copies == "sum" else grouped.select(2, 0)


class HeadParallel(Schedule):
    name = "head_parallel"
    sharded_dim = 1
    supports_thd = True  # whole packed sequences on every rank

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

    def forward(self, q, k, v, spec, kernel, dropout=None):
        return local_forward(self._kernel(kernel), q, k, v, spec, self._dropout(dropout))

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        return local_backward(self._kernel(kernel), dout, q, k, v, out, lse, spec,
                              self._dropout(dropout))

    @property
    def _where(self) -> str:
        return f"schedule 'head_parallel' over {self.dim}={self.size}"

    def shard(self, t: torch.Tensor, *, layout: Layout | str = "auto", cu_seqlens=None,
              cu_seqlens_padded=None, replicated: bool = False) -> torch.Tensor:
        """This rank's heads of a full tensor (logical [B, H, S, E], or [T, H, E] with
        ``layout='thd'``), in ``layout``; differentiable. A tensor with fewer heads than ranks
        (K/V of GQA) gives each rank a copy of the head its query heads use.
        ``replicated=True``: ``t`` is computed alike on every rank (a replicated model's
        activation), so its gradient is summed over the ranks in backward."""
        layout = shard_layout(t, layout)
        if self.size == 1:
            return layout.to(t)
        if replicated:
            t = sum_gradients(t, self.group)
        return layout.to(heads_of(t, self.size, self.index, self._where))

    def unshard(self, t: torch.Tensor, *, layout: Layout | str = "auto", cu_seqlens=None,
                cu_seqlens_padded=None, heads: int | None = None,
                copies: str | None = None) -> torch.Tensor:
        """The full tensor (same on every rank) from every rank's heads; differentiable, this
        rank's heads receiving their gradient. ``heads`` < ranks (K/V of GQA): ``t`` is a copy
        of one of ``heads`` heads, folded by ``copies`` ("sum" for gradients, "first" for
        values)."""
        layout = unshard_layout(t, layout)
        if self.size == 1:
            return layout.to(t)
        full = self.gather(t, 1)
        if heads is not None and heads != full.shape[1]:
            full = fold_copies(full, heads, copies, self._where)
        return layout.to(full)

    def describe(self, spec):
        return Description(
            self.name, self.size, steps=1, bytes_sent=0, bytes_received=0,
            flops=spec.flops() / self.size, backward_steps=1,
            backward_flops=(spec.flops(backward=True) - spec.flops()) / self.size,
            notes=f"{spec.heads // self.size} of {spec.heads} heads per rank, no communication",
            memory=self.memory(spec),
        )

    def memory(self, spec, call=None) -> Memory:
        """What this rank allocates for a call on the global ``spec``: the kernel call's
        allocations on its heads, nothing else. ``call(heads, kv_heads)``: the ``Memory`` of
        the call on that many query and K/V heads when it is not a GPU kernel's (under
        ``hybrid``, the outer schedule's)."""
        heads, kv_heads = spec.heads // self.size, max(spec.kv_heads // self.size, 1)
        if call is not None:
            return call(heads, kv_heads)
        return local_memory(spec.replace(heads=heads, kv_heads=kv_heads))
