"""benchmarks.max_seq's arithmetic: which length a confirming step runs at within its time
budget, and what the summary claims from it (pure functions: no GPU); and its --tiny run on
CPU, whose confirming step counts only when its results are right.

Run: python -m pytest -q tests/test_max_seq.py
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from benchmarks import max_seq
from benchmarks.max_seq import HEADROOM, merge, predict, summary, within_budget

K = 1024
RIGHT = {"right": True}  # a confirming step's check (check.merge's dict), in short


def probe(impl, s, seconds):
    return dict(impl=impl, phase="probe", status="ok", seq_len=s, seconds=seconds)


def test_a_step_within_the_budget_runs_at_the_target():
    rows = [probe("ring", 64 * K, 1.0), probe("ring", 256 * K, 4.0)]
    # 4 s at 256K grows to 4 * 16 = 64 s at 1M
    assert within_budget(rows, 1024 * K, 100, 4 * K) == 1024 * K


def test_a_longer_step_runs_at_the_longest_length_the_budget_allows():
    rows = [probe("ring", 256 * K, 4.0)]
    got = within_budget(rows, 4096 * K, 400, 4 * K)  # 1024 s at 4M; 400 s allows 2.5M
    assert got % (4 * K) == 0
    assert 4.0 * (got / (256 * K)) ** 2 <= 400 < 4.0 * ((got + 4 * K) / (256 * K)) ** 2


def test_summary_compares_predictions_and_a_lower_bound_with_one_gpu_predicted():
    rows = [
        dict(impl="1 GPU auto", phase="predict", status="ok", seq_len=1000, bytes_per_token=1.0),
        dict(impl="ring", phase="predict", status="ok", seq_len=4000, bytes_per_token=0.5),
        dict(impl="ring", phase="confirm", status="ok", seq_len=2500, full=False, seconds=400.0,
             check=RIGHT),
        dict(impl="ulysses", phase="predict", status="ok", seq_len=3000, bytes_per_token=0.5),
        dict(impl="ulysses", phase="confirm", status="out of memory", seq_len=2850, full=True),
    ]
    got = {e["impl"]: e for e in summary(rows)}
    assert got["ring"]["ratio_to_one_gpu"] == 4.0
    assert got["ring"]["confirmed_ratio_to_one_gpu"] == 2.5
    assert got["ring"]["confirmed_full"] is False
    assert got["ulysses"]["confirmed"] is None and got["ulysses"]["confirmed_ratio_to_one_gpu"] is None
    assert got["ulysses"]["confirmed_full"] is False


def test_a_wrong_or_unchecked_confirmation_confirms_nothing_the_longest_right_one_counts():
    rows = [
        dict(impl="1 GPU auto", phase="confirm", status="ok", seq_len=1000, asked=True,
             check=RIGHT),
        dict(impl="1 GPU auto", phase="confirm", status="wrong", seq_len=3000, asked=True,
             errors={"dq": 0.4}),
        dict(impl="1 GPU auto", phase="confirm", status="ok", seq_len=2000, asked=True,
             kernel="cudnn", errors={"dq": 0.004}, check=RIGHT),
        dict(impl="ring", phase="confirm", status="wrong", seq_len=4000, full=True),
        dict(impl="ulysses", phase="confirm", status="ok", seq_len=4000, full=True),  # old
    ]
    got = {e["impl"]: e for e in summary(rows)}
    assert got["1 GPU auto"]["confirmed"] == 2000
    assert got["1 GPU auto"]["kernel"] == "cudnn"
    assert got["1 GPU auto"]["confirm_errors"] == {"dq": 0.004}
    assert [c["status"] for c in got["1 GPU auto"]["confirms"]] == ["ok", "wrong", "ok"]
    assert got["ring"]["confirmed"] is None and got["ring"]["confirm_status"] == "wrong"
    assert got["ulysses"]["confirmed"] is None
    assert got["ulysses"]["confirm_status"] == "unchecked"


def test_merge_takes_each_implementation_once_and_never_over_this_run(tmp_path):
    one = [probe("1 GPU auto", 64 * K, 1.0)]
    ring = [probe("1 GPU auto", 64 * K, 9.0), probe("ring", 64 * K, 2.0),
            probe("ulysses", 64 * K, 7.0)]
    (tmp_path / "max_seq_single.json").write_text(json.dumps({"rows": one}))
    (tmp_path / "max_seq_ring.json").write_text(json.dumps({"rows": ring}))
    args = types.SimpleNamespace(results_dir=tmp_path,
                                 merge=["max_seq_single", "max_seq_ring", "max_seq_missing"])
    record = {"rows": [probe("ulysses", 64 * K, 3.0)]}
    merge(args, record)
    assert [(r["impl"], r["seconds"]) for r in record["rows"]] == [
        ("1 GPU auto", 1.0), ("ring", 2.0), ("ulysses", 3.0)]
    assert record["merged"] == ["max_seq_single", "max_seq_ring"]


def test_a_fixed_cost_the_description_leaves_out_stays_fixed():
    """Probes measuring what describe() says plus 128 MiB: the prediction is the longest
    length whose described bytes plus 128 MiB fit, not one grown by the probes' ratio."""
    mib = 1 << 20

    def described(s):
        return 1000 * s

    points = [(s, described(s) + 128 * mib) for s in (64 * K, 128 * K, 256 * K)]
    free = (described(4096 * K) + 129 * mib) / HEADROOM  # 1 MiB spare: less than 4K tokens
    assert predict(points, free, 4 * K, described) == 4096 * K
    ratio = max(measured / described(s) for s, measured in points)  # 3x at 64K
    assert ratio * described(4096 * K) > free * HEADROOM


def tiny(tmp_path, *extra) -> dict:
    """The --tiny one-device run, confirming at 512 tokens: its summary entry."""
    assert max_seq.main(["--single-gpu", "--tiny", "--confirm-lens", "512", *extra,
                         "--results-dir", str(tmp_path), "--copy-to", ""]) == 0
    record = json.loads((tmp_path / "max_seq_tiny.json").read_text())
    (confirm,) = [r for r in record["rows"] if r["phase"] == "confirm"]
    return confirm, record["summary"][0]


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_the_tiny_run_confirms_a_right_step_and_records_its_kernel_and_errors(tmp_path, layout):
    confirm, entry = tiny(tmp_path, "--layout", layout)
    assert confirm["status"] == "ok" and confirm["kernel"] == "reference"
    assert confirm["check"]["right"] and confirm["check"]["rows"]["dk"] > 0
    assert max(confirm["errors"].values()) < 1e-2
    assert entry["confirmed"] == 512 and entry["confirm_errors"] == confirm["errors"]


def test_a_step_with_a_wrong_dq_is_wrong_and_not_confirmed(tmp_path, monkeypatch):
    import sdpa_fusion

    right = sdpa_fusion.attention

    def wrong_dq(q, k, v, **kwargs):  # out as it is; dq gains 0.5 dout
        return right(q, k, v, **kwargs) + 0.5 * (q - q.detach())

    monkeypatch.setattr(sdpa_fusion, "attention", wrong_dq)
    confirm, entry = tiny(tmp_path)
    assert confirm["status"] == "wrong" and "dq" in confirm["error"]
    assert confirm["errors"]["dq"] > 0.1 and confirm["errors"]["out"] < 1e-2
    assert entry["confirmed"] is None and entry["confirm_status"] == "wrong"


def test_shards_are_the_global_problem_s_rows():
    args = max_seq.parse_args(["--tiny", "--layout", "bshe"])
    positions = torch.tensor([5, 900, 64, 1023])
    shard = max_seq.local_inputs(args, positions, "cpu")
    whole = max_seq.local_inputs(args, torch.arange(1024), "cpu")
    for part, full in zip(shard, whole):
        assert torch.equal(part.detach(), full.detach()[:, :, positions])
        assert part.stride(1) < part.stride(2)  # bshe
    assert [t.requires_grad for t in shard] == [True, True, True, False]
