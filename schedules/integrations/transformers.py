"""sdpa-fusion as a transformers attention backend, and batches sharded over a schedule.

    from schedules.integrations import transformers as sdpa_transformers

    sdpa_transformers.register()                       # attn_implementation="sdpa_fusion"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa_fusion")

    batch = sdpa_transformers.shard_batch(sched, input_ids, labels=labels,
                                          attention_mask=mask)   # or position_ids= (packed)
    out = model(**batch.inputs)            # this rank's tokens; out.loss: this rank's share
    out.loss.backward()
    batch.sum_gradients(model.parameters())  # the one-process gradient on every rank
    optimizer.step()
    loss = batch.total(out.loss)           # the one-process loss
    logits = batch.unshard(out.logits)     # [B, S, V] on every rank

The backend serves any model that calls attention through transformers' attention interface
(Llama, Mistral, Qwen, ...). Without ``shard_batch`` it runs on one device and honours what
transformers gives it: causal or not (``module.is_causal``), a 2-D padding mask (registered
as this backend's mask, so transformers never drops it), packed ``position_ids`` (documents
restarting inside a row) and ``cu_seq_lens_q/k`` (``DataCollatorWithFlattening``), a KV cache
without padding. What it cannot honour is a ValueError: 4-D or additive masks, sliding
windows, softcapping, attention sinks, position biases, padding with a KV cache, causal
prefill of a chunk after cached tokens.

``shard_batch`` splits a batch by the schedule (``schedules.batch``): the model sees this
rank's tokens and their global positions (RoPE), attention runs over the mesh (padded and
packed batches as packed sequences), and the loss is normalised across ranks: each rank's
``out.loss`` is the sum of its real tokens' losses divided by the global count of labelled
tokens (labels other than -100, padding excluded), so the ranks' losses add up to the
one-process mean, and ``sum_gradients`` adds the replicated weights' gradients over the
ranks that split the tokens. ``head_parallel`` keeps every token on every rank: each rank
attends its heads of the replicated q, k, v, the weights' gradients come out whole.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import schedules.batch
from schedules.batch import TokenBatch

NAME = "sdpa_fusion"
BATCH = "sdpa_fusion_batch"  # the model-call keyword that carries a sharded batch
IGNORE = -100  # transformers' label of tokens without a loss


def register(name: str = NAME, *, kernel="auto") -> str:
    """Register the backend (attention and mask) with transformers as ``name``; returns it,
    for ``attn_implementation=name``. ``kernel`` chooses the local kernel ("auto": the
    fastest on the device)."""
    AttentionInterface.register(name, _Backend(kernel))
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """What transformers hands the backend as ``attention_mask``: the 2-D padding mask
    [B, kv_length] (bool), or None when there is no padding."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    return None if mask.shape[1] == kv_length and bool(mask.all()) else mask


_UNSUPPORTED = {
    "softcap": "softcapping of the scores",
    "s_aux": "attention sinks",
    "position_bias": "a position bias",
    "sliding_window": "a sliding window",
}


class _Backend:
    """The attention function transformers calls: (module, q, k, v, mask, ...) ->
    (out [B, S, H, E], None)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._last = (None, None, None)  # (mask, positions, TokenBatch): one per model call

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 is_causal=None, **kwargs):
        for name, what in _UNSUPPORTED.items():
            if kwargs.get(name) is not None or (name == "sliding_window" and
                                                getattr(module, name, None) is not None):
                raise ValueError(f"attention backend {NAME!r} does not take {what} ({name}); "
                                 f"use attn_implementation='sdpa' or 'eager' for this model")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        options = dict(causal=bool(causal), scale=scaling, dropout_p=dropout, kernel=self.kernel)
        batch = kwargs.get(BATCH)
        if batch is not None:
            if attention_mask is not None:
                raise ValueError(
                    "a sharded batch holds its padding: call the model with batch.inputs "
                    "only, without attention_mask"
                )
            out = batch.attention(query, key, value, **options)
        else:
            out = self._one_device(query, key, value, attention_mask, kwargs, options)
        return out.transpose(1, 2), None

    def _one_device(self, q, k, v, mask, kwargs, options):
        """Attention of the whole [B, H, S, E] batch on this device."""
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
            raise ValueError(
                f"attention backend {NAME!r} takes a 2-D padding mask, got "
                f"{list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}; "
                f"a 4-D or custom mask cannot be honoured: pass the 2-D 0/1 attention_mask"
            )
        if q.shape[2] != k.shape[2]:  # a KV cache: queries are the last tokens
            return self._cached(q, k, v, mask, options)
        positions = _positions(kwargs, q)
        batch = self._batch(mask, positions, q)
        if batch is None:
            return _sdpa(q, k, v, schedule=None, **options)
        local = [batch.shard(t.transpose(1, 2)).transpose(1, 2) for t in (q, k, v)]
        return batch.unshard(batch.attention(*local, **options).transpose(1, 2)).transpose(1, 2)

    def _cached(self, q, k, v, mask, options):
        if mask is not None:
            raise ValueError(
                f"attention backend {NAME!r} does not take a padding mask with a KV cache "
                f"({q.shape[2]} queries, {k.shape[2]} keys); generate unpadded or with "
                f"attn_implementation='sdpa'"
            )
        if options["causal"] and q.shape[2] > 1:
            raise ValueError(
                f"attention backend {NAME!r} aligns causal masks top-left; {q.shape[2]} queries "
                f"after {k.shape[2] - q.shape[2]} cached tokens need it bottom-right: prefill "
                f"in one call, or use attn_implementation='sdpa'"
            )
        return _sdpa(q, k, v, schedule=None, **dict(options, causal=False))

    def _batch(self, mask, positions, q) -> TokenBatch | None:
        """The packed form of a padded or packed batch (made once per model call), or None."""
        last_mask, last_positions, batch = self._last
        if mask is last_mask and positions is last_positions and batch is not None:
            return batch
        if mask is None and (positions is None or not _restarts(positions)):
            return None
        batch = schedules.batch.split(None, (q.shape[0], q.shape[2]), attention_mask=mask,
                                      position_ids=positions, device=q.device)
        self._last = (mask, positions, batch)
        return batch


def _sdpa(q, k, v, **kwargs):
    import sdpa_fusion

    return sdpa_fusion.attention(q, k, v, **kwargs)


def _restarts(positions: torch.Tensor) -> bool:
    return bool((positions[:, 1:] != positions[:, :-1] + 1).any())


def _positions(kwargs, q) -> torch.Tensor | None:
    """The tokens' positions: from ``cu_seq_lens_q`` (one packed row) or ``position_ids``."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None:
        return kwargs.get("position_ids")
    if cu_k is not None and not torch.equal(cu_q, cu_k):
        raise ValueError(f"attention backend {NAME!r} takes self-attention packs: "
                         f"cu_seq_lens_k must equal cu_seq_lens_q")
    if q.shape[0] != 1 or int(cu_q[-1]) != q.shape[2]:
        raise ValueError(f"cu_seq_lens_q (ending at {int(cu_q[-1])}) must pack the one row of "
                         f"{q.shape[2]} tokens (batch {q.shape[0]}); flatten the batch to [1, T]")
    lengths = cu_q.diff().long()
    starts = torch.repeat_interleave(cu_q[:-1].long(), lengths)
    return (torch.arange(q.shape[2], device=q.device) - starts.to(q.device))[None]


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
                position_ids=None) -> ShardedBatch:
    """This rank's part of a causal-LM batch under ``schedule``: ``input_ids`` [B, S], the
    optional ``labels`` [B, S] (shifted here, as transformers does, then sharded),
    ``attention_mask`` (padding) and ``position_ids`` (packed documents, or custom
    positions), the same full tensors on every rank."""
    batch = schedules.batch.split(schedule, input_ids.shape, attention_mask=attention_mask,
                                  position_ids=position_ids, device=input_ids.device)
    inputs = {"input_ids": batch.shard(input_ids), "position_ids": batch.position_ids,
              "use_cache": False, BATCH: batch}
    if labels is not None:
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE)], 1)
        local = batch.shard(shifted, fill=IGNORE)
        inputs.update(labels=local, shift_labels=local,
                      num_items_in_batch=_labelled(batch, shifted))
    return ShardedBatch(batch, inputs)


def _labelled(batch: TokenBatch, shifted: torch.Tensor) -> torch.Tensor:
    """The global count of labelled real tokens (what the loss is divided by)."""
    labelled = shifted != IGNORE
    if batch.packed:
        labelled = labelled.flatten()[batch.rows]
    return labelled.sum()
