"""sdpa-fusion as a transformers attention backend, and batches sharded over a schedule.

    from schedules.integrations import transformers as sdpa_transformers

    name = sdpa_transformers.register()                # "fusion_attention"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    batch = sdpa_transformers.shard_batch(sched, input_ids, labels=labels,
                                          attention_mask=mask)   # or position_ids= (packed)
    out = model(**batch.inputs)            # this rank's tokens; out.loss: this rank's share
    out.loss.backward()
    batch.sum_gradients(model.parameters())  # the one-process gradient on every rank

The backend registers as ``"fusion_attention"`` and, as an alias, ``"sdpa_fusion"``:
transformers takes any name containing "sdpa" for PyTorch's own SDPA and refuses, under such
a name, the models that do not support SDPA (``_supports_sdpa = False``) before the backend
runs. Its mask function, registered with transformers' mask interface under the same names,
reads the mask function transformers builds for each layer type (``transformers_masks``: a
band of position differences, or a composed mask for image blocks and chunks); attention
runs exactly that mask, checked against the layer (``module.is_causal``, its
``sliding_window``: transformers' window of w is ``window=(w - 1, 0)``), or raises a
ValueError naming what it cannot run.

Without ``shard_batch`` the backend runs on one device: padding masks, packed documents
(``position_ids`` restarting, or ``DataCollatorWithFlattening``'s ``cu_seq_lens_q/k``),
prepared 4-D masks and KV caches. ``shard_batch`` splits a batch by the schedule
(``schedules.batch``): the model sees this rank's tokens at their global positions, and each
rank's ``out.loss`` is its real tokens' losses over the global count of labelled tokens, so
the ranks' losses add up to the one-process mean. docs/api.md ("transformers") has the
whole example and lists what the backend honours and what it refuses.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface
from transformers.masking_utils import (AttentionMaskInterface, causal_mask_function,
                                       prepare_padding_mask)

import schedules.batch
import sdpa_fusion
from schedules.batch import TokenBatch

from .transformers_masks import (Band, BandMask, Call, Sequences, Unsupported, exact, read,
                                 read_dense)

NAME = "fusion_attention"
ALIASES = ("sdpa_fusion",)  # transformers takes it for SDPA (module docstring)
BATCH = "sdpa_fusion_batch"  # the model-call keyword that carries a sharded batch
IGNORE = -100  # transformers' label of tokens without a loss


def register(name: str = NAME, *, kernel="auto") -> str:
    """Register the backend (attention and mask) with transformers as ``name`` (the default
    also as ``ALIASES``) and return it, for ``attn_implementation=name``. ``kernel`` chooses
    the local kernel ("auto": the fastest on the device)."""
    for each in (name, *ALIASES) if name == NAME else (name,):
        AttentionInterface.register(each, _Backend(kernel, each))
        AttentionMaskInterface.register(each, band_mask)
    return name


def band_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
              mask_function=causal_mask_function, attention_mask=None, **kwargs) -> BandMask:
    """What transformers hands the backend as ``attention_mask``: the keys' padding and the
    band that ``mask_function`` keeps; a ValueError names a mask the backend cannot run."""
    call = Call(int(q_length), int(kv_length), int(q_offset), int(kv_offset))
    try:
        reading = read(mask_function, call)
    except Unsupported as e:
        raise _cannot(e) from None
    padding = prepare_padding_mask(attention_mask, call.kv_len, call.kv_offset)
    if padding is None:
        keys = torch.ones(batch_size, call.kv_len, dtype=torch.bool, device=kwargs.get("device"))
    else:
        keys = padding[:, call.kv_offset:call.kv_offset + call.kv_len].to(torch.bool)
    return BandMask.of(keys, reading, call, mask_function)


def _cannot(e: Unsupported) -> ValueError:
    return ValueError(f"the {NAME!r} attention backend cannot run this mask: {e}; it runs "
                      f"causal or bidirectional attention with padding, packed documents, "
                      f"sliding windows, image blocks and chunks. Use attn_implementation="
                      f"'sdpa' or 'eager' for this model or these inputs")


_UNSUPPORTED = {"softcap": "softcapping of the scores", "s_aux": "attention sinks",
                "position_bias": "a position bias"}


@dataclasses.dataclass(frozen=True)
class _Mask:
    """A layer's mask: the band of q - kv, the first query's position minus the first key's
    (``shift``), the keys' padding ([B, kv_len] bool or None), whether documents are
    separated, and the ``BandMask`` whose overlays change pairs of the call (``overlaid``)."""

    band: Band
    shift: int
    padding: torch.Tensor | None
    documents: bool = False
    overlaid: BandMask | None = None


class _Backend:
    """The attention function transformers calls: (module, q, k, v, mask, ...) ->
    (out [B, S, H, E], None)."""

    def __init__(self, kernel, name: str = NAME):
        self.kernel, self.name = kernel, name
        self._batches: list = []  # recent (mask, positions, TokenBatch, contiguous)

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 is_causal=None, **kwargs):
        for name, what in _UNSUPPORTED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"attention backend {self.name!r} does not take {what} "
                                 f"({name}); use attn_implementation='sdpa' or 'eager' for "
                                 f"this model")
        layer = self._layer_band(module, is_causal, kwargs)
        options = dict(scale=scaling, dropout_p=dropout, kernel=self.kernel)
        batch = kwargs.get(BATCH)
        if batch is not None:
            out = self._sharded(batch, query, key, value, attention_mask, layer, options)
        else:
            out = self._one_device(query, key, value, attention_mask, layer, kwargs, options)
        return out.transpose(1, 2), None

    def _layer_band(self, module, is_causal, kwargs) -> Band:
        """The band the layer asks for: causal or not (``is_causal``, else the module's), its
        sliding window (the ``sliding_window`` kwarg, else the module's attribute)."""
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window = kwargs["sliding_window"] if "sliding_window" in kwargs else \
            getattr(module, "sliding_window", None)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"sliding_window={window!r} of the layer must be a positive number "
                             f"of tokens or None")
        return Band(0 if causal else None, None if window is None else window - 1)

    # ---- the mask of a call --------------------------------------------------------------
    def _mask(self, mask, layer: Band, batch: int, q_len: int, k_len: int) -> _Mask:
        """The layer's mask from what transformers passed, checked against the layer."""
        if isinstance(mask, BandMask):
            if (mask.q_len, mask.shape[-1]) != (q_len, k_len):
                raise ValueError(f"the mask was built for {mask.q_len} queries and "
                                 f"{mask.shape[-1]} keys, attention got {q_len} and {k_len}; "
                                 f"build the mask for this call")
            self._agree(mask.band, layer, q_len, k_len, mask.shift)
            return _Mask(mask.band, mask.shift, mask.keys if mask.padded else None,
                         mask.band.documents, mask if mask.matter else None)
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            try:
                band, keys = read_dense(mask, q_len, k_len)
            except Unsupported as e:
                raise ValueError(f"attention backend {self.name!r} cannot run this 4-D "
                                 f"attention_mask: {e}; pass the 2-D 0/1 attention_mask, or use "
                                 f"attn_implementation='sdpa' or 'eager'") from None
            self._agree(band, layer, q_len, k_len, 0)
            return _Mask(band, 0, None if bool(keys.all()) else keys.expand(batch, -1))
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"attention backend {self.name!r} takes its own mask, a 2-D "
                             f"padding mask or a 4-D one, got {got}")
        padding = None
        if mask is not None:  # 2-D: the padding of the keys, the last k_len columns
            padding = mask[:, -k_len:].to(torch.bool)
            padding = None if padding.shape[1] == k_len and bool(padding.all()) else padding
        if q_len == k_len:
            return _Mask(layer, 0, padding)
        if q_len == 1 and padding is None:  # decoding after a dynamic cache
            return _Mask(layer, k_len - 1, None)
        raise ValueError(f"attention backend {self.name!r} got {q_len} queries and {k_len} keys "
                         f"without its own mask ({'padding' if padding is not None else 'none'})"
                         f": where the queries sit among the keys is unknown; let transformers "
                         f"build the mask (pass the 2-D attention_mask to the model) or use "
                         f"attn_implementation='sdpa'")

    def _agree(self, band: Band, layer: Band, q_len=None, k_len=None, shift=0) -> None:
        """Raise unless the mask's band is the layer's: on this call's q_len queries and k_len
        keys (a window longer than them is none), or exactly when they are not given."""
        got, want = band, layer
        if q_len is not None:
            got, want = (_effective(b, q_len, k_len, shift) for b in (band, layer))
        if (got.lo, got.hi) != (want.lo, want.hi):
            raise ValueError(f"the mask transformers built keeps {_describe(band)}, but the layer "
                             f"asks for {_describe(layer)} (module.is_causal, sliding_window); "
                             f"attention backend {self.name!r} runs a mask only with its "
                             f"layer's settings: use attn_implementation='eager' for this model")

    # ---- one device ------------------------------------------------------------------------
    def _one_device(self, q, k, v, mask, layer, kwargs, options):
        """Attention of the whole [B, H, S, E] batch on this device."""
        m = self._mask(mask, layer, q.shape[0], q.shape[2], k.shape[2])
        if m.shift != 0 or q.shape[2] != k.shape[2]:  # a KV cache
            if m.overlaid is not None:
                raise ValueError(
                    f"attention backend {self.name!r} runs image blocks and chunked attention "
                    f"without a KV cache ({q.shape[2]} queries after {k.shape[2] - q.shape[2]} "
                    f"cached keys): call the model with use_cache=False, or generate with "
                    f"attn_implementation='sdpa'")
            k, v, m = _trim(k, v, m, q.shape[2], self.name)
        band = _effective(m.band, q.shape[2], k.shape[2], m.shift)
        causal, window = _top_left(band, m.shift)
        options = dict(options, causal=causal, window=window)
        if m.shift != 0 or q.shape[2] != k.shape[2]:
            return sdpa_fusion.attention(q, k, v, schedule=None, **options)
        documents = kwargs.get("cu_seq_lens_q", kwargs.get("position_ids"))
        if m.documents and documents is None:
            raise ValueError("the mask separates packed documents but the attention got no "
                             "position_ids or cu_seq_lens_q to find them; pass position_ids")
        batch, contiguous = self._batch(mask, documents, m.padding, kwargs, q)
        if window is not None and not contiguous:
            raise ValueError(f"attention backend {self.name!r} runs a sliding window over rows "
                             f"of real tokens; the padding mask has padding between real tokens "
                             f"of a row: pad at the ends only")
        if m.overlaid is not None:
            options = dict(options, causal=False, window=None,
                           mask=_exact(m.overlaid, batch, (q.shape[0], q.shape[2])))
        if batch is None:
            return sdpa_fusion.attention(q, k, v, schedule=None, **options)
        local = [batch.shard(t.transpose(1, 2)).transpose(1, 2) for t in (q, k, v)]
        return batch.unshard(batch.attention(*local, **options).transpose(1, 2)).transpose(1, 2)

    def _batch(self, mask, documents, padding, kwargs, q) -> tuple[TokenBatch | None, bool]:
        """(the packed form of a padded or packed batch, or None; whether the real tokens
        of every row are one run), made once per model call (``mask`` and ``documents``,
        the tensor that gives the documents, are the same objects for all its layers)."""
        for last_mask, last_documents, *made in self._batches:
            if mask is last_mask and documents is last_documents:
                return tuple(made)
        batch, contiguous = None, True
        positions = kwargs.get("position_ids")  # or from cu_seq_lens_q (one packed row):
        if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
            positions = _document_positions(
                kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"),
                kwargs.get("max_length_q"), kwargs.get("max_length_k"),
                (q.shape[0], q.shape[2]), q.device)
        if padding is not None or (positions is not None and bool(
                (positions[:, 1:] != positions[:, :-1] + 1).any())):  # documents restart
            batch = schedules.batch.split(None, (q.shape[0], q.shape[2]),
                                          attention_mask=padding, position_ids=positions,
                                          device=q.device)
            if padding is not None:  # whether the real tokens of every row are one run
                starts = padding.int().diff(dim=1, prepend=padding.new_zeros(len(padding), 1).int())
                contiguous = bool(((starts == 1).sum(1) <= 1).all())
        self._batches = [(mask, documents, batch, contiguous), *self._batches[:3]]
        return batch, contiguous

    # ---- a sharded batch -------------------------------------------------------------------
    def _sharded(self, batch: TokenBatch, q, k, v, mask, layer, options):
        if not (mask is None or (isinstance(mask, BandMask) and not mask.padded)):
            raise ValueError("a sharded batch holds its padding: call the model with "
                             "batch.inputs only, without attention_mask")
        if mask is not None:
            self._agree(mask.band, layer)  # exactly: local lengths say nothing of the windows
        causal, window = _top_left(layer, 0)
        if mask is not None and mask.function is not None:  # overlays: over the whole batch
            return batch.attention(q, k, v, causal=False, window=None, **options,
                                   mask=_exact(mask, batch, batch.shape, sharded=True))
        return batch.attention(q, k, v, causal=causal, window=window, **options)


def _exact(mask: BandMask, batch: TokenBatch | None, shape, sharded: bool = False):
    """The composed mask of ``mask``'s function over the sequences of ``batch`` (None: the
    rows of ``shape``), made once per mask (the layers of one type share it)."""
    if mask.exact is None:
        try:
            mask.exact = exact(mask.function, _sequences(batch, shape, sharded))
        except Unsupported as e:
            raise _cannot(e) from None
    return mask.exact


def _sequences(batch: TokenBatch | None, shape, sharded: bool) -> Sequences:
    """The sequences attention runs: the rows of a dense batch, else the packed ones of
    ``batch``; a sharded batch gathers the image blocks of its local calls."""
    b, s = shape
    blocks = _gathered(batch) if sharded else None
    if batch is None or not batch.packed:
        columns = torch.arange(s)
        positions = batch.positions.cpu() if batch is not None else columns.expand(b, s)
        return Sequences(list(range(b)), [columns] * b, list(positions), blocks, sharded)
    cu = batch.packing.split.cu_seqlens
    rows, flat = batch.rows.cpu(), batch.positions.cpu().flatten()
    pieces = [rows[a:z] for a, z in zip(cu[:-1], cu[1:])]
    return Sequences([int(p[0]) // s for p in pieces], [p % s for p in pieces],
                     [flat[p] for p in pieces], blocks, sharded)


def _gathered(batch: TokenBatch):
    """block_sequence_ids of the local call -> [B, S] ids of the whole batch: the image
    tokens (ids >= 0) of every rank, each maximal run numbered."""
    def blocks(ids: torch.Tensor) -> torch.Tensor:
        local = (ids[:, :batch.tokens.shape[1]] >= 0).float()
        image = batch.unshard(local[..., None])[..., 0].cpu() > 0.5
        new = image.clone()
        new[:, 1:] &= ~image[:, :-1]
        return torch.where(image, new.long().cumsum(1) - 1, -1)

    return blocks


def _effective(band: Band, q_len: int, k_len: int, shift: int) -> Band:
    """``band`` without the sides that keep every pair of this call (a window longer than
    the sequence, a lower bound below every difference)."""
    lo = None if band.lo is not None and band.lo <= shift - (k_len - 1) else band.lo
    hi = None if band.hi is not None and band.hi >= q_len - 1 + shift else band.hi
    return dataclasses.replace(band, lo=lo, hi=hi)


def _top_left(band: Band, shift: int) -> tuple[bool, tuple | None]:
    """(causal, window) of ``sdpa_fusion.attention`` (top-left: query i sees key j when i - left
    <= j <= i + right) for ``band`` of q_pos - kv_pos when query i sits at key i + shift."""
    left = None if band.hi is None else band.hi - shift
    right = None if band.lo is None else shift - band.lo
    if right == 0:
        return True, None if left is None else (left, 0)
    return False, None if left is None and right is None else (left, right)


def _trim(k, v, m: _Mask, q_len: int, name: str):
    """The keys any query sees (a static cache's empty slots and keys behind every window
    dropped, as transformers' SDPA trims a static cache), and the mask shifted to them."""
    k_len, band, shift = k.shape[2], m.band, m.shift
    if shift < 0:
        raise ValueError(f"the queries start {-shift} positions before the keys; attention "
                         f"backend {name!r} runs queries at or after the first key")
    first = 0 if band.hi is None else max(0, shift - band.hi)
    last = k_len - 1 if band.lo is None else min(k_len - 1, q_len - 1 + shift - band.lo)
    if m.padding is not None and not bool(m.padding[:, first:last + 1].all()):
        raise ValueError(f"attention backend {name!r} does not take a padding mask with a KV "
                         f"cache or over other tokens' keys (cross-attention; {q_len} queries, "
                         f"{k_len} keys); generate unpadded or use attn_implementation='sdpa'")
    k, v = k[:, :, first:last + 1], v[:, :, first:last + 1]
    return k, v, _Mask(band, shift - first, None)


def _describe(band: Band) -> str:
    """The pairs a band keeps, in words."""
    if band.lo is None and band.hi is None:
        return "every pair (bidirectional)"
    if band.lo == 0:
        return "causal pairs" + ("" if band.hi is None else
                                 f" in a sliding window of {band.hi + 1} tokens")
    bounds = [f"{band.lo} <="] if band.lo is not None else []
    bounds += ["q - kv"] + ([f"<= {band.hi}"] if band.hi is not None else [])
    return "pairs with " + " ".join(bounds)


def _document_positions(cu_q, cu_k, max_q, max_k, shape, device) -> torch.Tensor:
    """Positions [1, T] restarting at every document of ``cu_seq_lens_q`` (as
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives them), checked."""
    if cu_q is None or cu_k is None or not torch.equal(cu_q.cpu(), cu_k.cpu()):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must both be given and equal "
                         "(self-attention packs, as DataCollatorWithFlattening makes them)")
    cu = cu_q.to(device=device, dtype=torch.long)
    b, t = shape
    if cu.dim() != 1 or len(cu) < 2 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()) \
            or b != 1 or int(cu[-1]) != t:
        shown = cu.tolist() if cu.numel() <= 8 else f"{cu.tolist()[:8]}..."
        raise ValueError(f"cu_seq_lens_q {shown} must rise from 0 to the {t} tokens of the "
                         f"one packed row (batch {b}); flatten the batch to [1, T]")
    longest = int(cu.diff().max())
    for name, value in (("max_length_q", max_q), ("max_length_k", max_k)):
        if value is not None and int(value) < longest:
            raise ValueError(f"{name}={int(value)} is shorter than the longest document "
                             f"({longest} tokens) of cu_seq_lens_q")
    starts = torch.repeat_interleave(cu[:-1], cu.diff())
    return (torch.arange(t, device=device) - starts)[None]


@dataclasses.dataclass(frozen=True)
class ShardedBatch:
    """A batch split by a schedule: ``inputs`` for ``model(**inputs)`` (this rank's tokens,
    their positions, labels and the loss normalisation) and the helpers of ``TokenBatch``."""

    batch: TokenBatch
    inputs: dict

    def unshard(self, t: torch.Tensor) -> torch.Tensor:
        """The full [B, S, ...] tensor (e.g. logits) on every rank from the local tokens'."""
        return self.batch.unshard(t)

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """The one-process value of a per-rank share (e.g. ``out.loss``), on every rank."""
        return self.batch.total(t)

    def sum_gradients(self, parameters) -> None:
        """Add the replicated weights' gradients over the ranks that split the tokens."""
        self.batch.sum_gradients(parameters)


def shard_batch(schedule, input_ids: torch.Tensor, *, labels=None, attention_mask=None,
                position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None,
                max_length_k=None, seq_idx=None) -> ShardedBatch:
    """This rank's part of a causal-LM batch under ``schedule``, from the same full tensors on
    every rank: ``input_ids`` [B, S], ``labels`` (shifted here, as transformers does),
    ``attention_mask`` (padding) or ``position_ids`` (packed documents); or
    ``DataCollatorWithFlattening``'s batch as it comes (``shard_batch(sched, **collated)``):
    its ``cu_seq_lens_q`` the documents, its ``position_ids`` the positions."""
    shape, device = tuple(input_ids.shape), input_ids.device
    if cu_seq_lens_q is None and cu_seq_lens_k is None:
        for name, value in (("max_length_q", max_length_q), ("max_length_k", max_length_k)):
            if value is not None:
                raise ValueError(f"{name} is given without cu_seq_lens_q/k; pass the "
                                 f"collator's cu_seq_lens_q and cu_seq_lens_k as well")
        batch = schedules.batch.split(schedule, shape, attention_mask=attention_mask,
                                      position_ids=position_ids, device=device)
        documents = None
    else:
        if attention_mask is not None:
            raise ValueError("pass either attention_mask (padded rows) or cu_seq_lens_q/k "
                             "(packed documents), not both")
        documents = _document_positions(cu_seq_lens_q, cu_seq_lens_k, max_length_q,
                                        max_length_k, shape, device)
        batch = schedules.batch.split(schedule, shape, position_ids=documents, device=device)
        rope = position_ids if position_ids is not None else \
            torch.arange(shape[1], device=device)[None]
        if rope.shape[-1] != shape[1]:
            raise ValueError(f"position_ids {list(rope.shape)} must be [1, {shape[1]}] like "
                             f"input_ids")
        batch = dataclasses.replace(batch, positions=rope.to(device, torch.long).expand(shape))
    if seq_idx is not None:
        _check_seq_idx(seq_idx, documents if cu_seq_lens_q is not None else position_ids,
                       shape, attention_mask)
    inputs = {"input_ids": batch.shard(input_ids), "position_ids": batch.position_ids,
              "use_cache": False, BATCH: batch}
    if labels is not None:
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], 1)
        local = batch.shard(shifted, fill=IGNORE)
        labelled = shifted != IGNORE  # the loss's divisor: the global count of real ones
        if batch.packed:
            labelled = labelled.flatten()[batch.rows]
        inputs.update(labels=local, shift_labels=local, num_items_in_batch=labelled.sum())
    return ShardedBatch(batch, inputs)


def _check_seq_idx(seq_idx, positions, shape, attention_mask) -> None:
    """``seq_idx`` [B, S] must number each row's documents 0, 1, ... as the collator does
    (they start where ``positions`` do not follow on); attention does not read it."""
    b, s = shape
    if attention_mask is not None:
        raise ValueError("seq_idx numbers packed documents; a padded batch (attention_mask) "
                         "has none: leave seq_idx out")
    if not isinstance(seq_idx, torch.Tensor) or tuple(seq_idx.shape[-1:]) != (s,):
        raise ValueError(f"seq_idx must be a [{b}, {s}] tensor like input_ids")
    positions = torch.arange(s)[None] if positions is None else positions.cpu()
    start = torch.ones(positions.shape, dtype=torch.long)
    start[:, 1:] = (positions[:, 1:] != positions[:, :-1] + 1).long()
    if not torch.equal(seq_idx.cpu().long().expand(b, s), (start.cumsum(1) - 1).expand(b, s)):
        raise ValueError("seq_idx does not number the documents that cu_seq_lens_q (or the "
                         "position_ids) give: 0 for the first document of a row, 1 for the "
                         "next, ...")

