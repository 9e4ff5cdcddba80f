"""Composed masks on one device (sdpa_fusion.masks): random masks against the reference with
the boolean mask built from the definitions (tests/masks.py), the calls a mask compiles to,
bad masks, and benchmarks/masks.py --tiny as a smoke test.
Run: pytest -q tests/test_masks.py"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sdpa_fusion
from benchmarks import masks as bench
from sdpa_fusion import mask_plan, masks
from sdpa_fusion.mask_plan import Tokens, pieces
from sdpa_fusion.masked import block_call
from tests import masks as described
from tests import reference
from tests.nonfinite import PoisonedDocuments

S = 40


@settings(max_examples=30, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(d=described.description(S, 2))
def test_random_masks_match_the_reference(monkeypatch, d):
    monkeypatch.setattr(mask_plan, "TILE", 8)
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, S, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, S, 8, generator=g) for _ in range(2))
    seen = torch.stack([described.boolean(d, b, S, S) for b in range(2)]).unsqueeze(1)
    want = reference.attention(q, k, v, dout, mask=seen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa_fusion.attention(*leaves, mask=described.built(d), kernel="reference")
    out.backward(dout)
    reference.assert_results((out, *(t.grad for t in leaves)), want, msg=str(d))


@settings(max_examples=40, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(d=described.description(S, 5), seqs=st.lists(st.integers(0, 4), min_size=1, max_size=5))
def test_a_mask_of_part_of_the_batch_is_its_rows(d, seqs):
    """``select(seqs)``, as a rank's part of a packed batch numbers its sequences from 0:
    element i sees what element seqs[i] of the whole batch sees (every kind of leaf, joined),
    made once per part."""
    mask = described.built(d)
    part = mask.select(seqs)
    q, k = torch.arange(S).unsqueeze(1), torch.arange(S).unsqueeze(0)
    for i, b in enumerate(seqs):
        assert torch.equal(part.visible(torch.tensor(i), q, k), described.boolean(d, b, S, S))
    assert mask.select(torch.tensor(seqs)) is part
    if not mask.batched:
        assert part is mask


def test_padding_slots_past_a_table_are_never_read():
    """A split pads sequences, and its padding slots carry positions past the sequence (past
    a document_ids table as long as the longest one): joined with a mask_mod, every pair is
    asked per tile, padding at position 0, and no padding slot is seen."""
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    mask = masks.document_ids(ids) & masks.mask_mod(lambda b, h, q, k: k <= q)
    seq = torch.tensor([0, 0, 0, -1, 0, 0, -1])
    pos = torch.tensor([0, 1, 2, 6, 3, 4, 5])
    tokens = Tokens(seq, pos)
    seen = torch.zeros(7, 7, dtype=torch.bool)
    for rows, keys, sees in (m for p in pieces(mask, tokens, tokens) for m in _members(p, 7)):
        seen[rows.unsqueeze(1), keys] |= sees
    want = (seq[:, None] >= 0) & (seq[None, :] >= 0) & (pos[None, :] <= pos[:, None]) & \
        (ids[0][pos.clamp(max=4)][:, None] == ids[0][pos.clamp(max=4)][None, :])
    assert torch.equal(seen, want)


def test_a_mask_keeps_its_tables():
    """Changing the tensors a mask was built from in place leaves the mask as built (plans
    made of it stay right)."""
    ids, n = torch.tensor([[0, 0, 1, 1]]), torch.tensor([2])
    mask = masks.document_ids(ids) | masks.prefix(n)
    q, k = torch.arange(4).unsqueeze(1), torch.arange(4).unsqueeze(0)
    before = mask.visible(torch.tensor(0), q, k)
    ids.fill_(0)
    n.fill_(4)
    assert torch.equal(mask.visible(torch.tensor(0), q, k), before)


def test_one_row_of_document_ids_serves_every_batch_element():
    """document_ids [1, S] broadcast over a batch of 2 (as tests/gpu/test_masks.py gives
    them); rows of another count are a ValueError naming the fix."""
    d = ("and", ("causal",), ("docs", torch.tensor([[0] * 15 + [1] * 25])))
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 2, S, 8, generator=g) for _ in range(4))
    seen = torch.stack([described.boolean(d, b, S, S) for b in range(2)]).unsqueeze(1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa_fusion.attention(*leaves, mask=described.built(d), kernel="reference")
    out.backward(dout)
    reference.assert_results((out, *(t.grad for t in leaves)),
                             reference.attention(q, k, v, dout, mask=seen))
    with pytest.raises(ValueError, match="document_ids has 3 rows but the call has 2 batch "
                                         "elements.*give one row, or one per batch element"):
        sdpa_fusion.attention(q, k, v, mask=masks.document_ids(torch.zeros(3, S, dtype=torch.long)))


def test_image_spans_compile_to_unmasked_and_causal_calls():
    """causal | spans over 12 tokens: rows 0-3 causal; rows 4-11 all of keys 0-7 (the span's
    rows and the later rows' earlier keys joined); rows 8-11 keys 8-11 causal. No call needs
    a window or an explicit mask."""
    every = Tokens.dense(torch.arange(12))
    found = pieces(masks.causal() | masks.bidirectional_spans([(4, 8)]), every, every)
    got = sorted((p.rows.indices(12)[:2], p.keys.indices(12)[:2], p.causal) for p in found)
    assert got == [((0, 4), (0, 4), True), ((4, 12), (0, 8), False), ((8, 12), (8, 12), True)]
    assert all(p.window is None and p.seen is None for p in found)


def test_spans_in_documents_compile_to_a_call_per_piece_without_merges():
    """benchmarks/masks.py's spans+docs at 1/4096 scale: 4 documents of 8 tokens, image
    spans in the second halves of documents 0 and 2. Each row is reached by one call (no
    log-sum-exp merge, out and dQ written in place); keys 0-3 and 16-19 by two (there the
    second call's dK, dV are added to the first's, fp32 math rounded once), every other key
    by one (written in place)."""
    every = Tokens.dense(torch.arange(32))
    mask = (masks.causal() | masks.bidirectional_spans([(4, 8), (20, 24)])) & \
        masks.document_ids(torch.arange(32) // 8)
    call = block_call(mask, every, every)
    got = sorted((p.rows.indices(32)[:2], p.keys.indices(32)[:2], p.causal)
                 for _, found in call.parts for p in found)
    assert got == [((0, 4), (0, 4), True), ((4, 8), (0, 8), False), ((8, 16), (8, 16), True),
                   ((16, 20), (16, 20), True), ((20, 24), (16, 24), False),
                   ((24, 32), (24, 32), True)]
    assert call.summed == ((), ((0, 4, 2), (16, 20, 2)))
    only_documents = block_call(masks.causal() & masks.document_ids(torch.arange(32) // 8),
                                every, every)
    assert only_documents.pieces == 4 and only_documents.summed == ((), ())


def test_plain_masks_take_the_plain_path():
    q = torch.randn(1, 2, 16, 8)
    plan = sdpa_fusion.plan(q, q, q, mask=masks.causal() & masks.window(4, 0))
    assert (plan.spec.mask, plan.spec.causal, plan.spec.window.left) == (None, True, 4)


def test_documents_count_only_visible_pairs():
    q = torch.randn(1, 2, 16, 8)
    ids = torch.tensor([0] * 8 + [1] * 8)
    plan = sdpa_fusion.plan(q, q, q, mask=masks.causal() & masks.document_ids(ids))
    assert plan.spec.flops() == 4 * 2 * 8 * (2 * 36)


@pytest.mark.parametrize("build,match", [
    (lambda: masks.document_ids([0, 1]), "document_ids has 2 positions"),
    (lambda: masks.bidirectional_spans([(3, 1)]), "0 <= start < stop"),
    (lambda: masks.chunked(0), "positive integer"),
    (lambda: masks.causal() & 3, "masks combine with masks"),
    (lambda: masks.mask_mod(lambda b, h, q, k: h > 0), "depends on the head"),
])
def test_bad_masks_are_value_errors(build, match):
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match=match):
        sdpa_fusion.attention(q, q, q, mask=build())


def test_benchmark_tiny(tmp_path):
    assert bench.main(["--tiny", "--results-dir", str(tmp_path), "--copy-to", ""]) == 0
    rows = json.loads((tmp_path / "masks.json").read_text())["rows"]
    assert {r["panel"] for r in rows} == {"causal", "spans", "spans+docs"}
    assert all(r["right"] and len(r["tflops_runs"]) == 3 for r in rows)
    assert all(len(r["vs_causal_runs"]) == 3 and r["tflops_min"] <= r["tflops"] <= r["tflops_max"]
               for r in rows)
    docs = next(r for r in rows if r["panel"] == "spans+docs")
    assert docs["ring_bytes"] < next(r for r in rows if r["panel"] == "causal")["ring_bytes"]


# packed documents (lengths, padding after each) for the tests of non-finite neighbours
_LENGTHS, _PADDING = [5, 11, 3, 9], [2, 0, 3, 1]
_POISONED = 1  # the document whose K and V get a non-finite value
_IDS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]])  # per position, as long as the longest


@pytest.mark.parametrize("tile", [4, 8, 128])
@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("d", [("mod", "sink", 2), ("and", ("mod", "batch", 2), ("docs", _IDS))],
                         ids=["mask_mod", "mask_mod&document_ids"])
def test_nonfinite_neighbours_leave_a_document_alone(monkeypatch, d, value, tile):
    """Packed documents with padding slots between them (cu_seqlens_padded) under a mask_mod:
    NaN or Inf in every padding slot's q, k and v, and in one document's K and V, leave every
    other document's out, dQ, dK and dV those of the reference on that document alone, and
    padding's results 0. A mask_mod's tiles run per document: masked entries of a tile over
    several documents still meet the other documents' keys and values (0 * NaN)."""
    monkeypatch.setattr(mask_plan, "TILE", tile)
    docs = PoisonedDocuments(_LENGTHS, _PADDING, 4, 2, value, _POISONED, seed=0)
    leaves = [t.clone().requires_grad_() for t in (docs.q, docs.k, docs.v)]
    out = sdpa_fusion.attention(*leaves, layout="thd", cu_seqlens=docs.cu,
                                cu_seqlens_padded=torch.tensor(docs.starts),
                                mask=described.built(d), kernel="reference")
    out.backward(docs.dout)
    got = (out.detach(), *(t.grad for t in leaves))
    for i, a, n in docs.others():
        one = [docs.document(t, a, n) for t in (*docs.clean, docs.dout)]
        seen = described.boolean(d, i, n, n)[None, None]
        want = reference.attention(*one, mask=seen)
        mine = [docs.document(t, a, n) for t in got]
        reference.assert_results(mine, want, msg=f"document {i}")
    real = docs.real
    for name, t in zip(reference.NAMES, got):
        assert torch.equal(t[~real], torch.zeros_like(t[~real])), f"{name} is 0 on padding"


def _members(p, n: int):
    """(rows, keys, seen) of each problem a piece's call attends: its own, or each member of
    its batch (pads left out)."""
    if p.batch is None:
        rows, keys = torch.arange(n)[p.rows], torch.arange(n)[p.keys]
        band = reference.visible(len(rows), len(keys), p.causal, p.window)
        seen = p.seen if p.seen is not None else torch.ones(len(rows), len(keys), dtype=torch.bool) \
            if band is None else band
        return [(rows, keys, seen)]
    b = p.batch
    return [(r[r >= 0], c[c >= 0], s[r >= 0][:, c >= 0]) for r, c, s in zip(b.rows, b.keys, b.seen)]


@pytest.mark.parametrize("draw", ["1-16", "16 then 1s"])
def test_short_documents_share_calls(monkeypatch, draw):
    """300 documents of 1-16 tokens under a causal mask_mod (tiles of 16), or documents of 16
    each followed by twenty of 1: the mask is asked for 256 documents' tiles at once; each
    document's tile alone would be a call; they run in
    batches spanning at most 8 tiles' rows, their members padded to the largest holding at
    most 8 tiles' scores, a few calls; every document's results those of the reference on
    that document alone."""
    monkeypatch.setattr(mask_plan, "TILE", 16)
    lengths = torch.randint(1, 17, (300,), generator=torch.Generator().manual_seed(1)).tolist() \
        if draw == "1-16" else ([16] + [1] * 20) * 14
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    asked = []
    mask = masks.mask_mod(lambda b, h, q, k: asked.append(b.shape) or q >= k)
    tokens = mask_plan.packed_tokens(list(zip(cu, lengths)), cu[-1])
    found = pieces(mask, tokens, tokens)
    # every document is one tile: the mask is asked for 256 of them at once
    assert len(asked) == -(-len(lengths) // mask_plan.SINGLE_TILES)
    assert sum(len(_members(p, cu[-1])) for p in found) == len(lengths)
    assert len(found) <= len(lengths) / 8
    for p in (p for p in found if p.batch is not None):
        rows = p.rows.stop - p.rows.start
        assert rows <= mask_plan.BATCH_TILES * 16
        assert p.batch.seen.numel() <= mask_plan.BATCH_TILES * 16 * 16
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(cu[-1], 2, 8, generator=g) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa_fusion.attention(*leaves, layout="thd", cu_seqlens=cu, mask=mask,
                                kernel="reference")
    out.backward(dout)
    for a, n in zip(cu, lengths):
        one = [PoisonedDocuments.document(t, a, n) for t in (q, k, v, dout)]
        want = reference.attention(*one, causal=True)
        mine = [PoisonedDocuments.document(t, a, n)
                for t in (out.detach(), *(x.grad for x in leaves))]
        reference.assert_results(mine, want, msg=f"document at {a}")


@pytest.mark.parametrize("past", [0, 3])
def test_diagonal_tiles_of_a_causal_mask_mod_run_as_causal_calls(monkeypatch, past):
    """A 64-token sequence under a mask_mod that keeps k <= q + past (tiles of 16): causal
    (past 0), its four diagonal tiles run as the kernel's causal calls, the tiles below
    unmasked, no explicit mask; with keys past the diagonal they keep their explicit mask (a
    kernel aligning causal bottom-right would misread a tile that is not square). Out and
    gradients those of the reference under that mask."""
    monkeypatch.setattr(mask_plan, "TILE", 16)
    mask = masks.mask_mod(lambda b, h, q, k: k <= q + past)
    tokens = mask_plan.packed_tokens([(0, 64)], 64)
    found = pieces(mask, tokens, tokens)
    causal = [p for p in found if p.causal]
    assert all(p.rows.stop - p.rows.start == p.keys.stop - p.keys.start for p in causal)
    if past == 0:
        assert len(causal) == 4 and all(p.seen is None and p.batch is None for p in found)
    else:
        assert not causal and any(p.seen is not None for p in found)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(64, 2, 8, generator=g) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa_fusion.attention(*leaves, layout="thd", cu_seqlens=[0, 64], mask=mask,
                                kernel="reference")
    out.backward(dout)
    seen = torch.arange(64).unsqueeze(0) <= torch.arange(64).unsqueeze(1) + past
    one = [PoisonedDocuments.document(t, 0, 64) for t in (q, k, v, dout)]
    want = reference.attention(*one, mask=seen)
    got = [PoisonedDocuments.document(t, 0, 64)
           for t in (out.detach(), *(x.grad for x in leaves))]
    reference.assert_results(got, want)


@st.composite
def _scattered(draw, length: int, sequences: int):
    """``Tokens`` of up to ``sequences`` sequences of up to ``length`` positions, each in one
    or two runs, the runs in any order with padding slots (any position) between them."""
    runs = []
    for s in range(draw(st.integers(1, sequences))):
        n = draw(st.integers(1, length))
        cut = draw(st.integers(0, n))
        runs += [(s, a, z) for a, z in ((0, cut), (cut, n)) if a < z]
    order = draw(st.permutations(runs))
    seq, pos = [], []
    for s, a, z in order:
        gap = draw(st.integers(0, 3))
        seq += [-1] * gap + [s] * (z - a)
        pos += [draw(st.integers(0, length - 1)) for _ in range(gap)] + list(range(a, z))
    return Tokens(torch.tensor(seq), torch.tensor(pos))


@settings(max_examples=60, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(d=described.description(12, 3), tokens=_scattered(12, 3))
def test_a_call_reads_one_sequence(monkeypatch, d, tokens):
    """Every call's rows and keys (each member's, in a batch of short sequences' tiles) are of
    one sequence, no padding (a masked entry still meets its key and value: 0 * NaN), and the
    calls see what the mask does, for every kind of mask (mask_mod tiles of 4 here),
    sequences in runs apart and padding between them."""
    monkeypatch.setattr(mask_plan, "TILE", 4)
    seq, pos = tokens.seq, tokens.pos
    n = len(seq)
    seen = torch.zeros(n, n, dtype=torch.bool)
    for rows_at, keys_at, sees in (m for p in pieces(described.built(d), tokens, tokens)
                                   for m in _members(p, n)):
        rows, keys = seq[rows_at], seq[keys_at]
        assert len(rows) and len(keys) and (rows[0] >= 0).all(), (rows_at, keys_at)
        assert (rows == rows[0]).all() and (keys == rows[0]).all(), (rows_at, keys_at)
        seen[rows_at.unsqueeze(1), keys_at] |= sees
    want = torch.zeros(n, n, dtype=torch.bool)
    for s in seq[seq >= 0].unique().tolist():
        mine = (seq == s).nonzero()[:, 0]
        full = described.boolean(d, s, 12, 12)
        want[mine.unsqueeze(1), mine] = full[pos[mine].unsqueeze(1), pos[mine]]
    assert torch.equal(seen, want), d
