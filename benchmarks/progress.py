"""A plain-text progress bar for long benchmark runs (no dependency).

    progress = Progress(total=36)
    print(progress.step("hd=128 s=32K"))   # [#####...............]  5/36  14%  0:42, ~4:18 left  hd=128 s=32K

Each ``step`` marks one case done and returns its line; the time left is the mean time per
case so far times the cases left.
"""

from __future__ import annotations

import time


def clock_text(seconds: float) -> str:
    """0:42, 12:05, 1:02:03."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    text = f"{rest // 60}:{rest % 60:02d}"
    return f"{hours}:{text.zfill(5)}" if hours else text


class Progress:
    """Cases done out of ``total``, with elapsed time and an estimate of the time left."""

    def __init__(self, total: int, *, width: int = 20, clock=time.monotonic):
        self.total, self.width, self.clock = max(int(total), 1), width, clock
        self.done, self.start = 0, clock()

    def step(self, what: str = "") -> str:
        """Count one case done; the progress line (``what`` at its end)."""
        self.done = min(self.done + 1, self.total)
        elapsed = self.clock() - self.start
        left = elapsed / self.done * (self.total - self.done)
        filled = self.width * self.done // self.total
        digits = len(str(self.total))
        bar = "#" * filled + "." * (self.width - filled)
        line = (f"[{bar}] {self.done:>{digits}}/{self.total} {100 * self.done // self.total:3d}%  "
                f"{clock_text(elapsed)}, ~{clock_text(left)} left")
        return f"{line}  {what}" if what else line
