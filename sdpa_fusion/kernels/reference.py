"""The reference kernel: attention written out in fp32 on any device, forward and backward.

It is the oracle of the test suite and the kernel of CPU ranks. Masks (causal, sliding window)
are the top-left band of ``sdpa_fusion.mask``; ``masked_forward``/``masked_backward`` take an
explicit bool mask instead (the partial tiles of a ``masks.mask_mod``). Packed sequences run
one by one. The backward is the explicit softmax-attention gradient (no autograd), given the
global out and lse of each query row:

    P  = exp(scale * Q K^T - lse)          (masked entries 0)
    dV = P^T dO
    dS = P * (dO V^T - rowsum(dO * O))
    dQ = scale * dS K,   dK = scale * dS^T Q

With dropout the kept probabilities D = P * M / (1 - p) replace P in the products with V
(out = D V, dV = D^T dO, dS = P * (M / (1 - p) * dO V^T - rowsum(dO * O))); the keep mask M is
drawn from a ``torch.Generator`` seeded with the call's ``Dropout.seed``, in forward and again
in backward. lse is that of P (dropout is applied after the softmax).
"""

from __future__ import annotations

import torch

from ..mask import band, visible
from .base import Dropout, Kernel, layout_of, like_layout, register


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, ...] -> [B, H_kv, G, ...] in fp32 (query heads grouped by their K/V head)."""
    return q.float().unflatten(1, (kv_heads, q.shape[1] // kv_heads))


def _probabilities(q, k, lse, *, causal, scale, window, seen=None):
    """P [B, H_kv, G, S_q, S_kv] in fp32 from the given lse; masked entries are 0 (``seen``:
    an explicit bool mask [S_q, S_kv], or [B, 1, 1, S_q, S_kv], instead of the band)."""
    kv_heads = k.shape[1]
    scores = torch.einsum("bhgqe,bhke->bhgqk", _grouped(q, kv_heads), k.float()) * scale
    mask = band(causal, window)
    if seen is None and mask != (None, None):
        seen = visible(q.shape[2], k.shape[2], mask, q.device)
    if seen is not None:
        scores = scores.masked_fill(~seen.to(q.device), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
        # a row with a +inf score has no softmax (inf / inf): NaN for the whole row, as torch's
        lse = torch.where(torch.isposinf(lse), torch.nan, lse)
    else:
        lse = _grouped(lse, kv_heads)
    empty = torch.isneginf(lse)  # rows that see no key; NaN and +inf rows stay NaN
    p = torch.exp(scores - torch.where(empty, 0.0, lse).unsqueeze(-1))
    p = torch.where(empty.unsqueeze(-1), 0.0, p)
    return p, lse


def _kept(p: torch.Tensor, dropout: Dropout | None) -> torch.Tensor:
    """M / (1 - p) of the call's dropout stream, shaped like ``p`` (1 without dropout)."""
    if dropout is None or dropout.p == 0:
        return torch.ones((), device=p.device)
    draw = torch.rand(p.shape, generator=dropout.generator(p.device), device=p.device)
    return (draw >= dropout.p).float() / (1.0 - dropout.p)


def _out(t: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, G, S, E] fp32 -> [B, H, S, E] in model's dtype and layout."""
    return like_layout(t.flatten(1, 2).to(model.dtype), model)


class ReferenceKernel(Kernel):
    name = "reference"
    gpu_only = False
    supports_window = True
    supports_dropout = True
    supports_mask = True
    limits = None  # torch's 64-bit indexing

    def _forward(self, q, k, v, *, causal, scale, window, dropout: Dropout | None, out, lse,
                 seen=None):
        p, lse = _probabilities(q, k, None, causal=causal, scale=scale, window=window, seen=seen)
        out = torch.einsum("bhgqk,bhke->bhgqe", p * _kept(p, dropout), v.float())
        return _out(out, q), lse.flatten(1, 2).contiguous()

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale, window,
                  dropout: Dropout | None, dq, dk, dv, seen=None):
        kv_heads = k.shape[1]
        p, _ = _probabilities(q, k, lse, causal=causal, scale=scale, window=window, seen=seen)
        do = _grouped(dout, kv_heads)
        delta = (do * _grouped(out, kv_heads)).sum(-1, keepdim=True)
        kept = _kept(p, dropout)
        dv = torch.einsum("bhgqk,bhgqe->bhke", p * kept, do)
        dp = torch.einsum("bhgqe,bhke->bhgqk", do, v.float()) * kept
        ds = p * (dp - delta)
        dq = torch.einsum("bhgqk,bhke->bhgqe", ds, k.float()) * scale
        dk = torch.einsum("bhgqk,bhgqe->bhke", ds, _grouped(q, kv_heads)) * scale
        kv_layout = layout_of(k)
        return _out(dq, q), kv_layout.to(dk.to(k.dtype)), kv_layout.to(dv.to(v.dtype))

    def masked_forward(self, q, k, v, seen, scale):
        """(out, lse) of q, k, v under the explicit bool mask ``seen`` [S_q, S_kv] (or one per
        batch element, [B, 1, 1, S_q, S_kv])."""
        return self._forward(q, k, v, causal=False, scale=scale, window=None, dropout=None,
                             out=None, lse=None, seen=seen)

    def masked_backward(self, dout, q, k, v, out, lse, seen, scale):
        """(dq, dk, dv) under the explicit bool mask ``seen``, given the global out and lse."""
        return self._backward(dout, q, k, v, out, lse, causal=False, scale=scale, window=None,
                              dropout=None, dq=None, dk=None, dv=None, seen=seen)


register(ReferenceKernel())
