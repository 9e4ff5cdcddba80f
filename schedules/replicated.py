"""``replicated``: every rank holds the full q, k, v and computes the full attention.

Also the schedule of ``attention(..., schedule=None)`` (one device, no communication).
"""

from __future__ import annotations

from sdpa_fusion.local import local_backward, local_forward

from . import dry_run
from .base import Description, Schedule


class Replicated(Schedule):
    name = "replicated"
    sharded_dim = None

    def validate(self, spec):
        pass

    def forward(self, q, k, v, spec, kernel, dropout=None):
        return local_forward(kernel, q, k, v, spec, dropout)

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        return local_backward(kernel, dout, q, k, v, out, lse, spec, dropout)

    def describe(self, spec):
        return Description(
            self.name, self.size, steps=1, bytes_sent=0, bytes_received=0,
            flops=spec.flops(), backward_steps=1, backward_flops=spec.flops(backward=True) - spec.flops(),
            memory_of=dry_run.memory_of(self, spec))
