"""DTensor in, DTensor out: unwrap q, k, v whose placements describe the schedule's shards.

A placement is accepted only when it is exactly what ``schedule.shard`` gives this rank:
``Shard(1)`` (contiguous heads) for ``head_parallel``, ``Shard(2)`` for sequence schedules with
``partition='contiguous'``, ``Replicate()`` for ``replicated``. Nothing is redistributed:
another partition refuses ``Shard(2)`` rather than misread it. Checks are local.
"""

from __future__ import annotations


def unwrap_dtensors(tensors, schedule):
    """(local tensors, rewrap): rewrap makes a local result a DTensor (None for plain tensors)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(t, DTensor) for t in tensors):
        return tensors, None
    if not all(isinstance(t, DTensor) for t in tensors):
        raise ValueError("q, k, v must be all DTensors or all plain tensors, not a mix")
    if schedule is None or schedule.mesh is None:
        raise ValueError("DTensor inputs need schedule= (a schedule over their mesh)")
    if not schedule.takes_dtensors:
        raise ValueError(f"schedule {schedule.name!r} does not take DTensors; pass this rank's "
                         "local tensors (schedule.shard(...)) instead")
    ranks, dim = schedule.mesh.torch_mesh.mesh.tolist(), schedule.sharded_dim
    for name, t in zip("qkv", tensors):
        if t.device_mesh.mesh.tolist() != ranks:
            raise ValueError(f"{name} lives on DeviceMesh {t.device_mesh.mesh.tolist()} but "
                             f"schedule {schedule.name!r} runs on {ranks}; use the schedule's mesh")
        if dim is not None and t.dim() > dim and t.shape[dim] % (size := schedule.size):
            what = {1: "heads", 2: "sequence length"}.get(dim, f"dim {dim}")
            raise ValueError(f"{name} is a DTensor with {what} {t.shape[dim]}, which its {size} "
                             f"ranks cannot hold in equal shards; pad it to a multiple of {size}")
        expected = schedule.placements(t.shape)
        if list(t.placements) != expected:
            raise ValueError(f"{name} has placements {list(t.placements)} but schedule "
                             f"{schedule.name!r} needs {expected}; redistribute it first "
                             f"({name}.redistribute(placements={expected}))")
    device_mesh, placements = tensors[0].device_mesh, tensors[0].placements

    def rewrap(t):
        return DTensor.from_local(t, device_mesh, placements, run_check=False)

    return tuple(t.to_local() for t in tensors), rewrap
