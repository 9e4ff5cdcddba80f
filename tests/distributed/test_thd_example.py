"""The packed example agrees with one-device attention under every schedule.

    mpirun -np 2 python -m pytest tests/distributed/test_thd_example.py
"""

from __future__ import annotations

import pytest

from examples.packed_thd import mesh_for, run


@pytest.mark.parametrize("schedule", ["ring", "allgather", "ulysses", "head_parallel", "hybrid"])
def test_packed_example_runs_each_schedule(mesh, schedule):
    p = mesh.size()
    if schedule == "hybrid":
        mesh = mesh_for(schedule)
    checked = run(mesh, schedule, heads=2 * max(4, p), kv_heads=max(4, p), head_dim=16)
    assert checked["out"] < 1e-5 and checked["dq"] < 1e-5
    if schedule != "head_parallel":
        assert checked["rope"] == 0.0 and checked["padding"] == 0.0
