"""A 2-D mesh ("heads", "seq"): schedules run over one dim, each line of ranks on its own.

    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_mesh_2d.py
"""

from __future__ import annotations

import pytest

import schedules
import sdpa_fusion

from .conftest import assert_matches, make_problem, run_schedule


@pytest.fixture(scope="module")
def mesh_2d(mesh):
    if mesh.size() % 2:
        pytest.skip("a 2 x P/2 mesh needs an even number of ranks")
    return sdpa_fusion.init_mesh((2, -1), ("heads", "seq"))


def test_2d_mesh_lines(mesh_2d):
    assert mesh_2d.shape == (2, mesh_2d.world_size // 2)
    heads_line, seq_line = mesh_2d.ranks("heads"), mesh_2d.ranks("seq")
    assert mesh_2d.rank in heads_line and mesh_2d.rank in seq_line
    assert len(heads_line) == 2 and len(seq_line) == mesh_2d.world_size // 2
    assert set(heads_line) & set(seq_line) == {mesh_2d.rank}


@pytest.mark.parametrize("name,dim", [("head_parallel", "heads"), ("ring", "seq"),
                                      ("ulysses", "seq"), ("head_parallel", "seq")])
def test_schedule_over_one_dim_of_a_2d_mesh(mesh_2d, name, dim):
    p = mesh_2d.size(dim)
    problem = make_problem(b=1, h=4 * p, h_kv=2 * p, s=8 * p, e=8, layout="bshe", causal=True)
    sched = schedules.get(name, mesh_2d, dim=dim)
    assert sched.size == p
    assert_matches(problem, run_schedule(sched, problem))


def test_dtensor_on_another_mesh_is_refused(mesh, mesh_2d):
    from torch.distributed.tensor import Shard, distribute_tensor

    problem = make_problem(b=1, h=2 * mesh.size(), s=8, e=8)
    sched = schedules.get("head_parallel", mesh_2d, dim="heads")
    q = distribute_tensor(problem.q, mesh.torch_mesh, [Shard(1)])
    with pytest.raises(ValueError, match=r"q lives on DeviceMesh .* but schedule 'head_parallel' "
                                         r"runs on .*; use the schedule's mesh"):
        sdpa_fusion.attention(q, q, q, schedule=sched, kernel="reference")

