"""The kernel calls of sliding windows over split sequences (``schedules.bands``), single
process: table cases, the ring steps a window needs, and for every partition, rank count,
length and window that the calls of every pair of ranks compute each visible query-key
pair exactly once (dense and packed), with no call, row or key that sees nothing, and every
packed call one varlen call of flash and of FA4 (one shift).

Run: pytest -q tests/test_bands.py
Oracle: the band written out on global positions (a - left <= b <= a + right), and the
windows of the calls read through ``tests.reference.visible``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from schedules.bands import dense_calls, dense_runs, packed_calls, packed_runs, ring_steps
from schedules.calls import DenseCall, row_index
from schedules.packing import Split
from schedules.partition import Contiguous, LoadBalanced, Striped
from sdpa_fusion.kernels.fa4 import varlen_shift
from sdpa_fusion.kernels.flash_window import flash_call
from sdpa_fusion.mask import Window, band
from tests.reference import visible

LB, CO, ST = LoadBalanced(), Contiguous(), Striped()
WINDOWS = [(0, 0), (1, 0), (3, 2), (None, 1), (2, None), (5, 0), (0, 3), (100, 100)]


def seen(a: torch.Tensor, b: torch.Tensor, mask) -> torch.Tensor:
    """[len(a), len(b)]: the query at position a[i] sees the key at position b[j]."""
    left, right = mask
    d = a[:, None] - b[None, :]
    out = torch.ones(len(a), len(b), dtype=torch.bool)
    if left is not None:
        out &= d <= left
    if right is not None:
        out &= -d <= right
    return out


def call_mask(n_q: int, n_k: int, call) -> torch.Tensor:
    """What a call's kernel computes on its n_q x n_k block (the reference's top-left mask)."""
    m = visible(n_q, n_k, call.causal, call.window)
    return torch.ones(n_q, n_k, dtype=torch.bool) if m is None else m


# ---- tables ----------------------------------------------------------------------------------
def test_load_balanced_blocks_of_the_module_drawing():
    """P = 2, S = 16, causal window of 2: rank 0 holds 0-3 | 12-15, rank 1 holds 4-11."""
    runs, mask = dense_runs(LB, 16, 2), band(True, Window(2, 0))
    assert dense_calls(runs, 0, runs, 1, mask) == [DenseCall(slice(4, 6), slice(6, 8), False,
                                                             Window(0, 2))]
    assert dense_calls(runs, 0, runs, 0, mask) == [
        DenseCall(slice(0, 4), slice(0, 4), False, Window(2, 0)),
        DenseCall(slice(4, 8), slice(4, 8), False, Window(2, 0))]
    # rank 1's chunks meet: one run, one call
    assert dense_calls(runs, 1, runs, 1, mask) == [DenseCall(slice(None), slice(0, 8), False,
                                                             Window(2, 0))]
    assert dense_calls(runs, 1, runs, 0, mask) == [DenseCall(slice(0, 2), slice(2, 4), False,
                                                             Window(0, 2))]


@pytest.mark.parametrize("partition, parts, s, window, causal, steps", [
    (CO, 4, 32, (3, 0), True, [0, 1]),         # a causal window within a chunk: the neighbour
    (CO, 4, 32, (3, 3), False, [0, 1, 3]),     # both sides: both neighbours
    (LB, 4, 32, (3, 0), True, [0, 1, 3]),      # the late chunk's neighbour is rank r + 1
    (LB, 4, 32, (40, 0), True, [0, 1, 2, 3]),  # past the sequence: every step
    (ST, 4, 32, (1, 0), True, [0, 1]),         # stripes: the previous token is rank r - 1's
    (CO, 4, 32, (0, 0), False, [0]),           # the diagonal: no transfer at all
    (CO, 1, 8, (2, 0), True, [0]),
])
def test_ring_steps(partition, parts, s, window, causal, steps):
    runs, mask = dense_runs(partition, s, parts), band(causal, Window(*window))
    assert ring_steps(runs, runs, mask) == steps


# ---- every pair of ranks: each visible pair exactly once ---------------------------------------
def dense_cases():
    for partition, parts in itertools.product((LB, CO, ST), (1, 2, 3, 4)):
        for s, causal, window in itertools.product((2 * parts, 6 * parts), (False, True), WINDOWS):
            yield partition, parts, s, band(causal, Window(*window))


def test_dense_calls_cover_the_band_exactly():
    for partition, parts, s, mask in dense_cases():
        runs = dense_runs(partition, s, parts)
        positions = [partition.indices(s, parts, r) for r in range(parts)]
        for r, j in itertools.product(range(parts), repeat=2):
            covered = torch.zeros(s // parts, s // parts, dtype=torch.long)
            for call in dense_calls(runs, r, runs, j, mask):
                rows, keys = range(s // parts)[call.rows], range(s // parts)[call.keys]
                m = call_mask(len(rows), len(keys), call)
                assert m.any(1).all() and m.any(0).all(), f"{call}: a row or key sees nothing"
                covered[rows.start:rows.stop, keys.start:keys.stop] += m.long()
            want = seen(positions[r], positions[j], mask).long()
            assert torch.equal(covered, want), f"{partition.name} P={parts} S={s} {mask} {r}<-{j}"


def packed_cases():
    g = torch.Generator().manual_seed(5)
    for trial in range(60):
        partition = (LB, CO, ST)[trial % 3]
        parts = 1 + trial % 4
        n = int(torch.randint(1, 6, (1,), generator=g))
        lengths = torch.randint(0, 4 * parts + 3, (n,), generator=g).tolist() + [0, 1]
        cu = (0, *itertools.accumulate(lengths))
        padded = None
        if trial % 2:
            slack = torch.randint(0, 4, (len(lengths),), generator=g).tolist()
            padded = (0, *itertools.accumulate(a + b for a, b in zip(lengths, slack)))
        causal, window = trial % 5 < 2, WINDOWS[trial % len(WINDOWS)]
        split = Split(partition, parts, cu, padded, torch.device("cpu"))
        yield split, band(causal, Window(*window))


def test_packed_calls_cover_the_band_exactly():
    for split, mask in packed_cases():
        runs, t = packed_runs(split), split.tokens
        for r, j in itertools.product(range(split.parts), repeat=2):
            covered = torch.zeros(t, t, dtype=torch.long)
            for call in packed_calls(runs, r, j, mask, tokens=(t, t), device="cpu"):
                rows, keys = row_index(call.rows, t), row_index(call.keys, t)
                assert len(rows.unique()) == len(rows), f"{call}: a query row twice in one call"
                mask_of_call = band(call.causal, call.window)
                assert flash_call(call.seqlens, len(rows), len(keys), mask_of_call) is not None
                assert varlen_shift(call.seqlens, call.causal, call.window) is not None
                cu_q, cu_k = call.seqlens.cu_q, call.seqlens.cu_k
                for i in range(len(cu_q) - 1):
                    rr, kk = rows[cu_q[i]:cu_q[i + 1]], keys[cu_k[i]:cu_k[i + 1]]
                    m = call_mask(len(rr), len(kk), call)
                    assert m.any(1).all() and m.any(0).all(), f"{call}: a segment sees nothing"
                    covered[rr[:, None], kk[None, :]] += m.long()
            same = split.seq[:, None] == split.seq[None, :]
            real = split.real[r][:, None] & split.real[j][None, :]
            want = same & real & seen(split.positions[r], split.positions[j], mask)
            assert torch.equal(covered, want.long()), f"{split.cu_seqlens} {mask} {r}<-{j}"


def test_packed_calls_group_sequences_by_window():
    """Sequences whose late chunk meets the early one at different distances: the partial
    ones come out with the same window (0, left) and share one call."""
    split = Split(LB, 2, (0, 16, 32, 40), None, torch.device("cpu"))
    runs = packed_runs(split)
    calls = packed_calls(runs, 0, 1, band(True, Window(2, 0)), tokens=(20, 20), device="cpu")
    assert [(c.window, len(c.seqlens.lengths_q)) for c in calls] == [(Window(0, 2), 3)]
