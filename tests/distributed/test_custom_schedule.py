"""The worked example of docs/custom_schedule.md: a user's schedule, registered without
editing the package, runs forward and backward like the built-in ones and refuses what it
cannot do on every rank.

    mpirun -np 4 python -m pytest tests/distributed/test_custom_schedule.py
"""

from __future__ import annotations

import importlib

import pytest
import torch

import schedules
import sdpa_fusion
from tests.distributed.conftest import assert_matches, make_problem, run_schedule
from tests.comms import counting
from tests.distributed.test_memory import assert_described
from tests.distributed.test_traffic import assert_bytes


@pytest.fixture(scope="module", autouse=True)
def example():
    """The example module, imported (so registering its schedule) into a copy of the
    registry that is dropped after these tests: the other tests see the built-in names."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schedules, "_REGISTRY", dict(schedules._REGISTRY))
        module = importlib.import_module("examples.custom_schedule")
        yield importlib.reload(module)


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_gather_kv_matches_the_reference(mesh, example, layout):
    p = mesh.size()
    problem = make_problem(b=2, h=4, h_kv=2, s=4 * p, e=16, layout=layout, scale=0.5)
    sched = schedules.get("gather_kv", mesh)
    assert isinstance(sched, example.GatherKV)
    assert_matches(problem, run_schedule(sched, problem))


def test_the_example_script_checks_what_it_prints(mesh, example):
    errors = example.run(mesh)
    assert set(errors) == {"out", "dq", "dk", "dv"} and max(errors.values()) < 1e-5


def test_gather_kv_refuses_causal_on_every_rank_then_runs(mesh):
    problem = make_problem(b=1, h=2, s=2 * mesh.size(), e=8)
    sched = schedules.get("gather_kv", mesh)
    q, k, v = (sched.shard(t) for t in (problem.q, problem.k, problem.v))
    with pytest.raises(ValueError, match="schedule 'gather_kv' attends every query to every key"):
        sdpa_fusion.attention(q, k, v, causal=True, schedule=sched)
    assert_matches(problem, run_schedule(sched, problem))


def test_gather_kv_allocates_what_its_dry_run_says(mesh, example):
    """Its memory is no formula of its own: a dry run of its code, here against a real run."""
    p = mesh.size()
    sched = schedules.get("gather_kv", mesh)
    full = [torch.randn(1, 4, 8 * p, 64) for _ in range(4)]
    spec = sdpa_fusion.AttentionSpec.from_tensors(*full[:3])
    q, k, v, dout = (sched.shard(t).detach() for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory)


def test_gather_kv_describes_what_it_does(mesh, example):
    """Its describe() is a dry run of its code: one kernel call each way on a P-th of the
    FLOPs, and the bytes torch.distributed sees it move in a real call, each way."""
    p = mesh.size()
    sched = schedules.get("gather_kv", mesh)
    full = [torch.randn(1, 4, 8 * p, 16) for _ in range(4)]
    spec = sdpa_fusion.AttentionSpec.from_tensors(*full[:3])
    d = sched.describe(spec)
    assert (d.steps, d.backward_steps) == (1, 1)
    assert d.flops == pytest.approx(spec.flops() / p)
    assert d.flops + d.backward_flops == pytest.approx(spec.flops(backward=True) / p)
    q, k, v, dout = (sched.shard(t) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with counting() as forward:
        out = sdpa_fusion.attention(q, k, v, kernel="reference", schedule=sched)
    with counting() as backward:
        out.backward(dout)
    assert_bytes(d, forward, backward, sched.group)
