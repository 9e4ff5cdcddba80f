"""Token partitioners are permutations: property tests over sequence lengths and rank counts.

    python -m pytest tests/test_partition.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from schedules import partition as partitions

NAMED = ["contiguous", "load_balanced", "striped"]


@st.composite
def placements(draw, names=tuple(NAMED) + ("index_map",)):
    """(partitioner, seq_len, parts) with seq_len divisible as the partitioner needs."""
    name = draw(st.sampled_from(names))
    parts = draw(st.integers(1, 8))
    per = 2 if name == "load_balanced" else 1
    seq_len = draw(st.integers(1, 12)) * per * parts
    if name == "index_map":
        seed = draw(st.integers(0, 2**16))
        perm = torch.randperm(seq_len, generator=torch.Generator().manual_seed(seed))
        return partitions.get(perm.view(parts, -1).tolist()), seq_len, parts
    return partitions.get(name), seq_len, parts


@given(placements())
def test_ranks_hold_a_permutation(placement):
    part, s, p = placement
    held = [part.indices(s, p, r) for r in range(p)]
    assert all(len(h) == s // p for h in held)
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(s))
    assert torch.equal(part.permutation(s, p), torch.cat(held))


@given(placements())
def test_inverse_restores_order(placement):
    part, s, p = placement
    tokens = torch.arange(s) * 10
    sharded = tokens[part.permutation(s, p)]
    assert torch.equal(sharded[part.inverse(s, p)], tokens)


@given(placements(names=tuple(NAMED)))
def test_named_partitions_keep_tokens_in_order(placement):
    part, s, p = placement
    for r in range(p):
        held = part.indices(s, p, r)
        assert bool((held[1:] > held[:-1]).all())


@given(st.integers(1, 8), st.integers(1, 12))
def test_load_balanced_causal_work_is_equal(parts, chunks):
    s = 2 * parts * chunks
    part = partitions.get("load_balanced")
    work = {int((part.indices(s, parts, r) + 1).sum()) for r in range(parts)}
    assert len(work) == 1


@pytest.mark.parametrize("name, multiple", [("contiguous", 4), ("striped", 4), ("load_balanced", 8)])
@given(extra=st.integers(1, 3))
def test_non_divisible_length_names_the_multiple(name, multiple, extra):
    with pytest.raises(ValueError, match=rf"sequence length {multiple + extra} must be divisible by "
                                         rf"{multiple} for {name} sharding over 4 ranks; pad the "
                                         rf"sequence to a multiple of {multiple}"):
        partitions.get(name).indices(multiple + extra, 4, 0)


def test_index_map_needs_equal_rows():
    with pytest.raises(ValueError, match="index_map must give every rank the same number of tokens"):
        partitions.get([[0, 1, 2], [3]])


def test_index_map_needs_every_token_once():
    with pytest.raises(ValueError, match="must hold each of the 4 token positions exactly once"):
        partitions.get([[0, 1], [1, 3]])


def test_index_map_must_fit_the_sequence_and_ranks():
    part = partitions.get([[0, 2], [1, 3]])
    with pytest.raises(ValueError, match="places 4 tokens on 2 ranks, but the sequence has 8 tokens "
                                         "over 2 ranks"):
        part.indices(8, 2, 0)
    with pytest.raises(ValueError, match="sequence has 4 tokens over 4 ranks"):
        part.indices(4, 4, 0)


def test_unknown_partition_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"partition='zigzag' is not known; use one of "
                                         r"\['auto', 'contiguous', 'documents', "
                                         r"'load_balanced', 'striped'\]"):
        partitions.get("zigzag")
