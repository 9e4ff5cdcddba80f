"""Every kernel past 2^31-element offsets on one GPU, forward and backward, checked on sampled
rows against fp32 math (``benchmarks.check``): right within bf16 error, or the documented
ValueError; a CUDA error fails the test (and ends the process).

    python -m pytest -q tests/gpu/test_long.py            # alone: scripts/gpu_session.sh tests-gpu-long

(with every one of 512 heads checked, a full-mask case took about a minute on an H200, its
dK/dV reference a full fp32 forward; they now check 32 heads, the last among them)

Shapes (bf16, head dim 128):
- the issue's: 32 heads, S = 600,000 (2.46e9 elements per tensor), causal, for the kernels
  ``auto`` picks (cuDNN, FA4): ATen's cuDNN alone returns a wrong dQ here;
- the same element count with 512 heads of S = 37,504 (1/16 of the FLOPs:
  offsets past 2^31 all the same), for every kernel x BSHE/BHSE x causal/full, checked on
  32 of the heads (the first, the last and evenly between: in BHSE the last heads hold the
  offsets past 2^31; in BSHE every head's last rows do), so that the fp32 reference of the
  keys' gradients stays cheap;
- the edge: 32 heads, S = 524,288 (2^31 elements exactly), the largest call that reaches a
  kernel unsplit;
- packed: 6 documents of 8K-24K tokens and 1,500 of 16-600 (552K tokens x 32 heads, 2.26e9
  elements), where ATen's varlen flash reads out of bounds on its own.
Each kernel is also run with FlashAttention-4 absent (a run without it installed): ``auto``
then takes cuDNN.
"""

from __future__ import annotations

import pytest
import torch

import sdpa_fusion
from benchmarks.check import check, check_packed, line
from sdpa_fusion.layout import Layout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E = 128
KERNELS = ["cudnn", "flash", "fa4", "nvfuser", "auto"]


def _inputs(heads: int, s: int, layout: str, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    layout = Layout.of(layout)
    tensors = [layout.to(torch.randn(1, heads, s, E, device="cuda", generator=g,
                                     dtype=torch.bfloat16)) if layout is Layout.BHSE
               else torch.randn(1, s, heads, E, device="cuda", generator=g,
                                dtype=torch.bfloat16).transpose(1, 2) for _ in range(4)]
    return [t.requires_grad_(i < 3) for i, t in enumerate(tensors)]


def _available(kernel: str, spec_kwargs) -> None:
    """Skip a kernel this GPU cannot run at all (FA4 absent, an old GPU)."""
    from sdpa_fusion import AttentionSpec
    from sdpa_fusion.kernels import get

    if kernel == "auto":
        return
    reason = get(kernel).unavailable_reason(AttentionSpec(**spec_kwargs), torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)


def _step(kernel: str, heads: int, s: int, layout: str, causal: bool, key_flops: float = 1e14,
          checked_heads: int | None = None):
    _available(kernel, dict(batch=1, heads=heads, kv_heads=heads, q_len=s, kv_len=s,
                            head_dim=E, dtype=torch.bfloat16, causal=causal))
    q, k, v, dout = _inputs(heads, s, layout)
    out = sdpa_fusion.attention(q, k, v, causal=causal, kernel=kernel)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    report = check(q.detach(), k.detach(), v.detach(), dout, out.detach(), dq, dk, dv,
                   causal=causal, key_flops=key_flops, heads=checked_heads)
    assert Layout.of(layout).to(out) is out, "the output keeps the inputs' layout"
    del q, k, v, dout, out, dq, dk, dv
    torch.cuda.empty_cache()
    return report


@pytest.mark.parametrize("kernel", ["cudnn", "fa4"])
@pytest.mark.parametrize("layout", ["bshe", "bhse"])
def test_600k_tokens_32_heads(kernel, layout):
    if kernel == "fa4" and layout == "bhse":
        pytest.skip("FA4 in BHSE runs the same views: the wide-head case below covers it")
    report = _step(kernel, 32, 600_000, layout, causal=True)
    assert report.right and report.errors["dq"] is not None, line(report.as_dict())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ["bshe", "bhse"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_past_2_31_elements(kernel, layout, causal):
    report = _step(kernel, 512, 37_504, layout, causal, checked_heads=32)
    assert report.right and all(e is not None for e in report.errors.values()), \
        line(report.as_dict())


@pytest.mark.parametrize("kernel,s", [("cudnn", 524_288), ("fa4", 524_032)])
def test_the_largest_call_that_is_not_split(kernel, s):
    """2^31 elements (cuDNN), less the rows FA4's workspaces pad: the longest 32-head call
    that reaches the kernel whole."""
    from sdpa_fusion.kernels import get
    from sdpa_fusion.kernels.limits import dense_pieces

    limits = get(kernel).limits
    shape, longer = (1, 32, s, E), (1, 32, s + 128, E)
    assert dense_pieces(shape, shape, limits) == [] and dense_pieces(longer, longer, limits)
    report = _step(kernel, 32, s, "bshe", causal=True)
    assert report.right, line(report.as_dict())


def _packed_batch(seed: int = 0):
    """6 documents of 8K-24K tokens and 1,500 of 16-600, of a dozen distinct lengths (cuDNN
    builds a graph per shape: a new one per document would take minutes)."""
    g = torch.Generator().manual_seed(seed)
    long = torch.randint(8192, 24_577, (6,), generator=g).tolist()
    short = (torch.randint(0, 12, (1500,), generator=g) * 53 + 16).tolist()
    lengths = long + short
    order = torch.randperm(len(lengths), generator=g).tolist()
    lengths = [lengths[i] for i in order]
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    gd = torch.Generator(device="cuda").manual_seed(seed)
    tensors = [torch.randn(total, 32, E, device="cuda", generator=gd, dtype=torch.bfloat16)
               for _ in range(4)]
    return [t.requires_grad_(i < 3) for i, t in enumerate(tensors)], cu


@pytest.mark.parametrize("kernel", ["flash", "fa4", "cudnn", "auto"])
def test_packed_batch_past_2_31_elements(kernel):
    (q, k, v, dout), cu = _packed_batch()
    assert q.numel() > 2**31
    _available(kernel, dict(batch=1, heads=32, kv_heads=32, q_len=q.shape[0],
                            kv_len=q.shape[0], head_dim=E, dtype=torch.bfloat16, causal=True,
                            layout="thd", cu_seqlens=tuple(cu.tolist())))
    out = sdpa_fusion.attention(q, k, v, causal=True, layout="thd", cu_seqlens=cu.cuda(),
                                kernel=kernel)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    report = check_packed(q.detach(), k.detach(), v.detach(), dout, out.detach(), dq, dk, dv,
                          cu.tolist(), causal=True)
    assert report.right, line(report.as_dict())


def test_fa4_varlen_with_a_strided_dout():
    """FA4's varlen backward wraps ``cu_seqlens[i] * dout.stride(0)`` in 32 bits (upstream
    issue 2611): a dout that is a view of some heads of a wider tensor is copied first. The
    batch and dout are those of the packed test above (seed 0), dout now a strided view."""
    (q, k, v, dout), cu = _packed_batch(seed=0)
    _available("fa4", dict(batch=1, heads=32, kv_heads=32, q_len=q.shape[0], kv_len=q.shape[0],
                           head_dim=E, dtype=torch.bfloat16, causal=True, layout="thd",
                           cu_seqlens=tuple(cu.tolist())))
    wide = torch.zeros(q.shape[0], 40, E, device="cuda", dtype=torch.bfloat16)
    wide[:, 4:36] = dout
    dout = wide[:, 4:36]  # 32 heads, row stride 40 x 128
    assert dout.stride(0) * q.shape[0] > 2**31
    out = sdpa_fusion.attention(q, k, v, causal=True, layout="thd", cu_seqlens=cu.cuda(),
                                kernel="fa4")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    report = check_packed(q.detach(), k.detach(), v.detach(), dout, out.detach(), dq, dk, dv,
                          cu.tolist(), causal=True)
    assert report.right, line(report.as_dict())
