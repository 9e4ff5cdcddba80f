"""Attention as nvFuser fusion definitions, in the subclass style of nvFuser's older frontend.

    fd = SdpaForward(spec)                  # definition() runs here
    fd.multidevice_schedule(mesh, parts)    # optional: split heads over an nvFuser DeviceMesh
    out, lse = fd.execute([q, k, v])        # CUDA tensors laid out as spec.layout says
    print(fd)                               # a script that rebuilds this fusion

``definition()`` declares tensors and ops; ``multidevice_schedule`` only annotates them.
Batch and sequence lengths are symbolic, so ``cached`` gives one fusion per head count, head
dim, dtype, layout and mask; the softmax scale (and dropout probability) are scalar inputs, so
the printed script keeps them exact. GQA repeats each K/V head inside the fusion.
"""

from __future__ import annotations

import re

import torch
from nvfuser_direct import DataType, FusionDefinition, FusionGuard, ParallelType, translate_fusion
from nvfuser_direct.pytorch_utils import torch_dtype_to_nvfuser_dtype

from .layout import Layout, check_layout
from .spec import AttentionSpec

_CACHE: dict[tuple, "Definition"] = {}

_SCRIPT_HEADER = """import torch
import nvfuser_direct as nvfuser
from nvfuser_direct import FusionDefinition, DataType, ParallelType
"""

_SCHEDULE_SCRIPT = """def multidevice_schedule(fd : FusionDefinition) -> None :
    mesh = nvfuser.multidevice.DeviceMesh({devices})
    for tv in fd.fusion.inputs():
        if tv.is_tensor():
            tv.set_device_mesh(mesh)
        if tv.is_tensor() and tv.ndim >= 3:
            tv.outer_split(1, {parts})
            tv.axis(1).parallelize(ParallelType.mesh_x)
"""


class Definition(FusionDefinition):
    """A FusionDefinition built by ``definition()`` at construction; subclasses name their
    tensor inputs and outputs and the extents a head split divides (``split_extents``)."""

    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.mesh, self.parts = None, 1
        with self:
            self.definition()

    def definition(self) -> None:
        raise NotImplementedError

    @classmethod
    def signature(cls, *args, **kwargs) -> tuple:
        """What the definition depends on: instances with equal signatures are interchangeable."""
        return args, tuple(sorted(kwargs.items()))

    @classmethod
    def cached(cls, *args, mesh=None, parts: int = 1, **kwargs) -> "Definition":
        """The shared instance for these arguments, built (and scheduled on ``mesh``) once."""
        key = (cls, cls.signature(*args, **kwargs), None if mesh is None else str(mesh), parts)
        if key not in _CACHE:
            fd = cls(*args, **kwargs)
            if mesh is not None:
                fd.multidevice_schedule(mesh, parts)
            _CACHE[key] = fd
        return _CACHE[key]

    def split_extents(self) -> dict[str, int]:
        return {}

    def multidevice_schedule(self, mesh, parts: int) -> None:
        """Split the head axis (dim 1) of every tensor input into ``parts`` on the 1-D nvFuser
        ``mesh``; each rank then executes on its head shards and gets its output shards."""
        if hasattr(self, "fec"):
            raise ValueError(f"{type(self).__name__}.multidevice_schedule must come before the "
                             f"first execute; build a new definition (or use .cached(..., mesh=, "
                             f"parts=))")
        if self.mesh is not None:
            raise ValueError(f"{type(self).__name__} is already scheduled on {self.mesh}")
        if parts != mesh.size:
            raise ValueError(f"parts={parts} must equal the size {mesh.size} of mesh {mesh}")
        for name, extent in self.split_extents().items():
            if extent % parts:
                raise ValueError(f"{name}={extent} must be divisible by parts={parts} for a head "
                                 f"split; choose parts among the divisors of {extent}")
        guard = FusionGuard(self._fusion)
        try:  # what _SCHEDULE_SCRIPT prints; outputs follow by sharding propagation
            for tv in self._fusion.inputs():
                if tv.is_tensor():
                    tv.set_device_mesh(mesh)
                if tv.is_tensor() and tv.ndim >= 3:
                    tv.outer_split(1, parts)
                    tv.axis(1).parallelize(ParallelType.mesh_x)
        finally:
            del guard
        self.mesh, self.parts = mesh, parts

    def scalar_inputs(self, **values) -> list:
        """Values of the scalar inputs, appended after the tensors by ``execute``."""
        if values:
            raise ValueError(f"{type(self).__name__} takes no {', '.join(values)}")
        return []

    def check_inputs(self, inputs: list) -> None:
        if len(inputs) != len(self.input_names):
            raise ValueError(f"{type(self).__name__} takes {len(self.input_names)} tensors "
                             f"({', '.join(self.input_names)}), got {len(inputs)}")

    def execute(self, inputs, *, device=None, **scalars) -> list[torch.Tensor]:
        """The outputs (``output_names``) for CUDA ``inputs`` (local shards once scheduled)."""
        inputs = list(inputs)
        self.check_inputs(inputs)
        return super().execute(inputs + self.scalar_inputs(**scalars), device=device)

    def __str__(self) -> str:
        return self.repro_script_for(None)

    def repro_script_for(self, inputs: list | None = None) -> str:
        """A script that rebuilds this fusion (and runs it on stand-ins for ``inputs``)."""
        parts = [_SCRIPT_HEADER, translate_fusion(self.fusion)]
        body = "with FusionDefinition() as fd:\n    nvfuser_fusion(fd)\n"
        if self.mesh is not None:
            devices = [int(d) for d in re.findall(r"-?\d+", str(self.mesh))]
            parts.append(_SCHEDULE_SCRIPT.format(devices=devices, parts=self.parts))
            body += "    multidevice_schedule(fd)\n"
        parts.append(body)
        if inputs is not None:
            parts.append("inputs = [\n" + "".join(f"    {_source_of(x)},\n" for x in inputs) + "]\n")
            parts.append("fd.execute(inputs)\n")
        return "\n".join(parts)


def _source_of(x) -> str:
    """Python source of a stand-in for input ``x`` (same shape, strides and dtype)."""
    if not isinstance(x, torch.Tensor):
        return repr(x)
    make = "torch.randn" if x.dtype.is_floating_point else "torch.zeros"
    return (f"{make}({x.numel()}, dtype={x.dtype}, device='{x.device}')"
            f".as_strided({tuple(x.shape)}, {x.stride()})")


class _Attention(Definition):
    """Shared parts of the attention definitions; ``spec`` holds global head counts. A causal
    mask follows ATen flash: aligned bottom-right when q_len != kv_len."""

    def __init__(self, spec: AttentionSpec):
        spec.validate()
        if spec.layout.is_varlen:
            raise ValueError("layout='thd' has no fusion definition; run packed sequences one by "
                             "one as 'bshe' views (sdpa_fusion.local does)")
        if spec.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype={spec.dtype}: nvFuser's sdpfa takes torch.float16 or "
                             f"torch.bfloat16")
        if spec.head_dim > 256:
            raise ValueError(f"head_dim={spec.head_dim}: flash attention supports head_dim <= 256")
        self.spec = spec
        super().__init__()

    @classmethod
    def signature(cls, spec: AttentionSpec) -> tuple:
        return (spec.heads, spec.kv_heads, spec.head_dim, spec.dtype, spec.causal,
                spec.dropout_p > 0, spec.layout)

    @property
    def has_dropout(self) -> bool:
        return self.spec.dropout_p > 0

    def split_extents(self) -> dict[str, int]:
        return {"heads": self.spec.heads, "kv_heads": self.spec.kv_heads}

    def scalar_inputs(self, *, scale: float | None = None, dropout_p: float | None = None) -> list:
        scale = self.spec.softmax_scale if scale is None else scale
        if not self.has_dropout:
            if dropout_p:
                raise ValueError(f"dropout_p={dropout_p} given to a definition built without "
                                 f"dropout; build it from a spec with dropout_p > 0")
            return [float(scale)]
        return [float(self.spec.dropout_p if dropout_p is None else dropout_p), float(scale)]

    def check_inputs(self, inputs: list) -> None:
        super().check_inputs(inputs)
        for name, t in zip(self.input_names, inputs):
            if t.dim() == 4:
                check_layout(name, t, self.spec.layout)

    def _tensor(self, heads: int):
        """A [B, heads, S, E] input in the spec's dtype and layout."""
        return self.define_tensor(shape=[-1, heads, -1, self.spec.head_dim], contiguity=True,
                                  dtype=torch_dtype_to_nvfuser_dtype(self.spec.dtype),
                                  stride_order=self.spec.layout.stride_order)

    def _scalars(self):
        """(dropout_p, is_causal, scale): dropout_p and scale are inputs when symbolic."""
        dropout_p = self.define_scalar(None, dtype=DataType.Double) if self.has_dropout else 0.0
        scale = self.define_scalar(None, dtype=DataType.Double)
        return dropout_p, self.define_scalar(self.spec.causal, dtype=DataType.Bool), scale

    def _expand_kv(self, t):
        """[B, H_kv, S, E] -> [B, H, S, E]: each K/V head repeated for its group (GQA)."""
        groups, h_kv, e = self.spec.groups, self.spec.kv_heads, self.spec.head_dim
        if groups == 1:
            return t
        b, s = self.ops.size(t, 0), self.ops.size(t, 2)
        t = self.ops.broadcast_in_dim(t, shape=[b, h_kv, 1, s, e], broadcast_dims=[0, 1, 3, 4])
        t = self.ops.expand(t, shape=[b, h_kv, groups, s, e])
        return self.ops.reshape(t, [b, h_kv * groups, s, e])

    def _reduce_kv(self, grad):
        """[B, H, S, E] -> [B, H_kv, S, E]: gradients of a group summed in fp32 (GQA)."""
        groups, h_kv, e = self.spec.groups, self.spec.kv_heads, self.spec.head_dim
        if groups == 1:
            return grad
        b, s = self.ops.size(grad, 0), self.ops.size(grad, 2)
        grad = self.ops.reshape(grad, [b, h_kv, groups, s, e])
        grad = self.ops.sum(grad, [2], dtype=DataType.Float)
        grad = self.ops.cast(grad, torch_dtype_to_nvfuser_dtype(self.spec.dtype))
        return self.ops.stride_order(grad, self.spec.layout.stride_order)


class SdpaForward(_Attention):
    """q, k, v -> out [B,H,S,E] (q's layout), lse fp32 [B,H,S] (+ philox seed, offset)."""

    input_names = ("q", "k", "v")

    @property
    def output_names(self):
        return ("out", "lse") + (("seed", "offset") if self.has_dropout else ())

    def definition(self) -> None:
        q = self._tensor(self.spec.heads)
        k, v = (self._tensor(self.spec.kv_heads) for _ in range(2))
        dropout_p, is_causal, scale = self._scalars()
        out, lse, seed, offset = self.ops.sdpfa_fwd(q, self._expand_kv(k), self._expand_kv(v),
                                                    dropout_p=dropout_p, is_causal=is_causal,
                                                    scale=scale)
        for t in (out, lse) + ((seed, offset) if self.has_dropout else ()):
            self.add_output(t)


class SdpaBackward(_Attention):
    """dout, q, k, v, out, lse, seed, offset -> dq, dk, dv, each in its input's layout; out and
    lse of the whole row (so a ring can apply it per block); seed and offset: a dropout
    forward's philox state (without dropout ATen ignores them: any uint64 [2] and [])."""

    input_names = ("dout", "q", "k", "v", "out", "lse", "seed", "offset")
    output_names = ("dq", "dk", "dv")

    def definition(self) -> None:
        dout, q = self._tensor(self.spec.heads), self._tensor(self.spec.heads)
        k, v = (self._tensor(self.spec.kv_heads) for _ in range(2))
        out = self._tensor(self.spec.heads)
        lse = self.define_tensor(shape=[-1, self.spec.heads, -1], contiguity=True,
                                 dtype=DataType.Float)
        seed = self.define_tensor(shape=[2], contiguity=True, dtype=DataType.UInt64)  # philox
        offset = self.define_tensor(shape=[], dtype=DataType.UInt64)
        dropout_p, is_causal, scale = self._scalars()
        dq, dk, dv = self.ops.sdpfa_bwd(dout, q, self._expand_kv(k), self._expand_kv(v), out, lse,
                                        dropout_p, is_causal, seed, offset, scale)
        for t in (dq, self._reduce_kv(dk), self._reduce_kv(dv)):
            self.add_output(t)


class SdpaForwardBackward(_Attention):
    """q, k, v, dout -> out, lse, dq, dk, dv (+ seed, offset) in one fusion."""

    input_names = ("q", "k", "v", "dout")

    @property
    def output_names(self):
        return ("out", "lse", "dq", "dk", "dv") + (("seed", "offset") if self.has_dropout else ())

    def definition(self) -> None:
        q = self._tensor(self.spec.heads)
        k, v = (self._tensor(self.spec.kv_heads) for _ in range(2))
        dout = self._tensor(self.spec.heads)
        dropout_p, is_causal, scale = self._scalars()
        k_x, v_x = self._expand_kv(k), self._expand_kv(v)
        out, lse, seed, offset = self.ops.sdpfa_fwd(q, k_x, v_x, dropout_p=dropout_p,
                                                    is_causal=is_causal, scale=scale)
        dq, dk, dv = self.ops.sdpfa_bwd(dout, q, k_x, v_x, out, lse, dropout_p, is_causal, seed,
                                        offset, scale)
        for t in (out, lse, dq, self._reduce_kv(dk), self._reduce_kv(dv)) + (
                (seed, offset) if self.has_dropout else ()):
            self.add_output(t)


def _merge_weights(ops, lse_a, lse_b):
    """(w_a, w_b, lse) of two partial results (``LseMerge``'s math); 0, 0, -inf where no key."""
    m = ops.maximum(lse_a, lse_b)
    m = ops.where(ops.isneginf(m), 0.0, m)
    w_a, w_b = ops.exp(ops.sub(lse_a, m)), ops.exp(ops.sub(lse_b, m))
    total = ops.add(w_a, w_b)
    lse = ops.add(m, ops.log(total))
    inv = ops.reciprocal(ops.where(ops.eq(total, 0.0), 1.0, total))
    return ops.mul(w_a, inv), ops.mul(w_b, inv), lse


def _contiguity(memory_order, heads: int, dense: bool) -> list:
    """Contiguity of each dim in ``memory_order``: the innermost dense, the others when
    ``dense``; None for the heads dim of a single head (nvFuser takes it as a broadcast)."""
    inner = memory_order[-1]
    return [None if d == 1 and heads == 1 else (True if d == inner else dense)
            for d in memory_order]


def _weighted_sum(ops, out_a, w_a, out_b, w_b):
    """w_a out_a + w_b out_b in fp32."""
    return ops.add(ops.mul(ops.cast(out_a, DataType.Float), w_a),
                   ops.mul(ops.cast(out_b, DataType.Float), w_b))


class _Blocks(Definition):
    """Shared parts of the definitions that combine two [B, H, S, E] results. Per-row inputs
    are declared [B, H, S, 1] (``execute`` takes them [B, H, S]) so that the fusion has no
    broadcast op: nvFuser moves an in-place write that a broadcast feeds into a copy kernel of
    its own (against a read-write race across the broadcast), a second pass."""

    row_inputs, row_outputs = (1, 3), ()  # positions of the per-row tensors

    def __init__(self, heads: int, head_dim: int, *, layout: Layout | str = Layout.BHSE,
                 acc_dtype: torch.dtype = torch.float32, block_dtype: torch.dtype = torch.bfloat16,
                 dense: bool = False):
        self.heads, self.head_dim, self.layout = heads, head_dim, Layout.of(layout)
        self.dense, self.acc_dtype, self.block_dtype = dense, acc_dtype, block_dtype
        if self.layout.is_varlen:
            raise ValueError(f"{type(self).__name__} takes layout 'bhse' or 'bshe'; view packed "
                             f"tensors as 'bshe'")
        for name, dtype in (("acc_dtype", acc_dtype), ("block_dtype", block_dtype)):
            if not dtype.is_floating_point:
                raise ValueError(f"{name}={dtype} must be a floating-point dtype")
        super().__init__()

    def split_extents(self) -> dict[str, int]:
        return {"heads": self.heads}

    def _block(self, dtype: torch.dtype):
        return self.define_tensor(
            shape=[-1, self.heads, -1, self.head_dim],
            contiguity=_contiguity(self.layout.memory_order, self.heads, self.dense),
            dtype=torch_dtype_to_nvfuser_dtype(dtype), stride_order=self.layout.stride_order)

    def _rows(self):
        """A per-row fp32 input, [B, H, S, 1]: the last dim a broadcast of the head dim."""
        rows = _contiguity((0, 1, 2), self.heads, self.dense)
        return self.define_tensor(shape=[-1, self.heads, -1, 1], contiguity=[*rows, None],
                                  dtype=DataType.Float)

    def execute(self, inputs, *, device=None, **scalars) -> list[torch.Tensor]:
        """The outputs for [B, H, S] per-row inputs; per-row outputs [B, H, S]."""
        inputs = list(inputs)
        self.check_inputs(inputs)
        for i in self.row_inputs:
            if inputs[i].dim() == 3:
                inputs[i] = inputs[i].unsqueeze(-1)
        outputs = super().execute(inputs, device=device, **scalars)
        return [t.squeeze(-1) if i in self.row_outputs else t for i, t in enumerate(outputs)]


class LseMerge(_Blocks):
    """Two partial attention results combined by their log-sum-exp, in fp32: out_a, lse_a
    (usually fp32 accumulators) and out_b, lse_b (a block's) -> out fp32 [B,H,S,E] in
    ``layout``, lse fp32 [B,H,S]:

        m   = max(lse_a, lse_b), or 0 where both are -inf (rows no key reaches yet)
        lse = m + log(exp(lse_a - m) + exp(lse_b - m))
        out = (exp(lse_a - m) out_a + exp(lse_b - m) out_b) / exp(lse - m)

    ``dense=True`` declares the inputs dense (vectorized, flat indexing); else they may be
    views of some rows."""

    input_names = ("out_a", "lse_a", "out_b", "lse_b")
    output_names = ("out", "lse")
    row_outputs = (1,)

    def definition(self) -> None:
        out_a, lse_a = self._block(self.acc_dtype), self._rows()
        out_b, lse_b = self._block(self.block_dtype), self._rows()
        w_a, w_b, lse = _merge_weights(self.ops, lse_a, lse_b)
        out = _weighted_sum(self.ops, out_a, w_a, out_b, w_b)
        self.add_output(self.ops.stride_order(out, self.layout.stride_order))
        self.add_output(lse)


class WeightedSum(_Blocks):
    """out_a <- w_a out_a + w_b out_b in place (an aliased output, rounded once), weights fp32
    [B,H,S] from ``MergeWeights``."""

    input_names = ("out_a", "w_a", "out_b", "w_b")
    output_names = ()

    def definition(self) -> None:
        out_a, w_a = self._block(self.acc_dtype), self._rows()
        out_b, w_b = self._block(self.block_dtype), self._rows()
        out = _weighted_sum(self.ops, out_a, w_a, out_b, w_b)
        self.add_output(self.ops.cast(out, torch_dtype_to_nvfuser_dtype(self.acc_dtype)), out_a)


class MergeWeights(Definition):
    """Dense fp32 lse_a, lse_b [B,H,S] -> w_a, w_b, lse [B,H,S]: ``LseMerge``'s weights."""

    input_names = ("lse_a", "lse_b")
    output_names = ("w_a", "w_b", "lse")

    def __init__(self, heads: int):
        self.heads = heads
        super().__init__()

    def split_extents(self) -> dict[str, int]:
        return {"heads": self.heads}

    def definition(self) -> None:
        lse_a, lse_b = (self.define_tensor(shape=[-1, self.heads, -1],
                                           contiguity=_contiguity((0, 1, 2), self.heads, True),
                                           dtype=DataType.Float) for _ in range(2))
        for t in _merge_weights(self.ops, lse_a, lse_b):
            self.add_output(t)


__all__ = ["Definition", "LseMerge", "MergeWeights", "SdpaBackward", "SdpaForward",
           "SdpaForwardBackward", "WeightedSum"]
