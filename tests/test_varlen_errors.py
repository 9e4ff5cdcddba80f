"""Bad packed-sequence input on one device: every bad ``cu_seqlens``/``cu_seqlens_padded`` is a
ValueError naming the argument and the fix, and a correct call after it works. Also the
values of ``cu_seqlens``: read on every call, so a buffer refilled in place serves its new
packing.

Run: pytest -q tests/test_varlen_errors.py
(Messages of the checks shared with AttentionSpec are pinned in test_spec.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sdpa_fusion
from tests import reference
from tests.distributed.packed import refill


def packed(t=20, h=2, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, e, generator=g) for _ in range(3))


def cu(*values, dtype=torch.int32, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


BAD = [
    (dict(cu_seqlens=cu(0, 20, dtype=torch.float32)),
     r"^cu_seqlens must hold int32 or int64 offsets, got dtype torch.float32"),
    (dict(cu_seqlens=cu(0, 20, dtype=torch.int16)),
     r"^cu_seqlens must hold int32 or int64 offsets, got dtype torch.int16"),
    (dict(cu_seqlens=cu(0, 20, device="meta")),
     r"^cu_seqlens is on meta but q, k, v are on cpu; pass cu_seqlens.to\(q.device\) \(or a "
     r"Python list of ints"),
    (dict(cu_seqlens=cu(1, 20)), r"^cu_seqlens=\[1, 20\] must start at 0 .*; prepend 0"),
    (dict(cu_seqlens=cu(0, 12, 9, 20)), r"^cu_seqlens=\[0, 12, 9, 20\] must never decrease"),
    (dict(cu_seqlens=cu(0, 12, 19)), r"^cu_seqlens ends at 19 but the packed tensor has 20 tokens; "
                                     r"the last entry must equal T"),
    (dict(cu_seqlens=[0, 5.0, 20]), r"^cu_seqlens=\[0, 5.0, 20\] must hold Python ints"),
    (dict(cu_seqlens="0,20"), r"^cu_seqlens must be an int32/int64 tensor or a list of ints, got str"),
    (dict(cu_seqlens=cu(0, 5, 12), cu_seqlens_padded=cu(0, 4, 20)),
     r"^cu_seqlens_padded leaves sequence 0 room for 4 tokens but cu_seqlens gives it 5"),
    (dict(cu_seqlens=cu(0, 5, 12), cu_seqlens_padded=cu(0, 8, 20, dtype=torch.float64)),
     r"^cu_seqlens_padded must hold int32 or int64 offsets"),
    (dict(cu_seqlens=cu(0, 5, 12), cu_seqlens_padded=cu(0, 8, 18)),
     r"^cu_seqlens_padded ends at 18 but the packed tensor has 20 tokens"),
]


@pytest.mark.parametrize("bad, message", BAD, ids=range(len(BAD)))
def test_bad_cu_seqlens_then_a_good_call(bad, message):
    q, k, v = packed()
    with pytest.raises(ValueError, match=message):
        sdpa_fusion.attention(q, k, v, layout="thd", causal=True, **bad)
    out = sdpa_fusion.attention(q, k, v, layout="thd", causal=True, cu_seqlens=cu(0, 7, 20))
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_long_cu_seqlens_are_shown_elided():
    q, k, v = packed(t=100)
    bad = cu(*range(0, 95, 5), 85, 100)
    with pytest.raises(ValueError, match=r"^cu_seqlens=\[0, 5, 10, 15, 20, 25, \.\.\., 90, 85, 100\] "
                                         r"must never decrease, but entry 19 \(85\) is below entry 18"):
        sdpa_fusion.attention(q, k, v, layout="thd", cu_seqlens=bad)


def test_a_host_list_needs_no_tensor():
    q, k, v = packed()
    want = sdpa_fusion.attention(q, k, v, layout="thd", cu_seqlens=cu(0, 7, 20))
    assert torch.equal(sdpa_fusion.attention(q, k, v, layout="thd", cu_seqlens=[0, 7, 20]), want)
    assert torch.equal(sdpa_fusion.attention(q, k, v, layout="thd", cu_seqlens=(0, 7, 20)), want)


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_a_cu_seqlens_buffer_refilled_in_place_serves_its_new_packing(how):
    """Each call reads the packing the buffer holds now: the reference per sequence."""
    q, k, v = packed()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    array = np.array([0, 7, 20], dtype=np.int32) if how == "numpy" else None
    offsets = torch.from_numpy(array) if array is not None else cu(0, 7, 20)
    for values in ([0, 7, 20], [0, 12, 20], [0, 3, 20]):
        refill(offsets, array, values)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sdpa_fusion.attention(*leaves, layout="thd", causal=True, cu_seqlens=offsets)
        out.backward(dout)
        want = reference.packed(q, k, v, dout, values, causal=True)
        reference.assert_results((out, *(t.grad for t in leaves)), want, msg=str(values))
