"""shard and unshard: differentiable, and the gradient of the full tensor reaches each shard.

    mpirun -np 2 python -m pytest tests/distributed/test_shard.py
"""

from __future__ import annotations

import pytest

import schedules
import sdpa_fusion
from tests.reference import assert_close

from .conftest import make_problem


@pytest.mark.parametrize("name", ["ring", "head_parallel", "ulysses"])
def test_shard_and_unshard_are_differentiable(mesh, name):
    """A loss on the unsharded output gives every rank the gradient of its own shard."""
    problem = make_problem(b=1, h=2 * mesh.size(), s=8 * mesh.size(), e=8, layout="bshe", causal=True)
    sched = schedules.get(name, mesh)
    q = problem.q.clone().requires_grad_()
    k, v = (sched.shard(t, layout="bshe") for t in (problem.k, problem.v))
    out = sched.unshard(sdpa_fusion.attention(sched.shard(q, layout="bshe"), k, v, causal=True,
                                              layout="bshe", kernel="reference", schedule=sched),
                        layout="bshe")
    (out * problem.dout).sum().backward()
    assert_close(out, problem.out)
    local = sched.shard(q.grad, layout="bshe")
    assert_close(local, sched.shard(problem.dq, layout="bshe"))
