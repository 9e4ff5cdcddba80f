"""The hybrid schedule on 2-D meshes of GPUs vs the test reference (tests/reference.py: torch
SDPA in fp64) on the full tensors, dense and packed (per sequence).

    mpirun -np 2 python -m pytest tests/gpu_distributed/test_hybrid_gpu.py   # 1x2 and 2x1
    mpirun -np 4 python -m pytest tests/gpu_distributed/test_hybrid_gpu.py   # 2x2

Mesh shapes are (inner "heads", outer "seq") sizes. Every rank unshards all its results
before any assert, so a failure on one rank leaves no other waiting in a collective. Without
CUDA every test here is skipped.
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from tests import reference

from ..distributed.test_hybrid import meshes, shapes  # noqa: F401  (fixture, shapes of this world)
from .conftest import requires_gpus
from .test_schedules_gpu import _full_problem
from .test_thd_gpu import LENGTHS, _problem

pytestmark = requires_gpus


def check(sched, layout, causal, kernel, *, h_kv=4, s=2048):
    q, k, v, dout = _full_problem(layout, h_kv=h_kv, s=s)
    expected = reference.attention(q, k, v, dout, causal=causal)
    q_l, k_l, v_l = (sched.shard(t, layout=layout).requires_grad_() for t in (q, k, v))
    out_l = sdpa_fusion.attention(q_l, k_l, v_l, causal=causal, layout=layout, kernel=kernel,
                                  schedule=sched)
    out_l.backward(sched.shard(dout, layout=layout))
    kv = dict(heads=h_kv, copies="sum")
    got = [sched.unshard(out_l, layout=layout), sched.unshard(q_l.grad, layout=layout),
           sched.unshard(k_l.grad, layout=layout, **kv), sched.unshard(v_l.grad, layout=layout, **kv)]
    assert_close_to_torch(got, expected, _torch_bf16(q, k, v, dout, causal))


def check_packed(sched, causal, kv_heads):
    """Packed sequences of 0, 1 and lengths not multiples of 2 x ranks in user padding
    (``test_thd_gpu``), ATen flash varlen calls; padding outputs and gradients exactly zero."""
    (q, k, v, dout, cu, cu_padded), expected = _problem(causal, kv_heads, True)
    kw = dict(layout="thd", cu_seqlens=cu, cu_seqlens_padded=cu_padded)
    q_l, k_l, v_l = (sched.shard(t, **kw).requires_grad_() for t in (q, k, v))
    out_l = sdpa_fusion.attention(q_l, k_l, v_l, causal=causal, kernel="flash", schedule=sched,
                                  **kw)
    out_l.backward(sched.shard(dout, **kw))
    local = (out_l, q_l.grad, k_l.grad, v_l.grad)
    copies = dict(heads=kv_heads, copies="sum")
    got = [*(sched.unshard(t, **kw) for t in local[:2]),
           *(sched.unshard(t, **kw, **copies) for t in local[2:])]
    padding = sched.pack(cu, cu_padded).token_index < 0
    for name, t in zip(("out", "dq", "dk", "dv"), local):
        assert not t[padding].any(), f"{name} is not zero on padding tokens"
    bf16 = [torch.zeros_like(t) for t in (q, q, k, v)]
    for start, n in zip(cu_padded[:-1].tolist(), LENGTHS):
        rows = slice(start, start + n)
        if n:
            part = _torch_bf16(*(t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v, dout)),
                               causal)
            for full, t in zip(bf16, part):
                full[rows] = t[0].transpose(0, 1)
    assert_close_to_torch(got, expected, bf16)


def assert_close_to_torch(got, expected, bf16):
    """(out, dq, dk, dv) equal the reference's ``expected``: within the bf16 level of its
    TOLERANCES, or within 2x of torch's own bf16 error ``bf16`` (sums over many heads)."""
    for name, g, want, torch_bf16 in zip(("out", "dq", "dk", "dv"), got, expected.results, bf16):
        error = (g.double() - want).abs().max().item()
        yardstick = (torch_bf16.double() - want).abs().max().item()
        if error <= 2 * yardstick:
            continue
        reference.assert_close(g, want, msg=f"{name} (torch's bf16 error {yardstick:.3g})")


def _torch_bf16(q, k, v, dout, causal):
    """(out, dq, dk, dv) of torch SDPA on the bf16 inputs (its own kernel choice): not a
    reference, the yardstick of what bf16 attention errs by here."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                           enable_gqa=True)
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


@shapes
@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
@pytest.mark.parametrize("outer", ["ring", "allgather"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_torch_sdpa(meshes, shape, inner, outer, causal):
    sched = schedules.get("hybrid", meshes(shape), inner=inner, outer=outer)
    check(sched, "bshe", causal, "cudnn")


@shapes
@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
def test_nvfuser_kernel(meshes, shape, inner):
    """With inner head_parallel the nvFuser fusions carry the head split (DID annotation)."""
    sched = schedules.get("hybrid", meshes(shape), inner=inner)
    check(sched, "bhse", True, "nvfuser")


@shapes
@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
def test_one_kv_head(meshes, shape, inner):
    """One K/V head for all query heads: replicated over the inner ranks."""
    sched = schedules.get("hybrid", meshes(shape), inner=inner, outer="ring")
    check(sched, "bhse", True, "auto", h_kv=1)


@shapes
@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
@pytest.mark.parametrize("outer", ["ring", "allgather"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_matches_torch_sdpa(meshes, shape, inner, outer, causal):
    """Packed sequences, GQA 8:4."""
    check_packed(schedules.get("hybrid", meshes(shape), inner=inner, outer=outer), causal, 4)


@shapes
@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
def test_packed_one_kv_head(meshes, shape, inner):
    """Packed sequences, one K/V head for all query heads (fewer than the inner ranks)."""
    check_packed(schedules.get("hybrid", meshes(shape), inner=inner), True, 1)
