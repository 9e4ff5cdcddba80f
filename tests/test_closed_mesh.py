"""A mesh used after ``sdpa_fusion.close_mesh()`` raises a ValueError that says it was closed
and how to make a new one, on every rank, on every use that would communicate; a new mesh
from ``init_mesh`` then works. close_mesh() ends torch.distributed in its process, so two
ranks of ``tests/closed_mesh.py`` run here as subprocesses (launched as torchrun would).

Run: pytest -q tests/test_closed_mesh.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

RANKS = 2
LAUNCHER_VARS = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCALRANKID")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks() -> list[dict]:
    """Start the ranks, wait for them; every rank's JSON report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    env.update(WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               NEXT_MASTER_PORT=str(free_port()), SDPA_FUSION_TIMEOUT_S="60", OMP_NUM_THREADS="1")
    root = Path(__file__).resolve().parent.parent
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.closed_mesh"], cwd=root,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(RANKS)]
    reports = []
    for r, rank in enumerate(ranks):
        out, err = rank.communicate(timeout=240)
        assert rank.returncode == 0, f"rank {r} exited with {rank.returncode}:\n{err[-3000:]}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def test_a_closed_mesh_says_so_on_every_rank():
    reports = run_ranks()
    for rank, raised in enumerate(reports):
        assert raised.pop("a new mesh") is None, f"rank {rank}"
        for use, error in raised.items():
            assert error is not None and error.startswith("ValueError: Mesh(seq=2; rank "), \
                f"rank {rank}, {use}: {error}"
            assert "was closed by sdpa_fusion.close_mesh()" in error and \
                "sdpa_fusion.init_mesh(...)" in error, f"rank {rank}, {use}: {error}"
