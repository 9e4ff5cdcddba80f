"""Which partition a packed batch takes under partition ``auto``: ``documents`` when no
document needs cutting, else the one the cost model predicts faster for causal fwd+bwd at 32
bf16 heads of 128 (bytes and FLOPs both grow with heads x head dim, so heads hardly matter).

    documents       the slowest rank's work, in calls as long as its longest whole
                    document, beside the ring of the cut documents only
    load_balanced   an even share of that work, in calls of a P-th of the longest document,
                    beside the ring of every token
"""

from __future__ import annotations

import torch

from sdpa_fusion.spec import FORWARD_AND_BACKWARD, AttentionSpec

from .assign import CUT, plan
from .figures import TABLE, auto_kernel, rate, transfer_seconds
from .overlap import overlap_of

REFERENCE_HEADS, REFERENCE_HEAD_DIM = 32, 128


def packed_partition(schedule, lengths: tuple, tolerance: float, transport: str = "auto",
                     path=TABLE, groups: bool = True) -> tuple[str, str]:
    """("documents" | "load_balanced", why) for a packed batch of document ``lengths``
    (``tolerance`` and ``groups`` of ``partition.Documents``); pure."""
    parts = schedule.size
    chosen = plan(lengths, parts, tolerance=tolerance, groups=groups)
    if not chosen.cut:
        return "documents", "no document needs cutting: every one stays whole, nothing travels"
    try:
        kernel = auto_kernel(REFERENCE_HEAD_DIM, True, path)
        size = chosen.group_size
        whole = [n for n, o in zip(lengths, chosen.owner) if o != CUT]
        longest_cut = max(lengths[i] for i in chosen.cut)
        ring_tokens = max(sum(lengths[i] for i in chosen.cut_in(g)) for g in range(parts // size))
        documents = _seconds(schedule, max(chosen.work), max([*whole, longest_cut // size]),
                             ring_tokens, kernel, transport, path, size)
        balanced = _seconds(schedule, sum(chosen.work) / parts, max(lengths) // parts,
                            sum(lengths), kernel, transport, path)
    except ValueError as e:
        return "documents", f"the cost model has no figures ({e}); whole documents move least"
    name = "documents" if documents <= balanced else "load_balanced"
    return name, (f"{len(chosen.cut)} of {len(lengths)} documents must be cut; predicted "
                  f"{documents * 1e3:.3g} ms with documents, {balanced * 1e3:.3g} ms "
                  f"load_balanced (fwd+bwd at {REFERENCE_HEADS} bf16 heads of "
                  f"{REFERENCE_HEAD_DIM}, {kernel})")


def _seconds(schedule, pairs: float, length: int, ring_tokens: int, kernel: str,
             transport: str, path, size: int | None = None) -> float:
    """Predicted fwd+bwd seconds of the slowest rank: ``pairs`` of work beside a ring of
    ``size`` ranks (all by default) on ``ring_tokens`` tokens."""
    flops = 4.0 * REFERENCE_HEADS * REFERENCE_HEAD_DIM * pairs * FORWARD_AND_BACKWARD
    compute = flops / rate(kernel, REFERENCE_HEAD_DIM, True, "fwd+bwd", max(length, 1),
                           path).value
    size = size or schedule.size
    multiple = 2 * size
    tokens = -(-ring_tokens // multiple) * multiple
    spec = AttentionSpec(batch=1, heads=REFERENCE_HEADS, kv_heads=REFERENCE_HEADS,
                         q_len=tokens, kv_len=tokens, head_dim=REFERENCE_HEAD_DIM,
                         dtype=torch.bfloat16, causal=True)
    twin = schedule.twin((schedule.index // size * size, size))
    transport = getattr(twin, "transport", transport)  # a group's ring: p2p
    d = twin.describe(spec)
    return compute + transfer_seconds(d, overlap_of(type(twin)), compute, True, transport,
                                      path)[0]
