"""The plain-text progress bar of the benchmarks. Run: pytest -q tests/test_progress.py"""

from __future__ import annotations

from benchmarks.progress import Progress, clock_text


def test_progress_counts_cases_and_estimates_the_time_left():
    now = [0.0]
    progress = Progress(4, width=8, clock=lambda: now[0])
    now[0] = 30.0
    assert progress.step("hd=128") == "[##......] 1/4  25%  0:30, ~1:30 left  hd=128"
    now[0] = 60.0
    assert progress.step() == "[####....] 2/4  50%  1:00, ~1:00 left"
    progress.step(), progress.step()
    now[0] = 130.0
    assert progress.step().startswith("[########] 4/4 100%  2:10, ~0:00 left")  # never past the end


def test_clock_text():
    assert [clock_text(s) for s in (0, 42, 725, 3723)] == ["0:00", "0:42", "12:05", "1:02:03"]
