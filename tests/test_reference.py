"""The reference kernel against torch.nn.functional.scaled_dot_product_attention, forward and
backward, with autograd on fp64 copies of the same inputs as the oracle (``sdpa_oracle`` in
conftest.py: explicit top-left causal mask when s_q != s_kv, enable_gqa for GQA).

Run: pytest -q tests/test_reference.py
Tolerances: TOLERANCES in conftest.py for the dtype of the inputs (lse: always fp32's).
"""

from __future__ import annotations

import math

import pytest
import torch

from sdpa_fusion import Layout
from sdpa_fusion.kernels import get
from sdpa_fusion.layout import has_layout

reference = get("reference")


def make(shape, layout: Layout, dtype, rng) -> torch.Tensor:
    return layout.to(torch.randn(shape, generator=rng).to(dtype))


def run_reference(q, k, v, dout, *, causal, scale):
    s = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    out, lse = reference.forward(q, k, v, causal=causal, scale=s)
    dq, dk, dv = reference.backward(dout, q, k, v, out, lse, causal=causal, scale=s)
    return out, lse, dq, dk, dv


def check(q, k, v, dout, assert_close, oracle, *, causal, scale=None):
    got = run_reference(q, k, v, dout, causal=causal, scale=scale)
    want = oracle(q, k, v, dout, causal=causal, scale=scale)
    out, lse, dq, dk, dv = got
    assert out.dtype == q.dtype and dq.dtype == q.dtype and dk.dtype == k.dtype
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        dtype = torch.float32 if name == "lse" else q.dtype
        assert_close(g, w, dtype, msg=name)
    return got


LENGTHS = [(37, 37), (37, 45), (45, 37)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("s_q, s_kv", LENGTHS, ids=lambda s: str(s))
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", [Layout.BHSE, Layout.BSHE], ids=str)
def test_matches_torch_sdpa(layout, causal, heads, kv_heads, s_q, s_kv, dtype, rng, assert_close,
                            sdpa_oracle):
    b, e = 2, 16
    q = make((b, heads, s_q, e), layout, dtype, rng)
    k, v = (make((b, kv_heads, s_kv, e), layout, dtype, rng) for _ in range(2))
    dout = make((b, heads, s_q, e), layout, dtype, rng)
    out, _, dq, dk, dv = check(q, k, v, dout, assert_close, sdpa_oracle, causal=causal)
    assert has_layout(out, layout) and has_layout(dq, layout)
    assert has_layout(dk, layout) and has_layout(dv, layout)


@pytest.mark.parametrize("scale", [0.05, 1.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_scale(scale, causal, rng, assert_close, sdpa_oracle):
    q, k, v, dout = (make((1, 2, 29, 32), Layout.BHSE, torch.float32, rng) for _ in range(4))
    check(q, k, v, dout, assert_close, sdpa_oracle, causal=causal, scale=scale)


def test_causal_top_left_with_more_keys_than_queries(rng, assert_close, sdpa_oracle):
    """Query i sees keys 0..i even when s_kv > s_q (ATen flash would align bottom-right)."""
    q, dout = (make((1, 2, 8, 16), Layout.BHSE, torch.float32, rng) for _ in range(2))
    k, v = (make((1, 2, 24, 16), Layout.BHSE, torch.float32, rng) for _ in range(2))
    _, _, _, dk, dv = check(q, k, v, dout, assert_close, sdpa_oracle, causal=True)
    assert dk[:, :, 8:].abs().max() == 0 and dv[:, :, 8:].abs().max() == 0  # keys no query sees


def test_gqa_gradients_sum_over_the_query_heads_of_a_group(rng, assert_close):
    q, dout = (make((1, 6, 16, 8), Layout.BSHE, torch.float32, rng) for _ in range(2))
    k, v = (make((1, 2, 16, 8), Layout.BSHE, torch.float32, rng) for _ in range(2))
    *_, dk, dv = run_reference(q, k, v, dout, causal=False, scale=None)
    k_x, v_x = (t.repeat_interleave(3, 1) for t in (k, v))
    *_, dk_x, dv_x = run_reference(q, Layout.BSHE.to(k_x), Layout.BSHE.to(v_x), dout,
                                   causal=False, scale=None)
    assert_close(dk, dk_x.unflatten(1, (2, 3)).sum(2))
    assert_close(dv, dv_x.unflatten(1, (2, 3)).sum(2))


def test_backward_block_by_block_with_global_out_and_lse(rng, assert_close):
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


def test_lse_matches_torch_logsumexp(rng, assert_close):
    q = make((2, 4, 33, 16), Layout.BSHE, torch.bfloat16, rng)
    k = make((2, 4, 41, 16), Layout.BSHE, torch.bfloat16, rng)
    _, lse = reference.forward(q, k, k, causal=False, scale=0.5)
    scores = 0.5 * q.double() @ k.double().transpose(-1, -2)
    assert_close(lse, torch.logsumexp(scores, -1), torch.float32)
