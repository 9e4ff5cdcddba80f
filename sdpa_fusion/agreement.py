"""The one agreement rule: the ranks that run a call together run the same call, or every one
of them raises the same ValueError.

A call describes itself as *fields*, names mapped to canonical text. On every call each rank
adds, over a gloo control group of the call's ranks, one all-reduce (MAX) of three int64:

    [h, -h, failed]     h: 62-bit hash of the fields; failed: 1 when this rank's checks raised

Every rank takes the same branch: max h == -max(-h) (all hashes equal) and no failure -> the
call goes on (no GPU synchronisation, no pickling). Otherwise the ranks gather their fields and
errors and each raises the same ValueError, built from the gathered values alone. A rank that
does not arrive within the mesh's timeout is named by ``MeshTimeout`` (``waiting``); the
control group is then unusable and says so on every later call.
"""

from __future__ import annotations

import ctypes
import datetime
import enum
import hashlib

import torch
import torch.distributed as dist

from .waiting import Arrivals, MeshTimeout, ranks_text


def canonical(value) -> str:
    """Text equal on every rank exactly when ``value`` is: objects by ``configuration()`` or
    their class and public attributes, tensors by dtype, shape and a hash of their contents."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, torch.Tensor):
        return f"tensor({str(value.dtype)[6:]}, {list(value.shape)}, {_tensor_digest(value)})"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        items = sorted((canonical(k), canonical(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    configuration = getattr(value, "configuration", None)
    if callable(configuration):
        return canonical(configuration())
    public = {k: v for k, v in vars(value).items() if not k.startswith("_")} \
        if hasattr(value, "__dict__") else {}
    return f"{type(value).__qualname__}{canonical(public)}"


def _tensor_digest(t: torch.Tensor) -> str:
    c = t.detach().to("cpu").contiguous()
    data = ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()) if c.numel() else b""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def fingerprint(fields: dict[str, str]) -> int:
    """A 62-bit hash of ``fields`` (names and values, in order), the same on every rank."""
    text = "\x1f".join(f"{name}\x1e{value}" for name, value in fields.items())
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


class ControlGroup:
    """A gloo group of ``ranks`` (mesh order), called ``name``, that agree on calls."""

    def __init__(self, group, ranks: list[int], timeout: datetime.timedelta, name: str):
        self.group, self.ranks, self.timeout, self.name = group, ranks, timeout, name
        self.calls = 0  # agreements so far: every rank of the group counts alike
        self._counts: dict[str, int] = {}  # agreements so far per kind of call
        self._arrivals = Arrivals(group.group_name, ranks, timeout)
        self._broken: str | None = None  # why the group can no longer be used

    @property
    def size(self) -> int:
        return len(self.ranks)

    def count(self, what: str) -> int:
        """Count an agreement on a call of kind ``what``: its number of that kind."""
        self.calls += 1
        self._counts[what] = self._counts.get(what, 0) + 1
        return self._counts[what]

    def all_reduce_max(self, t: torch.Tensor, what: str) -> None:
        """All-reduce ``t`` (CPU, in place) by MAX; a MeshTimeout naming the missing ranks."""
        self._check_usable(what)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        try:
            self._arrivals.wait(work, self.calls)
        except RuntimeError as e:
            raise self._timed_out(what, e) from e

    def gather(self, value, what: str) -> list:
        """Every rank's ``value`` (picklable) in the order of ``ranks``."""
        self._check_usable(what)
        values = [None] * self.size
        try:
            dist.all_gather_object(values, value, group=self.group)
        except RuntimeError as e:
            raise self._timed_out(what, e) from e
        return values

    def _check_usable(self, what: str) -> None:
        if self._broken is not None:
            raise MeshTimeout(f"{what}: the control group of {self.name} broke earlier "
                              f"({self._broken}); its ranks can no longer agree. Build a new mesh "
                              "with init_mesh(...) or restart")

    def _timed_out(self, what: str, error: BaseException) -> MeshTimeout:
        who = self._arrivals.missing(self.calls)
        self._broken = f"{what}: {who}"
        return MeshTimeout(f"{what} on {self.name}: {who}. Check that every rank makes the same "
                           "calls in the same order; raise the mesh's timeout with "
                           "init_mesh(timeout=...) if a rank is only slow. "
                           f"({type(error).__name__}: {error})")


def agree(control: ControlGroup | None, fields: dict[str, str] | None,
          error: BaseException | None, *, what: str, fix: str) -> int:
    """Go on when every rank of ``control`` has the same ``fields`` and no ``error``; else raise
    the same ValueError on every rank (``fix``: what to do when the ranks differ). Without a
    group of several ranks ``error`` is raised as it is. Returns this call's number among the
    ``what`` calls of the group (0 without one)."""
    if control is None or control.size == 1:
        if error is not None:
            raise error
        return 0
    number = control.count(what)
    fields = None if error is not None else {"call": what, **fields}
    digest = fingerprint(fields) if error is None else 0
    verdict = torch.tensor([digest, -digest, int(error is not None)], dtype=torch.int64)
    control.all_reduce_max(verdict, f"{what} call {number}")
    top, bottom, failed = verdict.tolist()
    if not failed and top == -bottom:
        return number
    gathered = control.gather((_message(error), fields), f"{what} call {number}")
    raise ValueError(_verdict(gathered, control, what, fix)) from error


def _message(error: BaseException | None) -> str | None:
    if error is None:
        return None
    text = str(error) or "(no message)"
    return text if isinstance(error, ValueError) else f"{type(error).__name__}: {text}"


def _verdict(gathered: list, control: ControlGroup, what: str, fix: str) -> str:
    """The error every rank raises, from every rank's (message, fields)."""
    messages: dict[str, list[int]] = {}
    for rank, (message, _) in zip(control.ranks, gathered):
        if message is not None:
            messages.setdefault(message, []).append(rank)
    if messages:
        return "; ".join(f"{ranks_text(rs, control.ranks)}: {m}" for m, rs in messages.items())
    fields = [f for _, f in gathered]
    if len({f["call"] for f in fields}) > 1:
        return (f"the ranks of {control.name} are not at the same call: "
                f"{_differing(['call'], fields, control.ranks)}; every rank must make the same "
                f"calls (attention, unshard, schedules.get) in the same order")
    names = list(dict.fromkeys(name for f in fields for name in f))
    return (f"{what} needs the same call on every rank of {control.name}, but the ranks differ "
            f"in {_differing(names, fields, control.ranks)}; {fix}")


def _differing(names: list[str], fields: list[dict], ranks: list[int]) -> str:
    """Each of ``names`` whose value differs between the ranks, with the values."""
    differing = []
    for name in names:
        values: dict[str, list[int]] = {}
        for rank, f in zip(ranks, fields):
            values.setdefault(f.get(name, "(absent)"), []).append(rank)
        if len(values) > 1:
            shown = " / ".join(f"{v if len(v) <= 200 else v[:197] + '...'} on "
                               f"{ranks_text(rs, ranks)}" for v, rs in values.items())
            differing.append(f"{name} ({shown})")
    return ", ".join(differing)
