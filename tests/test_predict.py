"""The cost model of ``explain`` (benchmarks/predict.py) against the committed measurements it
was not fitted to: its inputs are one-GPU kernel rates and ring-shift bandwidths, the
schedules' own step times are only compared with.
Run: pytest -q tests/test_predict.py"""

from __future__ import annotations

import functools
import json
import statistics

import pytest
import torch

from benchmarks import predict
from schedules.plan import plan_ranks
from sdpa_fusion.spec import AttentionSpec

SCHEDULE_FILES = ("context_parallel.json", "context_parallel_2gpu.json", "hybrid.json",
                  "head_parallel.json", "context_parallel_single.json")


def spec_of(row: dict) -> AttentionSpec:
    causal = row.get("causal", row["panel"].startswith("causal"))
    return AttentionSpec(batch=row["batch"], heads=row["heads"], kv_heads=row["heads"],
                         q_len=row["seq_len"], kv_len=row["seq_len"], head_dim=row["head_dim"],
                         causal=causal, dtype=torch.bfloat16)


def committed_cases():
    """(file, row, schedule, mesh shape, options) of every committed measurement of one of
    our schedules (rows read straight from the JSON files)."""
    for file in SCHEDULE_FILES:
        record = json.loads((predict.RESULTS / file).read_text())
        for row in record["rows"]:
            words = row["impl"].split()
            if row["status"] != "ok" or "baseline_from" in row:
                continue
            if words[0] == "ring":  # 4 GPUs: NCCL send/receive; later, the transport named or
                transport = words[1] if len(words) > 1 else (  # copy engines (symmetric memory)
                    "copy_engine" if row.get("symmetric_gib") else "p2p")
                yield file, record, row, "ring", (row["ranks"],), {"transport": transport}
            elif words[0] in ("allgather", "ulysses") or row["impl"] == "head_parallel auto":
                yield file, record, row, words[0], (row["ranks"],), {}
            elif words[0] == "hybrid":
                yield file, record, row, "hybrid", tuple(map(int, words[2].split("x"))), \
                    {"inner": words[1]}
            elif row["impl"] == "1 GPU auto" and row.get("ranks", 1) == 1:
                yield file, record, row, "replicated", (1,), {}


@functools.lru_cache(maxsize=None)
def plans_of(name, spec, shape, inner):
    return plan_ranks(name, spec, shape, **({"inner": inner} if inner else {}))


def relative_errors():
    errors = []
    for file, record, row, name, shape, options in committed_cases():
        spec = spec_of(row)
        kernel = "fa4" if record["environment"].get("flash_attn_4") else "cudnn"
        plans = plans_of(name, spec, shape, options.get("inner"))
        seconds = max(predict.step_time(p, spec, mode=row["mode"], kernel=kernel,
                                        transport=options.get("transport", "auto")).seconds
                      for p in plans)
        errors.append((file, row["impl"], row["seq_len"], row["mode"],
                       seconds * 1e3 / row["median_ms"] - 1))
    return errors


def test_predictions_of_committed_measurements():
    errors = relative_errors()
    assert len(errors) > 150
    two_gpus = [e for e in errors if e[0] != "context_parallel.json"]
    worst = max(two_gpus, key=lambda e: abs(e[-1]))
    assert abs(worst[-1]) < 0.2, worst
    assert statistics.median(abs(e[-1]) for e in errors) < 0.05
    # 4 GPUs at 32K with NCCL send/receive: the transfers were slower than the 2-GPU link
    # the model knows, so it predicts too fast there, never by more than 45%
    assert all(-0.45 < e[-1] < 0.1 for e in errors)


def test_a_schedule_without_communication_costs_its_flops_at_the_kernel_rate():
    spec = AttentionSpec(batch=1, heads=32, kv_heads=32, q_len=65536, kv_len=65536,
                         head_dim=128, causal=True)
    (plan, _) = plan_ranks("head_parallel", spec, (2,))
    step = predict.step_time(plan, spec, mode="fwd+bwd", kernel="cudnn")
    record = json.loads((predict.RESULTS / "single_gpu.json").read_text())
    (row,) = [r for r in record["rows"] if r["impl"] == "cudnn" and r["head_dim"] == 128
              and r["causal"] and r["mode"] == "fwd+bwd" and r["seq_len"] == 65536]
    assert step.transfer_s == 0
    assert step.seconds == pytest.approx(spec.flops(backward=True) / 2 / (row["tflops"] * 1e12))


def test_ring_transfers_cost_between_their_unhidden_share_and_their_time():
    spec = AttentionSpec(batch=1, heads=32, kv_heads=32, q_len=32768, kv_len=32768,
                         head_dim=128, causal=True)
    plan = plan_ranks("ring", spec, (2,))[0]
    step = predict.step_time(plan, spec, mode="fwd+bwd", kernel="cudnn", transport="p2p")
    d = plan.description
    seconds_alone = (d.bytes_received + d.backward_bytes_received) / step.bandwidth.value
    assert 0 < step.transfer_s <= seconds_alone
    assert step.seconds == pytest.approx(step.compute_s + step.transfer_s)


def test_interpolation_is_linear_in_log_length_and_held_at_the_ends():
    points = {1024: 100.0, 4096: 200.0}
    assert predict._interpolate(points, 2048) == pytest.approx(150.0)
    assert predict._interpolate(points, 512) == 100.0 and predict._interpolate(points, 1 << 20) == 200.0


def test_the_last_measurement_is_the_newest_of_the_configuration():
    spec = AttentionSpec(batch=1, heads=32, kv_heads=32, q_len=32768, kv_len=32768,
                         head_dim=128, causal=True)
    found = predict.measurements("ring", (2,), spec, "fwd+bwd", {"transport": "copy_engine"})
    files = {m.file for m in found}
    assert files == {"context_parallel_2gpu.json", "hybrid.json"}
    assert found[-1].file == "hybrid.json" and found[-1].date >= found[0].date
