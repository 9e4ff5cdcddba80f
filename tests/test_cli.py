"""``python -m sdpa_fusion demo | explain`` on CPU, with small shapes.
Run: pytest -q tests/test_cli.py"""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("args,message", [
    (["--head-dim", "12"], r"^error: head_dim=12 must be a multiple of 8"),
    (["--scale", "inf"], r"^error: scale=inf must be a positive number"),
    (["--scale", "-1"], r"^error: scale=-1.0 must be a positive number"),
    (["--heads", "4", "--kv-heads", "3"], r"^error: heads=4 must be a multiple of kv_heads=3"),
    (["--schedule", "bogus"], r"^error: --schedule 'bogus' is not known; choose one of \["),
    (["--kernel", "bogus"], r"^error: kernel='bogus' is not known"),
], ids=["head-dim", "scale-inf", "scale-negative", "gqa", "schedule", "kernel"])
def test_explain_reports_a_bad_problem_in_one_line(capsys, args, message):
    assert main(["explain", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert re.match(message, err) and err.count("\n") == 1, err


@pytest.mark.parametrize("flag,value", [("--seq", "0"), ("--batch", "0"), ("--heads", "0"),
                                        ("--kv-heads", "-2"), ("--head-dim", "x")])
def test_explain_refuses_sizes_that_are_not_positive(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "--device", "cpu", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.match(rf"^python -m sdpa_fusion explain: error: argument {flag}: ", err), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_demo_refuses_an_unknown_kernel(capsys):
    assert main(["demo", "--device", "cpu", "--kernels", "reference,bogus"]) == 2
    assert capsys.readouterr().err.startswith("error: --kernels bogus: not known")


def test_demo_checks_the_reference_kernel(capsys):
    assert main(["demo", *SMALL, "--seq", "40", "--kv-seq", "40"]) == 0
    out = capsys.readouterr().out
    assert "kernel='reference' against torch SDPA in float64" in out
    assert "demo: all checks passed" in out
    for name in ("out", "dq", "dk", "dv"):
        assert f"    {name}: max |error|" in out
