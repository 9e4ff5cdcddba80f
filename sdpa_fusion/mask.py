"""Bands: the sliding window, and what a band leaves of runs of queries and keys (``cut``).

Masks are aligned top-left (per sequence when packed): query i sees key j when j <= i
(causal) and ``i - left <= j <= i + right`` (window); kernels take the band that both make,
``band(causal, window)``. Composed masks are ``sdpa_fusion.masks``.
"""

from __future__ import annotations

import dataclasses

import torch

_UNBOUNDED = 1 << 60  # an unbounded side, as a number the band arithmetic keeps unbounded


@dataclasses.dataclass(frozen=True)
class Window:
    """A sliding-window band, top-left aligned: query i sees key j when
    ``i - left <= j <= i + right``; a side that is None is unbounded."""

    left: int | None = None
    right: int | None = None

    def __post_init__(self):
        for side in ("left", "right"):
            value = getattr(self, side)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 0):
                raise ValueError(f"window {side}={value!r} must be a non-negative integer or "
                                 f"None (unbounded)")

    @classmethod
    def of(cls, window) -> "Window | None":
        """None, a Window, or a (left, right) pair."""
        if window is None or isinstance(window, Window):
            return window
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(f"window={window!r} must be a (left, right) pair of token counts "
                             f"(None for unbounded), e.g. window=(4096, 0)") from None
        return cls(left, right)

    def band(self, causal: bool) -> tuple[int | None, int | None]:
        """(left, right) of this window combined with a causal mask."""
        right = self.right
        if causal:
            right = 0 if right is None else min(right, 0)
        return self.left, right


def band(causal: bool, window: "Window | None") -> tuple[int | None, int | None]:
    """(left, right) of the mask that ``causal`` and ``window`` make together (None: unbounded)."""
    return (window or Window()).band(causal)


def visible(n_q: int, n_k: int, band_: tuple[int | None, int | None], device=None):
    """Bool [n_q, n_k]: True where query i sees key j under the top-left ``band_`` (left, right)."""
    left, right = band_
    i = torch.arange(n_q, device=device).unsqueeze(1)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    seen = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left is not None:
        seen &= j >= i - left
    if right is not None:
        seen &= j <= i + right
    return seen


def visible_pairs(n_q: int, n_k: int, band_: tuple[int | None, int | None]) -> int:
    """How many (query, key) pairs of an n_q x n_k block the top-left ``band_`` lets through."""
    left, right = band_
    if n_q == 0 or n_k == 0:
        return 0
    i = torch.arange(n_q, dtype=torch.int64)
    low = (i - left).clamp_min(0) if left is not None else torch.zeros_like(i)
    high = (i + right).clamp_max(n_k - 1) if right is not None else torch.full_like(i, n_k - 1)
    return int((high - low + 1).clamp_min(0).sum())


def call_pairs(n_q: int, n_k: int, causal: bool, window: "Window | None") -> float:
    """Query-key pairs a call over ``n_q`` queries and ``n_k`` keys computes, as FLOPs count
    them: half of them when causal without a window, else those the band lets through."""
    if window is None:
        return n_q * n_k * (0.5 if causal else 1.0)
    return visible_pairs(n_q, n_k, band(causal, window))


@dataclasses.dataclass(frozen=True)
class Cut:
    """What a band leaves of runs of queries and keys (tensors, elementwise): the first
    ``row_cut`` rows and ``key_cut`` keys go, ``rows`` and ``keys`` stay (0: no call), seen
    through the window (``left``, ``right``) in their own rows, or unmasked where ``full``."""

    row_cut: torch.Tensor
    rows: torch.Tensor
    key_cut: torch.Tensor
    keys: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor
    full: torch.Tensor


def cut(n_q, n_k, offset, stride: int, mask) -> Cut:
    """The ``Cut`` of runs of ``n_q`` queries and ``n_k`` keys whose first positions differ by
    ``offset`` (query minus key; int64 tensors, elementwise) in steps of ``stride``, under
    the global band ``mask`` (left, right; None unbounded)."""
    left, right = (_UNBOUNDED if side is None else side for side in mask)
    low = torch.div(left - offset, stride, rounding_mode="floor")    # j >= i - low
    high = torch.div(right + offset, stride, rounding_mode="floor")  # j <= i + high
    empty = low + high < 0
    key_cut, row_cut = (-low).clamp(min=0), (-high).clamp(min=0)  # at most one is not 0
    low, high = low + key_cut - row_cut, high - key_cut + row_cut
    rows = torch.minimum(n_q - row_cut, n_k - key_cut + low).clamp(min=0)
    keys = torch.minimum(n_k - key_cut, rows + high).clamp(min=0)
    empty |= (rows == 0) | (keys == 0)
    rows, keys = rows.masked_fill(empty, 0), keys.masked_fill(empty, 0)
    full = (low >= rows - 1) & (high >= keys - 1)
    return Cut(row_cut, rows, key_cut, keys, low, high, full)
