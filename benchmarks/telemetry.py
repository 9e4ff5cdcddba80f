"""What the GPUs ran at while a measurement was taken: SM clock, power, temperature, and how
often a power or thermal limit held the clock down.

Under sustained attention an H200 draws its power limit (700 W) and its driver lowers the SM
clock below its maximum (1980 MHz) until the draw fits, by a different amount on each GPU (a
hotter chip needs a lower clock for the same power). A multi-GPU figure is a ratio of two such
measurements, so ``common.measure`` records, beside each time, the clocks of the GPUs over
the timed iterations (``Measurement.gpus``):

    {"0": {"sm_mhz": 1617, "power_w": 690, "max_temp_c": 61, "limited": 0.98, "samples": 40},
     "1": {...}}

One ``nvidia-smi`` process per benchmark process samples every GPU (read-only queries) every
100 ms from the first measurement on; each sample is stamped when it arrives, and a
measurement takes the samples of its own time span. Where there is no nvidia-smi or no CUDA
(CPU machines) there are no samples and ``gpus`` is None. Indices are nvidia-smi's.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

QUERY = "index,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
# clocks_event_reasons bits that mean a limit held the clock down: software power cap,
# hardware slowdown, software and hardware thermal slowdown, hardware power brake
LIMITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
INTERVAL_MS = 100


class Sampler:
    """An ``nvidia-smi`` loop whose csv lines are kept with the time they arrived."""

    def __init__(self, interval_ms: int = INTERVAL_MS):
        self._samples: list[tuple[float, str]] = []
        self._process = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
             "-lms", str(interval_ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        # nvidia-smi ends on its next write once this process is gone (broken pipe)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._process.stdout:
            self._samples.append((time.time(), line))

    def between(self, start: float, stop: float) -> dict | None:
        """``summarize`` of the samples that arrived between ``start`` and ``stop``
        (``time.time()`` values)."""
        return summarize(line for t, line in list(self._samples) if start <= t <= stop)


_SAMPLER: list = []  # the process's Sampler, made on first use (None where none can run)


def sampler() -> Sampler | None:
    """This process's sampler, started on the first call; None without nvidia-smi or CUDA."""
    if not _SAMPLER:
        import torch

        usable = torch.cuda.is_available() and shutil.which("nvidia-smi") is not None
        _SAMPLER.append(Sampler() if usable else None)
    return _SAMPLER[0]


def summarize(lines) -> dict | None:
    """Per GPU: mean SM clock (MHz) and power (W), highest temperature (C), the share of
    samples in which a power or thermal limit held the clock down, and the sample count, from
    nvidia-smi's csv lines of ``QUERY`` (no header, no units); lines that do not parse (a
    field reported as N/A) are left out. None without samples."""
    samples: dict[str, list[tuple[float, float, float, int]]] = {}
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5:
            continue
        try:
            index = str(int(fields[0]))
            sample = (float(fields[1]), float(fields[2]), float(fields[3]), int(fields[4], 16))
        except ValueError:
            continue
        samples.setdefault(index, []).append(sample)
    if not samples:
        return None
    return {index: {"sm_mhz": round(statistics.mean(s[0] for s in ss)),
                    "power_w": round(statistics.mean(s[1] for s in ss)),
                    "max_temp_c": max(s[2] for s in ss),
                    "limited": round(sum(bool(s[3] & LIMITS) for s in ss) / len(ss), 2),
                    "samples": len(ss)}
            for index, ss in sorted(samples.items(), key=lambda item: int(item[0]))}
