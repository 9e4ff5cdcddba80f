"""Kernel limits: which calls split and where, and that split calls are exact.

A ``Bounded`` kernel (tests/bounded.py) is the reference kernel with small limits; it
records every call that reaches it and any that is past its limits. Its results are compared
with the reference kernel's on the whole problem (a split must give what one call gives),
within tests/reference.py's fp32 tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sdpa_fusion
from sdpa_fusion.kernels import KernelUnavailable, Limits, Seqlens, get
from sdpa_fusion.kernels.base import Dropout
from sdpa_fusion.kernels.limits import dense_pieces, fits, packed_pieces, packed_rows, span
from sdpa_fusion.layout import Layout
from sdpa_fusion.mask import Window

from sdpa_fusion.local import packed_seqlens
from tests.reference import tolerance

from .bounded import Bounded

FP32 = tolerance(torch.float32)


def test_span_counts_strides():
    t = torch.empty(2, 6, 5, 4)  # BHSE
    assert span(t) == t.numel()
    bshe = torch.empty(2, 5, 6, 4).transpose(1, 2)
    assert span(bshe) == bshe.numel()
    heads = bshe[:, 1:3]  # two heads of a [B, S, H, E] buffer reach over all its rows
    # strides (120, 4, 24, 1): 1 + 120 + 4 + 4 * 24 + 3
    assert heads.numel() == 80 and span(heads) == 224
    assert span(torch.empty(0, 3)) == 0 and span(torch.empty(3, 4)[:, :1]) == 9
    assert fits(None, Limits(1)) and fits(torch.empty(10), None)
    assert fits(torch.empty(10), Limits(10)) and not fits(torch.empty(11), Limits(10))


def test_pieces_of_dense_calls():
    limits = Limits(1000)
    assert dense_pieces((1, 4, 10, 8), (1, 4, 10, 8), limits) == []  # 320 elements
    assert dense_pieces((1, 4, 10, 8), (1, 4, 10, 8), None) == []
    # 4 heads of 40 x 8 = 320 each: groups of 3 do not divide 4, so two of 2
    pieces = dense_pieces((1, 4, 40, 8), (1, 4, 40, 8), limits)
    assert [(p.q, p.kv) for p in pieces] == [(slice(0, 2), slice(0, 2)), (slice(2, 4), slice(2, 4))]
    # the longer side sizes a call (K/V widened to every query head by some kernels)
    assert len(dense_pieces((1, 4, 10, 8), (1, 4, 40, 8), limits)) == 2
    # batch elements apart once one K/V head group of every batch element is too much
    pieces = dense_pieces((4, 2, 30, 8), (4, 1, 30, 8), limits)  # GQA 2:1, 480 per element
    assert [(p.batch, p.q, p.kv) for p in pieces] == [
        (slice(0, 2), slice(0, 2), slice(0, 1)), (slice(2, 4), slice(0, 2), slice(0, 1))]
    assert not any(p.shares_kv for p in pieces)
    # query heads of one K/V head apart: they share its dK/dV
    pieces = dense_pieces((1, 4, 100, 8), (1, 1, 100, 8), limits)
    assert [p.q for p in pieces] == [slice(i, i + 1) for i in range(4)]
    assert all(p.shares_kv and p.kv == slice(0, 1) for p in pieces)
    # one head of one sequence past the limit: no split helps
    assert dense_pieces((1, 1, 200, 8), (1, 1, 200, 8), limits) is None


def test_pieces_of_packed_calls():
    limits = Limits(1000, rows_per_sequence=2)
    assert packed_rows([3, 5], [3, 5], limits) == 12
    assert packed_pieces([10, 10], [10, 10], 4, 4, 8, limits) == []  # 24 rows x 4 x 8 = 768
    pieces = packed_pieces([30, 30], [30, 30], 4, 2, 8, limits)  # 64 rows x 8 = 512 per head
    assert [(p.q, p.kv, p.sequences) for p in pieces] == [
        (slice(i, i + 1), slice(i // 2, i // 2 + 1), None) for i in range(4)]
    assert all(p.shares_kv for p in pieces)
    # every head of runs of sequences when each sequence fits so (24 x 4 x 8 = 768 each)
    pieces = packed_pieces([22, 22, 10], [22, 22, 10], 4, 2, 8, limits)  # runs <= 31 rows
    assert [(p.q, p.kv, p.sequences) for p in pieces] == [
        (slice(0, 4), slice(0, 2), slice(0, 1)), (slice(0, 4), slice(0, 2), slice(1, 2)),
        (slice(0, 4), slice(0, 2), slice(2, 3))]
    assert not any(p.shares_kv for p in pieces)
    # one head of every sequence together past the limit: runs of sequences apart
    pieces = packed_pieces([60, 70, 50, 20], [60, 70, 50, 20], 2, 2, 8, limits)  # <= 125 rows
    assert {p.sequences for p in pieces} == {slice(0, 1), slice(1, 3), slice(3, 4)}
    assert packed_pieces([130], [130], 1, 1, 8, limits) is None


def _problem(layout, b=2, h=4, h_kv=2, s=24, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    layout = Layout.of(layout)

    def rand(heads):
        return layout.to(torch.randn(b, heads, s, e, generator=g))

    return rand(h), rand(h_kv), rand(h_kv), rand(h)


def _run(kernel, q, k, v, dout, **mask):
    out, lse = kernel.forward(q, k, v, **mask)
    return (out, lse, *kernel.backward(dout, q, k, v, out, lse, **mask))


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("elements,calls", [(10_000, 1), (800, 2), (400, 4), (200, 8)],
                         ids=["whole", "kv-head-groups", "batch", "query-heads"])
@pytest.mark.parametrize("window", [None, (5, 0)])
def test_dense_calls_past_the_limit_split_exactly(layout, elements, calls, window):
    q, k, v, dout = _problem(layout)  # 2 x 4 heads (2 K/V heads) x 24 x 8
    mask = dict(causal=True, scale=0.3, window=Window.of(window))
    bounded = Bounded(elements)
    got = _run(bounded, q, k, v, dout, **mask)
    want = _run(get("reference"), q, k, v, dout, **mask)
    assert sum(1 for c in bounded.calls if c[0] == "forward") == calls and not bounded.past
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.stride() == w.stride(), name
        torch.testing.assert_close(g, w, **FP32, msg=name)


def test_views_past_the_limit_are_copied_and_outputs_written_in_place():
    # a head group of a [B, S, H, E] buffer spans every row: the kernel gets a copy
    q, k, v, dout = (t[:, :2] for t in _problem("bshe", h=8, h_kv=8))
    bounded = Bounded(2 * 24 * 8 * 2)  # the group's own elements fit, its view does not
    assert not fits(q, bounded.limits)
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:3], math.nan)
    got_out, got_lse = bounded.forward(q, k, v, causal=False, scale=0.5, out=out, lse=lse)
    assert got_out is out and got_lse is lse and len(bounded.calls) == 1 and not bounded.past
    want_out, want_lse = get("reference").forward(q, k, v, causal=False, scale=0.5)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


def test_dropout_pieces_draw_the_same_masks_in_forward_and_backward():
    """Pieces draw streams of their own; the backward's gradients are those of the forward
    that ran (autograd through the reference's math on the same pieces)."""
    q, k, v, dout = (t.requires_grad_() for t in _problem("bhse"))
    bounded, dropout = Bounded(400), Dropout(0.3, seed=7)
    mask = dict(causal=True, scale=0.3)
    out, lse = bounded.forward(q, k, v, dropout=dropout, **mask)
    assert len(bounded.calls) == 4 and not bounded.past
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = bounded.backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                           dropout=dropout, **mask)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **FP32)


def _one_call(q, k, v, dout, seqlens, mask):
    """(out, lse, dq, dk, dv) of the packed call unsplit (the reference kernel: no limit)."""
    ref = get("reference")
    out, lse = ref.varlen_forward(q, k, v, seqlens, **mask)
    return (out, lse, *ref.varlen_backward(dout, q, k, v, out, lse, seqlens, **mask))


def _assert_results(got, want):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **FP32, msg=name)


@pytest.mark.parametrize("elements,rows_per_sequence,calls", [
    (100_000, 0, 1),
    (2048, 2, 2),  # every head of runs of at most 64 rows (2048 / (4 x 8)): 57 and 25 rows
    (1100, 2, 4),  # the sequence of 34 + 2 rows x 32 > 1100: query heads apart (656 each)
    (700, 4, 8),   # 94 rows per head: runs of sequences of 67 and 27 rows, one head each
], ids=["whole", "sequence-runs-every-head", "query-heads", "sequence-runs"])
def test_packed_calls_past_the_limit_split_exactly(elements, rows_per_sequence, calls):
    cu = (0, 5, 6, 6, 40, 47, 70)  # lengths 5, 1, 0, 34, 7, 23
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(70, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(70, 2, 8, generator=g) for _ in range(2))
    seqlens = packed_seqlens(cu)
    mask = dict(causal=True, scale=0.4)
    bounded = Bounded(elements, rows_per_sequence)
    out, lse = bounded.varlen_forward(q, k, v, seqlens, **mask)
    grads = bounded.varlen_backward(dout, q, k, v, out, lse, seqlens, **mask)
    _assert_results((out, lse, *grads), _one_call(q, k, v, dout, seqlens, mask))
    assert sum(1 for c in bounded.calls if c[0] == "varlen_forward") == calls
    assert not bounded.past


class _Seen(Bounded):
    """``Bounded`` that keeps the inputs and the output buffers every varlen call got."""

    def _varlen_forward(self, q, k, v, seqlens, **kw):
        self.inputs = getattr(self, "inputs", []) + [q, k, v]
        self.given = getattr(self, "given", []) + [kw["out"]]
        return super()._varlen_forward(q, k, v, seqlens, **kw)

    def _varlen_backward(self, dout, q, k, v, out, lse, seqlens, **kw):
        self.inputs = getattr(self, "inputs", []) + [dout, q, k, v, out]
        self.given = getattr(self, "given", []) + [kw["dq"], kw["dk"], kw["dv"]]
        return super()._varlen_backward(dout, q, k, v, out, lse, seqlens, **kw)


def _rows_of(t: torch.Tensor, tensors) -> bool:
    """Whether ``t`` is a view of one of ``tensors`` (no copy)."""
    return any(t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
               for w in tensors)


def test_pieces_of_every_head_are_written_by_the_kernel_into_their_rows():
    """A packed call split into runs of sequences with every head: each piece's inputs are
    row blocks of the call's (no copy), and the kernel writes its out, dq, dk, dv into its rows
    of the given buffers; the results are those of one call, rows outside every sequence
    included."""
    cu = (2, 7, 8, 8, 42, 49, 70)  # rows 0-1 and 70-71 in no sequence
    g = torch.Generator().manual_seed(4)
    q, dout = (torch.randn(72, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(72, 2, 8, generator=g) for _ in range(2))
    seqlens = Seqlens(cu, cu)
    mask = dict(causal=True, scale=0.4)
    seen = _Seen(2048, rows_per_sequence=2)
    out = torch.full_like(q, math.nan)
    lse = torch.full((4, 72), math.nan)
    got_out, got_lse = seen.varlen_forward(q, k, v, seqlens, **mask, out=out, lse=lse)
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    got = seen.varlen_backward(dout, q, k, v, out, lse, seqlens, **mask, dq=grads[0],
                               dk=grads[1], dv=grads[2])
    assert got_out is out and got_lse is lse and all(a is b for a, b in zip(got, grads))
    varlen = [c for c in seen.calls if c[0].startswith("varlen")]
    assert len(varlen) == 4 and not seen.past  # two runs, forward and backward
    for given in seen.given:  # every buffer the kernel got is rows of the call's own
        assert given is not None and _rows_of(given, (out, *grads))
    assert all(_rows_of(t, (q, k, v, dout, out)) for t in seen.inputs)  # nothing copied in
    _assert_results((out, lse, *grads), _one_call(q, k, v, dout, seqlens, mask))


@settings(max_examples=30, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1,
                      max_size=6),
       before=st.integers(0, 2), after=st.integers(0, 2), kv_heads=st.sampled_from([4, 2, 1]),
       elements=st.integers(40, 600), rows_per_sequence=st.integers(0, 2),
       given_buffers=st.booleans(), causal=st.booleans())
@example(pairs=[(12, 12), (0, 3), (5, 0), (1, 1)], before=1, after=2, kv_heads=2, elements=300,
         rows_per_sequence=1, given_buffers=True, causal=True)
def test_any_split_packed_call_gives_the_unsplit_results(pairs, before, after, kv_heads,
                                                         elements, rows_per_sequence,
                                                         given_buffers, causal):
    """Random packs (lengths 0 and 1, queries != keys, rows outside every sequence) and
    limits: whatever pieces the split takes (runs of every head, head groups, query heads of
    one K/V head), out, lse and the gradients are the unsplit call's, given NaN-filled
    buffers or none; a pack no split fits is refused."""
    cu_q, cu_k = [before], [before]
    for n, m in pairs:
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + m)
    seqlens = Seqlens(tuple(cu_q), tuple(cu_k))
    g = torch.Generator().manual_seed(len(pairs) + elements)
    q, dout = (torch.randn(cu_q[-1] + after, 4, 4, generator=g) for _ in range(2))
    k, v = (torch.randn(cu_k[-1] + after, kv_heads, 4, generator=g) for _ in range(2))
    mask = dict(causal=causal, scale=0.5)
    want = _one_call(q, k, v, dout, seqlens, mask)
    bounded = Bounded(elements, rows_per_sequence)
    buffers = dict(out=torch.full_like(q, math.nan), lse=torch.full((4, q.shape[0]), math.nan))
    grads = dict(dq=torch.full_like(q, math.nan), dk=torch.full_like(k, math.nan),
                 dv=torch.full_like(v, math.nan))
    try:
        out, lse = bounded.varlen_forward(q, k, v, seqlens, **mask,
                                          **(buffers if given_buffers else {}))
    except (ValueError, KernelUnavailable):
        head_dim = q.shape[2]  # refused only when one head of one sequence does not fit
        assert max(packed_rows([n], [m], bounded.limits) for n, m in pairs) * head_dim > elements
        return
    got = bounded.varlen_backward(dout, q, k, v, *want[:2], seqlens, **mask,
                                  **(grads if given_buffers else {}))
    assert not bounded.past
    if given_buffers:
        assert out is buffers["out"] and lse is buffers["lse"]
        assert all(a is b for a, b in zip(got, grads.values()))
    _assert_results((out, lse, *got), want)


def test_rows_outside_every_sequence_stay_empty_when_sequences_split():
    seqlens = Seqlens((2, 10, 20), (2, 10, 20))  # rows 0-1 and 20-23 in no sequence
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(24, 1, 8, generator=g) for _ in range(4))
    bounded = Bounded(100, rows_per_sequence=1)
    out, lse = bounded.varlen_forward(q, k, v, seqlens, causal=False, scale=0.5)
    assert len(bounded.calls) > 1
    assert (out[:2] == 0).all() and (out[20:] == 0).all()
    assert torch.isneginf(lse[:, :2]).all() and torch.isneginf(lse[:, 20:]).all()
    dq, dk, dv = bounded.varlen_backward(dout, q, k, v, out, lse, seqlens, causal=False,
                                         scale=0.5)
    assert (dq[20:] == 0).all() and (dk[:2] == 0).all() and (dv[20:] == 0).all()
    assert not bounded.past


def test_a_head_past_the_limit_is_refused_naming_the_kernels_that_can_run_it():
    bounded = Bounded(100)
    q, k, v = (torch.randn(1, 1, 20, 8) for _ in range(3))  # one head: 160 elements
    with pytest.raises(KernelUnavailable, match=r"kernel 'bounded' takes at most 100 elements "
                                                r"per tensor per call.*\(20 tokens\) x 8 = 160.*"
                                                r"kernel 'reference' can run it here"):
        sdpa_fusion.attention(q, k, v, kernel=bounded)
    assert bounded.calls == []
    out = sdpa_fusion.attention(q, k, v, kernel=Bounded(160))  # at the limit: runs
    torch.testing.assert_close(out, get("reference").forward(q, k, v, causal=False,
                                                              scale=8 ** -0.5)[0])


def test_attention_splits_through_autograd():
    q, k, v, dout = _problem("bshe")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    bounded = Bounded(300)
    out = sdpa_fusion.attention(*leaves, causal=True, kernel=bounded)
    out.backward(dout)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = sdpa_fusion.attention(*ref, causal=True, kernel="reference")
    want.backward(dout)
    torch.testing.assert_close(out, want, **FP32)
    for got, w in zip(leaves, ref):
        torch.testing.assert_close(got.grad, w.grad, **FP32)
    assert len(bounded.calls) > 2 and not bounded.past
