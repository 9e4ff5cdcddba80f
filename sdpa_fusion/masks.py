"""Attention masks that compose: ``causal() & document_ids(ids) | bidirectional_spans(spans)``.

A mask says whether the query at position q of batch element b (the sequence, when packed)
sees the key at position k. Positions count from 0 in each sequence (top-left, as ``causal``
and ``window`` do). The pieces:

    causal()                   k <= q
    window(left, right)        q - left <= k <= q + right (None: unbounded)
    document_ids(ids)          ids[b, q] == ids[b, k] (ids [S] or [B, S]; -1: sees nothing)
    prefix(n)                  q < n and k < n (a bidirectional prefix: ``causal() | prefix(n)``)
    bidirectional_spans(s)     q and k in the same span [start, stop) of ``s`` (image tokens:
                               ``causal() | bidirectional_spans(s)``; a list per b allowed)
    chunked(size)              q // size == k // size (Llama 4: ``causal() & chunked(8192)``)
    mask_mod(fn)               fn(b, h, q, k), FlexAttention's signature: the general case

joined by ``&`` (and), ``|`` (or) and ``~`` (not). Every piece but ``mask_mod`` is
*structured*: over a segment of queries and one of keys whose document, span, chunk and
prefix classes do not change, it keeps an interval of k - q (causal, a window, everything or
nothing), so a mask compiles to kernel calls on bands (``sdpa_fusion.masked``); a
``mask_mod`` is evaluated per tile. ``fn`` gets int64 tensors that broadcast (b and h as
0-d tensors or columns, q a column, k a row) and returns a bool tensor, with elementwise
torch ops; masks that vary over heads are not supported (h is 0). A mask is a value: it
copies the ids, lengths and spans it is given (a mask_mod's ``fn`` is its own: build a new
mask rather than change what it reads in place).
"""

from __future__ import annotations

import collections
import copy
import hashlib

import torch

from .mask import _UNBOUNDED as INF, Window  # INF: an unbounded side of an interval of k - q
_EMPTY = (2 * INF, 2 * INF - 1)  # an empty interval, sorted after every real one


_SELECTIONS_KEPT = 8  # the parts of a batch whose ``select`` a mask keeps


class Mask:
    """A composable attention mask; see the module docstring."""

    structured = True  # compiles to bands (no mask_mod inside)
    needs_window = False  # some kernel call may need a sliding window
    classed = False  # compares classes of tokens (``classes``)
    batched = False  # may differ between batch elements (packed: sequences)

    def __and__(self, other: "Mask") -> "Mask":
        return _Node("and", (self, _checked(other, "&")))

    def __or__(self, other: "Mask") -> "Mask":
        return _Node("or", (self, _checked(other, "|")))

    def __invert__(self) -> "Mask":
        return _Node("not", (self,))

    def leaves(self) -> list["Mask"]:
        return [self]

    def select(self, seqs) -> "Mask":
        """This mask over the batch elements ``seqs`` of a larger batch (element i here is
        element ``seqs[i]`` there; packed: sequences), for a part of the batch numbered
        from 0; itself when it does not differ between batch elements (made once per
        ``seqs``)."""
        seqs = tuple(int(i) for i in seqs)
        if not self.batched or not seqs:
            return self
        kept = self.__dict__.setdefault("_selected", collections.OrderedDict())
        if seqs not in kept:
            kept[seqs] = self._select(torch.tensor(seqs))
            while len(kept) > _SELECTIONS_KEPT:
                kept.popitem(last=False)
        return kept[seqs]

    def _select(self, seqs: torch.Tensor) -> "Mask":
        """``select`` of a mask that differs between batch elements."""
        raise NotImplementedError

    def classes(self, b: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
        """Class of every token (b[i], pos[i]) (1-D tensors) for masks that compare classes,
        else None."""
        return None

    def intervals(self, cls: dict):
        """(lo, hi) [..., K]: the intervals of k - q kept between segments of queries and keys,
        ``cls[id(leaf)]`` = (query classes [Nq, 1], key classes [1, Nk]) of every leaf."""
        raise NotImplementedError

    def visible(self, b, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Bool: whether query position ``q`` (a column) sees key position ``k`` (a row) of
        batch element ``b`` (a 0-d tensor or a column)."""
        raise NotImplementedError

    def check(self, batch: int, length: int) -> None:
        """A ValueError when the mask cannot describe ``batch`` sequences of up to ``length``
        positions."""
        for leaf in self.leaves():
            leaf._check(batch, length)

    def _check(self, batch: int, length: int) -> None:
        return None

    def band(self):
        """(causal, (left, right) or None) when the mask is only causal and/or a window (the
        schedules' plain paths run it), else None."""
        return None


def _checked(other, op: str) -> Mask:
    if not isinstance(other, Mask):
        raise ValueError(f"masks combine with masks by {op}, not with {type(other).__name__}; "
                         f"build it with sdpa_fusion.masks (e.g. masks.causal())")
    return other


class _Node(Mask):
    def __init__(self, op: str, parts: tuple):
        self.op, self.parts = op, parts
        self.structured = all(p.structured for p in parts)
        self.needs_window = op == "not" or any(p.needs_window for p in parts)
        self.batched = any(p.batched for p in parts)

    def leaves(self):
        return [leaf for p in self.parts for leaf in p.leaves()]

    def _select(self, seqs):
        return _Node(self.op, tuple(p.select(seqs) for p in self.parts))

    def intervals(self, cls):
        got = [p.intervals(cls) for p in self.parts]
        if self.op == "not":  # the gaps between the sorted intervals, and past the ends
            lo, hi = _normal(*got[0])
            starts = torch.cat([torch.full_like(lo[..., :1], -INF), hi + 1], -1)
            stops = torch.cat([lo - 1, torch.full_like(hi[..., :1], INF)], -1).clamp(max=INF)
            return _normal(starts, stops)
        (lo_a, hi_a), (lo_b, hi_b) = got
        if self.op == "or":
            return _normal(torch.cat(torch.broadcast_tensors(lo_a, lo_b), -1),
                           torch.cat(torch.broadcast_tensors(hi_a, hi_b), -1))
        lo = torch.maximum(lo_a.unsqueeze(-1), lo_b.unsqueeze(-2))
        hi = torch.minimum(hi_a.unsqueeze(-1), hi_b.unsqueeze(-2))
        return _normal(lo.flatten(-2), hi.flatten(-2))

    def visible(self, b, q, k):
        seen = [p.visible(b, q, k) for p in self.parts]
        if self.op == "not":
            return ~seen[0]
        return seen[0] & seen[1] if self.op == "and" else seen[0] | seen[1]

    def band(self):
        if self.op != "and":
            return None
        bands = [p.band() for p in self.parts]
        if None in bands:
            return None
        causal = any(c for c, _ in bands)
        sides = [w for _, w in bands if w is not None]
        if not sides:
            return causal, None
        left = min((w[0] for w in sides if w[0] is not None), default=None)
        right = min((w[1] for w in sides if w[1] is not None), default=None)
        return causal, (left, right)

    def __repr__(self):
        if self.op == "not":
            return f"~{self.parts[0]!r}"
        return f"({self.parts[0]!r} {'&' if self.op == 'and' else '|'} {self.parts[1]!r})"


def _normal(lo: torch.Tensor, hi: torch.Tensor):
    """The union of the intervals [lo, hi] along the last dim, as sorted disjoint intervals
    (touching ones joined; empty slots at the end; slots empty everywhere dropped)."""
    empty = lo > hi
    lo, hi = lo.masked_fill(empty, _EMPTY[0]), hi.masked_fill(empty, _EMPTY[1])
    lo, order = lo.sort(-1)
    hi = hi.gather(-1, order)
    reach = hi.cummax(-1).values
    start = torch.ones_like(empty)
    start[..., 1:] = lo[..., 1:] > reach[..., :-1] + 1
    group = start.long().cumsum(-1) - 1
    new_lo = torch.full_like(lo, _EMPTY[0]).scatter_reduce(-1, group, lo, "amin")
    new_hi = torch.full_like(hi, -INF).scatter_reduce(-1, group, hi, "amax")
    new_hi = torch.where(new_lo == _EMPTY[0], _EMPTY[1], new_hi)
    kept = (new_lo <= new_hi).flatten(0, -2).any(0) if lo.dim() > 1 else new_lo <= new_hi
    if not bool(kept.any()):
        return new_lo[..., :1], new_hi[..., :1]
    return new_lo[..., kept], new_hi[..., kept]


class _Causal(Mask):
    def intervals(self, cls):
        return torch.tensor([-INF]), torch.tensor([0])

    def visible(self, b, q, k):
        return k <= q

    def band(self):
        return True, None

    def __repr__(self):
        return "causal()"


class _Window(Mask):
    needs_window = True

    def __init__(self, left, right):
        Window(left, right)  # checks the sides
        self.left, self.right = left, right

    def intervals(self, cls):
        return (torch.tensor([-INF if self.left is None else -self.left]),
                torch.tensor([INF if self.right is None else self.right]))

    def visible(self, b, q, k):
        seen = torch.ones_like(q >= k)
        if self.left is not None:
            seen = seen & (k >= q - self.left)
        if self.right is not None:
            seen = seen & (k <= q + self.right)
        return seen

    def band(self):
        return False, (self.left, self.right)

    def __repr__(self):
        return f"window({self.left}, {self.right})"


class _Classes(Mask):
    """Query and key see each other when they have one class, and it is not negative."""

    classed = True
    what = ""  # the maker's name, for errors

    def _check(self, batch, length):
        if len(self._table) not in (1, batch):
            raise ValueError(f"{self.what} has {len(self._table)} rows but the call has {batch} "
                             f"batch elements (packed: sequences); give one row, or one per "
                             f"batch element")

    rows = ()  # the attributes holding one row per batch element (``_table`` is the first)

    @property
    def batched(self):
        return len(self._table) > 1

    def _select(self, seqs):
        picked = copy.copy(self)
        picked.__dict__.pop("_selected", None)
        for name in self.rows:
            setattr(picked, name, getattr(self, name)[seqs])
        picked._table = getattr(picked, self.rows[0])
        return picked

    def intervals(self, cls):
        c_q, c_k = cls[id(self)]
        same = ((c_q == c_k) & (c_q >= 0)).unsqueeze(-1)
        return torch.where(same, -INF, _EMPTY[0]), torch.where(same, INF, _EMPTY[1])

    def visible(self, b, q, k):
        c_q, c_k = self._at(b, q), self._at(b, k)
        return (c_q == c_k) & (c_q >= 0)

    def _at(self, b, pos):
        b, pos = torch.broadcast_tensors(torch.as_tensor(b), pos)
        return self.classes(b.reshape(-1), pos.reshape(-1)).reshape(pos.shape)


def _per_batch(values, what: str, fix: str) -> torch.Tensor:
    try:
        t = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{what}={values!r} must be {fix}") from None
    if t.dtype in (torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64) \
            or t.dim() > 2 or t.numel() == 0:
        raise ValueError(f"{what} must be {fix}, got a {t.dtype} tensor of shape {list(t.shape)}")
    return t.cpu().long().clone()  # the mask's own: plans made of it stay right


def _rows(t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The rows of ``t`` [B', ...] of the batch elements ``b`` (the one row when B' = 1)."""
    return t[torch.zeros_like(b) if len(t) == 1 else b]


class _Documents(_Classes):
    what = "document_ids"
    rows = ("ids",)

    def __init__(self, ids):
        ids = _per_batch(ids, "document_ids", "an int tensor [S] or [B, S] of document ids")
        self.ids = self._table = ids if ids.dim() == 2 else ids.unsqueeze(0)

    def classes(self, b, pos):
        return self.ids[torch.zeros_like(b) if len(self.ids) == 1 else b, pos]

    def _check(self, batch, length):
        super()._check(batch, length)
        if self.ids.shape[1] < length:
            raise ValueError(f"document_ids has {self.ids.shape[1]} positions but sequences "
                             f"have up to {length}; give an id to every position")

    def __repr__(self):
        return f"document_ids({_digest(self.ids)})"


class _Spans(_Classes):
    what = "bidirectional_spans"
    rows = ("starts", "stops")

    def __init__(self, spans):
        rows = spans if any(isinstance(r, (list, tuple)) and (not r or isinstance(
            r[0], (list, tuple))) for r in spans) else [spans]  # one list per b (some empty)
        width = max((len(r) for r in rows), default=0) or 1
        self.starts = torch.full((len(rows), width), INF)
        self.stops = torch.full((len(rows), width), INF)
        for i, row in enumerate(rows):
            row = sorted(_span(s) for s in row)
            for j, (a, z) in enumerate(row):
                if j and a < row[j - 1][1]:
                    raise ValueError(f"bidirectional_spans overlap: {row[j - 1]} and {(a, z)}; "
                                     f"join them into one span")
                self.starts[i, j], self.stops[i, j] = a, z
        self._table = self.starts

    def classes(self, b, pos):
        starts, stops = _rows(self.starts, b), _rows(self.stops, b)
        at = torch.searchsorted(starts.contiguous(), pos.unsqueeze(-1).contiguous(),
                                right=True).squeeze(-1) - 1
        inside = (at >= 0) & (pos < stops.gather(-1, at.clamp(min=0).unsqueeze(-1)).squeeze(-1))
        return torch.where(inside, at, -1)

    def __repr__(self):
        return f"bidirectional_spans({_digest(torch.stack([self.starts, self.stops]))})"


def _span(s) -> tuple[int, int]:
    try:
        a, z = (int(x) for x in s)
    except (TypeError, ValueError):
        raise ValueError(f"bidirectional span {s!r} must be a (start, stop) pair") from None
    if not 0 <= a < z:
        raise ValueError(f"bidirectional span {s!r} must have 0 <= start < stop")
    return a, z


class _Prefix(_Classes):
    what = "prefix"
    rows = ("n",)

    def __init__(self, n):
        self.n = _per_batch(n, "prefix", "a length, or one per batch element").flatten()
        self._table = self.n
        if bool((self.n < 0).any()):
            raise ValueError(f"prefix={n!r} must be non-negative")

    def classes(self, b, pos):
        return torch.where(pos < _rows(self.n, b), 0, -1)

    def __repr__(self):
        return f"prefix({self.n.tolist()})"


class _Chunks(_Classes):
    def __init__(self, size):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"chunked size={size!r} must be a positive integer")
        self.size = size
        self._table = [size]

    def classes(self, b, pos):
        return torch.div(pos, self.size, rounding_mode="floor")

    def __repr__(self):
        return f"chunked({self.size})"


class _MaskMod(Mask):
    structured = False
    batched = True  # b may matter

    def __init__(self, fn, of=None):
        if not callable(fn):
            raise ValueError(f"mask_mod={fn!r} must be callable as fn(b, h, q, k) -> bool")
        self.fn, self.of = fn, of  # ``of``: the mask_mod this one selects a part of

    def _select(self, seqs):
        fn = self.fn
        return _MaskMod(lambda b, h, q, k: fn(seqs.to(b.device)[b], h, q, k), self)

    def visible(self, b, q, k):
        seen = self.fn(torch.as_tensor(b), torch.zeros((), dtype=torch.long), q, k)
        if not isinstance(seen, torch.Tensor) or seen.dtype != torch.bool:
            raise ValueError(f"mask_mod {self!r} must return a bool tensor, got "
                             f"{type(seen).__name__} {getattr(seen, 'dtype', '')}")
        return seen.expand(torch.broadcast_shapes(q.shape, k.shape))

    def _check(self, batch, length):
        n = min(length, 64)
        q, k = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        for b in range(min(batch, 2)):
            b = torch.tensor(b)
            head0 = self.visible(b, q, k)
            head1 = self.fn(b, torch.ones((), dtype=torch.long), q, k)
            if not torch.equal(head0, torch.as_tensor(head1).expand_as(head0)):
                raise ValueError(f"mask_mod {self!r} depends on the head h; masks are the same "
                                 f"for every head here: drop h from it")

    def __repr__(self):
        if self.of is not None:
            return f"{self.of!r} of part of the batch"
        fn = self.fn
        return f"mask_mod({getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)})"


def _digest(t: torch.Tensor) -> str:
    data = t.contiguous().numpy().tobytes()
    return f"{list(t.shape)}:{hashlib.blake2b(data, digest_size=6).hexdigest()}"


def causal() -> Mask:
    """Query q sees keys k <= q."""
    return _Causal()


def window(left: int | None, right: int | None) -> Mask:
    """Query q sees keys q - left <= k <= q + right (None: unbounded)."""
    return _Window(left, right)


def document_ids(ids) -> Mask:
    """Tokens see tokens of their own document: ids [S] or [B, S] (-1: sees nothing)."""
    return _Documents(ids)


def prefix(n) -> Mask:
    """The first ``n`` positions see each other (an int, or one per batch element)."""
    return _Prefix(n)


def bidirectional_spans(spans) -> Mask:
    """Tokens of one span [start, stop) see each other: a list of spans, or one list per
    batch element."""
    return _Spans(spans)


def chunked(size: int) -> Mask:
    """Tokens see tokens of their own chunk of ``size`` positions."""
    return _Chunks(size)


def mask_mod(fn) -> Mask:
    """The mask ``fn(b, h, q, k) -> bool`` (FlexAttention's signature; see the module
    docstring for what it gets)."""
    return _MaskMod(fn)
