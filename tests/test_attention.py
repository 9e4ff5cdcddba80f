"""``sdpa_fusion.attention`` on one device (CPU): layouts of outputs and gradients, packed
(thd) sequences, kernel choice and its errors, ``explain``.

Run: pytest -q tests/test_attention.py
Reference: tests/reference.py (torch SDPA in fp64 with autograd); tolerances: its TOLERANCES
for the dtype of the results.
"""

from __future__ import annotations

import pytest
import torch

import sdpa_fusion
from sdpa_fusion import KernelUnavailable, Layout
from sdpa_fusion.kernels import get, names
from sdpa_fusion.layout import has_layout
from tests import reference
from tests.reference import assert_close


def make(shape, layout: Layout, rng, dtype=torch.float32, grad=False) -> torch.Tensor:
    t = layout.to(torch.randn(shape, generator=rng).to(dtype))
    return t.requires_grad_() if grad else t


def qkv(rng, layout=Layout.BSHE, b=2, h=4, h_kv=2, s_q=24, s_kv=24, e=16, dtype=torch.float32):
    q = make((b, h, s_q, e), layout, rng, dtype, grad=True)
    k, v = (make((b, h_kv, s_kv, e), layout, rng, dtype, grad=True) for _ in range(2))
    return q, k, v


# ---- dense layouts ---------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["reference", "auto"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", [Layout.BHSE, Layout.BSHE], ids=str)
def test_matches_torch_and_keeps_layouts(layout, causal, kernel, rng):
    """out and gradients equal the reference and keep the layouts of q, k, v."""
    q, k, v = qkv(rng, layout, s_q=24, s_kv=24 if causal else 31)
    dout = make(q.shape, layout, rng)
    out = sdpa_fusion.attention(q, k, v, causal=causal, layout=str(layout), kernel=kernel)
    out.backward(dout)
    assert has_layout(out, layout), "the output keeps the query's layout"
    for name, t in zip("qkv", (q, k, v)):
        assert has_layout(t.grad, layout), f"d{name} is in the layout of {name}"
    want = reference.attention(q, k, v, dout, causal=causal)
    reference.assert_results((out, q.grad, k.grad, v.grad), want)


def test_bf16_with_scale_and_gqa(rng):
    """bf16 results (and gradients) within bf16's tolerance, GQA 8:2, a given scale."""
    q, k, v = qkv(rng, Layout.BSHE, h=8, h_kv=2, s_q=37, s_kv=37, dtype=torch.bfloat16)
    dout = make(q.shape, Layout.BSHE, rng, torch.bfloat16)
    out = sdpa_fusion.attention(q, k, v, causal=True, scale=0.2, layout="bshe")
    out.backward(dout)
    want = reference.attention(q, k, v, dout, causal=True, scale=0.2)
    assert out.dtype == torch.bfloat16 and q.grad.dtype == torch.bfloat16
    reference.assert_results((out, q.grad, k.grad, v.grad), want)


def test_gradient_in_another_layout_is_accepted(rng):
    """A dout in another layout than out: dq keeps q's layout and equals the reference."""
    q, k, v = qkv(rng, Layout.BSHE)
    dout = make(q.shape, Layout.BHSE, rng)
    sdpa_fusion.attention(q, k, v, layout="bshe", kernel="reference").backward(dout)
    want = reference.attention(q, k, v, dout, causal=False)
    assert has_layout(q.grad, Layout.BSHE)
    assert_close(q.grad, want.dq)


def test_claimed_layout_is_checked(rng):
    q, k, v = qkv(rng, Layout.BSHE)
    with pytest.raises(ValueError, match=r"^q .* does not have the layout 'bhse' it claims"):
        sdpa_fusion.attention(q, k, v, layout="bhse")


# ---- packed sequences (thd) ------------------------------------------------------------------
def cu(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_thd_matches_torch_per_sequence(padded, causal, rng):
    """Packed sequences (in user padding or not) equal the reference run sequence by
    sequence; padding tokens get zero output and gradients."""
    lengths = [7, 1, 13, 9]
    room = [8, 4, 16, 12] if padded else lengths
    starts = [sum(room[:i]) for i in range(len(room))]
    total = sum(room)
    cu_seqlens = cu(*[sum(lengths[:i]) for i in range(len(lengths) + 1)])
    cu_padded = cu(*starts, total) if padded else None
    h, h_kv, e = 4, 2, 16
    q = make((total, h, e), Layout.THD, rng, grad=True)
    k, v = (make((total, h_kv, e), Layout.THD, rng, grad=True) for _ in range(2))
    dout = make((total, h, e), Layout.THD, rng)

    out = sdpa_fusion.attention(q, k, v, causal=causal, layout="thd", cu_seqlens=cu_seqlens,
                                cu_seqlens_padded=cu_padded)
    out.backward(dout)

    assert out.shape == (total, h, e) and has_layout(out, Layout.THD)
    real = torch.zeros(total, dtype=torch.bool)
    for start, n in zip(starts, lengths):
        real[start:start + n] = True
    want = reference.packed(q, k, v, dout, cu_seqlens, cu_seqlens_padded=cu_padded, causal=causal)
    reference.assert_results((out, q.grad, k.grad, v.grad), want)
    if padded:
        for name, t in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad)):
            assert t[~real].abs().max().item() == 0, f"{name} is zero on padding tokens"


def test_thd_sequences_do_not_see_each_other(rng):
    q, k, v = (make((10, 2, 8), Layout.THD, rng) for _ in range(3))
    out = sdpa_fusion.attention(q, k, v, layout="thd", cu_seqlens=cu(0, 4, 10))
    v2 = v.clone()
    v2[4:] += 100.0  # only the second sequence's values change
    out2 = sdpa_fusion.attention(q, k, v2, layout="thd", cu_seqlens=cu(0, 4, 10))
    assert torch.equal(out[:4], out2[:4])


# ---- kernels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["flash", "cudnn", "nvfuser", "fa4"])
def test_gpu_kernels_on_cpu_tensors_raise_kernel_unavailable(kernel, rng):
    q, k, v = qkv(rng, dtype=torch.bfloat16)
    with pytest.raises(KernelUnavailable, match=rf"^kernel '{kernel}' runs on CUDA GPUs only; .* on cpu"):
        sdpa_fusion.attention(q, k, v, layout="bshe", kernel=kernel)


def test_kernel_unavailable_is_a_value_error():
    assert issubclass(KernelUnavailable, ValueError)


def test_unknown_kernel_lists_the_known_ones(rng):
    q, k, v = qkv(rng)
    known = r"\['cudnn', 'fa4', 'flash', 'nvfuser', 'reference', 'auto'\]"
    with pytest.raises(ValueError, match=rf"^kernel='triton' is not known; choose one of {known}"):
        sdpa_fusion.attention(q, k, v, layout="bshe", kernel="triton")


def test_kernel_names():
    assert {"auto", "cudnn", "fa4", "flash", "nvfuser", "reference"} <= set(names())


def test_a_kernel_object_can_be_passed(rng):
    """A kernel object runs what its registered name runs."""
    q, k, v = qkv(rng)
    ref = get("reference")
    assert_close(sdpa_fusion.attention(q, k, v, layout="bshe", kernel=ref),
                 sdpa_fusion.attention(q, k, v, layout="bshe", kernel="reference"))


# ---- explain ---------------------------------------------------------------------------------
def test_explain_reports_the_reference_kernel_on_cpu(rng):
    q, k, v = qkv(rng)
    plan = sdpa_fusion.explain(q, k, v, layout="bshe", causal=True)
    assert plan.kernel.name == "reference"
    assert plan.spec.causal and plan.spec.layout is Layout.BSHE and plan.spec.kv_heads == 2
    text = str(plan)
    assert "kernel: reference" in text and "one device" in text


def test_explain_raises_what_attention_would(rng):
    q, k, v = qkv(rng)
    with pytest.raises(KernelUnavailable, match="CUDA"):
        sdpa_fusion.explain(q, k, v, layout="bshe", kernel="flash")


# ---- plans kept across calls -------------------------------------------------------------------
def _counting_plans(monkeypatch):
    from sdpa_fusion import api

    made = []

    def counted(*args, **kwargs):
        made.append(kwargs)
        return plan(*args, **kwargs)

    plan = api.plan
    monkeypatch.setattr(api, "plan", counted)
    monkeypatch.setattr(api, "_PLANS", type(api._PLANS)())
    return made


def test_a_call_like_an_earlier_one_reuses_its_plan_and_stays_right(monkeypatch, rng):
    """A model's layers call attention alike every step: planned once, right every time;
    another shape, memory order or option is planned anew."""
    made = _counting_plans(monkeypatch)
    for layout, causal in [(Layout.BHSE, True), (Layout.BHSE, True), (Layout.BSHE, True),
                           (Layout.BHSE, False), (Layout.BHSE, True)]:
        q, k, v = qkv(rng, layout)
        out = sdpa_fusion.attention(q, k, v, causal=causal)
        assert_close(out, reference.attention(q, k, v, causal=causal).out, torch.float32)
    assert len(made) == 3


def test_bad_input_after_a_kept_plan_still_raises(monkeypatch, rng):
    made = _counting_plans(monkeypatch)
    q, k, v = qkv(rng)
    sdpa_fusion.attention(q, k, v, causal=True)
    for _ in range(2):
        with pytest.raises(ValueError, match="causal=1 must be True or False"):
            sdpa_fusion.attention(q, k, v, causal=1)
    sdpa_fusion.attention(q, k, v, causal=True)
    assert len(made) == 3


def test_offsets_in_a_tensor_are_read_on_every_call(monkeypatch, rng):
    """cu_seqlens in a tensor may change in place between calls: never a kept plan."""
    made = _counting_plans(monkeypatch)
    q, k, v = (torch.randn(20, 2, 8, generator=rng) for _ in range(3))
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    for cut in (5, 12):
        cu[1] = cut
        out = sdpa_fusion.attention(q, k, v, layout="thd", causal=True, cu_seqlens=cu)
        for a, b in ((0, cut), (cut, 20)):
            want = reference.attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                       causal=True).out
            assert_close(out[a:b], want[0].transpose(0, 1), torch.float32)
    assert len(made) == 2


def test_offsets_in_a_tuple_keep_their_plan_until_the_pack_changes(monkeypatch, rng):
    """A tuple of offsets is part of the kept plan's key: the same pack is planned once, a
    new one anew, each right; in a key, True is not 1."""
    from sdpa_fusion import api

    made = _counting_plans(monkeypatch)
    q, k, v = (torch.randn(20, 2, 8, generator=rng) for _ in range(3))
    for cut in (5, 5, 12, 5):
        out = sdpa_fusion.attention(q, k, v, layout="thd", causal=True, cu_seqlens=(0, cut, 20))
        for a, b in ((0, cut), (cut, 20)):
            want = reference.attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                       causal=True).out
            assert_close(out[a:b], want[0].transpose(0, 1), torch.float32)
    assert len(made) == 2
    assert api._typed((0, 1, 2)) != api._typed((0, True, 2))
    assert api._typed((0, 1, 2)) == api._typed((0, 1, 2)) != api._typed((0, 1, 3))


def test_calls_with_a_mask_are_planned_every_time(monkeypatch, rng):
    """A mask holds tensors and a batch brings its own: no plan of it is kept."""
    made = _counting_plans(monkeypatch)
    q, k, v = qkv(rng)
    mask = sdpa_fusion.masks.prefix(5)
    for _ in range(2):
        sdpa_fusion.attention(q, k, v, causal=True, mask=mask)
    assert len(made) == 2
