"""What the benchmarks make of their rows (no GPU): ``common.ratios``, the one ratio helper
of every benchmark, and context_parallel's one-GPU baseline, read from the result file the
``--single-gpu`` run wrote before the run under mpirun writes over it.

Run: python -m pytest -q tests/test_benchmark_results.py
"""

from __future__ import annotations

import json
import types

from benchmarks import common, context_parallel


def row(impl, tflops, panel="causal fwd+bwd", seq_len=1024, **extra):
    return dict(panel=panel, seq_len=seq_len, impl=impl, tflops=tflops, **extra)


def test_each_row_over_its_baseline_in_the_same_case_in_the_order_of_the_rows():
    rows = [row("ring", 500.0), row("ring", 550.0, seq_len=2048), row("1 GPU", 600.0),
            row("ulysses", 300.0), row("1 GPU", 550.0, seq_len=2048), row("ring", 0.0, "full")]
    got = common.ratios(rows, lambda r: None if r["impl"] == "1 GPU" else "1 GPU")
    assert [(e["seq_len"], e["impl"], e["ratio"]) for e in got] == [
        (1024, "ring", 500 / 600), (2048, "ring", 1.0), (1024, "ulysses", 0.5)]
    assert got[0] == {"panel": "causal fwd+bwd", "seq_len": 1024, "impl": "ring",
                      "ratio": 500 / 600, "status": "ok", "baseline": "1 GPU"}


def test_a_later_row_replaces_an_earlier_one_and_several_baselines_give_the_fastest():
    rows = [row("auto", 100.0), row("torch-a", 80.0), row("torch-b", 90.0), row("auto", 99.0)]
    got = common.ratios(rows, lambda r: ["torch-a", "torch-b"] if r["impl"] == "auto" else None)
    assert [(e["baseline"], e["ratio"]) for e in got] == [("torch-b", 99 / 90)]


def test_every_keeps_rows_without_a_value_and_entry_shapes_the_result():
    rows = [row("ours", None, status="wrong", as_run=5.0), row("peer", None, as_run=4.0),
            row("lone", 3.0)]
    got = common.ratios(rows, lambda r: {"ours": "peer", "lone": "nobody"}.get(r["impl"]),
                        same=("seq_len",), base_value="as_run", every=True,
                        entry=lambda r, base, ratio: (r["impl"], base["impl"], ratio))
    assert got == [("ours", "peer", None)]
    assert common.ratios(rows, lambda r: "peer" if r["impl"] == "ours" else None,
                         base_value="as_run") == []


def baseline_of(tmp_path, record, **settings):
    (tmp_path / "context_parallel.json").write_text(json.dumps(record))
    args = types.SimpleNamespace(results_dir=tmp_path, name="context_parallel")
    problem = {"batch": 1, "heads": 32, "head_dim": 128, "dtype": "bf16"}
    return context_parallel.one_gpu_baseline(args, {"settings": {**problem, **settings}})


def test_the_one_gpu_rows_the_single_gpu_run_left_are_the_baseline(tmp_path):
    single = {"environment": {"command": "python -m benchmarks.context_parallel --single-gpu"},
              "settings": {"batch": 1, "heads": 32, "head_dim": 128, "dtype": "bf16"},
              "rows": [row("1 GPU cudnn", 550.0, ranks=1)]}
    rows, where = baseline_of(tmp_path, single)
    assert rows == [dict(single["rows"][0], baseline_from=single["environment"]["command"])]
    assert where == {"file": "context_parallel.json", "environment": single["environment"]}
    merged = dict(single, environment={"command": "mpirun ..."}, baseline=where,
                  rows=[row("ring", 500.0, ranks=2), *rows])
    assert baseline_of(tmp_path, merged) == (rows, where)  # a later run keeps them as they were
    assert baseline_of(tmp_path, single, heads=16)[0] == []  # another problem


def test_without_a_one_gpu_run_there_is_no_baseline(tmp_path):
    args = types.SimpleNamespace(results_dir=tmp_path, name="context_parallel")
    rows, why = context_parallel.one_gpu_baseline(args, {"settings": {}})
    assert rows == [] and why == "context_parallel.json not found; run with --single-gpu first"
