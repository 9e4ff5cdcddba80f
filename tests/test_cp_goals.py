"""The goals of context parallelism read off result rows (``benchmarks.cp_goals``)."""

from benchmarks import cp_goals

K = 1024


def _row(impl, tflops, s=32 * K, **extra):
    return dict(panel=cp_goals.PANEL, impl=impl, seq_len=s, status="ok", tflops=tflops, **extra)


def test_ring_is_compared_with_one_gpu_alone_and_with_every_gpu_at_once():
    rows = [_row("ring fa4", 570.0, kernel="fa4"), _row("1 GPU fa4", 600.0),
            _row("every GPU fa4", 580.0)]
    goals = {g["goal"]: g for g in cp_goals.evaluate(rows)}
    alone, together = goals["ring fa4 / 1 GPU fa4"], goals["ring fa4 / every GPU fa4"]
    assert (alone["value"], alone["ok"]) == (0.95, True)  # 0.95 at 32K: met
    assert together["value"] == round(570 / 580, 3) and together["ok"]
    rows[0]["tflops"] = 560.0
    assert not {g["goal"]: g for g in cp_goals.evaluate(rows)}["ring fa4 / 1 GPU fa4"]["ok"]


def test_a_baseline_that_did_not_run_is_not_a_goal():
    goals = cp_goals.evaluate([_row("ring cudnn", 500.0, kernel="cudnn"), _row("1 GPU cudnn", 550.0)])
    assert [g["goal"] for g in goals] == ["ring cudnn / 1 GPU cudnn"]
