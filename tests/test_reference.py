"""The product's fp32 reference kernel against the test suites' reference
(tests/reference.py: torch SDPA's math in fp64 with autograd on copies of the same inputs,
top-left causal masks when s_q != s_kv, enable_gqa for GQA), forward and backward.

Run: pytest -q tests/test_reference.py
Tolerances: TOLERANCES in tests/reference.py for the dtype of the inputs (lse: always fp32's).
"""

from __future__ import annotations

import math

import pytest
import torch

from sdpa_fusion import Layout
from sdpa_fusion.kernels import get
from sdpa_fusion.layout import has_layout
from tests import reference as test_reference
from tests.reference import assert_close

reference = get("reference")


def make(shape, layout: Layout, dtype, rng) -> torch.Tensor:
    return layout.to(torch.randn(shape, generator=rng).to(dtype))


def run_reference(q, k, v, dout, *, causal, scale):
    s = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    out, lse = reference.forward(q, k, v, causal=causal, scale=s)
    dq, dk, dv = reference.backward(dout, q, k, v, out, lse, causal=causal, scale=s)
    return out, lse, dq, dk, dv


def check(q, k, v, dout, *, causal, scale=None, sharp=False):
    """The kernel's out, lse and gradients equal the test reference's, in the inputs' dtype
    (``sharp``: scores far above unit scale, the table's SHARP level)."""
    got = run_reference(q, k, v, dout, causal=causal, scale=scale)
    want = test_reference.attention(q, k, v, dout, causal=causal, scale=scale)
    out, lse, dq, dk, dv = got
    assert out.dtype == q.dtype and dq.dtype == q.dtype and dk.dtype == k.dtype
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        dtype = torch.float32 if name == "lse" else q.dtype
        assert_close(g, w, dtype, msg=name, sharp=sharp)
    return got


LENGTHS = [(37, 37), (37, 45), (45, 37)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("s_q, s_kv", LENGTHS, ids=lambda s: str(s))
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", [Layout.BHSE, Layout.BSHE], ids=str)
def test_matches_torch_sdpa(layout, causal, heads, kv_heads, s_q, s_kv, dtype, rng):
    """Every layout, mask, GQA, length pair and dtype; results keep the layout."""
    b, e = 2, 16
    q = make((b, heads, s_q, e), layout, dtype, rng)
    k, v = (make((b, kv_heads, s_kv, e), layout, dtype, rng) for _ in range(2))
    dout = make((b, heads, s_q, e), layout, dtype, rng)
    out, _, dq, dk, dv = check(q, k, v, dout, causal=causal)
    assert has_layout(out, layout) and has_layout(dq, layout)
    assert has_layout(dk, layout) and has_layout(dv, layout)


@pytest.mark.parametrize("scale", [0.05, 1.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_scale(scale, causal, rng):
    """A given softmax scale, small and large (1.0 over head dim 32: sharp softmaxes)."""
    q, k, v, dout = (make((1, 2, 29, 32), Layout.BHSE, torch.float32, rng) for _ in range(4))
    check(q, k, v, dout, causal=causal, scale=scale, sharp=scale > 32 ** -0.5)


def test_causal_top_left_with_more_keys_than_queries(rng):
    """Query i sees keys 0..i even when s_kv > s_q (ATen flash would align bottom-right)."""
    q, dout = (make((1, 2, 8, 16), Layout.BHSE, torch.float32, rng) for _ in range(2))
    k, v = (make((1, 2, 24, 16), Layout.BHSE, torch.float32, rng) for _ in range(2))
    _, _, _, dk, dv = check(q, k, v, dout, causal=True)
    assert dk[:, :, 8:].abs().max() == 0 and dv[:, :, 8:].abs().max() == 0  # keys no query sees


def test_gqa_gradients_sum_over_the_query_heads_of_a_group(rng):
    """dK, dV of a K/V head are the sums over its query heads (K/V repeated per head)."""
    q, dout = (make((1, 6, 16, 8), Layout.BSHE, torch.float32, rng) for _ in range(2))
    k, v = (make((1, 2, 16, 8), Layout.BSHE, torch.float32, rng) for _ in range(2))
    *_, dk, dv = run_reference(q, k, v, dout, causal=False, scale=None)
    k_x, v_x = (t.repeat_interleave(3, 1) for t in (k, v))
    *_, dk_x, dv_x = run_reference(q, Layout.BSHE.to(k_x), Layout.BSHE.to(v_x), dout,
                                   causal=False, scale=None)
    assert_close(dk, dk_x.unflatten(1, (2, 3)).sum(2))
    assert_close(dv, dv_x.unflatten(1, (2, 3)).sum(2))


def test_backward_block_by_block_with_global_out_and_lse(rng):
    """The contract ring schedules rely on: backward over KV blocks, each given the global out
    and lse of the rows, sums to dq and concatenates to dk, dv of the whole problem."""
    q, dout = (make((2, 4, 20, 16), Layout.BHSE, torch.float32, rng) for _ in range(2))
    k, v = (make((2, 2, 30, 16), Layout.BHSE, torch.float32, rng) for _ in range(2))
    scale = 0.25
    out, lse, dq, dk, dv = run_reference(q, k, v, dout, causal=False, scale=scale)
    blocks = [reference.backward(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse, causal=False, scale=scale)
              for a, b in ((0, 12), (12, 30))]
    assert_close(blocks[0][0] + blocks[1][0], dq)
    assert_close(torch.cat([blocks[0][1], blocks[1][1]], 2), dk)
    assert_close(torch.cat([blocks[0][2], blocks[1][2]], 2), dv)


def test_lse_matches_torch_logsumexp(rng):
    """lse of bf16 inputs, computed in fp32, equals the reference's (logsumexp of the fp64
    scores)."""
    q = make((2, 4, 33, 16), Layout.BSHE, torch.bfloat16, rng)
    k = make((2, 4, 41, 16), Layout.BSHE, torch.bfloat16, rng)
    _, lse = reference.forward(q, k, k, causal=False, scale=0.5)
    assert_close(lse, test_reference.attention(q, k, k, scale=0.5).lse, torch.float32)
