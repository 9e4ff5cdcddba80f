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
from tests import masks as described
from tests import reference
from tests.nonfinite import VALUES, PoisonedDocuments, mismatch, plant

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
    q, dout = (torch.randn(sum(lengths), 4 * p, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(sum(lengths), 2 * p, 8, generator=g) for _ in range(2))
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


MASKED = [("ring", "load_balanced"), ("ring", "documents"), ("allgather", "load_balanced"),
          ("allgather", "documents"), ("ulysses", "load_balanced"), ("head_parallel", None)]
_IDS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2] + [3] * 30])  # per position
MASK_MODS = {"mask_mod": ("mod", "sink", 2),
             "mask_mod&document_ids": ("and", ("mod", "batch", 2), ("docs", _IDS))}


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("mask", sorted(MASK_MODS))
@pytest.mark.parametrize("name,partition", MASKED, ids=[f"{n}-{p}" for n, p in MASKED])
def test_packed_mask_mod(mesh, name, partition, mask, value):
    """Packed documents with padding slots (cu_seqlens_padded) under a mask_mod (alone, and
    joined with document_ids): NaN or Inf in every global padding slot, in every padding row
    of the split and in one document's K and V leave every other document's out, dQ, dK and
    dV those of the reference on that document alone, and the padding slots' results 0 (a
    mask_mod's tiles over several documents met their keys and values: 0 * NaN)."""
    p = mesh.size()
    d = MASK_MODS[mask]
    docs = PoisonedDocuments([4 * p + 1, 3 * p + 2, 2 * p + 1, 3], [2, 0, 3, 1], 2 * p, p,
                             value, poisoned=1, seed=3)
    sched = schedules.get(name, mesh, **({"partition": partition} if partition else {}))
    kw = dict(layout="thd", cu_seqlens=torch.tensor(docs.cu),
              cu_seqlens_padded=torch.tensor(docs.starts))
    shards = [sched.shard(t, **kw) for t in (docs.q, docs.k, docs.v)]
    if hasattr(sched, "pack"):  # the split's own padding rows too
        split_padding = sched.pack(kw["cu_seqlens"], kw["cu_seqlens_padded"]).token_index < 0
        for t in shards:
            t[split_padding] = VALUES[value]
    leaves = [t.requires_grad_() for t in shards]
    out = sdpa_fusion.attention(*leaves, mask=described.built(d), kernel="reference",
                                schedule=sched, **kw)
    out.backward(sched.shard(docs.dout, **kw))
    got = [sched.unshard(t, **kw) for t in (out.detach(), *(t.grad for t in leaves))]
    atol, rtol = reference.TOLERANCES[torch.float32]
    found = None
    for i, a, n in docs.others():
        views = [docs.document(t, a, n) for t in (*docs.clean, docs.dout)]
        want = reference.attention(*views, mask=described.boolean(d, i, n, n)[None, None])
        for what, t, w in zip(reference.NAMES, got, want.results):
            mine = docs.document(t, a, n).double()
            if found is None and not torch.allclose(mine, w, rtol=rtol, atol=atol):
                found = (f"document {i} {what}: {int((~mine.isfinite()).sum())} non-finite, "
                         f"max |error| {(mine - w).abs().nan_to_num(float('inf')).max():.2e}")
    for what, t in zip(reference.NAMES, got):
        if found is None and t[~docs.real].any():
            found = f"{what} is not 0 in the padding slots"
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
