"""``attention(q, k, v, ...)``: the differentiable entry point, on one device or a mesh.

On a mesh the ranks of the schedule's control group first agree on every call (``agreement``,
on ``call_fields``) or all raise the same ValueError. ``explain``/``plan`` check one rank's
call and never communicate.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging

import torch

from . import kernels, masks
from .agreement import agree
from .kernels import Dropout, Kernel
from .kernels.base import like_layout
from .layout import Layout, layout_of, tensor_layout
from .local import local_backward, local_forward
from .mask import Window
from .spec import AttentionSpec

log = logging.getLogger("sdpa_fusion")

_FIX = ("pass the same arguments on every rank, each rank's part of the same tensors "
        "(schedule.shard(...)), under the same grad mode")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``attention`` will run: the local spec, the kernel and why, and the schedule."""

    spec: AttentionSpec
    kernel: Kernel
    skipped: tuple[str, ...]
    schedule: object
    why: str = ""  # why ``auto`` chose the kernel

    def __str__(self) -> str:
        where = self.schedule if self.schedule is not None else "none (one device, no communication)"
        lines = [f"schedule: {where}", f"local problem: {self.spec}", f"kernel: {self.kernel.name}"]
        lines += [f"  {self.why}"] if self.why else []
        lines += [f"  skipped: {reason}" for reason in self.skipped]
        if self.schedule is not None and self.schedule.mesh is not None:
            lines.append(f"per rank: {self.schedule.describe(self.schedule.global_spec(self.spec))}")
        return "\n".join(lines)


def plan(q, k, v, *, causal=False, scale=None, layout="auto", kernel="auto", schedule=None,
         dropout_p=0.0, cu_seqlens=None, cu_seqlens_padded=None, window=None, mask=None) -> Plan:
    """Check this rank's call and choose the kernel, without communicating (a bad argument
    raises here on this rank; ``attention`` raises it on every rank)."""
    q_layout = tensor_layout("q", q, layout)  # "auto": read from q
    _check_arguments(schedule, causal, kernel, q_layout, cu_seqlens, cu_seqlens_padded)
    causal, window, mask = _composed(causal, window, mask)
    packing = schedule.local_packing(q, cu_seqlens, cu_seqlens_padded) \
        if schedule is not None and q_layout.is_varlen else None
    if packing is not None:  # the global packing, split: this rank's lengths (host values)
        cu_seqlens, cu_seqlens_padded = packing.offsets
    spec = AttentionSpec.from_tensors(
        q, k, v, layout=layout, causal=causal, scale=scale, dropout_p=dropout_p,
        cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded, window=window,
    ).replace(packing=packing, mask=mask)
    _check_device(q.device, schedule.mesh if schedule is not None else None)
    if schedule is not None:
        schedule.validate(spec)
        schedule.check_shards(q, k, v)
    if mask is not None:  # a ValueError when the mask cannot describe the global problem
        full = schedule.global_spec(spec) if schedule is not None else spec
        if full.layout.is_varlen:
            sequences = full.sequences()
            full.mask.check(len(sequences), max((n for _, n in sequences), default=0))
        else:
            full.mask.check(full.batch, max(full.q_len, full.kv_len))
    extent = schedule.call_extent(spec) if schedule is not None else None
    calls = schedule.kernel_calls(spec) if schedule is not None else 1
    chosen = kernels.select(kernel, spec, q.device, extent=extent, calls=calls)
    return Plan(spec, chosen.kernel, tuple(chosen.skipped), schedule, chosen.why)


def explain(q, k, v, **kwargs) -> Plan:
    """The plan ``attention(q, k, v, **kwargs)`` would run (kernel and why, schedule, per-rank
    cost); never communicates, so one rank may call it alone."""
    return plan(q, k, v, **kwargs)


def _check_arguments(schedule, causal, kernel, layout, cu_seqlens, cu_seqlens_padded) -> None:
    if schedule is not None and not hasattr(schedule, "control"):
        raise ValueError(f"schedule={schedule!r} must be a schedule object, e.g. "
                         "schedules.get('ring', mesh), or None (one device)")
    if not isinstance(causal, bool):
        raise ValueError(f"causal={causal!r} must be True or False, not a {type(causal).__name__}")
    if not isinstance(kernel, (str, Kernel)):
        raise ValueError(f"kernel={kernel!r} must be a kernel's name, one of {kernels.names()}, "
                         f"or a Kernel object, not a {type(kernel).__name__}")
    varlen = layout.is_varlen
    for name, value in (("cu_seqlens", cu_seqlens), ("cu_seqlens_padded", cu_seqlens_padded)):
        if value is not None and not varlen:
            raise ValueError(f"{name}= is given but layout={str(layout)!r} is dense; pass "
                             f"layout='thd' for packed sequences, or leave {name} out")


def _composed(causal: bool, window, mask):
    """(causal, window, mask): a mask with causal and window folded in, or, when the whole is
    only causal and a window, those (the plain paths) and no mask."""
    if mask is None:
        return causal, window, None
    if not isinstance(mask, masks.Mask):
        raise ValueError(f"mask={mask!r} must be built with sdpa_fusion.masks, e.g. "
                         f"masks.causal() & masks.document_ids(ids), or None")
    if causal:
        mask = masks.causal() & mask
    if window is not None:
        window = Window.of(window)
        mask = masks.window(window.left, window.right) & mask
    plain = mask.band()
    return (plain[0], plain[1], None) if plain is not None else (False, None, mask)


def _check_device(device: torch.device, mesh) -> None:
    if device.type == "meta":
        raise ValueError("q, k, v are on the meta device (no data); attention needs real tensors")
    if mesh is not None and (device.type != mesh.device.type
                             or (device.type == "cuda" and device != mesh.device)):
        raise ValueError(f"q, k, v are on {device} but this rank of the mesh runs on "
                         f"{mesh.device}; move them there (tensor.to({str(mesh.device)!r}))")


def call_fields(p: Plan, needs_grad: bool, dtensor: bool, device: torch.device) -> dict[str, str]:
    """What every rank of the schedule's control group must have alike for this call."""
    full = p.schedule.global_spec(p.spec).replace(scale=p.spec.softmax_scale)
    fields = {f.name: _text(getattr(full, f.name)) for f in dataclasses.fields(full)}
    fields.update(p.schedule.configuration_fields())
    fields.update(kernel=p.kernel.name, device=device.type,
                  backward="follows" if needs_grad else "none (no_grad, or no input requires grad)",
                  inputs="DTensor" if dtensor else "torch.Tensor")
    return fields


_PLANS: collections.OrderedDict = collections.OrderedDict()  # call key -> (plan, fields)
PLANS_KEPT = 8  # plans kept: a model's layers repeat a few calls, each step's packing anew


def _planned(q, k, v, options: dict) -> tuple[Plan, dict]:
    """``plan`` of a call and its agreement fields so far (by (needs_grad, dtensor)), kept per
    ``_call_key`` for the last ``PLANS_KEPT`` calls (or the schedule's ``kept_plans``)."""
    schedule = options["schedule"]
    kept = _PLANS if schedule is None else getattr(schedule, "kept_plans", None)
    key = _call_key(q, k, v, options)
    if key is None or kept is None:
        return plan(q, k, v, **options), {}
    found = kept.get(key)
    if found is not None:
        kept.move_to_end(key)
        return found
    kept[key] = found = (plan(q, k, v, **options), {})
    while len(kept) > PLANS_KEPT:
        kept.popitem(last=False)
    return found


def _call_key(q, k, v, options: dict):
    """What a call's plan depends on (the tensors' metadata and the options); None (plan anew)
    when an option may change in place (a tensor, a list, a mask) or q, k, v are no tensors."""
    if any(isinstance(value, (torch.Tensor, list)) for value in options.values()) or \
            options["mask"] is not None or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    key = (tuple((t.shape, t.stride(), t.dtype, t.device) for t in (q, k, v)),
           tuple((name, _typed(value)) for name, value in options.items() if name != "schedule"))
    try:
        return _CallKey(key)
    except TypeError:
        return None


class _CallKey:
    """A call key hashed once: a kept plan is looked up, found and moved with one hash of its
    offsets, however many documents the pack holds."""

    __slots__ = ("key", "hash")

    def __init__(self, key: tuple):
        self.key, self.hash = key, hash(key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _CallKey) and self.hash == other.hash and self.key == other.key


_INTS = "ints"  # _typed's mark of a tuple of ints (no other typed value starts with a string)


def _typed(value):
    """``value`` with the type of every part, so that a key tells ``1`` from ``True``; a
    tuple of ints (a pack's offsets) as it is, its items' types checked in one pass in C."""
    if isinstance(value, tuple):
        if set(map(type, value)) <= {int}:
            return _INTS, value
        return tuple(_typed(v) for v in value)
    return type(value), value


_long_text = functools.lru_cache(maxsize=16)(repr)


def _text(value) -> str:
    """``repr(value)``; that of a long tuple (a pack's offsets) made once."""
    return _long_text(value) if isinstance(value, tuple) and len(value) > 64 else repr(value)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, call: int):
        q, k, v = (plan.spec.layout.to(t) for t in (q, k, v))  # layout="auto": one layout
        dropout = Dropout.draw(plan.spec.dropout_p) if plan.spec.dropout_p > 0 else None
        # what the schedule's forward leaves for its backward (Ulysses: the heads it gathered)
        keeps = plan.schedule is not None and plan.schedule.keeps_forward
        kept = {} if keeps and any(ctx.needs_input_grad[:3]) else None
        if plan.schedule is None:
            out, lse = local_forward(plan.kernel, q, k, v, plan.spec, dropout)
        else:
            with plan.schedule.running(f"forward of call {call}"):
                out, lse = plan.schedule.forward(q, k, v, plan.spec, plan.kernel, dropout,
                                                 **_kept(kept))
        ctx.plan, ctx.dropout, ctx.call, ctx.kept = plan, dropout, call, kept
        ctx.keeps = kept is not None  # alike on every rank (the schedule's and the call's)
        ctx.shapes = None  # q, k, v and out are saved, unless the backward reads what was kept
        if kept is not None and not plan.schedule.backward_reads_inputs(plan.spec):
            ctx.shapes = [(t.shape, t.dtype, layout_of(t) if t.dim() == 4 else None)
                          for t in (q, k, v)]
            ctx.save_for_backward(None, None, None, None, lse)
        else:
            ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        p, dropout, grads = ctx.plan, ctx.dropout, {}
        if ctx.keeps and ctx.kept is None:  # on every rank alike (some hold no q, k, v)
            raise RuntimeError(
                f"a second backward through attention call {ctx.call} (retain_graph=True): "
                f"its forward kept what schedule {p.schedule.name!r} gathered for one "
                f"backward, which let it go; build the schedule with keep_forward=False to "
                f"backward through a call more than once")
        if ctx.shapes is not None:  # the gradients' buffers stand in for q, k, v and dout for out
            q, k, v = (torch.empty(shape, dtype=dtype, device=lse.device) if layout is None
                       else layout.empty(shape, dtype=dtype, device=lse.device)
                       for shape, dtype, layout in ctx.shapes)
            grads = dict(dq=q, dk=k, dv=v)
        dout = p.spec.layout.to(dout) if p.spec.layout.is_varlen else like_layout(dout, q)
        if p.schedule is None:
            dq, dk, dv = local_backward(p.kernel, dout, q, k, v, out, lse, p.spec, dropout)
        else:
            with p.schedule.running(f"backward of call {ctx.call}"):
                dq, dk, dv = p.schedule.backward(dout, q, k, v, dout if out is None else out,
                                                 lse, p.spec, p.kernel, dropout, **grads,
                                                 **_kept(ctx.kept))
        ctx.kept = None  # let go: a second backward (retain_graph) is refused
        return dq, dk, dv, None, None


def _kept(kept: dict | None) -> dict:
    """The ``kept`` keyword of a schedule's forward and backward (none: it keeps nothing)."""
    return {} if kept is None else {"kept": kept}


def attention(q, k, v, *, causal: bool = False, scale: float | None = None,
              layout: Layout | str = "auto", kernel: str | Kernel = "auto", schedule=None,
              dropout_p: float = 0.0, cu_seqlens=None, cu_seqlens_padded=None,
              window=None, mask=None) -> torch.Tensor:
    """Scaled-dot-product attention of q [B,H,S,E] over k, v [B,H_kv,S_kv,E] (or packed THD).

    ``schedule=None`` runs on one device; a schedule from ``schedules.get`` runs over its
    mesh on this rank's shards once every rank agreed on the call. ``kernel``: "auto", "cudnn",
    "fa4", "flash", "nvfuser" or "reference". ``window=(left, right)`` keeps key j for query i
    when ``i - left <= j <= i + right`` (per sequence when packed; None: unbounded).
    ``layout="auto"`` reads each tensor's memory order. ``mask`` (``sdpa_fusion.masks``) is
    and-ed with ``causal`` and ``window``. Differentiable in q, k, v; DTensors whose
    placements describe the schedule's shards give a DTensor.
    """
    from .dtensor import unwrap_dtensors

    p = fields = error = rewrap = None
    try:
        (q, k, v), rewrap = unwrap_dtensors((q, k, v), schedule)
        options = dict(causal=causal, scale=scale, layout=layout, kernel=kernel,
                       schedule=schedule, dropout_p=dropout_p, cu_seqlens=cu_seqlens,
                       cu_seqlens_padded=cu_seqlens_padded, window=window, mask=mask)
        p, known_fields = _planned(q, k, v, options)
        if schedule is not None and schedule.mesh is not None:
            needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            said = (needs_grad, rewrap is not None)
            if said not in known_fields:
                known_fields[said] = call_fields(p, needs_grad, rewrap is not None, q.device)
            fields = known_fields[said]
    except Exception as e:  # noqa: BLE001 - every failure is agreed on, not only ValueError
        error = e
    control = schedule.control if schedule is not None and hasattr(schedule, "control") else None
    call = agree(control, fields, error, what="attention", fix=_FIX)
    if p.skipped:
        log.info("%s (skipped: %s)", p.why, "; ".join(p.skipped))
    out = _Attention.apply(q, k, v, p, call)
    return out if rewrap is None else rewrap(out)
