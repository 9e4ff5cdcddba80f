"""benchmarks.virtual_ranks runs small on CPU: every virtual rank's step right and timed."""

from __future__ import annotations

import json

from benchmarks import virtual_ranks


def test_tiny_run(tmp_path):
    virtual_ranks.main(["--tiny", "--ranks", "2,3", "--batches", "a,b", "--results-dir",
                        str(tmp_path), "--copy-to", ""])
    rows = json.loads((tmp_path / "virtual_ranks_tiny.json").read_text())["rows"]
    ranks = [r for r in rows if r["ranks"] > 1]
    assert len(ranks) == 2 * 2 * 2  # batches x partitions x rank counts
    assert all(r["status"] == "ok" and r["check"].startswith("right") for r in ranks), rows
    assert all(r["median_ms"] > 0 for r in ranks)
    a = [r for r in ranks if r["batch"] == "a" and r["partition"] == "load_balanced"]
    assert all(min(r["bytes_sent_per_rank"]) > 0 for r in a)  # every document cut: K/V travel
