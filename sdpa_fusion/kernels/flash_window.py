"""Our top-left masks as the arguments of ATen's FlashAttention-2 (pure functions).

Flash aligns its masks bottom-right: in a block of n_q queries and n_k keys, query i sees key
j when ``i + s - window_left <= j <= i + s + window_right`` with ``s = n_k - n_q``. Our band
``(left, right)`` is top-left (s = 0). The two agree once the queries that see no key and the
keys no query sees are cut off (``flash_cut``) and the window is shifted by what remains of
``n_k - n_q`` (``flash_window``). Two habits of flash's argument handling matter (flash_api:
``mha_fwd``/``mha_varlen_fwd``, ``set_params_fprop``): a window at least the (max) key length
becomes unbounded (-1), and an unbounded side next to a bounded one becomes the (max) key
length. Both are right only when queries do not outnumber keys, so unbounded sides are
written as explicit sizes and the max key length passed is raised above both windows.
"""

from __future__ import annotations

import dataclasses
import functools

from .base import Seqlens


def flash_cut(n_q: int, n_k: int, mask: tuple[int | None, int | None]) -> tuple[int, int]:
    """(rows, keys): how many leading queries of an n_q x n_k block see a key under top-left
    ``mask``, and how many leading keys such a query sees ((0, 0) when none does)."""
    left, right = mask
    rows = n_q if left is None else max(0, min(n_q, n_k + left))
    keys = n_k if right is None else max(0, min(n_k, rows + right))
    return (rows, keys) if rows and keys else (0, 0)


@dataclasses.dataclass(frozen=True)
class FlashWindow:
    """Flash's mask arguments: ``causal``, the window sizes (-1: unbounded), and the least
    max key length to pass so that flash keeps them as they are."""

    causal: bool
    left: int
    right: int
    min_max_k: int = 0


def flash_window(mask, shift: int, max_rows: int, max_keys: int) -> FlashWindow:
    """The arguments with which flash computes top-left ``mask`` on cut blocks (``flash_cut``)
    that all have ``shift`` = keys - rows, at most ``max_rows`` rows and ``max_keys`` keys."""
    left, right = mask
    if left is None and right is None:
        return FlashWindow(False, -1, -1)
    if left is None and right == shift:
        return FlashWindow(True, -1, -1)
    # i + shift - w_left <= 0 for every row once w_left >= keys - 1: unbounded; likewise
    # i + shift + w_right >= keys - 1 once w_right >= rows - 1.
    w_left = max_keys - 1 if left is None else min(left + shift, max_keys - 1)
    w_right = max_rows - 1 if right is None else min(right - shift, max_rows - 1)
    return FlashWindow(False, w_left, w_right, max(w_left, w_right) + 1)


@dataclasses.dataclass(frozen=True)
class FlashCall:
    """One varlen flash call: the sequences as flash sees them (queries that see no key and
    keys no query sees split off as sequences of their own) and its mask arguments."""

    seqlens: Seqlens
    window: FlashWindow

    @property
    def max_q(self) -> int:
        # At least 2: with max_q == 1 and GQA, flash reshapes q for decoding as if every
        # sequence had one query, which fails for sequences without queries.
        return max(self.seqlens.max_q, 2)

    @property
    def max_k(self) -> int:
        return max(self.seqlens.max_k, self.window.min_max_k)


@functools.lru_cache(maxsize=64)
def flash_call(seqlens: Seqlens, t_q: int, t_k: int, mask) -> FlashCall | None:
    """The varlen call computing top-left ``mask`` over packed [t_q] queries and [t_k] keys,
    or None when masked sequences need different shifts. Tokens outside every sequence
    become sequences without keys (or queries): output 0, lse -inf, gradient 0."""
    cu_q, cu_k = [0], [0]

    def add(n_q, n_k):
        if n_q or n_k:
            cu_q.append(cu_q[-1] + n_q)
            cu_k.append(cu_k[-1] + n_k)

    def add_apart(n_q, n_k):
        add(n_q, 0)
        add(0, n_k)

    add_apart(seqlens.cu_q[0], seqlens.cu_k[0])
    cut = [flash_cut(n_q, n_k, mask) for n_q, n_k in zip(seqlens.lengths_q, seqlens.lengths_k)]
    for (n_q, n_k), (rows, keys) in zip(zip(seqlens.lengths_q, seqlens.lengths_k), cut):
        add(rows, keys)
        add_apart(n_q - rows, n_k - keys)
    add_apart(t_q - seqlens.cu_q[-1], t_k - seqlens.cu_k[-1])
    shifts = {keys - rows for rows, keys in cut if rows}
    if len(shifts) > 1 and mask != (None, None):
        return None
    window = flash_window(mask, shifts.pop() if shifts else 0, max([r for r, _ in cut] + [1]),
                          max([k for _, k in cut] + [1]))
    return FlashCall(Seqlens(tuple(cu_q), tuple(cu_k)), window)
