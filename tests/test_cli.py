"""``python -m sdpa_fusion demo | explain`` on CPU, with small shapes.
Run: pytest -q tests/test_cli.py"""

from __future__ import annotations

import pytest

from sdpa_fusion.cli import main

SMALL = ["--device", "cpu", "--batch", "1", "--heads", "4", "--kv-heads", "2", "--seq", "24",
         "--head-dim", "16"]


def test_explain_prints_the_plan(capsys):
    assert main(["explain", *SMALL, "--layout", "bhse", "--no-causal"]) == 0
    out = capsys.readouterr().out
    assert "kernel: reference" in out and "kv_heads=2" in out and "causal=False" in out
    assert "FLOPs: forward" in out


def test_explain_reports_an_unavailable_kernel(capsys):
    assert main(["explain", *SMALL, "--kernel", "flash"]) == 2
    assert "runs on CUDA GPUs only" in capsys.readouterr().err


def test_explain_rejects_a_bad_shape():
    with pytest.raises(SystemExit, match=r"head_dim=12 must be a multiple of 8"):
        main(["explain", "--device", "cpu", "--head-dim", "12"])


def test_demo_checks_the_reference_kernel(capsys):
    assert main(["demo", *SMALL, "--seq", "40", "--kv-seq", "40"]) == 0
    out = capsys.readouterr().out
    assert "kernel='reference' against torch SDPA in float64" in out
    assert "demo: all checks passed" in out
    for name in ("out", "dq", "dk", "dv"):
        assert f"    {name}: max |error|" in out
