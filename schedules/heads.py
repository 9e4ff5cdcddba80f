"""Head groups: a sequence schedule run over a few K/V heads (and their query heads) at a time.

Every buffer a sequence schedule allocates for its blocks scales with the heads it works on;
running it once per group of heads divides them all by the number of groups G, at G times as
many calls and transfers. Heads do not mix in attention, so every group computes exactly what
the whole call does for its heads (ring-flash-attention's llama3 ``heads_k_stride``).

    head_groups="auto"   the most groups that leave every group's kernel calls at least
                         ``MIN_GROUP_WORK`` query rows x heads (packed: rows of the longest
                         share of one sequence)
    head_groups=G        G groups; G divides the K/V heads

Group g of G holds K/V heads [g H_kv/G, (g+1) H_kv/G) and query heads [g H/G, (g+1) H/G).
"""

from __future__ import annotations

import dataclasses

MIN_GROUP_WORK = 1 << 19  # query rows x heads of a group's block (auto): 4 heads of 128K rows
PIPELINE_GROUPS = 2  # auto: the least groups of a call whose groups' transfers overlap kernels


def check_option(head_groups) -> int | str:
    """``head_groups`` when it is 'auto' or a positive int, else a ValueError."""
    if head_groups == "auto" or (isinstance(head_groups, int) and not isinstance(head_groups, bool)
                                 and head_groups >= 1):
        return head_groups
    raise ValueError(f"head_groups={head_groups!r} must be 'auto' or a positive integer "
                     f"(the number of K/V head groups run one after another)")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose(option, *, heads: int, kv_heads: int, rows: int, fits=lambda groups: True,
           least: int = 1) -> int:
    """The head groups of a call whose blocks have ``rows`` query rows (module docstring)."""
    if option != "auto":
        return option
    best = 1
    for groups in divisors(kv_heads):
        if fits(groups) and (heads // groups * rows >= MIN_GROUP_WORK or groups <= least):
            best = groups
    return best


def check_divides(groups: int, kv_heads: int, schedule: str) -> None:
    """A ValueError when ``groups`` does not divide ``kv_heads``."""
    if kv_heads % groups:
        raise ValueError(f"head_groups={groups} must divide the {kv_heads} K/V heads of schedule "
                         f"{schedule!r}; choose one of {divisors(kv_heads)} or 'auto'")


def contiguous(spec, groups: int) -> bool:
    """Whether a head group of a local tensor of ``spec`` is one contiguous buffer."""
    return groups == 1 or (spec.layout.value == "bhse" and spec.batch == 1)


@dataclasses.dataclass(frozen=True)
class HeadGroup:
    """The query heads ``q`` and K/V heads ``kv`` (slices) of group ``index``."""

    q: slice
    kv: slice
    index: int

    def of_q(self, t):
        """This group's query heads of a [B, H, ...] tensor (a view)."""
        return t[:, self.q]

    def of_kv(self, t):
        """This group's K/V heads of a [B, H_kv, ...] tensor (a view)."""
        return t[:, self.kv]


def groups_of(groups: int, heads: int, kv_heads: int) -> list[HeadGroup]:
    """The ``groups`` head groups of a problem of ``heads`` query and ``kv_heads`` K/V heads."""
    hq, hkv = heads // groups, kv_heads // groups
    return [HeadGroup(slice(g * hq, (g + 1) * hq), slice(g * hkv, (g + 1) * hkv), g)
            for g in range(groups)]
