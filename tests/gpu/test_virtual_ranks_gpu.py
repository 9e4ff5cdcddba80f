"""benchmarks.virtual_ranks on one CUDA GPU: a replayed rank's receives run on the mailbox's
side stream, as the copy-engine transport runs transfers, and land before they are read:
every rank of ring and allgather is right against fp32 math on sampled rows, its step
captured in a CUDA graph replays what it computes uncaptured.

Run on a GPU machine: python -m pytest -q tests/gpu/test_virtual_ranks_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import virtual_ranks
from benchmarks.mailbox import Mailbox

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_replayed_receives_run_beside_the_rank_s_work_and_are_right(monkeypatch):
    sides = []
    side_stream = Mailbox.side_stream

    def watched(box, device):
        stream = side_stream(box, device)
        if stream is not None:
            sides.append(stream)
        return stream

    monkeypatch.setattr(Mailbox, "side_stream", watched)
    args = virtual_ranks.parse_args([
        "--ranks", "2,4", "--batches", "c", "--shrink", "64", "--heads", "4",
        "--head-dim", "64", "--kernel", "flash", "--schedules",
        "ring:grad_dtype=input,allgather", "--partitions", "documents,load_balanced",
        "--iters", "2", "--profile"])
    rows = []
    virtual_ranks.batch_rows(args, "c", virtual_ranks.batches(False, 64)["c"],
                             lambda text: print(text, flush=True),
                             lambda row: row is not None and rows.append(row))
    assert len(rows) == 1 + 2 * 2 * 2, [r.get("impl") for r in rows]
    for row in rows[1:]:
        assert row["status"] == "ok" and row["check"].startswith("right"), row
        for split in row["rank_device_ms"]:
            assert "graph_error" not in split, split
            assert split["graph_vs_step"] <= 2e-2 and split["ops"] > 0, split
    # load_balanced cuts every document: K/V travel (documents may place all whole here)
    assert sides and all(s != torch.cuda.current_stream() for s in sides)
