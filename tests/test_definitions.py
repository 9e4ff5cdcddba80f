"""The fusion definitions on CPU: inputs, outputs, layouts, repro scripts, DID annotations, cache.

Run: python -m pytest -q tests/test_definitions.py
"""

import re
import subprocess
import sys

import pytest
import torch

nvfuser = pytest.importorskip("nvfuser_direct")

from nvfuser_direct import DataType  # noqa: E402

from sdpa_fusion import AttentionSpec, Layout  # noqa: E402
from sdpa_fusion.definitions import (  # noqa: E402
    LseMerge, MergeWeights, SdpaBackward, SdpaForward, SdpaForwardBackward, WeightedSum,
)
from sdpa_fusion.kernels import KernelUnavailable, get  # noqa: E402

H, E = 8, 64
LAYOUTS = pytest.mark.parametrize("layout", [Layout.BHSE, Layout.BSHE], ids=str)
CAUSAL = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
KV_HEADS = pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
CLASSES = pytest.mark.parametrize(
    "cls", [SdpaForward, SdpaBackward, SdpaForwardBackward], ids=lambda c: c.__name__
)


def make_spec(layout=Layout.BHSE, causal=False, kv_heads=H, dropout_p=0.0, **changes):
    spec = AttentionSpec(
        batch=2, heads=H, kv_heads=kv_heads, q_len=256, kv_len=256, head_dim=E, causal=causal,
        dropout_p=dropout_p, layout=layout,
    )
    return spec.replace(**changes)


def tensors(vals):
    return [v for v in vals if v.is_tensor()]


def extents(tv):
    return [str(d.extent()) for d in tv.get_logical_domain()]


def assert_attention_tensor(tv, heads, dtype=DataType.BFloat16):
    """[B, heads, S, E] with symbolic B and S."""
    b, h, s, e = extents(tv)
    assert (h, e) == (str(heads), str(E))
    assert not b.isdigit() and not s.isdigit()
    assert tv.dtype() == dtype


def mesh(n):
    return nvfuser.multidevice.DeviceMesh(list(range(n)))


def rebuilt(fd):
    """The FusionDefinition that ``print(fd)``'s script builds."""
    namespace = {}
    exec(str(fd), namespace)
    return namespace["fd"]


def canonical_math(fd) -> str:
    """``fd``'s IR (tensors, domains, DID annotations, ops) with names numbered by first use."""
    names = {}

    def rename(match):
        return names.setdefault(match.group(0), f"{match.group(1)}#{len(names)}")

    return re.sub(r"(?<![A-Za-z0-9])([A-Za-z?]+(?:\.x)?)(\d+)(?![0-9])", rename, fd.fusion.print_math())


def assert_same_fusion(a, b):
    assert canonical_math(a) == canonical_math(b)


# ---- inputs and outputs -------------------------------------------------------------------
@LAYOUTS
@CAUSAL
@KV_HEADS
def test_forward_io(layout, causal, kv_heads):
    fd = SdpaForward(make_spec(layout, causal, kv_heads))
    q, k, v = tensors(fd.fusion.inputs())
    assert_attention_tensor(q, H)
    assert_attention_tensor(k, kv_heads)
    assert_attention_tensor(v, kv_heads)
    out, lse = fd.fusion.outputs()
    assert_attention_tensor(out, H)
    assert lse.dtype() == DataType.Float and extents(lse)[1] == str(H) and lse.ndim == 3
    assert len(fd.fusion.inputs()) == 4  # q, k, v and the scale
    assert fd.output_names == ("out", "lse")
    assert f"is_causal={causal}" in repr(fd)


@LAYOUTS
@KV_HEADS
def test_backward_io(layout, kv_heads):
    fd = SdpaBackward(make_spec(layout, True, kv_heads))
    dout, q, k, v, out, lse, seed, offset = tensors(fd.fusion.inputs())
    assert seed.dtype() == offset.dtype() == DataType.UInt64 and offset.ndim == 0
    for t, heads in ((dout, H), (q, H), (k, kv_heads), (v, kv_heads), (out, H)):
        assert_attention_tensor(t, heads)
    assert lse.dtype() == DataType.Float and lse.ndim == 3
    dq, dk, dv = fd.fusion.outputs()
    assert_attention_tensor(dq, H)
    assert_attention_tensor(dk, kv_heads)
    assert_attention_tensor(dv, kv_heads)


@LAYOUTS
@KV_HEADS
def test_forward_backward_io(layout, kv_heads):
    fd = SdpaForwardBackward(make_spec(layout, True, kv_heads))
    assert len(tensors(fd.fusion.inputs())) == 4
    out, lse, dq, dk, dv = fd.fusion.outputs()
    heads = [extents(t)[1] for t in (out, lse, dq, dk, dv)]
    assert heads == [str(h) for h in (H, H, H, kv_heads, kv_heads)]


@LAYOUTS
@CLASSES
def test_inputs_carry_the_layout(cls, layout):
    """BSHE inputs declare stride_order [3, 1, 2, 0]; BHSE is nvFuser's default (not printed)."""
    fd = cls(make_spec(layout, kv_heads=2))
    declared = [line for line in repr(fd).splitlines() if "fd.define_tensor(" in line]
    four_d = [line for tv, line in zip(tensors(fd.fusion.inputs()), declared) if tv.ndim == 4]
    assert len(four_d) == len({"q", "k", "v", "dout", "out"} & set(fd.input_names))
    for line in four_d:
        assert "contiguity=[True, True, True, True]" in line
        assert ("stride_order=[3, 1, 2, 0]" in line) == (layout is Layout.BSHE)


@LAYOUTS
def test_gqa_gradients_are_summed_in_fp32_and_keep_the_layout(layout):
    text = repr(SdpaBackward(make_spec(layout, kv_heads=2)))
    assert text.count("fd.ops.sum(") == 2 and "dtype=DataType.Float" in text
    reorders = [line for line in text.splitlines() if "fd.ops.stride_order(" in line]
    assert len(reorders) == 2
    assert all(("[3, 1, 2, 0]" in line) == (layout is Layout.BSHE) for line in reorders)
    assert "fd.ops.expand(" in text and "fd.ops.reshape(" in text


def test_mha_needs_no_expansion():
    text = repr(SdpaBackward(make_spec(kv_heads=H)))
    assert "expand" not in text and "fd.ops.sum(" not in text


def test_dropout_adds_rng_state():
    spec = make_spec(dropout_p=0.25)
    fwd = SdpaForward(spec)
    out, lse, seed, offset = fwd.fusion.outputs()
    assert seed.dtype() == DataType.UInt64 and extents(seed) == ["2"] and offset.ndim == 0
    assert fwd.output_names == ("out", "lse", "seed", "offset")
    bwd = SdpaBackward(spec)
    assert len(tensors(bwd.fusion.inputs())) == 8 and len(bwd.fusion.inputs()) == 10
    assert len(SdpaBackward(make_spec()).fusion.inputs()) == 9  # no dropout_p scalar
    assert len(SdpaForwardBackward(spec).fusion.outputs()) == 7


def test_scalar_inputs():
    spec = make_spec(scale=0.1)
    assert SdpaForward(spec).scalar_inputs() == [0.1]
    assert SdpaForward(spec).scalar_inputs(scale=0.5) == [0.5]
    assert SdpaForward(make_spec()).scalar_inputs() == [pytest.approx(E ** -0.5)]
    assert SdpaForward(spec.replace(dropout_p=0.3)).scalar_inputs() == [0.3, 0.1]
    with pytest.raises(ValueError, match="built without dropout"):
        SdpaForward(spec).scalar_inputs(dropout_p=0.3)


@CLASSES
def test_scalars_are_symbolic_trailing_inputs(cls):
    """dropout_p and scale come after the tensors and keep full precision (not printed)."""
    fd = cls(make_spec(dropout_p=0.1, scale=1 / 3))
    assert [v.is_tensor() for v in fd.fusion.inputs()] == [True] * len(fd.input_names) + [False] * 2
    assert re.search(r"dropout_p=c\d+, is_causal=False, .*scale=c\d+", repr(fd))
    assert "0.333" not in repr(fd)


@LAYOUTS
def test_lse_merge_io(layout):
    fd = LseMerge(H, E, layout=layout, block_dtype=torch.float16)
    out_a, lse_a, out_b, lse_b = fd.fusion.inputs()
    assert out_a.dtype() == DataType.Float and out_b.dtype() == DataType.Half
    assert extents(out_a)[1:2] + extents(out_a)[3:] == [str(H), str(E)]
    assert lse_a.dtype() == lse_b.dtype() == DataType.Float and lse_a.ndim == 4
    out, lse = fd.fusion.outputs()
    assert out.dtype() == lse.dtype() == DataType.Float
    text = repr(fd)
    assert "contiguity=[False, False, False, True]" in text  # sequence slices are accepted
    assert "fd.ops.stride_order(" in text
    assert ("stride_order=[3, 1, 2, 0])" in text) == (layout is Layout.BSHE)
    assert "fd.ops.isneginf(" in text
    assert "fd.ops.broadcast(" not in text  # the weights meet the blocks by a broadcast dim


@LAYOUTS
def test_weighted_sum_writes_its_first_input_in_place(layout):
    """The in-place fold: weights per row from ``MergeWeights`` (the merge's math, no blocks),
    then one aliased output over the accumulator, rounded once into its dtype."""
    weights = MergeWeights(H)
    assert [t.ndim for t in weights.fusion.inputs()] == [3, 3]
    assert len(weights.fusion.outputs()) == 3 and "fd.ops.isneginf(" in repr(weights)
    fd = WeightedSum(H, E, layout=layout, acc_dtype=torch.bfloat16, dense=True)
    out_a, w_a, out_b, w_b = fd.fusion.inputs()
    assert out_a.dtype() == DataType.BFloat16 and w_a.ndim == w_b.ndim == 4
    text = repr(fd)
    assert "fd.add_output(" in text and ", tv0)" in text  # written into out_a
    assert "fd.ops.broadcast(" not in text and "fd.ops.exp(" not in text


@LAYOUTS
@pytest.mark.parametrize("dense", [False, True], ids=["views", "dense"])
@pytest.mark.parametrize("cls", [LseMerge, WeightedSum], ids=["merge", "weighted-sum"])
def test_block_merges_of_one_head(layout, dense, cls):
    """A single head (a fold a few heads at a time) is a broadcast dim, whose contiguity
    nvFuser takes as None, in memory order."""
    fd = cls(1, E, layout=layout, acc_dtype=torch.bfloat16, dense=dense)
    flag = str(dense)
    want = {Layout.BHSE: f"[{flag}, None, {flag}, True]", Layout.BSHE: f"[{flag}, {flag}, None, True]"}
    assert f"contiguity={want[layout]}" in repr(fd)
    assert f"contiguity=[{flag}, None, True, None]" in repr(fd)


def test_merge_weights_of_one_head():
    """The weights of a single head's rows (a fold into a head group of one head): its heads
    dim a broadcast, as in the fusions that take the weights."""
    assert "contiguity=[True, None, True]" in repr(MergeWeights(1))
    assert "contiguity=[True, True, True]" in repr(MergeWeights(H))


# ---- repro scripts and DID annotations ----------------------------------------------------
@LAYOUTS
@CLASSES
@KV_HEADS
def test_repro_script_rebuilds_the_definition(cls, layout, kv_heads):
    fd = cls(make_spec(layout, True, kv_heads))
    script = str(fd)
    assert script.startswith("import torch") and "multidevice_schedule" not in script
    assert_same_fusion(rebuilt(fd), fd)


@LAYOUTS
@CLASSES
@KV_HEADS
def test_multidevice_schedule_splits_heads(cls, layout, kv_heads):
    fd = cls(make_spec(layout, False, kv_heads))
    assert "deviceIdx" not in fd.fusion.print_math()
    fd.multidevice_schedule(mesh(2), 2)
    script = str(fd)
    assert "DeviceMesh([0, 1])" in script and "ParallelType.mesh_x" in script
    assert "outer_split(1, 2)" in script and "    multidevice_schedule(fd)" in script
    for tv in tensors(fd.fusion.inputs()):
        assert "(DeviceMesh{0 1})" in str(tv)
        assert ("ideviceIdx.x" in str(tv)) == (tv.ndim >= 3)
    assert_same_fusion(rebuilt(fd), fd)


def test_lse_merge_schedule_and_repro():
    fd = LseMerge(H, E, layout=Layout.BSHE)
    assert_same_fusion(rebuilt(fd), fd)
    fd.multidevice_schedule(mesh(4), 4)
    assert all("ideviceIdx.x" in str(tv) for tv in fd.fusion.inputs())
    assert_same_fusion(rebuilt(fd), fd)


def test_repro_script_with_inputs_compiles():
    fd = SdpaForward(make_spec(layout=Layout.BSHE))
    q = Layout.BSHE.empty((2, H, 16, E), dtype=torch.bfloat16, device="cpu")
    script = fd.repro_script_for([q, q, q, 0.125])
    assert ".as_strided((2, 8, 16, 64), (8192, 64, 512, 1))" in script and "    0.125,\n" in script
    compile(script, "repro", "exec")


def test_schedule_errors():
    fd = SdpaForward(make_spec(kv_heads=2))
    with pytest.raises(ValueError, match="parts=2 must equal the size 4"):
        fd.multidevice_schedule(mesh(4), 2)
    with pytest.raises(ValueError, match="kv_heads=2 must be divisible by parts=4"):
        fd.multidevice_schedule(mesh(4), 4)
    fd.multidevice_schedule(mesh(2), 2)
    with pytest.raises(ValueError, match="already scheduled"):
        fd.multidevice_schedule(mesh(2), 2)


def test_definition_errors():
    with pytest.raises(ValueError, match="layout='thd' has no fusion definition"):
        SdpaForward(make_spec(layout=Layout.THD, batch=1, cu_seqlens=(0, 256)))
    with pytest.raises(ValueError, match="takes torch.float16 or torch.bfloat16"):
        SdpaForward(make_spec(dtype=torch.float32))
    with pytest.raises(ValueError, match="head_dim <= 256"):
        SdpaForward(make_spec(head_dim=512))
    with pytest.raises(ValueError, match="LseMerge takes layout"):
        LseMerge(H, E, layout="thd")


def test_execute_checks_inputs_before_running():
    fd = SdpaForward(make_spec(layout=Layout.BSHE))
    q = Layout.BSHE.empty((2, H, 16, E), dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match=r"takes 3 tensors \(q, k, v\), got 2"):
        fd.execute([q, q])
    bhse = q.contiguous()
    with pytest.raises(ValueError, match="k .* does not have the layout 'bshe'"):
        fd.execute([q, bhse, q])


# ---- cache --------------------------------------------------------------------------------
def test_cache_reuses_one_definition_per_signature():
    spec = make_spec(causal=True, kv_heads=2)
    fd = SdpaForward.cached(spec)
    assert SdpaForward.cached(spec) is fd
    assert SdpaForward.cached(spec.replace(batch=3, q_len=512, kv_len=512, scale=0.2)) is fd
    assert SdpaForward.cached(spec.replace(causal=False)) is not fd
    assert SdpaForward.cached(spec.replace(layout=Layout.BSHE)) is not fd
    assert SdpaBackward.cached(spec) is not fd
    split = SdpaForward.cached(spec, mesh=mesh(2), parts=2)
    assert split is not fd and split.parts == 2
    assert SdpaForward.cached(spec, mesh=mesh(2), parts=2) is split
    merge = LseMerge.cached(H, E, layout=Layout.BSHE, block_dtype=torch.float16)
    assert LseMerge.cached(H, E, layout=Layout.BSHE, block_dtype=torch.float16) is merge


# ---- the nvfuser kernel's availability ----------------------------------------------------
def test_kernel_reasons():
    kernel = get("nvfuser")
    assert kernel._unavailable_reason(make_spec(causal=True), "cuda") is None
    reason = kernel._unavailable_reason(make_spec(causal=True, q_len=128), "cuda")
    assert "bottom-right" in reason and "q_len=128 != kv_len=256" in reason
    assert "head_dim <= 256" in kernel._unavailable_reason(make_spec(head_dim=512), "cuda")
    assert "runs on CUDA GPUs only" in kernel.unavailable_reason(make_spec(), "cpu")
    # a call another layer makes (a mask's piece, a schedule's block) is refused alike,
    # before any fusion runs: never the bottom-right mask in place of the top-left one
    q, k = torch.zeros(1, 2, 128, 64), torch.zeros(1, 2, 256, 64)
    with pytest.raises(KernelUnavailable, match=r"q_len=128 != kv_len=256"):
        kernel.forward(q, k, k, causal=True, scale=1.0)
    with pytest.raises(KernelUnavailable, match=r"bottom-right"):
        kernel.backward(q, q, k, k, q, torch.zeros(1, 2, 128), causal=True, scale=1.0)
    split = type(kernel)(mesh(2), 2)
    assert split.parts == 2 and "split over 2" in repr(split)


def test_package_imports_without_nvfuser():
    code = (
        "import sys; sys.modules['nvfuser_direct'] = None\n"
        "import sdpa_fusion, torch\n"
        "from sdpa_fusion.kernels import get\n"
        "from sdpa_fusion.merge import accumulators, merge_partial\n"
        "spec = sdpa_fusion.AttentionSpec(batch=1, heads=2, kv_heads=2, q_len=8, kv_len=8, head_dim=8)\n"
        "print(get('nvfuser')._unavailable_reason(spec, 'cuda'))\n"
        "out, lse = accumulators(torch.zeros(1, 2, 8, 8))\n"
        "merge_partial(out, lse, out, lse)\n"
        "try:\n"
        "    sdpa_fusion.SdpaForward\n"
        "except ImportError:\n"
        "    print('SdpaForward needs nvfuser')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "kernel 'nvfuser' needs nvfuser_direct" in result.stdout
    assert "SdpaForward needs nvfuser" in result.stdout
