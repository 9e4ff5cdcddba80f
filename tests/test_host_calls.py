"""benchmarks.host_calls runs small on CPU: every piece timed, the attention row checked
against fp32 math, a wrong attention recorded with no figure."""

from __future__ import annotations

import json

import sdpa_fusion
from benchmarks import host_calls


def _rows(tmp_path):
    code = host_calls.main(["--tiny", "--results-dir", str(tmp_path), "--copy-to", ""])
    return code, json.loads((tmp_path / "host_calls_tiny.json").read_text())["rows"]


def test_tiny_run_times_every_piece(tmp_path):
    code, rows = _rows(tmp_path)
    assert code == 0
    assert [r["impl"] for r in rows] == [
        "torch op (one element)", "reference packed forward", "reference packed backward",
        "merge fold (fp32)", "attention reference fwd+bwd (offsets a tuple: plan kept)",
        "attention reference fwd+bwd (offsets a list: planned)"]
    for r in rows:
        assert r["status"] == "ok" and r["host_us"] > 0 and r["device_us"] > 0, r
    assert all(r["check"].startswith("right") for r in rows[-2:]), rows[-2:]
    assert (tmp_path / "host_calls_tiny.png").is_file()


def test_a_wrong_attention_is_no_figure(tmp_path, monkeypatch):
    attention = sdpa_fusion.attention
    monkeypatch.setattr(sdpa_fusion, "attention", lambda *a, **k: 2 * attention(*a, **k))
    code, rows = _rows(tmp_path)
    assert code == 1
    for r in rows[-2:]:
        assert r["status"] == "wrong" and r["host_us"] is None, r
        assert r["check"].startswith("WRONG"), r


def test_lengths_repeat_with_x():
    assert host_calls.lengths_of("2048,300x3, 5") == [2048, 300, 300, 300, 5]


def test_a_tag_names_the_files(tmp_path):
    host_calls.main(["--tiny", "--results-dir", str(tmp_path), "--copy-to", "", "--tag", "_x"])
    assert (tmp_path / "host_calls_x_tiny.json").is_file()
    assert not (tmp_path / "host_calls_tiny.json").exists()
