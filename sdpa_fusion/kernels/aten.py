"""ATen's fused attention kernels (cuDNN and FlashAttention-2) behind the kernel contract.

``flash`` runs dense and packed (varlen) problems, with sliding windows, through
``_flash_attention_forward/_backward``. Flash aligns its masks bottom-right: in a block of n_q
queries and n_k keys, query i sees key j when ``j - (n_k - n_q)`` lies in
``[i - window_left, i + window_right]``. Our top-left band is that mask once the queries that
see no key and the keys that no query sees are cut off and the window is shifted by what
remains of n_k - n_q (``flash_band``). Packed sequences run in one call when that shift is
the same for every masked sequence (always so for self-attention), else one by one.

``cudnn`` runs dense problems; packed sequences run one by one through it (the base class).
ATen's cuDNN varlen path is not used: see ``CUDNN_VARLEN``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..mask import band
from ..spec import AttentionSpec
from .base import (Dropout, Kernel, Seqlens, expand_kv_heads, get, like_layout, reduce_kv_heads,
                   register)

aten = torch.ops.aten

CUDNN_VARLEN = (
    "ATen's cuDNN varlen attention (_cudnn_attention_forward/_backward with cum_seq_q/k) is not "
    "used: on torch 2.11 its backward takes the longest sequence to be query.size(2), the head "
    "dim of a packed [T, H, E] tensor, so gradients of sequences longer than the head dim are "
    "wrong; it rebuilds its cuDNN graph on every call (118 ms for 2048 sequences of 128 tokens "
    "on an H200) and leaves rows whose sequence has no keys unset"
)


def flash_band(n_q: int, n_k: int, mask: tuple[int | None, int | None]):
    """(rows, keys, window_left, window_right) such that flash, given the first ``rows`` queries
    and the first ``keys`` keys of an n_q x n_k block and that bottom-right window (-1:
    unbounded), computes the top-left band ``mask``; the other queries see no key and the
    other keys no query. Always possible for one block (0, 0 when no query sees a key)."""
    left, right = mask
    rows = n_q if left is None else max(0, min(n_q, n_k + left))
    keys = n_k if right is None else max(0, min(n_k, rows + right))
    if rows == 0 or keys == 0:
        return 0, 0, -1, -1
    shift = keys - rows
    return (rows, keys, -1 if left is None else left + shift,
            -1 if right is None else right - shift)


@dataclasses.dataclass(frozen=True)
class FlashCall:
    """One varlen flash call: the sequences as flash sees them (queries that see no key and
    keys no query sees split off as sequences of their own) and its mask arguments."""

    seqlens: Seqlens
    causal: bool
    window_left: int
    window_right: int

    @property
    def max_q(self) -> int:
        # At least 2: with max_q == 1 and GQA, flash reshapes q for decoding as if every
        # sequence had one query, which fails for sequences without queries.
        return max(self.seqlens.max_q, 2)


@functools.lru_cache(maxsize=64)
def flash_call(seqlens: Seqlens, t_q: int, t_k: int, mask) -> FlashCall | None:
    """The varlen call computing top-left ``mask`` over packed [t_q] queries and [t_k] keys,
    or None when the sequences need different window shifts. Tokens outside every sequence
    become sequences without keys (or queries): output 0, lse -inf, gradient 0."""
    cu_q, cu_k = [0], [0]

    def add(n_q, n_k):
        if n_q or n_k:
            cu_q.append(cu_q[-1] + n_q)
            cu_k.append(cu_k[-1] + n_k)

    def add_apart(n_q, n_k):
        add(n_q, 0)
        add(0, n_k)

    add_apart(seqlens.cu_q[0], seqlens.cu_k[0])
    windows = set()
    for n_q, n_k in zip(seqlens.lengths_q, seqlens.lengths_k):
        rows, keys, left, right = flash_band(n_q, n_k, mask)
        if rows:
            add(rows, keys)
            windows.add((left, right))
        add_apart(n_q - rows, n_k - keys)
    add_apart(t_q - seqlens.cu_q[-1], t_k - seqlens.cu_k[-1])
    if len(windows) > 1:
        return None
    left, right = windows.pop() if windows else (-1, -1)
    causal = left < 0 and right == 0
    return FlashCall(Seqlens(tuple(cu_q), tuple(cu_k)), causal,
                     -1 if causal else left, -1 if causal else right)


def _no_key_to_minus_inf(lse: torch.Tensor) -> torch.Tensor:
    """Flash gives rows that see no key lse +inf; the contract says -inf."""
    return lse.masked_fill_(lse == math.inf, -math.inf)


def _no_key_to_plus_inf(lse: torch.Tensor) -> torch.Tensor:
    """The lse flash's backward takes: +inf for rows that see no key (their P is then 0)."""
    return lse.masked_fill(lse == -math.inf, math.inf)


def _rng_state(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rng_state, unused) for a flash backward without dropout."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


class FlashKernel(Kernel):
    """ATen FlashAttention-2 (``_flash_attention_forward/_backward``), dense and varlen."""

    name = "flash"
    supports_window = True

    def _unavailable_reason(self, spec: AttentionSpec, device) -> str | None:
        if spec.head_dim > 256:
            return f"kernel 'flash' supports head_dim <= 256, got {spec.head_dim}"
        return None

    def forward(self, q, k, v, *, causal, scale, dropout: Dropout | None = None, window=None):
        rows, keys, left, right = flash_band(q.shape[2], k.shape[2], band(causal, window))
        lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        if rows == 0:
            return torch.zeros_like(q), lse
        o, l, *_ = aten._flash_attention_forward(
            *(t.transpose(1, 2) for t in (q[:, :, :rows], k[:, :, :keys], v[:, :, :keys])),
            None, None, rows, keys, 0.0, left < 0 and right == 0, False, scale=scale,
            window_size_left=left, window_size_right=right,
        )
        lse[:, :, :rows] = _no_key_to_minus_inf(l)
        return _filled(o.transpose(1, 2), q), lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, dropout: Dropout | None = None,
                 window=None):
        rows, keys, left, right = flash_band(q.shape[2], k.shape[2], band(causal, window))
        if rows == 0:
            return tuple(torch.zeros_like(t) for t in (q, k, v))
        grads = aten._flash_attention_backward(
            *(t.transpose(1, 2) for t in (dout[:, :, :rows], q[:, :, :rows], k[:, :, :keys],
                                          v[:, :, :keys], out[:, :, :rows])),
            _no_key_to_plus_inf(lse[:, :, :rows]).contiguous(), None, None, rows, keys, 0.0,
            left < 0 and right == 0, *_rng_state(q.device), scale=scale,
            window_size_left=left, window_size_right=right,
        )
        return tuple(_filled(g.transpose(1, 2), t) for g, t in zip(grads, (q, k, v)))

    def varlen_forward(self, q, k, v, seqlens: Seqlens, *, causal, scale, window=None):
        call = flash_call(seqlens, q.shape[0], k.shape[0], band(causal, window))
        if call is None or q.shape[0] == 0 or k.shape[0] == 0:
            return super().varlen_forward(q, k, v, seqlens, causal=causal, scale=scale, window=window)
        cu_q, cu_k = call.seqlens.tensors(q.device)
        out, lse, *_ = aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, call.max_q, call.seqlens.max_k, 0.0, call.causal, False,
            scale=scale, window_size_left=call.window_left, window_size_right=call.window_right,
        )
        return out, _no_key_to_minus_inf(lse)

    def varlen_backward(self, dout, q, k, v, out, lse, seqlens: Seqlens, *, causal, scale,
                        window=None):
        call = flash_call(seqlens, q.shape[0], k.shape[0], band(causal, window))
        if call is None or q.shape[0] == 0 or k.shape[0] == 0:
            return super().varlen_backward(dout, q, k, v, out, lse, seqlens, causal=causal,
                                           scale=scale, window=window)
        cu_q, cu_k = call.seqlens.tensors(q.device)
        return aten._flash_attention_backward(
            dout, q, k, v, out, _no_key_to_plus_inf(lse), cu_q, cu_k, call.max_q,
            call.seqlens.max_k, 0.0, call.causal, *_rng_state(q.device), scale=scale,
            window_size_left=call.window_left, window_size_right=call.window_right,
        )


def _filled(part: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """``part``, the leading rows of a tensor shaped like ``model`` ([B, H, S, E]), as all of
    it in ``model``'s layout: the rows flash did not see get 0."""
    if part.shape == model.shape:
        return like_layout(part, model)
    full = torch.zeros_like(model)
    full[:, :, :part.shape[2]] = part
    return full


class CudnnKernel(Kernel):
    """ATen cuDNN attention (``_scaled_dot_product_cudnn_attention``); packed sequences run
    one by one (``CUDNN_VARLEN`` says why not through ATen's cuDNN varlen path). cuDNN refuses
    one query and one key ("s_q = s_kv = 1 is not supported"): that block, a one-token
    sequence, runs on the reference kernel."""

    name = "cudnn"

    def _unavailable_reason(self, spec: AttentionSpec, device) -> str | None:
        if spec.head_dim > 128:
            return f"kernel 'cudnn' supports head_dim <= 128 here, got {spec.head_dim}"
        if torch.backends.cudnn.version() is None:
            return "kernel 'cudnn' needs torch built with cuDNN"
        return None

    def forward(self, q, k, v, *, causal, scale, dropout: Dropout | None = None, window=None):
        if q.shape[2] == k.shape[2] == 1:
            return get("reference").forward(q, k, v, causal=causal, scale=scale)
        groups = q.shape[1] // k.shape[1]
        k, v = expand_kv_heads(k, groups), expand_kv_heads(v, groups)
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.view(lse.shape[:3])

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, dropout: Dropout | None = None,
                 window=None):
        if q.shape[2] == k.shape[2] == 1:
            return get("reference").backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        groups = q.shape[1] // k.shape[1]
        k_x, v_x = expand_kv_heads(k, groups), expand_kv_heads(v, groups)
        s_q, s_k = q.shape[2], k.shape[2]
        # As the forward returns them for dense tensors: int64 scalars for the RNG state and
        # no cum_seq_q/k (an empty tensor there reads as packed input and fails a dim check).
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        offset = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k_x, v_x, out, lse.unsqueeze(-1), seed, offset, None, None, None,
            s_q, s_k, 0.0, causal, scale=scale,
        )
        return dq, reduce_kv_heads(dk, groups), reduce_kv_heads(dv, groups)


register(FlashKernel())
register(CudnnKernel())
