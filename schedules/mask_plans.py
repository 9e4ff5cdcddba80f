"""Composed masks (``sdpa_fusion.masks``) over a split sequence: each rank's block calls
(pure decisions, no communication), ``masked.block_call`` of its ``Tokens`` (None where no
query sees a key). The ring takes only the steps at which some rank's queries see a key of
the block that arrives (a skipped step moves no bytes), allgather makes no call for gathered
keys that no local query sees, ulysses attends the whole sequence of its heads.
"""

from __future__ import annotations

import collections

import torch

from sdpa_fusion.mask_plan import Tokens, packed_tokens
from sdpa_fusion.masked import block_call


def rank_tokens(spec, partition, parts: int, rank: int, keys: bool = False) -> Tokens:
    """The ``Tokens`` of ``rank``'s queries (or ``keys``) of the local ``spec``."""
    packing = spec.packing
    if packing is not None:
        split = packing.split
        return Tokens(torch.where(split.real[rank], split.sequence(rank), -1),
                      split.positions[rank], split.partition.stride(split.parts))
    length = (spec.kv_len if keys else spec.q_len) * parts
    return Tokens.dense(partition.indices(length, parts, rank).cpu(), partition.stride(parts))


def _joined(tokens: list[Tokens]) -> Tokens:
    return Tokens(torch.cat([t.seq for t in tokens]), torch.cat([t.pos for t in tokens]),
                  tokens[0].stride)


def _batch(spec) -> int:
    return 1 if spec.packing is not None else spec.batch


_DENSE: collections.OrderedDict = collections.OrderedDict()  # the last dense plans
_KEPT = 64


def _cached(spec, key, build, *dense_key):
    """``build()``, made once per packing, or per mask, lengths and ``dense_key`` for dense
    blocks."""
    if spec.packing is not None:
        return spec.packing.cached((key, spec.mask), build)
    key = (key, spec.mask, *dense_key, spec.q_len, spec.kv_len, spec.batch)
    if key not in _DENSE:
        _DENSE[key] = build()
        while len(_DENSE) > _KEPT:
            _DENSE.popitem(last=False)
    return _DENSE[key]


def ring_plan(spec, partition, parts: int, rank: int) -> list:
    """(step, calls) of every ring step ``rank`` takes under ``spec.mask``: the own block
    (step 0) and the steps at which some rank's queries see a key of the block of the rank
    ``step`` before it."""
    def build():
        qs = [rank_tokens(spec, partition, parts, j) for j in range(parts)]
        ks = [rank_tokens(spec, partition, parts, j, keys=True) for j in range(parts)]
        calls = {(r, j): block_call(spec.mask, qs[r], ks[j], _batch(spec))
                 for r in range(parts) for j in range(parts)}
        needed = [s for s in range(parts)
                  if s == 0 or any(calls[r, (r - s) % parts] is not None for r in range(parts))]
        mine = [calls[rank, (rank - s) % parts] for s in needed]
        return [(s, [] if c is None else [c]) for s, c in zip(needed, mine)]

    return _cached(spec, "ring", build, partition, parts, rank)


def allgather_plan(spec, partition, parts: int, rank: int) -> tuple[list, list]:
    """(own calls, gathered calls) of ``rank`` under ``spec.mask``: the gathered keys in rank
    order (dense: the other ranks'; packed: every rank's, its own rows unused)."""
    def build():
        mine = rank_tokens(spec, partition, parts, rank)
        ks = [rank_tokens(spec, partition, parts, j, keys=True) for j in range(parts)]
        own_keys = ks[rank]
        if spec.packing is not None:
            ks[rank] = Tokens(torch.full_like(own_keys.seq, -1), own_keys.pos, own_keys.stride)
            others = _joined(ks)
        else:
            others = _joined(ks[:rank] + ks[rank + 1:]) if parts > 1 else None
        own = block_call(spec.mask, mine, own_keys, _batch(spec))
        gathered = None if others is None else block_call(spec.mask, mine, others, _batch(spec))
        return [c for c in (own,) if c is not None], [c for c in (gathered,) if c is not None]

    return _cached(spec, "allgather", build, partition, parts, rank)


def whole_call(spec, parts: int, lengths=None):
    """The call over the whole sequence of the local ``spec`` split over ``parts`` ranks
    (ulysses: every token of this rank's heads; packed: the real tokens of the sequences of
    ``lengths``, one after another)."""
    def build():
        if lengths is not None:
            starts = torch.cumsum(lengths, 0) - lengths
            tokens = packed_tokens(list(zip(starts.tolist(), lengths.tolist())),
                                   int(lengths.sum()))
            return block_call(spec.mask, tokens, tokens)
        return block_call(spec.mask, Tokens.dense(torch.arange(spec.q_len * parts)),
                          Tokens.dense(torch.arange(spec.kv_len * parts)), spec.batch)

    return _cached(spec, "whole", build, parts)
