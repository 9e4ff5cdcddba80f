"""Attention masks beyond causal: the sliding-window band.

Masks are aligned top-left (per sequence when packed): query i sees key j when j <= i
(causal) and ``i - left <= j <= i + right`` (window). Kernels take the band that a causal
flag and a window make together, ``band(causal, window)``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Window:
    """A sliding-window band, top-left aligned: query i sees key j when
    ``i - left <= j <= i + right``; a side that is None is unbounded."""

    left: int | None = None
    right: int | None = None

    def __post_init__(self):
        for side in ("left", "right"):
            value = getattr(self, side)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(
                    f"window {side}={value!r} must be a non-negative integer or None (unbounded)"
                )

    @classmethod
    def of(cls, window) -> "Window | None":
        """None, a Window, or a (left, right) pair."""
        if window is None or isinstance(window, Window):
            return window
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(
                f"window={window!r} must be a (left, right) pair of token counts (None for "
                f"unbounded), e.g. window=(4096, 0)"
            ) from None
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
