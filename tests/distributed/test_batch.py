"""A model's batch over the ranks (schedules.batch), layouts read or checked per tensor.

    mpirun -np 2 python -m pytest tests/distributed/test_batch.py
    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_batch.py

Batches are [B, S] of 2 x 16 tokens: dense, padded (left and right) or packed (documents
restarting inside a row); attention through the batch is checked against torch SDPA on every
sequence of the full batch (tests/reference.py), forward and backward, within the fp32
tolerance of its TOLERANCES.
"""

from __future__ import annotations

import pytest
import torch

import schedules
import sdpa_fusion
from schedules.batch import split
from tests import reference

B, S, H, H_KV, E = 2, 16, 4, 2, 8
SCHEDULES = ["ring", "allgather", "ulysses", "head_parallel"]
BATCH_SCHEDULES = [*SCHEDULES, "hybrid ulysses", "hybrid head_parallel"]  # hybrids: 2 x P/2
KINDS = ["dense", "padded", "packed"]


def usable(name: str, mesh) -> None:
    if name in ("ulysses", "head_parallel") and mesh.size() > H:
        pytest.skip(f"{H} heads over {mesh.size()} ranks")
    if name.startswith("hybrid") and mesh.size() % 2:
        pytest.skip("a 2 x P/2 mesh needs an even number of ranks")


@pytest.fixture(scope="module")
def make(mesh):
    """``make(name)``: schedule ``name`` over all ranks; "hybrid <inner>" over a 2 x P/2 mesh
    ("heads", "seq"), made once."""
    meshes = {}

    def get(name: str):
        if not name.startswith("hybrid"):
            return schedules.get(name, mesh)
        if "2d" not in meshes:
            meshes["2d"] = sdpa_fusion.init_mesh((2, -1), ("heads", "seq"))
        return schedules.get("hybrid", meshes["2d"], inner=name.split()[1])

    return get


def add_over_token_ranks(t: torch.Tensor, schedule) -> None:
    """Sum ``t`` over the ranks that split the batch's tokens (each holds its tokens' part)."""
    for s in schedule.token_splits:
        torch.distributed.all_reduce(t, group=s.group)


def batch_inputs(kind: str) -> dict:
    if kind == "padded":  # row 0 left-padded by 3, row 1 right-padded by 5
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, :3] = mask[1, 11:] = 0
        return {"attention_mask": mask}
    if kind == "packed":  # documents of 5 + 11 and 7 + 9 tokens
        return {"position_ids": torch.tensor([[*range(5), *range(11)], [*range(7), *range(9)]])}
    return {}


def sequences(kind: str) -> list[tuple[int, int, int]]:
    """(row, start, stop) of every sequence of the batch."""
    return {"dense": [(0, 0, S), (1, 0, S)], "padded": [(0, 3, S), (1, 0, 11)],
            "packed": [(0, 0, 5), (0, 5, S), (1, 0, 7), (1, 7, S)]}[kind]


def expected(q, k, v, dout, kind):
    """(out, dq, dk, dv) of causal attention on every sequence (the reference, fp64);
    padding 0."""
    results = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, q, k, v)]
    for row, a, b in sequences(kind):
        part = reference.attention(*(t[row:row + 1, :, a:b] for t in (q, k, v, dout)),
                                   causal=True)
        for full, got in zip(results, part.results):
            full[row:row + 1, :, a:b] = got
    return results


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", BATCH_SCHEDULES)
def test_attention_through_the_batch(mesh, make, name, kind):
    """Shard [B, S, H, E] tensors, attend through the batch, unshard: torch SDPA per sequence,
    forward and backward (head_parallel: the model's replicated tensors, split inside)."""
    usable(name, mesh)
    g = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(B, H, S, E, generator=g) for _ in range(2))
    k, v = (torch.randn(B, H_KV, S, E, generator=g) for _ in range(2))
    batch = split(make(name), (B, S), **batch_inputs(kind))
    assert batch.packed == (kind != "dense")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    local = [batch.shard(t.transpose(1, 2)).transpose(1, 2) for t in leaves]  # BSHE views
    out_l = batch.attention(*local, causal=True, kernel="reference")
    out = batch.unshard(out_l.transpose(1, 2)).transpose(1, 2)
    (out * dout).sum().backward()
    grads = [t.grad.clone() for t in leaves]
    for grad in grads:  # each rank's leaves hold its tokens' gradients: add them
        add_over_token_ranks(grad, batch.schedule)
    want = expected(q, k, v, dout, kind)
    for what, got, w in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        reference.assert_close(got, w, msg=what)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", BATCH_SCHEDULES)
def test_shard_positions_and_unshard(mesh, make, name, kind):
    """Local tokens are the rows ``tokens`` names, with the positions one process gives them;
    ``unshard`` restores the batch (padding 0) and sends each rank its tokens' gradient."""
    usable(name, mesh)
    sched = make(name)
    inputs = batch_inputs(kind)
    batch = split(sched, (B, S), **inputs)
    full = torch.arange(B * S * 3, dtype=torch.float32).view(B, S, 3).requires_grad_()
    local = batch.shard(full)
    real = batch.real
    assert torch.equal(local[real], full.flatten(0, 1)[batch.tokens[real]])
    assert bool((local[~real] == 0).all())
    positions = inputs.get("position_ids", torch.arange(S).expand(B, S))
    assert torch.equal(batch.position_ids[real], positions.flatten()[batch.tokens[real]])
    assert bool((batch.shard(full.long(), fill=-100)[~real] == -100).all())
    mask = inputs.get("attention_mask", torch.ones(B, S)).bool()
    restored = batch.unshard(local * 2)
    assert torch.equal(restored[mask], 2 * full[mask]) and bool((restored[~mask] == 0).all())
    restored.sum().backward()
    grad = full.grad.clone()
    add_over_token_ranks(grad, sched)
    assert torch.equal(grad, 2 * mask[..., None].float().expand_as(grad))


def test_total_and_sum_gradients_add_over_token_ranks(mesh):
    ring, heads = (split(schedules.get(n, mesh), (B, S)) for n in ("ring", "head_parallel"))
    one = torch.ones(())
    assert ring.total(one).item() == mesh.size() and heads.total(one).item() == 1
    w = torch.nn.Parameter(torch.zeros(3))
    w.grad = torch.full((3,), float(mesh.rank))
    ring.sum_gradients([w])
    assert torch.equal(w.grad, torch.full((3,), float(sum(range(mesh.size())))))


# ---- layouts: auto, and explicit layouts checked ---------------------------------------------
@pytest.mark.parametrize("name", ["ring", "head_parallel"])
def test_auto_reads_each_tensors_layout(mesh, name):
    """q a BSHE view, k and v contiguous BHSE (as transformers passes them with a KV cache):
    layout="auto" (the default) runs them as torch SDPA does."""
    sched = schedules.get(name, mesh)
    g = torch.Generator().manual_seed(4)
    h = 2 * mesh.size()
    q = torch.randn(1, S, h, E, generator=g).transpose(1, 2)
    k, v = (torch.randn(1, h, S, E, generator=g) for _ in range(2))
    local = [sched.shard(t).requires_grad_() for t in (q, k, v)]
    assert local[0].stride(1) < local[0].stride(2) and local[1].is_contiguous()  # kept
    out = sched.unshard(sdpa_fusion.attention(*local, causal=True, schedule=sched,
                                              kernel="reference"))
    reference.assert_close(out, reference.attention(q, k, v, causal=True).out)


@pytest.mark.parametrize("name", SCHEDULES)
def test_shard_refuses_a_natural_bshe_tensor_claimed_as_bshe(mesh, name):
    """A [B, S, H, E] tensor is not the logical [B, H, S, E] view 'bshe' names: shard raises
    (no communication: rank 0 alone) instead of splitting its heads; a correct call follows."""
    usable(name, mesh)
    sched = schedules.get(name, mesh)
    natural = torch.randn(1, S, H, E, generator=torch.Generator().manual_seed(5))
    if mesh.rank == 0:
        with pytest.raises(ValueError, match=r"t \(shape \[1, 16, 4, 8\].* does not have the "
                                             r"layout 'bshe' it claims; a \[B,S,H,E\] tensor is "
                                             r"passed as t.transpose\(1, 2\)"):
            sched.shard(natural, layout="bshe")
    q = sched.shard(natural.transpose(1, 2), layout="bshe")
    out = sched.unshard(sdpa_fusion.attention(q, q, q, schedule=sched, kernel="reference"))
    reference.assert_close(out, reference.attention(*(natural.transpose(1, 2),) * 3).out)


@pytest.mark.usefixtures("several_ranks")
@pytest.mark.parametrize("name", SCHEDULES)
def test_contradicted_layout_on_one_rank_raises_on_every_rank(mesh, name):
    """Rank 1 claims 'bshe' for contiguous BHSE tensors: every rank raises the same
    ValueError, then a correct call runs."""
    sched = schedules.get(name, mesh)
    local = sched.shard(torch.randn(1, 2 * mesh.size(), S, E))
    bad = "bshe" if mesh.rank == 1 else "bhse"
    with pytest.raises(ValueError, match=r"rank 1: q .* does not have the layout 'bshe' it claims"):
        sdpa_fusion.attention(local, local, local, layout=bad, schedule=sched, kernel="reference")
    out = sdpa_fusion.attention(local, local, local, layout="bhse", schedule=sched,
                                kernel="reference")
    assert out.shape == local.shape


