"""Head groups (schedules.heads): how many groups 'auto' takes, and which heads each holds.

Run: python -m pytest -q tests/test_heads.py
"""

import pytest
import torch

from schedules import heads

K = 1024


@pytest.mark.parametrize("heads_q,kv_heads,rows,want", [
    (32, 32, 16 * K, 1),    # 32K over 2 ranks: blocks stay whole
    (32, 32, 32 * K, 2),    # 64K over 2 ranks
    (32, 32, 64 * K, 4),    # 128K over 2 ranks: 8 heads x 64K rows per group
    (32, 32, 128 * K, 8),   # 256K over 2 ranks
    (32, 32, 512 * K, 32),  # 1M over 2 ranks: one head at a time
    (32, 8, 128 * K, 8),    # GQA: groups divide the K/V heads
    (32, 2, 1024 * K, 2),
    (8, 8, 8 * K, 1),
])
def test_auto_keeps_groups_large(heads_q, kv_heads, rows, want):
    got = heads.choose("auto", heads=heads_q, kv_heads=kv_heads, rows=rows)
    assert got == want
    assert heads_q // got * rows >= heads.MIN_GROUP_WORK or got == 1


def test_auto_respects_what_fits():
    fits = lambda g: (32 // g) % 4 == 0  # noqa: E731 -- e.g. ulysses over 4 ranks
    assert heads.choose("auto", heads=32, kv_heads=32, rows=512 * K, fits=fits) == 8


def test_explicit_count_is_taken():
    assert heads.choose(4, heads=32, kv_heads=8, rows=16) == 4


@pytest.mark.parametrize("bad", [0, -2, 1.5, "two", True, None])
def test_bad_option(bad):
    with pytest.raises(ValueError, match=r"head_groups=.* must be 'auto' or a positive integer"):
        heads.check_option(bad)


def test_groups_must_divide_kv_heads():
    with pytest.raises(ValueError, match=r"head_groups=3 must divide the 8 K/V heads of "
                                         r"schedule 'ring'; choose one of \[1, 2, 4, 8\]"):
        heads.check_divides(3, 8, "ring")


def test_groups_hold_the_query_heads_of_their_kv_heads():
    groups = heads.groups_of(2, 8, 4)
    q, kv = torch.arange(8).view(1, 8, 1), torch.arange(4).view(1, 4, 1)
    assert [g.of_q(q).flatten().tolist() for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [g.of_kv(kv).flatten().tolist() for g in groups] == [[0, 1], [2, 3]]
    # query head i uses K/V head i // (H / H_kv): within its group
    for g in groups:
        assert {int(h) // 2 for h in g.of_q(q).flatten()} == set(g.of_kv(kv).flatten().tolist())


@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses"])
def test_auto_sizes_packed_groups_by_the_longest_sequence(name):
    """Packed sequences are separate problems: 2048 short documents stay in one group (8
    groups would be 8 x 2048 tiny kernel calls), one long document splits as a dense one."""
    import schedules
    from sdpa_fusion import AttentionSpec, VirtualMesh

    sched = schedules.get(name, VirtualMesh((2,), ("seq",), rank=0), partition="load_balanced")

    def groups(lengths):
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        spec = AttentionSpec(batch=1, heads=32, kv_heads=32, q_len=cu[-1], kv_len=cu[-1],
                             head_dim=128, causal=True, layout="thd", cu_seqlens=tuple(cu))
        return sched.groups_for(spec)

    dense = AttentionSpec(batch=1, heads=32, kv_heads=32, q_len=256 * K, kv_len=256 * K,
                          head_dim=128, causal=True, layout="bshe")
    assert groups([128] * 2048) == 1  # 256K tokens in all
    assert groups([256 * K]) == sched.groups_for(dense) == 8
    assert groups([32 * K] * 6 + [K] * 8) == 1
