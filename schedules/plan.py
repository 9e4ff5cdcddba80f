"""What every rank of a mesh would do for one attention problem, without the ranks.

    for r in plan_ranks("ring", spec, (4,)):        # spec: the global AttentionSpec
        print(r.rank, r.local, r.description, r.memory)

Each rank's schedule is built on a ``VirtualMesh`` (no process group) and sees data-less
(meta) shards of the full q, k, v, so its local problem, its ``validate`` and its
``describe`` are exactly those of a run on real ranks. Nothing communicates or allocates.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from sdpa_fusion.mesh import VirtualMesh
from sdpa_fusion.spec import AttentionSpec

from .base import Description
from .dim_costs import buffer_bytes

# schedules that fold partial outputs and gradients into fp32 accumulators (out in forward;
# dQ, dK, dV in backward), and those whose communication buffers ``buffer_bytes`` knows
_ACCUMULATES = ("ring", "allgather", "hybrid")
_BUFFERED = ("ring", "allgather", "ulysses")


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one rank holds for a step: its q, k, v, out (and lse) and, in backward, dout
    and the gradients; fp32 accumulators; the buffers of its communication at their peak.
    Kernel workspace is not counted."""

    tensors: int
    accumulators: int
    buffers: int
    backward_tensors: int
    backward_accumulators: int
    backward_buffers: int

    @property
    def forward(self) -> int:
        return self.tensors + self.accumulators + self.buffers

    @property
    def forward_backward(self) -> int:
        return self.backward_tensors + self.backward_accumulators + self.backward_buffers


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank's part: its coordinates on the mesh, its local problem, what the schedule
    says it costs (``describe`` of the global problem) and the memory it holds."""

    rank: int
    coordinates: dict[str, int]
    local: AttentionSpec
    description: Description
    memory: Memory


def mesh_names(name: str, dims: int) -> tuple[str, ...]:
    """Default dim names: ("heads", "seq") on 2-D meshes; on 1-D, the dim the schedule splits."""
    if dims == 2:
        return ("heads", "seq")
    from . import _class

    return ("heads",) if _class(name).sharded_dim == 1 else ("seq",)


def plan_ranks(name: str, spec: AttentionSpec, shape: tuple[int, ...],
               names: tuple[str, ...] | None = None, **options) -> list[RankPlan]:
    """Every rank's ``RankPlan`` under schedule ``name`` (with ``options``) on a mesh of
    ``shape`` for the global dense ``spec``; a ValueError naming the fix when the schedule
    cannot run it there."""
    from . import get

    if spec.layout.is_varlen:
        raise ValueError("plan_ranks takes a dense spec (layout 'bhse' or 'bshe'); plan packed "
                         "batches with schedule.describe(spec) on a VirtualMesh")
    names = names or mesh_names(name, len(shape))
    plans = []
    with _one_thread():
        for rank in range(_size(shape)):
            mesh = VirtualMesh(shape, names, rank=rank)
            schedule = get(name, mesh, **options)
            local = _local_spec(schedule, spec)
            schedule.validate(local)
            description = schedule.describe(spec)
            plans.append(RankPlan(rank, {n: mesh.coordinate(n) for n in names}, local,
                                  description, _memory(schedule, spec, local, description)))
    return plans


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread: planning is index arithmetic over up to S tokens per rank, small
    work that torch's thread pool only slows down (tenfold and more on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _size(shape) -> int:
    size = 1
    for s in shape:
        size *= int(s)
    return size


def _local_spec(schedule, spec: AttentionSpec) -> AttentionSpec:
    """The spec of this rank's shards of data-less full tensors of ``spec``."""
    def full(heads, length):
        t = torch.empty(spec.batch, heads, length, spec.head_dim, dtype=spec.dtype, device="meta")
        return schedule.shard(spec.layout.to(t), layout=spec.layout)

    q = full(spec.heads, spec.q_len)
    k = v = full(spec.kv_heads, spec.kv_len)
    return AttentionSpec.from_tensors(q, k, v, layout=spec.layout, causal=spec.causal,
                                      scale=spec.scale, window=spec.window)


def _memory(schedule, spec: AttentionSpec, local: AttentionSpec,
            description: Description) -> Memory:
    size = local.dtype.itemsize
    q = local.batch * local.heads * local.q_len * local.head_dim
    kv = local.batch * local.kv_heads * local.kv_len * local.head_dim
    lse = local.batch * local.heads * local.q_len * 4
    accumulates = schedule.name in _ACCUMULATES and description.ranks > 1
    if schedule.name == "hybrid":
        dims = description.dims
        buffers = (sum(d.memory for d in dims), sum(d.backward_memory for d in dims))
    elif schedule.name in _BUFFERED:
        buffers = buffer_bytes(schedule, spec)
    else:
        buffers = (0, 0)
    return Memory(
        tensors=(2 * q + 2 * kv) * size + lse, accumulators=4 * q + lse if accumulates else 0,
        buffers=buffers[0],
        backward_tensors=(4 * q + 4 * kv) * size + lse,
        backward_accumulators=4 * (q + 2 * kv) if accumulates else 0,
        backward_buffers=buffers[1],
    )
