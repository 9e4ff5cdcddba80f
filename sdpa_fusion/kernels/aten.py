"""ATen's fused attention kernels (cuDNN and FlashAttention-2) behind the kernel contract.

``flash`` runs dense and packed problems, with sliding windows (``flash_window`` turns our
top-left masks into its bottom-right ones); packed sequences run in one call when every
masked sequence has as many more keys than queries (always so for self-attention), else one
by one. ``cudnn`` runs dense problems, packed sequences one by one (see ``CUDNN_VARLEN``).
"""

from __future__ import annotations

import math

import torch

from ..mask import band
from ..spec import AttentionSpec
from .base import (Dropout, Kernel, Seqlens, expand_kv_heads, get, like_layout, on_cuda,
                   reduce_kv_heads, register)
from .flash_window import flash_call, flash_cut, flash_window
from .limits import Limits

aten = torch.ops.aten

CUDNN_VARLEN = (
    "ATen's cuDNN varlen attention (_cudnn_attention_forward/_backward with cum_seq_q/k) is not "
    "used: on torch 2.11 its backward takes the longest sequence to be query.size(2), the head "
    "dim of a packed [T, H, E] tensor, so gradients of sequences longer than the head dim are "
    "wrong; it rebuilds its cuDNN graph on every call (118 ms for 2048 sequences of 128 tokens "
    "on an H200) and leaves rows whose sequence has no keys unset"
)


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
    supports_dropout = True
    native_varlen = True
    # flash-attn 2 pads every sequence's rows to 128 in its dQ accumulator
    limits = Limits(rows_per_sequence=256, why="past 2^31 elements ATen's varlen flash reads "
                    "out of bounds; its dense call is tested up to 2^31")

    def _unavailable_reason(self, spec: AttentionSpec, device) -> str | None:
        if spec.head_dim > 256:
            return f"kernel 'flash' supports head_dim <= 256, got {spec.head_dim}"
        if spec.dropout_p > 0 and spec.window is not None:
            return "kernel 'flash' takes dropout without a sliding window only; use window=None"
        return None

    def _forward(self, q, k, v, *, causal, scale, window, dropout: Dropout | None, out, lse):
        rows, keys, win = _dense_window(q, k, causal, window)
        if win is None:  # one flash call per sequence would reset the window: go through varlen
            out, lse = self.varlen_forward(*map(_to_packed, (q, k, v)),
                                           _batch(q.shape[0], q.shape[2], k.shape[2]),
                                           causal=causal, scale=scale, window=window)
            return (_from_packed(out, q),
                    lse.view(q.shape[1], q.shape[0], -1).transpose(0, 1).contiguous())
        lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        if rows == 0:
            return torch.zeros_like(q), lse
        p = dropout.p if dropout is not None else 0.0
        with on_cuda(dropout, q.device):
            o, l, *state, _ = aten._flash_attention_forward(
                *(t.transpose(1, 2) for t in (q[:, :, :rows], k[:, :, :keys], v[:, :, :keys])),
                None, None, rows, keys, p, win.causal, False, scale=scale,
                window_size_left=win.left, window_size_right=win.right,
            )
        if p > 0:
            dropout.state = tuple(state)  # philox seed and offset, replayed by the backward
        lse[:, :, :rows] = _no_key_to_minus_inf(l)
        return _filled(o.transpose(1, 2), q), lse

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale, window,
                  dropout: Dropout | None, dq, dk, dv):
        rows, keys, win = _dense_window(q, k, causal, window)
        if win is None:
            grads = self.varlen_backward(
                *map(_to_packed, (dout, q, k, v, out)), lse.transpose(0, 1).reshape(q.shape[1], -1),
                _batch(q.shape[0], q.shape[2], k.shape[2]), causal=causal, scale=scale,
                window=window)
            return tuple(_from_packed(g, t) for g, t in zip(grads, (q, k, v)))
        if rows == 0:
            return tuple(torch.zeros_like(t) for t in (q, k, v))
        grads = aten._flash_attention_backward(
            *(t.transpose(1, 2) for t in (dout[:, :, :rows], q[:, :, :rows], k[:, :, :keys],
                                          v[:, :, :keys], out[:, :, :rows])),
            _no_key_to_plus_inf(lse[:, :, :rows]).contiguous(), None, None, rows, keys,
            dropout.p if dropout is not None else 0.0, win.causal,
            *(dropout.state if dropout is not None and dropout.p > 0 else _rng_state(q.device)),
            scale=scale, window_size_left=win.left, window_size_right=win.right,
        )
        return tuple(_filled(g.transpose(1, 2), t) for g, t in zip(grads, (q, k, v)))

    def _varlen_forward(self, q, k, v, seqlens: Seqlens, *, causal, scale, window, out=None,
                        lse=None):
        call = flash_call(seqlens, q.shape[0], k.shape[0], band(causal, window))
        if call is None or q.shape[0] == 0 or k.shape[0] == 0:
            return super()._varlen_forward(q, k, v, seqlens, causal=causal, scale=scale,
                                           window=window, out=out, lse=lse)
        cu_q, cu_k = call.seqlens.tensors(q.device)
        out, lse, *_ = aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, call.max_q, call.max_k, 0.0, call.window.causal, False,
            scale=scale, window_size_left=call.window.left, window_size_right=call.window.right,
        )
        return out, _no_key_to_minus_inf(lse)

    def _varlen_backward(self, dout, q, k, v, out, lse, seqlens: Seqlens, *, causal, scale,
                         window, dq=None, dk=None, dv=None):
        call = flash_call(seqlens, q.shape[0], k.shape[0], band(causal, window))
        if call is None or q.shape[0] == 0 or k.shape[0] == 0:
            return super()._varlen_backward(dout, q, k, v, out, lse, seqlens, causal=causal,
                                            scale=scale, window=window, dq=dq, dk=dk, dv=dv)
        cu_q, cu_k = call.seqlens.tensors(q.device)
        return aten._flash_attention_backward(
            dout, q, k, v, out, _no_key_to_plus_inf(lse), cu_q, cu_k, call.max_q, call.max_k,
            0.0, call.window.causal, *_rng_state(q.device), scale=scale,
            window_size_left=call.window.left, window_size_right=call.window.right,
        )


def _dense_window(q, k, causal, window):
    """(rows, keys, flash window) of a dense call; window None when flash's dense call would
    reset it (more queries than keys: the max key length it compares with is the keys')."""
    rows, keys = flash_cut(q.shape[2], k.shape[2], band(causal, window))
    win = flash_window(band(causal, window), keys - rows, max(rows, 1), max(keys, 1))
    return rows, keys, (win if win.min_max_k <= max(keys, 1) else None)


def _batch(b: int, s_q: int, s_k: int) -> Seqlens:
    """A dense batch of b sequences as packed sequences."""
    return Seqlens(tuple(range(0, b * s_q + 1, s_q)), tuple(range(0, b * s_k + 1, s_k)))


def _to_packed(t: torch.Tensor) -> torch.Tensor:
    """[B, H, S, E] -> [B*S, H, E] (a view for BSHE memory)."""
    return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], t.shape[3])


def _from_packed(t: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """[B*S, H, E] -> [B, H, S, E] in ``model``'s layout."""
    return like_layout(t.reshape(model.shape[0], -1, *t.shape[1:]).transpose(1, 2), model)


def _filled(part: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """``part``, the leading rows of a tensor shaped like ``model`` ([B, H, S, E]), as all of
    it in ``model``'s layout: the rows flash did not see get 0."""
    if part.shape == model.shape:
        return like_layout(part, model)
    full = torch.zeros_like(model)
    full[:, :, :part.shape[2]] = part
    return full


class CudnnKernel(Kernel):
    """ATen cuDNN attention (``_scaled_dot_product_cudnn_attention``). cuDNN refuses one query
    and one key ("s_q = s_kv = 1 is not supported"): that block runs on the reference kernel."""

    name = "cudnn"
    limits = Limits(why="past 2^31 elements ATen's cuDNN backward returns a wrong dQ")

    def _unavailable_reason(self, spec: AttentionSpec, device) -> str | None:
        if spec.head_dim > 128:
            return f"kernel 'cudnn' supports head_dim <= 128 here, got {spec.head_dim}"
        if torch.backends.cudnn.version() is None:
            return "kernel 'cudnn' needs torch built with cuDNN"
        return None

    def _forward(self, q, k, v, *, causal, scale, window, dropout: Dropout | None, out, lse):
        if q.shape[2] == k.shape[2] == 1:
            return get("reference").forward(q, k, v, causal=causal, scale=scale)
        groups = q.shape[1] // k.shape[1]
        k, v = expand_kv_heads(k, groups), expand_kv_heads(v, groups)
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.view(lse.shape[:3])

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale, window,
                  dropout: Dropout | None, dq, dk, dv):
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
