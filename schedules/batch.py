"""A model's batch over a schedule's ranks: the tokens each rank holds, their positions, and
attention on them (``schedules.integrations.transformers`` uses it for you):

    batch = schedules.batch.split(sched, input_ids.shape)               # [B, S], no padding
    batch = schedules.batch.split(sched, attention_mask=mask)           # padded rows
    batch = schedules.batch.split(sched, position_ids=pos)              # packed documents
    ids = batch.shard(input_ids)                 # this rank's tokens of any [B, S, ...] tensor
    cos, sin = rope(batch.position_ids)          # the positions of those tokens
    out = batch.attention(q, k, v, causal=True)  # q, k, v: logical [B_l, H, S_l, E] of them
    logits = batch.unshard(logits_l)             # [B, S, ...] again, on every rank

Dense batches give local tensors [B, S_local, ...]; a padded or packed one becomes packed
sequences (THD) of its real tokens, local tensors [1, T_local, ...] with zero padding slots.

Loss and gradients: let each rank's loss be the sum over its real tokens divided by the global
count of such tokens; the ranks' losses then add up to the one-process loss (``total``), and
``sum_gradients`` adds the replicated weights' gradient shares into the one-process gradient.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import sdpa_fusion

from .packing import LocalPacking, Split, global_packing
from .partition import Contiguous


def split(schedule, shape=None, *, attention_mask=None, position_ids=None, device=None
          ) -> "TokenBatch":
    """This rank's part of a [B, S] batch under ``schedule`` (None: one device); without an
    ``attention_mask``, a position that does not follow the one before starts a document."""
    if schedule is None:
        from .replicated import Replicated  # one device

        schedule = Replicated(None)
    mask, positions, (b, s), device = _inputs(shape, attention_mask, position_ids, device)
    if mask is None:  # documents start where the positions do not follow on
        start = torch.ones(b, s, dtype=torch.bool, device=device)
        start[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        if not bool(start[:, 1:].any()) and _splits(schedule, s):
            return TokenBatch(schedule, (b, s), positions, None, None)
        mask = torch.ones(b, s, dtype=torch.bool, device=device)
    else:  # a padding mask: every row is one sequence of its real tokens
        if bool(mask.all()) and _splits(schedule, s):
            return TokenBatch(schedule, (b, s), positions, None, None)
        start = mask & (mask.cumsum(1) == 1)
    rows = mask.flatten().nonzero().flatten()
    if len(rows) == 0:
        raise ValueError("attention_mask marks no real token in the batch (all 0); give at "
                         "least one 1")
    starts = start.flatten()[rows].nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([len(rows)])]).to(torch.int32)
    return TokenBatch(schedule, (b, s), positions, rows, _packing(schedule, cu))


def _inputs(shape, attention_mask, position_ids, device):
    given = [t for t in (attention_mask, position_ids) if t is not None]
    for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 2):
            raise ValueError(
                f"{name} must be a 2-D [B, S] tensor, got "
                f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}; a "
                f"4-D or additive mask cannot be read as padding: pass the 2-D 0/1 padding mask")
    if attention_mask is not None:
        shape = tuple(attention_mask.shape)
    elif position_ids is not None and shape is None:
        shape = tuple(position_ids.shape)
    if shape is None or len(shape) < 2:
        raise ValueError(f"the batch shape (B, S) is needed, got {shape!r}; pass input_ids.shape")
    b, s = int(shape[0]), int(shape[1])
    device = torch.device(device) if device is not None else (
        given[0].device if given else torch.device("cpu"))
    mask = None
    if attention_mask is not None:
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError(f"attention_mask must hold 1 for real tokens and 0 for padding, got "
                             f"dtype {attention_mask.dtype} and values "
                             f"{attention_mask.unique().tolist()[:6]}; pass the tokenizer's 0/1 "
                             f"padding mask")
        mask = attention_mask.to(device=device, dtype=torch.bool)
    if position_ids is None:
        positions = torch.arange(s, device=device).expand(b, s)
    elif position_ids.shape[1] != s or position_ids.shape[0] not in (1, b):
        raise ValueError(f"position_ids {list(position_ids.shape)} must be [B, S] = [{b}, {s}] "
                         f"(or [1, {s}])")
    else:
        positions = position_ids.to(device=device, dtype=torch.long).expand(b, s)
    return mask, positions, (b, s), device


def _splits(schedule, seq_len: int) -> bool:
    """Whether every token split of ``schedule`` splits rows of ``seq_len`` tokens."""
    for s in reversed(schedule.token_splits):  # outer first
        if seq_len % s.partition.multiple(s.size):
            return False
        seq_len //= s.size
    return True


def _packing(schedule, cu: torch.Tensor) -> LocalPacking:
    """This rank's part of the packing ``cu`` (all of it where every rank keeps every token)."""
    if schedule.token_splits:
        return schedule.pack(cu)
    packing, _ = global_packing(cu)
    return Split(Contiguous(), 1, packing, None, cu.device).part(0)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenBatch:
    """This rank's tokens of a [B, S] batch; packed: ``rows`` are the real tokens' indices in
    the flattened batch, ``packing`` this rank's ``LocalPacking`` of them."""

    schedule: object
    shape: tuple[int, int]
    positions: torch.Tensor  # [B, S] position of every token of the full batch
    rows: torch.Tensor | None
    packing: LocalPacking | None

    @property
    def packed(self) -> bool:
        return self.packing is not None

    @property
    def tokens(self) -> torch.Tensor:
        """Index of every local token in the flattened [B*S] batch (-1: padding)."""
        b, s = self.shape
        if not self.packed:
            return torch.arange(b, device=self.device)[:, None] * s + self._local_positions
        index = self.packing.token_index
        return torch.where(index >= 0, self.rows[index.clamp(min=0)], -1)[None]

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def _local_positions(self) -> torch.Tensor:
        positions = torch.arange(self.shape[1], device=self.device)
        for s in reversed(self.schedule.token_splits):  # outer first
            positions = positions[s.position_ids(len(positions), self.device)]
        return positions

    @property
    def real(self) -> torch.Tensor:
        """Which local tokens are real (not padding), bool [B_l, S_l]."""
        return self.tokens >= 0

    @property
    def position_ids(self) -> torch.Tensor:
        """The position ids of the local tokens (0 for padding), int64 [B_l, S_l], for RoPE."""
        return self.shard(self.positions)

    def shard(self, t: torch.Tensor, fill=0) -> torch.Tensor:
        """This rank's tokens of a full [B, S, ...] tensor (padding slots ``fill``)."""
        self._check("t", t, self.shape, "the full batch")
        if not self.packed:
            return t.index_select(1, self._local_positions)
        local = self.packing.shard(t.flatten(0, 1).index_select(0, self.rows))
        if fill != 0:
            local = local.masked_fill(self.packing.token_index.view(-1, *[1] * (t.dim() - 2)) < 0,
                                      fill)
        return local[None]

    def unshard(self, t: torch.Tensor) -> torch.Tensor:
        """The full [B, S, ...] tensor on every rank from every rank's tokens; differentiable."""
        self._check("t", t, tuple(self.tokens.shape), "this rank's tokens")
        if not self.packed:
            for s in self.schedule.token_splits:  # inner first
                t = s.gather_tokens(t, 1)
            return t
        real = self.packing.unshard(t[0])
        full = real.new_zeros((self.shape[0] * self.shape[1], *real.shape[1:]))
        return full.index_copy(0, self.rows, real).unflatten(0, self.shape)

    def _check(self, name: str, t, shape: tuple, what: str) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or tuple(t.shape[:2]) != shape:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} ({got}) must start with the dims {list(shape)} of {what}")

    def attention(self, q, k, v, *, causal: bool = True, scale: float | None = None,
                  dropout_p: float = 0.0, kernel="auto", window=None, mask=None) -> torch.Tensor:
        """``sdpa_fusion.attention`` of the local tokens' q [B_l, H, S_l, E] over k, v within each
        sequence; under a head-splitting schedule q, k, v hold all heads (split here)."""
        packing = {}
        if self.packed:
            if any(t.dim() != 4 or t.shape[0] != 1 for t in (q, k, v)):
                raise ValueError(f"q, k, v of a packed batch are [1, H, T_local, E] (the model's "
                                 f"one row of this rank's tokens), got "
                                 f"{[list(t.shape) for t in (q, k, v)]}; feed the model "
                                 f"batch.shard(...) of its inputs")
            q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [T_l, H, E]
            packing["cu_seqlens"] = (self.packing if self.schedule.token_splits
                                     else self.packing.cu_seqlens)
        heads = self.schedule.head_split
        if heads is not None:
            q, k, v = (heads.shard(t, replicated=True) for t in (q, k, v))
        out = sdpa_fusion.attention(q, k, v, causal=causal, scale=scale, dropout_p=dropout_p,
                                    kernel=kernel, schedule=self.schedule, window=window,
                                    mask=mask, **packing)
        if heads is not None:
            out = heads.unshard(out)
        return out.transpose(0, 1)[None] if self.packed else out

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the ranks that split the tokens, detached (the whole loss)."""
        t = t.detach().clone()
        for s in self.schedule.token_splits:
            dist.all_reduce(t, group=s.group)
        return t

    def sum_gradients(self, parameters) -> None:
        """Add up replicated ``parameters``' gradients over the ranks that split the tokens."""
        grads = [p.grad for p in parameters if p.grad is not None]
        splits = self.schedule.token_splits
        if not grads or not splits:
            return
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            for s in splits:
                dist.all_reduce(flat, group=s.group)
            for g, part in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(part.view_as(g))
