"""DTensor in, DTensor out: unwrap q, k, v sharded as the schedule shards them."""

from __future__ import annotations


def unwrap_dtensors(tensors, schedule):
    """(local tensors, rewrap) where rewrap turns a local result back into a DTensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not any(isinstance(t, DTensor) for t in tensors):
        return tensors, lambda t: t
    if not all(isinstance(t, DTensor) for t in tensors):
        raise ValueError("q, k, v must be all DTensors or all plain tensors, not a mix")
    if schedule is None or schedule.mesh is None:
        raise ValueError("DTensor inputs need schedule= (a schedule over their mesh)")
    if not schedule.takes_dtensors:
        raise ValueError(
            f"schedule {schedule.name!r} does not take DTensors; pass this rank's local tensors "
            f"(schedule.shard(...)) instead"
        )
    mesh = schedule.mesh
    dim = schedule.sharded_dim
    expected = [Replicate()] * len(mesh.names)
    if dim is not None:
        expected[mesh.names.index(schedule.dim)] = Shard(dim)
    for name, t in zip("qkv", tensors):
        if t.device_mesh.mesh.tolist() != mesh.torch_mesh.mesh.tolist():
            raise ValueError(
                f"{name} lives on DeviceMesh {t.device_mesh.mesh.tolist()} but schedule "
                f"{schedule.name!r} runs on {mesh.torch_mesh.mesh.tolist()}; use the schedule's mesh"
            )
        if list(t.placements) != expected:
            raise ValueError(
                f"{name} has placements {list(t.placements)} but schedule {schedule.name!r} needs "
                f"{expected}; redistribute it first"
            )
    device_mesh, placements = tensors[0].device_mesh, tensors[0].placements

    def rewrap(t):
        return DTensor.from_local(t, device_mesh, placements, run_check=False)

    return tuple(t.to_local() for t in tensors), rewrap
