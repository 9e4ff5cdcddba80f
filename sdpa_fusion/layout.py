"""Memory layouts of attention tensors.

Every tensor handed to sdpa-fusion is seen through the logical shape [B, H, S, E]; the layout
says how that shape is laid out in memory:

- ``bhse``: a contiguous [B, H, S, E] buffer.
- ``bshe``: a contiguous [B, S, H, E] buffer viewed as [B, H, S, E] (``t.transpose(1, 2)``).
- ``thd``: a packed [T, H, E] buffer of several sequences, delimited by ``cu_seqlens``.
"""

from __future__ import annotations

import enum

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
            raise ValueError(f"layout={value!r} is not a known layout; use one of {known}") from None

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
        order = self.memory_order
        buffer = torch.empty([shape[d] for d in order], dtype=dtype, device=device)
        return buffer.permute(self.logical_order)

    def to(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of logical tensor ``t`` in this layout (``t`` itself when it already is)."""
        if has_layout(t, self):
            return t
        out = self.empty(t.shape, dtype=t.dtype, device=t.device)
        out.copy_(t)
        return out


def _inverse(order: tuple[int, ...]) -> list[int]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return inv


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


def check_layout(name: str, t: torch.Tensor, layout: Layout) -> None:
    """Raise a ValueError naming ``name`` unless ``t`` really has ``layout``."""
    if t.dim() != layout.ndim:
        want = "[T, H, E]" if layout.is_varlen else "[B, H, S, E]"
        raise ValueError(
            f"{name} has {t.dim()} dims (shape {list(t.shape)}) but layout={layout.value!r} "
            f"needs the logical shape {want}"
        )
    if not has_layout(t, layout):
        hint = {
            Layout.BHSE: "pass t.contiguous(), or layout='bshe' if it is a [B,S,H,E] buffer "
            "viewed as [B,H,S,E]",
            Layout.BSHE: "pass t.transpose(1, 2).contiguous().transpose(1, 2), or layout='bhse' "
            "for a contiguous [B,H,S,E] tensor",
            Layout.THD: "pass t.contiguous()",
        }[layout]
        raise ValueError(
            f"{name} (shape {list(t.shape)}, strides {list(t.stride())}) does not have the "
            f"layout {layout.value!r} it claims; {hint}"
        )


def check_cu_seqlens(name: str, cu_seqlens: torch.Tensor, total_tokens: int, *,
                     exact: bool = True) -> list[int]:
    """Validate cumulative sequence lengths of a packed tensor; return them as a list.

    ``exact``: the last entry must equal ``total_tokens`` (else it may be smaller, as the
    real ``cu_seqlens`` of sequences padded by ``cu_seqlens_padded`` are)."""
    if cu_seqlens is None:
        raise ValueError(f"layout='thd' needs {name}= (cumulative sequence lengths, int32 [N+1])")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(
            f"{name} must be a 1-D integer tensor [0, l0, l0+l1, ...] of at least 2 entries, "
            f"got shape {list(cu_seqlens.shape)} dtype {cu_seqlens.dtype}"
        )
    values = [int(x) for x in cu_seqlens.tolist()]
    check_offsets(name, values, total_tokens, exact=exact)
    return values


def check_offsets(name: str, values: list[int], total_tokens: int, *, exact: bool = True) -> None:
    """Raise a ValueError naming ``name`` unless ``values`` are cumulative sequence lengths
    [0, ..., T] of ``total_tokens`` = T tokens (ending at most at T when not ``exact``)."""
    if len(values) < 2:
        raise ValueError(f"{name}={values} needs at least 2 entries [0, l0, l0+l1, ...]")
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}={values} must start at 0 and never decrease")
    if values[-1] != total_tokens and (exact or values[-1] > total_tokens):
        raise ValueError(
            f"{name} ends at {values[-1]} but the packed tensor has {total_tokens} tokens; "
            f"the last entry must equal T" + ("" if exact else " or, with padding, not exceed it")
        )


def check_padding(cu_seqlens: list[int], cu_seqlens_padded: list[int]) -> None:
    """Raise a ValueError unless the padded slots ``cu_seqlens_padded`` hold one slot per
    sequence of ``cu_seqlens``, each at least as long as its sequence."""
    if len(cu_seqlens_padded) != len(cu_seqlens):
        raise ValueError(
            f"cu_seqlens_padded has {len(cu_seqlens_padded)} entries but "
            f"cu_seqlens has {len(cu_seqlens)}; give one entry per sequence plus one"
        )
    real, room = seqlens_of(cu_seqlens), seqlens_of(cu_seqlens_padded)
    if any(r > p for r, p in zip(real, room)):
        raise ValueError(
            f"cu_seqlens_padded={cu_seqlens_padded} leaves less room than the sequence lengths "
            f"{real} need; each padded length must be >= its sequence length"
        )


def seqlens_of(cu_seqlens: list[int]) -> list[int]:
    return [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]


def sequence_view(packed: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of a packed [T, H, E] tensor as a BSHE [1, H, s, E] view."""
    return packed[start:end].unsqueeze(0).transpose(1, 2)
