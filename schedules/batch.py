"""A model's batch over a schedule's ranks: the tokens each rank holds, their positions, and
attention on them.

A training step splits the batch once, runs the model on this rank's tokens and calls
attention through the batch (``schedules.integrations.transformers`` does it for you):

    batch = schedules.batch.split(sched, input_ids.shape)               # [B, S], no padding
    batch = schedules.batch.split(sched, attention_mask=mask)           # padded rows
    batch = schedules.batch.split(sched, position_ids=pos)              # packed documents
    ids = batch.shard(input_ids)                 # this rank's tokens of any [B, S, ...] tensor
    cos, sin = rope(batch.position_ids)          # the positions of those tokens
    out = batch.attention(q, k, v, causal=True)  # q, k, v: logical [B_l, H, S_l, E] of them
    logits = batch.unshard(logits_l)             # [B, S, ...] again, on every rank

Dense batches (every row one whole sequence of a length the partition splits): every row is
split by the partition; local tensors are [B, S_local, ...]. Otherwise the batch becomes
packed sequences (THD) of its real tokens, one per row (``attention_mask``: 1 for real
tokens) or per document (``position_ids`` that restart inside a row, without a mask); local
tensors are [1, T_local, ...], whose padding slots (``real`` False) hold zeros.

Schedules that keep every token (``head_parallel``, ``replicated``) give every rank the whole
batch; under ``head_parallel`` (or ``hybrid`` with inner head_parallel) ``attention`` splits
the heads of the model's replicated q, k, v (``shard(replicated=True)``) and gathers the
output's heads.

Loss and gradients: let each rank's loss be the sum over its real tokens divided by the
global count of such tokens; the ranks' losses then add up to the one-process loss (``total``
gives it). Backward gives the replicated weights this rank's share of their gradient;
``sum_gradients`` adds the shares over the ranks that split the tokens, after which every
rank holds the one-process gradient.
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
    """This rank's part of a [B, S] batch under ``schedule`` (None: one device).

    ``shape`` (B, S) is read from ``attention_mask`` or ``position_ids`` when given.
    ``attention_mask`` [B, S] marks real tokens (1) and padding (0). ``position_ids`` [B, S]
    (or [1, S]) default to 0..S-1 in every row; without a mask, a position that does not
    follow the one before starts a new document, as in transformers' packed batches."""
    schedule = schedule if schedule is not None else _one_device()
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


def _one_device():
    from .replicated import Replicated

    return Replicated(None)


def _inputs(shape, attention_mask, position_ids, device):
    """(mask or None, positions [B, S], (B, S), device), checked."""
    given = [t for t in (attention_mask, position_ids) if t is not None]
    for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 2):
            raise ValueError(
                f"{name} must be a 2-D [B, S] tensor, got "
                f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}; a "
                f"4-D or additive mask cannot be read as padding: pass the 2-D 0/1 padding mask"
            )
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
            raise ValueError(
                f"attention_mask must hold 1 for real tokens and 0 for padding, got dtype "
                f"{attention_mask.dtype} and values {attention_mask.unique().tolist()[:6]}; pass "
                f"the tokenizer's 0/1 padding mask"
            )
        mask = attention_mask.to(device=device, dtype=torch.bool)
    if position_ids is None:
        positions = torch.arange(s, device=device).expand(b, s)
    elif position_ids.shape[1] != s or position_ids.shape[0] not in (1, b):
        raise ValueError(
            f"position_ids {list(position_ids.shape)} must be [B, S] = [{b}, {s}] (or [1, {s}])"
        )
    else:
        positions = position_ids.to(device=device, dtype=torch.long).expand(b, s)
    return mask, positions, (b, s), device


def _splits(schedule, seq_len: int) -> bool:
    """Whether every token split of ``schedule`` can split rows of ``seq_len`` tokens dense."""
    for s in reversed(schedule.token_splits):  # outer first
        if seq_len % s.partition.multiple(s.size):
            return False
        seq_len //= s.size
    return True


def _packing(schedule, cu: torch.Tensor) -> LocalPacking:
    """This rank's part of the packing ``cu`` of the real tokens (all of it where the
    schedule keeps every token)."""
    if schedule.token_splits:
        return schedule.pack(cu)
    packing, _ = global_packing(cu)
    return Split(Contiguous(), 1, packing, None, cu.device).part(0)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenBatch:
    """This rank's tokens of a [B, S] batch under ``schedule``; made by ``split``. Packed:
    ``rows`` are the real tokens' indices in the flattened [B*S] batch, in sequence order,
    ``packing`` this rank's ``LocalPacking`` of them (None: dense)."""

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
        """Index of every local token in the flattened [B*S] batch, [B_l, S_l] (-1: padding)."""
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
        """Positions (0..S-1) in its row of every local token of a dense batch."""
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
        """This rank's tokens of a full [B, S, ...] tensor: [B, S_l, ...] (dense) or
        [1, T_l, ...] (packed, padding slots ``fill``); differentiable."""
        self._check("t", t, self.shape, "the full batch")
        if not self.packed:
            return t.index_select(1, self._local_positions)
        local = self.packing.shard(t.flatten(0, 1).index_select(0, self.rows))
        if fill != 0:
            local = local.masked_fill(self.packing.token_index.view(-1, *[1] * (t.dim() - 2)) < 0,
                                      fill)
        return local[None]

    def unshard(self, t: torch.Tensor) -> torch.Tensor:
        """The full [B, S, ...] tensor on every rank from every rank's local tokens (padding
        positions 0); differentiable."""
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
        """``sdpa_fusion.attention`` of the local tokens' q [B_l, H, S_l, E] over k, v
        [B_l, H_kv, S_l, E] (logical), within each sequence (``window`` and the composed
        ``mask`` over the batch's sequences); the output like q. Under a head-splitting
        schedule q, k, v hold all heads: they are split here and the output's gathered."""
        packing = {}
        if self.packed:
            if any(t.dim() != 4 or t.shape[0] != 1 for t in (q, k, v)):
                raise ValueError(
                    f"q, k, v of a packed batch are [1, H, T_local, E] (the model's one row of "
                    f"this rank's tokens), got {[list(t.shape) for t in (q, k, v)]}; feed the "
                    f"model batch.shard(...) of its inputs"
                )
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

    # ---- over the ranks that split the tokens ---------------------------------------------
    def total(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``t`` over the ranks that split the tokens, detached: the
        one-process loss from the ranks' shares."""
        t = t.detach().clone()
        for s in self.schedule.token_splits:
            dist.all_reduce(t, group=s.group)
        return t

    def sum_gradients(self, parameters) -> None:
        """Add up the gradients of replicated ``parameters`` (a module's ``parameters()``)
        over the ranks that split the tokens, so every rank holds the one-process gradient."""
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
