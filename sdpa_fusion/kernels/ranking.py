"""The order in which ``auto`` tries kernels: fastest measured on this device first.

``measured_tflops.json`` (beside this module) holds the forward+backward TFLOP/s of every
kernel per device, head dim and causal flag, written by ``benchmarks.single_gpu`` (no figure
is typed by hand). A problem is looked up by ``lookup``; kernels the table does not list, and
devices it does not know, follow ``default_order``. All functions here are pure (no GPU
needed), so the ordering is tested on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

TABLE = Path(__file__).with_name("measured_tflops.json")


@dataclasses.dataclass(frozen=True)
class Device:
    """A GPU as the ranking sees it: its name and compute capability."""

    name: str
    capability: tuple[int, int]

    @property
    def sm(self) -> str:
        return "sm%d%d" % self.capability


@functools.cache
def gpu(device) -> Device:
    """The Device of CUDA device ``device`` (a torch.device), read once."""
    import torch

    return Device(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


@dataclasses.dataclass(frozen=True)
class Measured:
    """Forward+backward TFLOP/s of each kernel on one device for one (head dim, causal)."""

    device: str
    sm: str | None
    head_dim: int
    causal: bool
    tflops: tuple[tuple[str, float], ...]  # (kernel, TFLOP/s), fastest first

    @classmethod
    def from_json(cls, entry: dict) -> "Measured":
        ranked = sorted(entry["tflops"].items(), key=lambda item: -item[1])
        return cls(entry["device"], entry.get("sm"), int(entry["head_dim"]),
                   bool(entry["causal"]), tuple((k, float(v)) for k, v in ranked))

    def figure(self, kernel: str) -> float | None:
        return dict(self.tflops).get(kernel)


@functools.cache
def load_table(path: Path = TABLE) -> tuple[Measured, ...]:
    """The measurements in ``path`` (none when the file does not exist)."""
    path = Path(path)
    if not path.is_file():
        return ()
    return tuple(Measured.from_json(e) for e in json.loads(path.read_text())["entries"])


def default_order(capability: tuple[int, int]) -> tuple[str, ...]:
    """Kernels in the order ``auto`` tries them on a device the table does not know: cuDNN
    (fastest measured on Ampere and Hopper), FA4 (sm90+: no backward below), flash, nvFuser."""
    if capability[0] >= 9:
        return ("cudnn", "fa4", "flash", "nvfuser")
    return ("cudnn", "flash", "nvfuser")


def lookup(table, device: Device, head_dim: int, causal: bool) -> Measured | None:
    """The measurement that stands for this problem on ``device``: same device name (else
    same compute capability), same causal flag (else the other), nearest head dim (ties go
    to the larger); None when the table has nothing for the device."""
    same = [m for m in table if m.device == device.name] or [m for m in table if m.sm == device.sm]
    same = [m for m in same if m.causal == causal] or same
    if not same:
        return None
    return min(same, key=lambda m: (abs(m.head_dim - head_dim), -m.head_dim))


@dataclasses.dataclass(frozen=True)
class Ranking:
    """The kernels ``auto`` tries, in order, and the measurement (if any) behind the order."""

    order: tuple[str, ...]
    measured: Measured | None
    device: Device
    head_dim: int
    causal: bool

    def why(self, chosen: str, runners_up: list[str]) -> str:
        """One line saying why ``chosen`` won over ``runners_up`` (the others that can run
        the problem, in rank order)."""
        m = self.measured
        figure = m.figure(chosen) if m else None
        order = " > ".join(self.order)
        if m is None:
            return (f"auto chose {chosen}: nothing measured on {self.device.name} "
                    f"({self.device.sm}); first that runs this problem in the default order "
                    f"{order}")
        if figure is None:
            return (f"auto chose {chosen}: first that runs this problem in the order {order} "
                    f"(measured on {m.device} ({self._where(m)}), then the default order)")
        others = [f"{k} {m.figure(k):.0f}" for k in runners_up if m.figure(k) is not None]
        return (f"auto chose {chosen}: {figure:.0f} TFLOP/s measured on {m.device} "
                f"({self._where(m)})" + (f" vs {', '.join(others)}" if others else ""))

    def _where(self, m: Measured) -> str:
        parts = [f"hd {m.head_dim}" + ("" if m.head_dim == self.head_dim
                                        else f", nearest to {self.head_dim}"),
                 "causal" if m.causal else "not causal"]
        if m.causal != self.causal:
            parts[-1] += f", the {'causal' if self.causal else 'non-causal'} case is not measured"
        if m.device != self.device.name:
            parts.append(f"same {m.sm} as this {self.device.name}")
        parts.append("fwd+bwd")
        return ", ".join(parts)


def rank(table, device: Device, head_dim: int, causal: bool) -> Ranking:
    """Kernels of ``default_order(device)``, the measured ones first, fastest first."""
    default = default_order(device.capability)
    measured = lookup(table, device, head_dim, causal)
    figures = dict(measured.tflops) if measured else {}
    order = sorted(default,
                   key=lambda k: (k not in figures, -figures.get(k, 0.0), default.index(k)))
    return Ranking(tuple(order), measured, device, head_dim, causal)


def choose(ranking: Ranking, reasons: dict[str, str | None]) -> tuple[str | None, list[str], str]:
    """(chosen kernel or None, why each kernel ranked above it was skipped, why it was chosen)
    given every ranked kernel's ``unavailable_reason`` (None: it can run the problem)."""
    runnable = [k for k in ranking.order if reasons.get(k) is None]
    if not runnable:
        return None, [reasons[k] for k in ranking.order], ""
    chosen = runnable[0]
    skipped = [reasons[k] for k in ranking.order[:ranking.order.index(chosen)]]
    return chosen, skipped, ranking.why(chosen, runnable[1:])
