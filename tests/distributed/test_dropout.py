"""Attention dropout under every schedule: each rank and block draws its own reproducible
stream, the forward's mask is the one the backward replays.

    mpirun -np 2 python -m pytest tests/distributed/test_dropout.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_dropout.py

With v the identity (head dim = sequence length), out is the dropped attention matrix itself:
every entry must be 0 or P / (1 - p), P the softmax of the full problem (the reference of
tests/reference.py with v the identity), about a fraction p of them 0, and the masks of different ranks' blocks (and head groups) must
differ. The gradients
are checked against the forward with the same seed: dV exactly (out is linear in v), dQ and
dK by central differences.
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from tests import reference

P_DROP, B, S = 0.4, 2, 16
NAMES = ["ring", "allgather", "ulysses", "head_parallel", "hybrid"]
GROUPED = ["ring", "allgather", "ulysses"]  # the schedules with head groups


def schedule(name: str, mesh, **options):
    p = mesh.size()
    if name == "hybrid":
        if p % 2:
            pytest.skip("hybrid: a 2 x P/2 mesh needs an even world")
        return schedules.get("hybrid", sdpa_fusion.init_mesh((2, p // 2), ("heads", "seq")))
    if name in ("ring", "allgather"):
        options["partition"] = "contiguous"
    return schedules.get(name, mesh, **options)


def heads(mesh) -> int:
    return 2 * mesh.size()


def full(mesh, *, identity_v: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = heads(mesh)
    q, k, dout = (torch.randn(B, h, S, S, generator=g) for _ in range(3))
    v = torch.eye(S).expand(B, h, S, S).contiguous() if identity_v else torch.randn(
        B, h, S, S, generator=g)
    return q, k, v, dout


def run(sched, q, k, v, *, seed: int, grad_of=None):
    """Sharded causal attention with dropout seeded by ``seed``: the full output, and (with
    ``grad_of`` = dout) the local q, k, v with their gradients."""
    local = [sched.shard(t).requires_grad_() for t in (q, k, v)]
    torch.manual_seed(seed)
    out = sdpa_fusion.attention(*local, causal=True, dropout_p=P_DROP, schedule=sched,
                                kernel="reference")
    if grad_of is not None:
        out.backward(sched.shard(grad_of))
    return sched.unshard(out), local


def across(value: torch.Tensor) -> torch.Tensor:
    """A per-rank sum added over all ranks (each holds a distinct part: tokens or heads)."""
    value = value.detach().clone()
    torch.distributed.all_reduce(value)
    return value


def softmax_causal(q, k) -> torch.Tensor:
    """The attention matrix of the full causal problem (fp64): the reference with v = I."""
    return reference.attention(q, k, torch.eye(S).expand(*q.shape[:2], S, S), causal=True).out


# Kept entries are P / (1 - p) of fp32 softmaxes over 16 keys: the table's fp32 rtol, and an
# atol of 1e-6, tighter than its 1e-5 (probabilities, off by about 1e-7 in fp32).
KEPT = dict(rtol=reference.TOLERANCES[torch.float32][1], atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_dropped_attention_matrix(mesh, name):
    sched = schedule(name, mesh)
    q, k, v, _ = full(mesh, identity_v=True)
    attention, _ = run(sched, q, k, v, seed=7)
    probs = softmax_causal(q, k)
    kept = attention.double().abs() > 0
    visible = probs > 0
    assert not bool((kept & ~visible).any()), "a masked (future) key got weight"
    torch.testing.assert_close(attention.double()[kept], probs[kept] / (1 - P_DROP), **KEPT)
    dropped = 1 - kept[visible].double().mean().item()
    assert abs(dropped - P_DROP) < 0.1, f"dropped a fraction {dropped:.3f}, expected {P_DROP}"
    again, _ = run(sched, q, k, v, seed=7)
    other, _ = run(sched, q, k, v, seed=8)
    assert torch.equal(again, attention) and not torch.equal(other, attention)
    if name != "hybrid":
        assert_ranks_draw_their_own(sched, kept, mesh.size())


def assert_ranks_draw_their_own(sched, kept, p):
    """The blocks of different ranks (their heads, or their tokens' diagonal blocks) have
    different masks: one stream for all would repeat them."""
    if sched.name in ("ulysses", "head_parallel"):
        per_rank = kept.unflatten(1, (p, -1))  # [B, P, H/P, S, S]: rank r's heads
        blocks = [per_rank[:, r] for r in range(p)]
    else:  # contiguous tokens: rank r's queries against its own keys
        n = S // p
        blocks = [kept[..., r * n:(r + 1) * n, r * n:(r + 1) * n] for r in range(p)]
    for r in range(1, p):
        assert not torch.equal(blocks[r], blocks[0]), f"ranks 0 and {r} drew the same mask"


@pytest.mark.parametrize("name", NAMES)
def test_gradients_replay_the_forward_mask(mesh, name):
    assert_gradients_replay_the_forward_mask(schedule(name, mesh), mesh)


@pytest.mark.parametrize("name", GROUPED)
def test_head_groups_draw_their_own_masks(mesh, name):
    """With two head groups the dropped attention matrix is still right, the groups' masks
    differ (one stream for both would repeat them) and the backward replays each."""
    sched = schedule(name, mesh, head_groups=2)
    q, k, v, _ = full(mesh, identity_v=True)
    attention, _ = run(sched, q, k, v, seed=7)
    probs = softmax_causal(q, k)
    kept = attention.double().abs() > 0
    assert not bool((kept & ~(probs > 0)).any()), "a masked (future) key got weight"
    torch.testing.assert_close(attention.double()[kept], probs[kept] / (1 - P_DROP), **KEPT)
    half = kept.shape[1] // 2
    assert not torch.equal(kept[:, :half], kept[:, half:]), "both head groups drew one mask"
    assert_gradients_replay_the_forward_mask(sched, mesh)


def assert_gradients_replay_the_forward_mask(sched, mesh):
    """f = <out, dout>, with the same seed: f(v + u) - f(v) = <dV, u> (out is linear in v),
    and (f(x + eps u) - f(x - eps u)) / 2 eps = <dX, u> for x = q, k."""
    q, k, v, dout = full(mesh, identity_v=False, seed=1)
    _, local = run(sched, q, k, v, seed=11, grad_of=dout)
    g = torch.Generator().manual_seed(2)
    directions = [torch.randn(q.shape, generator=g) for _ in range(3)]

    def f(*tensors):
        out, _ = run(sched, *tensors, seed=11)
        return (out.double() * dout.double()).sum()

    def along(i, u):  # <dX, u> over the whole tensor
        return across((local[i].grad.double() * sched.shard(u).double()).sum())

    u_q, u_k, u_v = directions
    linear = f(q, k, v + u_v) - f(q, k, v)
    # sums of fp32 results over the whole tensor (not a comparison with the reference): the
    # difference of two fp32 forwards, and below central differences with an O(eps^2) error
    torch.testing.assert_close(linear, along(2, u_v), rtol=1e-4, atol=1e-4)
    eps = 1e-2
    for i, (x, u) in enumerate(((q, u_q), (k, u_k))):
        args = [q, k, v]
        args[i] = x + eps * u
        plus = f(*args)
        args[i] = x - eps * u
        slope = (plus - f(*args)) / (2 * eps)
        torch.testing.assert_close(slope, along(i, u), rtol=2e-3, atol=2e-3,
                                   msg=lambda m: f"d{'qk'[i]}: {m}")
