"""``StreamBarrier`` on GPUs (every rank under mpirun, one GPU each): after a pass, a rank's
stream sees what every other rank copied into its symmetric buffer before passing, however
late that rank comes, and no rank overwrites a buffer before its owner has read it; the host
never waits.

    mpirun -np 2 python -m pytest tests/gpu_distributed/test_stream_signals_gpu.py
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from schedules.stream_signals import StreamBarrier

from .conftest import requires_gpus

pytestmark = requires_gpus

LATE_CYCLES = 400_000_000  # about 0.2 s of a GPU spinning


def test_ranks_meet_on_the_stream_with_copies_between(mesh):
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(), dist.get_world_size()
    n = 1 << 20  # int32 words each rank receives from each rank
    flat = symm_mem.empty(world * n, dtype=torch.int32, device="cuda")
    flat.fill_(-1)
    torch.cuda.synchronize()
    handle = symm_mem.rendezvous(flat, dist.group.WORLD)
    ready, filled = StreamBarrier(handle, 0), StreamBarrier(handle, 1)
    peers = [handle.get_buffer(p, (world, n), torch.int32) for p in range(world)]
    seen, host_s = [], []
    for step in range(1, 2 * world + 1):
        late = step % world  # a different rank is late in each step
        if rank == late and step <= world:  # late to write: the others must wait to read
            torch.cuda._sleep(LATE_CYCLES)
        start = time.perf_counter()
        ready.pass_()  # every rank has read the last step's words
        host_s.append(time.perf_counter() - start)
        payload = torch.full((n,), step * 100 + rank, dtype=torch.int32, device="cuda")
        for p in range(world):
            peers[p][rank].copy_(payload)  # into this rank's row of every rank's buffer
        filled.pass_()
        if rank == late and step > world:  # late to read: the others must wait to write
            torch.cuda._sleep(LATE_CYCLES)
        seen.append(flat.view(world, n).clone())
    torch.cuda.synchronize()
    for step, words in enumerate(seen, start=1):
        expected = torch.arange(world, dtype=torch.int32, device="cuda") + step * 100
        assert torch.equal(words, expected[:, None].expand(world, n)), \
            f"rank {rank}, step {step}: rows {words[:, 0].tolist()} != {expected.tolist()}"
    assert max(host_s) < 0.05, f"the host waited {max(host_s):.3f} s in a pass"
    assert ready.passes == filled.passes == 2 * world
    dist.barrier()
