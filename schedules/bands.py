"""Sliding windows over a split sequence: the kernel calls of a block, each with a top-left
window in its own coordinates (pure decisions, no communication).

A rank holds its tokens of a sequence as *runs*: local rows [row, row + n) at positions first,
first + stride, ... (``load_balanced`` gives two runs, ``contiguous`` one, ``striped`` one of
stride P). The query at position a sees the key at b when a - left <= b <= a + right
(``mask.band``); between a run of queries and a run of keys whose first positions differ by
d = first_q - first_k that is, in the runs' own rows i and j,

    i - (left - d) // stride  <=  j  <=  i + (right + d) // stride

A negative side is cut from the front (the keys before the band's left edge, or the queries
before its right edge) to 0, and rows and keys past the band are cut too; a band that leaves
nothing is no call (a ring skips a step no rank needs), one that leaves every pair no mask.

    load_balanced, P = 2, S = 16 (chunks of 4), causal window of 2 (band (2, 0)):
    rank 0 holds 0-3 | 12-15, rank 1 holds 4-7 | 8-11

    rank 0's queries 12-15 vs rank 1's keys 8-11: d = 4, left side 2 - 4 = -2 < 0:
        keys 8, 9 cut; queries 12, 13 vs keys 10, 11 with window (0, 2); 14, 15 cut
    rank 0's queries 0-3 vs rank 1's keys 4-7: right side 0 - 4 < 0: every row cut, no call
    rank 0's queries 12-15 vs its own 0-3: d = 12, left side 2 - 12 <= -4: no call

Packed sequences: one varlen call holds the segments that share one window, one shift (keys
minus queries) and one diagonal of run pairs, so that it takes each query row at most once.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from sdpa_fusion.mask import _UNBOUNDED, Cut, Window, band, cut

from .calls import DenseCall, packed_call, ranges

MAX_RUNS = 2  # runs of one sequence a rank may hold under a window (calls grow as its square)


def window_band(spec) -> tuple[int | None, int | None] | None:
    """The band of ``spec`` when its window masks more than ``causal`` does, else None."""
    if spec.window is None:
        return None
    mask = band(spec.causal, spec.window)
    return None if mask == band(spec.causal, None) else mask


@dataclasses.dataclass(frozen=True, eq=False)
class Runs:
    """The runs of every rank's part of every sequence, as [P, N, K] host tensors (K: the most
    runs of one part): first local row, tokens (0: no such run) and the position of the
    first token in its sequence."""

    row: torch.Tensor
    count: torch.Tensor
    first: torch.Tensor
    stride: int

    @property
    def most(self) -> int:
        """The most runs any rank holds of one sequence."""
        return int((self.count > 0).sum(-1).max()) if self.count.numel() else 0


def run_index(positions: torch.Tensor, real: torch.Tensor, seq: torch.Tensor,
              stride: int = 1) -> torch.Tensor:
    """[P, T]: which run of its sequence's part each local token belongs to (-1: padding),
    from every rank's token ``positions`` and ``real`` [P, T] and each row's ``seq`` [T]; a run
    goes on while positions step by ``stride``."""
    start = real.clone()
    new_sequence = torch.ones_like(seq, dtype=torch.bool)
    new_sequence[1:] = seq[1:] != seq[:-1]
    start[:, 1:] &= new_sequence[1:] | (positions[:, 1:] != positions[:, :-1] + stride)
    seen = torch.cumsum(start.long(), dim=1) - 1  # runs so far on the rank, minus one
    sequences = int(seq.max()) + 1 if len(seq) else 0
    firsts = torch.full((len(positions), sequences), _UNBOUNDED, dtype=torch.long)
    rank_seq = seq.expand_as(seen)
    firsts.scatter_reduce_(1, rank_seq, torch.where(real, seen, _UNBOUNDED), "amin")
    return torch.where(real, seen - firsts.gather(1, rank_seq), -1)


def find_runs(positions: torch.Tensor, real: torch.Tensor, seq: torch.Tensor, sequences: int,
              stride: int) -> Runs:
    """The ``Runs`` of tokens laid out as ``run_index`` reads them, over ``sequences``."""
    run = run_index(positions, real, seq, stride)
    parts, tokens = positions.shape
    k = int(run.max()) + 1 if run.numel() else 0
    cell = torch.where(real, seq * k + run, sequences * k)  # padding: one cell past the end
    count = torch.zeros(parts, sequences * k + 1, dtype=torch.long)
    count.scatter_add_(1, cell, real.long())
    row = torch.full_like(count, max(tokens - 1, 0))
    row.scatter_reduce_(1, cell, torch.arange(tokens).expand_as(cell), "amin")
    first = positions.gather(1, row) if tokens else torch.zeros_like(row)
    shape = (parts, sequences, k)
    return Runs(row[:, :-1].reshape(shape), count[:, :-1].reshape(shape),
                first[:, :-1].reshape(shape), stride)


@functools.lru_cache(maxsize=64)
def dense_runs(partition, seq_len: int, parts: int) -> Runs:
    """The ``Runs`` of one sequence of ``seq_len`` tokens split by ``partition``."""
    positions = torch.stack([partition.indices(seq_len, parts, r) for r in range(parts)])
    seq = torch.zeros(positions.shape[1], dtype=torch.long)
    return find_runs(positions, torch.ones_like(positions, dtype=torch.bool), seq, 1,
                     partition.stride(parts))


def packed_runs(split) -> Runs:
    """The ``Runs`` of every sequence of a packing ``split`` (``schedules.packing.Split``)."""
    return find_runs(split.positions, split.real, split.seq, len(split.lengths),
                     split.partition.stride(split.parts))


def _pair_cut(runs_q: Runs, rank_q, runs_k: Runs, rank_k, mask) -> Cut:
    """The ``Cut`` of every query run of ``rank_q`` against every key run of ``rank_k``."""
    n_q, n_k = runs_q.count[rank_q][..., :, None], runs_k.count[rank_k][..., None, :]
    offset = runs_q.first[rank_q][..., :, None] - runs_k.first[rank_k][..., None, :]
    return cut(n_q, n_k, offset, runs_q.stride, mask)


def ring_steps(runs_q: Runs, runs_k: Runs, mask) -> list[int]:
    """The ring steps some rank computes at: 0, and s when some rank needs the block s back."""
    parts = len(runs_q.count)
    ranks = torch.arange(parts)
    steps = [0]
    for step in range(1, parts):
        c = _pair_cut(runs_q, ranks, runs_k, (ranks - step) % parts, mask)
        if bool((c.rows > 0).any()):
            steps.append(step)
    return steps


def _window(c: Cut, index, mask) -> Window | None:
    """The window of the pair at ``index`` of ``c`` (None: no mask)."""
    if bool(c.full[index]):
        return None
    left, right = (None if side is None else int(t[index])
                   for side, t in zip(mask, (c.left, c.right)))
    return Window(left, right)


def dense_calls(runs_q: Runs, rank: int, runs_k: Runs, source: int, mask, *,
                key_base: int = 0) -> list[DenseCall]:
    """The calls of ``rank``'s queries against ``source``'s keys of one dense sequence."""
    c = _pair_cut(runs_q, rank, runs_k, source, mask)
    s_q = int(runs_q.count[rank].sum())
    calls = []
    for index in (c.rows[0] > 0).nonzero().tolist():
        a, b = index
        at = (0, a, b)
        r0 = int(runs_q.row[rank, 0, a] + c.row_cut[at])
        k0 = key_base + int(runs_k.row[source, 0, b] + c.key_cut[at])
        rows = slice(None) if (r0, int(c.rows[at])) == (0, s_q) else slice(r0, r0 + int(c.rows[at]))
        calls.append(DenseCall(rows, slice(k0, k0 + int(c.keys[at])), False, _window(c, at, mask)))
    return calls


def packed_calls(runs: Runs, rank: int, source: int, mask, *, tokens: tuple[int, int], device,
                 key_base: int = 0) -> list:
    """The varlen calls of ``rank``'s queries against ``source``'s keys of every sequence."""
    c = _pair_cut(runs, rank, runs, source, mask)
    kept = (c.rows > 0).nonzero()  # [M, 3]: sequence, query run, key run, in sequence order
    if not len(kept):
        return []
    seq, a, b = kept.unbind(1)
    at = (seq, a, b)
    sides = [torch.full_like(seq, -1) if side is None else t[at]
             for side, t in zip(mask, (c.left, c.right))]
    full, rows, keys = c.full[at], c.rows[at], c.keys[at]
    diagonal = (b - a) % runs.count.shape[-1]
    shift = (keys - rows).masked_fill(full, 0)  # kernels align a mask by keys minus queries
    groups = torch.stack([full.long(), *(s.masked_fill(full, -1) for s in sides), shift,
                          diagonal], 1)
    kinds, which = torch.unique(groups, dim=0, return_inverse=True)
    row_start = runs.row[rank][seq, a] + c.row_cut[at]
    key_start = key_base + runs.row[source][seq, b] + c.key_cut[at]
    calls = []
    for g in range(len(kinds)):
        sel = which == g
        first = tuple(t[sel][0] for t in at)  # every segment of the group has its window
        calls.append(packed_call(ranges(row_start[sel], rows[sel]), rows[sel],
                                 ranges(key_start[sel], keys[sel]), keys[sel], causal=False,
                                 tokens=tokens, device=device, window=_window(c, first, mask)))
    return calls


def spec_runs(spec, partition, parts: int) -> tuple[Runs, Runs]:
    """(query runs, key runs) of this rank's local ``spec`` split by ``partition``."""
    packing = spec.packing
    if packing is not None:
        runs = packing.cached(("bands", "runs"), lambda: packed_runs(packing.split))
        return runs, runs
    return (dense_runs(partition, spec.q_len * parts, parts),
            dense_runs(partition, spec.kv_len * parts, parts))


def check_runs(spec, partition, parts: int, schedule: str) -> None:
    """A ValueError when ``partition`` gives a rank more runs of a sequence than a window takes."""
    most = max(r.most for r in spec_runs(spec, partition, parts))
    if most > MAX_RUNS:
        window = (spec.window.left, spec.window.right)
        raise ValueError(f"window={window} under schedule {schedule!r} makes one kernel call per "
                         f"pair of runs of a rank's tokens (positions stepping by the partition's "
                         f"stride), at most {MAX_RUNS} runs per sequence; partition "
                         f"{partition.name!r} gives a rank {most} runs over {parts} ranks. Use "
                         f"partition 'load_balanced', 'contiguous' or 'striped', or schedule "
                         f"'ulysses' or 'head_parallel' (the window over the whole sequence)")


def ring_plan(spec, mask, partition, parts: int, rank: int):
    """(steps, travel) of ``rank`` under the band ``mask``: (step, calls) of every ring step it
    takes (at step s the block of rank (rank - s) mod P); ``travel`` = (n, starts), the rows
    [starts[j], starts[j] + n) of rank j's block that travel (the widest hull of the keys any
    rank's remote calls use, so every block has one shape), the remote calls' keys counted in
    them; None when that is the whole block, and for packed sequences."""
    packing = spec.packing
    if packing is None:
        return _dense_ring_plan(mask, partition, parts, rank, spec.q_len * parts,
                                spec.kv_len * parts)

    def build():
        runs, _ = spec_runs(spec, partition, parts)
        tokens = (packing.tokens, packing.tokens)
        return [(step, packed_calls(runs, rank, (rank - step) % parts, mask, tokens=tokens,
                                    device=packing.device))
                for step in ring_steps(runs, runs, mask)]

    return packing.cached(("ring", mask), build), None


@functools.lru_cache(maxsize=64)
def _dense_ring_plan(mask, partition, parts, rank, q_len, kv_len):
    steps = _dense_ring_steps(mask, partition, parts, rank, q_len, kv_len)
    travel = _travelling_rows(mask, partition, parts, q_len, kv_len)
    if travel is None:
        return steps, None
    s_kv, starts = kv_len // parts, travel[1]
    return [(step, calls if step == 0 else
             [_in_travelling_rows(c, starts[(rank - step) % parts], s_kv) for c in calls])
            for step, calls in steps], travel


@functools.lru_cache(maxsize=64)
def _dense_ring_steps(mask, partition, parts, rank, q_len, kv_len):
    runs_q, runs_k = dense_runs(partition, q_len, parts), dense_runs(partition, kv_len, parts)
    return [(step, dense_calls(runs_q, rank, runs_k, (rank - step) % parts, mask))
            for step in ring_steps(runs_q, runs_k, mask)]


@functools.lru_cache(maxsize=64)
def _travelling_rows(mask, partition, parts, q_len, kv_len):
    s_kv = kv_len // parts
    hulls: dict[int, tuple[int, int]] = {}
    for rank in range(parts):
        for step, calls in _dense_ring_steps(mask, partition, parts, rank, q_len, kv_len):
            source = (rank - step) % parts
            for call in calls if step else ():
                start, stop, _ = call.keys.indices(s_kv)
                low, high = hulls.get(source, (s_kv, 0))
                hulls[source] = (min(low, start), max(high, stop))
    n = max((high - low for low, high in hulls.values()), default=s_kv)
    if n >= s_kv:
        return None
    return n, tuple(min(hulls.get(j, (0, 0))[0], s_kv - n) for j in range(parts))


def _in_travelling_rows(call: DenseCall, start: int, s_kv: int) -> DenseCall:
    """``call`` with its keys counted from row ``start`` of the block of ``s_kv`` rows."""
    first, stop, _ = call.keys.indices(s_kv)
    return dataclasses.replace(call, keys=slice(first - start, stop - start))
