"""Layouts: names, stride orders, the check that a tensor has the layout it claims, copies
into a layout, and views of packed sequences. Run: pytest -q tests/test_layout.py"""

from __future__ import annotations

import pytest
import torch

from sdpa_fusion import Layout
from sdpa_fusion.kernels.base import layout_of
from sdpa_fusion.layout import check_layout, has_layout, seqlens_of

SHAPE = (2, 3, 5, 8)  # logical [B, H, S, E]


def make(layout: Layout, shape=SHAPE) -> torch.Tensor:
    return layout.to(torch.randn(shape))


@pytest.mark.parametrize("name, layout", [
    ("bhse", Layout.BHSE), ("BSHE", Layout.BSHE), ("Thd", Layout.THD), (Layout.BSHE, Layout.BSHE),
])
def test_of_accepts_names_and_members(name, layout):
    assert Layout.of(name) is layout


@pytest.mark.parametrize("bad", ["bshd", "", None, 3])
def test_of_rejects_unknown_names_listing_known_ones(bad):
    with pytest.raises(ValueError, match=r"^layout=.* is not a known layout; use one of 'bhse', 'bshe', 'thd'"):
        Layout.of(bad)


def test_str_is_the_name():
    assert [str(m) for m in Layout] == ["bhse", "bshe", "thd"]


@pytest.mark.parametrize("layout, order", [
    (Layout.BHSE, [3, 2, 1, 0]), (Layout.BSHE, [3, 1, 2, 0]), (Layout.THD, [2, 1, 0]),
])
def test_stride_order(layout, order):
    assert layout.stride_order == order


@pytest.mark.parametrize("layout", list(Layout), ids=str)
def test_stride_order_ranks_the_real_strides(layout):
    """nvFuser's stride order: the dim with the largest stride gets the highest number."""
    shape = SHAPE[1:] if layout.is_varlen else SHAPE
    t = layout.empty(shape, dtype=torch.float32, device="cpu")
    by_stride = sorted(range(t.dim()), key=lambda d: t.stride(d))
    order = [0] * t.dim()
    for rank, d in enumerate(by_stride):
        order[d] = rank
    assert order == layout.stride_order


@pytest.mark.parametrize("layout, seq_dim, ndim, varlen", [
    (Layout.BHSE, 2, 4, False), (Layout.BSHE, 2, 4, False), (Layout.THD, 0, 3, True),
])
def test_dims(layout, seq_dim, ndim, varlen):
    assert (layout.seq_dim, layout.head_dim, layout.ndim, layout.is_varlen) == (seq_dim, 1, ndim, varlen)


def test_empty_bshe_is_a_bshe_buffer_viewed_as_bhse():
    t = Layout.BSHE.empty(SHAPE, dtype=torch.bfloat16, device="cpu")
    assert t.shape == SHAPE and t.dtype == torch.bfloat16
    assert t.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("layout", [Layout.BHSE, Layout.BSHE], ids=str)
def test_has_layout(layout):
    t = make(layout)
    other = Layout.BSHE if layout is Layout.BHSE else Layout.BHSE
    assert has_layout(t, layout)
    assert not has_layout(t, other)
    assert not has_layout(t[..., :4], layout)        # not dense
    assert not has_layout(t[0], layout)              # wrong ndim


def test_has_layout_ignores_strides_of_size_one_dims():
    one_head = torch.randn(2, 5, 1, 8).transpose(1, 2)  # [B, 1, S, E] from a BSHE buffer
    assert has_layout(one_head, Layout.BHSE) and has_layout(one_head, Layout.BSHE)


def test_has_layout_thd():
    assert has_layout(torch.randn(7, 3, 8), Layout.THD)
    assert not has_layout(torch.randn(3, 7, 8).transpose(0, 1), Layout.THD)


@pytest.mark.parametrize("src, dst", [
    (Layout.BHSE, Layout.BSHE), (Layout.BSHE, Layout.BHSE), (Layout.BHSE, Layout.BHSE),
])
def test_to_copies_into_the_layout_keeping_values(src, dst):
    t = make(src)
    out = dst.to(t)
    assert has_layout(out, dst)
    assert torch.equal(out, t)
    assert (out is t) == (src is dst)


def test_to_makes_non_dense_tensors_dense():
    t = torch.randn(2, 3, 5, 16)[..., ::2]
    out = Layout.BHSE.to(t)
    assert out.is_contiguous() and torch.equal(out, t)


def test_check_layout_names_the_argument():
    with pytest.raises(ValueError, match=r"^dout .* does not have the layout 'bshe' it claims"):
        check_layout("dout", make(Layout.BHSE), Layout.BSHE)
    check_layout("dout", make(Layout.BSHE), Layout.BSHE)


def test_layout_of_tells_bshe_from_bhse():
    assert layout_of(make(Layout.BSHE)) is Layout.BSHE
    assert layout_of(make(Layout.BHSE)) is Layout.BHSE


def test_seqlens_of():
    assert seqlens_of([0, 3, 3, 10]) == [3, 0, 7]
