"""Attention on one device: a kernel applied to dense tensors, or sequence by sequence to
packed (THD) tensors."""

from __future__ import annotations

import torch

from .kernels import Dropout, Kernel
from .layout import sequence_view
from .spec import AttentionSpec


def local_forward(kernel: Kernel, q, k, v, spec: AttentionSpec, dropout: Dropout | None = None):
    """(out, lse) of the whole local problem; lse is fp32 [B, H, S] ([1, H, T] for THD)."""
    scale = spec.softmax_scale
    if not spec.layout.is_varlen:
        return kernel.forward(q, k, v, causal=spec.causal, scale=scale, dropout=dropout)
    out = torch.zeros_like(q)
    lse = torch.full((1, spec.heads, spec.q_len), float("-inf"), dtype=torch.float32, device=q.device)
    for start, n in spec.sequences():
        if n == 0:
            continue
        o, l = kernel.forward(
            *(sequence_view(t, start, start + n) for t in (q, k, v)), causal=spec.causal, scale=scale
        )
        sequence_view(out, start, start + n).copy_(o)
        lse[:, :, start:start + n] = l
    return out, lse


def local_backward(kernel: Kernel, dout, q, k, v, out, lse, spec: AttentionSpec,
                   dropout: Dropout | None = None):
    """(dq, dk, dv) of the whole local problem, given its out and lse."""
    scale = spec.softmax_scale
    if not spec.layout.is_varlen:
        return kernel.backward(dout, q, k, v, out, lse, causal=spec.causal, scale=scale, dropout=dropout)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for start, n in spec.sequences():
        if n == 0:
            continue
        views = [sequence_view(t, start, start + n) for t in (dout, q, k, v, out)]
        block = kernel.backward(
            *views, lse[:, :, start:start + n].contiguous(), causal=spec.causal, scale=scale
        )
        for grad, g in zip(grads, block):
            sequence_view(grad, start, start + n).copy_(g)
    return tuple(grads)
