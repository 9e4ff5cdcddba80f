"""benchmarks.virtual_ranks on one CUDA GPU: a replayed rank's receives run on the mailbox's
side stream, as the copy-engine transport runs transfers, and land before they are read:
every rank of ring, allgather and ulysses is right against fp32 math on sampled rows, its
step captured in a CUDA graph replays what it computes uncaptured.

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
        "ring:grad_dtype=input,allgather,ulysses", "--partitions", "documents,load_balanced",
        "--iters", "2", "--profile"])
    rows = batch_rows(args, "c")
    assert len(rows) == 1 + 3 * 2 * 2, [r.get("impl") for r in rows]
    assert_right(rows[1:])
    # load_balanced cuts every document: K/V travel (documents may place all whole here)
    assert sides and all(s != torch.cuda.current_stream() for s in sides)


@pytest.mark.parametrize("head_groups", [1, 2])
@pytest.mark.parametrize("keep", [False, True], ids=["resend", "keep_forward"])
def test_ulysses_cut_documents_are_right(head_groups, keep):
    """Batch d (shrunk 32 times): its longest document is cut over every rank, its tokens
    travel by heads and each rank attends it whole in one call (its backward sending the
    heads again, or reusing those its forward kept)."""
    args = virtual_ranks.parse_args([
        "--ranks", "2,4", "--batches", "d", "--shrink", "32", "--heads", "8",
        "--head-dim", "64", "--kernel", "auto", "--schedules",
        f"ulysses:head_groups={head_groups}" + (":keep_forward=True" if keep else ""),
        "--partitions", "documents", "--iters", "2", "--profile"])
    rows = batch_rows(args, "d", 32)
    assert len(rows) == 1 + 2, [r.get("impl") for r in rows]
    assert_right(rows[1:])
    for row in rows[1:]:
        assert min(row["bytes_sent_per_rank"]) > 0, row


def batch_rows(args, batch: str, shrink: int = 64) -> list[dict]:
    """The rows of ``batch`` (shrunk ``shrink`` times): one GPU's, then each schedule's."""
    rows = []
    virtual_ranks.batch_rows(args, batch, virtual_ranks.batches(False, shrink)[batch],
                             lambda text: print(text, flush=True),
                             lambda row: row is not None and rows.append(row))
    return rows


def assert_right(rows) -> None:
    """Every rank right, its step replayed as a graph as it ran."""
    for row in rows:
        assert row["status"] == "ok" and row["check"].startswith("right"), row
        for split in row["rank_device_ms"]:
            assert "graph_error" not in split, split
            assert split["graph_vs_step"] <= 2e-2 and split["ops"] > 0, split
