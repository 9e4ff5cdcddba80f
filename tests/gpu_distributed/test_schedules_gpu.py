"""Every schedule with the GPU kernels vs the test reference (tests/reference.py: torch SDPA in
fp64) on the full tensors, within the bf16 level of its TOLERANCES.

    mpirun -np 4 python -m pytest tests/gpu_distributed

The fa4 cases skip without FlashAttention-4, or fail with SDPA_FUSION_REQUIRE_FA4=1
(``fa4_kernel`` in tests/conftest.py). They use the kernel configurations of
tests/gpu/test_fa4.py (hd 128 MHA and GQA 8:4, hd 256 MHA, full and causal), so with
FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 after that file nothing compiles again.
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from sdpa_fusion.layout import Layout
from tests import reference

from .conftest import requires_gpus

pytestmark = requires_gpus

SCHEDULES = ["head_parallel", "ring", "allgather", "ulysses"]
KERNELS = ["nvfuser", "cudnn", "flash", "fa4"]


def _full_problem(layout, *, b=2, h=8, h_kv=8, s=2048, e=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(heads):
        t = torch.randn(b, heads, s, e, device="cuda", generator=g, dtype=torch.bfloat16)
        return Layout.of(layout).to(t)

    return rand(h), rand(h_kv), rand(h_kv), rand(h)


def _check_schedule(mesh, schedule, kernel, layout, causal, options=None, **problem):
    if schedule not in schedules.names():
        pytest.fail(f"schedule {schedule!r} is not registered")
    sched = schedules.get(schedule, mesh, **(options or {}))
    q, k, v, dout = _full_problem(layout, **problem)
    expected = reference.attention(q, k, v, dout, causal=causal)
    q_l, k_l, v_l = (sched.shard(t, layout=layout).requires_grad_() for t in (q, k, v))
    out_l = sdpa_fusion.attention(q_l, k_l, v_l, causal=causal, layout=layout, kernel=kernel, schedule=sched)
    out_l.backward(sched.shard(dout, layout=layout))
    got = [sched.unshard(t, layout=layout) for t in (out_l, q_l.grad, k_l.grad, v_l.grad)]
    reference.assert_results(got, expected)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [8, 4], ids=["mha", "gqa"])
def test_schedule_matches_torch_sdpa(request, mesh, schedule, kernel, layout, causal, kv_heads):
    if kernel == "fa4":
        request.getfixturevalue("fa4_kernel")
    _check_schedule(mesh, schedule, kernel, layout, causal, h_kv=kv_heads)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kernel", ["fa4", "flash"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_schedule_at_head_dim_256(request, mesh, schedule, kernel, causal):
    """Head dims beyond cuDNN's 128 under every schedule (FA4 and ATen flash go to 256)."""
    if kernel == "fa4":
        request.getfixturevalue("fa4_kernel")
    _check_schedule(mesh, schedule, kernel, "bshe", causal, e=256, s=1024)


@pytest.mark.parametrize("transport", ["p2p", "copy_engine"])
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_transports_match_torch_sdpa(mesh, transport, layout, causal):
    """Both ways of moving ring blocks (NCCL send/receive, copy engines over symmetric
    memory) give torch SDPA's results, over calls of two sizes on one schedule."""
    sched = schedules.get("ring", mesh, transport=transport)
    results = []  # every call's collectives on every rank before any assert
    for s, seed in ((2048, 0), (4096, 1), (2048, 2)):
        q, k, v, dout = _full_problem(layout, h_kv=4, s=s, seed=seed)
        q_l, k_l, v_l = (sched.shard(t, layout=layout).requires_grad_() for t in (q, k, v))
        out_l = sdpa_fusion.attention(q_l, k_l, v_l, causal=causal, layout=layout,
                                      kernel="cudnn", schedule=sched)
        out_l.backward(sched.shard(dout, layout=layout))
        got = [sched.unshard(t, layout=layout) for t in (out_l, q_l.grad, k_l.grad, v_l.grad)]
        results.append((s, got, reference.attention(q, k, v, dout, causal=causal)))
    assert sched.mover(torch.device("cuda", torch.cuda.current_device())).name == transport
    for s, got, expected in results:
        reference.assert_results(got, expected, msg=f"s={s}")


def test_ring_auto_transport_is_copy_engine_on_gpus(mesh):
    sched = schedules.get("ring", mesh)
    assert sched.mover(torch.device("cuda", torch.cuda.current_device())).name == "copy_engine"


def test_ring_sums_dq_inside_fa4(request, mesh, monkeypatch):
    """On Hopper the ring's head groups sum dQ inside FA4 (``fa4_rows.QueryRows``: one fp32
    accumulator for all calls on their rows): with 1024 rows per rank every rank's calls,
    those on the second chunk's 512 rows off the 80-row tiles (masked rows around them)."""
    request.getfixturevalue("fa4_kernel")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the ring sums dQ inside FA4 on Hopper (sm90) only")
    from sdpa_fusion.kernels import fa4_rows

    rows = []
    call = fa4_rows.QueryRows.call

    def counted(self, span, *args, **kwargs):
        rows.append(span)
        return call(self, span, *args, **kwargs)

    monkeypatch.setattr(fa4_rows.QueryRows, "call", counted)
    _check_schedule(mesh, "ring", "fa4", "bshe", True, b=1, s=1024 * mesh.size())
    assert all(mesh.agree(len(rows) >= 2)), "every rank: its own block's call and another"
