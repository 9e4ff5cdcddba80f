"""benchmarks.virtual_ranks runs small on CPU: every virtual rank's step right and timed; the
mailbox keeps records within its budget."""

from __future__ import annotations

import json

import torch

from benchmarks import virtual_ranks
from benchmarks.mailbox import Mailbox


def test_tiny_run(tmp_path):
    virtual_ranks.main(["--tiny", "--ranks", "2,3", "--batches", "a,b", "--results-dir",
                        str(tmp_path), "--copy-to", ""])
    rows = json.loads((tmp_path / "virtual_ranks_tiny.json").read_text())["rows"]
    ranks = [r for r in rows if r["ranks"] > 1]
    assert len(ranks) == 2 * 2 * 2  # batches x partitions x rank counts
    for r in ranks:  # the threaded run's check, and every replayed rank's
        assert r["status"] == "ok" and r["check"].startswith("right"), r
        assert r["check_record"].startswith("right") and r["record_runs"] == 1
        assert len(r["rank_ms"]) == r["ranks"] and min(r["rank_ms"]) > 0
    a = [r for r in ranks if r["batch"] == "a" and r["partition"] == "load_balanced"]
    assert all(min(r["bytes_sent_per_rank"]) > 0 for r in a)  # every document cut: K/V travel


def test_records_past_the_budget_drop_the_highest_rank():
    box = Mailbox(3, recording=[0, 1, 2], budget=3 * 4 * 4)  # three 4-float receives
    for src, dst in [(1, 0), (2, 1), (0, 2), (1, 0)]:
        box.send(src, dst, torch.ones(4))
        box.receive(src, dst, torch.empty(4))
    assert box.recorded == [0, 1] and len(box.records[0]) == 2
    box.replay(0)
    into = torch.empty(4)
    box.receive(1, 0, into)
    assert torch.equal(into, torch.ones(4)) and box.cursor == 1
