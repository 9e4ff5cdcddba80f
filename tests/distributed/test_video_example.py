"""The video example: intact 3-D tiles per rank, 3-D RoPE at each rank's own (f, h, w), the
gathered output and gradients equal to one device's, under every sequence schedule.

    mpirun -np 4 python -m pytest tests/distributed/test_video_example.py
"""

from __future__ import annotations

import pytest

from examples.video_tiles import TILES, run


@pytest.mark.parametrize("schedule", ["ring", "allgather", "ulysses"])
def test_video_example_runs_each_sequence_schedule(mesh, schedule):
    if mesh.size() not in TILES:
        pytest.skip(f"the example tiles its frames for {sorted(TILES)} ranks")
    checked = run(mesh, schedule, heads=mesh.size())
    assert checked["intact tile"], checked["tile"]
    assert checked["rope"] == 0.0
    for name in ("out", "dq", "dk", "dv"):
        assert checked[name] < 1e-5, (name, checked[name])
