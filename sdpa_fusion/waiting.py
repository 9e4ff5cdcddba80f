"""Waiting for the other ranks of a group, and naming the ones that did not come.

A rank that waits at a step (an agreement, a transfer) longer than a short stall notes its
arrival in the store of rank 0; when the wait fails, the ranks without a note never arrived.
Nothing is written while ranks keep pace. NCCL work is watched by a ``StallWatch`` thread.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time

import torch.distributed as dist

log = logging.getLogger("sdpa_fusion")


class MeshTimeout(RuntimeError):
    """Ranks of a mesh did not meet within its timeout; the message names the step and ranks."""


class Arrivals:
    """The arrival notes of the ``ranks`` (global) of the process group named ``group_name``."""

    def __init__(self, group_name: str, ranks: list[int], timeout: datetime.timedelta):
        self.group_name, self.ranks, self.timeout = group_name, ranks, timeout

    def wait(self, work, step: int) -> None:
        """Wait for gloo ``work`` of ``step``, noting the arrival after a short stall."""
        try:
            work.wait(min(datetime.timedelta(seconds=1), self.timeout / 4))
            return
        except RuntimeError:
            pass  # still waiting (or failed already): note the arrival and wait on
        noted = self._note(step, arrived=True)
        work.wait()
        if noted:
            self._note(step, arrived=False)

    def missing(self, step: int, waited_s: float | None = None) -> str:
        """Who did not arrive at ``step`` within ``waited_s`` (default: the timeout), in words."""
        seconds = self.timeout.total_seconds() if waited_s is None else waited_s
        try:
            store = self._store(step)
            missing = [r for r in self.ranks if not store.check([str(r)])]
        except (RuntimeError, ValueError):
            return (f"a rank did not arrive within {seconds:g} s (which one is unknown: the "
                    f"store of rank 0 cannot be reached)")
        if not missing:
            return (f"every rank arrived, but not within {seconds:g} s of each other (the ranks "
                    f"that came first gave up)")
        return f"{ranks_text(missing, self.ranks)} did not arrive within {seconds:g} s"

    def _store(self, step: int):
        return dist.PrefixStore(f"sdpa_fusion/{self.group_name}/{step}/",
                                dist.distributed_c10d._get_default_store())

    def _note(self, step: int, *, arrived: bool) -> bool:
        """Note (or clear) this rank's arrival; False when the store cannot be reached."""
        try:
            store = self._store(step)
            if arrived:
                store.set(str(dist.get_rank()), "1")
            else:
                store.delete_key(str(dist.get_rank()))
            return True
        except (RuntimeError, ValueError):
            return False


@dataclasses.dataclass(eq=False)
class _Watched:
    done: object  # what says the step completed: an object with ``query()`` (a CUDA event)
    what: str
    step: int
    start: float
    noted: bool = False
    reported: bool = False
    ended: bool = False


class StallWatch:
    """Transfers the host does not wait for (NCCL, copy engine), watched from a thread: after
    ``stall_s`` this rank notes its arrival; at ``REPORT_AT`` of the timeout (before NCCL's
    watchdog) ``report`` names the step and the missing ranks; ``END_GRACE_S`` past it (NCCL's
    watchdog can stall in its debug dump) ``end`` ends the process, so a job never hangs."""

    POLL_S = 0.5
    REPORT_AT = 0.9
    END_GRACE_S = 15.0

    def __init__(self, arrivals: Arrivals, timeout: datetime.timedelta, *, stall_s: float = 1.0,
                 report=None, end=None):
        self.arrivals, self.timeout_s, self.stall_s = arrivals, timeout.total_seconds(), stall_s
        self.report = report or (lambda message: log.error("%s", message))
        self.end = end or _end_process
        self._watched: list[_Watched] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, done, what: str, step: int) -> None:
        """Watch ``done`` (``query()`` is True once step ``step``, called ``what``, completed)."""
        with self._lock:
            self._watched.append(_Watched(done, what, step, time.monotonic()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="sdpa_fusion stall watch")
                self._thread.start()

    def check(self, now: float | None = None) -> None:
        """One poll: forget completed steps, note stalls, report timeouts, end past the grace."""
        now = time.monotonic() if now is None else now
        with self._lock:
            watched = list(self._watched)
        finished = []
        for w in watched:
            if w.done.query():
                if w.noted:
                    self.arrivals._note(w.step, arrived=False)
                finished.append(w)
                continue
            waited = now - w.start
            if not w.noted and waited >= self.stall_s:
                w.noted = self.arrivals._note(w.step, arrived=True)
            if not w.reported and waited >= self.REPORT_AT * self.timeout_s:
                w.reported = True
                missing = self.arrivals.missing(w.step, round(waited, 1))
                self.report(f"{w.what} did not complete: {missing}; every rank must make the "
                            f"same transfers in the same order (the process ends at the "
                            f"mesh's timeout of {self.timeout_s:g} s)")
            if not w.ended and waited >= self.timeout_s + self.END_GRACE_S:
                w.ended = True
                self.report(f"{w.what} has not completed {waited:.0f} s after it began (the "
                            f"mesh's timeout is {self.timeout_s:g} s): ending this process "
                            f"with exit status 1 so that the job does not hang")
                self.end()
        with self._lock:  # _Watched compares by identity
            self._watched = [w for w in self._watched if w not in finished]

    def _run(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 -- a watch must never take the process down
                log.debug("stall watch: %s", e)


def _end_process() -> None:
    """Leave now with exit status 1 (the launcher then ends the other ranks), logs flushed."""
    logging.shutdown()
    os._exit(1)


def ranks_text(ranks: list[int], everyone: list[int]) -> str:
    """"rank 3", "ranks 1, 3", or "every rank" when ``ranks`` are all of ``everyone``."""
    if len(ranks) == len(everyone) > 1:
        return "every rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
