"""Waiting for the other ranks of a group, and naming the ones that did not come.

A rank that waits at a step (an agreement, a transfer) longer than a short stall notes its
arrival in the store of the process group (rank 0's); when the wait fails, the ranks without
a note are the ones that never arrived. Nothing is written while ranks keep pace, so the
cheap path costs no store traffic. Only gloo (CPU) waits: waiting with a time limit would
block the host on NCCL work, whose timeouts NCCL's watchdog reports.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


class MeshTimeout(RuntimeError):
    """Ranks of a mesh did not meet within the mesh's timeout; the message names the call, the
    step and the ranks that did not arrive. The group is unusable afterwards."""


class Arrivals:
    """The arrival notes of the ``ranks`` (global) of the process group named ``group_name``."""

    def __init__(self, group_name: str, ranks: list[int], timeout: datetime.timedelta):
        self.group_name, self.ranks, self.timeout = group_name, ranks, timeout

    def wait(self, work, step: int) -> None:
        """Wait for gloo ``work`` of ``step``, noting this rank's arrival after a short stall;
        the backend's RuntimeError when it fails (see ``missing``)."""
        try:
            work.wait(min(datetime.timedelta(seconds=1), self.timeout / 4))
            return
        except RuntimeError:
            pass  # still waiting (or failed already): note the arrival and wait on
        noted = self._note(step, arrived=True)
        work.wait()
        if noted:
            self._note(step, arrived=False)

    def missing(self, step: int) -> str:
        """Who did not arrive at ``step``, in words (after a failed ``wait``)."""
        seconds = self.timeout.total_seconds()
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


def ranks_text(ranks: list[int], everyone: list[int]) -> str:
    """"rank 3", "ranks 1, 3", or "every rank" when ``ranks`` are all of ``everyone``."""
    if len(ranks) == len(everyone) > 1:
        return "every rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
