"""benchmarks.nvlink_tax: the pace summary, the traffic thread, and a tiny run on the CPU."""

from __future__ import annotations

import json
import time

import pytest
import torch

from benchmarks import nvlink_tax


def test_summary_compares_each_pattern_with_no_traffic():
    rows = [{"panel": "p", "pattern": pattern, "median_ms": ms, "status": "ok"}
            for pattern, ms in (("none", 10.0), ("a", 11.0), ("none", 12.0), ("a", 13.0),
                                ("none", 11.0), ("a", 12.5))]
    rows.append({"panel": "p", "pattern": "a", "median_ms": None, "status": "error"})
    rows.append({"panel": "q", "pattern": "a", "median_ms": 1.0, "status": "ok"})  # no baseline
    pace = {line["pattern"]: line for line in nvlink_tax.summary(rows)}
    assert set(pace) == {"none", "a"}
    assert pace["none"]["pace_vs_none"] == 1.0
    assert pace["a"]["median_ms"] == 12.5
    assert pace["a"]["pace_vs_none"] == pytest.approx(11.0 / 12.5)


def test_traffic_copies_only_while_a_pattern_is_set():
    source = torch.arange(64, dtype=torch.uint8)
    target = torch.zeros_like(source)
    traffic = nvlink_tax.Traffic(source, target)
    try:
        time.sleep(0.02)
        assert traffic.sent == 0 and not target.any()
        traffic.pattern = (16, 0.001)
        deadline = time.monotonic() + 5
        while traffic.sent < 64 and time.monotonic() < deadline:
            time.sleep(0.005)
        traffic.pattern = None
        assert traffic.sent >= 64 and traffic.sent % 16 == 0
        assert torch.equal(target[:16], source[:16]) and not target[16:].any()
    finally:
        traffic.close()


def test_tiny_run_writes_every_pattern(tmp_path):
    assert nvlink_tax.main(["--tiny", "--results-dir", str(tmp_path), "--copy-to", ""]) == 0
    record = json.loads((tmp_path / "nvlink_tax_tiny.json").read_text())
    assert [r["pattern"] for r in record["rows"]] == list(nvlink_tax.PATTERNS)
    assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in record["rows"])
    assert [r["gbps"] > 0 for r in record["rows"]] == [False, True, True, True]
    assert {line["pattern"] for line in record["summary"]} == set(nvlink_tax.PATTERNS)


def test_traffic_in_pieces_and_its_errors():
    source = torch.arange(16, dtype=torch.uint8)
    traffic = nvlink_tax.Traffic(source, torch.zeros_like(source))
    try:
        traffic._copy(40)  # 16 + 16 + 8 bytes
        assert torch.equal(traffic.target, source)
        traffic.check()
    finally:
        traffic.close()
    broken = nvlink_tax.Traffic(source, torch.zeros(4, dtype=torch.uint8))  # too small
    try:
        broken.pattern = (16, 0.0)
        deadline = time.monotonic() + 5
        while broken.error is None and time.monotonic() < deadline:
            time.sleep(0.005)
        with pytest.raises(RuntimeError, match="traffic thread stopped"):
            broken.check()
    finally:
        broken.close()
