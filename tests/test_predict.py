"""The cost model of ``explain`` (schedules/predict.py) and the table it reads
(schedules/cost_table.json): the table is what ``benchmarks.cost_table`` writes from the
committed results, the model knows no schedule by name (a registered one gets a prediction
too), and its predictions of the committed measurements it was not fitted to
(``benchmarks.prediction_errors``) are those docs/benchmarks.md shows.
Run: pytest -q tests/test_predict.py"""

from __future__ import annotations

import importlib
import json
import statistics
from pathlib import Path

import pytest
import torch

import schedules
from benchmarks import cost_table, prediction_errors
from benchmarks.common import COMMITTED_RESULTS
from schedules import predict, report
from schedules.overlap import Overlap
from schedules.plan import plan_ranks
from sdpa_fusion.spec import AttentionSpec

ROOT = Path(__file__).resolve().parent.parent


def spec(seq: int, causal: bool = True) -> AttentionSpec:
    return AttentionSpec(batch=1, heads=32, kv_heads=32, q_len=seq, kv_len=seq, head_dim=128,
                         causal=causal, dtype=torch.bfloat16)


def committed_row(file: str, **fields) -> dict:
    """The one row of committed result ``file`` with ``fields``, read without the code under test."""
    record = json.loads((COMMITTED_RESULTS / file).read_text())
    (row,) = [r for r in record["rows"] if all(r.get(k) == v for k, v in fields.items())]
    return row


# ---- the table ---------------------------------------------------------------------------
def test_the_table_is_what_the_benchmark_writes_from_the_committed_results():
    committed = json.loads(predict.TABLE.read_text())
    written = cost_table.table(COMMITTED_RESULTS, committed)
    assert written == committed, "run python -m benchmarks.cost_table"
    assert cost_table.dumps(written) + "\n" == predict.TABLE.read_text()


def test_the_table_is_small_and_names_where_each_figure_comes_from():
    assert len(predict.TABLE.read_text().splitlines()) < 300
    for device in json.loads(predict.TABLE.read_text())["devices"].values():
        for part, file in (("kernels", "single_gpu.json"), ("ring_shifts", "ring_transport.json")):
            source = device[part]["source"]
            assert source["file"] == file
            assert "python -m benchmarks." in source["command"]
            assert source["git_commit"]


def test_the_table_keeps_the_measured_figures():
    row = committed_row("single_gpu.json", impl="cudnn", head_dim=128, causal=True,
                        mode="fwd+bwd", seq_len=65536)
    figure = predict.rate("cudnn", 128, True, "fwd+bwd", 65536)
    assert figure.value == pytest.approx(row["tflops"] * 1e12, rel=1e-3)
    assert "single_gpu.json" in figure.source


def test_a_kernel_without_figures_gets_an_error_naming_the_measured_ones():
    with pytest.raises(ValueError, match=r"no fwd figures of kernel 'reference'; choose one of "
                                         r"the measured kernels \['cudnn', 'fa4'"):
        predict.rate("reference", 128, True, "fwd", 4096)


# ---- the model ---------------------------------------------------------------------------
def test_a_schedule_without_communication_costs_its_flops_at_the_kernel_rate():
    problem = spec(65536)
    (plan, _) = plan_ranks("head_parallel", problem, (2,))
    step = predict.step_time(plan, problem, mode="fwd+bwd", kernel="cudnn")
    row = committed_row("single_gpu.json", impl="cudnn", head_dim=128, causal=True,
                        mode="fwd+bwd", seq_len=65536)
    assert step.transfer_s == 0
    assert step.seconds == pytest.approx(problem.flops(backward=True) / 2 / (row["tflops"] * 1e12),
                                         rel=1e-3)


def test_ring_transfers_cost_between_their_unhidden_share_and_their_time():
    problem = spec(32768)
    plan = plan_ranks("ring", problem, (2,))[0]
    step = predict.step_time(plan, problem, mode="fwd+bwd", kernel="cudnn", transport="p2p")
    d = plan.description
    seconds_alone = (d.bytes_received + d.backward_bytes_received) / step.bandwidth.value
    assert 0 < step.transfer_s < seconds_alone
    assert step.seconds == pytest.approx(step.compute_s + step.transfer_s)
    assert predict.call_length(plan, problem) == 16384  # each call: one rank's block of keys


def packed_spec(lengths) -> AttentionSpec:
    cu = (0, *torch.tensor(lengths).cumsum(0).tolist())
    return AttentionSpec(batch=1, heads=32, kv_heads=32, q_len=cu[-1], kv_len=cu[-1],
                         head_dim=128, causal=True, dtype=torch.bfloat16, layout="thd",
                         cu_seqlens=cu)


def test_short_packed_documents_run_at_the_share_their_batches_reached():
    """2048 documents of 128 tokens, whole on each rank: calls of 128 keys, at the share of
    the dense rate that the committed packed batch of them reached (thd.json's auto row)."""
    problem = packed_spec([128] * 2048)
    plan = plan_ranks("ring", problem, (4,), partition="documents")[1]
    assert predict.call_length(plan, problem) == 128
    auto = committed_row("thd.json", batch="b", impl="auto")
    kernel = auto["chosen"].split()[0]  # the kernel of the way auto ran
    step = predict.step_time(plan, problem, mode="fwd+bwd", kernel=kernel)
    shortest = committed_row("single_gpu.json", impl=kernel, head_dim=128, causal=True,
                             mode="fwd+bwd", seq_len=4096)  # the rate held below 4K
    dense = predict.rate(kernel, 128, True, "fwd+bwd", 128).value
    assert dense == pytest.approx(shortest["tflops"] * 1e12, rel=1e-3)
    assert step.rate.value == pytest.approx(auto["tflops"] * 1e12, rel=0.01)
    assert step.rate.value < 0.2 * dense and "packed documents of 128 tokens" in step.rate.source


def test_a_rank_calls_its_whole_documents_at_their_length_and_the_cut_ones_in_pieces():
    """Under documents a rank's calls take its whole documents (4K) and a P-th of the cut one
    (64K over 4 ranks: 16K), weighted by work; load_balanced cuts every document."""
    problem = packed_spec([65536, 4096, 4096, 4096, 4096])
    plans = plan_ranks("ring", problem, (4,), partition="documents")
    for plan in plans:
        (whole,) = plan.local.packing.whole_lengths
        pairs = [(4096, 4096 ** 2), (16384, 65536 ** 2 / 4)]
        want = sum(n * w for n, w in pairs) / sum(w for _, w in pairs)
        assert predict.call_length(plan, problem) == round(want)
    balanced = plan_ranks("ring", problem, (4,), partition="load_balanced")[0]
    pairs = [(16384, 65536 ** 2)] + [(1024, 4096 ** 2)] * 4
    want = sum(n * w for n, w in pairs) / sum(w for _, w in pairs)
    assert predict.call_length(balanced, problem) == round(want)


def test_interpolation_is_linear_in_log_length_and_held_at_the_ends():
    points = {1024: 100.0, 4096: 200.0}
    assert predict._interpolate(points, 2048) == pytest.approx(150.0)
    assert predict._interpolate(points, 512) == 100.0 and predict._interpolate(points, 1 << 20) == 200.0


def test_the_model_names_no_schedule():
    """What it needs of a schedule comes from the schedule (``Overlap``)."""
    source = (ROOT / "schedules" / "predict.py").read_text()
    assert [n for n in schedules.names() if f'"{n}"' in source or f"'{n}'" in source] == []
    ring, allgather = (predict.overlap(plan_ranks(n, spec(4096), (4,))[0].description)
                       for n in ("ring", "allgather"))
    assert (ring.hidden(4), ring.splits_keys, ring.own_transport) == (0.75, True, True)
    assert (allgather.hidden(4), allgather.splits_keys, allgather.own_transport) == (0.25, True, False)


@pytest.fixture
def gather_kv():
    """examples/custom_schedule.py imported (registering ``gather_kv``) into a copy of the
    registry that is dropped afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(schedules, "_REGISTRY", dict(schedules._REGISTRY))
        yield importlib.reload(importlib.import_module("examples.custom_schedule"))


def test_a_registered_schedule_gets_a_prediction_with_its_transfers_not_hidden(gather_kv):
    problem = spec(32768, causal=False)
    plan = plan_ranks("gather_kv", problem, (4,))[0]
    assert predict.overlap(plan.description) == Overlap()  # it states nothing
    step = predict.step_time(plan, problem, mode="fwd+bwd", kernel="cudnn")
    d = plan.description
    assert predict.call_length(plan, problem) == 32768  # its calls take every key
    assert step.compute_s == pytest.approx((d.flops + d.backward_flops) / step.rate.value)
    assert step.transfer_s == pytest.approx(
        (d.bytes_received + d.backward_bytes_received) / step.bandwidth.value)
    assert "p2p ring-shift figures" in step.bandwidth.source  # NCCL's, the slower ones
    planned = report.mesh_report("gather_kv", problem, (4,))
    assert planned.predicted is not None and "no predicted time" not in report.text(planned)


# ---- against the committed measurements --------------------------------------------------
@pytest.fixture(scope="module")
def errors():
    return prediction_errors.errors()


def test_predictions_of_committed_measurements(errors):
    found = [(c.file, c.impl, c.spec.q_len, c.mode, e) for c, e in errors]
    assert len(found) >= 40
    assert {c.kernel for c, _ in errors} == {"cudnn", "fa4"}
    worst = max(found, key=lambda e: abs(e[-1]))
    assert abs(worst[-1]) < 0.2, worst
    assert statistics.median(abs(e[-1]) for e in found) < 0.05
    assert all(-0.2 < e[-1] < 0.1 for e in found)  # the model errs on the optimistic side


def test_the_doc_shows_the_prediction_errors_of_the_committed_results(errors):
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    shown = doc.split(prediction_errors.BEGIN)[1].split(prediction_errors.END)[0].strip()
    assert shown.startswith(f"Generated by `{prediction_errors.COMMAND}` from the results")
    assert shown.splitlines()[2:] == prediction_errors.table(errors), \
        f"run {prediction_errors.COMMAND}"
