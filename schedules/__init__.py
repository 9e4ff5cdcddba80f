"""Multidevice schedules for sdpa-fusion, by name.

    sched = schedules.get("ring", mesh)            # options as keywords
    schedules.register(MySchedule)                 # a user's schedule, no edit of this package
"""

from __future__ import annotations

from . import batch  # noqa: F401  (schedules.batch: a model's batch over the ranks)
from .allgather import AllGather
from .base import Description, Schedule
from .head_parallel import HeadParallel
from .hybrid import Hybrid
from .replicated import Replicated
from .ring import Ring
from .ulysses import Ulysses

_REGISTRY: dict[str, type[Schedule]] = {}


def register(cls: type[Schedule]) -> type[Schedule]:
    """Make schedule class ``cls`` available as ``get(cls.name, ...)``; usable as a decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Schedule) and cls.name):
        raise ValueError(f"{cls!r} must be a Schedule subclass with a name")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str, mesh=None, **options) -> Schedule:
    """The schedule registered as ``name`` over ``mesh`` (its options as keywords)."""
    if name not in _REGISTRY:
        raise ValueError(f"schedule {name!r} is not known; choose one of {names()}")
    return _REGISTRY[name](mesh, **options)


for _cls in (Replicated, HeadParallel, Ring, AllGather, Ulysses, Hybrid):
    register(_cls)

__all__ = ["Description", "Schedule", "get", "names", "register"]
