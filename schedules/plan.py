"""What every rank of a mesh would do for one attention problem, without the ranks: each
rank's schedule is built on a ``VirtualMesh`` (no process group) and sees meta shards.

    for r in plan_ranks("ring", spec, (4,)):        # spec: the global AttentionSpec
        print(r.rank, r.local, r.description, r.memory)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch

from sdpa_fusion.mesh import VirtualMesh
from sdpa_fusion.spec import AttentionSpec

from . import dry_run
from .assign import RING, Exchange
from .base import Description
from .memory import Memory, input_bytes


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds for a step: inputs q, k, v (and dout) and what the call allocates."""

    inputs: int
    dout: int
    schedule: Memory | None

    @property
    def forward(self) -> int | None:
        """The peak of a forward."""
        m = self.schedule
        return None if m is None else self.inputs + m.kept + m.outputs + m.forward

    @property
    def forward_backward(self) -> int | None:
        """The peak of a forward and backward step."""
        m = self.schedule
        return None if m is None else self.inputs + self.dout + m.step


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank's coordinates, local problem, ``describe`` of the global problem and memory,
    and what its schedule's exchanges of cut documents cost (``schedules.assign``)."""

    rank: int
    coordinates: dict[str, int]
    local: AttentionSpec
    description: Description
    exchange: Exchange = RING

    @functools.cached_property
    def memory(self) -> RankMemory:
        inputs = input_bytes(self.local, backward=False)
        return RankMemory(inputs, input_bytes(self.local) - inputs, self.description.memory)


def mesh_names(name: str, dims: int) -> tuple[str, ...]:
    """Default dim names: ("heads", "seq") on 2-D meshes; on 1-D, the dim the schedule splits."""
    if dims == 2:
        return ("heads", "seq")
    from . import _class

    return ("heads",) if _class(name).sharded_dim == 1 else ("seq",)


def plan_ranks(name: str, spec: AttentionSpec, shape: tuple[int, ...],
               names: tuple[str, ...] | None = None, **options) -> list[RankPlan]:
    """Every rank's ``RankPlan`` under schedule ``name`` on a mesh of ``shape`` for ``spec``."""
    from . import _class, get

    packed = spec.layout.is_varlen
    if packed and (len(shape) != 1 or not hasattr(_class(name), "local_spec")):
        raise ValueError(f"a packed batch is planned under a sequence schedule on a 1-D mesh "
                         f"(ring, allgather, ulysses), not {name!r} on a mesh of "
                         f"{'x'.join(map(str, shape))}")
    names = names or mesh_names(name, len(shape))
    plans = []
    with _one_thread():
        for rank in range(math.prod(int(s) for s in shape)):
            mesh = VirtualMesh(shape, names, rank=rank)
            schedule = get(name, mesh, **options)
            if packed:
                local = schedule.local_spec(spec)
                local = local.replace(q_len=local.packing.tokens, kv_len=local.packing.tokens)
            else:  # as a dry run makes it, less the composed mask
                local = dry_run.local_problem(schedule, spec)[0].replace(mask=None)
            schedule.validate(local)
            description = schedule.describe(spec)
            plans.append(RankPlan(rank, {n: mesh.coordinate(n) for n in names}, local,
                                  description, getattr(schedule, "exchange", RING)))
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
