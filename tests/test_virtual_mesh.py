"""VirtualMesh: a mesh of a given shape seen from one rank, with no process group, on which
schedules validate, shard and describe, and refuse to communicate.
Run: pytest -q tests/test_virtual_mesh.py"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import schedules
import sdpa_fusion
from sdpa_fusion import VirtualMesh


def test_coordinates_and_lines_of_a_two_dim_mesh():
    mesh = VirtualMesh((2, 3), ("heads", "seq"), rank=4)
    assert (mesh.size(), mesh.size("heads"), mesh.size("seq")) == (6, 2, 3)
    assert (mesh.coordinate("heads"), mesh.coordinate("seq")) == (1, 1)
    assert mesh.ranks("seq") == [3, 4, 5] and mesh.ranks("heads") == [1, 4]
    assert mesh.control_group("seq") is None
    assert not dist.is_initialized()


@pytest.mark.parametrize("shape,names,rank,message", [
    ((4,), ("seq",), 4, r"rank=4 must be an int in \[0, 4\)"),
    ((-1,), ("seq",), 0, r"must hold positive sizes \(no -1"),
    ((2, 2), ("seq",), 0, r"shape \(2, 2\) and names \('seq',\) must have the same length"),
    ((2, 2), ("seq", "seq"), 0, r"names \('seq', 'seq'\) must be distinct"),
])
def test_a_bad_virtual_mesh_is_a_value_error(shape, names, rank, message):
    with pytest.raises(ValueError, match=message):
        VirtualMesh(shape, names, rank=rank)


def test_a_schedule_on_a_virtual_mesh_plans_but_does_not_run():
    mesh = VirtualMesh((4,), ("seq",), rank=1)
    sched = schedules.get("ring", mesh)
    q = torch.randn(1, 2, 16, 8)
    local = sched.shard(q)
    assert torch.equal(local, q[:, :, [2, 3, 12, 13]])  # load_balanced: chunks 1 and 6 of 8
    with pytest.raises(ValueError, match="plans, it does not communicate; build the mesh"):
        sdpa_fusion.attention(local, sched.shard(q), sched.shard(q), schedule=sched)
    assert not dist.is_initialized()
