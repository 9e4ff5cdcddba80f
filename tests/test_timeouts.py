"""A rank that arrives late: the mesh's timeout (init_mesh(timeout=1.5)) bounds the wait, and
the error names the call, the step and the rank that did not arrive.

Each test starts two CPU ranks of its own (spawned processes with their own process group),
so the broken groups a timeout leaves behind never reach the rest of the suite.
Run: pytest -q tests/test_timeouts.py
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time

import pytest
import torch

TIMEOUT_S = 1.5
LATE_S = 4.5


def _rank_main(rank: int, port: int, scenario: str, out_dir: str, done) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import schedules
    import sdpa_fusion
    from sdpa_fusion.kernels import register
    from sdpa_fusion.kernels.reference import ReferenceKernel

    class Late(ReferenceKernel):
        """The reference kernel, LATE_S seconds late on rank 1."""

        name = "late_on_rank_1"

        def forward(self, *args, **kwargs):
            if rank == 1:
                time.sleep(LATE_S)
            return super().forward(*args, **kwargs)

    register(Late())
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",), timeout=TIMEOUT_S)
    sched = schedules.get("ulysses" if scenario == "transfer" else "ring", mesh)
    q = torch.randn(1, 2, 4, 8)
    kernel = "late_on_rank_1" if scenario == "transfer" else "reference"
    results = []
    for call in range(2):
        if scenario == "agreement" and rank == 1 and call == 0:
            time.sleep(LATE_S)
        start = time.monotonic()
        try:
            sdpa_fusion.attention(q, q, q, kernel=kernel, schedule=sched)
            results.append({"error": None})
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.append({"error": type(e).__name__, "message": str(e)})
        results[-1]["seconds"] = time.monotonic() - start
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    done.wait()  # rank 0 holds the store: it stays until rank 1 is done
    os._exit(0)  # the process group is broken: leave without tearing it down


def _run(scenario: str, tmp_path) -> list[list[dict]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Barrier(2)
    procs = [ctx.Process(target=_rank_main, args=(r, port, scenario, str(tmp_path), done))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            pytest.fail(f"rank {procs.index(p)} still runs after 120 s: a hang")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_rank_late_for_the_agreement(tmp_path):
    first, late = _run("agreement", tmp_path)
    assert first[0]["error"] == "MeshTimeout", first
    assert first[0]["seconds"] < LATE_S - 1, "rank 0 waited for rank 1 instead of the timeout"
    assert first[0]["message"].startswith("attention call 1 on mesh dim 'seq': rank 1 did not "
                                          "arrive within 1.5 s"), first
    assert late[0]["error"] == "MeshTimeout", late
    assert "every rank arrived, but not within 1.5 s of each other" in late[0]["message"]
    for results in (first, late):  # later calls say why the mesh cannot agree any more
        assert results[1]["error"] == "MeshTimeout", results
        assert "broke earlier" in results[1]["message"] and "init_mesh" in results[1]["message"]


def test_a_rank_late_for_a_transfer(tmp_path):
    waiting, late = _run("transfer", tmp_path)
    message = waiting[0]["message"]
    assert waiting[0]["error"] == "MeshTimeout", waiting
    assert message.startswith("schedule 'ulysses' over seq=2, forward of call 1: transfer "), message
    assert "(all-to-all over ranks [0, 1]) did not complete: rank 1 did not arrive within 1.5 s" in message
    assert late[0]["error"] == "MeshTimeout", late
