"""benchmarks.fa4_backward: its cases, its summary, and a run where it cannot measure."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import fa4_backward


def test_cases_are_both_ranks_rows_at_every_length():
    args = fa4_backward.parse_args(["--rows", "8k,16k"])
    assert fa4_backward.cases(args) == [("all rows", 8192), ("last half", 8192),
                                        ("all rows", 16384), ("last half", 16384)]


def test_summary_takes_the_median_round_of_each_implementation():
    fa4, ours = fa4_backward.IMPLS
    rows = [{"panel": "16K rows, all rows", "impl": impl, "median_ms": ms, "status": "ok"}
            for impl, ms in ((fa4, 10.0), (ours, 9.0), (fa4, 11.0), (ours, 9.5), (fa4, 10.5),
                             (ours, 30.0))]
    rows.append({"panel": "16K rows, all rows", "impl": ours, "median_ms": None,
                 "status": "error"})
    rows.append({"panel": "8K rows, all rows", "impl": fa4, "median_ms": 1.0, "status": "ok"})
    (line,) = fa4_backward.summary(rows)  # 8K: only one implementation ran, no ratio
    assert line["panel"] == "16K rows, all rows"
    assert line[f"{ours} ms"] == 9.5 and line[f"{fa4} ms"] == 10.5
    assert line["ours / FA4"] == pytest.approx(9.5 / 10.5, abs=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run without a Hopper GPU")
def test_without_a_hopper_gpu_every_row_says_why(tmp_path):
    assert fa4_backward.main(["--rows", "8k,16k", "--results-dir",
                              str(tmp_path), "--copy-to", ""]) == 0
    record = json.loads((tmp_path / "fa4_backward.json").read_text())
    assert len(record["rows"]) == 8 and record["summary"] == []
    assert all(r["status"] == "unavailable" and "Hopper" in r["error"] for r in record["rows"])
