"""Partition ``documents``: the planner as a table and its bounds, every rank's tokens and
positions, and describe() on a VirtualMesh (the runs under mpirun:
tests/distributed/test_thd_documents.py)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import schedules
import sdpa_fusion
from schedules import dry_run
from schedules.assign import (CUT, CUT_TOKEN_PAIRS, RING, STEP_PAIRS, ULYSSES, ULYSSES_KEPT,
                              assign, plan, work)
from schedules.documents import DocumentSplit
from schedules.partition import Concatenated, Documents, LoadBalanced
from schedules.whole import whole_pieces


@pytest.mark.parametrize("lengths, parts, tolerance, owner", [
    ([9, 7, 3, 3, 2, 2, 1, 1], 2, 0.05, (CUT, CUT, 0, 1, 0, 1, 0, 1)),
    ([9, 7, 3, 3, 2, 2, 1, 1], 2, 10.0, (CUT, 0, 1, 1, 1, 1, 1, 0)),  # 9 has a share's work
    ([4, 4, 4, 4], 2, 0.05, (0, 1, 0, 1)),
    ([4, 4, 4, 4], 4, 0.0, (0, 1, 2, 3)),
    ([0, 0, 5], 2, 0.05, (0, 0, CUT)),  # empty documents: anywhere
    ([30, 1], 2, 100.0, (CUT, 0)),  # longer than a rank's share: cut whatever the tolerance
    ([3, 3, 3], 1, 0.0, (0, 0, 0)),  # one rank holds everything whole
])
def test_assignment_table(lengths, parts, tolerance, owner):
    """Pairs alone (``token_pairs=0``, the picture of ``schedules.assign``)."""
    assert assign(lengths, parts, tolerance=tolerance, token_pairs=0).owner == owner


def test_a_long_document_among_short_ones_stays_whole_when_rows_cost_too():
    """One document of 100 tokens among forty of 10, P = 2: its 5,000 pairs exceed a rank's
    share of the pairs (3,500), so pairs alone cut it; counted with the cost of its rows it
    is a fifth of the work, and stays whole, the short documents balancing the ranks."""
    lengths = [100] + [10] * 40
    assert assign(lengths, 2, token_pairs=0).cut == (0,)
    a = assign(lengths, 2)
    assert not a.cut and a.tokens == (250, 250)
    assert max(a.imbalance) <= 1.05


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=40), st.sampled_from([2, 3, 4, 8]),
       st.sampled_from([0.0, 0.05, 0.2]), st.sampled_from([0, 600]))
def test_bounds(lengths, parts, tolerance, token_pairs):
    """Each rank's tokens and work within (1 + tolerance) of the mean, or every document cut;
    shares add up; no document longer than a rank's share stays whole."""
    a = assign(lengths, parts, tolerance=tolerance, token_pairs=token_pairs)
    total = sum(lengths)
    assert sum(a.tokens) == pytest.approx(total)
    assert sum(a.work) == pytest.approx(sum(work(n, token_pairs) for n in lengths))
    if any(o != CUT for o, n in zip(a.owner, lengths) if n):
        tokens, loads = a.imbalance
        assert tokens <= 1 + tolerance + 1e-9 and loads <= 1 + tolerance + 1e-9
    assert all(o == CUT for o, n in zip(a.owner, lengths) if n > total / parts)
    assert assign(lengths, parts, tolerance=tolerance, token_pairs=token_pairs) == a


def placed_by_the_rule(lengths, parts, tolerance, token_pairs):
    """The owners of schedules.assign's rule written plainly: cut what exceeds a share;
    place the rest largest first where the larger of the two ratios after it is least
    (then the fewest tokens, then the lowest rank); while unbalanced, cut the largest whole
    document too."""
    works = [work(n, token_pairs) for n in lengths]
    mean_t, mean_w = sum(lengths) / parts, sum(works) / parts
    ratio = lambda x, mean: x / mean if mean > 0 else 0.0  # noqa: E731
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cut = {i for i in order if parts > 1 and (lengths[i] > mean_t or works[i] > mean_w)}
    while True:
        tokens = [sum(lengths[i] for i in cut) / parts] * parts
        loads = [sum(works[i] for i in cut) / parts] * parts
        owner = [CUT] * len(lengths)
        for i in (i for i in order if i not in cut):
            r = min(range(parts), key=lambda r: (max(ratio(tokens[r] + lengths[i], mean_t),
                                                     ratio(loads[r] + works[i], mean_w)),
                                                 tokens[r], r))
            owner[i], tokens[r], loads[r] = r, tokens[r] + lengths[i], loads[r] + works[i]
        whole = [i for i in order if i not in cut]
        if not whole or (max(tokens) <= (1 + tolerance) * mean_t + 1e-9
                         and max(loads) <= (1 + tolerance) * mean_w + 1e-9):
            return tuple(owner)
        cut.add(whole[0])


@settings(max_examples=80, derandomize=True, database=None, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 5000)), max_size=60),
       st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([0.0, 0.05, 0.2]),
       st.sampled_from([0, 600]))
@example([2, 2, 1, 5, 3, 6, 5, 2], 2, 0.2, 0)  # a tie in ratio that the fewer tokens break
def test_placement_is_the_rule(lengths, parts, tolerance, token_pairs):
    """assign's placement loop (written for speed: it runs for every document of every new
    packing) places as the rule says."""
    a = assign(lengths, parts, tolerance=tolerance, token_pairs=token_pairs)
    assert a.owner == placed_by_the_rule(lengths, parts, tolerance, token_pairs)


def test_short_documents_stay_whole_and_balanced():
    """2048 documents of 128 tokens: none cut, every rank the same tokens."""
    for parts in (2, 4, 8):
        a = assign([128] * 2048, parts)
        assert not a.cut and a.imbalance == (1.0, 1.0)


def test_plan_cuts_over_groups_where_documents_fit_them():
    """Two documents longer than a rank's share (24 of 20 tokens) fit a group of two ranks
    (40): each is cut over its pair only. On the batches of benchmarks.thd: (a) and (c) cut
    over pairs and fours at P = 8; (d)'s longest document (61% of the work) over every rank
    and its second, which fits no rank beside its share of the first, over a pair (P = 4),
    a four (P = 8); every rank within the tolerance, where ``assign`` left (d)'s at 1.043."""
    from benchmarks.thd import BATCHES

    a = plan([24, 1, 3, 2, 5, 1, 4, 24, 1, 3, 2, 5, 1, 4], 4, tolerance=0.2)
    assert a.cut == (0, 7) and a.groups == ((0, 2), (2, 2))
    assert a.over[0] != a.over[7] and a.groups_of(1) == ((0, 2),)
    assert assign([24, 1, 3, 2, 5, 1, 4] * 2, 4, tolerance=0.2).groups == ((0, 4),)
    d = BATCHES["d"]
    longest, second = sorted(range(len(d)), key=lambda i: -d[i])[:2]
    for p, over in ((4, (0, 2)), (8, (0, 4))):
        planned = plan(d, p)
        assert planned.over[longest] == (0, p) and planned.over[second] == over
        assert max(planned.imbalance) <= 1.05
    assert max(assign(d, 4).imbalance) > 1.04
    for b in "ac":
        assert {size for _, size in plan(BATCHES[b], 8).groups} == {2, 4}


@settings(max_examples=80, derandomize=True, database=None, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 400)), min_size=1, max_size=40),
       st.sampled_from([2, 3, 4, 6, 8]), st.sampled_from([0.05, 0.2, 100.0]))
def test_plan_bounds(lengths, parts, tolerance):
    """``plan`` is ``assign`` or a nesting of groups: each cut document over a group of
    consecutive ranks whose size divides the line and whose first rank is a multiple of its
    size, groups nested (two are disjoint or one holds the other), a rank's tokens and work
    its whole documents plus its even shares of its groups' cut ones, every rank within the
    tolerance when any document stays whole, and no document cut over more ranks than
    ``assign`` cuts it over."""
    a, flat = plan(lengths, parts, tolerance=tolerance), assign(lengths, parts, tolerance=tolerance)
    if a == flat:
        return
    assert flat.cut and parts % 2 == 0
    for first, size in a.groups:
        assert parts % size == 0 and first % size == 0 and first + size <= parts
    for g, h in itertools.combinations(a.groups, 2):
        inside = g[0] <= h[0] and h[0] + h[1] <= g[0] + g[1]
        assert inside or h[0] + h[1] <= g[0] or g[0] + g[1] <= h[0]
    for r in range(parts):
        tokens = sum(lengths[i] for i in a.whole(r))
        loads = sum(work(lengths[i]) for i in a.whole(r))
        for g in a.groups_of(r):
            tokens += sum(lengths[i] for i in a.cut_over(g)) / g[1]
            loads += sum(work(lengths[i]) for i in a.cut_over(g)) / g[1]
        assert a.tokens[r] == pytest.approx(tokens) and a.work[r] == pytest.approx(loads)
    assert sum(a.tokens) == pytest.approx(sum(lengths))
    assert max(a.imbalance) <= 1 + tolerance + 1e-9


def split_of(lengths, parts, slack=None, tolerance=100.0, cut_partition=LoadBalanced()
             ) -> DocumentSplit:
    cu = (0, *torch.tensor(lengths).cumsum(0).tolist())
    padded = None if slack is None else (
        0, *torch.tensor([n + s for n, s in zip(lengths, slack)]).cumsum(0).tolist())
    return DocumentSplit(Documents(tolerance), parts, cu, padded, torch.device("cpu"),
                         cut_partition=cut_partition)


def test_rings_are_the_steps_and_cut_tokens_of_a_ranks_groups():
    """One document cut over ranks 0-3 and one over ranks 0-1: ranks 0-1 take 4 + 2 ring
    steps and their rings cut 176 + 64 tokens, of which they hold 44 + 32, ranks 2-3 four
    steps and 176 tokens, of which they hold 44; a rank's pairs are its whole documents' and
    its shares of the cut ones. Under ``ulysses`` a rank's exchanges cost by the tokens it
    holds of the cut documents alone."""
    lengths = [4 * n for n in (44, 1, 2, 16, 3, 1, 2, 3, 2, 1, 4, 2, 2, 3, 1, 2)]
    a = plan(lengths, 4)
    assert a.groups == ((0, 4), (0, 2)) and a.cut == (0, 3)
    assert [a.cost_terms(r)[2:] for r in range(4)] == [(6, 240, 76), (6, 240, 76),
                                                       (4, 176, 44), (4, 176, 44)]
    assert list(a.exchanges) == [STEP_PAIRS * 6 + CUT_TOKEN_PAIRS * 240] * 2 + [
        STEP_PAIRS * 4 + CUT_TOKEN_PAIRS * 176] * 2
    u = dataclasses.replace(a, exchange=ULYSSES)  # the same plan priced for ulysses
    assert [u.cost_terms(r) for r in range(4)] == [a.cost_terms(r) for r in range(4)]
    assert list(u.exchanges) == [ULYSSES.per_held_token * 76] * 2 + [
        ULYSSES.per_held_token * 44] * 2
    for r in range(4):
        pairs = sum(lengths[i] ** 2 / 2 for i in a.whole(r)) + 176 ** 2 / 2 / 4 \
            + (64 ** 2 / 2 / 2 if r < 2 else 0)
        assert a.cost_terms(r)[:2] == (pytest.approx(pairs), pytest.approx(a.tokens[r]))


def slowest(a) -> float:
    """The most work and rings of a rank of the plan ``a``."""
    return max(w + r for w, r in zip(a.work, a.exchanges))


@settings(max_examples=80, derandomize=True, database=None, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 400)), min_size=1, max_size=40),
       st.sampled_from([2, 4, 6, 8]), st.sampled_from([0.05, 0.2]),
       st.sampled_from([RING, ULYSSES, ULYSSES_KEPT]))
def test_whole_documents_are_placed_again_by_what_exchanges_cost(lengths, parts, tolerance,
                                                                  exchange):
    """``plan`` keeps the cuts of the plan by work alone (``exchanges=False``) and places its
    whole documents again only where that lowers the slowest rank's work and exchanges,
    within the same bounds; under an exchange of no ring steps (``ulysses``) it takes every
    cut over every rank (``groups=False``) where that costs the slowest rank less. Each
    rank's exchanges are priced by the steps, cut tokens and held tokens of its groups."""
    a, by_work = plan(lengths, parts, tolerance=tolerance, exchange=exchange), \
        plan(lengths, parts, tolerance=tolerance, exchange=exchange, exchanges=False)
    flat = plan(lengths, parts, tolerance=tolerance, exchange=exchange, groups=False)
    assert all(a.over[i] == (a.owner[i], 1) for i in range(len(lengths)) if a.owner[i] != CUT)
    if a.cut != by_work.cut or [a.over[i] for i in a.cut] != [by_work.over[i] for i in a.cut]:
        assert a == flat and exchange.per_step == 0 and slowest(a) < slowest(by_work)
    if exchange.per_step == 0:
        assert slowest(a) <= slowest(flat) + 1e-6
    if a not in (by_work, flat):
        assert slowest(a) < slowest(by_work)
        assert max(a.imbalance) <= 1 + tolerance + 1e-9
    for r in range(parts):
        groups = {a.over[i] for i in a.cut if a.over[i][0] <= r < a.over[i][0] + a.over[i][1]}
        cut = sum(lengths[i] for i in a.cut if a.over[i] in groups)
        held = sum(lengths[i] / a.over[i][1] for i in a.cut if a.over[i] in groups)
        assert a.exchanges[r] == pytest.approx(
            exchange.per_step * sum(size for _, size in groups)
            + exchange.per_cut_token * cut + exchange.per_held_token * held)


@pytest.mark.parametrize("batch, parts", [("c", 4), ("c", 8), ("d", 4), ("d", 8)])
def test_ranks_in_more_rings_take_less_whole_work(batch, parts):
    """On the batches of benchmarks.thd that cut documents over groups, the ranks whose
    rings cost more shed whole documents to the others: the slowest rank's work and rings
    drop by 0.5% or more (2.9% and 2.6% on (c) and (d) at P = 8), the tokens within 5%, and
    the rank of the costliest rings holds less work than the rank of the cheapest."""
    from benchmarks.thd import BATCHES

    a, by_work = plan(BATCHES[batch], parts), plan(BATCHES[batch], parts, exchanges=False)
    assert slowest(a) < 0.995 * slowest(by_work) and max(a.imbalance) <= 1.05
    most, least = (f(range(parts), key=lambda r: a.exchanges[r]) for f in (max, min))
    assert a.work[most] < a.work[least]


@pytest.mark.parametrize("batch, parts, gain, flat", [("a", 8, 0.015, True), ("c", 8, 0.05, True),
                                                     ("d", 8, 0.02, False)])
def test_ulysses_places_by_the_tokens_its_ranks_hold_of_cut_documents(batch, parts, gain, flat):
    """Under ``ulysses`` a rank's all-to-alls cost by the tokens it holds of its groups' cut
    documents, not by ring steps: placed for the ring, ranks 6-7 of (c) at P = 8 hold the most
    of them and are the slowest by ``ulysses``' costs. Placed for ``ulysses`` the slowest
    rank's work and exchanges drop by 1.5% on (a), 5% on (c), 2% on (d), within the bounds:
    (a) and (c) cut every document over every rank, which evens the tokens held, (d) keeps
    its groups and places its whole documents again. The schedule's packing is planned so."""
    from benchmarks.thd import BATCHES

    lengths = BATCHES[batch]
    for_ring = dataclasses.replace(plan(lengths, parts), exchange=ULYSSES)  # priced so
    a = plan(lengths, parts, exchange=ULYSSES)
    assert slowest(a) < (1 - gain) * slowest(for_ring) and max(a.imbalance) <= 1.05
    if flat:
        assert a == plan(lengths, parts, exchange=ULYSSES, groups=False)
        assert a.groups == ((0, parts),)
    else:
        assert a.cut == for_ring.cut and a.over == tuple(
            for_ring.over[i] if o == CUT else (o, 1) for i, o in enumerate(a.owner))
    cu = [0, *itertools.accumulate(lengths)]
    for name, options, exchange in (("ulysses", {}, ULYSSES), ("ring", {}, RING),
                                    ("ulysses", {"keep_forward": True}, ULYSSES_KEPT)):
        mesh = sdpa_fusion.VirtualMesh((parts,), ("seq",), rank=0)
        packing = schedules.get(name, mesh, partition="documents", **options).pack(cu)
        assert packing.assignment == plan(lengths, parts, exchange=exchange)


def test_every_token_once_whole_documents_first():
    """a = 2, b = 8 (cut), c = 3, d = 1 over 2 ranks (schedules.documents' picture)."""
    split = split_of([2, 8, 3, 1], 2)
    assert split.assignment.owner == (1, CUT, 0, 1)
    assert split.rows(0).tolist() == [10, 11, 12, 2, 3, 8, 9]
    assert split.rows(1).tolist() == [0, 1, 13, 4, 5, 6, 7]
    assert split.positions(1).tolist() == [0, 1, 0, 2, 3, 4, 5]
    assert split.part_packing(1) == ((0, 2, 3, 7), (0, 2, 3, 7))
    assert [split.part(r).tokens for r in (0, 1)] == [7, 7]


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 300)), min_size=1, max_size=40),
       st.sampled_from([2, 3, 4, 8]), st.integers(1, 6))
@example([0, 3, 0, 2, 0, 30, 0, 2, 0, 3], 2, 2)  # empty documents join a run with tokens
def test_whole_pieces_cover_the_whole_documents_by_work(lengths, parts, count):
    """The pieces run beside the cut groups' transfers: consecutive runs of a rank's whole
    documents, each once, in order, each with a token, as many as asked where documents
    allow; each within one document's work of an even share."""
    split = split_of(lengths, parts, tolerance=0.05)
    spec = sdpa_fusion.AttentionSpec(1, 2, 2, 8, 8, 8, causal=True)
    for r in range(parts):
        local = split.part(r)
        pieces = whole_pieces(spec.replace(packing=local), count)
        assert whole_pieces(spec.replace(packing=local), count) is pieces  # made once a batch
        whole = local.whole_lengths
        assert len(pieces) == min(count, sum(n > 0 for n in whole))
        if not pieces:
            continue
        assert all(rows.stop > rows.start for rows, _ in pieces)
        assert [rows.start for rows, _ in pieces] == [0, *(rows.stop for rows, _ in pieces[:-1])]
        assert pieces[-1][0].stop == local.whole_tokens
        docs = [n for _, piece in pieces for n in torch.tensor(piece.cu_seqlens).diff().tolist()]
        assert tuple(docs) == whole
        for rows, piece in pieces:
            assert piece.packing is None and piece.q_len == rows.stop - rows.start
            assert piece.cu_seqlens[0] == 0 and piece.cu_seqlens[-1] == piece.q_len
        works = [sum(work(n) for n in torch.tensor(p.cu_seqlens).diff().tolist())
                 for _, p in pieces]
        assert max(works) <= sum(works) / len(pieces) + max(work(n) for n in whole) + 1e-6


@settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.sampled_from([2, 3, 4, 8]),
       st.booleans(), st.sampled_from([0.05, 100.0]),
       st.sampled_from([LoadBalanced(), Concatenated()]))
def test_rows_cover_the_batch(lengths, parts, padded, tolerance, cut_partition):
    """Every real token is on exactly one rank, at its position inside its document; local
    cu_seqlens delimit each rank's tokens; cut packings split load-balanced (the ring's) or
    concatenated (ulysses')."""
    slack = [n % 3 for n in lengths] if padded else None
    split = split_of(lengths, parts, slack, tolerance, cut_partition)
    starts = split.starts.tolist()
    rows = torch.cat([split.rows(r) for r in range(parts)])
    real = rows[rows >= 0]
    want = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    assert torch.equal(torch.sort(real).values, want)
    for r in range(parts):
        local = split.part(r)
        assert len(split.rows(r)) == local.tokens == local.cu_seqlens_padded[-1]
        doc = torch.searchsorted(torch.tensor(starts), split.rows(r), right=True) - 1
        at = split.rows(r) >= 0
        assert torch.equal(split.positions(r)[at], split.rows(r)[at] - split.starts[doc[at]])
        assert int(local.seqlens.sum()) == int(at.sum())


def test_describe_counts_each_rank_and_only_cut_documents_travel():
    """On every rank of a VirtualMesh: FLOPs add up to the batch's, bytes come from the cut
    documents only."""
    p, lengths = 4, [1, 3, 0, 40, 2, 5, 1, 4, 6, 2]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, kv = torch.randn(int(cu[-1]), 4, 8), torch.randn(int(cu[-1]), 2, 8)
    spec = sdpa_fusion.AttentionSpec.from_tensors(q, kv, kv, layout="thd",
                                                  cu_seqlens=cu, causal=True)
    flops, sent = 0.0, []
    for r in range(p):
        mesh = sdpa_fusion.VirtualMesh((p,), ("seq",), rank=r)
        for name in ("ring", "allgather"):
            d = schedules.get(name, mesh, partition=Documents(100.0)).describe(spec)
            flops += d.flops if name == "ring" else 0.0
            sent.append(d.bytes_sent)
            assert "whole documents" in d.notes and d.memory.outputs > 0
    assert flops == pytest.approx(spec.flops(), rel=0.02)  # cut parts: padding rounds
    assert min(sent) > 0
    whole = spec.replace(cu_seqlens=(0, 2, 4, 6, 8), q_len=8, kv_len=8)
    mesh = sdpa_fusion.VirtualMesh((p,), ("seq",))
    d = schedules.get("ring", mesh, partition="documents").describe(whole)
    assert (d.bytes_sent, d.backward_bytes_sent, d.steps) == (0, 0, 1)


@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("partition", ["documents", "load_balanced"])
def test_kernel_calls_are_the_calls_a_rank_makes(name, partition):
    """``kernel="auto"`` weighs a way's host time once per call the schedule makes on the
    rank's sequences: ``kernel_calls`` is what the kernel of a dry run receives in a forward,
    on every rank (documents: 40 tokens cut over every rank, 8 over ranks 0-1, and the whole
    ones' pieces; one call when every document is whole; a rank that makes none counts one,
    as the kernel choice weighs every call past the first)."""
    lengths = [1, 3, 0, 40, 2, 8, 1, 4, 6, 2]
    for p, packed in ((2, lengths), (4, lengths), (4, [2, 2, 2, 2])):
        cu = (0, *torch.tensor(packed).cumsum(0).tolist())
        spec = sdpa_fusion.AttentionSpec(1, 8, 8, cu[-1], cu[-1], 8, layout="thd",
                                         cu_seqlens=cu, causal=True)
        for rank in range(p):
            sched = schedules.get(name, sdpa_fusion.VirtualMesh((p,), ("seq",), rank=rank),
                                  partition=partition, head_groups=1)
            calls = sched.kernel_calls(sched.local_spec(spec))
            made = dry_run.run(sched, spec)[0].calls
            assert calls == max(made, 1), (p, packed, rank)  # none made: the way's one
            if partition == "documents" and packed != lengths:
                assert calls == 1


@pytest.mark.parametrize("window,calls", [(None, 6), ((3, 0), 2), ((20, 0), 4)])
def test_ring_kernel_calls_are_those_of_the_steps_it_takes(window, calls):
    """A rank calls the kernel on the blocks its queries see: causal over a contiguous split
    rank 5 of 8 sees its own block and the five before; a window of 3 keys (blocks of 8
    rows) its own and the one before, one of 20 keys three blocks back."""
    mesh = sdpa_fusion.VirtualMesh((8,), ("seq",), rank=5)
    sched = schedules.get("ring", mesh, partition="contiguous")
    q = torch.randn(1, 2, 8, 8)
    plan = sdpa_fusion.plan(q, q, q, layout="bhse", causal=True, schedule=sched, window=window)
    steps, _ = sched._plan(plan.spec, 8, 8)
    assert sched.kernel_calls(plan.spec) == calls == sum(len(c) for _, c in steps)


@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
def test_hybrid_kernel_calls_are_its_outer_rings(inner):
    """The outer ring's steps over the cut document (40 tokens), and rank 1's two whole
    documents (3 and 5 tokens) in two pieces beside its transfers."""
    lengths = [3, 40, 5, 8]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mesh = sdpa_fusion.VirtualMesh((2, 2), ("heads", "seq"), rank=3)
    sched = schedules.get("hybrid", mesh, inner=inner)
    local = sched.pack(cu)
    q = torch.randn(local.tokens, 4, 8) if inner == "ulysses" else torch.randn(local.tokens, 2, 8)
    plan = sdpa_fusion.plan(q, q, q, layout="thd", causal=True, schedule=sched, cu_seqlens=local)
    assert sched.kernel_calls(plan.spec) == sched.outer.size + 2 == 4


def test_bad_tolerance_or_groups():
    with pytest.raises(ValueError, match=r"tolerance=-1 must be a number >= 0"):
        Documents(tolerance=-1)
    with pytest.raises(ValueError, match=r"groups='no' must be True .* or False"):
        Documents(groups="no")


def test_groups_false_cuts_over_every_rank():
    """``Documents(groups=False)``: the plan is ``assign``'s, a split's one group every rank;
    the option is part of the partition's identity and its repr."""
    lengths = [24, 1, 3, 2, 5, 1, 4] * 2
    assert plan(lengths, 4, groups=False) == assign(lengths, 4)
    split = split_of(lengths, 4, tolerance=0.2)
    flat = DocumentSplit(Documents(0.2, groups=False), 4, split.cu_seqlens, None,
                         torch.device("cpu"))
    assert [[g for g, _, _ in flat.part(r).cuts] for r in range(4)] == [[(0, 4)]] * 4
    assert [[g for g, _, _ in split.part(r).cuts] for r in range(4)] == [
        [(0, 2)], [(0, 2)], [(2, 2)], [(2, 2)]]
    assert Documents(groups=False) != Documents()
    assert repr(Documents(0.2, groups=False)) == "documents(tolerance=0.2, groups=False)"


def test_a_rank_of_two_groups_stores_each_cut_packing_after_its_whole_documents():
    """One document cut over every rank and one over ranks 0-1: rank 0 stores its whole
    documents, its part of the first, then of the second; its rows, positions and cu_seqlens
    follow, and every token is on one rank."""
    lengths = [4 * n for n in (44, 1, 2, 16, 3, 1, 2, 3, 2, 1, 4, 2, 2, 3, 1, 2)]
    split = split_of(lengths, 4, tolerance=0.05)
    a = split.assignment
    assert a.groups == ((0, 4), (0, 2)) and a.over[0] == (0, 4) and a.over[3] == (0, 2)
    local = split.part(0)
    (g0, rows0, cut0), (g1, rows1, cut1) = local.cuts
    assert (g0, g1) == ((0, 4), (0, 2)) and rows0.start == local.whole_tokens
    assert rows1.start == rows0.stop and rows1.stop == local.tokens
    starts = split.starts.tolist()
    # load-balanced: 176 tokens in 8 chunks of 22, 64 in 4 chunks of 16; rank 0 holds the
    # first and the last chunk of each
    first_and_last = lambda n, c: [*range(c), *range(n - c, n)]  # noqa: E731
    assert split.rows(0)[rows0].tolist() == [starts[0] + i for i in first_and_last(176, 22)]
    assert split.rows(0)[rows1].tolist() == [starts[3] + i for i in first_and_last(64, 16)]
    assert split.positions(0)[rows1].tolist() == first_and_last(64, 16)
    cu, padded = local.offsets
    assert padded[-1] == local.tokens and cu[-1] == int((split.rows(0) >= 0).sum())
    every = torch.cat([split.rows(r) for r in range(4)])
    assert sorted(every[every >= 0].tolist()) == list(range(sum(lengths)))


def test_ulysses_takes_documents_but_not_auto():
    """Ulysses takes ``documents`` when named (CPU ranks: tests/distributed/
    test_thd_documents.py); the cost model's ``auto`` is the ring's and allgather's."""
    mesh = sdpa_fusion.VirtualMesh((2,), ("seq",))
    assert schedules.get("ulysses", mesh, partition="documents").partition.name == "documents"
    with pytest.raises(ValueError, match=r"partition='auto' .* 'ring', 'allgather' and "
                                         r"'hybrid', not 'ulysses'; name partition="):
        schedules.get("ulysses", mesh, partition="auto")


@settings(max_examples=30, derandomize=True, database=None, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 3), st.integers(0, 60)), min_size=1, max_size=16),
       st.sampled_from([2, 4, 8]))
def test_ulysses_cut_documents_travel_in_the_order_they_are_attended(lengths, parts):
    """Under ``ulysses`` each group's cut packing is split concatenated: every rank of the
    group holds a run of its documents one after another, so the tokens it sends arrive in
    the order they are attended and its results go home with no gather (``Routes.in_order``);
    the ring keeps load-balanced chunks of each document."""
    from schedules.ulysses import Routes, packed_placement

    cu = (0, *torch.tensor(lengths).cumsum(0).tolist())
    for rank in range(parts):
        mesh = sdpa_fusion.VirtualMesh((parts,), ("seq",), rank=rank)
        ulysses = schedules.get("ulysses", mesh, partition=Documents(0.05))
        ring = schedules.get("ring", mesh, partition=Documents(0.05))
        local, ring_local = ulysses.pack(cu), ring.pack(cu)
        for (group, _, cut), (_, _, ring_cut) in zip(local.cuts, ring_local.cuts):
            assert cut.partition == Concatenated() and ring_cut.partition == LoadBalanced()
            place = packed_placement(cut.split)
            assert place.in_order
            routes = Routes.of(place, rank - group[0])
            assert torch.equal(routes.back, torch.arange(routes.total))


@pytest.mark.parametrize("batch", ["a", "c", "d"])
def test_ulysses_head_groups_do_not_depend_on_how_cut_documents_are_split(batch, monkeypatch):
    """A group's call attends each cut document whole with 1/P of the heads, so its head
    groups are sized by the longest document / P, whatever the split: a concatenated split
    (a rank may hold a whole 32K document of (a)) takes the groups load-balanced chunks take."""
    from benchmarks.thd import BATCHES
    from schedules.ulysses import Ulysses
    from schedules.whole import cut_specs

    cu = (0, *torch.tensor(BATCHES[batch]).cumsum(0).tolist())
    groups = {}
    for cut_partition in (LoadBalanced(), Concatenated()):
        monkeypatch.setattr(Ulysses, "cut_partition", cut_partition)
        for rank in range(8):
            mesh = sdpa_fusion.VirtualMesh((8,), ("seq",), rank=rank)
            sched = schedules.get("ulysses", mesh, partition=Documents(0.05))
            spec = sdpa_fusion.AttentionSpec(
                batch=1, heads=32, kv_heads=32, q_len=cu[-1], kv_len=cu[-1], head_dim=128,
                dtype=torch.bfloat16, causal=True, layout="thd", cu_seqlens=cu)
            for group, _, cut in cut_specs(sched.local_spec(spec)):
                q = torch.empty((cut.q_len, 32, 128), device="meta")
                count = len(sched.twin(group).groups_of(q, q, cut))
                groups.setdefault((rank, group), []).append(count)
    assert groups and all(a == b for a, b in groups.values())


def test_auto_takes_documents_where_the_model_says_faster():
    """The default partition: whole documents when none must be cut, or when the model
    predicts them faster; load_balanced where that is faster (and when named); dense
    sequences split as load_balanced; describe says which and why."""
    mesh = sdpa_fusion.VirtualMesh((4,), ("seq",))
    ring = schedules.get("ring", mesh)
    assert repr(ring.partition) == "auto"
    short = (0, *torch.tensor([64] * 32).cumsum(0).tolist())
    assert ring.partition_choice(short, None)[0] == "documents"
    assert "no document needs cutting" in ring.partition_choice(short, None)[1]
    one_long = (0, 4096, *(4096 + 16 * i for i in range(1, 9)))  # must be cut: all of it travels
    name, why = ring.partition_choice(one_long, None)
    assert name in ("documents", "load_balanced") and "predicted" in why
    q = torch.randn(short[-1], 2, 8)
    spec = sdpa_fusion.AttentionSpec.from_tensors(q, q, q, layout="thd", cu_seqlens=short,
                                                  causal=True)
    assert schedules.get("ring", mesh).describe(spec).notes.startswith(
        "partition auto: documents (no document needs cutting")
    named = schedules.get("ring", mesh, partition="load_balanced")
    assert not hasattr(named.pack(short), "assignment")
    assert named.describe(spec).notes.startswith("partition load_balanced;")
    assert torch.equal(ring.position_ids(32), named.position_ids(32))


def test_the_twin_and_dry_copies_keep_plans_of_their_own():
    """``attention`` keeps a schedule's plans in ``kept_plans``: the copies that run the cut
    documents (with another partition) and dry runs start without them, and the fields the
    ranks agree on leave them out."""
    from schedules import dry_run

    ring = schedules.get("ring", sdpa_fusion.VirtualMesh((2,), ("seq",), rank=0),
                         partition="documents")
    ring.kept_plans["a call"] = (ring, {})  # a plan holds its schedule
    assert not ring.twin().kept_plans
    assert not dry_run._dry(ring, {}).kept_plans
    assert ring.kept_plans == {"a call": (ring, {})}
    # a cache, not configuration: the ranks' agreement does not read it
    assert not any("kept" in name for name in ring.configuration())
