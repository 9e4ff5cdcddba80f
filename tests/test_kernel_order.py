"""How ``auto`` orders kernels: by the measured table, per device, head dim and causal flag,
with a default order for devices the table does not know (pure logic, on CPU).

Run: pytest -q tests/test_kernel_order.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.kernel_table import kernel_table, write_kernel_table
from schedules.replicated import Replicated
from sdpa_fusion import AttentionSpec
from sdpa_fusion.api import Plan
from sdpa_fusion.kernels import get, names, ranking, select
from sdpa_fusion.kernels.ranking import Device, Measured, choose, default_order, lookup, rank

H200 = Device("NVIDIA H200", (9, 0))
H100 = Device("NVIDIA H100 80GB HBM3", (9, 0))
A100 = Device("NVIDIA A100-SXM4-80GB", (8, 0))
B200 = Device("NVIDIA B200", (10, 0))


def measured(device="NVIDIA H200", sm="sm90", head_dim=128, causal=True, **tflops):
    return Measured.from_json(dict(device=device, sm=sm, head_dim=head_dim, causal=causal,
                                   tflops=tflops))


TABLE = (
    measured(head_dim=128, causal=True, cudnn=575.0, fa4=652.0, flash=320.0, nvfuser=318.0),
    measured(head_dim=128, causal=False, cudnn=602.0, fa4=674.0, flash=330.0),
    measured(head_dim=64, causal=True, cudnn=430.0, fa4=410.0, flash=280.0),
    measured(head_dim=256, causal=True, fa4=480.0, flash=250.0),
)
ALL_RUN = {"cudnn": None, "fa4": None, "flash": None, "nvfuser": None}


def test_fastest_measured_first_and_why():
    r = rank(TABLE, H200, 128, True)
    assert r.order == ("fa4", "cudnn", "flash", "nvfuser")
    chosen, skipped, why = choose(r, ALL_RUN)
    assert (chosen, skipped) == ("fa4", [])
    assert why == ("auto chose fa4: 652 TFLOP/s measured on NVIDIA H200 (hd 128, causal, "
                   "fwd+bwd) vs cudnn 575, flash 320, nvfuser 318")


def test_the_order_follows_the_figures_per_head_dim():
    assert rank(TABLE, H200, 64, True).order[:2] == ("cudnn", "fa4")
    # cuDNN is not measured at hd 256 (it cannot run it): measured kernels first, then the rest
    assert rank(TABLE, H200, 256, True).order == ("fa4", "flash", "cudnn", "nvfuser")


def test_a_kernel_that_cannot_run_is_skipped_with_its_reason():
    reasons = dict(ALL_RUN, fa4="kernel 'fa4' needs FlashAttention-4")
    chosen, skipped, why = choose(rank(TABLE, H200, 128, True), reasons)
    assert chosen == "cudnn" and skipped == ["kernel 'fa4' needs FlashAttention-4"]
    assert why.startswith("auto chose cudnn: 575 TFLOP/s measured on NVIDIA H200")
    assert why.endswith("vs flash 320, nvfuser 318")


def test_no_kernel_can_run():
    reasons = {k: f"{k} cannot" for k in ALL_RUN}
    chosen, skipped, why = choose(rank(TABLE, H200, 128, True), reasons)
    assert chosen is None and sorted(skipped) == sorted(reasons.values()) and why == ""


def test_a_device_of_the_same_capability_uses_its_measurements():
    r = rank(TABLE, H100, 128, False)
    assert r.order[0] == "fa4"
    assert "same sm90 as this NVIDIA H100 80GB HBM3" in choose(r, ALL_RUN)[2]


def test_an_unknown_device_takes_the_default_order_of_its_capability():
    for device in (A100, B200):
        r = rank(TABLE, device, 128, True)
        assert r.measured is None and r.order == default_order(device.capability)
        why = choose(r, ALL_RUN)[2]
        assert why.startswith(f"auto chose cudnn: nothing measured on {device.name} ({device.sm})")


def test_default_orders():
    assert default_order((9, 0)) == ("cudnn", "fa4", "flash", "nvfuser")
    assert default_order((10, 0))[:2] == ("cudnn", "fa4")
    assert "fa4" not in default_order((8, 0)), "FA4 has no backward below sm90"


def test_nearest_head_dim_and_the_other_causal_flag_stand_in():
    m = lookup(TABLE, H200, 96, True)
    assert m.head_dim == 128, "96 is as near to 64 as to 128: the larger wins"
    assert lookup(TABLE, H200, 256, False).head_dim == 128, "no non-causal hd 256: hd 128 stands in"
    why = choose(rank(TABLE, H200, 80, True), ALL_RUN)[2]
    assert "hd 64, nearest to 80" in why


def test_a_measured_kernel_that_cannot_run_leaves_an_unmeasured_one():
    table = (measured(cudnn=575.0, fa4=652.0),)
    reasons = dict(ALL_RUN, cudnn="no", fa4="no")
    chosen, skipped, why = choose(rank(table, H200, 128, True), reasons)
    assert chosen == "flash" and skipped == ["no", "no"]
    assert why.startswith("auto chose flash: first that runs this problem in the order "
                          "fa4 > cudnn > flash > nvfuser")


# ---- the table, written from benchmark results ---------------------------------------------
def result(device, sm, rows):
    return {"environment": {"device": device, "capability": sm, "date_utc": "now"},
            "rows": [dict(impl=impl, mode=mode, head_dim=hd, causal=causal, seq_len=s,
                          tflops=t) for impl, mode, hd, causal, s, t in rows]}


def test_the_table_is_written_from_results_and_read_back(tmp_path):
    rows = [
        ("fa4", "fwd+bwd", 128, True, 8192, 600.0), ("fa4", "fwd+bwd", 128, True, 16384, 700.0),
        ("cudnn", "fwd+bwd", 128, True, 8192, 500.0), ("cudnn", "fwd+bwd", 128, True, 16384, 560.0),
        ("cudnn", "fwd+bwd", 128, True, 4096, 290.0),   # each kernel: over its own lengths
        ("fa4", "fwd", 128, True, 8192, 900.0),          # forward only: not ranked by
        ("auto", "fwd+bwd", 128, True, 8192, 999.0),     # auto is not a kernel of its own
        ("torch-cudnn", "fwd+bwd", 128, True, 8192, 999.0),
        ("flash", "fwd+bwd", 128, True, 8192, None),     # failed
    ]
    path = write_kernel_table(result("NVIDIA H200", "sm90", rows), tmp_path / "t.json")
    (entry,) = json.loads(path.read_text())["entries"]
    assert entry["tflops"] == {"cudnn": 450.0, "fa4": 650.0}
    assert entry["seq_lens"] == {"cudnn": [4096, 8192, 16384], "fa4": [8192, 16384]}
    table = ranking.load_table(path)
    assert rank(table, H200, 128, True).order[:2] == ("fa4", "cudnn")

    other = [("cudnn", "fwd+bwd", 128, True, 8192, 400.0)]
    write_kernel_table(result("NVIDIA H100", "sm90", other), path)
    write_kernel_table(result("NVIDIA H200", "sm90", [("cudnn", "fwd+bwd", 128, True, 8192, 1.0)]),
                       path)
    entries = {e["device"]: e["tflops"] for e in json.loads(path.read_text())["entries"]}
    assert entries == {"NVIDIA H100": {"cudnn": 400.0}, "NVIDIA H200": {"cudnn": 1.0}}


def test_the_committed_table_holds_what_the_committed_result_measured():
    committed = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "single_gpu.json"
    table = json.loads(ranking.TABLE.read_text())["entries"]
    from_result = kernel_table(json.loads(committed.read_text()))
    assert from_result, "the committed single-GPU result has kernel measurements"
    for entry in from_result:
        assert entry in table, (f"the table differs from {committed.name} at hd "
                                f"{entry['head_dim']} causal={entry['causal']}; rewrite it: python "
                                f"-m benchmarks.single_gpu --kernel-table-from {committed}")
    assert {k for e in table for k in e["tflops"]} <= set(names())


# ---- select and explain ---------------------------------------------------------------------
def test_select_auto_on_a_gpu_ranks_by_the_table(monkeypatch):
    monkeypatch.setattr(ranking, "gpu", lambda device: H200)
    reasons = dict(ALL_RUN, nvfuser="kernel 'nvfuser' needs nvfuser_direct")
    for name, reason in reasons.items():
        monkeypatch.setattr(get(name), "unavailable_reason", lambda spec, device, r=reason: r)
    spec = AttentionSpec(batch=1, heads=8, kv_heads=8, q_len=8192, kv_len=8192, head_dim=128,
                         causal=True)
    choice = select("auto", spec, torch.device("cuda"), table=TABLE)
    assert choice.kernel is get("fa4") and choice.skipped == []
    assert choice.why.endswith("vs cudnn 575, flash 320")
    text = str(Plan(spec, choice.kernel, tuple(choice.skipped), Replicated(None), choice.why))
    assert "kernel: fa4\n  auto chose fa4: 652 TFLOP/s measured on NVIDIA H200" in text


def test_select_auto_on_cpu_takes_the_reference_kernel():
    spec = AttentionSpec(batch=1, heads=2, kv_heads=2, q_len=8, kv_len=8, head_dim=8)
    choice = select("auto", spec, "cpu")
    assert choice.kernel is get("reference") and "cpu" in choice.why


@pytest.mark.parametrize("kernel", ["cudnn", "fa4"])
def test_a_named_kernel_is_not_ranked(kernel):
    spec = AttentionSpec(batch=1, heads=2, kv_heads=2, q_len=8, kv_len=8, head_dim=8,
                         dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"kernel '{kernel}' runs on CUDA GPUs only"):
        select(kernel, spec, "cpu")
