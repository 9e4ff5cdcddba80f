"""Which (query, key) pairs a transformers mask keeps, read from how transformers built it.

transformers (5.x, ``transformers.masking_utils``) builds every mask of a model from small
functions of ``(batch_idx, head_idx, q_idx, kv_idx)`` combined with ``and_masks`` and
``or_masks``, wrapped by ``remap_positions_for_packed_sequence`` for packed documents, and
hands the function to the attention backend's mask function. ``read`` walks that tree and
returns the ``Band`` it keeps, a range of position differences ``lo <= q - kv <= hi``:

    causal_mask_function                         0 <= q - kv
    sliding_window_overlay(w)                    q - kv <= w - 1    (the w most recent keys,
                                                                     the query's own included)
    sliding_window_bidirectional_overlay(w)      -w <= q - kv <= w
    bidirectional_mask_function                  every pair
    packed_sequence_mask_function (+ remap)      within each document (``documents``)

Every other part is a ValueError naming it: bidirectional spans of image tokens
(``blockwise_overlay``, Gemma 3's images), chunked attention (``chunked_overlay``, Llama 4),
and any function transformers does not define (a model's own prefix-LM or bidirectional
overlay, a user's ``or_mask_function``). A part that changes nothing on this call's tokens
is read as absent: image blocks whose tokens see no later token of their block, chunks
longer than the sequence.

``BandMask`` carries a band to the attention function: a [B, 1, 1, kv_len] bool tensor of
the keys' padding (True: a real key) with the band, the query's offset in the keys and
whether documents are separated. Being 4-D it passes through transformers unchanged where
transformers takes a prepared mask (``generate`` with a static cache builds the masks
ahead and hands them back to the model).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

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


def read(mask_function, call: Call) -> Band:
    """The band that ``mask_function`` (built by transformers) keeps on ``call``'s tokens;
    ValueError (``Unsupported``) naming a part that is not a band."""
    band = _read(mask_function, call)
    if band is _NOTHING:
        raise Unsupported("a mask that keeps no pair")
    if band.documents != band.remapped:
        raise Unsupported("documents given by sequence ids (packed_sequence_mask_function) "
                          "without the positions remapped per document")
    if (band.lo is not None and band.lo > 0) or (band.hi is not None and band.hi < 0):
        raise Unsupported(f"a mask where a token does not see itself (q - kv in "
                          f"[{band.lo}, {band.hi}])")
    return band


def _read(fn, call: Call) -> Band | None:
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
        parts = [_read(f, call) for f in free["mask_functions"]]
        if any(p is _NOTHING for p in parts):
            return _NOTHING
        band = Band()
        for p in parts:
            band = band & p
        return band
    if name == "or_masks":
        parts = [p for p in (_read(f, call) for f in free["mask_functions"]) if p is not _NOTHING]
        if not parts:
            return _NOTHING
        band = parts[0]
        for p in parts[1:]:
            band = band | p
        return band
    if name == "remap_positions_for_packed_sequence":
        inner = _read(free["mask_function"], call)
        return inner if inner is _NOTHING else dataclasses.replace(inner, remapped=True)
    if name == "packed_sequence_mask_function":
        return Band(None, None, documents=True)
    if name == "blockwise_overlay":
        _check_blocks(free["block_sequence_ids"], call)
        return _NOTHING
    if name == "chunked_overlay":
        _check_chunks(int(free["chunk_size"]), free["left_padding"], call)
        return Band(None, None)
    raise Unsupported(f"a custom mask function ({_qualified(fn)}), e.g. a model's prefix-LM or "
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


def _qualified(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _check_blocks(ids: torch.Tensor, call: Call) -> None:
    """Raise if an image block (ids >= 0) lets a query see a later key of its block: the
    only pairs ``blockwise_overlay`` adds to a causal mask."""
    groups = int(ids.max()) + 1 if ids.numel() else 0
    if groups <= 0:
        return
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
    if bool((first_q[:, :groups] < last_kv[:, :groups]).any()):
        raise Unsupported(
            "bidirectional attention within blocks of image tokens (blockwise_overlay of "
            "block_sequence_ids, made from token_type_ids: an image's tokens see each "
            "other, later ones included)"
        )


def _check_chunks(chunk: int, left_padding: torch.Tensor, call: Call) -> None:
    """Raise unless every real token of the call lies in the first chunk of its row."""
    last = max(call.q_offset + call.q_len, call.kv_offset + call.kv_len) - 1
    if bool(((last - left_padding) >= chunk).any()):
        raise Unsupported(f"chunked attention (chunks of {chunk} tokens, attention_chunk_size, "
                          f"as Llama 4's) on a sequence longer than a chunk ({last + 1} tokens)")


class BandMask(torch.Tensor):
    """A mask transformers built, as the attention backend reads it: the keys' padding
    ([B, 1, 1, kv_len] bool, True for a real key), the ``band`` of position differences,
    ``shift`` (the first query's position minus the first key's: 0 without a cache) and
    ``q_len`` and whether any key is padding (``padded``). Torch functions on it return
    plain tensors."""

    band: Band
    shift: int
    q_len: int
    padded: bool

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def of(keys: torch.Tensor, band: Band, call: Call) -> "BandMask":
        mask = torch.Tensor._make_subclass(BandMask, keys[:, None, None, :].contiguous())
        mask.band, mask.shift, mask.q_len = band, int(call.q_offset - call.kv_offset), call.q_len
        mask.padded = not bool(keys.all())
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
