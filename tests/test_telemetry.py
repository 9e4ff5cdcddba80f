"""benchmarks.telemetry (the GPUs' clocks beside each measurement) and the sustained-load
hold of benchmarks.common.measure, on the CPU."""

from __future__ import annotations

import pytest

from benchmarks import common, telemetry


def test_summarize_gives_each_gpus_clock_power_and_limits():
    lines = [
        "0, 1600, 690.5, 61, 0x0000000000000004",   # power-capped
        "1, 1980, 120.0, 40, 0x0000000000000001",   # idle
        "0, 1700, 650.5, 63, 0x0000000000000000",
        "1, 1500, 700.0, 66, 0x0000000000000080",   # hardware power brake
        "0, [N/A], 600, 60, 0x0",                   # a field reported as N/A: left out
        "garbage",
    ]
    gpus = telemetry.summarize(lines)
    assert list(gpus) == ["0", "1"]
    assert gpus["0"] == {"sm_mhz": 1650, "power_w": 670, "max_temp_c": 63.0, "limited": 0.5,
                         "samples": 2}
    assert gpus["1"]["sm_mhz"] == 1740 and gpus["1"]["limited"] == 0.5


def test_summarize_of_nothing_is_none():
    assert telemetry.summarize([]) is None
    assert telemetry.summarize(["not, a, sample"]) is None


def test_no_sampler_without_a_gpu():
    assert telemetry.sampler() is None


def test_measure_holds_before_timing_and_every_rank_stops_together():
    """``hold_s`` runs rounds of four untimed steps until ``agree`` says stop; here another
    rank wants two rounds more than this one's clock, so this one takes them too."""
    calls, decisions = [], []

    def step(x):
        calls.append(x)

    def agree(go):
        decisions.append(go)
        return go or len(decisions) <= 2  # the other rank goes on for two rounds

    m = common.measure(step, [1, 2], warmup=1, iters=3, hold_s=1e-9, agree=agree)
    assert m.status == "ok" and m.hold_s == 1e-9 and m.gpus is None
    assert decisions == [False, False, False]
    assert len(calls) == 1 + 3 * 4 + 3


def test_measure_without_hold_times_right_after_warmup():
    calls = []
    m = common.measure(calls.append, [0], warmup=2, iters=4)
    assert m.status == "ok" and m.hold_s == 0.0 and len(calls) == 6


def test_budget_is_estimated_past_a_first_call_that_compiles():
    """A first call 100x slower than the others (a kernel compiling) does not cut the timed
    iterations to the least: the estimate takes a call after it."""
    import time

    calls = []

    def step(x):
        time.sleep(0.2 if not calls else 0.002)
        calls.append(x)

    m = common.measure(step, [0], warmup=1, iters=10, min_iters=2, budget_s=0.1)
    assert m.status == "ok" and m.iters == 10 and len(calls) == 2 + 10


def test_hold_alone_runs_about_its_seconds():
    import time

    calls = []

    def step(x):
        calls.append(x)
        time.sleep(0.01)

    start = time.perf_counter()
    common.measure(step, [0], warmup=0, iters=1, hold_s=0.1)
    assert time.perf_counter() - start >= 0.1
    assert len(calls) % 4 == 1 and len(calls) >= 9


@pytest.mark.parametrize("hold", ["0", "0.05"])
def test_context_parallel_records_hold_and_gpus(tmp_path, hold):
    from benchmarks import context_parallel

    assert context_parallel.main(["--single-gpu", "--tiny", "--seq-lens", "64", "--causal", "yes",
                                  "--modes", "fwd+bwd", "--hold-seconds", hold,
                                  "--results-dir", str(tmp_path), "--copy-to", ""]) == 0
    import json

    record = json.loads((tmp_path / "context_parallel_tiny.json").read_text())
    assert record["settings"]["hold_seconds"] == float(hold)
    row = record["rows"][0]
    assert row["status"] == "ok" and row["hold_s"] == float(hold) and row["gpus"] is None
