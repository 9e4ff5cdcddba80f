"""Random composed masks for tests: a description (nested tuples) drawn by hypothesis, the
package's mask built from it, and the boolean mask built here from the definitions alone
(it shares no code with the package).

    ("causal",) ("window", left, right) ("docs", ids [B, S]) ("prefix", n) ("spans", [(a, z)])
    ("chunk", size) ("mod", kind, m) ("and", x, y) ("or", x, y) ("not", x)
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from sdpa_fusion import masks

# mask_mods, written as a user would (b, h, q, k broadcast; elementwise ops)
MODS = {
    "stride": lambda m: lambda b, h, q, k: (q - k) % m == 0,
    "sink": lambda m: lambda b, h, q, k: (k <= q) & ((k < m) | (q - k < m)),
    "batch": lambda m: lambda b, h, q, k: (k <= q + b * m) & (k >= q - m),
}


def built(d) -> masks.Mask:
    """The package's mask of description ``d``."""
    kind = d[0]
    if kind in ("and", "or"):
        x, y = built(d[1]), built(d[2])
        return x & y if kind == "and" else x | y
    return {
        "causal": lambda: masks.causal(),
        "window": lambda: masks.window(d[1], d[2]),
        "docs": lambda: masks.document_ids(d[1]),
        "prefix": lambda: masks.prefix(d[1]),
        "spans": lambda: masks.bidirectional_spans(d[1]),
        "chunk": lambda: masks.chunked(d[1]),
        "mod": lambda: masks.mask_mod(MODS[d[1]](d[2])),
        "not": lambda: ~built(d[1]),
    }[kind]()


def boolean(d, b: int, n_q: int, n_k: int) -> torch.Tensor:
    """[n_q, n_k] bool of description ``d`` for batch element (packed: sequence) ``b``."""
    q = torch.arange(n_q).unsqueeze(1)
    k = torch.arange(n_k).unsqueeze(0)
    kind = d[0]
    if kind == "and":
        return boolean(d[1], b, n_q, n_k) & boolean(d[2], b, n_q, n_k)
    if kind == "or":
        return boolean(d[1], b, n_q, n_k) | boolean(d[2], b, n_q, n_k)
    if kind == "not":
        return ~boolean(d[1], b, n_q, n_k)
    if kind == "causal":
        return k <= q
    if kind == "window":
        seen = torch.ones(n_q, n_k, dtype=torch.bool)
        if d[1] is not None:
            seen &= k >= q - d[1]
        if d[2] is not None:
            seen &= k <= q + d[2]
        return seen
    if kind == "docs":  # one row of ids: the same for every batch element
        ids = d[1][b if len(d[1]) > 1 else 0]
        return (ids[:n_q].unsqueeze(1) == ids[:n_k].unsqueeze(0)) & (ids[:n_q] >= 0).unsqueeze(1)
    if kind == "prefix":
        return (q < d[1]) & (k < d[1])
    if kind == "spans":
        seen = torch.zeros(n_q, n_k, dtype=torch.bool)
        for a, z in d[1]:
            seen |= (q >= a) & (q < z) & (k >= a) & (k < z)
        return seen
    if kind == "chunk":
        return q // d[1] == k // d[1]
    m = d[2]
    if d[1] == "stride":
        return (q - k) % m == 0
    if d[1] == "sink":
        return (k <= q) & ((k < m) | (q - k < m))
    return (k <= q + b * m) & (k >= q - m)


def leaf(length: int, batch: int, *, windows: bool = True, mods: bool = True):
    """A strategy of one mask piece over sequences of ``length`` positions."""
    pos = st.integers(0, length)
    spans = st.lists(st.tuples(st.integers(0, length - 1), st.integers(1, length // 2)),
                     max_size=3).map(_disjoint)
    docs = st.lists(st.integers(1, length), min_size=1, max_size=4).map(
        lambda cuts: _documents(cuts, batch, length))
    options = [st.just(("causal",)), st.tuples(st.just("prefix"), pos),
               st.tuples(st.just("spans"), spans), st.tuples(st.just("docs"), docs),
               st.tuples(st.just("chunk"), st.integers(1, length))]
    if windows:
        side = st.one_of(st.none(), st.integers(0, length // 2))
        options.append(st.tuples(st.just("window"), side, side))
    if mods:
        options.append(st.tuples(st.just("mod"), st.sampled_from(sorted(MODS)),
                                 st.integers(1, 5)))
    return st.one_of(options)


def description(length: int, batch: int, **kw):
    """A strategy of composed masks of up to three pieces."""
    one = leaf(length, batch, **kw)
    op = st.sampled_from(["and", "or"])
    return st.one_of(one, st.tuples(op, one, one), st.tuples(op, st.tuples(op, one, one), one))


def _disjoint(spans):
    kept, end = [], 0
    for a, n in sorted(spans):
        if a >= end:
            kept.append((a, a + n))
            end = a + n
    return kept


def _documents(cuts, batch: int, length: int) -> torch.Tensor:
    """[batch, length] document ids: element b's documents end at the cuts shifted by b."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        for c in sorted(cuts):
            ids[b, (c + b) % length:] += 1
    return ids
