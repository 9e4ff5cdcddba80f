"""single_gpu --preset long (benchmarks.long_steps): its settings, its goals' arithmetic, and
its --tiny run on CPU, where every step is checked and a wrong one is no speed.

Run: python -m pytest -q tests/test_long_steps.py
"""

from __future__ import annotations

import json

from benchmarks import long_steps, single_gpu

K = 1024


def test_the_preset_is_the_issue_s_problem_and_options_still_override():
    args = single_gpu.parse_args(["--preset", "long"])
    assert args.seq_lens == [512 * K, 1024 * K]
    assert (args.head_dims, args.heads_for, args.causals) == ([128], {128: 32}, (True,))
    assert args.modes == ["fwd+bwd"] and args.layout == "bshe" and args.dtype == "bf16"
    assert args.impls == ["torch-cudnn", "cudnn", "fa4-direct", "fa4", "auto"]
    assert single_gpu.parse_args(["--preset", "long", "--layout", "bhse"]).layout == "bhse"
    assert single_gpu.parse_args([]).layout == "bhse"  # the sweep keeps its own default


def row(impl, s, status, tflops_as_run):
    return dict(impl=impl, seq_len=s, status=status, tflops_as_run=tflops_as_run,
                tflops=tflops_as_run if status == "ok" else None)


def test_ours_counts_only_when_right_and_the_peer_as_it_ran():
    rows = [row("torch-cudnn", K * K, "wrong", 510.0), row("cudnn", K * K, "ok", 470.0),
            row("fa4-direct", K * K, "ok", 560.0), row("fa4", K * K, "wrong", 600.0),
            row("cudnn", 512 * K, "ok", 300.0)]
    got = {(r["ours"], r["seq_len"]): r for r in long_steps.goal_ratios(rows)}
    assert set(got) == {("cudnn", K * K), ("fa4", K * K)}  # no peer at 512K
    cudnn, fa4 = got["cudnn", K * K], got["fa4", K * K]
    assert abs(cudnn["ratio"] - 470 / 510) < 1e-12 and cudnn["met"]
    assert cudnn["peer_status"] == "wrong"
    assert fa4["ratio"] is None and not fa4["met"] and fa4["ours_status"] == "wrong"
    lines = long_steps.verdicts(long_steps.goal_ratios(rows))
    assert lines[0].startswith("goal cudnn/torch-cudnn >= 0.9 at 1M: met (0.92")
    assert lines[1].startswith("goal fa4/fa4-direct >= 0.95 at 1M: NOT met (-")


def tiny(tmp_path, *extra) -> dict:
    argv = ["--preset", "long", "--tiny", *extra, "--results-dir", str(tmp_path),
            "--copy-to", ""]
    assert single_gpu.main(argv) == 0
    record = json.loads((tmp_path / "single_gpu_long_tiny.json").read_text())
    return {(r["impl"], r["seq_len"]): r for r in record["rows"]}


def test_the_tiny_run_checks_every_step(tmp_path):
    rows = tiny(tmp_path)
    assert set(rows) == {(i, s) for i in ("torch-math", "reference", "fa4-direct", "auto")
                         for s in (256, 512)}
    for (impl, _), r in rows.items():
        if impl == "fa4-direct":  # flash_attn is not installed here
            assert r["status"] == "unavailable" and "flash-attn-4" in r["error"]
            continue
        assert r["status"] == "ok" and r["check"]["right"], r
        assert r["tflops"] == r["tflops_as_run"] > 0
        assert r["layout"] == "bshe" and max(r["errors"].values()) < 2e-2
    assert rows["auto", 512]["kernel"] == "reference"
    assert rows["torch-math", 512]["kernel"] == "torch math"


def test_a_wrong_step_is_flagged_and_is_no_speed(tmp_path, monkeypatch):
    right = long_steps.attention_fn

    def wrong_dk(impl, causal, layout):  # out as it is; dk gains 0.5 dout
        fn = right(impl, causal, layout)
        return lambda q, k, v: fn(q, k, v) + 0.5 * (k - k.detach())

    monkeypatch.setattr(long_steps, "attention_fn", wrong_dk)
    rows = tiny(tmp_path, "--impls", "reference", "--layout", "bhse")
    for r in rows.values():
        assert r["status"] == "wrong" and r["tflops"] is None and r["tflops_as_run"] > 0
        assert r["errors"]["dk"] > 0.1 and r["errors"]["out"] < 1e-2
        assert r["layout"] == "bhse" and r["error"].startswith("WRONG")


def test_two_halves_run_apart_make_one_record(tmp_path):
    """The cuDNN half (before FA4 is installed) and the FA4 half merge into one record."""
    common = ["--preset", "long", "--tiny", "--results-dir", str(tmp_path), "--copy-to", ""]
    assert single_gpu.main(common + ["--impls", "torch-math", "--tag", "_a"]) == 0
    assert single_gpu.main(common + ["--impls", "reference", "--merge",
                                     "single_gpu_long_a_tiny"]) == 0
    rows = json.loads((tmp_path / "single_gpu_long_tiny.json").read_text())["rows"]
    assert {(r["impl"], r.get("merged_from")) for r in rows} == {
        ("torch-math", "single_gpu_long_a_tiny.json"), ("reference", None)}
    assert all(r["status"] == "ok" and r["check"]["right"] for r in rows)


def test_one_length_run_later_replaces_only_its_rows(tmp_path):
    """A rerun of one length keeps the other length's rows, naming the file they come from."""
    common = ["--preset", "long", "--tiny", "--results-dir", str(tmp_path), "--copy-to", "",
              "--impls", "torch-math"]
    assert single_gpu.main(common + ["--tag", "_a"]) == 0
    assert single_gpu.main(common + ["--seq-lens", "256", "--merge", "single_gpu_long_a_tiny"]) == 0
    rows = json.loads((tmp_path / "single_gpu_long_tiny.json").read_text())["rows"]
    assert sorted((r["seq_len"], r.get("merged_from")) for r in rows) == [
        (256, None), (512, "single_gpu_long_a_tiny.json")]
