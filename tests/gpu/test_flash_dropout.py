"""Dropout of the ATen flash kernel on a CUDA GPU: the mask of a ``Dropout`` stream, drawn
under the CUDA generator seeded with it, and replayed by the backward (philox state).

    python -m pytest -q tests/gpu/test_flash_dropout.py

With q = 0 (uniform attention over the keys a row sees: S, or i + 1 causal) and v the identity
(head dim S), out * keys * (1 - p) is the keep mask itself (0 or 1). The nvFuser kernel's dropout: tests/gpu/test_nvfuser_kernel.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from sdpa_fusion.kernels import Dropout, get
from tests import reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

B, H, S, P = 2, 4, 128, 0.2
kernel = get("flash")


def keep_mask(seed: int, causal: bool = False) -> torch.Tensor:
    q = torch.zeros(B, H, S, S, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16)
    v = torch.eye(S, device="cuda", dtype=torch.bfloat16).expand(B, H, S, S).contiguous()
    out, _ = kernel.forward(q, k, v, causal=causal, scale=1.0, dropout=Dropout(P, seed))
    seen = torch.arange(1, S + 1, device="cuda")[:, None] if causal else S  # keys per row
    scaled = out.float() * seen * (1 - P)
    assert (scaled - scaled.round()).abs().max() < 0.05, "out * keys * (1 - p): 0 or 1"
    return scaled.round()


def test_the_stream_decides_the_mask():
    mask = keep_mask(7)
    n = mask.numel()
    dropped = 1 - mask.mean().item()
    assert abs(dropped - P) < 6 * math.sqrt(P * (1 - P) / n) + 1e-3, f"dropped {dropped:.4f}"
    assert torch.equal(keep_mask(7), mask) and not torch.equal(keep_mask(8), mask)
    torch.manual_seed(0)  # torch's generator does not enter: the stream's seed does
    assert torch.equal(keep_mask(7), mask)


def test_backward_replays_the_forward_mask():
    """out = (softmax * M / (1 - p)) v with the mask M of the stream, and the gradients of
    that formula (the test reference with that keep-mask), causal, within the bf16 level of
    its TOLERANCES."""
    mask = keep_mask(1234, causal=True)
    q, k, v, dout = (torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    dropout = Dropout(P, 1234)
    out, lse = kernel.forward(q, k, v, causal=True, scale=S ** -0.5, dropout=dropout)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=S ** -0.5,
                            dropout=dropout)
    want = reference.attention(q, k, v, dout, causal=True, scale=S ** -0.5,
                               dropout=(mask.bool(), P))
    reference.assert_results((out, *grads), want)
