"""Launcher environments and mesh errors, in one process (no torch.distributed started)."""

from __future__ import annotations

import pytest

import sdpa_fusion
from sdpa_fusion.mesh import launch_env

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID")


@pytest.mark.parametrize("env,expected", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (3, 8, 1, "torchrun")),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
     (2, 4, 2, "mpirun")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, (5, 16, 1, "slurm")),
], ids=["torchrun", "mpirun", "slurm"])
def test_launch_env(env, expected):
    e = launch_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.launcher) == expected


def test_no_launcher():
    assert launch_env({}) is None


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def test_mesh_larger_than_one_process_needs_a_launcher(no_launcher):
    with pytest.raises(ValueError, match=r"mesh shape \(4,\) needs 4 ranks but no launcher"):
        sdpa_fusion.init_mesh((4,), ("seq",))


def test_mesh_size_must_match_the_world(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"mesh shape \(3,\) needs 3 ranks but mpirun started 4"):
        sdpa_fusion.init_mesh((3,), ("seq",))
    with pytest.raises(ValueError, match="4 ranks do not divide by 3"):
        sdpa_fusion.init_mesh((3, -1), ("heads", "seq"))


@pytest.mark.parametrize("shape,names,match", [
    ((2, 2), ("seq",), "must have the same length"),
    ((2, 2), ("seq", "seq"), "must be distinct"),
    ((-1, -1), ("heads", "seq"), "at most one -1"),
])
def test_bad_mesh_arguments(no_launcher, shape, names, match):
    with pytest.raises(ValueError, match=match):
        sdpa_fusion.init_mesh(shape, names)


@pytest.mark.parametrize("timeout", [0, -5, "60", True])
def test_bad_timeout(no_launcher, timeout):
    with pytest.raises(ValueError, match=r"^timeout=.* must be"):
        sdpa_fusion.init_mesh((1,), ("seq",), timeout=timeout)
