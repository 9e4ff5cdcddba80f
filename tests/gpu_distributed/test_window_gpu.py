"""Sliding windows under ``ring`` and ``allgather`` with the flash and fa4 kernels vs the test
reference (tests/reference.py: torch SDPA in fp64 with the mask i - left <= j <= i + right,
and j <= i when causal) on the full problem, dense and packed (per sequence), within the bf16
level of its TOLERANCES.

    mpirun -np 2 python -m pytest -q tests/gpu_distributed/test_window_gpu.py

Head groups under a window run with flash (``test_dense_head_groups``).

Dense: 2 x 4096 tokens, 8 query heads over 4 K/V heads, windows within a load-balanced chunk
and past it. Packed: lengths 1000, 1, 0, 517, 2051, 64 (not multiples of 2 x ranks). fa4
skips without FlashAttention-4 (fails with SDPA_FUSION_REQUIRE_FA4=1).
"""

from __future__ import annotations

import functools

import pytest
import torch

import schedules
import sdpa_fusion
from tests import reference

from .conftest import requires_gpus

pytestmark = requires_gpus

LENGTHS = [1000, 1, 0, 517, 2051, 64]
CASES = [(True, (300, 0)), (False, (200, 1500))]  # (causal, window): within and past a chunk


@functools.lru_cache(maxsize=4)
def dense_problem(causal: bool, window):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4096, h, 128, device="cuda", generator=g, dtype=torch.bfloat16)
                     for h in (8, 4, 4, 8))
    logical = (t.transpose(1, 2) for t in (q, k, v, dout))  # [B, H, S, E] views
    want = reference.attention(*logical, causal=causal, window=window)
    return (q, k, v, dout), [t.transpose(1, 2) for t in want.results]


@functools.lru_cache(maxsize=4)
def packed_problem(causal: bool, window):
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, dout = (torch.randn(int(cu[-1]), h, 128, device="cuda", generator=g,
                                 dtype=torch.bfloat16) for h in (8, 4, 4, 8))
    want = reference.packed(q, k, v, dout, cu, causal=causal, window=window)
    return (q, k, v, dout, cu), want.results


def assert_close(got, expected):
    """(out, dq, dk, dv) equal the reference's within the tolerance of their dtype."""
    for name, g, want in zip(("out", "dq", "dk", "dv"), got, expected):
        reference.assert_close(g, want, msg=name)


@pytest.fixture
def kernel(request):
    if request.param == "fa4":
        request.getfixturevalue("fa4_kernel")
    return request.param


@pytest.mark.parametrize("name", ["ring", "allgather"])
@pytest.mark.parametrize("kernel", ["flash", "fa4"], indirect=True)
@pytest.mark.parametrize("causal, window", CASES, ids=["causal-300", "full-200-1500"])
def test_dense(mesh, name, kernel, causal, window):
    _check_dense(schedules.get(name, mesh), kernel, causal, window)


@pytest.mark.parametrize("name", ["ring", "allgather"])
@pytest.mark.parametrize("causal, window", CASES, ids=["causal-300", "full-200-1500"])
def test_dense_head_groups(mesh, name, causal, window):
    """Two head groups under a window (the ring's transport: each group's blocks to the
    steps some rank needs, several hops at once on 4 GPUs)."""
    _check_dense(schedules.get(name, mesh, head_groups=2), "flash", causal, window)


def _check_dense(sched, kernel, causal, window):
    (q, k, v, dout), expected = dense_problem(causal, window)
    shard = functools.partial(sched.shard, layout="bshe")
    q_l, k_l, v_l = (shard(t.transpose(1, 2)).requires_grad_() for t in (q, k, v))
    out = sdpa_fusion.attention(q_l, k_l, v_l, causal=causal, window=window, kernel=kernel,
                                layout="bshe", schedule=sched)
    out.backward(shard(dout.transpose(1, 2)))
    got = [sched.unshard(t, layout="bshe").transpose(1, 2)
           for t in (out, q_l.grad, k_l.grad, v_l.grad)]
    assert_close(got, expected)


@pytest.mark.parametrize("name", ["ring", "allgather"])
@pytest.mark.parametrize("kernel", ["flash", "fa4"], indirect=True)
@pytest.mark.parametrize("causal, window", CASES, ids=["causal-300", "full-200-1500"])
def test_packed(mesh, name, kernel, causal, window):
    (q, k, v, dout, cu), expected = packed_problem(causal, window)
    sched = schedules.get(name, mesh)
    kw = dict(layout="thd", cu_seqlens=cu)
    q_l, k_l, v_l = (sched.shard(t, **kw).requires_grad_() for t in (q, k, v))
    out = sdpa_fusion.attention(q_l, k_l, v_l, causal=causal, window=window, kernel=kernel,
                                schedule=sched, **kw)
    out.backward(sched.shard(dout, **kw))
    assert_close([sched.unshard(t, **kw) for t in (out, q_l.grad, k_l.grad, v_l.grad)], expected)
