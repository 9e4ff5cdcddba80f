"""ATen's fused attention kernels (cuDNN and FlashAttention-2) behind the kernel contract."""

from __future__ import annotations

import torch

from ..spec import AttentionSpec
from .base import Dropout, Kernel, expand_kv_heads, reduce_kv_heads, register

aten = torch.ops.aten


class FlashKernel(Kernel):
    """ATen FlashAttention-2 (``_scaled_dot_product_flash_attention``)."""

    name = "flash"

    def _unavailable_reason(self, spec: AttentionSpec, device) -> str | None:
        if spec.causal and spec.q_len != spec.kv_len:
            return (
                f"kernel 'flash' aligns the causal mask bottom-right, so causal with "
                f"q_len={spec.q_len} != kv_len={spec.kv_len} is not the top-left mask asked for"
            )
        if spec.head_dim > 256:
            return f"kernel 'flash' supports head_dim <= 256, got {spec.head_dim}"
        return None

    def forward(self, q, k, v, *, causal, scale, dropout: Dropout | None = None, window=None):
        groups = q.shape[1] // k.shape[1]
        k, v = expand_kv_heads(k, groups), expand_kv_heads(v, groups)
        out, lse, *_ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, dropout: Dropout | None = None,
                 window=None):
        groups = q.shape[1] // k.shape[1]
        k_x, v_x = expand_kv_heads(k, groups), expand_kv_heads(v, groups)
        s_q, s_k = q.shape[2], k.shape[2]
        # No cum_seq_q/k, as the forward returns for dense tensors (an empty tensor there reads
        # as packed input). The RNG state is unused without dropout.
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k_x, v_x, out, lse, None, None, s_q, s_k, 0.0, causal, seed, offset,
            scale=scale,
        )
        return dq, reduce_kv_heads(dk, groups), reduce_kv_heads(dv, groups)


class CudnnKernel(Kernel):
    """ATen cuDNN attention (``_scaled_dot_product_cudnn_attention``)."""

    name = "cudnn"

    def _unavailable_reason(self, spec: AttentionSpec, device) -> str | None:
        if spec.head_dim > 128:
            return f"kernel 'cudnn' supports head_dim <= 128 here, got {spec.head_dim}"
        if torch.backends.cudnn.version() is None:
            return "kernel 'cudnn' needs torch built with cuDNN"
        return None

    def forward(self, q, k, v, *, causal, scale, dropout: Dropout | None = None, window=None):
        groups = q.shape[1] // k.shape[1]
        k, v = expand_kv_heads(k, groups), expand_kv_heads(v, groups)
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.view(lse.shape[:3])

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, dropout: Dropout | None = None,
                 window=None):
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
