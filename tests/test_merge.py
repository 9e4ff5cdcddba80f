"""merge_partial and friends (torch path on CPU) against attention over the whole key range
(the reference kernel on all keys: a merge must give what one call gives).

Run: python -m pytest -q tests/test_merge.py
Tolerances: tests/reference.py's TOLERANCES for the dtype merged; bf16 merges are held to
1e-2, tighter than the table's bf16 level (a merge of two exact blocks adds one rounding).
"""

import pytest
import torch

from sdpa_fusion.kernels import get
from sdpa_fusion.layout import Layout, has_layout
from sdpa_fusion.merge import Merged, accumulators, finish, fold, merge_partial
from tests.reference import tolerance

B, H, H_KV, S, E = 2, 4, 2, 64, 16
SCALE = E ** -0.5
LAYOUTS = pytest.mark.parametrize("layout", [Layout.BHSE, Layout.BSHE], ids=str)
FP32 = tolerance(torch.float32)
BF16 = dict(atol=1e-2, rtol=1e-2)  # tighter than the table's bf16 level: one rounding
reference = get("reference")


def qkv(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, E, generator=g)
    k, v = (torch.randn(B, H_KV, S, E, generator=g) for _ in range(2))
    return [layout.to(t) for t in (q, k, v)]


def halves(t):
    return t[:, :, : S // 2], t[:, :, S // 2:]


def full(q, k, v, causal=False):
    return reference.forward(q, k, v, causal=causal, scale=SCALE)


@LAYOUTS
def test_two_blocks_give_full_attention(layout):
    q, k, v = qkv(layout)
    (k_a, k_b), (v_a, v_b) = halves(k), halves(v)
    out_a, lse_a = full(q, k_a, v_a)
    out_b, lse_b = full(q, k_b, v_b)
    out, lse = merge_partial(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = full(q, k, v)
    torch.testing.assert_close(out, want_out, **FP32)
    torch.testing.assert_close(lse, want_lse, **FP32)
    assert out.dtype == lse.dtype == torch.float32 and has_layout(out, layout)


def test_merge_is_symmetric():
    q, k, v = qkv(Layout.BHSE)
    (k_a, k_b), (v_a, v_b) = halves(k), halves(v)
    a, b = full(q, k_a, v_a), full(q, k_b, v_b)
    for x, y in zip(merge_partial(*a, *b), merge_partial(*b, *a)):
        torch.testing.assert_close(x, y)


def causal_second_block(q, k_b, v_b):
    """Keys [S/2, S) under a causal mask: rows < S/2 see none of them (lse -inf, out 0)."""
    out = torch.zeros_like(q)
    lse = torch.full((B, H, S), float("-inf"))
    o, l = full(halves(q)[1], k_b, v_b, causal=True)
    out[:, :, S // 2:], lse[:, :, S // 2:] = o, l
    return out, lse


@LAYOUTS
def test_fully_masked_rows_merge_without_nan(layout):
    q, k, v = qkv(layout)
    (k_a, k_b), (v_a, v_b) = halves(k), halves(v)
    out_a, lse_a = full(q, k_a, v_a, causal=True)
    out_b, lse_b = causal_second_block(q, k_b, v_b)
    assert torch.isneginf(lse_b[:, :, : S // 2]).all()
    out, lse = merge_partial(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = full(q, k, v, causal=True)
    torch.testing.assert_close(out, want_out, **FP32)
    torch.testing.assert_close(lse, want_lse, **FP32)


def test_rows_masked_in_both_stay_zero_and_minus_inf():
    out, lse = accumulators(torch.empty(B, H, S, E))
    block = torch.randn(B, H, S, E)
    out, lse = merge_partial(out, lse, block, torch.full((B, H, S), float("-inf")))
    assert not out.isnan().any() and (out == 0).all() and torch.isneginf(lse).all()


@LAYOUTS
def test_ring_loop_with_a_slice_merge(layout):
    """Step 1: all queries see keys [0, S/2) causally; step 2: only the second half of the
    queries see keys [S/2, S), merged into rows [S/2, S) of the accumulators."""
    q, k, v = qkv(layout)
    (k_a, k_b), (v_a, v_b) = halves(k), halves(v)
    out_acc, lse_acc = accumulators(q)
    assert has_layout(out_acc, layout) and torch.isneginf(lse_acc).all()
    out_acc, lse_acc = fold(out_acc, lse_acc, *full(q, k_a, v_a, causal=True))
    late = full(halves(q)[1], k_b, v_b, causal=True)
    out_acc, lse_acc = fold(out_acc, lse_acc, *late, rows=slice(S // 2, None))
    want_out, want_lse = full(q, k, v, causal=True)
    torch.testing.assert_close(out_acc, want_out, **FP32)
    torch.testing.assert_close(lse_acc, want_lse, **FP32)
    out = finish(out_acc, torch.bfloat16, layout)
    assert out.dtype == torch.bfloat16 and has_layout(out, layout)


def test_bf16_blocks_accumulate_in_fp32():
    q, k, v = (t.bfloat16() for t in qkv(Layout.BSHE))
    out_acc, lse_acc = accumulators(q)
    for k_i, v_i in zip(halves(k), halves(v)):
        out_acc, lse_acc = fold(out_acc, lse_acc, *full(q, k_i, v_i))
    assert out_acc.dtype == torch.float32
    want_out, _ = full(q, k, v)
    out = finish(out_acc, torch.bfloat16, Layout.BSHE)
    torch.testing.assert_close(out, want_out, **BF16)


def test_shape_errors():
    out, lse = accumulators(torch.empty(B, H, S, E))
    with pytest.raises(ValueError, match="pass rows= to merge a block into part"):
        merge_partial(out, lse, out[:, :, :8], lse[:, :, :8])
    with pytest.raises(ValueError, match=r"block_lse \[2, 4, 8\] must be out's \[B, H, S\]"):
        merge_partial(out, lse, out, lse[:, :, :8])


# ---- Merged: blocks folded in place into the results ------------------------------------
def thirds(t):
    return t[:, :, : S // 4], t[:, :, S // 4: S // 2], t[:, :, S // 2:]


@LAYOUTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merged_over_blocks_matches_full_attention(layout, dtype):
    """Three key blocks (one merged only into the late rows) give attention over all keys."""
    q, k, v = (t.to(dtype) for t in qkv(layout))
    out = layout.empty(q.shape, dtype=dtype, device=q.device)
    lse = torch.empty(B, H, S)
    merged = Merged(out, lse, blocks=3)
    for i, (k_i, v_i) in enumerate(zip(thirds(k), thirds(v))):
        if i < 2:
            merged.add(*full(q, k_i, v_i))
        else:
            merged.add(*full(halves(q)[1], k_i, v_i), rows=slice(S // 2, None))
    merged.finish()
    want_out, _ = full(q, torch.cat(thirds(k)[:2], 2), torch.cat(thirds(v)[:2], 2))
    late, _ = full(halves(q)[1], k, v)
    want_out[:, :, S // 2:] = late
    tol = FP32 if dtype == torch.float32 else BF16
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    assert has_layout(out, layout)


def test_two_blocks_merged_into_bf16_round_once():
    """With at most two blocks per row the merge writes straight into a bf16 output: the
    same numbers as an fp32 accumulator cast at the end."""
    q, k, v = (t.bfloat16() for t in qkv(Layout.BHSE))
    a, b = full(q, halves(k)[0], halves(v)[0]), full(q, halves(k)[1], halves(v)[1])
    out, lse = torch.empty_like(q), torch.empty(B, H, S)
    merged = Merged(out, lse, blocks=2)
    assert merged.acc is out  # no fp32 accumulator
    merged.add(*a)
    merged.add(*b)
    merged.finish()
    out_acc, lse_acc = accumulators(q)
    for block in (a, b):
        fold(out_acc, lse_acc, *block)
    assert torch.equal(out, finish(out_acc, torch.bfloat16, Layout.BHSE))
    assert torch.equal(lse, lse_acc)


@pytest.mark.parametrize("blocks,dtype,rows,direct", [
    (2, torch.bfloat16, None, True),              # first block of every row, into out
    (2, torch.bfloat16, slice(S // 2, None), False),  # some rows only: merged in
    (3, torch.bfloat16, None, False),             # three blocks: an fp32 accumulator
    (3, torch.float32, None, True),
])
def test_merged_into_lets_the_first_block_write_the_result(blocks, dtype, rows, direct):
    """``into`` hands out (out, lse) to the kernel of the first block when it covers every row
    and goes straight into out; the next block merges into what it wrote."""
    q, k, v = (t.to(dtype) for t in qkv(Layout.BHSE))
    a_k, b_k = halves(k)
    a_v, b_v = halves(v)
    out, lse = torch.empty_like(q), torch.empty(B, H, S)
    merged = Merged(out, lse, blocks=blocks)
    outputs = merged.into(rows)
    assert (outputs is not None) == direct
    q_rows = q if rows is None else q[:, :, rows]
    if direct:
        assert outputs[0] is out and outputs[1] is lse
        reference.forward(q, a_k, a_v, causal=False, scale=SCALE, out=outputs[0],
                          lse=outputs[1])
        assert merged.into() is None  # only the first block
    else:
        merged.add(*full(q_rows, a_k, a_v), rows=rows)
    merged.add(*full(q_rows, b_k, b_v), rows=rows)
    merged.finish()
    want, _ = full(q_rows.float(), k.float(), v.float())
    got = out if rows is None else out[:, :, rows]
    tol = tolerance(dtype)
    torch.testing.assert_close(got.float(), want, **tol)


def test_merged_rows_no_block_reaches():
    """finish() without any block: out 0, lse -inf."""
    q = torch.randn(B, H, S, E)
    out, lse = torch.full_like(q, 7.0), torch.empty(B, H, S)
    Merged(out, lse, blocks=2).finish()
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_fold_rows_by_index_matches_a_slice():
    q, k, v = qkv(Layout.BSHE)
    late = full(halves(q)[1], k, v)
    by_slice, by_index = accumulators(q), accumulators(q)
    fold(*by_slice, *full(q, k, v), rows=None)
    fold(*by_index, *full(q, k, v), rows=None)
    fold(*by_slice, *late, rows=slice(S // 2, None))
    fold(*by_index, *late, rows=torch.arange(S // 2, S))
    for a, b in zip(by_slice, by_index):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("layout, case, in_place", [
    (Layout.BHSE, "all", True), (Layout.BHSE, "rows", False), (Layout.BHSE, "heads", True),
    (Layout.BSHE, "all", True), (Layout.BSHE, "rows", True), (Layout.BSHE, "heads", True),
], ids=str)
def test_fold_in_place_into_dense_bhse_or_any_bshe_accumulator(layout, case, in_place):
    """On GPUs WeightedSum writes its aliased output correctly into dense BHSE memory and into
    BSHE memory, views of some rows or heads too; a BHSE view of some rows folds out of place
    (a head slice of a batch of one is dense)."""
    from sdpa_fusion.merge import _folds_in_place

    batch = 1 if case == "heads" and layout is Layout.BHSE else B
    out = layout.empty((batch, H, S, E), dtype=torch.float32, device="cpu")
    lse = torch.zeros(batch, H, S)
    view = {"rows": (slice(None), slice(None), slice(8, 24)),
            "heads": (slice(None), slice(1, 3))}.get(case, (slice(None),))
    block_lse = lse[view].contiguous()
    assert _folds_in_place(out[view], lse[view], block_lse) is in_place


@LAYOUTS
@pytest.mark.parametrize("heads", [4, 12, 20], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [slice(None), slice(8, 40)], ids=["all", "slice"])
@pytest.mark.parametrize("part_heads", [None, 3], ids=["whole", "parts"])
def test_fold_by_heads_gives_the_whole_merge(monkeypatch, layout, heads, acc_dtype, rows,
                                            part_heads):
    """The out-of-place fold of GPUs (here with torch's merge in place of the fusion) into a
    view of the accumulator, in one part or ``part_heads`` heads at a time (FOLD_PART_BYTES):
    every head and row merged once, the rest untouched, the accumulator's storage kept."""
    from sdpa_fusion import merge as merge_module
    from sdpa_fusion.merge import _fold_by_heads, _merge_torch

    g = torch.Generator().manual_seed(heads)
    out = layout.to(torch.randn(B, heads, S, E, generator=g)).to(acc_dtype)
    block = layout.to(torch.randn(B, heads, S, E, generator=g))
    lse, block_lse = (torch.randn(B, heads, S, generator=g) for _ in range(2))
    want_out, want_lse = out.clone(), lse.clone()
    merged, merged_lse = _merge_torch(out[:, :, rows], lse[:, :, rows], block[:, :, rows],
                                      block_lse[:, :, rows])
    want_out[:, :, rows], want_lse[:, :, rows] = merged.to(acc_dtype), merged_lse
    storage, view = out.data_ptr(), out[:, :, rows]
    if part_heads is not None:
        head_bytes = view[:, :1].numel() * 4  # the merge's output is fp32
        monkeypatch.setattr(merge_module, "FOLD_PART_BYTES", part_heads * head_bytes)
    calls = []

    def counted(*args):
        calls.append(args[0].shape[1])
        return _merge_torch(*args)

    _fold_by_heads(view, lse[:, :, rows], layout.to(block[:, :, rows]),
                   block_lse[:, :, rows].contiguous(), merge=counted)
    assert calls == ([heads] if part_heads is None else
                     [min(part_heads, heads - h) for h in range(0, heads, part_heads)])
    assert out.data_ptr() == storage and has_layout(out, layout)
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("held", ["packed", "bhse", "bshe"])
def test_add_rows_by_index_adds_each_row_once(held, dtype):
    """``calls.add_rows`` with distinct rows in any order: acc[rows] += g, rounded once, on a
    packed block (token rows, the fast path), a dense BHSE and a batched BSHE accumulator."""
    from schedules.calls import add_rows, as_block

    g = torch.Generator().manual_seed(3)
    shape = {"packed": (S, H, E), "bhse": (B, H, S, E), "bshe": (B, S, H, E)}[held]
    acc = torch.randn(shape, generator=g).to(dtype)
    acc = as_block(acc) if held == "packed" else acc if held == "bhse" else acc.transpose(1, 2)
    rows = torch.randperm(S, generator=g)[:S // 3]
    grad = torch.randn(acc.shape[0], H, len(rows), E, generator=g).to(dtype)
    want = acc.clone()
    for i, r in enumerate(rows.tolist()):
        want[:, :, r] += grad[:, :, i]
    add_rows(acc, rows, grad)
    assert torch.equal(acc, want)
