"""What a schedule's call allocates on each rank: the memory half of ``describe()``.

``Description.memory`` comes from a dry run of the schedule's own code (``schedules.dry_run``),
kernel workspace counted as the GPU kernels keep it (the fp32 dQ that FlashAttention and cuDNN
backwards hold, with GQA FlashAttention-4's fp32 dK and dV too).
"""

from __future__ import annotations

import dataclasses

from sdpa_fusion.spec import AttentionSpec


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one rank allocates for one call of a schedule, its inputs not counted.

    outputs   out and lse, made by the forward and held (saved for backward) until it ends,
              with what the forward keeps for its backward (``keeps_forward``)
    forward   the forward's peak beyond its outputs (slots, accumulators, kernel results)
    backward  the backward's peak beyond the saved outputs (dq, dk, dv included)
    kept      held between calls outside torch's caching allocator (the copy-engine
              transport's symmetric buffer), in forward and backward alike
    """

    outputs: int
    forward: int
    backward: int
    kept: int = 0

    @property
    def step(self) -> int:
        """The peak of a forward and backward step, kept buffers included."""
        return self.kept + self.outputs + max(self.forward, self.backward)


def input_bytes(local: AttentionSpec, backward: bool = True) -> int:
    """Bytes of a rank's inputs q, k, v (and dout when ``backward``) of the local problem."""
    item = local.dtype.itemsize
    q = local.batch * local.heads * local.q_len * local.head_dim * item
    kv = local.batch * local.kv_heads * local.kv_len * local.head_dim * item
    return (2 if backward else 1) * q + 2 * kv
