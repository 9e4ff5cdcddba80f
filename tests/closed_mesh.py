"""One rank of test_closed_mesh.py: each use of a mesh after ``close_mesh()``, and a new mesh
from ``init_mesh`` after it (rendezvous on $NEXT_MASTER_PORT: a torchrun-style store is not
rebuilt on the port of the closed one). Prints one JSON line: what each use raised (None: it
ran).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... NEXT_MASTER_PORT=... \
        python -m tests.closed_mesh
"""

from __future__ import annotations

import json
import os

import torch

import schedules
import sdpa_fusion


def attend(sched, q):
    """The full output of attention on ``sched``'s shards of ``q`` (as q, k and v)."""
    q_l = sched.shard(q)
    return sched.unshard(sdpa_fusion.attention(q_l, q_l, q_l, schedule=sched, kernel="reference"))


def new_mesh():
    os.environ["MASTER_PORT"] = os.environ["NEXT_MASTER_PORT"]
    return sdpa_fusion.init_mesh((-1,), ("seq",))


def main() -> None:
    mesh = sdpa_fusion.init_mesh((-1,), ("seq",))
    p = mesh.size()
    q = torch.randn(1, 2 * p, 4 * p, 8, generator=torch.Generator().manual_seed(0))
    ring, heads = schedules.get("ring", mesh), schedules.get("head_parallel", mesh)
    want = attend(ring, q)
    q_l = ring.shard(q)
    sdpa_fusion.close_mesh()
    uses = {
        "attention": lambda: sdpa_fusion.attention(q_l, q_l, q_l, schedule=ring),
        "attention, again": lambda: sdpa_fusion.attention(q_l, q_l, q_l, schedule=ring),
        "schedules.get": lambda: schedules.get("ring", mesh),
        "unshard": lambda: ring.unshard(q_l),
        "shard, replicated": lambda: heads.shard(q, replicated=True),
        "Mesh.agree": lambda: mesh.agree(mesh.rank),
        "a new mesh": lambda: torch.testing.assert_close(
            attend(schedules.get("ring", new_mesh()), q), want),
        "the closed one's schedule, beside a new mesh": lambda: ring.unshard(q_l),
    }
    raised = {}
    for name, use in uses.items():
        try:
            use()
            raised[name] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            raised[name] = f"{type(e).__name__}: {e}"
    sdpa_fusion.close_mesh()
    print(json.dumps(raised), flush=True)
    # The closed mesh's gloo groups are still referenced here; torch's teardown of such
    # groups at interpreter exit can abort ("terminate called") once a peer has gone, which
    # is outside what this checks: leave without it, as every rank's report is out.
    os._exit(0)


if __name__ == "__main__":
    main()
