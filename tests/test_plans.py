"""What schedules decide without communicating, for every rank of meshes of 2, 4 and 8 ranks
planned on ``VirtualMesh`` (no process group): the ring's block cases, allgather's gathered
calls and the dtype of its sums, head groups, shards and their errors, positions for RoPE,
batches. These ran under mpirun once per world size; here each world size is a parameter
and every rank of it is planned in turn.

Run: pytest -q tests/test_plans.py
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import schedules
import sdpa_fusion
from schedules.allgather import MAX_RUNS, gathered_calls, packed_plan, runs
from schedules.batch import split
from schedules.calls import row_index
from schedules.heads import PIPELINE_GROUPS
from schedules.partition import Contiguous, LoadBalanced, Striped
from schedules.ring import Block, block_case
from sdpa_fusion import VirtualMesh
from tests.distributed.packed import global_positions, make_packed

WORLDS = [2, 4, 8]  # the world sizes the mpirun stages run
worlds = pytest.mark.parametrize("p", WORLDS, ids=lambda p: f"P{p}")


def ranks(p: int, shape=None, names=("seq",)):
    """A VirtualMesh for every rank of a mesh of ``shape`` (1-D of ``p`` ranks by default)."""
    return [VirtualMesh(shape or (p,), names, rank=r) for r in range(p)]


# ---- ring ---------------------------------------------------------------------------------
# Each rank's view of the block owned by each source rank, P = 4, causal.
LB, CO, ST = LoadBalanced(), Contiguous(), Striped()
CASES = [
    (LB, 2, 2, Block.CAUSAL), (LB, 2, 0, Block.EARLY_KEYS), (LB, 2, 3, Block.LATE_QUERIES),
    (LB, 0, 3, Block.LATE_QUERIES), (LB, 3, 0, Block.EARLY_KEYS),
    (CO, 1, 1, Block.CAUSAL), (CO, 1, 0, Block.FULL), (CO, 1, 3, Block.SKIP),
    (ST, 2, 2, Block.CAUSAL), (ST, 2, 1, Block.CAUSAL), (ST, 2, 3, Block.SHIFTED),
]


@pytest.mark.parametrize("partition,rank,source,expected", CASES,
                         ids=[f"{c[0].name}-r{c[1]}-from{c[2]}" for c in CASES])
def test_block_case_table(partition, rank, source, expected):
    """The mask case of a ring step, causal, and without a mask always full."""
    assert block_case(rank, source, True, partition) is expected
    assert block_case(rank, source, False, partition) is Block.FULL


def test_load_balanced_steps_cost_the_same():
    """Every step after the first computes half a block on every rank: the query x key
    pairs of each case are equal."""
    s = 8
    for rank in range(4):
        for source in range(4):
            if source == rank:
                continue
            case = block_case(rank, source, True, LB)
            q_rows = s // 2 if case is Block.LATE_QUERIES else s
            k_rows = s // 2 if case is Block.EARLY_KEYS else s
            assert q_rows * k_rows == s * s // 2


@worlds
def test_ring_sequence_not_divisible(p):
    """shard refuses a length load-balanced sharding cannot split, naming the multiple."""
    t = torch.randn(1, 2, 2 * p + 1, 8)
    for mesh in ranks(p):
        with pytest.raises(ValueError, match=rf"sequence length {2 * p + 1} must be divisible by "
                                             rf"{2 * p} for load_balanced"):
            schedules.get("ring", mesh).shard(t)


@worlds
def test_unknown_transport_rejected(p):
    with pytest.raises(ValueError, match=r"transport='pigeon' is not known; choose one of"):
        schedules.get("ring", VirtualMesh((p,), ("seq",)), transport="pigeon")


# ---- allgather ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "indices, causal, want",
    [
        ([0, 1, 2, 3], True, []),                               # rank 0, contiguous
        ([8, 9, 10, 11], True, [(slice(0, 4), 8)]),             # rank 2, contiguous
        ([0, 1, 14, 15], True, [(slice(2, 4), 12)]),            # rank 0, load_balanced P=4
        ([6, 7, 8, 9], True, [(slice(0, 4), 6)]),               # rank 3: its two chunks meet
        ([2, 3, 12, 13], True, [(slice(0, 2), 2), (slice(2, 4), 10)]),  # rank 1
        ([5, 0, 9, 3], False, [(slice(0, 4), 12)]),             # any order without causal
    ],
)
def test_gathered_calls(indices, causal, want):
    """The calls of the gathered keys before a rank's runs of queries (16 tokens, 4 ranks)."""
    assert gathered_calls(torch.tensor(indices), 16, 4, causal) == want


def test_runs():
    assert runs(torch.tensor([0, 1, 2, 7, 8, 12])) == [(0, 3), (3, 5), (5, 6)]


@worlds
def test_packed_runs_that_see_the_same_keys_share_a_call(p):
    """At P = 2 a rank's two runs of every sequence see the same keys of the other rank
    (rank 1: chunk 0 before both its chunks), so its gathered keys make one call, and each
    key gets one contribution to its dK/dV; above, at most MAX_RUNS calls."""
    sched = schedules.get("allgather", VirtualMesh((p,), ("seq",)), partition="load_balanced")
    cu = torch.tensor([0, 37, 37, 38, 38 + 16 * p, 38 + 16 * p + 5])
    for rank in range(p):
        own, calls = packed_plan(sched.pack(cu, rank=rank), causal=True)
        assert len(calls) <= (1 if p == 2 else MAX_RUNS)
        for call in calls:  # every key once per call
            keys = row_index(call.keys, p * sched.pack(cu, rank=rank).tokens)
            assert len(set(keys.tolist())) == len(keys)


def local_bf16_spec(sched, cu_seqlens, heads: int, kv_heads: int, *, causal: bool,
                    window=None) -> sdpa_fusion.AttentionSpec:
    """The local spec, on ``sched``'s rank, of a bf16 packed call on ``cu_seqlens`` (head
    dim 8)."""
    local = sched.pack(cu_seqlens)
    return sdpa_fusion.AttentionSpec(1, heads, kv_heads, local.tokens, local.tokens, 8,
                                     torch.bfloat16, causal=causal, layout="thd", packing=local,
                                     window=window)


@worlds
def test_packed_sums_dtype_is_the_same_on_every_rank(p):
    """Random packings, causal or not, with or without a window: every rank derives the same
    dtype for the dK/dV sums (their exchanges size their regions by it)."""
    scheds = [schedules.get("allgather", mesh, partition="load_balanced") for mesh in ranks(p)]

    @settings(max_examples=30, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(lengths=st.lists(st.integers(0, 13), min_size=1, max_size=5), causal=st.booleans(),
           window=st.one_of(st.none(), st.tuples(st.integers(0, 6), st.integers(0, 6))))
    def check(lengths, causal, window):
        cu = torch.tensor([0, *torch.tensor([1, *lengths]).cumsum(0).tolist()])
        window = None if window is None else (window[0], 0 if causal else window[1])
        dtypes = [str(s._sums_dtype(local_bf16_spec(s, cu, 2, 2, causal=causal, window=window)))
                  for s in scheds]
        assert len(set(dtypes)) == 1, f"lengths {[1, *lengths]}: {dtypes}"

    check()


# ---- ulysses, head groups -----------------------------------------------------------------
@worlds
def test_auto_pipelines_packed_calls_over_copy_engines(p, monkeypatch):
    """With a transport that overlaps the kernel, ``auto`` runs packed calls in
    PIPELINE_GROUPS head groups (as many as the heads allow), dense calls in one."""
    for mesh in ranks(p):
        sched = schedules.get("ulysses", mesh)
        packed = sdpa_fusion.AttentionSpec(1, 8 * p, 8 * p, 64, 64, 8, torch.float32,
                                           causal=True, layout="thd", cu_seqlens=(0, 40, 64))
        dense = packed.replace(layout="bshe", cu_seqlens=None)
        assert sched.groups_for(packed) == sched.groups_for(dense) == 1  # p2p: nothing overlaps
        monkeypatch.setattr(sched, "keeps_buffers", lambda: True)
        assert sched.groups_for(packed) == PIPELINE_GROUPS
        assert sched.groups_for(dense) == 1
        few = packed.replace(heads=2 * p, kv_heads=2 * p)  # two groups of P heads at most
        assert sched.groups_for(few) == 2


@worlds
@pytest.mark.parametrize("options, match", [
    (dict(head_groups=0), r"head_groups=0 must be 'auto' or a positive integer"),
    (dict(head_groups="many"), r"head_groups='many' must be 'auto' or a positive integer"),
    (dict(grad_dtype="fp8"), r"grad_dtype='fp8' is not known; choose one of"),
], ids=["zero-groups", "named-groups", "fp8-sums"])
def test_bad_ring_options(p, options, match):
    with pytest.raises(ValueError, match=match):
        schedules.get("ring", VirtualMesh((p,), ("seq",)), **options)


# ---- shards that cannot be made ------------------------------------------------------------
@worlds
def test_head_parallel_heads_not_divisible(p):
    t = torch.randn(1, 2 * p + 1, 8, 16)
    for mesh in ranks(p):
        with pytest.raises(ValueError, match=rf"heads {2 * p + 1} must be divisible by the {p} "
                                             rf"ranks"):
            schedules.get("head_parallel", mesh).shard(t)


@worlds
def test_head_parallel_kv_heads_neither_multiple_nor_divisor_of_ranks(p):
    k = torch.randn(1, p + 1, 8, 16)
    for mesh in ranks(p):
        with pytest.raises(ValueError, match=rf"heads {p + 1} must be divisible by the {p} ranks "
                                             rf"of schedule 'head_parallel' .*\(or divide {p}"):
            schedules.get("head_parallel", mesh).shard(k)


@worlds
def test_hybrid_head_parallel_shard_refuses_indivisible_heads(p):
    for mesh in ranks(p, (p, 1), ("heads", "seq")):
        sched = schedules.get("hybrid", mesh, inner="head_parallel")
        with pytest.raises(ValueError, match=rf"heads {p + 1} must be divisible by the {p} ranks "
                                             rf"of inner dim 'heads' \(or divide {p}"):
            sched.shard(torch.randn(1, p + 1, 8, 8))


# ---- positions for RoPE -------------------------------------------------------------------
def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x [..., N, H, E] whose dim -3 rows sit at integer ``positions``."""
    e = x.shape[-1]
    angles = positions.double()[:, None] * base ** (-torch.arange(0, e, 2).double() / e)
    cos, sin = (f(angles)[:, None, :].to(x.dtype) for f in (torch.cos, torch.sin))
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


@worlds
@pytest.mark.parametrize("partition", ["load_balanced", "contiguous", "striped"])
def test_rope_after_shard_equals_rope_before(p, partition):
    """Packed: RoPE at local.position_ids on the shard = the shard of RoPE on the full tensor."""
    problem = make_packed([2 * p + 1, 0, 1, 3 * p], h=2, slack=[0, 2, 1, 0])
    for mesh in ranks(p):
        local = schedules.get("ring", mesh, partition=partition).pack(problem.cu_seqlens,
                                                                      problem.cu_seqlens_padded)
        before = local.shard(rope(problem.q, global_positions(problem)))
        torch.testing.assert_close(rope(local.shard(problem.q), local.position_ids), before)


@worlds
@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses"])
def test_dense_position_ids_give_rope_of_the_full_sequence(p, name):
    x = torch.randn(1, 4 * p, 2, 8)  # [B, S, H, E]: RoPE along S
    full = rope(x, torch.arange(4 * p)).transpose(1, 2)
    for mesh in ranks(p):
        sched = schedules.get(name, mesh)
        local = sched.shard(x.transpose(1, 2), layout="bshe").transpose(1, 2)
        torch.testing.assert_close(rope(local, sched.position_ids(4 * p)).transpose(1, 2),
                                   sched.shard(full, layout="bshe"))


# ---- batches ------------------------------------------------------------------------------
B, S, H = 2, 16, 4


@worlds
@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses", "head_parallel"])
def test_batch_tensors_go_through_the_batch(p, name):
    """shard of a [B, S] tensor is a ValueError naming schedules.batch (not an IndexError)."""
    if name in ("ulysses", "head_parallel") and p > H:
        pytest.skip(f"{H} heads over {p} ranks")
    for mesh in ranks(p):
        with pytest.raises(ValueError, match=r"t has 2 dims .*Shard a model's \[B, S, \.\.\.\] "
                                             r"batch tensors with schedules.batch"):
            schedules.get(name, mesh).shard(torch.zeros(B, S, dtype=torch.long))


@worlds
def test_bad_batches(p):
    sched = schedules.get("ring", VirtualMesh((p,), ("seq",)))
    with pytest.raises(ValueError, match=r"attention_mask must be a 2-D \[B, S\] tensor, got "
                                         r"\[2, 1, 16, 16\]; a 4-D or additive mask"):
        split(sched, attention_mask=torch.ones(B, 1, S, S))
    with pytest.raises(ValueError, match=r"attention_mask must hold 1 for real tokens and 0"):
        split(sched, attention_mask=torch.full((B, S), -1.0))
    with pytest.raises(ValueError, match=r"position_ids \[2, 8\] must be \[B, S\] = \[2, 16\]"):
        split(sched, (B, S), position_ids=torch.zeros(B, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="marks no real token"):
        split(sched, attention_mask=torch.zeros(B, S))
    batch = split(sched, (B, S))
    with pytest.raises(ValueError, match=r"t \(\[2, 15\]\) must start with the dims \[2, 16\]"):
        batch.shard(torch.zeros(B, S - 1))


# ---- a user's schedule --------------------------------------------------------------------
def test_the_custom_schedule_example_registers_its_schedule(monkeypatch):
    """docs/custom_schedule.md's example registers its schedule without editing the package
    (into a copy of the registry, dropped after the test); under mpirun:
    tests/distributed/test_custom_schedule.py."""
    monkeypatch.setattr(schedules, "_REGISTRY", dict(schedules._REGISTRY))
    importlib.reload(importlib.import_module("examples.custom_schedule"))
    assert "gather_kv" in schedules.names() and schedules.options("gather_kv") == ["dim"]
