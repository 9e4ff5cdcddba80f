"""StallWatch: NCCL transfers the host does not wait for, watched from a thread, reported by
name when they do not complete within the mesh's timeout (polls driven by hand here).

Run: pytest -q tests/test_stall_watch.py
"""

from __future__ import annotations

import datetime
import time

from sdpa_fusion.waiting import StallWatch


class Marker:
    """A CUDA event stand-in: ``query()`` is True once ``done`` is set."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


class Notes:
    """An ``Arrivals`` stand-in: which steps this rank noted, and who it says is missing."""

    def __init__(self):
        self.noted: set[int] = set()

    def _note(self, step: int, *, arrived: bool) -> bool:
        (self.noted.add if arrived else self.noted.discard)(step)
        return True

    def missing(self, step: int, waited_s: float) -> str:
        return f"rank 1 did not arrive within {waited_s:g} s (step {step})"


def watch(timeout_s=10.0, ends=None):
    reports, notes = [], Notes()
    w = StallWatch(notes, datetime.timedelta(seconds=timeout_s), stall_s=1.0,
                   report=reports.append, end=lambda: (ends if ends is not None else []).append(1))
    return w, notes, reports


def test_a_stalled_transfer_is_noted_then_reported_once_by_name():
    w, notes, reports = watch()
    late, quick = Marker(), Marker()
    w.add(late, "ring forward: transfer 3 (ranks [0, 1])", 7)
    w.add(quick, "ring forward: transfer 4 (ranks [0, 1])", 8)
    t0 = time.monotonic()
    quick.done = True
    w.check(t0 + 0.5)
    assert notes.noted == set() and reports == []
    w.check(t0 + 2)
    assert notes.noted == {7}  # this rank arrived at step 7 and waits there
    w.check(t0 + 8.5)
    assert reports == []
    w.check(t0 + 9)  # before the timeout (10 s), which ends the process
    w.check(t0 + 12)
    assert len(reports) == 1
    assert reports[0].startswith("ring forward: transfer 3 (ranks [0, 1]) did not complete: "
                                 "rank 1 did not arrive within 9 s (step 7)")


def test_a_transfer_still_stalled_after_the_grace_ends_the_process_once():
    ends = []
    w, notes, reports = watch(ends=ends)
    w.add(Marker(), "ring backward: transfer 2", 5)
    t0 = time.monotonic()
    w.check(t0 + 10 + w.END_GRACE_S - 1)
    assert len(reports) == 1 and ends == []  # named, and NCCL's watchdog has its chance
    w.check(t0 + 10 + w.END_GRACE_S + 1)
    w.check(t0 + 10 + w.END_GRACE_S + 2)
    assert ends == [1] and len(reports) == 2
    assert "ring backward: transfer 2 has not completed" in reports[1]
    assert "ending this process with exit status 1" in reports[1]


def test_completed_transfers_are_forgotten_and_their_notes_cleared():
    w, notes, reports = watch()
    slow = Marker()
    w.add(slow, "allgather backward: transfer 1", 2)
    t0 = time.monotonic()
    w.check(t0 + 3)
    assert notes.noted == {2}
    slow.done = True
    w.check(t0 + 20)
    assert notes.noted == set() and reports == [] and w._watched == []


def test_the_thread_polls_on_its_own():
    w, notes, reports = watch(timeout_s=0.2)
    w.POLL_S = 0.05
    w.stall_s = 0.1
    w.add(Marker(), "ulysses forward: transfer 0", 0)
    deadline = time.monotonic() + 5
    while not reports and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reports and "ulysses forward: transfer 0 did not complete" in reports[0]
