"""NaN and Inf in q, k or v propagate through every schedule as through torch SDPA: the
gathered results obey the rule of tests/nonfinite.py (merges never turn them into numbers).

    mpirun -np 2 python -m pytest tests/distributed/test_nonfinite.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import schedules
import sdpa_fusion
from tests.nonfinite import VALUES, mismatch, plant

SCHEDULES = [("ring", "load_balanced"), ("ring", "contiguous"), ("allgather", "load_balanced"),
             ("ulysses", "load_balanced"), ("head_parallel", None)]


@pytest.mark.parametrize("value", sorted(VALUES))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name,partition", SCHEDULES, ids=[f"{n}-{p}" for n, p in SCHEDULES])
def test_schedule(mesh, name, partition, causal, where, value):
    p = mesh.size()
    sched = schedules.get(name, mesh, **({"partition": partition} if partition else {}))
    seed = 7 * "qkv".index(where) + sorted(VALUES).index(value)
    g = torch.Generator().manual_seed(seed)
    h, s = 2 * p, 4 * p
    q = torch.randn(1, h, s, 8, generator=g)
    k, v = (torch.randn(1, p, s, 8, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, generator=g)
    q, k, v = plant(q, k, v, where, value, seed)
    shard = lambda t: sched.shard(t)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    out = sdpa_fusion.attention(*leaves, causal=causal, kernel="reference", schedule=sched)
    out.backward(shard(dout))
    got = [sched.unshard(t) for t in (out.detach(), *(t.grad for t in leaves))]
    found = mismatch(got, q, k, v, dout, causal=causal)
    assert mesh.agree(found) == [None] * mesh.world_size, found


@pytest.mark.parametrize("value", sorted(VALUES))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses"])
def test_packed(mesh, name, causal, where, value):
    """Packed sequences in two head groups (ulysses' pipeline, allgather's exchanges), padded
    in every part: a non-finite value propagates within its sequence as through torch SDPA,
    and the other sequence is untouched."""
    p = mesh.size()
    seed = 7 * "qkv".index(where) + sorted(VALUES).index(value)
    g = torch.Generator().manual_seed(seed)
    lengths = [4 * p + 1, 3 * p + 1]
    cu = torch.tensor([0, lengths[0], sum(lengths)])
    q, dout = (torch.randn(sum(lengths), 2 * p, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(sum(lengths), p, 8, generator=g) for _ in range(2))
    q, k, v = plant(q, k, v, where, value, seed)
    sched = schedules.get(name, mesh, head_groups=2)
    kw = dict(layout="thd", cu_seqlens=cu)
    leaves = [sched.shard(t, **kw).requires_grad_() for t in (q, k, v)]
    out = sdpa_fusion.attention(*leaves, causal=causal, kernel="reference", schedule=sched, **kw)
    out.backward(sched.shard(dout, **kw))
    got = [sched.unshard(t, **kw) for t in (out.detach(), *(t.grad for t in leaves))]
    found = None
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        def seq(t):
            return t[a:b].transpose(0, 1).unsqueeze(0)
        found = found or mismatch([seq(t) for t in got], *(seq(t) for t in (q, k, v, dout)),
                                  causal=causal)
    assert mesh.agree(found) == [None] * mesh.world_size, found


def torch_sdpa(backend, q, k, v):
    """Causal torch SDPA of q, k, v (GQA) on ``backend``."""
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("name,partition", SCHEDULES, ids=[f"{n}-{p}" for n, p in SCHEDULES])
def test_inf_key_behind_the_causal_mask(mesh, name, partition):
    """One +Inf in K, causal (a user saw ring leave 16 outputs finite where torch's math SDPA
    has NaN): the output rows that see the key and meet it with a +Inf score are NaN, the rows
    before it finite, exactly as on one device and in torch's flash SDPA. torch's math backend
    adds the mask (-inf) to the +Inf scores of the rows before the key, which makes those rows
    NaN too; they do not depend on the key. Gradients obey the rule of tests/nonfinite.py
    (a kernel's masked blocks, 0 * Inf, may reach more of dQ than the rows that see the key)."""
    p = mesh.size()
    sched = schedules.get(name, mesh, **({"partition": partition} if partition else {}))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2 * p, 4 * p, 8, generator=g)
    k, v = (torch.randn(1, p, 4 * p, 8, generator=g) for _ in range(2))
    key = 3 * p
    q[:, :2, :, 0] = q[:, :2, :, 0].abs()  # every query of K/V head 0 meets it with +Inf
    k[0, 0, key, 0] = float("inf")
    dout = torch.randn(q.shape, generator=g)
    leaves = [sched.shard(t).requires_grad_() for t in (q, k, v)]
    out = sdpa_fusion.attention(*leaves, causal=True, kernel="reference", schedule=sched)
    out.backward(sched.shard(dout))
    got = [sched.unshard(t) for t in (out.detach(), *(t.grad for t in leaves))]
    nan = torch.zeros_like(got[0], dtype=torch.bool)
    nan[:, :2, key:] = True
    assert torch.equal(got[0].isnan(), nan) and got[0][~nan].isfinite().all()
    flash = torch_sdpa(SDPBackend.FLASH_ATTENTION, q, k, v)
    assert torch.equal(got[0].isnan(), flash.isnan()), "out: NaN elsewhere than torch's flash"
    one = sdpa_fusion.attention(q, k, v, causal=True, kernel="reference")
    assert torch.equal(got[0].isnan(), one.isnan()), "out: NaN elsewhere than on one device"
    found = mismatch(got, q, k, v, dout, causal=True)  # gradients: the rule of tests/nonfinite.py
    assert mesh.agree(found) == [None] * mesh.world_size, found
