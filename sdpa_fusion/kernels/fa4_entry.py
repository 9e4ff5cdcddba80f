"""FlashAttention-4's entry points, in one place, behind a version check.

The ``fa4`` kernel needs a backward from an external out and lse (a ring's merged ones) and
outputs written into given buffers, which FA4's public autograd Function does not offer:
its private ``_flash_attn_fwd`` and ``_flash_attn_bwd`` do (``fa4_rows`` reaches further
in). Private entry points change between releases, so they are used only with the tested
release (``TESTED_VERSION``); with any other, ``import_error`` says so and the kernel is
unavailable.
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch

TESTED_VERSION = "4.0.0b36"
INSTALL_HINT = f"pip install 'sdpa-fusion[fa4]' (flash-attn-4=={TESTED_VERSION})"


@functools.cache
def interface():
    """FA4's ``flash_attn.cute.interface`` (importing it loads the CUTLASS DSL: seconds)."""
    from flash_attn.cute import interface as fa4_interface

    return fa4_interface


def installed_version() -> str | None:
    """The installed flash-attn-4 release, or None."""
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def import_error() -> str | None:
    """Why FA4's entry points cannot be used here, or None when they can."""
    version = installed_version()
    if version is None:
        return "flash-attn-4 is not installed"
    if version != TESTED_VERSION:
        return (f"flash-attn-4 {version} is installed, but kernel 'fa4' calls FA4's private "
                f"entry points as release {TESTED_VERSION} has them")
    try:
        interface()
    except Exception as e:  # noqa: BLE001 -- ImportError, or a DSL that fails to load
        return f"{type(e).__name__}: {e}"
    return None


def bshd(t: torch.Tensor) -> torch.Tensor:
    """Logical [B, H, S, E] -> the [B, S, H, E] view FA4 takes (no copy)."""
    return t.transpose(1, 2)


def forward(q, k, v, *, scale: float, window: tuple, out, lse=None, packed=None):
    """FA4's forward of [B, S, H, E] (or packed [T, H, E] with ``packed``: its cu_seqlens
    and max lengths) q, k, v, written into ``out`` (and ``lse`` when given); returns lse."""
    left, right = window
    with torch.cuda.device(q.device):
        _, lse, *_ = interface()._flash_attn_fwd(
            q, k, v, **(packed or {}), softmax_scale=scale, window_size_left=left,
            window_size_right=right, return_lse=True, out=out, lse=lse,
        )
    return lse


def backward(q, k, v, out, dout, lse, *, scale: float, window: tuple, dq=None, dk=None,
             dv=None, packed=None):
    """FA4's backward from the given out and lse, into ``dq``, ``dk``, ``dv`` where given;
    returns (dq, dk, dv)."""
    left, right = window
    with torch.cuda.device(q.device):
        return interface()._flash_attn_bwd(
            q, k, v, out, dout, lse, **(packed or {}), softmax_scale=scale,
            window_size_left=left, window_size_right=right, dq=dq, dk=dk, dv=dv,
        )


@functools.cache
def backward_internals():
    """(cute, to_cute_tensor, AuxData, FlashAttentionBackwardSm90): the pieces of FA4's
    Hopper backward that ``fa4_rows`` compiles and launches itself."""
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.utils import AuxData

    return cute, to_cute_tensor, AuxData, FlashAttentionBackwardSm90
