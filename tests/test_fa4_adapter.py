"""The FA4 kernel's adapter logic on CPU: its masks expressed in FA4's bottom-right windows,
its limits and install hint, and when packed calls go sequence by sequence. The kernel
itself runs in tests/gpu/test_fa4.py.

Run: pytest -q tests/test_fa4_adapter.py
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from sdpa_fusion import AttentionSpec
from sdpa_fusion.kernels import fa4, get
from sdpa_fusion.kernels.base import Seqlens
from sdpa_fusion.mask import Window
from tests.reference import assert_close


def top_left(s_q, s_k, causal, window):
    """Our contract: query i sees key j when j <= i (causal) and i - left <= j <= i + right."""
    i = torch.arange(s_q).unsqueeze(1)
    j = torch.arange(s_k).unsqueeze(0)
    seen = torch.ones(s_q, s_k, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if window is not None and window.left is not None:
        seen &= j >= i - window.left
    if window is not None and window.right is not None:
        seen &= j <= i + window.right
    return seen


def fa4_mask(s_q, s_k, left, right):
    """FA4 4.0.0b36's window (``_resolve_causal_local_window``, ``mask.py``): aligned
    bottom-right, query i sees key j when i + d - left <= j <= i + d + right, d = s_k - s_q;
    None is unbounded, and two negative sides together mean no window."""
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    i = torch.arange(s_q).unsqueeze(1) + (s_k - s_q)
    j = torch.arange(s_k).unsqueeze(0)
    seen = torch.ones(s_q, s_k, dtype=torch.bool)
    if left is not None:
        seen &= j >= i - left
    if right is not None:
        seen &= j <= i + right
    return seen


WINDOWS = [None, Window(3, 0), Window(0, 2), Window(5, None), Window(None, 4), Window(2, 7),
           Window(0, 0), Window(None, None)]


@pytest.mark.parametrize("s_q,s_k", [(8, 8), (5, 13), (13, 5), (1, 9), (9, 1)])
def test_fa4_windows_give_our_top_left_masks(s_q, s_k):
    for causal, window in itertools.product((False, True), WINDOWS):
        left, right = fa4.fa4_window(causal, window, s_q, s_k)
        assert torch.equal(fa4_mask(s_q, s_k, left, right), top_left(s_q, s_k, causal, window)), \
            f"causal={causal} {window} -> FA4 window ({left}, {right})"


def test_plain_causal_of_equal_lengths_is_fa4_causal():
    assert fa4.fa4_window(True, None, 64, 64) == (None, 0)   # FA4 runs its causal kernel
    assert fa4.fa4_window(False, None, 64, 32) == (None, None)


def spec(head_dim=128, q_len=256, kv_len=256, causal=False, window=None, **kw):
    return AttentionSpec(batch=1, heads=8, kv_heads=2, q_len=q_len, kv_len=kv_len,
                         head_dim=head_dim, dtype=torch.bfloat16, causal=causal, window=window,
                         **kw)


@pytest.mark.parametrize("capability,problem,match", [
    ((8, 0), spec(), r"runs forward and backward on sm90 .* this GPU is sm80"),
    ((12, 0), spec(), r"this GPU is sm120"),
    ((9, 0), spec(head_dim=264), r"head_dim <= 256, got 264"),
    ((10, 0), spec(head_dim=192), r"on sm100 supports head_dim <= 128 or 256, got 192"),
    ((10, 0), spec(head_dim=256, q_len=128, causal=True), r"reads a negative window as unbounded"),
])
def test_what_fa4_cannot_run(capability, problem, match):
    reason = fa4.limits_reason(problem, capability)
    assert reason is not None and re.search(match, reason), reason


@pytest.mark.parametrize("capability,problem", [
    ((9, 0), spec(head_dim=256, q_len=128, causal=True)),
    ((9, 0), spec(head_dim=64, window=Window(128, 0))),
    ((10, 0), spec(head_dim=256, causal=True)),
    ((10, 3), spec(head_dim=128, q_len=128, causal=True)),
])
def test_what_fa4_can_run(capability, problem):
    assert fa4.limits_reason(problem, capability) is None


def test_without_flash_attn_4_the_reason_says_how_to_install_it(monkeypatch):
    missing = "ModuleNotFoundError: No module named 'flash_attn'"
    monkeypatch.setattr(fa4, "import_error", lambda: missing)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    reason = get("fa4")._unavailable_reason(spec(), torch.device("cuda"))
    assert reason == ("kernel 'fa4' needs FlashAttention-4 (pip install 'sdpa-fusion[fa4]' "
                      f"(flash-attn-4==4.0.0b36)): {missing}")


@pytest.mark.parametrize("version,says", [
    (None, "flash-attn-4 is not installed"),
    ("4.0.1", "flash-attn-4 4.0.1 is installed, but kernel 'fa4' calls FA4's private entry "
              "points as release 4.0.0b36 has them"),
])
def test_only_the_tested_release_of_fa4_is_used(monkeypatch, version, says):
    from sdpa_fusion.kernels import fa4_entry

    monkeypatch.setattr(fa4_entry, "installed_version", lambda: version)
    fa4_entry.import_error.cache_clear()
    try:
        assert fa4_entry.import_error() == says
    finally:
        fa4_entry.import_error.cache_clear()


def test_fa4_has_no_dropout(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "import_error", lambda: None)
    assert get("fa4").unavailable_reason(spec(), torch.device("cuda")) is None
    reason = get("fa4").unavailable_reason(spec(dropout_p=0.1), torch.device("cuda"))
    assert reason == ("kernel 'fa4' has no dropout; use kernel='nvfuser' or 'flash' (or "
                      "'reference') for dropout_p > 0")


@pytest.mark.parametrize("causal,window,cu_k,shift", [
    (False, None, (0, 3, 3, 10), 0),           # no mask: lengths may differ
    (True, None, (0, 4, 6, 10), 0),            # masked, q and k lengths equal
    (False, Window(2, 2), (0, 4, 6, 10), 0),
    (False, Window(2, 2), (0, 5, 8, 13), 1),   # masked, one more key in every sequence
    (True, None, (0, 5, 8, 13), None),         # ... causal: FA4's right side would be -1
    (True, None, (0, 3, 3, 10), None),         # masked, shifts -1 and 3: one call per sequence
    (False, Window(None, 0), (0, 3, 3, 10), None),
    (True, Window(3, 0), (0, 3, 3, 6), -1),    # a sequence without keys takes any shift
])
def test_which_packed_calls_run_in_one_fa4_call(causal, window, cu_k, shift):
    seqlens = Seqlens(cu_q=(0, 4, 6, 10), cu_k=cu_k)
    assert fa4.varlen_shift(seqlens, causal, window) == shift


def test_the_rows_fa4_leaves_unwritten_are_those_of_sequences_without_keys():
    seqlens = Seqlens(cu_q=(0, 4, 6, 6, 10, 12), cu_k=(0, 3, 3, 5, 5, 8))
    # sequence 1 (rows 4-6) and 3 (rows 6-10) have queries and no keys; 2 has no queries
    assert seqlens.rows_without_keys == ((4, 6), (6, 10))
    assert seqlens.shifts == {-1, 1}
    assert Seqlens((0, 2), (0, 0)).shifts == frozenset()


def test_forward_writes_given_buffers(rng):
    """out= and lse= are the results, holding what a call without them gives."""
    kernel = get("reference")
    q, k, v = (torch.randn(1, 2, 6, 8, generator=rng) for _ in range(3))
    want = kernel.forward(q, k, v, causal=True, scale=0.3)
    buffers = (torch.empty_like(q), torch.empty(q.shape[:3]))
    got = kernel.forward(q, k, v, causal=True, scale=0.3, out=buffers[0], lse=buffers[1])
    assert all(g is b for g, b in zip(got, buffers))
    for g, w in zip(got, want):
        assert_close(g, w)


def test_backward_writes_given_buffers(rng):
    """dq=, dk=, dv= are the results, holding what a call without them gives."""
    kernel = get("reference")
    q, k, v, dout = (torch.randn(1, 2, 6, 8, generator=rng) for _ in range(4))
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.3)
    want = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.3)
    buffers = tuple(torch.empty_like(t) for t in (q, k, v))
    got = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.3, dq=buffers[0],
                          dk=buffers[1], dv=buffers[2])
    assert all(g is b for g, b in zip(got, buffers))
    for g, w in zip(got, want):
        assert_close(g, w)
