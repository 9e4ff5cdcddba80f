"""What describe() says each schedule allocates (a dry run on data-less tensors, transfers
moving nothing) vs what it allocates on CPU ranks, its transfers going through gloo.

    mpirun -np 4 --oversubscribe python -m pytest tests/distributed/test_memory.py

``Allocations`` counts the storages that ops create while it is active and when each dies,
so its peak is the bytes the call holds at its busiest. The kernel (``WorkspaceKernel``)
allocates what the GPU kernels allocate and computes nothing: the count is the schedule's
own. Collectives may release a buffer a moment late on gloo's threads, so each call is
measured a few times and the least peak taken.
"""

from __future__ import annotations

import time

import pytest
import torch

import schedules
import sdpa_fusion
from sdpa_fusion import masks
from schedules import heads
from schedules.dry_run import Allocations, WorkspaceKernel
from sdpa_fusion.waiting import Arrivals

from .packed import make_packed

TRIES = 5


@pytest.fixture(autouse=True)
def transfers_let_go(monkeypatch):
    """gloo's worker thread drops its reference to a finished transfer's tensors a moment
    after the waiting thread wakes, so a send buffer the schedule has freed may still be
    counted beside what it allocates next (seen: an all-to-all's send buffer alive while
    its result is placed). Each wait here gives the worker that moment, so that the count
    is the schedule's own lifetimes."""
    wait = Arrivals.wait

    def wait_and_let_go(self, work, step):
        wait(self, work, step)
        time.sleep(0.002)

    monkeypatch.setattr(Arrivals, "wait", wait_and_let_go)


@pytest.fixture(autouse=True)
def at_most_four_ranks(mesh):
    """The counts depend on the ring's steps, which two and four ranks show; eight CPU ranks
    take long over them on a small machine."""
    if mesh.size() > 4:
        pytest.skip("runs at 2 and 4 ranks")


def peak(run, prepare=lambda: None) -> int:
    """The peak of ``run(prepare())``, only ``run`` counted."""
    arg = prepare()
    with Allocations() as counted:
        run(arg)
    return counted.peak


def assert_described(sched, q, k, v, dout, memory, slack: int = 0,
                     phases=("forward", "backward"), **kwargs) -> None:
    """A forward and a backward of ``sched`` allocate what ``memory`` says, to 2% plus
    ``slack`` bytes: the forward its outputs and ``memory.forward``, the backward
    ``memory.backward`` (its gradients among them). Each is measured until it matches, at
    most ``TRIES`` times, the least peak counting."""
    assert memory.kept == 0  # p2p on CPU ranks keeps nothing between calls
    kernel = WorkspaceKernel()

    def forward(_=None):
        q.grad = k.grad = v.grad = None
        return sdpa_fusion.attention(q, k, v, kernel=kernel, schedule=sched, **kwargs)

    forward().backward(dout)  # the agreement and every plan made once
    runs = {"forward": (forward, lambda: None, memory.outputs + memory.forward),
            "backward": (lambda out: out.backward(dout), forward, memory.backward)}
    for what in phases:
        run, prepare, want = runs[what]
        got = peak(run, prepare)
        for _ in range(TRIES - 1):  # every rank measures again while any rank is off
            if not sched.mesh.agree(abs(got - want) > 0.02 * want + slack).count(True):
                break
            got = min(got, peak(run, prepare))
        assert abs(got - want) <= 0.02 * want + slack, f"{what}: measured {got}, described {want}"


CASES = [("ring", 1, True), ("ring", 2, False), ("allgather", 1, False),
         ("allgather", 2, True), ("ulysses", 1, True), ("ulysses", 2, False)]


@pytest.mark.parametrize("name, groups, causal", CASES,
                         ids=[f"{n}-g{g}-{'causal' if c else 'full'}" for n, g, c in CASES])
def test_dense(mesh, name, groups, causal):
    p = mesh.size()
    h, s, e = 2 * p * groups, 32, 64
    sched = schedules.get(name, mesh, head_groups=groups,
                          partition="load_balanced" if causal else "contiguous")
    q, k, v, dout = (torch.randn(1, h, s, e) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    spec = sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=causal))
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory, _merge_scratch(q),
                     causal=causal)


@pytest.mark.parametrize("layout", ["bhse", "bshe"])
@pytest.mark.parametrize("window", [None, (5, 0)], ids=["causal", "window"])
def test_ring_backward_in_two_groups(mesh, layout, window, monkeypatch):
    """One head group (auto) on blocks at MIN_GROUP_WORK: the backward runs two groups, the
    first taking its own block first (BSHE: p2p sends each group's K/V from a copy)."""
    p = mesh.size()
    h, s, e = 2 * p, 32, 64
    # h heads x the rows that size groups: s local rows, or the window's span of 6 keys
    monkeypatch.setattr(heads, "MIN_GROUP_WORK", h * (s if window is None else 6))
    sched = schedules.get("ring", mesh)
    q, k, v, dout = (torch.randn(1, h, s, e) for _ in range(4))
    if layout == "bshe":
        q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    spec = sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=True,
                                                                    window=window, layout=layout))
    assert sched.describe(spec).backward_steps == 2 * sched.describe(spec).steps
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory, _merge_scratch(q),
                     causal=True, window=window, layout=layout)


WINDOW_CASES = [("ring", 1), ("ring", 2), ("allgather", 1), ("allgather", 2)]


@pytest.mark.parametrize("name, groups", WINDOW_CASES,
                         ids=[f"{n}-g{g}" for n, g in WINDOW_CASES])
def test_window(mesh, name, groups):
    """A causal window: blocks split into several calls (the ring's steps only those some rank
    needs, shifts of several hops; allgather's calls of every rank's block in rank order)."""
    p = mesh.size()
    h, s, e = 2 * p * groups, 32, 64
    sched = schedules.get(name, mesh, head_groups=groups)
    q, k, v, dout = (torch.randn(1, h, s, e) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    spec = sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=True,
                                                                    window=(5, 0)))
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory, _merge_scratch(q),
                     causal=True, window=(5, 0))


@pytest.mark.parametrize("name", ["ring", "allgather"])
def test_window_bf16_sums(mesh, name):
    """Backward under a window in bf16: more than two calls, so dQ sums in fp32 (and the
    ring's dK/dV sums travel in fp32 at any P)."""
    sched = schedules.get(name, mesh, head_groups=2)
    q, dout = (torch.randn(1, 8, 32, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 4, 32, 64, dtype=torch.bfloat16) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    spec = sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=True,
                                                                    window=(9, 0)))
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory, phases=("backward",),
                     causal=True, window=(9, 0))


def test_ring_bf16_sums(mesh):
    """Backward with dK/dV sums in bf16 (auto at P = 2, fp32 above), GQA, BSHE. (The torch
    merge of bf16 outputs on CPU takes fp32 temporaries, so the forward is not checked.)"""
    sched = schedules.get("ring", mesh, head_groups=2)
    q, dout = (torch.randn(1, 32, 8, 64, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(1, 32, 4, 64, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    spec = sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=True,
                                                                    layout="bshe"))
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory, phases=("backward",),
                     causal=True, layout="bshe")


PACKED_CASES = [("ring", None, 2), ("allgather", None, 2), ("allgather", None, 4),
                ("ulysses", None, 2), ("ulysses", None, 4), ("ring", (3, 0), 2),
                ("allgather", (3, 0), 2)]


@pytest.mark.parametrize("name, window, groups", PACKED_CASES,
                         ids=[f"{n}-{'window' if w else 'causal'}-g{g}"
                              for n, w, g in PACKED_CASES])
def test_packed(mesh, name, window, groups):
    """Packed calls; in 4 groups, ulysses runs its pipeline with a group in flight each way
    while one is attended, and allgather gathers the next group's K/V while a group's
    dK/dV sums land behind the next group's own calls."""
    p = mesh.size()
    problem = make_packed([8 * p, 4 * p, 12 * p], h=groups * p, e=64, causal=True,
                          window=window)
    sched = schedules.get(name, mesh, head_groups=groups)
    local = sched.pack(problem.cu_seqlens)
    q, k, v, dout = (local.shard(t).detach() for t in (problem.q, problem.k, problem.v,
                                                        problem.dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    spec = sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(
        q, k, v, causal=True, layout="thd", cu_seqlens=local.cu_seqlens,
        window=window).replace(packing=local))
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory,
                     _merge_scratch(q.transpose(0, 1).unsqueeze(0)), causal=True, layout="thd",
                     cu_seqlens=local, window=window)


def packed_inputs(sched, problem):
    """(this rank's packing, its q, k, v (requiring grad) and dout, the global causal spec)."""
    local = sched.pack(problem.cu_seqlens)
    q, k, v, dout = (local.shard(t).detach() for t in (problem.q, problem.k, problem.v,
                                                        problem.dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    spec = sdpa_fusion.AttentionSpec.from_tensors(problem.q, problem.k, problem.v, causal=True,
                                                  layout="thd", cu_seqlens=problem.cu_seqlens)
    return local, (q, k, v, dout), spec


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_packed_allgather_in_padded_parts(mesh, dtype):
    """Packed allgather in two head groups on sequences padded in every part (calls read
    rows by index); bf16: at P = 2 the dK/dV sums are bf16 (every rank's gathered calls have
    disjoint key sets), above fp32. (The forward's bf16 merge takes fp32 temporaries on CPU,
    so only the backward is checked.)"""
    p = mesh.size()
    problem = make_packed([8 * p + 1, 4 * p + 3, 12 * p + 5], h=4, h_kv=2, e=64, causal=True,
                          dtype=dtype)
    sched = schedules.get("allgather", mesh, head_groups=2)
    local, (q, k, v, dout), spec = packed_inputs(sched, problem)
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory, phases=("backward",),
                     causal=True, layout="thd", cu_seqlens=local)


@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses"])
def test_whole_documents(mesh, name):
    """Whole documents in local calls beside the transfers of the one document longer than a
    rank's share, cut and run by the schedule's packed path (ulysses: by heads over the
    ranks)."""
    p = mesh.size()
    problem = make_packed([24 * p, 3, 5, 1, 7, 4], h=4, e=64, causal=True)
    sched = schedules.get(name, mesh, partition="documents")
    local, (q, k, v, dout), spec = packed_inputs(sched, problem)
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory,
                     _merge_scratch(q.transpose(0, 1).unsqueeze(0)), layout="thd",
                     causal=True, cu_seqlens=local)


@pytest.mark.parametrize("partition", ["load_balanced", "documents"])
def test_ulysses_keeping_its_forward(mesh, partition):
    """``keep_forward=True``: the heads the forward gathered and its out and lse are held
    until the backward (described as outputs), whose peak is what it gathers of dout and
    its gradients; dense, and packed with whole documents beside a cut one."""
    p = mesh.size()
    sched = schedules.get("ulysses", mesh, keep_forward=True, partition=partition)
    if partition == "documents":
        problem = make_packed([24 * p, 3, 5, 1, 7, 4], h=4, e=64, causal=True)
        local, (q, k, v, dout), spec = packed_inputs(sched, problem)
        scratch, call = _merge_scratch(q.transpose(0, 1).unsqueeze(0)), dict(
            layout="thd", cu_seqlens=local)
    else:
        q, k, v, dout = (torch.randn(1, 2 * p, 32, 64) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        spec = sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=True))
        scratch, call = _merge_scratch(q), {}
    memory = sched.describe(spec).memory
    resent = schedules.get("ulysses", mesh, partition=partition).describe(spec).memory
    assert memory.outputs > resent.outputs and memory.backward < resent.backward
    assert_described(sched, q, k, v, dout, memory, scratch, causal=True, **call)


@pytest.mark.parametrize("name", ["ring", "allgather", "ulysses"])
def test_mask(mesh, name):
    """A composed mask: blocks it hides make no call, partial ones go through the mask."""
    p = mesh.size()
    h, s, e = 2 * p, 16 * p, 64
    sched = schedules.get(name, mesh)
    mask = masks.causal() | masks.prefix(5)
    q, k, v, dout = (torch.randn(1, h, s, e) for _ in range(4))
    spec = sdpa_fusion.AttentionSpec.from_tensors(q, k, v).replace(mask=mask)
    q, k, v, dout = (sched.shard(t).detach() for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory, _merge_scratch(q),
                     mask=mask)


@pytest.mark.parametrize("name", ["head_parallel", "replicated"])
@pytest.mark.parametrize("kv", ["mha", "one"])
def test_without_communication(mesh, name, kv):
    """One kernel call on the local heads: its outputs, its gradients and workspace."""
    p = mesh.size()
    sched = schedules.get(name, mesh)
    q, dout = (torch.randn(1, 2 * p, 32, 64) for _ in range(2))
    k, v = (torch.randn(1, 2 * p if kv == "mha" else 1, 32, 64) for _ in range(2))
    q, k, v, dout = (sched.shard(t).detach() for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    spec = sched.global_spec(sdpa_fusion.AttentionSpec.from_tensors(q, k, v, causal=True))
    assert_described(sched, q, k, v, dout, sched.describe(spec).memory, causal=True)


def two_dim_shapes(p: int) -> list[tuple[int, int]]:
    """(inner, outer) meshes over ``p`` ranks: 1 x P, and 2 x P/2 for even P."""
    return [(1, p)] + ([(2, p // 2)] if p % 2 == 0 else [])


@pytest.fixture(scope="module")
def meshes(mesh):
    """``meshes(shape)``: a ("heads", "seq") mesh over all ranks, made once per shape."""
    made = {}

    def get(shape):
        if shape not in made:
            made[shape] = sdpa_fusion.init_mesh(shape, ("heads", "seq"))
        return made[shape]

    return get


@pytest.mark.parametrize("inner", ["ulysses", "head_parallel"])
@pytest.mark.parametrize("outer", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["bhse", "thd"])
@pytest.mark.parametrize("groups", ["one", "most"])
def test_hybrid(mesh, meshes, monkeypatch, inner, outer, layout, groups):
    """The inner schedule's buffers around the outer schedule, its kernel call, for the
    heads each call takes (GQA; packed: sequences in user padding). ``most``: auto head
    groups take as many groups as fit, in both dims."""
    if groups == "most":
        monkeypatch.setattr(heads, "MIN_GROUP_WORK", 1)
    p = mesh.size()
    for shape in two_dim_shapes(p):
        pi = shape[0]
        sched = schedules.get("hybrid", meshes(shape), inner=inner, outer=outer)
        h, h_kv = 4 * pi, 2 * pi
        if layout == "thd":
            problem = make_packed([8 * p + 3, 4 * p, 12 * p], h=h, h_kv=h_kv, e=64, causal=True,
                                  slack=[5, 0, 2])
            local = sched.pack(problem.cu_seqlens, problem.cu_seqlens_padded)
            q, k, v, dout = (sched.shard(t, layout="thd", cu_seqlens=local).detach()
                             for t in (problem.q, problem.k, problem.v, problem.dout))
            spec = sdpa_fusion.AttentionSpec.from_tensors(
                problem.q, problem.k, problem.v, causal=True, layout="thd",
                cu_seqlens=problem.cu_seqlens, cu_seqlens_padded=problem.cu_seqlens_padded)
            kw = dict(layout="thd", cu_seqlens=local)
            scratch = _merge_scratch(q.transpose(0, 1).unsqueeze(0))
        else:
            full = [torch.randn(1, n, 8 * p, 64) for n in (h, h_kv, h_kv, h)]
            spec = sdpa_fusion.AttentionSpec.from_tensors(*full[:3], causal=True)
            q, k, v, dout = (sched.shard(t).detach() for t in full)
            kw = {}
            scratch = _merge_scratch(q)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        assert_described(sched, q, k, v, dout, sched.describe(spec).memory, scratch,
                         causal=True, **kw)


def _merge_scratch(q) -> int:
    """Bytes of the small [B, H, S] temporaries the torch merge makes on CPU (the GPU's
    in-place fusion makes one): a dozen lse-sized tensors."""
    return 12 * q.shape[0] * q.shape[1] * q.shape[2] * 4
