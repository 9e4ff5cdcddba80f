"""NaN and Inf in q, k or v propagate through attention on one device (reference kernel) and
through the log-sum-exp merge as through torch SDPA (see tests/nonfinite.py for the rule).

Run: pytest -q tests/test_nonfinite.py
"""

from __future__ import annotations

import pytest
import torch

import sdpa_fusion
from sdpa_fusion.merge import merge_partial

from .nonfinite import VALUES, mismatch, plant


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("value", sorted(VALUES))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_device(causal, where, value, gqa):
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 4, 8, 8, generator=g)
        k, v = (torch.randn(1, 2 if gqa else 4, 8, 8, generator=g) for _ in range(2))
        dout = torch.randn(q.shape, generator=g)
        q, k, v = plant(q, k, v, where, value, seed)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sdpa_fusion.attention(*leaves, causal=causal, kernel="reference")
        out.backward(dout)
        found = mismatch((out, *(t.grad for t in leaves)), q, k, v, dout, causal=causal)
        assert found is None, f"seed {seed}: {found}"


def test_merge_keeps_nan_and_empty_rows():
    """Row 0: the block is NaN (lse NaN); row 1: its output is NaN with a finite lse; row 2:
    no key in either part (0, -inf); row 3: ordinary numbers."""
    out = torch.tensor([[1.0], [1.0], [0.0], [1.0]]).view(1, 1, 4, 1)
    lse = torch.tensor([0.0, 0.0, float("-inf"), 0.0]).view(1, 1, 4)
    block = torch.tensor([[2.0], [float("nan")], [0.0], [3.0]]).view(1, 1, 4, 1)
    block_lse = torch.tensor([float("nan"), 0.0, float("-inf"), 0.0]).view(1, 1, 4)
    merged, merged_lse = merge_partial(out, lse, block, block_lse)
    assert merged.flatten()[:2].isnan().all() and merged_lse[0, 0, 0].isnan()
    assert merged.flatten()[2] == 0 and merged_lse[0, 0, 2] == float("-inf")
    assert merged.flatten()[3] == 2.0 and merged_lse[0, 0, 3] == pytest.approx(torch.log(torch.tensor(2.0)))
