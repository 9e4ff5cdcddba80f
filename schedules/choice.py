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

from .assign import plan
from .figures import TABLE, auto_kernel, rate, transfer_seconds
from .overlap import overlap_of

REFERENCE_HEADS, REFERENCE_HEAD_DIM = 32, 128


def packed_partition(schedule, lengths: tuple, tolerance: float, transport: str = "auto",
                     path=TABLE, groups: bool = True) -> tuple[str, str]:
    """("documents" | "load_balanced", why) for a packed batch of document ``lengths``
    (``tolerance`` and ``groups`` of ``partition.Documents``); pure."""
    parts = schedule.size
    chosen = plan(lengths, parts, tolerance=tolerance, groups=groups, exchange=schedule.exchange)
    if not chosen.cut:
        return "documents", "no document needs cutting: every one stays whole, nothing travels"
    try:
        kernel = auto_kernel(REFERENCE_HEAD_DIM, True, path)
        rings = {}  # (ranks, tokens): (twin, description), one per ring, not per rank
        documents = max(_rank_seconds(schedule, chosen, r, lengths, kernel, transport, path,
                                      rings) for r in range(parts))
        balanced = _seconds(schedule, sum(chosen.work) / parts, max(lengths) // parts,
                            [((0, parts), sum(lengths))], kernel, transport, path, rings)
    except ValueError as e:
        return "documents", f"the cost model has no figures ({e}); whole documents move least"
    name = "documents" if documents <= balanced else "load_balanced"
    return name, (f"{len(chosen.cut)} of {len(lengths)} documents must be cut; predicted "
                  f"{documents * 1e3:.3g} ms with documents, {balanced * 1e3:.3g} ms "
                  f"load_balanced (fwd+bwd at {REFERENCE_HEADS} bf16 heads of "
                  f"{REFERENCE_HEAD_DIM}, {kernel})")


def _rank_seconds(schedule, chosen, rank: int, lengths, kernel, transport, path,
                  rings: dict) -> float:
    """Predicted fwd+bwd seconds of ``rank`` under the plan ``chosen``: its work, in calls
    as long as its longest whole document or cut share, beside the rings of its groups."""
    mine = [(g, sum(lengths[i] for i in chosen.cut_over(g))) for g in chosen.groups_of(rank)]
    longest = max([*(lengths[i] for i in chosen.whole(rank)),
                   *(max(lengths[i] for i in chosen.cut_over(g)) // g[1] for g, _ in mine)],
                  default=1)
    return _seconds(schedule, chosen.work[rank], longest, mine, kernel, transport, path, rings)


def _seconds(schedule, pairs: float, length: int, groups, kernel: str, transport: str,
             path, rings: dict) -> float:
    """Predicted fwd+bwd seconds of a rank: ``pairs`` of work beside a ring over each
    (group of ranks, tokens) of ``groups``, each hiding behind its share of the compute;
    ``rings`` keeps each ring's description for the other ranks of its group."""
    flops = 4.0 * REFERENCE_HEADS * REFERENCE_HEAD_DIM * pairs * FORWARD_AND_BACKWARD
    compute = flops / rate(kernel, REFERENCE_HEAD_DIM, True, "fwd+bwd", max(length, 1),
                           path).value
    seconds = compute
    for (_, size), ring_tokens in groups:
        multiple = 2 * size
        tokens = -(-ring_tokens // multiple) * multiple
        if (size, tokens) not in rings:
            spec = AttentionSpec(batch=1, heads=REFERENCE_HEADS, kv_heads=REFERENCE_HEADS,
                                 q_len=tokens, kv_len=tokens, head_dim=REFERENCE_HEAD_DIM,
                                 dtype=torch.bfloat16, causal=True)
            # a ring's cost is the same on each of its ranks: that of this rank's group of
            # its size (groups of a size start at its multiples: ``assign.plan``)
            twin = schedule.twin((schedule.index // size * size, size))
            rings[size, tokens] = twin, twin.describe(spec)
        twin, described = rings[size, tokens]
        ring_transport = getattr(twin, "transport", transport)  # a group's ring: p2p
        seconds += transfer_seconds(described, overlap_of(type(twin)), compute / len(groups),
                                    True, ring_transport, path)[0]
    return seconds
