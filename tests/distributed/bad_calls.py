"""The calls of test_bad_input.py: one per class of mistake a rank can make.

A ``Case`` makes, on a rank, the good call or its bad variant: ``act(ctx, bad)`` returns the
action to run. ``error`` is the message every rank must raise when some ranks are bad (None:
no rank raises); with ``all_error=False`` the bad variant is itself a valid call when every
rank makes it (another problem, grad mode, schedule ...), and the action checks its results
against the reference. Problems are small: heads 2P, K/V heads P, 4P tokens, head dim 8.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import schedules
import sdpa_fusion
from schedules.partition import Documents
from schedules.ring import Ring
from sdpa_fusion.kernels import register
from sdpa_fusion.kernels.reference import ReferenceKernel

from tests.reference import tolerance

from .conftest import Problem, make_problem


class TwinKernel(ReferenceKernel):
    """The reference kernel under another name: a user's kernel, the same numbers."""

    name = "reference_twin"


register(TwinKernel())
_PROBLEMS: dict = {}


@dataclasses.dataclass
class Ctx:
    """The mesh, the schedule of the case and its base problem (``changes`` to the default)."""

    mesh: object
    sched: object
    base: dict

    @property
    def p(self) -> int:
        return self.mesh.size()

    def problem(self, **changes) -> Problem:
        kwargs = dict(b=1, h=2 * self.p, h_kv=self.p, s=4 * self.p, e=8, layout="bshe",
                      causal=True)
        kwargs.update(self.base, **changes)
        key = tuple(sorted(kwargs.items(), key=lambda kv: kv[0]))
        if key not in _PROBLEMS:
            _PROBLEMS[key] = make_problem(**kwargs)
        return _PROBLEMS[key]


def index_map(p: int, seed: int) -> list:
    """A random placement of 4P tokens, 4 per rank."""
    return torch.randperm(4 * p, generator=torch.Generator().manual_seed(seed)).view(p, -1).tolist()


def good_call(sched, prob: Problem, *, grad: bool = True) -> dict:
    q, k, v = (sched.shard(t, layout=prob.layout).requires_grad_(grad)
               for t in (prob.q, prob.k, prob.v))
    return dict(q=q, k=k, v=v, causal=prob.causal, scale=prob.scale, layout=prob.layout.value,
                kernel="reference", schedule=sched)


def check(call: dict, prob: Problem, *, backward: bool = True, grad_mode: bool = True) -> None:
    """Run ``call``; this rank's out (and gradients) must equal the reference's shards."""
    sched = call["schedule"]
    leaves = {n: call.pop(f"{n}_local", call[n]) for n in "qkv"}
    with torch.set_grad_enabled(grad_mode):
        out = sdpa_fusion.attention(**call)
    local = out.to_local() if isinstance(out, DTensor) else out
    tol = tolerance(local.dtype)
    shard = lambda t: sched.shard(t, layout=prob.layout)  # noqa: E731
    torch.testing.assert_close(local.double(), shard(prob.out), **tol)
    if not backward:
        assert not out.requires_grad
        return
    dout = shard(prob.dout).to(local.dtype)
    out.backward(DTensor.from_local(dout, out.device_mesh, out.placements) if out is not local else dout)
    for name, want in zip("qkv", (prob.dq, prob.dk, prob.dv)):
        torch.testing.assert_close(leaves[name].grad.double(), shard(want), **tol,
                                   msg=lambda m, n=name: f"d{n}: {m}")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    act: Callable  # (ctx, bad) -> zero-argument action
    error: str | None  # regex of every rank's error when some ranks are bad (None: no error)
    all_error: bool = True  # every rank bad: the same error, or (False) a correct call
    schedule: str = "ring"
    options: Callable[[int], dict] = lambda p: {}
    base: tuple = ()  # changes to the base problem, as (name, value) pairs

    @property
    def id(self) -> str:
        return self.name


# ---- attention calls: a transform of the good call on the bad ranks --------------------------
def attention(transform: Callable[[dict, Ctx], dict]):
    def act(ctx: Ctx, bad: bool):
        prob = ctx.problem()
        call = good_call(ctx.sched, prob)
        if bad:
            call = transform(call, ctx)
        return lambda: check(call, prob)
    return act


def tensors(fn):
    """A transform replacing q, k, v by ``fn(name, t)``."""
    return lambda call, ctx: {**call, **{n: fn(n, call[n].detach()) for n in "qkv"}}


def arg(**changes):
    return lambda call, ctx: {**call, **changes}


def like(t, **dims):
    """A random BSHE tensor shaped like ``t`` with b/h/s/e (and dtype) changed."""
    b, h, s, e = t.shape
    shape = [dims.get("b", b), dims.get("s", s), dims.get("h", h), dims.get("e", e)]
    return torch.randn(shape).to(dims.get("dtype", t.dtype)).transpose(1, 2)


def dtensors(call, ctx):
    """q, k, v as Shard(2) DTensors of this rank's parts (no communication)."""
    def wrap(t):
        return DTensor.from_local(t, ctx.mesh.torch_mesh, [Shard(2)], run_check=False)
    return {**call, **{n: wrap(call[n]) for n in "qkv"}, **{f"{n}_local": call[n] for n in "qkv"}}


def thd_with_string(call, ctx):
    packed = {n: call[n].detach()[0].transpose(0, 1) for n in "qkv"}
    return {**call, **packed, "layout": "thd", "cu_seqlens": f"0,2,{packed['q'].shape[0]}"}


def query_copies(ctx: Ctx, bad: bool):
    """The bad ranks shard q, k, v of one head (fewer than the ranks) with head_parallel."""
    prob = ctx.problem(h=1, h_kv=1) if bad else ctx.problem()
    return lambda: check(good_call(ctx.sched, prob), prob)


LOCAL_ERRORS = [
    Case("head_dim_12", attention(tensors(lambda n, t: like(t, e=12))),
         r"head_dim=12 must be a multiple of 8"),
    Case("kv_heads_3", attention(tensors(lambda n, t: t if n == "q" else like(t, h=3))),
         r"must be a multiple of kv_heads=3"),
    Case("layout_claim", attention(arg(layout="bhse")), r"q .* does not have the layout 'bhse' it claims"),
    Case("three_dims", attention(tensors(lambda n, t: t[0])), r"q has 3 dims .* needs the logical shape"),
    Case("kv_shapes_differ", attention(tensors(lambda n, t: like(t, s=2 * t.shape[2]) if n == "v" else t)),
         r"k \[.*\] and v \[.*\] must have the same shape"),
    Case("dtypes_differ", attention(tensors(lambda n, t: t if n == "q" else t.bfloat16())),
         r"q, k, v must share one dtype"),
    Case("float64", attention(tensors(lambda n, t: t.double())), r"dtype=torch.float64 is not supported"),
    Case("int64", attention(tensors(lambda n, t: t.long())), r"dtype=torch.int64 is not supported"),
    Case("batch_differs", attention(tensors(lambda n, t: like(t, b=2) if n == "q" else t)),
         r"q has batch 2 but k and v have batch 1"),
    Case("odd_local_length", attention(tensors(lambda n, t: like(t, s=3))),
         r"must be divisible by \d+ for load_balanced"),
    Case("causal_lengths_differ", attention(tensors(lambda n, t: t if n == "q" else like(t, s=2 * t.shape[2]))),
         r"causal context parallelism needs q and k/v of one length per rank"),
    Case("scale_inf", attention(arg(scale=math.inf)), r"scale=inf must be a positive number"),
    Case("scale_nan", attention(arg(scale=math.nan)), r"scale=nan must be a positive number"),
    Case("scale_negative", attention(arg(scale=-0.5)), r"scale=-0.5 must be a positive number"),
    Case("scale_tensor", attention(arg(scale=torch.tensor(0.5))), r"scale=tensor\(0.5000\) must be a positive"),
    Case("dropout_1.5", attention(arg(dropout_p=1.5)), r"dropout_p=1.5 must be in \[0, 1\)"),
    Case("kernel_unknown", attention(arg(kernel="bogus")), r"kernel='bogus' is not known; choose one of"),
    Case("kernel_gpu_only", attention(arg(kernel="flash")), r"kernel 'flash' runs on CUDA GPUs only"),
    Case("layout_unknown", attention(arg(layout="bsd")), r"layout='bsd' is not a known layout"),
    Case("causal_tensor", attention(arg(causal=torch.tensor(True))), r"causal=tensor\(True\) must be True or False"),
    Case("causal_string", attention(arg(causal="yes")), r"causal='yes' must be True or False"),
    Case("cu_seqlens_string", attention(thd_with_string),
         r"cu_seqlens must be an int32/int64 tensor or a list of ints, got str"),
    Case("cu_seqlens_dense", attention(arg(cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))),
         r"cu_seqlens= is given but layout='bshe' is dense"),
    Case("meta_device", attention(tensors(lambda n, t: t.to("meta"))), r"q, k, v are on the meta device"),
    Case("not_a_tensor", attention(tensors(lambda n, t: t.tolist() if n == "q" else t)),
         r"q must be a torch.Tensor, got list"),
    Case("strided_q", attention(tensors(lambda n, t: like(t, e=16)[..., ::2] if n == "q" else t)),
         r"q \(shape .*\) does not have the layout 'bshe'"),
    Case("dtensor_load_balanced", attention(dtensors), r"not contiguous chunks, which is what the DTensor "
         r"placement Shard\(2\) means; build the schedule with partition='contiguous'"),
    Case("dtensor_mixed", attention(lambda call, ctx: {**call, "q": dtensors(call, ctx)["q"]}),
         r"q, k, v must be all DTensors or all plain tensors"),
    Case("ulysses_heads", attention(tensors(lambda n, t: like(t, h=3))),
         r"heads=3 must be divisible by the \d ranks of schedule 'ulysses'", schedule="ulysses"),
    Case("allgather_kernel", attention(arg(kernel="bogus")), r"kernel='bogus' is not known",
         schedule="allgather"),
    Case("head_parallel_meta", attention(tensors(lambda n, t: t.to("meta"))), r"meta device",
         schedule="head_parallel"),
    Case("dropout_none", attention(arg(dropout_p=None)),
         r"dropout_p=None must be in \[0, 1\): a Python number"),
    Case("dropout_string", attention(arg(dropout_p="0.1")), r"dropout_p='0.1' must be in \[0, 1\)"),
    Case("dropout_bool", attention(arg(dropout_p=True)), r"dropout_p=True must be in \[0, 1\)"),
    Case("scale_string", attention(arg(scale="0.5")), r"scale='0.5' must be a positive number"),
    Case("causal_none", attention(arg(causal=None)), r"causal=None must be True or False"),
    Case("window_number", attention(arg(window=5)), r"window=5 must be a \(left, right\) pair"),
    Case("window_floats", attention(arg(window=(1.5, 0))),
         r"window left=1.5 must be a non-negative integer"),
    Case("kernel_list", attention(arg(kernel=["reference"])),
         r"kernel=\['reference'\] must be a kernel's name, one of \[.*'reference'.*\], or a "
         r"Kernel object"),
    Case("kernel_none", attention(arg(kernel=None)), r"kernel=None must be a kernel's name"),
    Case("layout_none", attention(arg(layout=None)), r"layout=None is not a known layout"),
    Case("head_parallel_query_copies", query_copies,
         r"q is a copy of one head of a tensor of 1 heads, not a multiple of the \d ranks of "
         r"schedule 'head_parallel'", schedule="head_parallel"),
]


# ---- valid calls that differ between ranks ----------------------------------------------------
def variant(changes: Callable[[int], dict]):
    """The call of another problem (``changes(P)`` to the base) on the bad ranks."""
    def act(ctx: Ctx, bad: bool):
        prob = ctx.problem(**(changes(ctx.p) if bad else {}))
        return lambda: check(good_call(ctx.sched, prob), prob)
    return act


def grad(*, grad_mode: bool, requires_grad: bool):
    """The bad ranks call with grad mode or the inputs' requires_grad off (forward only)."""
    def act(ctx: Ctx, bad: bool):
        prob = ctx.problem()
        call = good_call(ctx.sched, prob, grad=requires_grad or not bad)
        return lambda: check(call, prob, backward=not bad, grad_mode=grad_mode or not bad)
    return act


def other_schedule(make):
    """The bad ranks run the base call on ``make(mesh)`` (built alone: no agreement)."""
    def act(ctx: Ctx, bad: bool):
        sched = make(ctx.mesh) if bad else ctx.sched
        prob = ctx.problem()
        return lambda: check(good_call(sched, prob), prob)
    return act


def dtensor_or_not(ctx: Ctx, bad: bool):
    prob = ctx.problem()
    call = good_call(ctx.sched, prob)
    return lambda: check(dtensors(call, ctx) if bad else call, prob)


def dropout_or_not(ctx: Ctx, bad: bool):
    """The bad ranks ask for dropout (valid on a mesh when every rank does: each rank draws its
    own stream; its numbers are checked in test_dropout.py, here only that they are finite)."""
    prob = ctx.problem()
    call = good_call(ctx.sched, prob)
    if not bad:
        return lambda: check(call, prob)

    def run():
        out = sdpa_fusion.attention(**call, dropout_p=0.1)
        out.backward(torch.ones_like(out))
        assert all(bool(torch.isfinite(t).all()) for t in (out, call["q"].grad, call["k"].grad))
    return run


MISMATCHES = [
    Case("dropout", dropout_or_not, r"differ in dropout_p \(", all_error=False),
    Case("seq_len", variant(lambda p: dict(s=8 * p)), r"differ in q_len \(.*\), kv_len \(",
         all_error=False),
    Case("dtype", variant(lambda p: dict(dtype=torch.bfloat16)), r"differ in dtype \(", all_error=False),
    Case("causal", variant(lambda p: dict(causal=False)), r"differ in causal \(", all_error=False),
    Case("scale", variant(lambda p: dict(scale=0.3)), r"differ in scale \(", all_error=False),
    Case("head_dim", variant(lambda p: dict(e=16)), r"differ in head_dim \(", all_error=False),
    Case("kv_heads", variant(lambda p: dict(h_kv=2 * p)), r"differ in kv_heads \(", all_error=False),
    Case("layout", variant(lambda p: dict(layout="bhse")), r"differ in layout \(", all_error=False),
    Case("batch", variant(lambda p: dict(b=2)), r"differ in batch \(", all_error=False),
    Case("kernel_name", attention(arg(kernel="reference_twin")), r"differ in kernel \(.*reference_twin",
         all_error=False),
    Case("no_grad", grad(grad_mode=False, requires_grad=True), r"differ in backward \(", all_error=False),
    Case("requires_grad", grad(grad_mode=True, requires_grad=False), r"differ in backward \(",
         all_error=False),
    Case("dtensor_or_not", dtensor_or_not, r"differ in inputs \(", all_error=False,
         options=lambda p: dict(partition="contiguous")),
    Case("partition", other_schedule(lambda mesh: Ring(mesh, partition="contiguous")),
         r"differ in schedule.partition \(Auto\{.*\} on .* / Contiguous\{\} on", all_error=False),
    Case("index_map", other_schedule(lambda mesh: Ring(mesh, partition=index_map(mesh.size(), 7))),
         r"differ in schedule.partition \(IndexMap", all_error=False,
         options=lambda p: dict(partition=index_map(p, 3)), base=(("causal", False),)),
    Case("transport", other_schedule(lambda mesh: Ring(mesh, transport="p2p")),
         r"differ in schedule.transport \('auto' on .* / 'p2p' on", all_error=False),
    Case("transport_ulysses", other_schedule(lambda mesh: schedules.Ulysses(mesh, transport="p2p")),
         r"differ in schedule.transport \('auto' on .* / 'p2p' on", all_error=False,
         schedule="ulysses"),
    Case("schedule_name", other_schedule(lambda mesh: schedules.AllGather(mesh)),
         r"differ in schedule \('ring' on .* / 'allgather' on", all_error=False),
    # differences that do not change the call: no error anywhere
    Case("scale_spelled_out", attention(arg(scale=1 / math.sqrt(8))), None),
    Case("kernel_auto", attention(arg(kernel="auto")), None),
]


# ---- building schedules -----------------------------------------------------------------------
def build(name: str, options: Callable[[int], dict], *, bad_name: str | None = None, base=()):
    """The bad ranks call ``schedules.get(bad_name or name, mesh, **options(P))``; the others
    ``get(name, mesh)``; then the base call runs on the schedule."""
    def act(ctx: Ctx, bad: bool):
        def run():
            sched = schedules.get(bad_name or name if bad else name, ctx.mesh,
                                  **(options(ctx.p) if bad else {}))
            prob = ctx.problem(**dict(base))
            check(good_call(sched, prob), prob)
        return run
    return act


BUILDS = [
    Case("get_unknown_name", build("ring", lambda p: {}, bad_name="rnig"),
         r"schedule 'rnig' is not known; choose one of \['allgather', 'head_parallel'"),
    Case("get_option_typo", build("ring", lambda p: dict(partiton="contiguous")),
         r"schedule 'ring' takes the options \['dim', 'grad_dtype', 'head_groups', 'partition', "
         r"'transport'\]; 'partiton' is not among them"),
    Case("get_option_not_applying", build("head_parallel", lambda p: dict(partition="contiguous")),
         r"schedule 'head_parallel' takes the options \['dim'\]; 'partition' is not among them",
         schedule="head_parallel"),
    Case("get_partition_unknown", build("ring", lambda p: dict(partition="zigzag")),
         r"partition='zigzag' is not known"),
    Case("get_index_map_floats", build("ring", lambda p: dict(partition=[[0.5] * 4] * p)),
         r"index_map must hold integer token positions"),
    Case("get_index_map_holes", build("ring", lambda p: dict(partition=[[0, 1, 2, 3]] * p)),
         r"index_map must hold each of the \d+ token positions exactly once"),
    Case("get_transport_unknown", build("ring", lambda p: dict(transport="pigeon")),
         r"transport='pigeon' is not known"),
    Case("get_transport_unknown_allgather", build("allgather", lambda p: dict(transport="pigeon")),
         r"transport='pigeon' is not known", schedule="allgather"),
    Case("get_dim_unknown", build("ring", lambda p: dict(dim="heads")), r"mesh has no dim 'heads'"),
    Case("get_partition_differs", build("ring", lambda p: dict(partition="contiguous")),
         r"schedules.get needs the same call on every rank .* differ in schedule.partition \(",
         all_error=False),
    Case("get_documents_groups_differ",
         build("ring", lambda p: dict(partition=Documents(groups=False))),
         r"schedules.get needs the same call on every rank .* differ in schedule.partition \(",
         all_error=False),
]


# ---- unshard, and what one rank may call alone -----------------------------------------------
def unshard(shape: Callable[[int, bool], list]):
    def act(ctx: Ctx, bad: bool):
        full = torch.randn(shape(ctx.p, bad), generator=torch.Generator().manual_seed(5))

        def run():
            part = ctx.sched.shard(full) if isinstance(full, torch.Tensor) else full
            torch.testing.assert_close(ctx.sched.unshard(part), full, rtol=0, atol=0)
        return run
    return act


def alone(bad_argument: bool):
    """The bad ranks call explain (with a bad argument: it raises there only), describe and
    repr; the others nothing. None of them communicates."""
    def act(ctx: Ctx, bad: bool):
        def run():
            if not bad:
                return
            call = good_call(ctx.sched, ctx.problem())
            if bad_argument:
                with pytest.raises(ValueError, match="head_dim=12"):
                    sdpa_fusion.explain(**tensors(lambda n, t: like(t, e=12))(call, ctx))
                return
            plan = sdpa_fusion.explain(**call)
            assert "per rank:" in str(plan) and ctx.sched.name in repr(ctx.sched)
            ctx.sched.describe(ctx.sched.global_spec(plan.spec))
        return run
    return act


def copies_unsharded(keywords: dict, good: dict):
    """Under head_parallel with one K/V head (a copy on every rank): attention, backward,
    then the unshard of dK with ``keywords`` on the bad ranks and ``good`` on the others; it
    must be the reference's dK."""
    def act(ctx: Ctx, bad: bool):
        prob = ctx.problem(h_kv=1)

        def run():
            q, k, v = (ctx.sched.shard(t, layout=prob.layout).requires_grad_()
                       for t in (prob.q, prob.k, prob.v))
            out = sdpa_fusion.attention(q, k, v, causal=prob.causal, layout=prob.layout.value,
                                        kernel="reference", schedule=ctx.sched)
            out.backward(ctx.sched.shard(prob.dout, layout=prob.layout))
            dk = ctx.sched.unshard(k.grad, layout=prob.layout, **(keywords if bad else good))
            torch.testing.assert_close(dk.double(), prob.dk, **tolerance(dk.dtype))
        return run
    return act


def copies_folded(ctx: Ctx, bad: bool):
    """Under head_parallel with one K/V head: the bad ranks unshard shard's copy of k adding
    the copies (valid on every rank: P times k), the others as it is (k)."""
    prob = ctx.problem(h_kv=1)

    def run():
        k = ctx.sched.shard(prob.k, layout=prob.layout)
        keywords = dict(heads=1, copies="sum") if bad else {}
        got = ctx.sched.unshard(k, layout=prob.layout, **keywords)
        torch.testing.assert_close(got, prob.k * (ctx.p if bad else 1))
    return run


OTHERS = [
    Case("unshard_copy_gradient", copies_unsharded({}, dict(heads=1, copies="sum")),
         r"unshard cannot tell what a tensor of one head per rank is: .* Pass heads=1, "
         r"copies='sum' for the gradient of a copied K/V tensor", schedule="head_parallel"),
    Case("unshard_copy_gradient_heads_only",
         copies_unsharded(dict(heads=1), dict(heads=1, copies="sum")),
         r"hold copies of heads=1 heads; pass copies='sum' for gradients", schedule="head_parallel"),
    Case("unshard_copies_differ", copies_folded,
         r"unshard needs the same call .* differ in fold \(",
         all_error=False, schedule="head_parallel"),
    Case("unshard_shapes_differ", unshard(lambda p, bad: [1, 2, (8 if bad else 4) * p, 8]),
         r"unshard needs the same call .* differ in shape \(", all_error=False),
    Case("unshard_not_a_tensor", lambda ctx, bad: lambda: ctx.sched.unshard(
        [1.0] if bad else ctx.sched.shard(torch.zeros(1, 2, 4 * ctx.p, 8))),
        r"unshard takes a torch.Tensor, got list"),
    Case("explain_alone", alone(bad_argument=False), None),
    Case("explain_alone_bad_argument", alone(bad_argument=True), None),
]

CASES = LOCAL_ERRORS + MISMATCHES + BUILDS + OTHERS
