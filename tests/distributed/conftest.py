"""Fixtures for tests run on every rank under mpirun:

    mpirun -np 2 python -m pytest tests/distributed
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed

Every rank seeds the same generator, builds the same full tensors, computes the reference on
them with the fp32 reference kernel, and checks its own shard. On CPU ranks the backend is
gloo and the local kernel ``reference``; on GPUs, NCCL.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import schedules
import sdpa_fusion
from sdpa_fusion.kernels.reference import ReferenceKernel
from sdpa_fusion.layout import Layout, has_layout
from sdpa_fusion.spec import AttentionSpec


@dataclasses.dataclass
class Problem:
    """Full q, k, v, dout in one layout and the reference out/gradients of the whole problem."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    layout: Layout
    causal: bool
    scale: float | None
    window: tuple | None = None


def make_problem(b=2, h=4, h_kv=None, s=32, e=16, *, s_kv=None, layout="bhse", causal=False,
                 scale=None, dtype=torch.float32, device="cpu", seed=0, window=None) -> Problem:
    """Random inputs (same on every rank) and the single-process fp32 reference results;
    ``s_kv`` keys per sequence (``s`` by default); ``window`` a sliding window (left, right)."""
    layout = Layout.of(layout)
    h_kv = h_kv or h
    g = torch.Generator().manual_seed(seed)

    def rand(heads, length):
        t = torch.randn(b, heads, length, e, generator=g).to(dtype=dtype, device=device)
        return layout.to(t)

    q, dout = rand(h, s), rand(h, s)
    k, v = rand(h_kv, s_kv or s), rand(h_kv, s_kv or s)
    spec = AttentionSpec.from_tensors(q, k, v, layout=layout, causal=causal, scale=scale,
                                      window=window)
    ref = ReferenceKernel()
    masks = dict(causal=causal, scale=spec.softmax_scale, window=spec.window)
    out, lse = ref.forward(q, k, v, **masks)
    dq, dk, dv = ref.backward(dout, q, k, v, out, lse, **masks)
    return Problem(q, k, v, dout, out, dq, dk, dv, layout, causal, scale, window)


def tolerance(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
            torch.float16: dict(rtol=2e-3, atol=2e-3)}[dtype]


@pytest.fixture(scope="session")
def mesh():
    """A 1-D mesh over all ranks, named ("seq",); torn down after the last test."""
    m = sdpa_fusion.init_mesh((-1,), ("seq",))
    yield m
    sdpa_fusion.close_mesh()


@pytest.fixture
def several_ranks(mesh):
    """Skip a test that needs two ranks or more (an error one rank cannot show) when the
    suite runs as one process; under mpirun it runs."""
    if mesh.size() == 1:
        pytest.skip("needs two ranks or more")


@pytest.fixture(scope="session")
def device(mesh):
    return mesh.device


def schedule_with(name: str, mesh, partition: str, index_map):
    """Schedule ``name`` over ``mesh`` with ``partition``; the name "index_map" stands for
    the rows ``index_map()`` makes."""
    rows = index_map() if partition == "index_map" else partition
    return schedules.get(name, mesh, partition=rows)


def run_schedule(schedule, problem: Problem, *, kernel="reference", shard_kwargs=None):
    """Shard the problem, run forward and backward through ``attention``, unshard the results:
    (out, dq, dk, dv) as full tensors on every rank."""
    layout = problem.layout
    q, k, v = (schedule.shard(t, layout=layout).requires_grad_() for t in (problem.q, problem.k, problem.v))
    dout = schedule.shard(problem.dout, layout=layout)
    out = sdpa_fusion.attention(q, k, v, causal=problem.causal, scale=problem.scale, layout=layout,
                                kernel=kernel, schedule=schedule, window=problem.window)
    out.backward(dout)
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert has_layout(t, layout), f"local {name} lost the layout {layout.value}"
    return tuple(schedule.unshard(t, layout=layout) for t in (out, q.grad, k.grad, v.grad))


def assert_matches(problem: Problem, results, dtype=torch.float32):
    """Full results of a schedule equal the reference (within the dtype's tolerance) and keep
    the layout of the inputs."""
    for name, got, want in zip(("out", "dq", "dk", "dv"), results, (problem.out, problem.dq, problem.dk, problem.dv)):
        assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
        torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype), msg=lambda m: f"{name}: {m}")
