"""Sliding windows on one device (CPU): ``attention(..., window=(left, right))`` dense and
packed against torch SDPA with an explicit mask, the band helpers, FLOPs, and bad windows.

Run: pytest -q tests/test_window.py
Reference: tests/reference.py with ``window=``: torch SDPA in fp64 with the top-left mask
i - left <= j <= i + right built there (``visible``), independently of sdpa_fusion.mask.
"""

from __future__ import annotations

import types

import pytest
import torch

import sdpa_fusion
from sdpa_fusion import AttentionSpec, Layout
from sdpa_fusion.kernels import Kernel, KernelUnavailable, get
from sdpa_fusion.mask import Window, band, visible, visible_pairs
from tests import reference
from tests.reference import assert_close

WINDOWS = [(3, 0), (0, 0), (2, 5), (None, 1), (4, None), (None, None)]


def window_mask(n_q, n_k, left, right):
    """The reference's mask of a window alone (reference.visible; None there when all may
    see)."""
    seen = reference.visible(n_q, n_k, False, (left, right))
    return torch.ones(n_q, n_k, dtype=torch.bool) if seen is None else seen


def make(shape, layout, rng, grad=True):
    t = layout.to(torch.randn(shape, generator=rng))
    return t.requires_grad_(grad)


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q, s_kv", [(19, 19), (12, 19), (19, 12)], ids=str)
@pytest.mark.parametrize("layout", [Layout.BHSE, Layout.BSHE], ids=str)
def test_dense_window_matches_torch(layout, s_q, s_kv, causal, window, rng):
    """Every window kind, causal or not, queries fewer, as many or more than keys."""
    q = make((2, 4, s_q, 16), layout, rng)
    k, v = (make((2, 2, s_kv, 16), layout, rng) for _ in range(2))
    dout = make(q.shape, layout, rng, grad=False)
    out = sdpa_fusion.attention(q, k, v, layout=str(layout), causal=causal, window=window)
    out.backward(dout)
    want = reference.attention(q, k, v, dout, causal=causal, window=window)
    reference.assert_results((out, q.grad, k.grad, v.grad), want)


@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_reference_lse_with_window(window, rng):
    """Rows a window leaves without keys: lse -inf, out 0 (s_q > s_kv + left)."""
    q = make((1, 2, 20, 8), Layout.BHSE, rng, grad=False)
    k, v = (make((1, 2, 6, 8), Layout.BHSE, rng, grad=False) for _ in range(2))
    out, lse = get("reference").forward(q, k, v, causal=False, scale=0.5, window=Window.of(window))
    want_out, want_lse, *_ = reference.attention(q, k, v, causal=False, scale=0.5, window=window)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(want_lse))
    assert_close(lse[torch.isfinite(lse)], want_lse[torch.isfinite(want_lse)], torch.float32)
    assert_close(out, want_out)


def test_visible_and_pair_counts_match_a_brute_force_mask():
    for mask in [(None, None), (None, 0), (2, 0), (0, 3), (5, None), (1, 1)]:
        for n_q, n_k in [(0, 4), (4, 0), (7, 7), (3, 9), (9, 3)]:
            want = window_mask(n_q, n_k, *mask)
            assert torch.equal(visible(n_q, n_k, mask), want)
            assert visible_pairs(n_q, n_k, mask) == int(want.sum())


def test_flops_count_the_pairs_a_window_lets_through():
    spec = AttentionSpec(batch=2, heads=4, kv_heads=4, q_len=10, kv_len=10, head_dim=8,
                         causal=True, window=(3, None))
    pairs = int(window_mask(10, 10, 3, 0).sum())
    assert spec.flops() == 4 * 2 * 4 * pairs * 8
    assert spec.flops(backward=True) == 3.5 * spec.flops()
    packed = AttentionSpec(batch=1, heads=4, kv_heads=4, q_len=15, kv_len=15, head_dim=8,
                           layout="thd", cu_seqlens=(0, 5, 15), window=(2, 2))
    assert packed.flops() == 4 * 4 * 8 * sum(int(window_mask(n, n, 2, 2).sum()) for n in (5, 10))


def test_band_of_causal_and_window():
    assert band(True, Window(4, 3)) == (4, 0)
    assert band(True, None) == (None, 0)
    assert band(False, Window(None, 2)) == (None, 2)


# ---- bad windows, and kernels or schedules without windows ----------------------------------------
@pytest.mark.parametrize("window, message", [
    ((-1, 0), r"^window left=-1 must be a non-negative integer or None \(unbounded\)"),
    ((0, -3), r"^window right=-3 must be a non-negative integer or None"),
    ((1.5, 0), r"^window left=1.5 must be a non-negative integer"),
    ((4,), r"^window=\(4,\) must be a \(left, right\) pair of token counts"),
])
def test_bad_window_then_a_good_call(window, message, rng):
    q, k, v = (make((1, 2, 8, 8), Layout.BHSE, rng, grad=False) for _ in range(3))
    with pytest.raises(ValueError, match=message):
        sdpa_fusion.attention(q, k, v, window=window)
    assert torch.isfinite(sdpa_fusion.attention(q, k, v, window=(2, 0))).all()


class _NoWindow(Kernel):
    name = "plain"
    gpu_only = False
    _forward = _backward = None


def test_kernels_without_a_window_say_so():
    spec = AttentionSpec(batch=1, heads=2, kv_heads=2, q_len=8, kv_len=8, head_dim=8,
                         window=(2, 0))
    assert _NoWindow().unavailable_reason(spec, torch.device("cpu")) == \
        "kernel 'plain' has no sliding window; use kernel='fa4', 'flash' or 'reference'"
    assert get("flash").supports_window and get("reference").supports_window
    assert not get("cudnn").supports_window and not get("nvfuser").supports_window


def test_explain_names_the_window(rng):
    q, k, v = (make((1, 2, 8, 8), Layout.BHSE, rng, grad=False) for _ in range(3))
    plan = sdpa_fusion.explain(q, k, v, causal=True, window=(4, None))
    assert plan.spec.window == Window(4, None) and plan.kernel.name == "reference"
    with pytest.raises(KernelUnavailable, match="CUDA"):
        sdpa_fusion.explain(q, k, v, window=(4, 0), kernel="flash")
