"""Attention on one device: a kernel applied to dense tensors, or one varlen call of it to
packed (THD) tensors."""

from __future__ import annotations

import functools

import torch

from .kernels import Dropout, Kernel, Seqlens
from .kernels.pieces import written
from .masked import spec_call
from .spec import AttentionSpec


@functools.lru_cache(maxsize=256)
def packed_seqlens(cu_seqlens: tuple[int, ...], cu_seqlens_padded: tuple[int, ...] | None = None
                   ) -> Seqlens:
    """The ``Seqlens`` of a self-attention pack (queries and keys alike). With
    ``cu_seqlens_padded`` the padding after each sequence becomes two sequences of its own,
    padding queries without keys and padding keys without queries, so padding tokens get
    output 0 and gradient 0 and no real query attends them."""
    if cu_seqlens_padded is None:
        return Seqlens(tuple(cu_seqlens), tuple(cu_seqlens))
    cu_q, cu_k = [0], [0]
    for start, stop, n in zip(cu_seqlens_padded, cu_seqlens_padded[1:],
                              (b - a for a, b in zip(cu_seqlens, cu_seqlens[1:]))):
        pad = stop - start - n
        cu_q.append(start + n)
        cu_k.append(start + n)
        if pad:
            cu_q += [stop, stop]
            cu_k += [start + n, stop]
    return Seqlens(tuple(cu_q), tuple(cu_k))


def spec_seqlens(spec: AttentionSpec) -> Seqlens:
    """The ``Seqlens`` of packed ``spec``."""
    return packed_seqlens(spec.cu_seqlens, spec.cu_seqlens_padded)


def local_forward(kernel: Kernel, q, k, v, spec: AttentionSpec, dropout: Dropout | None = None,
                  *, out=None, lse=None):
    """(out, lse fp32 [B,H,S] or [1,H,T]) of the local problem, into ``out``, ``lse`` if given."""
    scale = spec.softmax_scale
    if spec.mask is not None:
        return written(_masked(spec, kernel, "forward", (q, k, v), scale), (out, lse))
    if not spec.layout.is_varlen:
        return kernel.forward(q, k, v, causal=spec.causal, scale=scale, dropout=dropout,
                              window=spec.window, out=out, lse=lse)
    out, packed_lse = kernel.varlen_forward(q, k, v, spec_seqlens(spec), causal=spec.causal,
                                            scale=scale, window=spec.window, out=out,
                                            lse=None if lse is None else lse[0])
    return out, (packed_lse.unsqueeze(0) if lse is None else lse)


def local_backward(kernel: Kernel, dout, q, k, v, out, lse, spec: AttentionSpec,
                   dropout: Dropout | None = None, *, dq=None, dk=None, dv=None):
    """(dq, dk, dv) of the whole local problem, written into ``dq``, ``dk``, ``dv`` if given."""
    scale = spec.softmax_scale
    if spec.mask is not None:
        return written(_masked(spec, kernel, "backward", (dout, q, k, v, out), scale, lse),
                     (dq, dk, dv))
    if not spec.layout.is_varlen:
        return kernel.backward(dout, q, k, v, out, lse, causal=spec.causal, scale=scale,
                               dropout=dropout, window=spec.window, dq=dq, dk=dk, dv=dv)
    return kernel.varlen_backward(dout, q, k, v, out, lse[0], spec_seqlens(spec),
                                  causal=spec.causal, scale=scale, window=spec.window, dq=dq,
                                  dk=dk, dv=dv)


def _masked(spec: AttentionSpec, kernel: Kernel, what: str, tensors, scale, lse=None):
    """``forward`` (out, lse) or ``backward`` (dq, dk, dv) of a masked problem
    (``masked.spec_call``); packed [T, H, E] tensors go as [1, H, T, E] views."""
    packed = spec.layout.is_varlen
    if packed:
        tensors = [t.unsqueeze(0).transpose(1, 2) for t in tensors]
    call = spec_call(spec)
    if what == "forward":
        q, k, v = tensors
        if call is None:
            out = torch.zeros_like(q)
            lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        else:
            out, lse = call.forward(kernel, q, k, v, scale)
        return (out[0].transpose(0, 1) if packed else out), lse
    if call is None:
        grads = tuple(torch.zeros_like(t) for t in tensors[1:4])
    else:
        grads = call.backward(kernel, *tensors, lse, scale)
    return tuple(g[0].transpose(0, 1) for g in grads) if packed else grads
