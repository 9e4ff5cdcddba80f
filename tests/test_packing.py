"""How packed sequences are split over ranks (no communication): every real token on one rank,
padding added per sequence and kept last, TransformerEngine's token sets, positions, video tiles.

    python -m pytest tests/test_packing.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from schedules import partition as partitions
from schedules.packing import Split, global_packing, split_by_partition
from schedules.partition import VideoTiles
from schedules.ring import block_case, packed_calls
from sdpa_fusion.mask import band, visible_pairs


def cumulative(lengths) -> tuple[int, ...]:
    return (0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist())


def split_of(lengths, parts, partition="load_balanced", slack=None) -> Split:
    padded = None if slack is None else cumulative([n + x for n, x in zip(lengths, slack)])
    return split_by_partition(partitions.get(partition), parts, cumulative(lengths), padded,
                              torch.device("cpu"))


def te_partitioned_indices(cu_seqlens, parts: int, rank: int) -> list[int]:
    """TransformerEngine's thd_get_partitioned_indices, written out: each sequence (length a
    multiple of 2P) cut into 2P chunks, rank r taking chunks r and 2P-1-r."""
    held = []
    for start, stop in zip(cu_seqlens, cu_seqlens[1:]):
        c = (stop - start) // (2 * parts)
        for chunk in (rank, 2 * parts - 1 - rank):
            held += range(start + chunk * c, start + (chunk + 1) * c)
    return held


@given(st.integers(1, 8), st.lists(st.integers(0, 4), min_size=1, max_size=6))
def test_load_balanced_holds_transformer_engines_token_sets(parts, chunks):
    lengths = [2 * parts * c for c in chunks]
    split = split_of(lengths, parts)
    for rank in range(parts):
        expected = te_partitioned_indices(cumulative(lengths), parts, rank)
        assert split.part(rank).token_index.tolist() == expected


@st.composite
def packings(draw):
    parts = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, 3 * parts + 2), min_size=1, max_size=6))
    n = len(lengths)
    slack = draw(st.none() | st.lists(st.integers(0, 3), min_size=n, max_size=n))
    return draw(st.sampled_from(["load_balanced", "contiguous", "striped"])), parts, lengths, slack


@given(packings())
def test_every_real_token_on_one_rank_padding_last(packing):
    name, parts, lengths, slack = packing
    split = split_of(lengths, parts, name, slack)
    starts = cumulative([n + x for n, x in zip(lengths, slack or [0] * len(lengths))])
    real_tokens = [t for s, n in zip(starts, lengths) for t in range(s, s + n)]
    held = []
    multiple = 2 * parts if name == "load_balanced" else parts
    for rank in range(parts):
        local = split.part(rank)
        index, pos = local.token_index, local.position_ids
        assert len(index) == local.tokens
        room = [-(-(n + x) // multiple) * multiple // parts
                for n, x in zip(lengths, slack or [0] * len(lengths))]
        assert local.cu_seqlens_padded.tolist() == list(cumulative(room))
        assert local.cu_seqlens.tolist() == list(cumulative(local.seqlens.tolist()))
        bounds = local.cu_seqlens_padded.tolist()
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            real = int(local.seqlens[i])
            assert (index[a:a + real] >= 0).all() and (index[a + real:b] == -1).all()
            assert torch.equal(pos[a:a + real], index[a:a + real] - starts[i])
            assert (pos[a + real:b] == 0).all()
            assert bool((pos[a:a + real].diff() > 0).all())  # in order: causal stays top-left
        held += index[index >= 0].tolist()
    assert sorted(held) == real_tokens


@given(packings())
def test_ring_causal_calls_are_square_per_sequence(packing):
    """Every causal kernel call of a packed ring is square per sequence (the top-left mask is
    then also the bottom-right one flash uses), and every real query meets each key of an
    earlier position exactly once over the ring steps; a step of several calls (one per
    sequence) gives each its own consecutive rows and keys."""
    name, parts, lengths, slack = packing
    split = split_of(lengths, parts, name, slack)
    for rank in range(parts):
        local, pairs = split.part(rank), 0
        for source in range(parts):
            calls = packed_calls(block_case(rank, source, True, split.partition), local, source)
            if len(calls) > 1:
                assert all(isinstance(c.rows, slice) and isinstance(c.keys, slice)
                           and len(c.seqlens.lengths_q) == 1 for c in calls)
                spans = sorted((c.rows.start, c.rows.stop) for c in calls)
                assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))  # disjoint
            for call in calls:
                if call.causal:
                    assert call.seqlens.lengths_q == call.seqlens.lengths_k
                pairs += sum(visible_pairs(n_q, n_k, band(call.causal, call.window))
                             for n_q, n_k in zip(call.seqlens.lengths_q, call.seqlens.lengths_k))
        positions = local.position_ids[local.token_index >= 0]
        assert pairs == int((positions + 1).sum())  # query at position i sees i + 1 keys


@given(st.integers(1, 8), st.lists(st.integers(0, 20), min_size=1, max_size=6))
def test_concatenated_holds_contiguous_runs_of_the_sequences_one_after_another(parts, lengths):
    """Rank r holds tokens [r n, (r + 1) n) of the packing, n = ceil(T / P), real first; each
    rank's cu_seqlens counts its tokens of every sequence, in order, padding after the last;
    positions are inside each sequence, and ``unshard`` restores the packing."""
    split = split_of(lengths, parts, partitions.Concatenated())
    total, cu = sum(lengths), cumulative(lengths)
    n = -(-total // parts)
    for rank in range(parts):
        local = split.part(rank)
        tokens = list(range(rank * n, min((rank + 1) * n, total)))
        assert local.tokens == n
        assert local.token_index.tolist() == tokens + [-1] * (n - len(tokens))
        seq = [next(i for i in range(len(lengths)) if cu[i] <= t < cu[i + 1]) for t in tokens]
        assert local.position_ids.tolist() == [t - cu[i] for t, i in zip(tokens, seq)] + \
            [0] * (n - len(tokens))
        held = [seq.count(i) for i in range(len(lengths))]
        assert local.cu_seqlens.tolist() == list(cumulative(held))
        assert local.cu_seqlens_padded.tolist() == list(cumulative(held))[:-1] + [n]
    parts_of = [split.part(r) for r in range(parts)]
    packed = torch.arange(total, dtype=torch.float32).unsqueeze(1)
    shards = [p.shard(packed) for p in parts_of]
    gathered = torch.cat([torch.cat([s, s.new_zeros(n - len(s), 1)]) for s in shards])
    object.__setattr__(split, "gather", lambda t: gathered)
    assert torch.equal(parts_of[0].unshard(shards[0]), packed)


def test_load_balanced_pads_each_sequence_to_2p():
    """The split of the module docstring: sequences of 5 and 8 tokens over 2 ranks."""
    split = split_of([5, 8], 2)
    assert split.part(0).token_index.tolist() == [0, 1, -1, -1, 5, 6, 11, 12]
    assert split.part(1).token_index.tolist() == [2, 3, 4, -1, 7, 8, 9, 10]
    assert split.part(0).cu_seqlens.tolist() == [0, 2, 6]
    assert split.part(1).cu_seqlens.tolist() == [0, 3, 7]
    assert split.part(1).cu_seqlens_padded.tolist() == [0, 4, 8]
    assert split.part(1).position_ids.tolist() == [2, 3, 4, 0, 2, 3, 4, 5]


def test_global_packing_errors():
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"leaves sequence 0 room for 3 tokens but cu_seqlens gives it 4"):
        global_packing(cu, torch.tensor([0, 3, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 5, 3\] must never decrease, but entry 2 \(3\) is below entry 1"):
        global_packing(torch.tensor([0, 5, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be an int32/int64 tensor or a list of ints, got str"):
        global_packing("0,4,9")
    assert global_packing([0, 4, 9]) == ((0, 4, 9), None)


def test_index_map_padding_inside_a_part_is_refused():
    with pytest.raises(ValueError, match="places padding tokens between the real tokens"):
        split_of([3], 2, partitions.get([[3, 0], [1, 2]]), slack=[1])


# ---- video tiles -------------------------------------------------------------------------

@pytest.mark.parametrize("frames, frame, tiles", [
    (2, (4, 4), (1, 2, 2)), (4, (2, 6), (2, 1, 3)), (3, (4, 2), (1, 4, 1)), (1, (4, 4), (1, 1, 1)),
])
def test_video_tiles_hold_intact_boxes(frames, frame, tiles):
    part = VideoTiles(frame=frame, tiles=tiles)
    parts, length = tiles[0] * tiles[1] * tiles[2], frames * frame[0] * frame[1]
    held = []
    for rank in range(parts):
        index = part.indices(length, parts, rank)
        coords = part.coordinates(index)
        box = [(coords[:, d].min().item(), coords[:, d].max().item()) for d in range(3)]
        assert len(index) == torch.Size([hi - lo + 1 for lo, hi in box]).numel()  # a full box
        assert bool((index.diff() > 0).all())  # raster order inside the box
        held.append(index)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(length))
    f, h, w = part.coordinates(torch.arange(length)).unbind(1)
    assert torch.equal((f * frame[0] + h) * frame[1] + w, torch.arange(length))


def test_video_tiles_errors():
    with pytest.raises(ValueError, match=r"3 tiles along the 16 rows of a frame do not divide it"):
        VideoTiles(frame=(16, 8), tiles=(1, 3, 1))
    part = VideoTiles(frame=(4, 4), tiles=(2, 2, 1))
    with pytest.raises(ValueError, match=r"tiles=\(2, 2, 1\) make 4 tiles but the schedule has 2"):
        part.indices(32, 2, 0)
    with pytest.raises(ValueError, match=r"a video sequence of 48 tokens is not a whole number of "
                                         r"4x4 frames divisible into 2 tiles along frames"):
        part.indices(48, 4, 0)
    with pytest.raises(ValueError, match="a video sequence of 20 tokens"):
        split_of([32, 20], 4, part)


def test_video_tiles_per_packed_sequence():
    """Each packed sequence is its own video (frames may differ); rank r keeps tile r of each."""
    part = VideoTiles(frame=(2, 2), tiles=(1, 1, 2))
    split = split_of([4, 8], 2, part)
    assert split.part(0).token_index.tolist() == [0, 2, 4, 6, 8, 10]
    assert split.part(1).position_ids.tolist() == [1, 3, 1, 3, 5, 7]
    assert split.part(1).coordinates.tolist() == [[0, 0, 1], [0, 1, 1], [0, 0, 1], [0, 1, 1],
                                                  [1, 0, 1], [1, 1, 1]]


def test_partitions_compare_by_rule():
    assert partitions.get("load_balanced") == partitions.get("load_balanced")
    assert partitions.get("load_balanced") != partitions.get("striped")
    assert VideoTiles((4, 4), (1, 2, 2)) == VideoTiles((4, 4), (1, 2, 2))
    assert VideoTiles((4, 4), (1, 2, 2)) != VideoTiles((4, 4), (1, 4, 1))
    assert partitions.get([[0, 1], [2, 3]]) != partitions.get([[0, 2], [1, 3]])


@pytest.mark.parametrize("schedule,partition", [("ring", "load_balanced"),
                                                ("ring", "documents"), ("allgather", "documents")])
def test_a_call_on_a_local_packing_reads_no_tensor(monkeypatch, schedule, partition):
    """A call given a rank's packing reads its host offsets: reading its int32 tensors would
    cost a device sync on every call on a GPU."""
    import schedules
    import sdpa_fusion
    from sdpa_fusion import layout

    lengths = [40, 3, 9, 1, 20, 7]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    mesh = sdpa_fusion.VirtualMesh((2,), ("seq",), rank=1)
    sched = schedules.get(schedule, mesh, partition=partition)
    local = sched.pack(torch.tensor(cu, dtype=torch.int32))
    q = local.shard(torch.randn(cu[-1], 2, 8))
    read = []
    monkeypatch.setattr(layout, "_tensor_values",
                        lambda name, t, device: read.append(name) or t.tolist())
    p = sdpa_fusion.plan(q, q, q, layout="thd", causal=True, schedule=sched, cu_seqlens=local)
    assert read == []
    assert p.spec.cu_seqlens == tuple(local.cu_seqlens.tolist())
    assert p.spec.cu_seqlens_padded == tuple(local.cu_seqlens_padded.tolist())


def test_a_rank_s_packing_is_read_from_host_values_made_once(monkeypatch):
    """What a call reads of a whole-documents packing (its tokens, offsets, the whole and cut
    documents' problems) is made on first use: later calls read no tensor (host work every
    step, growing with the documents)."""
    import schedules
    import sdpa_fusion
    from schedules.whole import cut_specs, whole_spec

    lengths = [40, 3, 9, 1, 20, 7, 100]  # 100: more than a rank's share, cut
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    sched = schedules.get("ring", sdpa_fusion.VirtualMesh((2,), ("seq",), rank=0),
                          partition="documents")
    local = sched.pack(cu)
    q = local.shard(torch.randn(cu[-1], 2, 8))
    spec = sdpa_fusion.plan(q, q, q, layout="thd", causal=True, schedule=sched,
                            cu_seqlens=local).spec
    first = (local.tokens, local.offsets, whole_spec(spec), cut_specs(spec))
    assert first[3] and first[2].q_len > 0  # both parts present

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor read on a later call")

    for method in ("tolist", "item", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, method, refuse)
    assert (local.tokens, local.offsets, whole_spec(spec), cut_specs(spec)) == first


def test_a_step_of_calls_on_each_sequence_counts_once_per_row():
    """Calls on disjoint row ranges (a step's calls on each sequence's rows) merge one result
    per row: over two ranks, two documents cut, every row merges at most two (the merge and
    the dQ sum write straight into the bf16 result); a call on an index tensor counts for
    every row."""
    from schedules.calls import PackedCall, most_calls_per_row
    from sdpa_fusion.kernels.base import Seqlens

    split = split_of([40, 24], 2, "load_balanced")
    for rank in range(2):
        local = split.part(rank)
        calls = [c for source in range(2) for c in
                 packed_calls(block_case(rank, source, True, split.partition), local, source)]
        assert len(calls) == 3 and most_calls_per_row(calls, local.tokens) == 2
    import schedules
    import sdpa_fusion
    from schedules import runner

    sched = schedules.get("ring", sdpa_fusion.VirtualMesh((2,), ("seq",), rank=1),
                          partition="load_balanced")
    local = sched.pack((0, 40, 64))
    q = torch.empty(local.tokens, 2, 8)
    spec = sdpa_fusion.plan(q, q, q, layout="thd", causal=True, schedule=sched,
                            cu_seqlens=local).spec
    plan = sched.plan(spec, *runner.blocks(spec, q, q), backward=False)
    assert [op.blocks for op in plan.ops if isinstance(op, runner.Open)] == [2]
    index = PackedCall(torch.tensor([1, 2]), None, Seqlens((0, 2), (0, 9)), False)
    part = PackedCall(slice(0, 4), slice(0, 4), Seqlens((0, 4), (0, 4)), True)
    assert most_calls_per_row([index, part], 9) == 2 and most_calls_per_row([part], 9) == 1
    after = PackedCall(slice(4, 9), slice(4, 9), Seqlens((0, 5), (0, 5)), True)  # touches
    over = PackedCall(slice(3, 6), slice(3, 6), Seqlens((0, 3), (0, 3)), True)
    assert most_calls_per_row([part, after], 9) == 1
    assert most_calls_per_row([part, after, over], 9) == 2
