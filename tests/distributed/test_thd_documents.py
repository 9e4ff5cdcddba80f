"""Packed batches split by whole documents (partition ``documents``) under ring, allgather,
ulysses and hybrid vs the reference per document: random packings, empty and one-token
documents, every document short (nothing travels), one longer than a rank's share, windows,
GQA; positions and unshard with ranks holding different numbers of tokens (the planner's
table and bounds: tests/test_documents.py).

    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_thd_documents.py
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import schedules
import sdpa_fusion
from schedules.assign import RING
from schedules.partition import Documents
from sdpa_fusion import masks
from tests import reference

from .conftest import assert_matches, make_problem, run_schedule
from .packed import (assert_packed_matches, assert_round_trip, global_positions, make_packed,
                     run_packed)
from .test_hybrid import meshes, shapes  # noqa: F401  (the 2-D meshes of this world)
from .test_thd import SAME_ON_EVERY_RANK
from .test_traffic import assert_bytes, step

KEEP_WHOLE = Documents(tolerance=100.0)  # cuts only what must be cut: small tests keep documents
SCHEDULES = ["ring", "allgather", "ulysses"]


def heads(name: str, p: int, h: int, h_kv: int) -> dict:
    """``h`` query and ``h_kv`` K/V heads, times ``p`` under ulysses (whose cut documents
    split their heads over a group of ranks, a divisor of ``p``); one K/V head stays one
    (each rank of a group then attends with it, replicated)."""
    times = p if name == "ulysses" else 1
    return dict(h=h * times, h_kv=h_kv if h_kv == 1 else h_kv * times)


@st.composite
def packings(draw, p: int):
    """(lengths, padding slack or None, window or None, causal, GQA, tolerance)."""
    n = draw(st.integers(1, 2 * p + 2))
    lengths = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    if draw(st.booleans()):  # one document longer than a rank's share
        lengths.insert(draw(st.integers(0, n)), sum(lengths) + draw(st.integers(1, 4 * p)))
    if sum(lengths) == 0:
        lengths[0] = 1
    slack = draw(st.none() | st.lists(st.integers(0, 2), min_size=len(lengths),
                                      max_size=len(lengths)))
    window = draw(st.none() | st.tuples(st.integers(0, 3), st.none() | st.integers(0, 2)))
    return (lengths, slack, window, draw(st.booleans()), draw(st.booleans()),
            draw(st.sampled_from([0.05, 100.0])))


@pytest.mark.parametrize("name", SCHEDULES)
def test_random_packings_match_reference(mesh, name):
    """Forward and backward exact per document, zero on padding; positions are those inside
    each document; every token unshards to its place."""
    p = mesh.size()

    @settings(max_examples=6, **SAME_ON_EVERY_RANK)
    @given(packings(p))
    def check(drawn):
        lengths, slack, window, causal, gqa, tolerance = drawn
        problem = make_packed(lengths, **heads(name, p, 2, 1 if gqa else 2), slack=slack,
                              causal=causal, window=window, scale=0.5)
        sched = schedules.get(name, mesh, partition=Documents(tolerance=tolerance))
        assert_packed_matches(problem, run_packed(sched, problem))
        local = sched.pack(problem.cu_seqlens, problem.cu_seqlens_padded)
        assert torch.equal(local.position_ids, local.shard(global_positions(problem)))

    check()


MASKED_LENGTHS = [20, 3, 5, 4, 6, 2, 3, 80, 7, 1, 0, 9]  # 80 is cut at every P


def per_document(kind: str):
    """(mask, seen(b, n) -> [n, n] bool): masks that differ between documents, and what
    document b of n tokens sees under each, written out."""
    docs = len(MASKED_LENGTHS)
    if kind == "prefix":
        n = [(3 * b) % 7 for b in range(docs)]
        return (masks.causal() | masks.prefix(n),
                lambda b, q, k: (k <= q) | ((q < n[b]) & (k < n[b])))
    if kind == "spans":
        spans = [(b % 3, b % 3 + 2 + b % 4) for b in range(docs)]
        return (masks.causal() | masks.bidirectional_spans([[s] for s in spans]),
                lambda b, q, k: (k <= q) | ((q >= spans[b][0]) & (q < spans[b][1])
                                            & (k >= spans[b][0]) & (k < spans[b][1])))
    if kind == "ids":
        ids = torch.arange(max(MASKED_LENGTHS)) // torch.arange(2, docs + 2).unsqueeze(1)
        return (masks.causal() & masks.document_ids(ids),
                lambda b, q, k: (k <= q) & (ids[b][q] == ids[b][k]))
    return (masks.mask_mod(lambda b, h, q, k: (k <= q) & (q - k <= b % 5)),
            lambda b, q, k: (k <= q) & (q - k <= b % 5))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("kind", ["prefix", "spans", "ids", "mask_mod"])
def test_masks_that_differ_between_documents(mesh, name, kind):
    """A mask names a document by its index in the batch; a rank's whole documents and each
    cut packing are numbered from 0 on the rank, so each takes its documents' rows of the
    mask (``Mask.select``): forward and backward per document against the reference."""
    p = mesh.size()
    sched = schedules.get(name, mesh, partition="documents")
    split = sched.pack(torch.tensor([0, *itertools.accumulate(MASKED_LENGTHS)])).split
    renumbered = [split.whole(r).tolist() != list(range(len(split.whole(r)))) for r in range(p)]
    assert any(renumbered) and split.assignment.cut  # numbered apart from the batch: both
    assert_per_document_mask(sched, kind, **heads(name, p, 2, 2))


@shapes
@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
def test_hybrid_masks_that_differ_between_documents(meshes, shape, inner):  # noqa: F811
    """The same with documents over the outer dim of hybrid."""
    pi, _ = shape
    sched = schedules.get("hybrid", meshes(shape), inner=inner, outer="ring",
                          partition="documents")
    for kind in ("prefix", "mask_mod"):
        assert_per_document_mask(sched, kind, h=2 * pi, h_kv=2 * pi)


def assert_per_document_mask(sched, kind: str, h: int, h_kv: int) -> None:
    """Forward and backward of MASKED_LENGTHS under ``per_document(kind)`` against the
    reference, document by document."""
    mask, seen = per_document(kind)
    problem = make_packed(MASKED_LENGTHS, h=h, h_kv=h_kv)
    kw = dict(layout="thd", cu_seqlens=problem.cu_seqlens)
    shards = [sched.shard(t, **kw).requires_grad_() for t in (problem.q, problem.k, problem.v)]
    out = sdpa_fusion.attention(*shards, mask=mask, kernel="reference", schedule=sched, **kw)
    out.backward(sched.shard(problem.dout, **kw))
    got = [sched.unshard(t, **kw) for t in (out, *(s.grad for s in shards))]
    cu = problem.cu_seqlens.tolist()
    for b, (a, z) in enumerate(zip(cu, cu[1:])):
        if z == a:
            continue
        pos = torch.arange(z - a)
        views = [t[a:z].transpose(0, 1).unsqueeze(0).double()
                 for t in (problem.q, problem.k, problem.v, problem.dout)]
        want = reference.attention(*views, mask=seen(b, pos.unsqueeze(1), pos.unsqueeze(0)))
        for what, g, w in zip(reference.NAMES, got, want.results):
            reference.assert_close(g[a:z], w[0].transpose(0, 1), torch.float32,
                                   msg=f"{what} of document {b}")


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("window", [None, (3, 0)], ids=["causal", "window"])
def test_one_long_document_and_short_ones(mesh, name, window):
    """The long document is cut (its K/V travel), the short ones stay whole; ranks hold
    different numbers of tokens."""
    p = mesh.size()
    lengths = [1, 3, 0, 8 * p + 3, 2, 5, 1, 4]
    problem = make_packed(lengths, **heads(name, p, 4, 2), causal=True, window=window)
    sched = schedules.get(name, mesh, partition=KEEP_WHOLE)
    local = sched.pack(problem.cu_seqlens)
    assert local.assignment.cut == (3,)
    assert local.whole_tokens == sum(lengths[i] for i in local.assignment.whole(mesh.rank))
    assert_packed_matches(problem, run_packed(sched, problem, local=True))


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_row_cut(mesh, name):
    """One document (and empty ones): every rank's rows are cut, its results the cut
    documents' schedule's as they are."""
    p = mesh.size()
    problem = make_packed([0, 8 * p + 3, 0], **heads(name, p, 4, 2), causal=True)
    sched = schedules.get(name, mesh, partition=KEEP_WHOLE)
    local = sched.pack(problem.cu_seqlens)
    assert local.assignment.cut == (1,) and local.whole_tokens == 0
    assert_packed_matches(problem, run_packed(sched, problem, local=True))


@pytest.mark.parametrize("name", SCHEDULES)
def test_short_documents_move_nothing(mesh, name):
    """Every document whole: the call sends and receives nothing (the agreement aside), as
    describe() says, and each rank's tokens are within one document of the mean."""
    p = mesh.size()
    lengths = [3, 1, 4, 1, 5, 2, 6, 2, 3, 5] * p
    problem = make_packed(lengths, **heads(name, p, 2, 2), causal=True)
    sched = schedules.get(name, mesh, partition=KEEP_WHOLE)
    kw = dict(layout="thd", cu_seqlens=problem.cu_seqlens)
    d, forward, backward = step(sched, problem.q, problem.k, problem.v, problem.dout, kw)
    assert d.bytes_sent == d.backward_bytes_sent == 0
    assert_bytes(d, forward, backward, sched.group)
    local = sched.pack(problem.cu_seqlens)
    assert not local.assignment.cut
    assert abs(local.tokens - sum(lengths) / p) <= max(lengths)


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("name", SCHEDULES)
def test_cut_documents_move_what_describe_says(mesh, name):
    p = mesh.size()
    # 12p tokens: more than a rank's share, so cut (and 6p + 1 too at P >= 4)
    problem = make_packed([6 * p + 1, 2, 0, 3, 1, 12 * p], **heads(name, p, 4, 2), causal=True)
    sched = schedules.get(name, mesh, partition=KEEP_WHOLE)
    kw = dict(layout="thd", cu_seqlens=problem.cu_seqlens)
    d, forward, backward = step(sched, problem.q, problem.k, problem.v, problem.dout, kw)
    assert d.bytes_sent > 0
    assert_bytes(d, forward, backward, sched.group)


def right_and_moving_as_described(sched, problem):
    """Exact per document, and the step sends and receives what ``describe()`` says, which
    it returns."""
    assert_packed_matches(problem, run_packed(sched, problem, local=True))
    kw = dict(layout="thd", cu_seqlens=problem.cu_seqlens,
              cu_seqlens_padded=problem.cu_seqlens_padded)
    d, forward, backward = step(sched, problem.q, problem.k, problem.v, problem.dout, kw)
    assert_bytes(d, forward, backward, sched.group)
    return d


def grouped_lengths(groups: int) -> list[int]:
    """Per group of two ranks, one document longer than a rank's share (24 of 40 tokens)
    and short ones: each fits a group whole (``schedules.assign.plan``)."""
    return [24, 1, 3, 0, 2, 5, 1, 4] * groups


@pytest.mark.parametrize("name", SCHEDULES)
def test_documents_cut_within_groups_of_ranks(mesh, name):
    """With room in groups of two ranks, each long document is cut over its group only:
    exact per document, its K/V travel inside the group, as describe() says; every rank
    stays within the tolerance. Three ranks (no group size divides them) cut over all."""
    p = mesh.size()
    problem = make_packed(grouped_lengths(max(p // 2, 1)), **heads(name, p, 4, 2), causal=True,
                          slack=[0, 1, 0, 2, 0, 0, 1, 0] * max(p // 2, 1))
    sched = schedules.get(name, mesh, partition=Documents(tolerance=0.2))
    local = sched.pack(problem.cu_seqlens, problem.cu_seqlens_padded)
    grouped = p >= 4 and p % 2 == 0
    [((first, size), _, _)] = local.cuts
    assert (first, size) == ((mesh.rank // 2 * 2, 2) if grouped else (0, p))
    assert max(local.assignment.imbalance) <= 1.2 + 1e-9
    d = right_and_moving_as_described(sched, problem)
    if grouped:
        assert f"cut over ranks {first}-{first + 1}" in d.notes


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_document_over_every_rank_and_one_over_a_pair(mesh, name, monkeypatch):
    """At even P >= 4 the longest document is cut over every rank, the second over the first
    half of them (it fits no rank beside its share of the first; at P = 8 a third over ranks
    0-1): those ranks run several cut packings' schedules, exact per document, bytes as
    describe() says (its notes name every group). Planned for the ring's exchanges:
    ``ulysses``' own would cut both over every rank, which evens its ranks' held tokens."""
    p = mesh.size()
    lengths = [p * n for n in (44, 1, 2, 16, 3, 1, 2, 3, 2, 1, 4, 2, 2, 3, 1, 2)]
    problem = make_packed(lengths, **heads(name, p, 4, 2), causal=True,
                          slack=[0, 1, 0, 2, 0, 0, 1, 0] * 2)
    sched = schedules.get(name, mesh, partition="documents")
    monkeypatch.setattr(type(sched), "exchange", RING)
    local = sched.pack(problem.cu_seqlens, problem.cu_seqlens_padded)
    groups = [g for g, _, _ in local.cuts]
    nested = p >= 4 and p % 2 == 0
    if nested:
        assert local.assignment.over[0] == (0, p) and local.assignment.over[3] == (0, p // 2)
    assert groups == list(local.assignment.groups_of(mesh.rank))
    assert max(local.assignment.imbalance) <= 1.05 + 1e-9
    d = right_and_moving_as_described(sched, problem)
    for first, size in groups:
        over = "every rank" if size == p else f"ranks {first}-{first + size - 1}"
        assert f"cut over {over}" in d.notes


def test_unshard_of_uneven_parts_is_differentiable(mesh):
    """unshard(shard(x)) is x (zero in the global padding slots); the gradient of the full
    result reaches this rank's tokens only."""
    p = mesh.size()
    problem = make_packed([4, 0, 1, 7, 2, 6 * p, 3], h=2, slack=[1, 0, 2, 0, 0, 1, 0])
    sched = schedules.get("ring", mesh, partition=KEEP_WHOLE)
    assert_round_trip(sched, problem)


@shapes
@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
@pytest.mark.parametrize("outer", ["ring", "allgather"])
def test_hybrid_outer(meshes, shape, inner, outer):  # noqa: F811
    """Documents over the outer dim, split again (ulysses) or by heads (head_parallel)."""
    pi, po = shape
    problem = make_packed([2, 5, 0, 8 * pi * po + 1, 3, 1], h=2 * pi, h_kv=pi, causal=True,
                          slack=[0, 1, 0, 2, 0, 0])
    sched = schedules.get("hybrid", meshes(shape), inner=inner, outer=outer,
                          partition=KEEP_WHOLE)
    assert_packed_matches(problem, run_packed(sched, problem, kv_copies=True))
    local = sched.pack(problem.cu_seqlens, problem.cu_seqlens_padded)
    assert torch.equal(local.position_ids, local.shard(global_positions(problem)))


@shapes
def test_hybrid_outer_cuts_within_groups_of_outer_ranks(meshes, shape):  # noqa: F811
    """With room in groups of two outer ranks, the outer ring cuts each long document over
    its group of the outer line only (rank (i, o) with o's pair)."""
    pi, po = shape
    lengths = grouped_lengths(max(po // 2, 1))
    problem = make_packed(lengths, h=2 * pi, h_kv=pi, causal=True)
    sched = schedules.get("hybrid", meshes(shape), inner="ulysses", outer="ring",
                          partition=Documents(tolerance=0.2))
    assert_packed_matches(problem, run_packed(sched, problem, kv_copies=True))
    outer = sched.outer.split(tuple(problem.cu_seqlens.tolist()), None, "cpu")
    size = 2 if po >= 4 and po % 2 == 0 else po
    assert {s for _, s in outer.assignment.groups} == ({size} if po > 1 else set())


@pytest.mark.parametrize("name", SCHEDULES)
def test_dense_sequences_split_as_load_balanced(mesh, name):
    """A dense batch has no documents: each sequence is split as ``load_balanced``, and runs
    as it does there."""
    p = mesh.size()
    sched = schedules.get(name, mesh, partition="documents")
    balanced = schedules.get(name, mesh, partition="load_balanced")
    assert torch.equal(sched.position_ids(8 * p), balanced.position_ids(8 * p))
    problem = make_problem(h=2 * p, s=8 * p, causal=True)
    assert_matches(problem, run_schedule(sched, problem))


@pytest.mark.usefixtures("several_ranks")
def test_ulysses_heads_that_a_cut_group_cannot_split(mesh):
    """A document cut over every rank, heads not divisible by them: every rank raises the
    same ValueError naming heads and the cut, on every call; a call with heads that divide
    runs right after."""
    p = mesh.size()
    sched = schedules.get("ulysses", mesh, partition=KEEP_WHOLE)
    lengths = [2, 8 * p + 3, 1]
    bad = make_packed(lengths, h=p + 1, h_kv=p + 1, causal=True)
    for _ in range(2):
        with pytest.raises(ValueError, match=rf"cuts 1 document\(s\) over ranks 0-{p - 1}, "
                                             rf"which run schedule 'ulysses' .* heads={p + 1} "
                                             rf"must be divisible by the {p} ranks"):
            run_packed(sched, bad)
    good = make_packed(lengths, **heads("ulysses", p, 2, 1), causal=True)
    assert_packed_matches(good, run_packed(sched, good))


def test_ulysses_one_kv_head_for_a_group(mesh):
    """One K/V head for every rank of the groups that cut documents (at even P >= 4 also a
    group of ranks 0-1 alone): each of them attends with it (replicated) and its dK/dV come
    back summed among the group's ranks only, exact per document and moving what describe()
    says."""
    p = mesh.size()
    lengths = [p * n for n in (44, 1, 2, 16, 3, 1, 2, 3, 2, 1, 4, 2, 2, 3, 1, 2)]
    problem = make_packed(lengths, h=2 * p, h_kv=1, causal=True, window=(5, 0))
    sched = schedules.get("ulysses", mesh, partition="documents")
    assert sched.pack(problem.cu_seqlens).cuts  # every rank runs a cut group here
    right_and_moving_as_described(sched, problem)
