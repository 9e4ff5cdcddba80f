"""Which (query, key) pairs a transformers mask keeps, read from how transformers built it.

transformers (5.x, ``transformers.masking_utils``) builds every mask from small functions
of ``(batch_idx, head_idx, q_idx, kv_idx)`` combined by ``and_masks`` and ``or_masks`` and
wrapped by ``remap_positions_for_packed_sequence`` for packed documents. ``read`` walks that
tree and returns the ``Band`` it keeps, a range of position differences ``lo <= q - kv <= hi``:

    causal_mask_function                         0 <= q - kv
    sliding_window_overlay(w)                    q - kv <= w - 1    (the w most recent keys,
                                                                     the query's own included)
    sliding_window_bidirectional_overlay(w)      -w <= q - kv <= w
    bidirectional_mask_function                  every pair
    packed_sequence_mask_function (+ remap)      within each document (``documents``)

Overlays that are not bands are left out of the band and, where they change a pair of the
call, run exactly: ``exact`` turns the whole function into a composed mask
(``sdpa_fusion.masks``) over the call's sequences (positions from 0 in each):

    causal_mask_function                         masks.causal()
    sliding_window_overlay(w)                    masks.window(w - 1, None)
    blockwise_overlay(block_sequence_ids)        masks.bidirectional_spans (a span per run
                                                 of one id; masks.prefix where it starts the
                                                 sequence): Gemma 3's images, PaliGemma
    chunked_overlay(size, left_padding)          masks.chunked(size) (Llama 4), chunks
                                                 counted from each sequence's first token
    and_masks / or_masks                         & / |

Anything else is an ``Unsupported`` ValueError that names it. ``BandMask`` carries the
reading to the attention function as the keys' padding: being 4-D, it passes through
transformers unchanged where transformers takes a prepared mask (``generate`` with a static
cache builds the masks ahead and hands them back to the model).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator

import torch

from sdpa_fusion import masks
from sdpa_fusion.mask_plan import sequence_runs

_TRANSFORMERS = "transformers.masking_utils"


@dataclasses.dataclass(frozen=True)
class Band:
    """Pairs with ``lo <= q_pos - kv_pos <= hi`` (None: unbounded), within each document
    when ``documents`` (positions remapped per packed document)."""

    lo: int | None = None
    hi: int | None = None
    documents: bool = False
    remapped: bool = False

    def __and__(self, other: "Band") -> "Band":
        lo = max((b for b in (self.lo, other.lo) if b is not None), default=None)
        hi = min((b for b in (self.hi, other.hi) if b is not None), default=None)
        return Band(lo, hi, self.documents or other.documents, self.remapped or other.remapped)

    def __or__(self, other: "Band") -> "Band":
        if (self.documents, self.remapped) != (other.documents, other.remapped):
            raise Unsupported("a union of a mask within documents and one across them")
        first, second = sorted((self, other), key=lambda b: -10**18 if b.lo is None else b.lo)
        if first.hi is not None and second.lo is not None and second.lo > first.hi + 1:
            raise Unsupported(f"a union of two disjoint bands of q - kv ([{first.lo}, {first.hi}] "
                              f"and [{second.lo}, {second.hi}])")
        hi = None if first.hi is None or second.hi is None else max(first.hi, second.hi)
        return Band(first.lo, hi, self.documents, self.remapped)


class Unsupported(ValueError):
    """A part of a mask that is not a band; the message names it."""


@dataclasses.dataclass(frozen=True)
class Call:
    """The tokens a mask is built for: queries at positions q_offset + [0, q_len), keys at
    kv_offset + [0, kv_len)."""

    q_len: int
    kv_len: int
    q_offset: int = 0
    kv_offset: int = 0


_NOTHING = None  # a part that adds no pair on this call (an inert or_mask_function)


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a transformers mask function keeps on a call: the layer's ``band`` (overlays left
    out), whether it has overlays (image blocks, chunks) and whether they ``matter`` here."""

    band: Band
    overlaid: bool = False
    matter: bool = False


def read(mask_function, call: Call) -> Reading:
    """What ``mask_function`` (built by transformers) keeps on ``call``'s tokens; a
    ValueError (``Unsupported``) naming a part it cannot read."""
    found: dict = {}
    band = _read(mask_function, call, found)
    if band is _NOTHING:
        raise Unsupported("a mask that keeps no pair")
    if band.documents != band.remapped:
        raise Unsupported("documents given by sequence ids (packed_sequence_mask_function) "
                          "without the positions remapped per document")
    if (band.lo is not None and band.lo > 0) or (band.hi is not None and band.hi < 0):
        raise Unsupported(f"a mask where a token does not see itself (q - kv in "
                          f"[{band.lo}, {band.hi}])")
    return Reading(band, bool(found), any(found.values()))


def _read(fn, call: Call, found: dict) -> Band | None:
    """The band of ``fn`` with its overlays left out; ``found[name]``: whether an overlay
    changes a pair of ``call``."""
    name, free = _identify(fn)
    if name == "causal_mask_function":
        return Band(0, None)
    if name == "bidirectional_mask_function":
        return Band(None, None)
    if name == "sliding_window_overlay":
        return Band(None, int(free["sliding_window"]) - 1)
    if name == "sliding_window_bidirectional_overlay":
        w = int(free["sliding_window"])
        return Band(-w, w)
    if name == "and_masks":
        parts = [_read(f, call, found) for f in free["mask_functions"]]
        if any(p is _NOTHING for p in parts):
            return _NOTHING
        return functools.reduce(operator.and_, parts, Band())
    if name == "or_masks":
        parts = [_read(f, call, found) for f in free["mask_functions"]]
        parts = [p for p in parts if p is not _NOTHING]
        return functools.reduce(operator.or_, parts) if parts else _NOTHING
    if name == "remap_positions_for_packed_sequence":
        inner = _read(free["mask_function"], call, found)
        return inner if inner is _NOTHING else dataclasses.replace(inner, remapped=True)
    if name == "packed_sequence_mask_function":
        return Band(None, None, documents=True)
    if name == "blockwise_overlay":
        found[name] = found.get(name, False) or _blocks_matter(free["block_sequence_ids"], call)
        return _NOTHING
    if name == "chunked_overlay":  # matters where a real token lies past its row's first chunk
        last = max(call.q_offset + call.q_len, call.kv_offset + call.kv_len) - 1
        found[name] = found.get(name, False) or bool(
            ((last - free["left_padding"]) >= int(free["chunk_size"])).any())
        return Band(None, None)
    raise Unsupported(_custom(fn))


def _custom(fn) -> str:
    named = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    return (f"a custom mask function ({named}), e.g. a model's prefix-LM or "
            f"bidirectional overlay, or an or_mask_function/and_mask_function")


def _identify(fn) -> tuple[str | None, dict]:
    """(the name of the transformers mask function ``fn`` is, or made by; its closure's
    variables), or (None, {}) for anything transformers does not define."""
    if getattr(fn, "__module__", None) != _TRANSFORMERS or not hasattr(fn, "__qualname__"):
        return None, {}
    qualname = fn.__qualname__
    if "<locals>" in qualname:
        maker = qualname.split(".<locals>.")[0]
        return maker, inspect.getclosurevars(fn).nonlocals
    return qualname, {}


def _blocks_matter(ids: torch.Tensor, call: Call) -> bool:
    """Whether an image block (ids >= 0) lets a query see a later key of its block: the
    only pairs ``blockwise_overlay`` adds to a causal mask."""
    groups = int(ids.max()) + 1 if ids.numel() else 0
    if groups <= 0:
        return False
    q_pos = torch.arange(call.q_offset, call.q_offset + call.q_len, device=ids.device)
    kv_pos = torch.arange(call.kv_offset, call.kv_offset + call.kv_len, device=ids.device)
    width = ids.shape[1]

    def block_of(pos):  # the block of each position, ``groups`` for none (text, beyond ids)
        got = ids[:, pos.clamp(max=width - 1)]
        return torch.where((got >= 0) & (pos < width), got, groups)

    big = call.q_offset + call.q_len + call.kv_offset + call.kv_len + 1
    first_q = torch.full((ids.shape[0], groups + 1), big, device=ids.device, dtype=torch.long)
    first_q.scatter_reduce_(1, block_of(q_pos), q_pos.expand(ids.shape[0], -1), "amin")
    last_kv = torch.full_like(first_q, -1)
    last_kv.scatter_reduce_(1, block_of(kv_pos), kv_pos.expand(ids.shape[0], -1), "amax")
    return bool((first_q[:, :groups] < last_kv[:, :groups]).any())


# ---- the exact mask: overlays over the call's sequences -------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Sequences:
    """The sequences attention runs (dense rows, a row's real tokens, packed documents): each
    one's ``row``, ``columns`` (its tokens' columns in the row) and ``positions``. ``blocks``
    maps block_sequence_ids to the whole batch's; ``sharded``: the function was built for a
    rank's tokens, so the batch's own sequences count (its remapping and documents ignored)."""

    row: list
    columns: list
    positions: list
    blocks: object = None
    sharded: bool = False

    def spans(self, ids: torch.Tensor) -> masks.Mask | None:
        """The image blocks of ``ids`` as each sequence's spans (a prefix where one block
        starts every sequence that has one); None without blocks."""
        ids = ids if self.blocks is None else self.blocks(ids)
        width = ids.shape[1]
        per = [_runs(torch.where(cols < width, ids[b, cols.clamp(max=width - 1)], -1).cpu())
               for b, cols in zip(self.row, self.columns)]
        if not any(per):
            return None
        if all(not s or (len(s) == 1 and s[0][0] == 0) for s in per):
            return masks.prefix([s[0][1] if s else 0 for s in per])
        return masks.bidirectional_spans(per)

    def check_chunks(self, remapped: bool) -> None:
        """Raise unless every sequence's tokens sit at 0, 1, ... of the chunks: their
        position_ids (``remapped``, packed documents) or their columns past the row's left
        padding (as transformers counts them; a sharded batch's local calls see none)."""
        first = {}
        for b, cols in zip(self.row, self.columns):
            first[b] = min(first.get(b, int(cols[0])), int(cols[0]))
        for b, cols, pos in zip(self.row, self.columns, self.positions):
            at = pos if remapped else cols - first[b]
            if not torch.equal(at.cpu(), torch.arange(len(cols))):
                raise Unsupported(
                    "chunked attention (chunked_overlay) over a sequence whose tokens are "
                    "not at positions 0, 1, ... of the chunks (padding between real tokens, "
                    "or documents whose position_ids do not start at 0)")


def _runs(ids: torch.Tensor) -> list:
    """[(start, stop)] of the runs of one id >= 0; Unsupported where an id has two runs."""
    runs = sequence_runs(ids)
    if len({g for g, _, _ in runs}) < len(runs):
        raise Unsupported("an image block (block_sequence_ids) whose tokens are not one run of "
                          "the sequence")
    return [(a, z) for _, a, z in runs]


def exact(mask_function, sequences: Sequences) -> masks.Mask:
    """The composed mask that ``mask_function`` keeps over ``sequences``; ``Unsupported``
    naming a part it cannot run."""
    got = _exact(mask_function, sequences, remapped=False)
    if got is None:
        raise Unsupported("a mask that keeps no pair")
    return masks.window(None, None) if got is _EVERY else got


_EVERY = "every pair"  # a part that keeps every pair (and-ed away)


def _exact(fn, seqs: Sequences, remapped: bool):
    """The mask of ``fn``: a ``masks.Mask``, ``_EVERY`` or None (no pair)."""
    name, free = _identify(fn)
    if name == "causal_mask_function":
        return masks.causal()
    if name in ("bidirectional_mask_function", "packed_sequence_mask_function"):
        return _EVERY  # documents: the sequences themselves
    if name == "sliding_window_overlay":
        return masks.window(int(free["sliding_window"]) - 1, None)
    if name == "sliding_window_bidirectional_overlay":
        w = int(free["sliding_window"])
        return masks.window(w, w)
    if name in ("and_masks", "or_masks"):
        parts = [_exact(f, seqs, remapped) for f in free["mask_functions"]]
        if name == "and_masks" and None in parts:
            return None
        if name == "or_masks" and _EVERY in parts:
            return _EVERY
        parts = [p for p in parts if p is not None and p is not _EVERY]
        if not parts:
            return _EVERY if name == "and_masks" else None
        return functools.reduce(operator.and_ if name == "and_masks" else operator.or_, parts)
    if name == "remap_positions_for_packed_sequence":
        return _exact(free["mask_function"], seqs, not seqs.sharded)
    if name == "blockwise_overlay":
        if remapped:
            raise Unsupported("image blocks inside packed documents' remapped positions "
                              "(blockwise_overlay under remap_positions_for_packed_sequence, "
                              "as Gemma 3's sliding layers build it)")
        return seqs.spans(free["block_sequence_ids"])
    if name == "chunked_overlay":
        if not seqs.sharded:
            seqs.check_chunks(remapped)
        return masks.chunked(int(free["chunk_size"]))
    raise Unsupported(_custom(fn))


class BandMask(torch.Tensor):
    """A mask transformers built, as the backend reads it: the keys' padding ([B, 1, 1, kv_len]
    bool, True: a real key) with the ``band``, ``shift`` (first query's position minus first
    key's), the overlays' ``function`` (None without), whether they ``matter`` on this call
    and their ``exact`` mask once made. Torch functions on it return plain tensors."""

    band: Band
    shift: int
    q_len: int
    padded: bool
    function: object
    matter: bool
    exact: masks.Mask | None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def of(keys: torch.Tensor, reading: Reading, call: Call, function=None) -> "BandMask":
        mask = torch.Tensor._make_subclass(BandMask, keys[:, None, None, :].contiguous())
        mask.band, mask.q_len = reading.band, call.q_len
        mask.shift, mask.padded = int(call.q_offset - call.kv_offset), not bool(keys.all())
        mask.function = function if reading.overlaid else None
        mask.matter, mask.exact = reading.matter, None
        return mask

    @property
    def keys(self) -> torch.Tensor:
        """[B, kv_len] bool: True for a real key."""
        return torch.Tensor.as_subclass(self, torch.Tensor)[:, 0, 0, :]


def read_dense(mask: torch.Tensor, q_len: int, kv_len: int) -> tuple[Band, torch.Tensor]:
    """(band, keys [B, kv_len] bool: True for a real key) of a prepared 4-D mask
    [B or 1, 1 or H, q_len, kv_len] given to the model (bool: True keeps a pair; float:
    additive, 0 keeps, -inf or the dtype's minimum masks); ValueError (``Unsupported``)
    naming what is not causal or bidirectional attention with key padding and a window."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (q_len, kv_len):
        raise Unsupported(f"a mask of shape {list(mask.shape)} for {q_len} queries and {kv_len} "
                          f"keys (a 4-D mask is [B, 1, q_len, kv_len])")
    if q_len != kv_len:
        raise Unsupported(f"a prepared 4-D mask with a KV cache ({q_len} queries, {kv_len} keys)")
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        keep = mask == 0
        if not bool((keep | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            raise Unsupported("an additive bias (a float mask with values other than 0 and -inf "
                              "or the dtype's minimum)")
    else:
        raise Unsupported(f"a 4-D mask of dtype {mask.dtype} (bool or an additive float mask)")
    if keep.shape[1] > 1 and not bool((keep == keep[:, :1]).all()):
        raise Unsupported("a mask that differs between heads")
    keep = keep[:, 0]
    real = keep.diagonal(dim1=1, dim2=2)  # a real token sees itself; a padding one, nothing
    pairs = real[:, :, None] & real[:, None, :]
    if bool((keep & real[:, :, None] & ~real[:, None, :]).any()):
        raise Unsupported("a 4-D mask where a token sees a key that does not see itself (not "
                          "padding)")
    i = torch.arange(q_len, device=mask.device)
    d = (i[:, None] - i[None, :]).expand_as(keep)
    kept = keep & pairs
    if not bool(kept.any()):
        raise Unsupported("a 4-D mask that keeps no pair")
    lo, hi = int(d[kept].min()), int(d[kept].max())

    def matches(lo_, hi_) -> bool:
        band = torch.ones_like(kept)
        if lo_ is not None:
            band &= d >= lo_
        if hi_ is not None:
            band &= d <= hi_
        return torch.equal(kept, band & pairs)

    for lo_ in dict.fromkeys([0 if lo == 0 else None, None, lo]):
        for hi_ in (None, hi):
            if matches(lo_, hi_):
                return Band(lo_, hi_), real
    raise Unsupported("a 4-D mask that is not causal or bidirectional attention with padding "
                      "and a sliding window (e.g. packed documents as a block-diagonal mask, a "
                      "prefix-LM mask, bidirectional spans)")
