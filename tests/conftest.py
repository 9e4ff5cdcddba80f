"""Helpers shared by the single-process tests.

- ``rng``: a torch.Generator seeded the same for every test (and every rank).
- ``assert_close(actual, expected, dtype=None)``: compares in fp64 with the tolerances of
  TOLERANCES for the dtype the result was computed in (``actual.dtype`` unless given).
- ``sdpa_oracle(q, k, v, dout, causal=, scale=, window=)``: out, lse, dq, dk, dv of torch
  SDPA with autograd on fp64 copies (top-left causal mask and sliding window, GQA through
  enable_gqa; rows that see no key get out 0, lse -inf and give no gradient).
- ``fa4_kernel``: the fa4 kernel; its tests skip without a GPU or FlashAttention-4, and fail
  instead when SDPA_FUSION_REQUIRE_FA4=1 (a GPU machine where FA4 was staged).
- tests marked ``gpu`` are skipped when torch sees no CUDA device.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from sdpa_fusion.mask import Window

SEED = 1234

# (atol, rtol) for results computed in a dtype and compared against an fp64 oracle, on inputs
# of unit scale. fp32 accumulation over a few hundred keys stays near 1e-5; bf16 and fp16
# outputs are off by their rounding (2^-8 and 2^-11 relative) plus the rounding of the
# inputs the gradients are built from.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for results computed in ``dtype``."""
    return TOLERANCES[dtype]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                  msg: str = "") -> None:
    atol, rtol = tolerance(dtype or actual.dtype)
    assert actual.shape == expected.shape, f"{msg}: shape {list(actual.shape)} != {list(expected.shape)}"
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=atol, rtol=rtol,
        msg=lambda m: f"{msg}: {m}" if msg else m,
    )


@pytest.fixture
def assert_close():
    """``assert_close(actual, expected, dtype=None, msg="")`` with TOLERANCES per dtype."""
    return _assert_close


def causal_mask(s_q: int, s_kv: int, device=None) -> torch.Tensor:
    """True where query i may see key j: j <= i (top-left aligned, also when s_q != s_kv)."""
    return torch.ones(s_q, s_kv, dtype=torch.bool, device=device).tril()


def visible(s_q: int, s_kv: int, causal: bool, window=None, device=None) -> torch.Tensor | None:
    """True where query i may see key j under ``causal`` and ``window`` (a Window or a
    (left, right) pair: i - left <= j <= i + right, None unbounded); None when all may."""
    window = Window.of(window) or Window()
    left, right = window.left, window.right
    if not causal and left is None and right is None:
        return None
    i = torch.arange(s_q, device=device).unsqueeze(1)
    j = torch.arange(s_kv, device=device).unsqueeze(0)
    seen = causal_mask(s_q, s_kv, device) if causal else torch.ones(s_q, s_kv, dtype=torch.bool,
                                                                       device=device)
    if left is not None:
        seen = seen & (j >= i - left)
    if right is not None:
        seen = seen & (j <= i + right)
    return seen


def _sdpa_oracle(q, k, v, dout, *, causal: bool, scale: float | None = None, window=None):
    """out, lse, dq, dk, dv of torch SDPA on fp64 copies of logical [B, H, S, E] tensors."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    s_q, s_kv = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    mask = visible(s_q, s_kv, causal, window, q.device)
    # Rows that see no key: torch gives NaN there; they see every key here, then their output
    # is set to 0 and their dout to 0 (a constant output has no gradient).
    empty = None if mask is None else ~mask.any(-1, keepdim=True)
    dout = dout.double()
    if causal and s_q == s_kv and window is None:
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=gqa)
    else:  # explicit mask: torch's own alignment for s_q != s_kv is not what we test against
        attn_mask = None if mask is None else mask | empty
        out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=attn_mask, scale=scale,
                                             enable_gqa=gqa)
        if empty is not None:
            out, dout = out.masked_fill(empty, 0.0), dout.masked_fill(empty, 0.0)
    out.backward(dout)
    groups = q.shape[1] // k.shape[1]
    scores = qd.detach() @ kd.detach().repeat_interleave(groups, 1).transpose(-1, -2)
    scores = scores * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return out.detach(), torch.logsumexp(scores, dim=-1), qd.grad, kd.grad, vd.grad


@pytest.fixture
def sdpa_oracle():
    """``sdpa_oracle(q, k, v, dout, causal=, scale=None, window=None) -> (out, lse, dq, dk,
    dv)`` in fp64."""
    return _sdpa_oracle


@pytest.fixture(scope="session")
def fa4_kernel():
    """The fa4 kernel, when it can run on this GPU; else a skip, or a failure when
    SDPA_FUSION_REQUIRE_FA4=1 says that FlashAttention-4 was installed here."""
    from sdpa_fusion import AttentionSpec
    from sdpa_fusion.kernels import get

    reason = "needs a CUDA GPU; torch sees none"
    if torch.cuda.is_available():
        probe = AttentionSpec(batch=1, heads=8, kv_heads=8, q_len=256, kv_len=256, head_dim=128,
                              dtype=torch.bfloat16)
        reason = get("fa4").unavailable_reason(probe, torch.device("cuda"))
    if reason is None:
        return get("fa4")
    if os.environ.get("SDPA_FUSION_REQUIRE_FA4") == "1":
        pytest.fail(f"SDPA_FUSION_REQUIRE_FA4=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
def rng() -> torch.Generator:
    """A CPU generator seeded with SEED (the same in every test and on every rank)."""
    return torch.Generator().manual_seed(SEED)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


try:  # keep property tests deterministic and free of timing flakes on busy CI machines
    from hypothesis import settings

    settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
    settings.register_profile("dev", deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
except ImportError:
    pass
