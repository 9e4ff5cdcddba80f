"""The example script's schedules agree with one-device attention on every rank.

    mpirun -np 2 python -m pytest tests/distributed/test_example.py
"""

from __future__ import annotations

import pytest

from examples.context_parallel import run


@pytest.mark.parametrize("schedule", ["ring", "allgather", "ulysses", "head_parallel"])
def test_example_runs_each_schedule(mesh, schedule):
    kv_heads = 4 if mesh.size() <= 4 else mesh.size()
    errors = run(mesh, schedule, heads=2 * max(4, mesh.size()), kv_heads=kv_heads)
    assert set(errors) == {"out", "dq", "dk", "dv"}
    assert max(errors.values()) < 1e-5, errors
