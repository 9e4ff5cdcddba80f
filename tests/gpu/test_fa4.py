"""The fa4 kernel (FlashAttention-4) on a CUDA GPU against the test reference (tests/reference.py:
torch SDPA in fp64), within its TOLERANCES for the inputs' dtype.

    python -m pytest -q tests/gpu/test_fa4.py
    SDPA_FUSION_REQUIRE_FA4=1 python -m pytest -q tests/gpu/test_fa4.py   # FA4 missing: fail

Skips without a GPU or without FlashAttention-4 (``fa4_kernel`` in conftest.py). FA4
compiles each kernel configuration on its first call (about 5-8 s: dtype, head dim, GQA
ratio, mask kind, dense or packed; not lengths or batch), so the tests share configurations:
15 in all, each compiled for forward and backward (MHA at hd 64/128/256, GQA 8:4 at hd 128,
full and causal; MQA 8:1 and fp16 causal; three more window kinds; packed full and causal),
and ``fa4_rows``' backward kernels (causal and full, MHA and GQA 8:4, hd 128).
FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 keeps them on disk for later processes.
"""

from __future__ import annotations

import math

import pytest
import torch

import sdpa_fusion
from sdpa_fusion.kernels.base import Seqlens
from sdpa_fusion.layout import Layout, has_layout
from sdpa_fusion.mask import Window
from tests import reference
from tests.reference import assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

B, H, S = 2, 8, 256  # lengths above one FA4 tile (128): short ones compile other kernels
LAYOUTS = pytest.mark.parametrize("layout", [Layout.BHSE, Layout.BSHE], ids=str)
# lse is fp32 from the first product on: tighter than the table's bf16 and fp16 levels
LSE = dict(atol=1e-3, rtol=1e-3)


@pytest.fixture(autouse=True)
def kernel(fa4_kernel):
    return fa4_kernel


def randn(shape, layout, dtype=torch.bfloat16, *, generator):
    t = torch.randn(shape, device="cuda", generator=generator, dtype=torch.float32).to(dtype)
    return layout.to(t)


def problem(layout=Layout.BSHE, *, kv_heads=H, s_q=S, s_k=S, e=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = randn((B, H, s_q, e), layout, dtype, generator=g)
    k, v = (randn((B, kv_heads, s_k, e), layout, dtype, generator=g) for _ in range(2))
    return q, k, v, randn((B, H, s_q, e), layout, dtype, generator=g)


def scale_for(e: int) -> float:
    return 0.7 / math.sqrt(e)  # not the default: the scale must reach the kernel


def check(kernel, q, k, v, dout, *, causal, window=None):
    """Forward, then backward from its out and lse, against the reference; layouts kept."""
    scale = scale_for(q.shape[-1])
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale, window=window)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, window=window)
    want = reference.attention(q, k, v, dout, causal=causal, scale=scale, window=window)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    torch.testing.assert_close(lse.double(), want.lse, **LSE, msg=lambda m: f"lse: {m}")
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert got.dtype == q.dtype, name
    reference.assert_results((out, *grads), want)
    layout = Layout.BSHE if has_layout(q, Layout.BSHE) else Layout.BHSE
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert has_layout(got, layout), f"{name} strides {got.stride()} are not {layout} like q"
    return out, lse, grads


CASES = [
    pytest.param(dict(e=64), False, id="hd64-full"),
    pytest.param(dict(e=64), True, id="hd64-causal"),
    pytest.param(dict(e=128), False, id="hd128-full"),
    pytest.param(dict(e=128), True, id="hd128-causal"),
    pytest.param(dict(e=128, kv_heads=4), False, id="hd128-gqa-full"),
    pytest.param(dict(e=128, kv_heads=4), True, id="hd128-gqa-causal"),
    pytest.param(dict(e=128, kv_heads=1), True, id="hd128-mqa-causal"),
    pytest.param(dict(e=256), False, id="hd256-full"),
    pytest.param(dict(e=256), True, id="hd256-causal"),
    pytest.param(dict(e=128, dtype=torch.float16), True, id="hd128-causal-fp16"),
]


@LAYOUTS
@pytest.mark.parametrize("shape,causal", CASES)
def test_matches_sdpa(kernel, layout, shape, causal):
    """Head dims 64 to 256, MHA, GQA, MQA, bf16 and fp16, full and causal."""
    q, k, v, dout = problem(layout, **shape)
    check(kernel, q, k, v, dout, causal=causal)


@LAYOUTS
@pytest.mark.parametrize("s_q,s_k", [(256, 384), (384, 256)])
def test_causal_is_top_left_when_lengths_differ(kernel, layout, s_q, s_k):
    """FA4 aligns causal bottom-right; the kernel shifts its window to our top-left mask."""
    q, k, v, dout = problem(layout, s_q=s_q, s_k=s_k)
    check(kernel, q, k, v, dout, causal=True)


WINDOWS = [
    pytest.param(False, Window(64, 32), 256, 256, id="both-sides"),
    pytest.param(True, Window(64, None), 256, 256, id="causal-left"),
    pytest.param(False, Window(None, 16), 256, 256, id="right-only"),
    pytest.param(False, Window(64, None), 256, 256, id="left-only"),
    pytest.param(True, Window(16, None), 256, 384, id="causal-left-sq<sk"),
    pytest.param(False, Window(32, 8), 384, 256, id="empty-rows"),  # rows 288.. see no key
]


@pytest.mark.parametrize("causal,window,s_q,s_k", WINDOWS)
def test_windows(kernel, causal, window, s_q, s_k):
    """Every window kind, also with rows that see no key (out 0, lse -inf, dq 0)."""
    q, k, v, dout = problem(Layout.BSHE, s_q=s_q, s_k=s_k)
    out, lse, (dq, _, _) = check(kernel, q, k, v, dout, causal=causal, window=window)
    if window.left is not None and s_k + window.left < s_q:  # rows that see no key
        empty = slice(s_k + window.left, None)
        assert torch.isneginf(lse[:, :, empty]).all(), "rows without keys: lse -inf"
        assert (out[:, :, empty] == 0).all() and (dq[:, :, empty] == 0).all()


def test_attention_runs_fa4_end_to_end():
    """attention(kernel="fa4") forward and backward through autograd."""
    q, k, v, dout = problem(Layout.BSHE, kv_heads=4)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = sdpa_fusion.attention(*leaves, causal=True, layout="bshe", kernel="fa4")
    out.backward(dout)
    want = reference.attention(q, k, v, dout, causal=True)
    reference.assert_results((out, *(t.grad for t in leaves)), want)


def test_backward_from_a_merged_out_and_lse(kernel):
    """Ring attention's use: the last 256 of 512 queries against two K/V blocks (the first
    without mask, the second causal, its out and lse written into given buffers), their
    outputs merged by log-sum-exp, then each block's backward from the merged out and lse,
    the second written into given buffers."""
    q, k, v, dout = problem(Layout.BSHE, kv_heads=4, s_q=2 * S, s_k=2 * S)
    scale = scale_for(q.shape[-1])
    late, early = slice(S, None), slice(None, S)
    qs, dos = q[:, :, late], dout[:, :, late]
    o1, l1 = kernel.forward(qs, k[:, :, early], v[:, :, early], causal=False, scale=scale)
    given = (torch.empty_like(qs), torch.empty(qs.shape[:3], dtype=torch.float32, device="cuda"))
    o2, l2 = kernel.forward(qs, k[:, :, late], v[:, :, late], causal=True, scale=scale,
                            out=given[0], lse=given[1])
    assert o2 is given[0] and l2 is given[1], "forward written into the buffers"
    lse = torch.logaddexp(l1, l2)
    out = (o1.float() * (l1 - lse).exp().unsqueeze(-1)
           + o2.float() * (l2 - lse).exp().unsqueeze(-1)).to(q.dtype)
    dq1, dk1, dv1 = kernel.backward(dos, qs, k[:, :, early], v[:, :, early], out, lse,
                                    causal=False, scale=scale)
    buffers = tuple(torch.empty_like(t) for t in (qs, k[:, :, late], v[:, :, late]))
    dq2, dk2, dv2 = kernel.backward(dos, qs, k[:, :, late], v[:, :, late], out, lse,
                                    causal=True, scale=scale, dq=buffers[0], dk=buffers[1],
                                    dv=buffers[2])
    assert all(g is b for g, b in zip((dq2, dk2, dv2), buffers)), "written into the buffers"

    dout_late = dout.clone()
    dout_late[:, :, early] = 0  # the first 256 queries are not part of this problem
    want_out, want_lse, want_dq, want_dk, want_dv = reference.attention(
        q, k, v, dout_late, causal=True, scale=scale)
    torch.testing.assert_close(lse.double(), want_lse[:, :, late], **LSE)
    assert_close(out, want_out[:, :, late], msg="merged out")
    assert_close(dq1.float() + dq2.float(), want_dq[:, :, late], dtype=q.dtype, msg="dq")
    assert_close(torch.cat([dk1, dk2], dim=2), want_dk, msg="dk")
    assert_close(torch.cat([dv1, dv2], dim=2), want_dv, msg="dv")


# ---- one dQ accumulator over the calls of a ring's rows (Hopper) ----------------------------
def _reference_over_blocks(q, blocks, dout, scale):
    """fp64 (out, lse, dq, [(dk, dv) per block]) of queries ``q`` over key blocks ``blocks``
    = [(k, v, visible [s_q, s_k] bool)], their scores softmaxed together: the reference on
    the blocks' keys side by side."""
    k, v, seen = (torch.cat(parts, dim=-1 if i == 2 else 2)
                  for i, parts in enumerate(zip(*blocks)))
    want = reference.attention(q, k, v, dout, scale=scale, mask=seen)
    sizes = [b[0].shape[2] for b in blocks]
    return want.out, want.lse, want.dq, list(zip(want.dk.split(sizes, 2),
                                                 want.dv.split(sizes, 2)))


@LAYOUTS
@pytest.mark.parametrize("kv_heads", [H, 4], ids=["mha", "gqa"])
def test_query_rows_sum_dq_of_calls_in_one_accumulator(kernel, layout, kv_heads):
    """``query_rows`` on Hopper: 400 query rows against four K/V blocks in four calls that
    share one fp32 dQ accumulator (a causal square call on all rows, a full one, one on the
    rows from 170 and one on the rows up to 250: the last two off the 80-row tiles, run on
    the tiles around them with the other rows masked), each call's dK/dV written into given
    tensors, against fp64 math over all blocks at once."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("query_rows sums dQ inside FA4 on Hopper (sm90) only")
    from sdpa_fusion.kernels import fa4_rows

    s = 400
    g = torch.Generator(device="cuda").manual_seed(3)
    q, dout = (randn((B, H, s, 128), layout, generator=g) for _ in range(2))
    rows_of = [slice(0, s), slice(0, s), slice(170, s), slice(0, 250)]
    causal_of = [True, False, False, False]
    blocks = []
    for rows, n, causal in zip(rows_of, [s, 256, 128, 128], causal_of):
        k, v = (randn((B, kv_heads, n, 128), layout, generator=g) for _ in range(2))
        seen = torch.zeros(s, n, dtype=torch.bool, device="cuda")
        seen[rows] = torch.ones(s, n, dtype=torch.bool, device="cuda").tril()[rows] if causal \
            else True
        blocks.append((k, v, seen))
    scale = scale_for(128)
    want_out, want_lse, want_dq, want_kv = _reference_over_blocks(q, blocks, dout, scale)
    out, lse = layout.to(want_out.to(q.dtype)), want_lse.float()
    spans = [(*r.indices(s)[:2], causal) for r, causal in zip(rows_of, causal_of)]
    assert not fa4_rows.rows_fit([(8, s, True)], s, 128)
    assert not fa4_rows.rows_fit([(0, 250, True)], s, 128)
    assert kernel.query_rows(q, dout, out, lse, scale=scale, spans=[(8, s, True)]) is None
    rows = kernel.query_rows(q, dout, out, lse, scale=scale, spans=spans)
    assert rows is not None
    k, v = blocks[1][:2]
    with pytest.raises(ValueError, match="tiles"):
        rows.call(slice(0, 250), k[:, :, :250], v[:, :, :250], torch.empty_like(k[:, :, :250]),
                  torch.empty_like(v[:, :, :250]), causal=True)
    for (k, v, _), r, causal, (want_dk, want_dv) in zip(blocks, rows_of, causal_of, want_kv):
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        rows.call(r, k, v, dk, dv, causal=causal)
        assert_close(dk, want_dk, msg="dk")
        assert_close(dv, want_dv, msg="dv")
    dq = layout.empty(q.shape, dtype=q.dtype, device="cuda")
    assert rows.finish(dq) is dq
    assert_close(dq, want_dq, msg="dq")


# ---- packed sequences ------------------------------------------------------------------------
def packed(lengths_q, lengths_k, kv_heads, e=128, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t_q, t_k = sum(lengths_q), sum(lengths_k)
    q, dout = (randn((t_q, H, e), Layout.THD, generator=g) for _ in range(2))
    k, v = (randn((t_k, kv_heads, e), Layout.THD, generator=g) for _ in range(2))
    cu = [[0], [0]]
    for n_q, n_k in zip(lengths_q, lengths_k):
        cu[0].append(cu[0][-1] + n_q)
        cu[1].append(cu[1][-1] + n_k)
    return q, k, v, dout, Seqlens(tuple(cu[0]), tuple(cu[1]))


PACKED = [
    pytest.param(True, [100, 0, 1, 300, 57], [100, 0, 1, 300, 57], 4, id="causal-gqa"),
    pytest.param(False, [100, 0, 1, 300, 57], [100, 0, 1, 300, 57], 4, id="full-gqa"),
    pytest.param(False, [3, 0, 200, 150], [0, 5, 180, 150], 4, id="full-q-k-differ"),
    pytest.param(True, [200, 300], [300, 200], H, id="causal-q-k-differ-per-sequence"),
]


@pytest.mark.parametrize("causal,lengths_q,lengths_k,kv_heads", PACKED)
def test_packed_sequences(kernel, causal, lengths_q, lengths_k, kv_heads):
    """Sequences of 0 and 1 token, queries and keys differing in number per sequence."""
    q, k, v, dout, seqlens = packed(lengths_q, lengths_k, kv_heads)
    scale = scale_for(q.shape[-1])
    out, lse = kernel.varlen_forward(q, k, v, seqlens, causal=causal, scale=scale)
    dq, dk, dv = kernel.varlen_backward(dout, q, k, v, out, lse, seqlens, causal=causal,
                                        scale=scale)
    assert lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32
    for i, ((qa, qb), (ka, kb)) in enumerate(zip(zip(seqlens.cu_q, seqlens.cu_q[1:]),
                                                 zip(seqlens.cu_k, seqlens.cu_k[1:]))):
        if kb == ka:  # queries without keys
            assert (out[qa:qb] == 0).all() and torch.isneginf(lse[:, qa:qb]).all(), f"seq {i}"
            assert (dq[qa:qb] == 0).all(), f"seq {i}"
        elif qb == qa:  # keys without queries
            assert (dk[ka:kb] == 0).all() and (dv[ka:kb] == 0).all(), f"seq {i}"
    want = reference.packed(q, k, v, dout, seqlens.cu_q, cu_seqlens_k=seqlens.cu_k,
                            causal=causal, scale=scale)
    seen = torch.isfinite(want.lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key: lse -inf"
    torch.testing.assert_close(lse[seen].double(), want.lse[seen], **LSE,
                               msg=lambda m: f"lse: {m}")
    reference.assert_results((out, dq, dk, dv), want)


@pytest.mark.parametrize("causal,lengths_q,lengths_k,kv_heads", PACKED[:1] + PACKED[2:3])
def test_packed_sequences_into_given_buffers(kernel, causal, lengths_q, lengths_k, kv_heads):
    """Output buffers filled with NaN are written whole, in place (sequences without keys or
    without queries too), and hold what a call without buffers returns (``local_forward``
    hands whole documents' rows of a joint result to the kernel so)."""
    q, k, v, dout, seqlens = packed(lengths_q, lengths_k, kv_heads)
    mask = dict(causal=causal, scale=scale_for(q.shape[-1]))
    out, lse = kernel.varlen_forward(q, k, v, seqlens, **mask)
    want = (out, lse, *kernel.varlen_backward(dout, q, k, v, out, lse, seqlens, **mask))
    buffers = [torch.full_like(t, math.nan) for t in want]
    got = kernel.varlen_forward(q, k, v, seqlens, **mask, out=buffers[0], lse=buffers[1])
    got += kernel.varlen_backward(dout, q, k, v, out, lse, seqlens, **mask, dq=buffers[2],
                                  dk=buffers[3], dv=buffers[4])
    for name, result, buffer, expected in zip(("out", "lse", "dq", "dk", "dv"), got, buffers,
                                              want):
        assert result.data_ptr() == buffer.data_ptr(), f"{name}: written in place"
        if name in ("out", "lse"):
            assert torch.equal(buffer, expected), f"{name} differs from a call without buffers"
        else:  # the backward sums dQ (and GQA's dK/dV) with atomics: the order may differ
            torch.testing.assert_close(buffer, expected, atol=1e-2, rtol=1e-2,
                                       msg=lambda m, name=name: f"{name}: {m}")
