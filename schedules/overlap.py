"""What a cost model (``schedules.predict``) needs to know of a schedule beyond
``describe()``: how the transfers of its mesh dim meet the compute of a rank's step. A schedule
class states it as ``overlap = Overlap(...)``; one that states nothing gets ``Overlap()``, the
cautious reading: no transfer hidden, every call over all the keys, NCCL send/receive speed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Overlap:
    """How one mesh dim's transfers meet a rank's compute.

    hidden         the share of the step's compute that the transfers of P ranks can run
                   beside: (P - 1) / P for the ring, 1 / P for allgather
    splits_keys    each kernel call sees one rank's block of keys (S / P), not all S keys
    own_transport  the transfers go by the schedule's ``transport``, not NCCL collectives
    """

    hidden: Callable[[int], float] = lambda ranks: 0.0
    splits_keys: bool = False
    own_transport: bool = False


def overlap_of(cls: type) -> Overlap:
    """The ``Overlap`` that schedule class ``cls`` states, else the cautious default."""
    return getattr(cls, "overlap", None) or Overlap()
