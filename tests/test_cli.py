"""The command lines on CPU, with small shapes: the core's ``python -m sdpa_fusion demo |
explain`` (one device), the ``sdpa-fusion`` command (``python -m schedules``: explain on a mesh,
with predicted times) and ``python -m benchmarks``.
Run: pytest -q tests/test_cli.py"""

from __future__ import annotations

import json
import re

import pytest
import torch.distributed as dist

import sdpa_fusion
from benchmarks.__main__ import main as benchmarks_main
from schedules import cli as top
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
    assert top.main(["explain", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert re.match(message, err) and err.count("\n") == 1, err
    if "--schedule" not in args:  # the core's explain says the same
        assert main(["explain", "--device", "cpu", *args]) == 2
        assert capsys.readouterr().err == err


def test_the_core_explains_one_device_only(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "--schedule", "ring", "--mesh", "2"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --schedule ring --mesh 2" in capsys.readouterr().err


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


# ---- explain on a mesh, without a launcher -----------------------------------------------
ISSUE_COMMAND = ["explain", "--schedule", "ring", "--mesh", "4", "--seq", "131072", "--heads",
                 "32", "--head-dim", "128", "--causal"]


def test_explain_plans_every_rank_of_a_mesh_without_a_process_group(capsys):
    assert top.main(ISSUE_COMMAND) == 0
    out = capsys.readouterr().out
    assert not dist.is_initialized()
    assert "planned on a virtual mesh (no process group, no data)" in out
    assert "local problem of rank 0: b=1 h=32 h_kv=32 s_q=32768 s_kv=32768" in out
    # 2 head groups (auto: 16 heads x 32K rows a call), 4 steps each way in each; K/V blocks
    # of 1 x 16 x 32K x 128 bf16 = 0.25 GiB, 3 per group in forward (1.5 GiB); backward adds
    # the fp32 dK/dV sums (3 x 1 GiB). Ranks alike but for memory (rank 0's remote calls take
    # only its late queries, so their gradients and workspace are smaller than the others'):
    # rows of ranks that differ only there, which together are every rank
    rows = re.findall(r"\n +(\d+)(?:-(\d+))? +8/8 +1\.50/4\.50 +1\.50/4\.50 +35\.2/88 ", out)
    assert rows[0] == ("0", ""), out
    assert {r for a, b in rows for r in range(int(a), int(b or a) + 1)} == {0, 1, 2, 3}, out
    assert "predicted on NVIDIA H200 with kernel" in out
    assert "  compute " in out and "at 32K tokens" in out  # each call: 32K keys of one rank
    assert "ms not hidden: transfers of " in out and "copy_engine ring-shift" in out
    assert "last measurement" not in out  # explain reads no benchmark results


def test_explain_json_per_rank_numbers(capsys):
    assert top.main([*ISSUE_COMMAND, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    flops = 4 * 32 * 131072 ** 2 * 128 / 2  # causal forward of the whole problem
    for row in report["ranks"]:
        assert row["flops"] == flops / 4 and row["backward_flops"] == 2.5 * flops / 4
        assert row["predicted_fwd_ms"] < row["predicted_fwd+bwd_ms"]


def test_explain_one_device_adds_the_predicted_time_on_one_gpu(capsys):
    args = ["explain", "--device", "cpu", "--batch", "1", "--heads", "32", "--seq", "65536",
            "--head-dim", "128"]
    assert main(args) == 0
    core = capsys.readouterr().out
    assert "kernel: reference" in core and "predicted" not in core
    assert top.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(core)
    assert re.search(r"predicted on NVIDIA H200 with kernel \w+ .*: forward [\d.]+ ms", out)
    assert "at 64K tokens" in out and "transfers" not in out


def test_explain_a_window_plans_it(capsys):
    """--window: the plan's FLOPs are the band's."""
    args = ["explain", "--device", "cpu", "--batch", "1", "--heads", "32", "--seq", "65536",
            "--head-dim", "128"]
    assert main(args + ["--window", "4096"]) == 0
    out = capsys.readouterr().out
    assert "window=Window(left=4096, right=None)" in out
    spec = sdpa_fusion.AttentionSpec(1, 32, 32, 65536, 65536, 128, causal=True, window=(4096, None))
    assert f"FLOPs: forward {spec.flops(backward=False):.3e}" in out
    assert top.main(args[:1] + ["--schedule", "ring", "--mesh", "2"] + args[3:]
                    + ["--window", "4096"]) == 0
    out = capsys.readouterr().out
    assert "causal window (4096, None)" in out
    assert f"FLOPs of the whole problem: forward {spec.flops(backward=False):.3e}" in out


def test_explain_refuses_a_window_that_is_no_pair_of_counts(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["explain", "--window", "4096,-1"])
    assert exit_.value.code == 2
    assert "--window: '4096,-1' is not LEFT or LEFT,RIGHT" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--mesh", "4"], r"^error: --mesh needs --schedule"),
    (["--schedule", "ring", "--mesh", "4", "--option", "transport"],
     r"^error: --option 'transport' must be KEY=VALUE"),
    (["--schedule", "ring", "--mesh", "4", "--option", "hops=2"],
     r"^error: schedule 'ring' takes the options \["),
    (["--schedule", "ring", "--mesh", "4", "--seq", "1001"],
     r"^error: sequence length 1001 must be divisible by 8"),
    (["--schedule", "ring", "--mesh", "4", "--mesh-dims", "heads,seq"],
     r"^error: --mesh-dims heads,seq names 2 dims but --mesh 4 has 1"),
    (["--schedule", "hybrid", "--mesh", "4"], r"^error: schedule 'hybrid' needs a mesh of two"),
    (["--schedule", "ring", "--mesh", "2", "--kernel", "bogus"], r"^error: --kernel 'bogus'"),
], ids=["no-schedule", "option", "unknown-option", "seq", "dims", "hybrid-1d", "kernel"])
def test_explain_on_a_mesh_reports_a_bad_argument_in_one_line(capsys, args, message):
    assert top.main(["explain", *args]) == 2
    err = capsys.readouterr().err
    assert re.match(message, err) and err.count("\n") == 1, err
    assert not dist.is_initialized()


def test_explain_shows_each_ranks_documents_of_a_packed_batch(capsys):
    """--documents: per rank its tokens, whole and cut documents, work and bytes; documents
    that fit whole move nothing, and the numbers are those of the assignment."""
    from schedules.assign import CUT_TOKEN_PAIRS, STEP_PAIRS, plan as plan_of

    lengths = [4096] * 2 + [1024] * 4 + [128] * 64
    args = ["explain", "--schedule", "ring", "--mesh", "4", "--causal", "--heads", "8",
            "--head-dim", "64", "--documents", "4096x2,1024x4,128x64"]
    assert top.main(args + ["--option", "partition=documents", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranks"]
    plan = plan_of(lengths, 4)
    assert plan.groups == ((0, 2), (2, 2))  # each 4096 is cut over a pair of ranks
    cut = [[i for g in plan.groups_of(r) for i in plan.cut_over(g)] for r in range(4)]
    assert [r["tokens"] for r in rows] == [
        sum(lengths[i] for i in plan.whole(r)) + sum(lengths[i] for i in cut[r]) // 2
        for r in range(4)]
    assert [r["work_pairs"] for r in rows] == list(plan.work)
    assert [r["exchange_pairs"] for r in rows] == [  # two steps, one 4096-token document each
        STEP_PAIRS * 2 + CUT_TOKEN_PAIRS * 4096] * 4
    assert all(r["whole_documents"] == len(plan.whole(r["rank"])) for r in rows)
    assert all(r["cut_documents"] == len(cut[r["rank"]]) for r in rows)
    assert [r["cut_over_ranks"] for r in rows] == [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]]
    assert all((r["bytes_sent"] == 0) == (not cut[r["rank"]]) for r in rows)
    assert top.main(args) == 0
    out = capsys.readouterr().out
    assert "tokens  documents whole/cut  cut over  work M pairs  exchanges M pairs" in out
    assert "thd causal" in out
    assert top.main(["explain", "--schedule", "ring", "--mesh", "2", "--causal",
                     "--documents", "128x64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranks"]  # all short: whole, nothing travels
    assert all(r["cut_documents"] == 0 and r["bytes_sent"] == 0 for r in rows)
    with pytest.raises(SystemExit) as exit_info:
        top.main(["explain", "--schedule", "ring", "--mesh", "2", "--documents", "12y"])
    assert exit_info.value.code == 2
    assert "'12y' is not a list of document lengths" in capsys.readouterr().err


@pytest.mark.parametrize("options, exchange", [([], "ULYSSES"),
                                               (["--option", "keep_forward=True"], "ULYSSES_KEPT")])
def test_explain_prices_ulysses_exchanges_as_ulysses_does(capsys, options, exchange):
    """Every document cut (load_balanced) or some (documents): each rank's exchanges are
    priced by the tokens it holds of cut documents, as ulysses' placement prices them."""
    from schedules import assign

    priced = getattr(assign, exchange)
    lengths = [4096] * 2 + [1024] * 4 + [128] * 64
    args = ["explain", "--schedule", "ulysses", "--mesh", "4", "--causal", "--heads", "8",
            "--head-dim", "64", "--documents", "4096x2,1024x4,128x64", "--json", *options]
    assert top.main(args + ["--option", "partition=load_balanced"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["exchange_pairs"] for r in rows] == [priced.per_held_token * sum(lengths) / 4] * 4
    assert top.main(args + ["--option", "partition=documents"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranks"]
    plan = assign.plan(lengths, 4, exchange=priced)
    assert [r["exchange_pairs"] for r in rows] == list(plan.exchanges) and max(plan.exchanges) > 0


def test_explain_plans_ulysses_whole_documents_in_groups_without_a_process_group(capsys):
    """Ulysses, each 4096 cut over a pair of ranks, one K/V head (replicated over the pair):
    its dK/dV sums over the pair are planned dry, moving bytes on the cut documents' ranks."""
    assert not dist.is_initialized()
    assert top.main(["explain", "--schedule", "ulysses", "--mesh", "4", "--causal", "--heads",
                     "8", "--kv-heads", "1", "--head-dim", "64", "--option",
                     "partition=documents", "--documents", "4096x2,1024x4,128x64",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["cut_over_ranks"] for r in rows] == [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]]
    assert all(r["bytes_sent"] > 0 for r in rows)


def test_explain_refuses_a_mesh_that_is_no_shape(capsys):
    with pytest.raises(SystemExit) as exit_info:
        top.main(["explain", "--schedule", "ring", "--mesh", "2x"])
    assert exit_info.value.code == 2
    assert "argument --mesh: '2x' is not a mesh shape" in capsys.readouterr().err


# ---- python -m benchmarks ----------------------------------------------------------------
def test_benchmarks_lists_each_with_a_line_and_refuses_an_unknown_name(capsys):
    assert benchmarks_main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0] for line in lines if line.startswith("  ")}
    assert {"single_gpu", "thd", "context_parallel", "cost_table", "prediction_errors"} <= listed
    assert not {"check", "common", "long_steps", "telemetry", "precision"} & listed
    assert all(len(line.split()) > 3 for line in lines if line.startswith("  "))  # a description
    assert benchmarks_main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 'bogus' is not a benchmark; choose one of [")
    assert err.count("\n") == 1
