"""The goals of packed batches under context parallelism read off result rows
(``benchmarks.thd_context_parallel.goal_ratios``)."""

from benchmarks import thd_context_parallel as thd

DOCS, SPLIT = thd.DOCUMENTS, thd.LOAD_BALANCED


def _row(batch, impl, tflops, ranks=2):
    return dict(panel=f"batch {batch}", batch=batch, impl=impl, ranks=ranks, status="ok",
                tflops=tflops)


def _rows(b_docs=40.0):
    return [_row("a", "1 GPU auto", 500.0, ranks=1), _row("a", DOCS, 460.0),
            _row("a", SPLIT, 430.0), _row("a", thd.ULYSSES_DOCUMENTS, 470.0), _row("b", "1 GPU auto", 60.0, ranks=1),
            _row("b", DOCS, b_docs), _row("b", SPLIT, 10.0)]


def _by(ratios):
    return {(r["case"], r["impl"]): r for r in ratios}


def test_documents_preset_asks_0_9_of_one_gpu_and_3x_the_split_on_b():
    got = _by(thd.goal_ratios(_rows(), "documents"))
    per_gpu = got["batch a", DOCS]
    assert (per_gpu["ratio"], per_gpu["goal"]) == (460.0 / 500.0, 0.9)
    assert got["batch a", SPLIT]["goal"] is None  # the split is measured, not a goal
    by_heads = got["batch a", thd.ULYSSES_DOCUMENTS]  # cut documents by heads: the same goal
    assert (by_heads["ratio"], by_heads["goal"]) == (470.0 / 500.0, 0.9)
    b_over = got["batch b", f"{DOCS} / {SPLIT}"]
    assert (b_over["ratio"], b_over["goal"]) == (4.0, 3.0)
    assert got["batch a", f"{DOCS} / {SPLIT}"]["goal"] is None  # 3x is asked of b alone
    slow = _by(thd.goal_ratios(_rows(b_docs=25.0), "documents"))["batch b", f"{DOCS} / {SPLIT}"]
    assert slow["ratio"] < slow["goal"]


def test_without_a_preset_every_schedule_keeps_the_0_85_goal_and_no_split_ratio():
    rows = [_row("a", "1 GPU auto", 500.0, ranks=1), _row("a", "ring", 450.0)]
    (only,) = thd.goal_ratios(rows)
    assert (only["impl"], only["ratio"], only["goal"]) == ("ring", 0.9, 0.85)
