"""A rank that stops taking part in a ring's NCCL or copy-engine transfers on 2 GPUs: the
other rank names the call, the transfer and the missing rank before the mesh's timeout ends
it (``StallWatch``), and nothing hangs.

Each case starts two ranks of its own (spawned processes, one GPU each), so the broken process
group never reaches the rest of the suite. Needs 2 GPUs (CUDA_VISIBLE_DEVICES of the test
process is not passed on).
Run on a GPU machine: python -m pytest -q tests/gpu/test_stall_gpu.py
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import subprocess
import time

import pytest
import torch

TIMEOUT_S = 8.0  # the mesh's
STALL_S = 60.0  # how long rank 1 stays away (then it leaves)
WAIT_S = STALL_S - 10  # how long rank 0 may take to end


def _gpus() -> int:
    """GPUs of this machine, whatever CUDA_VISIBLE_DEVICES says."""
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU ") for line in listed.splitlines())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs"),
]


def _rank_main(rank: int, port: int, transport: str, out_dir: str) -> None:
    output = os.open(os.path.join(out_dir, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT)
    os.dup2(output, 1)  # what NCCL and torch print, for the test's messages
    os.dup2(output, 2)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import logging

    import schedules
    import sdpa_fusion
    from schedules import transport as transport_module

    handler = logging.FileHandler(os.path.join(out_dir, f"rank{rank}.log"))
    logging.getLogger("sdpa_fusion").addHandler(handler)
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",), timeout=TIMEOUT_S)
    sched = schedules.get("ring", mesh, transport=transport)
    g = torch.Generator(device="cuda").manual_seed(rank)
    q, k, v = (torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    sdpa_fusion.attention(q, k, v, causal=True, schedule=sched)  # every rank takes part
    torch.cuda.synchronize()
    if rank == 1:  # from now on this rank stays away from the ring's transfers
        def away(*args, **kwargs):
            time.sleep(STALL_S)
            os._exit(3)

        transport_module.Ring.shift = away
    sdpa_fusion.attention(q, k, v, causal=True, schedule=sched)
    torch.cuda.synchronize()  # rank 0 waits here for a transfer that never completes
    handler.stream.write("NOT STOPPED\n")
    handler.flush()
    os._exit(0)


@pytest.mark.parametrize("transport", ["p2p", "copy_engine"])
def test_a_missing_rank_is_named_before_the_timeout_ends_the_job(transport, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, port, transport, str(tmp_path)))
             for r in (0, 1)]
    start = time.monotonic()
    for p in procs:
        p.start()
    procs[0].join(timeout=WAIT_S)
    ended = time.monotonic() - start
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()

    def text(name):
        path = tmp_path / name
        return path.read_text(errors="replace") if path.exists() else ""

    log = text("rank0.log")
    seen = f"rank 0's log: {log!r}\nrank 0's output (end): {text('rank0.out')[-3000:]}"
    assert procs[0].exitcode is not None and ended < WAIT_S, \
        f"rank 0 still ran {ended:.0f} s after start (the mesh's timeout is {TIMEOUT_S:g} s); {seen}"
    assert "NOT STOPPED" not in log, f"rank 0 went on past a transfer that never completed; {seen}"
    assert "ring" in log and "transfer" in log and "did not complete" in log, seen
    assert "rank 1 did not arrive within" in log, seen
    assert procs[0].exitcode != 0, f"rank 0 ended with {procs[0].exitcode}; {seen}"
