"""Composed masks (sdpa_fusion.masks) on one CUDA GPU: each mask against torch SDPA with the
explicit boolean mask, in fp32 (tests/reference.py, fp64 math), forward and backward, for
every GPU kernel that runs it and ``auto``: documents, prefix-LM, bidirectional image spans
in a causal sequence, chunked attention, windows mixed in, and a mask_mod (its causal tiles
as the kernel's causal calls, its other partial tiles through the reference's fp32 math).

Run on a GPU machine: python -m pytest -q tests/gpu/test_masks.py
"""

from __future__ import annotations

import pytest
import torch

import sdpa_fusion
from sdpa_fusion import masks
from sdpa_fusion.kernels import KernelUnavailable
from tests import masks as described
from tests import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, H, H_KV, S, E = 2, 8, 2, 1024, 64
DOCS = torch.tensor([0] * 300 + [1] * 500 + [2] * 224)
MASKS = {
    "documents": ("and", ("causal",), ("docs", torch.stack([DOCS, DOCS.roll(100)]))),
    "prefix_lm": ("or", ("causal",), ("prefix", 200)),
    "image_spans": ("or", ("causal",), ("spans", [(64, 320), (500, 756)])),
    "chunked": ("and", ("causal",), ("chunk", 256)),
    "spans_in_documents": ("and", ("or", ("causal",), ("spans", [(64, 320)])),
                           ("docs", DOCS.unsqueeze(0))),
    "window_or_spans": ("or", ("window", 128, 0), ("spans", [(300, 600)])),
    "mask_mod": ("mod", "sink", 96),
}
KERNELS = ["auto", "cudnn", "flash", "fa4", "nvfuser"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mask_matches_sdpa(name, kernel, dtype):
    d = MASKS[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(B, S, H, E, device="cuda", generator=g, dtype=dtype).transpose(1, 2)
               for _ in range(2))
    k, v = (torch.randn(B, S, H_KV, E, device="cuda", generator=g, dtype=dtype).transpose(1, 2)
            for _ in range(2))
    seen = torch.stack([described.boolean(d, b, S, S) for b in range(B)]).unsqueeze(1).cuda()
    want = reference.attention(q.float(), k.float(), v.float(), dout.float(), mask=seen)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        out = sdpa_fusion.attention(*leaves, mask=described.built(d), kernel=kernel)
    except KernelUnavailable as e:
        pytest.skip(str(e))
    out.backward(dout)
    results = (out, *(t.grad for t in leaves))
    peer = _torch_sdpa(q, k, v, dout, seen)
    for label, got, expected, theirs in zip(("out", "dq", "dk", "dv"), results, want.results,
                                            peer):
        _assert_close_or_as_close_as_torch(got, expected, theirs, dtype, f"{name} {label}")


def _torch_sdpa(q, k, v, dout, seen):
    """(out, dq, dk, dv) of torch's own SDPA in the inputs' dtype with the boolean mask (K/V
    heads repeated for GQA, their gradients summed back by autograd)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    repeat = q.shape[1] // k.shape[1]
    kv = [t.repeat_interleave(repeat, dim=1) for t in leaves[1:]]
    out = torch.nn.functional.scaled_dot_product_attention(leaves[0], *kv, attn_mask=seen)
    out.backward(dout)
    return (out, *(t.grad for t in leaves))


def _assert_close_or_as_close_as_torch(got, expected, theirs, dtype, msg):
    """``got`` within the tolerance of ``dtype`` of the fp64 reference, or no further from it
    than twice torch's own SDPA in ``dtype`` (a mask's calls sum a few 16-bit partial
    gradients: one more rounding each)."""
    try:
        reference.assert_close(got, expected, dtype, msg=msg)
    except AssertionError:
        ours = float((got.double() - expected).abs().max())
        torch_error = float((theirs.double() - expected).abs().nan_to_num(0.0).max())
        assert ours <= 2 * torch_error, (
            f"{msg}: {ours:.3g} from the fp64 reference, torch SDPA in {dtype}: {torch_error:.3g}")


def test_kernel_without_window_is_skipped_by_auto():
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    chosen = sdpa_fusion.explain(q, q, q, mask=masks.window(8, 0) | masks.prefix(4))
    assert chosen.kernel.supports_window
