"""Memory layouts of attention tensors, all seen through the logical shape [B, H, S, E]:

- ``bhse``: a contiguous [B, H, S, E] buffer.
- ``bshe``: a contiguous [B, S, H, E] buffer viewed as [B, H, S, E] (``t.transpose(1, 2)``).
- ``thd``: a packed [T, H, E] buffer of several sequences, delimited by ``cu_seqlens``.

``"auto"`` (``tensor_layout``) reads each tensor's layout from its dims and strides; an
explicit layout that a tensor's shape or strides contradict is a ValueError.
"""

from __future__ import annotations

import enum
import functools

import torch


class Layout(enum.Enum):
    BHSE = "bhse"
    BSHE = "bshe"
    THD = "thd"

    @classmethod
    def of(cls, value: "Layout | str") -> "Layout":
        """Accept a Layout or its name ("bhse", "bshe", "thd"), case-insensitive."""
        if isinstance(value, Layout):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            known = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"layout={value!r} is not a known layout; use one of {known} (or "
                             f"'auto': read from the tensors)") from None

    def __str__(self) -> str:
        return self.value

    @property
    def is_varlen(self) -> bool:
        return self is Layout.THD

    @property
    def stride_order(self) -> list[int]:
        """nvFuser stride order of the logical tensor (the highest number is the outermost dim)."""
        return {Layout.BHSE: [3, 2, 1, 0], Layout.BSHE: [3, 1, 2, 0], Layout.THD: [2, 1, 0]}[self]

    @property
    def memory_order(self) -> tuple[int, ...]:
        """Logical dims from outermost to innermost in memory."""
        return {Layout.BHSE: (0, 1, 2, 3), Layout.BSHE: (0, 2, 1, 3), Layout.THD: (0, 1, 2)}[self]

    @property
    def logical_order(self) -> list[int]:
        """The permutation that views a buffer in memory order as the logical tensor."""
        return _inverse(self.memory_order)

    @property
    def seq_dim(self) -> int:
        """The logical dim that indexes tokens (S, or T for packed tensors)."""
        return 0 if self is Layout.THD else 2

    @property
    def head_dim(self) -> int:
        """The logical dim that indexes heads."""
        return 1

    @property
    def ndim(self) -> int:
        return 3 if self is Layout.THD else 4

    def empty(self, shape, *, dtype, device) -> torch.Tensor:
        """An uninitialized tensor of logical ``shape`` laid out in this layout."""
        buffer = torch.empty([shape[d] for d in self.memory_order], dtype=dtype, device=device)
        return buffer.permute(self.logical_order)

    def to(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of logical tensor ``t`` in this layout (``t`` itself when it already is)."""
        if t.dim() != self.ndim:
            raise ValueError(f"a tensor of {t.dim()} dims (shape {list(t.shape)}) has no layout "
                             f"{self.value!r}, which takes "
                             f"{'[T, H, E]' if self is Layout.THD else '[B, H, S, E]'} tensors; a "
                             "model's [B, S, ...] batch tensors go through schedules.batch")
        if has_layout(t, self):
            return t
        return self.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _inverse(order: tuple[int, ...]) -> list[int]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return inv


def exact_strides(t: torch.Tensor, memory_order) -> torch.Tensor:
    """Dense ``t`` (dims nested in ``memory_order``) as a view whose size-1 dims have the strides
    of that order too: torch leaves them free, nvFuser checks them against a fusion's contiguity."""
    strides, expected = [0] * t.dim(), 1
    for d in reversed(memory_order):
        strides[d] = expected
        expected *= t.shape[d]
    if list(t.stride()) == strides:
        return t
    return t.as_strided(t.shape, strides, t.storage_offset())


def has_layout(t: torch.Tensor, layout: Layout) -> bool:
    """Whether ``t`` is dense with its dims nested in ``layout``'s memory order."""
    if t.dim() != layout.ndim:
        return False
    expected = 1
    for d in reversed(layout.memory_order):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _is_auto(layout) -> bool:
    return isinstance(layout, str) and layout.lower() == "auto"


def layout_of(t: torch.Tensor) -> Layout:
    """BSHE when the heads of logical [B, H, S, E] ``t`` are inner to its tokens, else BHSE."""
    bshe = t.shape[1] > 1 and t.shape[2] > 1 and t.stride(1) < t.stride(2)
    return Layout.BSHE if bshe else Layout.BHSE


def tensor_layout(name: str, t: torch.Tensor, layout: "Layout | str") -> Layout:
    """The layout of tensor ``t`` (``name`` in errors): ``layout``, checked against t, or for
    ``"auto"`` read from t: THD for a 3-D tensor, else by memory order (``layout_of``)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if _is_auto(layout):
        if t.dim() not in (3, 4):
            raise ValueError(f"{name} has {t.dim()} dims (shape {list(t.shape)}); attention "
                             "tensors are logical [B, H, S, E] (layout 'bhse' or 'bshe') or "
                             "packed [T, H, E] (layout 'thd'). Shard a model's [B, S, ...] batch "
                             "tensors with schedules.batch")
        return Layout.THD if t.dim() == 3 else layout_of(t)
    layout = Layout.of(layout)
    check_layout(name, t, layout)
    return layout


def shard_layout(t: torch.Tensor, layout: "Layout | str") -> Layout:
    """The layout in which ``schedule.shard``/``unshard`` read ``t``: ``tensor_layout`` for
    dense layouts and "auto"; 'thd' takes packed [T, ...] tensors of any trailing dims."""
    if not _is_auto(layout) and Layout.of(layout) is Layout.THD:
        return Layout.THD
    return tensor_layout("t", t, layout)


def unshard_layout(t, layout: "Layout | str") -> Layout:
    """The layout in which ``schedule.unshard`` returns the full tensor: ``layout``, or for
    "auto" the local part's (BHSE for no attention tensor: the agreed gather reports it)."""
    if not _is_auto(layout):
        return Layout.of(layout)
    if isinstance(t, torch.Tensor) and t.dim() in (3, 4):
        return Layout.THD if t.dim() == 3 else layout_of(t)
    return Layout.BHSE


def check_layout(name: str, t: torch.Tensor, layout: Layout) -> None:
    """Raise a ValueError naming ``name`` unless ``t`` really has ``layout``."""
    if t.dim() != layout.ndim:
        want = "[T, H, E]" if layout.is_varlen else "[B, H, S, E]"
        raise ValueError(f"{name} has {t.dim()} dims (shape {list(t.shape)}) but "
                         f"layout={layout.value!r} needs the logical shape {want}")
    if not has_layout(t, layout):
        hint = {
            Layout.BHSE: "pass t.contiguous(), or layout='bshe' if it is a [B,S,H,E] buffer "
            "viewed as [B,H,S,E]",
            Layout.BSHE: "a [B,S,H,E] tensor is passed as t.transpose(1, 2) (its logical "
            "[B,H,S,E] view); pass layout='bhse' for a contiguous [B,H,S,E] tensor, or 'auto'",
            Layout.THD: "pass t.contiguous()",
        }[layout]
        raise ValueError(f"{name} (shape {list(t.shape)}, strides {list(t.stride())}) does not "
                         f"have the layout {layout.value!r} it claims; {hint}")


def check_cu_seqlens(name: str, cu_seqlens, total_tokens: int, *, device=None,
                     exact: bool = True) -> list[int]:
    """``cu_seqlens_values`` of a packed tensor, checked by ``check_offsets``."""
    values = cu_seqlens_values(name, cu_seqlens, device)
    check_offsets(name, values, total_tokens, exact=exact)
    return values


def cu_seqlens_values(name: str, cu_seqlens, device=None) -> list[int]:
    """The values of ``cu_seqlens`` (ints, or an int32/int64 tensor on the CPU or ``device``),
    read on every call: a buffer refilled in place must not serve its old packing."""
    if cu_seqlens is None:
        raise ValueError(f"layout='thd' needs {name}= (cumulative sequence lengths, int32 [N+1])")
    if isinstance(cu_seqlens, (list, tuple)):
        plain = set(map(type, cu_seqlens)) <= {int}  # one pass in C (a pack of many sequences)
        if not plain and not all(isinstance(x, int) and not isinstance(x, bool)
                                 for x in cu_seqlens):
            raise ValueError(f"{name}={_show(list(cu_seqlens))} must hold Python ints")
        return list(cu_seqlens)
    if isinstance(cu_seqlens, torch.Tensor):
        return _tensor_values(name, cu_seqlens, device)
    raise ValueError(f"{name} must be an int32/int64 tensor or a list of ints, got "
                     f"{type(cu_seqlens).__name__}")


def _tensor_values(name: str, t: torch.Tensor, device) -> list[int]:
    if t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"{name} must be a 1-D integer tensor [0, l0, l0+l1, ...] of at least 2 "
                         f"entries, got shape {list(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must hold int32 or int64 offsets, got dtype {t.dtype}; pass "
                         f"torch.tensor([0, l0, l0+l1, ...], dtype=torch.int32)")
    if device is not None and t.device.type != "cpu" and t.device != torch.device(device):
        raise ValueError(f"{name} is on {t.device} but q, k, v are on {device}; pass "
                         f"{name}.to(q.device) (or a Python list of ints or a CPU tensor, which "
                         "need no device sync)")
    return [int(x) for x in t.tolist()]


def check_offsets(name: str, values: list[int], total_tokens: int, *, exact: bool = True) -> None:
    """Raise a ValueError naming ``name`` unless ``values`` are offsets [0, ..., T] of T =
    ``total_tokens`` (at most T when not ``exact``); offsets that passed are remembered."""
    _checked_offsets(name, tuple(values), total_tokens, exact)


@functools.lru_cache(maxsize=64)
def _checked_offsets(name: str, offsets: tuple[int, ...], total_tokens: int, exact: bool) -> None:
    values = list(offsets)
    if len(values) < 2:
        raise ValueError(f"{name}={values} needs at least 2 entries [0, l0, l0+l1, ...]")
    if values[0] != 0:
        raise ValueError(f"{name}={_show(values)} must start at 0 (the first sequence starts at "
                         "token 0); prepend 0")
    for i, (a, b) in enumerate(zip(values, values[1:]), start=1):
        if b < a:
            raise ValueError(f"{name}={_show(values)} must never decrease, but entry {i} ({b}) is "
                             f"below entry {i - 1} ({a}); give the running sum of the sequence "
                             "lengths with a leading 0")
    if values[-1] != total_tokens and (exact or values[-1] > total_tokens):
        raise ValueError(f"{name} ends at {values[-1]} but the packed tensor has {total_tokens} "
                         "tokens; the last entry must equal T"
                         + ("" if exact else " or, with padding, not exceed it"))


def check_padding(cu_seqlens: list[int], cu_seqlens_padded: list[int]) -> None:
    """Raise a ValueError unless ``cu_seqlens_padded`` holds one slot per sequence of
    ``cu_seqlens``, each at least as long as its sequence (remembered, as ``check_offsets``)."""
    _checked_padding(tuple(cu_seqlens), tuple(cu_seqlens_padded))


@functools.lru_cache(maxsize=64)
def _checked_padding(cu_seqlens: tuple[int, ...], cu_seqlens_padded: tuple[int, ...]) -> None:
    if len(cu_seqlens_padded) != len(cu_seqlens):
        raise ValueError(f"cu_seqlens_padded has {len(cu_seqlens_padded)} entries but "
                         f"cu_seqlens has {len(cu_seqlens)}; give one entry per sequence plus one")
    real, room = seqlens_of(cu_seqlens), seqlens_of(cu_seqlens_padded)
    i = next((i for i, (r, p) in enumerate(zip(real, room)) if r > p), None)
    if i is not None:
        raise ValueError(f"cu_seqlens_padded leaves sequence {i} room for {room[i]} tokens but "
                         f"cu_seqlens gives it {real[i]}; each padded length "
                         "(cu_seqlens_padded[i+1] - cu_seqlens_padded[i]) must be >= the "
                         "sequence's length")


def _show(values: list, most: int = 12) -> str:
    """A list as text, its middle elided when long."""
    if len(values) <= most:
        return str(values)
    return f"[{', '.join(map(str, values[:6]))}, ..., {', '.join(map(str, values[-3:]))}]"


def seqlens_of(cu_seqlens: list[int]) -> list[int]:
    return [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
