"""The nvfuser kernel and fusions on a CUDA GPU, against the test reference (tests/reference.py:
torch SDPA in fp64), and its merges against torch's merge.

Run on a GPU machine: python -m pytest -q tests/gpu
Tolerances: tighter than tests/reference.py's TOLERANCES where stated (``TOLERANCE``, ``LSE``).
"""

import math

import pytest
import torch

import sdpa_fusion
from sdpa_fusion.kernels import Dropout, get
from sdpa_fusion.kernels.nvfuser import import_error
from sdpa_fusion.layout import Layout, has_layout
from sdpa_fusion.merge import _merge_fused, _merge_torch, accumulators, fold
from tests import reference
from tests.reference import tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(import_error() is not None, reason="needs nvfuser_direct"),
]

B, H = 2, 8
# bf16: tighter than the table's rtol (the fusions run ATen's flash kernel); fp16: the table's
TOLERANCE = {torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2), torch.float16: tolerance(torch.float16)}
LSE = dict(atol=2e-3, rtol=1e-3)  # lse is fp32 from the first product on
BF16_MERGE = dict(atol=1e-2, rtol=1e-2)  # one rounding into bf16: tighter than the table's
FP32 = tolerance(torch.float32)
LAYOUTS = pytest.mark.parametrize("layout", [Layout.BHSE, Layout.BSHE], ids=str)
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
kernel = get("nvfuser")


def randn(shape, dtype, layout, scale=1.0):
    return layout.to(torch.randn(shape, device="cuda", dtype=torch.float32).mul(scale).to(dtype))


def problem(dtype, layout, kv_heads=H, s_q=256, s_kv=256, e=64):
    q = randn((B, H, s_q, e), dtype, layout)
    k, v = (randn((B, kv_heads, s_kv, e), dtype, layout) for _ in range(2))
    dout = randn((B, H, s_q, e), dtype, layout)
    return q, k, v, dout


def assert_close_all(actual, expected, dtype):
    """(out, dq, dk, dv) equal the reference's ``expected`` within ``TOLERANCE[dtype]``; dK/dV
    of G query heads per K/V head (GQA, MQA) within sqrt(G) x its atol: they are sums of G
    per-head gradients, each rounded to ``dtype`` by the kernel, whose errors add up where
    the heads' gradients cancel (seen: 0.026 on a dV of 0.26 at G = 8)."""
    group = actual[0].shape[1] // actual[2].shape[1]
    for name, a, b in zip(("out", "dq", "dk", "dv"), actual, expected.results):
        tol = dict(TOLERANCE[dtype])
        if name in ("dk", "dv"):
            tol["atol"] *= math.sqrt(group)
        torch.testing.assert_close(a.double(), b, **tol, msg=lambda m: f"{name}: {m}")


CASES = [
    pytest.param(dict(kv_heads=H), id="mha"),
    pytest.param(dict(kv_heads=2), id="gqa"),
    pytest.param(dict(kv_heads=1), id="mqa"),
    pytest.param(dict(kv_heads=2, e=128), id="gqa-e128"),
    pytest.param(dict(e=128, s_q=128, s_kv=384), id="e128-sq128-skv384"),
]


@DTYPES
@LAYOUTS
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES)
def test_forward_backward_match_torch(dtype, layout, causal, case):
    q, k, v, dout = problem(dtype, layout, **case)
    if causal and q.shape[2] != k.shape[2]:
        # ATen flash aligns this mask bottom-right; ours is top-left: refused, not wrong.
        with pytest.raises(sdpa_fusion.KernelUnavailable, match="bottom-right"):
            sdpa_fusion.attention(q, k, v, causal=True, layout=layout.value, kernel="nvfuser")
        return
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    want = reference.attention(q, k, v, dout, causal=causal, scale=scale)
    assert_close_all((out, dq, dk, dv), want, dtype)
    torch.testing.assert_close(lse.double(), want.lse, **LSE)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert has_layout(t, layout), f"{name} strides {t.stride()} are not {layout}"


@LAYOUTS
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
def test_forward_backward_fusion(layout, kv_heads):
    q, k, v, dout = problem(torch.bfloat16, layout, kv_heads=kv_heads)
    out, lse, dq, dk, dv = kernel.forward_backward(q, k, v, dout, causal=True, scale=0.1)
    want = reference.attention(q, k, v, dout, causal=True, scale=0.1)
    assert_close_all((out, dq, dk, dv), want, torch.bfloat16)
    torch.testing.assert_close(lse.double(), want.lse, **LSE)


def test_one_fusion_serves_all_lengths():
    from sdpa_fusion.definitions import SdpaForward

    q, k, v, _ = problem(torch.bfloat16, Layout.BSHE, s_q=128, s_kv=128)
    kernel.forward(q, k, v, causal=True, scale=0.125)
    fd = SdpaForward.cached(kernel._spec(q, k, True, 0.125, None))
    q, k, v, dout = problem(torch.bfloat16, Layout.BSHE, s_q=320, s_kv=320)
    out, _ = kernel.forward(q, k, v, causal=True, scale=0.125)
    assert SdpaForward.cached(kernel._spec(q, k, True, 0.125, None)) is fd
    want = reference.attention(q, k, v, causal=True, scale=0.125).out
    torch.testing.assert_close(out.double(), want, **TOLERANCE[torch.bfloat16])


def test_head_split_on_a_one_device_mesh():
    import nvfuser_direct as nvfuser

    split = type(kernel)(nvfuser.multidevice.DeviceMesh([torch.cuda.current_device()]), 1)
    q, k, v, dout = problem(torch.bfloat16, Layout.BSHE, kv_heads=2)
    out, lse = split.forward(q, k, v, causal=True, scale=0.125)
    dq, dk, dv = split.backward(dout, q, k, v, out, lse, causal=True, scale=0.125)
    want = reference.attention(q, k, v, dout, causal=True, scale=0.125)
    assert_close_all((out, dq, dk, dv), want, torch.bfloat16)


# ---- LseMerge -----------------------------------------------------------------------------
def partials(layout, s=256, e=128):
    out = randn((B, H, s, e), torch.float32, layout)
    block = randn((B, H, s, e), torch.bfloat16, layout)
    lse, block_lse = (torch.randn(B, H, s, device="cuda") * 4 for _ in range(2))
    lse[:, :, :16] = float("-inf")          # rows the accumulator has no key for yet
    block_lse[:, :, 8:24] = float("-inf")   # rows the block masks entirely (8..15: both)
    return out, lse, block, block_lse


@LAYOUTS
def test_lse_merge_fusion_matches_torch(layout):
    out, lse, block, block_lse = partials(layout)
    fused_out, fused_lse = _merge_fused(out, lse, block, block_lse)
    want_out, want_lse = _merge_torch(out, lse, block, block_lse)
    assert not fused_out.isnan().any() and not fused_lse.isnan().any()
    torch.testing.assert_close(fused_out, want_out, **FP32)
    torch.testing.assert_close(fused_lse, want_lse, **FP32)
    assert has_layout(fused_out, layout) and fused_out.dtype == torch.float32
    assert torch.isneginf(fused_lse[:, :, 8:16]).all() and (fused_out[:, :, 8:16] == 0).all()


@LAYOUTS
def test_lse_merge_fusion_into_a_slice(layout):
    out, lse, block, block_lse = partials(layout)
    rows = slice(64, 192)
    want_out, want_lse = out.clone(), lse.clone()
    want_out[:, :, rows], want_lse[:, :, rows] = _merge_torch(
        out[:, :, rows], lse[:, :, rows], block[:, :, rows], block_lse[:, :, rows]
    )
    out, lse = fold(out, lse, layout.to(block[:, :, rows]), block_lse[:, :, rows].contiguous(), rows=rows)
    torch.testing.assert_close(out, want_out, **FP32)
    torch.testing.assert_close(lse, want_lse, **FP32)


@LAYOUTS
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [slice(None), slice(64, 192)], ids=["all", "slice"])
@pytest.mark.parametrize("heads", [slice(None), slice(2, 6)], ids=["heads", "head-slice"])
def test_lse_merge_fusion_folds_into_views(layout, acc_dtype, rows, heads):
    """The fold into the accumulator, or into some rows or heads of it (a ring's late half,
    a head group), gives torch's merge, rounded once into a bf16 accumulator, written into
    the accumulator's own storage; never a fallback to torch."""
    from sdpa_fusion import merge

    out, lse, block, block_lse = partials(layout)
    out = out.to(acc_dtype)
    want_out, want_lse = out.clone(), lse.clone()
    merged_out, merged_lse = _merge_torch(out[:, heads, rows], lse[:, heads, rows],
                                          block[:, heads, rows], block_lse[:, heads, rows])
    want_out[:, heads, rows], want_lse[:, heads, rows] = merged_out.to(acc_dtype), merged_lse
    storage = out.data_ptr()
    fold(out[:, heads], lse[:, heads], layout.to(block[:, heads, rows]),
         block_lse[:, heads, rows].contiguous(), rows=rows)
    assert not merge._UNFUSED, "LseMerge in place failed here"
    assert out.data_ptr() == storage and out.dtype == acc_dtype and has_layout(out, layout)
    tol = FP32 if acc_dtype == torch.float32 else BF16_MERGE
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(lse, want_lse, **FP32)
    assert torch.isneginf(lse[:, :, 8:16]).all() and not out.isnan().any()


def test_lse_merge_fusion_over_two_kv_blocks():
    q, k, v, _ = problem(torch.bfloat16, Layout.BSHE, kv_heads=2, s_q=256, s_kv=512)
    out_acc, lse_acc = accumulators(q)
    for k_i, v_i in zip(k.chunk(2, dim=2), v.chunk(2, dim=2)):
        out_acc, lse_acc = fold(out_acc, lse_acc, *kernel.forward(q, k_i, v_i, causal=False, scale=0.125))
    want_out, want_lse = kernel.forward(q, k, v, causal=False, scale=0.125)
    torch.testing.assert_close(out_acc, want_out.float(), **BF16_MERGE)
    # lse of two bf16 calls merged against one call's: fp32 sums of another order
    torch.testing.assert_close(lse_acc, want_lse, atol=1e-4, rtol=1e-4)


# ---- dropout ------------------------------------------------------------------------------
S = 128  # S == E: with v = I, out = the dropped, rescaled attention matrix itself
P = 0.2


def identity_run(seed, layout=Layout.BHSE):
    """q = 0 (uniform attention 1/S), v = I: out * S * (1 - p) is the keep mask."""
    q = randn((B, H, S, S), torch.bfloat16, layout, scale=0.0)
    k = randn((B, H, S, S), torch.bfloat16, layout)
    v = layout.to(torch.eye(S, device="cuda", dtype=torch.bfloat16).expand(B, H, S, S))
    out, _ = kernel.forward(q, k, v, causal=False, scale=1.0, dropout=Dropout(P, seed))
    return out.float() * S * (1 - P)


def keep_mask(seed):
    scaled = identity_run(seed)
    assert (scaled - scaled.round()).abs().max() < 0.05, "out * S * (1-p) should be 0 or 1"
    return scaled.round()


def test_dropout_drops_a_fraction_p():
    """Each of the n = B*H*S*S weights is dropped with probability p: the dropped fraction lies
    within six binomial standard deviations sqrt(p(1-p)/n) of p (about 0.005 here; flash
    quantizes the keep probability to 1/256 steps, a bias of 0.0008)."""
    mask = keep_mask(0)
    n = mask.numel()
    dropped = 1 - mask.mean().item()
    bound = 6 * math.sqrt(P * (1 - P) / n)  # six binomial standard deviations
    assert abs(dropped - P) < bound, f"dropped {dropped:.4f} of {n}, expected {P} +- {bound:.4f}"


def test_dropout_is_reproducible_by_seed():
    assert torch.equal(identity_run(7), identity_run(7))
    assert not torch.equal(identity_run(7), identity_run(8))


@LAYOUTS
def test_dropout_backward_replays_the_forward_mask(layout):
    """With the mask M of the identity run (same seed, same shapes), out = (softmax * M/(1-p)) v
    and the gradients are those of that expression."""
    mask = keep_mask(1234)
    q, k, v, dout = (randn((B, H, S, S), torch.bfloat16, layout) for _ in range(4))
    dropout = Dropout(P, 1234)
    out, lse = kernel.forward(q, k, v, causal=False, scale=S ** -0.5, dropout=dropout)
    assert len(dropout.state) == 2  # philox seed and offset
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=False, scale=S ** -0.5, dropout=dropout)

    want = reference.attention(q, k, v, dout, scale=S ** -0.5, dropout=(mask.bool(), P))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want.results):
        # the table's bf16 rtol, an atol tighter than its level
        torch.testing.assert_close(a.double(), b, atol=1e-2, rtol=2e-2,
                                   msg=lambda m: f"{name}: {m}")


def test_dropout_forward_backward_fusion_replays_its_mask():
    mask = keep_mask(99)
    q = randn((B, H, S, S), torch.bfloat16, Layout.BHSE, scale=0.0)
    k = randn((B, H, S, S), torch.bfloat16, Layout.BHSE)
    v = torch.randn(B, H, S, S, device="cuda").bfloat16()
    dout = torch.randn(B, H, S, S, device="cuda").bfloat16()
    dropout = Dropout(P, 99)
    out, _, _, _, dv = kernel.forward_backward(q, k, v, dout, causal=False, scale=1.0, dropout=dropout)
    want = reference.attention(q, k, v, dout, scale=1.0, dropout=(mask.bool(), P))  # q = 0
    torch.testing.assert_close(out.double(), want.out, atol=1e-2, rtol=2e-2)  # atol: as above
    torch.testing.assert_close(dv.double(), want.dv, atol=1e-2, rtol=2e-2)
    assert len(dropout.state) == 2


def test_backward_without_the_forward_rng_state_raises():
    q, k, v, dout = problem(torch.bfloat16, Layout.BHSE)
    with pytest.raises(ValueError, match="pass the Dropout object that the forward filled in"):
        kernel.backward(dout, q, k, v, q, torch.zeros(B, H, 256, device="cuda"), causal=False,
                        scale=0.1, dropout=Dropout(P))
