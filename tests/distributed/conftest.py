"""Fixtures for tests run on every rank under mpirun:

    mpirun -np 2 python -m pytest tests/distributed
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed

Every rank seeds the same generator, builds the same full tensors, computes the reference on
them (tests/reference.py: torch SDPA in fp64), and checks the gathered results within the
tolerance of their dtype (its TOLERANCES). On CPU ranks the backend is gloo and the local
kernel ``reference``; on GPUs, NCCL. Every test starts from a barrier of all ranks
(``barrier``). Tests of pure functions (plans, tables, describe() on a VirtualMesh) live in
tests/, not here: they need no process group.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import schedules
import sdpa_fusion
from sdpa_fusion.layout import Layout, has_layout
from tests import reference


@dataclasses.dataclass
class Problem:
    """Full q, k, v, dout in one layout and the reference out/gradients (fp64) of the whole
    problem."""

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
    """Random inputs (same on every rank) and the reference's results on the whole problem;
    ``s_kv`` keys per sequence (``s`` by default); ``window`` a sliding window (left, right)."""
    layout = Layout.of(layout)
    h_kv = h_kv or h
    g = torch.Generator().manual_seed(seed)

    def rand(heads, length):
        t = torch.randn(b, heads, length, e, generator=g).to(dtype=dtype, device=device)
        return layout.to(t)

    q, dout = rand(h, s), rand(h, s)
    k, v = rand(h_kv, s_kv or s), rand(h_kv, s_kv or s)
    want = reference.attention(q, k, v, dout, causal=causal, scale=scale, window=window)
    out, dq, dk, dv = (layout.to(t) for t in want.results)  # in the layout, as shard takes them
    return Problem(q, k, v, dout, out, dq, dk, dv, layout, causal, scale, window)


@pytest.fixture(scope="session")
def mesh():
    """A 1-D mesh over all ranks, named ("seq",); torn down after the last test."""
    m = sdpa_fusion.init_mesh((-1,), ("seq",))
    yield m
    sdpa_fusion.close_mesh()


@pytest.fixture(autouse=True)
def barrier(mesh):
    """Every test starts when every rank has arrived: a barrier of torch.distributed's WORLD
    group, so that one test's leftover traffic or a rank's early failure does not run into
    the next test. gloo: ``monitored_barrier``, which names the ranks that did not come,
    bounded by twice the mesh's timeout (ranks that a rank's early failure left waiting in
    the last test leave it after one timeout, with a MeshTimeout, and still meet here; a rank
    stuck for good fails the barrier instead of hanging); NCCL: the WORLD group's own timeout
    (the mesh's)."""
    if mesh.closed:
        pytest.fail(f"{mesh!r} was closed by an earlier test; tests under mpirun share the "
                    f"session's mesh, none may call sdpa_fusion.close_mesh()")
    if mesh.size() > 1:
        world = dist.group.WORLD
        if dist.get_backend(world) == "gloo":
            dist.monitored_barrier(world, timeout=2 * mesh.timeout, wait_all_ranks=True)
        else:
            dist.barrier(world, device_ids=[mesh.device.index])
    yield


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


def assert_matches(problem: Problem, results):
    """Full results (out, dq, dk, dv) of a schedule equal the reference within the tolerance
    of the problem's dtype."""
    for name, got, want in zip(("out", "dq", "dk", "dv"), results,
                               (problem.out, problem.dq, problem.dk, problem.dv)):
        reference.assert_close(got, want, problem.q.dtype, msg=name)
