"""benchmarks.gpu_pace: the order of turns, the pace summary, and a tiny run on the CPU."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_pace


def test_turns_go_there_and_back():
    assert gpu_pace.turns(2) == [0, 1, 1, 0]
    assert gpu_pace.turns(3) == [0, 1, 2, 2, 1, 0]
    assert gpu_pace.turns(0) == [None, None]


def test_summary_compares_each_device_with_the_first():
    rows = [{"panel": "p", "device_index": d, "median_ms": ms, "status": "ok"}
            for d, ms in ((0, 10.0), (1, 11.0), (1, 13.0), (0, 10.0))]
    rows.append({"panel": "p", "device_index": 1, "median_ms": None, "status": "error"})
    pace = {line["device_index"]: line for line in gpu_pace.summary(rows)}
    assert pace[0]["pace_vs_first"] == 1.0
    assert pace[1]["mean_ms"] == 12.0
    assert pace[1]["pace_vs_first"] == pytest.approx(10.0 / 12.0)


def test_tiny_run_writes_rows_for_every_turn(tmp_path):
    assert gpu_pace.main(["--tiny", "--results-dir", str(tmp_path), "--copy-to", ""]) == 0
    record = json.loads((tmp_path / "gpu_pace_tiny.json").read_text())
    assert [r["turn"] for r in record["rows"]] == [1, 2]
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in record["rows"])
    assert [line["device_index"] for line in record["summary"]] == [None]
