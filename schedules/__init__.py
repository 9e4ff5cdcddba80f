"""Multidevice schedules for sdpa-fusion, by name.

    sched = schedules.get("ring", mesh)            # options as keywords; collective
    schedules.register(MySchedule)                 # a user's schedule, no edit of this package
"""

from __future__ import annotations

import inspect

from sdpa_fusion.agreement import agree
from sdpa_fusion.mesh import Mesh

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


def options(name: str) -> list[str]:
    """The keyword options schedule ``name`` takes (``get(name, mesh, **options)``)."""
    return sorted(_keywords(_class(name))[0])


def option_value(text: str) -> int | float | bool | str:
    """An option's value given as text: an int, a float or True/False where it is one, else
    the text."""
    if text.lstrip("-").isdigit():
        return int(text)
    if text in ("True", "False"):
        return text == "True"
    try:
        return float(text)
    except ValueError:
        return text


def get(name: str, mesh: Mesh | None = None, **options) -> Schedule:
    """The schedule registered as ``name`` over ``mesh``; collective: any rank's error (or
    differing configurations) raises the same ValueError on every rank."""
    schedule = error = None
    try:
        cls = _class(name)
        known, more = _keywords(cls)
        unknown = [] if more else sorted(set(options) - known)
        if unknown:
            raise ValueError(f"schedule {name!r} takes the options {sorted(known)}; "
                             f"{', '.join(map(repr, unknown))} "
                             f"{'is' if len(unknown) == 1 else 'are'} not among them")
        schedule = cls(mesh, **options)
    except Exception as e:  # noqa: BLE001 - every failure is agreed on
        error = e
    control = mesh.control_group() if isinstance(mesh, Mesh) else None
    fields = None if schedule is None else schedule.configuration_fields()
    agree(control, fields, error, what="schedules.get",
          fix="build it with the same name and options on every rank")
    return schedule


def _class(name: str) -> type[Schedule]:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"schedule {name!r} is not known; choose one of {names()}")
    return _REGISTRY[name]


def _keywords(cls: type[Schedule]) -> tuple[set[str], bool]:
    """Keyword-only parameters of ``cls.__init__``, and whether it takes ``**options`` too."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return ({p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY},
            any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters))


for _cls in (Replicated, HeadParallel, Ring, AllGather, Ulysses, Hybrid):
    register(_cls)

__all__ = ["Description", "Schedule", "get", "names", "options", "register"]
