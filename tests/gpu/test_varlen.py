"""Packed (THD) attention and sliding windows on one CUDA GPU: every way of running packed
sequences (flash varlen, cuDNN per sequence, one padded dense call, long sequences per
sequence with the short ones in one varlen call, ``auto``) and
flash's windows against the test reference (tests/reference.py: torch SDPA in fp64, math
backend) run sequence by sequence, forward and backward, with empty and one-token sequences,
padded packs and GQA.

Run on a GPU machine: python -m pytest -q tests/gpu/test_varlen.py
Tolerances: TOLERANCES in tests/reference.py for the inputs' dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

import sdpa_fusion
from sdpa_fusion.kernels import KernelUnavailable, Padded, PerSequence, Seqlens, Split, Varlen, get
from sdpa_fusion.mask import Window
from tests import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, H_KV, E, SCALE = 8, 2, 64, 0.125
LENGTHS = [37, 0, 1, 300, 5, 128, 0, 2, 64]
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)


def cumulative(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def packed(total, dtype, seed, kv_total=None, grad=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv_total = total if kv_total is None else kv_total

    def randn(t, h):
        return torch.randn(t, h, E, device="cuda", generator=g).to(dtype).requires_grad_(grad)

    return randn(total, H), randn(kv_total, H_KV), randn(kv_total, H_KV), randn(total, H).detach()


def check_sequences(out, grads, q, k, v, dout, causal, window, **packing):
    """out and ``grads`` (dq, dk, dv) against the reference run on each sequence alone;
    ``packing``: the sequences (``cu_seqlens`` and ``cu_seqlens_k`` or
    ``cu_seqlens_padded`` of ``reference.packed``); 0 outside them."""
    want = reference.packed(q, k, v, dout, causal=causal, scale=SCALE, window=window, **packing)
    reference.assert_results((out, *grads), want)


def way(name):
    return {"cudnn per-sequence": PerSequence("cudnn"), "cudnn padded": Padded("cudnn"),
            "flash padded": Padded("flash"), "flash varlen": Varlen("flash"),
            "split": Split("cudnn", "flash", 64)}.get(name, name)


# ---- every way, through attention(layout="thd") -----------------------------------------------
WAYS = ["flash", "cudnn", "auto", "cudnn per-sequence", "flash varlen", "split"]
PADDED = ["cudnn padded", "flash padded"]  # causal only: padding keys come after each sequence


@DTYPES
@pytest.mark.parametrize("kernel, causal", [(w, c) for w in WAYS for c in (False, True)] +
                         [(w, True) for w in PADDED], ids=str)
def test_thd_matches_torch_per_sequence(kernel, causal, dtype):
    total = sum(LENGTHS)
    q, k, v, dout = packed(total, dtype, seed=1)
    out = sdpa_fusion.attention(q, k, v, layout="thd", causal=causal, scale=SCALE,
                                kernel=way(kernel), cu_seqlens=torch.tensor(cumulative(LENGTHS),
                                                                            device="cuda"))
    out.backward(dout)
    check_sequences(out, (q.grad, k.grad, v.grad), q, k, v, dout, causal, None,
                    cu_seqlens=cumulative(LENGTHS))


@pytest.mark.parametrize("kernel", ["flash", "cudnn", "auto", "cudnn padded", "split"])
def test_padded_pack_keeps_padding_out_of_everything(kernel):
    """Padding holds NaN (in q, k, v and dout): real tokens are exact, padding gets 0."""
    lengths, room = [37, 0, 1, 300, 5], [40, 3, 8, 300, 9]
    starts = cumulative(room)
    q, k, v, dout = packed(starts[-1], torch.bfloat16, seed=2, grad=False)
    real = torch.zeros(starts[-1], dtype=torch.bool, device="cuda")
    for a, n in zip(starts, lengths):
        real[a:a + n] = True
    for t in (q, k, v, dout):
        t[~real] = math.nan
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = sdpa_fusion.attention(q, k, v, layout="thd", causal=True, scale=SCALE, kernel=way(kernel),
                                cu_seqlens=torch.tensor(cumulative(lengths), device="cuda"),
                                cu_seqlens_padded=torch.tensor(starts, device="cuda"))
    out.backward(dout)
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.all(t.detach()[~real] == 0), f"{name} is 0 on padding"
    check_sequences(out, (q.grad, k.grad, v.grad), q, k, v, dout, True, None,
                    cu_seqlens=cumulative(lengths), cu_seqlens_padded=starts)


# ---- flash: windows, and queries != keys per sequence --------------------------------------------
@pytest.mark.parametrize("window", [(16, 0), (0, 0), (7, 5), (None, 3), (20, None)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_varlen_window(causal, window):
    total = sum(LENGTHS)
    q, k, v, dout = packed(total, torch.float16, seed=3)
    out = sdpa_fusion.attention(q, k, v, layout="thd", causal=causal, scale=SCALE, kernel="flash",
                                window=window, cu_seqlens=cumulative(LENGTHS))
    out.backward(dout)
    check_sequences(out, (q.grad, k.grad, v.grad), q, k, v, dout, causal, window,
                    cu_seqlens=cumulative(LENGTHS))


@pytest.mark.parametrize("pairs, window", [
    ([(10, 40), (40, 70), (3, 33)], None),          # one shift (keys - queries = 30): one call
    ([(50, 20), (33, 3), (0, 5), (4, 0)], (8, 0)),   # more queries than keys, a window
    ([(10, 40), (40, 10), (1, 1)], None),            # different shifts: one by one
    ([(10, 40), (40, 10), (1, 1)], (None, None)),    # no mask: one call whatever the lengths
    ([(100, 10), (70, 20)], (50, None)),             # a left window only, 50 more queries
], ids=["shift30", "window", "mixed-shifts", "full", "left-only"])
def test_flash_varlen_queries_and_keys_of_different_lengths(pairs, window):
    """Top-left alignment per sequence (flash's own is bottom-right)."""
    causal = window not in ((None, None), (50, None))
    seqlens = Seqlens(tuple(cumulative(n for n, _ in pairs)), tuple(cumulative(m for _, m in pairs)))
    q, k, v, dout = packed(seqlens.cu_q[-1], torch.float16, seed=4, kv_total=seqlens.cu_k[-1],
                           grad=False)
    flash = get("flash")
    w = Window.of(window)
    out, lse = flash.varlen_forward(q, k, v, seqlens, causal=causal, scale=SCALE, window=w)
    grads = flash.varlen_backward(dout, q, k, v, out, lse, seqlens, causal=causal, scale=SCALE,
                                  window=w)
    assert lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32
    check_sequences(out, grads, q, k, v, dout, causal, window, cu_seqlens=seqlens.cu_q,
                    cu_seqlens_k=seqlens.cu_k)
    for a, b, (n, m) in zip(seqlens.cu_q, seqlens.cu_k, pairs):
        if n and not m:
            assert torch.all(lse[:, a:a + n] == -math.inf) and torch.all(out[a:a + n] == 0)
        if m and not n:
            assert torch.all(grads[1][b:b + m] == 0) and torch.all(grads[2][b:b + m] == 0)


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("s_q, s_kv, causal, window", [
    (200, 200, False, (32, 0)), (200, 200, True, (None, None)), (150, 260, True, None),
    (260, 150, True, None), (260, 150, False, (10, 3)), (300, 100, True, None),
    (300, 100, False, (120, None)),
], ids=str)
def test_flash_dense_top_left_masks(layout, s_q, s_kv, causal, window):
    from sdpa_fusion import Layout

    lay = Layout.of(layout)
    g = torch.Generator(device="cuda").manual_seed(5)

    def randn(shape):
        return lay.to(torch.randn(shape, device="cuda", generator=g).half()).requires_grad_()

    q, k, v = randn((2, H, s_q, E)), randn((2, H_KV, s_kv, E)), randn((2, H_KV, s_kv, E))
    dout = randn((2, H, s_q, E)).detach()
    window = None if window == (None, None) else window
    out = sdpa_fusion.attention(q, k, v, layout=layout, causal=causal, scale=SCALE, kernel="flash",
                                window=window)
    out.backward(dout)
    assert lay.to(out) is out and lay.to(q.grad) is q.grad, "outputs keep the inputs' layout"
    want = reference.attention(q, k, v, dout, causal=causal, scale=SCALE, window=window)
    reference.assert_results((out, q.grad, k.grad, v.grad), want)


# ---- choice and refusals ---------------------------------------------------------------------
def test_auto_explains_its_choice():
    q, k, v, _ = packed(64 * 128, torch.bfloat16, seed=6, grad=False)
    plan = sdpa_fusion.explain(q, k, v, layout="thd", causal=True, cu_seqlens=list(range(0, 8193, 128)))
    assert plan.kernel.name in ("cudnn padded", "flash varlen", "cudnn per-sequence", "fa4 varlen")
    assert plan.why.startswith(f"auto chose {plan.kernel.name} for these packed sequences: ")
    assert any("flash varlen" in note for note in (plan.why, *plan.skipped))


def test_cudnn_has_no_window():
    q, k, v, _ = packed(64, torch.bfloat16, seed=7, grad=False)
    with pytest.raises(KernelUnavailable, match="kernel 'cudnn' has no sliding window"):
        sdpa_fusion.attention(q, k, v, layout="thd", cu_seqlens=[0, 64], kernel="cudnn",
                              window=(8, 0))
    plan = sdpa_fusion.explain(q, k, v, layout="thd", cu_seqlens=[0, 64], window=(8, 0))
    assert plan.kernel.name.startswith("flash")
