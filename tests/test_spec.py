"""AttentionSpec: what a valid problem is, and the ValueError (naming the argument) for every
bad one. Run: pytest -q tests/test_spec.py"""

from __future__ import annotations

import math

import pytest
import torch

import sdpa_fusion
from sdpa_fusion import AttentionSpec, Layout


def bhse(b=2, h=4, s=16, e=16, dtype=torch.float32):
    return torch.randn(b, h, s, e, dtype=dtype)


def bshe(b=2, h=4, s=16, e=16, dtype=torch.float32):
    return torch.randn(b, s, h, e, dtype=dtype).transpose(1, 2)


def thd(t=20, h=4, e=16, dtype=torch.float32):
    return torch.randn(t, h, e, dtype=dtype)


def cu(*values):
    return torch.tensor(values, dtype=torch.int32)


def spec_of(q, k=None, v=None, **kwargs):
    k = q if k is None else k
    v = k if v is None else v
    return AttentionSpec.from_tensors(q, k, v, **kwargs)


# ---- valid problems --------------------------------------------------------------------------
def test_from_tensors_reads_shape_dtype_and_options():
    q, k = bshe(b=2, h=8, s=24, e=32), bshe(b=2, h=2, s=40, e=32)
    spec = spec_of(q, k, layout="bshe", causal=True, scale=0.5)
    assert (spec.batch, spec.heads, spec.kv_heads, spec.q_len, spec.kv_len, spec.head_dim) == \
        (2, 8, 2, 24, 40, 32)
    assert spec.dtype == torch.float32 and spec.causal and spec.layout is Layout.BSHE
    assert spec.groups == 4 and spec.softmax_scale == 0.5


def test_default_scale_is_inverse_sqrt_head_dim():
    assert spec_of(bhse(e=64)).softmax_scale == pytest.approx(1 / math.sqrt(64))


def test_flops_count_matmuls_halved_when_causal_and_3_5x_with_backward():
    spec = AttentionSpec(batch=2, heads=4, kv_heads=4, q_len=8, kv_len=16, head_dim=32)
    assert spec.flops() == 4 * 2 * 4 * 8 * 16 * 32
    assert spec.replace(causal=True).flops() == spec.flops() / 2
    assert spec.flops(backward=True) == 3.5 * spec.flops()


def test_thd_spec_lists_sequences_at_their_padded_starts():
    q = thd(t=24)
    spec = spec_of(q, layout="thd", cu_seqlens=cu(0, 5, 15), cu_seqlens_padded=cu(0, 8, 24))
    assert spec.batch == 1 and spec.q_len == 24
    assert spec.sequences() == [(0, 5), (8, 10)]
    assert spec.flops() == 4 * 4 * (5 * 5 + 10 * 10) * 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_supported_dtypes(dtype):
    assert spec_of(bhse(dtype=dtype)).dtype == dtype


# ---- bad tensors -----------------------------------------------------------------------------
def test_not_a_tensor():
    with pytest.raises(ValueError, match=r"^k must be a torch.Tensor, got list"):
        AttentionSpec.from_tensors(bhse(), [1, 2], bhse())


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_wrong_ndim(layout):
    with pytest.raises(ValueError, match=rf"^q has 3 dims .* layout='{layout}' needs the logical"):
        spec_of(thd(), bhse(), layout=layout)


def test_wrong_ndim_thd():
    with pytest.raises(ValueError, match=r"^q has 4 dims .* layout='thd' needs .*\[T, H, E\]"):
        spec_of(bhse(), thd(), layout="thd", cu_seqlens=cu(0, 20))


def test_bshe_tensor_claimed_as_bhse():
    with pytest.raises(ValueError, match=r"^q .* does not have the layout 'bhse' it claims; .*'bshe'"):
        spec_of(bshe(), bhse(), layout="bhse")


def test_bhse_tensor_claimed_as_bshe():
    with pytest.raises(ValueError, match=r"^v .* does not have the layout 'bshe' it claims; .*'bhse'"):
        spec_of(bshe(), bshe(), bhse(), layout="bshe")


def test_non_dense_tensor_is_not_bhse():
    sliced = bhse(e=32)[..., :16]
    with pytest.raises(ValueError, match=r"^q .*strides.* does not have the layout 'bhse'"):
        spec_of(sliced, bhse(), layout="bhse")


def test_unknown_layout():
    with pytest.raises(ValueError, match=r"^layout='bsh' is not a known layout; use one of 'bhse'"):
        spec_of(bhse(), layout="bsh")


def test_k_and_v_shapes_differ():
    with pytest.raises(ValueError, match=r"^k \[2, 4, 16, 16\] and v \[2, 4, 8, 16\] must have"):
        spec_of(bhse(), bhse(), bhse(s=8))


def test_batch_differs():
    with pytest.raises(ValueError, match=r"^q has batch 2 but k and v have batch 3"):
        spec_of(bhse(b=2), bhse(b=3))


def test_head_dim_differs():
    with pytest.raises(ValueError, match=r"^q has head dim 16 but k and v have 32"):
        spec_of(bhse(e=16), bhse(e=32))


def test_dtype_mismatch():
    with pytest.raises(ValueError, match=r"^q, k, v must share one dtype, got torch.float32, "
                                         r"torch.bfloat16, torch.bfloat16"):
        spec_of(bhse(), bhse(dtype=torch.bfloat16))


def test_device_mismatch():
    meta = torch.empty(2, 4, 16, 16, device="meta")
    with pytest.raises(ValueError, match=r"^q, k, v must be on one device"):
        spec_of(bhse(), meta)


def test_head_dim_not_multiple_of_8():
    with pytest.raises(ValueError, match=r"^head_dim=12 must be a multiple of 8.*pad the head dim to 16"):
        spec_of(bhse(e=12))


def test_heads_not_multiple_of_kv_heads():
    with pytest.raises(ValueError, match=r"^heads=6 must be a multiple of kv_heads=4"):
        spec_of(bhse(h=6), bhse(h=4))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64], ids=str)
def test_unsupported_dtype(dtype):
    q = torch.zeros(2, 4, 16, 16, dtype=dtype)
    with pytest.raises(ValueError, match=rf"^dtype={dtype} is not supported; use torch.bfloat16"):
        spec_of(q)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_bad_dropout(p):
    with pytest.raises(ValueError, match=rf"^dropout_p={p} must be in \[0, 1\)"):
        spec_of(bhse(), dropout_p=p)


@pytest.mark.parametrize("scale", [0.0, -1.0, "big"])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match=r"^scale=.* must be a positive number or None"):
        spec_of(bhse(), scale=scale)


@pytest.mark.parametrize("field", ["batch", "heads", "kv_heads", "q_len", "kv_len", "head_dim"])
def test_sizes_must_be_positive(field):
    sizes = dict(batch=1, heads=2, kv_heads=2, q_len=8, kv_len=8, head_dim=16)
    sizes[field] = 0
    with pytest.raises(ValueError, match=rf"^{field}=0 must be a positive integer"):
        AttentionSpec(**sizes).validate()


def test_bad_input_raises_through_attention():
    with pytest.raises(ValueError, match=r"^head_dim=12 must be a multiple of 8"):
        sdpa_fusion.attention(bhse(e=12), bhse(e=12), bhse(e=12), kernel="reference")


# ---- packed (thd) sequences ------------------------------------------------------------------
def test_thd_without_cu_seqlens():
    with pytest.raises(ValueError, match=r"^layout='thd' needs cu_seqlens="):
        spec_of(thd(), layout="thd")


def test_thd_with_dropout():
    with pytest.raises(ValueError, match=r"^dropout_p=0.1 is not supported with layout='thd'"):
        spec_of(thd(), layout="thd", cu_seqlens=cu(0, 20), dropout_p=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8], ids=str)
def test_thd_cu_seqlens_not_int32_or_int64(dtype):
    with pytest.raises(ValueError, match=rf"^cu_seqlens must hold int32 or int64 offsets, got dtype "
                                         rf"{dtype}; pass torch.tensor\(.*dtype=torch.int32\)"):
        spec_of(thd(), layout="thd", cu_seqlens=torch.tensor([0, 20], dtype=dtype))


def test_thd_cu_seqlens_not_1d():
    with pytest.raises(ValueError, match=r"^cu_seqlens must be a 1-D integer tensor"):
        spec_of(thd(), layout="thd", cu_seqlens=cu(20))
    with pytest.raises(ValueError, match=r"^cu_seqlens must be a 1-D integer tensor"):
        spec_of(thd(), layout="thd", cu_seqlens=torch.tensor([[0, 20]], dtype=torch.int32))


def test_thd_cu_seqlens_not_starting_at_zero():
    with pytest.raises(ValueError, match=r"^cu_seqlens=\[2, 10, 20\] must start at 0"):
        spec_of(thd(), layout="thd", cu_seqlens=cu(2, 10, 20))


def test_thd_cu_seqlens_decreasing():
    with pytest.raises(ValueError, match=r"^cu_seqlens=\[0, 12, 8, 20\] must never decrease, but entry 2 "
                                         r"\(8\) is below entry 1 \(12\); give the running sum"):
        spec_of(thd(), layout="thd", cu_seqlens=cu(0, 12, 8, 20))


@pytest.mark.parametrize("last", [18, 22])
def test_thd_cu_seqlens_last_is_not_t(last):
    with pytest.raises(ValueError, match=rf"^cu_seqlens ends at {last} but the packed tensor has 20 tokens"):
        spec_of(thd(t=20), layout="thd", cu_seqlens=cu(0, 10, last))


def test_thd_padded_cu_seqlens_last_is_not_t():
    with pytest.raises(ValueError, match=r"^cu_seqlens_padded ends at 16 but the packed tensor has 20"):
        spec_of(thd(t=20), layout="thd", cu_seqlens=cu(0, 5, 12), cu_seqlens_padded=cu(0, 8, 16))


def test_thd_real_sequences_may_end_before_t_when_padded():
    spec = spec_of(thd(t=20), layout="thd", cu_seqlens=cu(0, 5, 12), cu_seqlens_padded=cu(0, 8, 20))
    assert spec.cu_seqlens == (0, 5, 12) and spec.cu_seqlens_padded == (0, 8, 20)


def test_thd_real_sequences_beyond_t_even_when_padded():
    with pytest.raises(ValueError, match=r"^cu_seqlens ends at 24 but the packed tensor has 20 tokens"):
        spec_of(thd(t=20), layout="thd", cu_seqlens=cu(0, 5, 24), cu_seqlens_padded=cu(0, 8, 20))


def test_thd_cu_seqlens_padded_too_small():
    with pytest.raises(ValueError, match=r"^cu_seqlens_padded leaves sequence 0 room for 4 tokens but "
                                         r"cu_seqlens gives it 5; each padded length .* must be >="):
        spec_of(thd(t=20), layout="thd", cu_seqlens=cu(0, 5, 12), cu_seqlens_padded=cu(0, 4, 20))


def test_thd_cu_seqlens_padded_entry_count():
    with pytest.raises(ValueError, match=r"^cu_seqlens_padded has 4 entries but cu_seqlens has 3"):
        spec_of(thd(t=20), layout="thd", cu_seqlens=cu(0, 5, 12), cu_seqlens_padded=cu(0, 8, 12, 20))


def test_thd_q_and_kv_token_counts_differ():
    with pytest.raises(ValueError, match=r"^layout='thd' needs q and k/v packed alike; got 20 query "
                                         r"tokens and 24 key tokens"):
        spec_of(thd(t=20), thd(t=24), layout="thd", cu_seqlens=cu(0, 20))


def test_thd_spec_built_by_hand_is_checked_too():
    base = dict(batch=1, heads=2, kv_heads=2, q_len=20, kv_len=20, head_dim=16, layout="thd")
    with pytest.raises(ValueError, match=r"^layout='thd' packs sequences along T; batch must be 1"):
        AttentionSpec(**{**base, "batch": 2}, cu_seqlens=(0, 20)).validate()
    with pytest.raises(ValueError, match=r"^cu_seqlens=\[0, 25, 20\] must never decrease"):
        AttentionSpec(**base, cu_seqlens=(0, 25, 20)).validate()
    with pytest.raises(ValueError, match=r"^cu_seqlens ends at 18 but the packed tensor has 20"):
        AttentionSpec(**base, cu_seqlens=(0, 18)).validate()
    with pytest.raises(ValueError, match=r"^cu_seqlens=\[0\] needs at least 2 entries"):
        AttentionSpec(**base, cu_seqlens=(0,)).validate()
