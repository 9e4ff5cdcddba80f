"""The cost model of packed sequences: how long a kernel takes on them, by a few numbers.

A sequence of ``length`` tokens costs ``flops / rate`` seconds on the device, with
``rate(length) = peak * length / (length + half)`` (short sequences fill the GPU less), and
every kernel call ``host_s`` seconds on the host. A varlen call also pays ``sequence_s``
per sequence and head (2048 documents of 128 tokens run 3x slower in one varlen call than
their rate says). ``SPEEDS`` holds these per kernel and way ("dense": one call per problem,
"varlen": one call for a pack), fitted to ``benchmarks.thd`` on an H200 (bf16, 32 heads,
head dim 128, causal forward+backward, FA4 4.0.0b36); other kernels get ``DEFAULT_SPEED``.
"""

from __future__ import annotations

import dataclasses

from ..mask import call_pairs
from ..spec import FORWARD_AND_BACKWARD, AttentionSpec
from .base import Kernel


@dataclasses.dataclass(frozen=True)
class Speed:
    """How fast a kernel runs causal forward+backward (the module docstring's model): ``peak``
    FLOP/s, half of it at ``half`` tokens, ``host_s`` and ``sequence_s`` seconds."""

    peak: float
    half: int
    host_s: float
    sequence_s: float = 0.0

    def seconds(self, flops: float, length: int) -> float:
        return flops * (length + self.half) / (self.peak * length)

    def in_varlen(self, flops: float, length: int, heads: int) -> float:
        """Seconds of one sequence of ``heads`` query heads inside a varlen call."""
        return self.seconds(flops, length) + heads * self.sequence_s


# Fitted to benchmarks/results/thd.json (batches a, b, mix, c): FA4's varlen within 3% of
# a, b and mix, flash's within 2% of a and b (22% under on mix); both under on c (38-42%);
# per-sequence within 4% on a; padding 30% under on b. With them auto takes the way
# measured fastest on all four batches with FA4 installed.
SPEEDS = {
    ("cudnn", "dense"): Speed(556e12, 636, 350e-6),
    ("flash", "dense"): Speed(340e12, 530, 350e-6),
    ("flash", "varlen"): Speed(340e12, 530, 150e-6, 280e-9),
    ("fa4", "dense"): Speed(610e12, 636, 500e-6),
    ("fa4", "varlen"): Speed(623e12, 636, 300e-6, 320e-9),
}
DEFAULT_SPEED = Speed(300e12, 600, 300e-6)
COPY_BYTES_PER_S = 2.5e12


def speed(kernel: Kernel, way: str) -> Speed:
    """The ``Speed`` of ``kernel`` run one ``way`` ("dense" or "varlen")."""
    return SPEEDS.get((kernel.name, way), DEFAULT_SPEED)


def sequence_work(spec: AttentionSpec) -> list[tuple[int, float]]:
    """(length, forward+backward FLOPs) of every non-empty packed sequence of ``spec``."""
    per_pair = 4.0 * spec.heads * spec.head_dim * FORWARD_AND_BACKWARD
    return [(n, per_pair * call_pairs(n, n, spec.causal, spec.window))
            for _, n in spec.sequences() if n]


def per_sequence_seconds(kernel: Kernel, work) -> float:
    """Seconds of one dense call per sequence of ``work`` ((length, flops) pairs): host and
    device overlap, so each call costs the longer of the two."""
    s = speed(kernel, "dense")
    return sum(max(s.host_s, s.seconds(f, n)) for n, f in work)


def varlen_seconds(kernel: Kernel, work, heads: int) -> float:
    """Seconds of one varlen call over the sequences of ``work`` with ``heads`` query heads."""
    s = speed(kernel, "varlen")
    return s.host_s + sum(s.in_varlen(f, n, heads) for n, f in work)
