"""The device mesh: ranks from the launcher, torch.distributed groups and nvFuser meshes.

    mesh = init_mesh((4,), ("seq",))             # under mpirun, torchrun or srun
    mesh = init_mesh((2, 2), ("heads", "seq"))   # 2-D: heads across rows, sequence across columns

Data goes through torch.distributed (NCCL with GPUs, gloo without); small gloo *control
groups* (one per line of each dim, one for the whole mesh) carry the agreement
(``sdpa_fusion.agreement``) before any data moves. The mesh's ``timeout`` bounds every wait.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import socket

import torch
import torch.distributed as dist

from .agreement import ControlGroup

TIMEOUT_ENV = "SDPA_FUSION_TIMEOUT_S"  # the default timeout in seconds, read by init_mesh


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """Rank, world size and local rank as the launcher gave them."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str


def launch_env(environ=os.environ) -> LaunchEnv | None:
    """Read the launcher's variables: torchrun, then MPI, then SLURM; None when absent."""
    for launcher, rank, size, local in (
        ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("mpirun", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ):
        if rank in environ and size in environ:
            return LaunchEnv(int(environ[rank]), int(environ[size]),
                             int(environ.get(local, environ[rank])), launcher)
    return None


class Mesh:
    """A named N-D mesh of ranks. Build it with ``init_mesh``."""

    def __init__(self, torch_mesh, names: tuple[str, ...], device: torch.device,
                 controls: dict[str | None, ControlGroup], timeout: datetime.timedelta):
        self.torch_mesh = torch_mesh
        self.layout = torch_mesh.mesh  # the global ranks, laid out as the mesh
        self._where = list(torch_mesh.get_coordinate())  # this rank's index along each dim
        self.names = names
        self.shape = tuple(torch_mesh.mesh.shape)
        self.device, self.timeout = device, timeout
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._controls, self._nvfuser_meshes = controls, {}
        self._world = dist.group.WORLD  # the torch.distributed this mesh lives in

    @property
    def closed(self) -> bool:
        """Whether torch.distributed ended (``close_mesh``) since this mesh was built."""
        return not dist.is_initialized() or dist.group.WORLD is not self._world

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"{self!r} was closed by sdpa_fusion.close_mesh() (torch.distributed "
                             "ended); build a new mesh with sdpa_fusion.init_mesh(...) and new "
                             "schedules on it")

    def _dim(self, name: str) -> int:
        if name not in self.names:
            raise ValueError(f"mesh has no dim {name!r}; its dims are {list(self.names)}")
        return self.names.index(name)

    def size(self, name: str | None = None) -> int:
        """Ranks along dim ``name`` (all ranks when None)."""
        return self.world_size if name is None else self.shape[self._dim(name)]

    def coordinate(self, name: str) -> int:
        """This rank's index along dim ``name``."""
        return self._where[self._dim(name)]

    def group(self, name: str):
        """The torch.distributed process group of this rank's line along dim ``name``."""
        self._check_open()
        return self.torch_mesh.get_group(self._dim(name)) if len(self.names) > 1 else \
            self.torch_mesh.get_group()

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's line along dim ``name``, in mesh order."""
        index: list = list(self._where)
        index[self._dim(name)] = slice(None)
        return [int(r) for r in self.layout[tuple(index)].tolist()]

    def control_group(self, name: str | None = None) -> ControlGroup:
        """The gloo control group of this rank's line along dim ``name`` (None: the mesh)."""
        if name is not None:
            self._dim(name)
        self._check_open()
        return self._controls[name]

    def nvfuser_mesh(self, name: str):
        """The nvFuser DeviceMesh of this rank's line along dim ``name``."""
        if name not in self._nvfuser_meshes:
            import nvfuser_direct as nvfuser

            ranks = torch.tensor(self.ranks(name))
            self._nvfuser_meshes[name] = nvfuser.multidevice.DeviceMesh(ranks)
        return self._nvfuser_meshes[name]

    def agree(self, value):
        """Every rank's ``value`` (any picklable object), gathered on every rank, in rank order."""
        return self.control_group().gather(value, "Mesh.agree")

    def configuration(self) -> dict:
        """What is the same on every rank of the mesh."""
        return {"names": self.names, "ranks": self.layout.tolist(), "device": self.device.type}

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"Mesh({dims}; rank {self.rank} of {self.world_size} on {self.device})"


class VirtualMesh(Mesh):
    """A mesh of ``shape`` seen from ``rank``, with no process group, for plans without a
    launcher (running attention on it raises a ValueError):

        mesh = VirtualMesh((4,), ("seq",), rank=2)
        schedules.get("ring", mesh).describe(spec)      # what rank 2 of 4 would do
    """

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...], *, rank: int = 0,
                 device: torch.device | str = "cpu"):
        shape, names = _check_dims(shape, names)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape {shape} must hold positive sizes (no -1: no launcher "
                             f"says how many ranks there are)")
        size = math.prod(shape)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank={rank!r} must be an int in [0, {size}) for mesh shape {shape}")
        self.torch_mesh = None
        self.layout = torch.arange(size).view(shape)
        self.names, self.shape, self.device = names, shape, torch.device(device)
        self.timeout = datetime.timedelta(0)
        self.rank, self.world_size = rank, size
        self._where = [int(i) for i in (self.layout == rank).nonzero()[0]]
        self._controls, self._nvfuser_meshes = {}, {}

    closed = False  # it never opened torch.distributed

    def group(self, name: str):
        self._dim(name)
        raise self._cannot_communicate()

    def agree(self, value):
        raise self._cannot_communicate()

    def _cannot_communicate(self) -> ValueError:
        return ValueError(f"{self!r} plans, it does not communicate; build the mesh with "
                          "sdpa_fusion.init_mesh under a launcher (mpirun, torchrun, srun) to "
                          "run attention")

    def control_group(self, name: str | None = None) -> None:
        """None: no rank to agree with (a plan is made by one process)."""
        if name is not None:
            self._dim(name)
        return None

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"VirtualMesh({dims}; rank {self.rank} of {self.world_size}, no process group)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous_address(env: LaunchEnv) -> tuple[str, str]:
    """MASTER_ADDR/PORT from the environment, or agreed through MPI when mpirun started us."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return addr, port
    if env.launcher == "mpirun":
        from mpi4py import MPI

        chosen = (socket.gethostname(), str(_free_port())) if env.rank == 0 else None
        host, port = MPI.COMM_WORLD.bcast(chosen, root=0)
        return (addr or ("127.0.0.1" if host == socket.gethostname() else host)), port
    raise ValueError(f"{env.launcher} started {env.world_size} ranks but MASTER_ADDR/MASTER_PORT "
                     "are not set; export them (the address and a free port of rank 0)")


def init_mesh(shape: tuple[int, ...] = (-1,), names: tuple[str, ...] = ("seq",), *,
              backend: str | None = None,
              timeout: datetime.timedelta | float | None = None) -> Mesh:
    """Join (or start) torch.distributed from the launcher's environment and build a mesh.

    ``shape`` may hold one -1 (the rest of the world); NCCL with CUDA, else gloo; no launcher:
    one rank. ``timeout`` (timedelta or seconds; default $SDPA_FUSION_TIMEOUT_S, else 300 s)
    bounds every wait; a rank that does not arrive in time raises ``MeshTimeout``."""
    timeout = _timeout(timeout)
    shape, names = _check_dims(shape, names)
    env = launch_env()
    world = env.world_size if env else (dist.get_world_size() if dist.is_initialized() else 1)
    shape = _resolve_shape(shape, world)
    size = math.prod(shape)
    if size != world:
        how = f"{env.launcher} started {world}" if env else "no launcher (mpirun, torchrun, srun) started"
        raise ValueError(f"mesh shape {shape} needs {size} ranks but {how} rank(s); launch {size} "
                         f"ranks or choose a mesh whose sizes multiply to {world}")
    use_cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
    backend = backend or ("nccl" if use_cuda else "gloo")
    device = torch.device("cpu")
    if use_cuda:
        local = env.local_rank if env else 0
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    # the world's own group has this timeout when it starts here; other groups are given it
    override = len(names) > 1 or dist.is_initialized()
    if not dist.is_initialized():
        _init_process_group(env, backend, device, timeout)
    from torch.distributed.device_mesh import init_device_mesh

    torch_mesh = init_device_mesh(
        device.type, shape, mesh_dim_names=names,
        backend_override={name: (backend, _group_options(backend, timeout)) for name in names}
        if override else None,
    )
    return Mesh(torch_mesh, names, device, _control_groups(torch_mesh, names, timeout), timeout)


def _check_dims(shape, names) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``shape`` and ``names`` as tuples, once they describe a mesh (sizes may hold one -1)."""
    shape, names = tuple(int(s) for s in shape), tuple(names)
    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} and names {names} must have the same length")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh dim names {names} must be distinct")
    return shape, names


def _timeout(timeout) -> datetime.timedelta:
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_ENV, 300))
    if not isinstance(timeout, datetime.timedelta):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError(f"timeout={timeout!r} must be a datetime.timedelta or seconds")
        timeout = datetime.timedelta(seconds=timeout)
    if not timeout.total_seconds() > 0:
        raise ValueError(f"timeout={timeout} must be positive")
    return timeout


def _group_options(backend: str, timeout: datetime.timedelta):
    """Options that give a mesh dim's process group the mesh's timeout."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def _control_groups(torch_mesh, names, timeout) -> dict[str | None, ControlGroup]:
    """A gloo control group per dim (this rank's line) and one for the mesh; every rank
    creates every group, in the same order."""
    ranks = torch_mesh.mesh
    controls = {}
    for d, name in enumerate(names):
        lines = ranks.movedim(d, -1).reshape(-1, ranks.shape[d]).tolist()
        if len(names) == 1:
            group = dist.new_group(lines[0], backend="gloo", timeout=timeout)
        else:
            group, _ = dist.new_subgroups_by_enumeration(lines, timeout=timeout, backend="gloo")
        line = next(line for line in lines if dist.get_rank() in line)
        controls[name] = ControlGroup(group, line, timeout, f"mesh dim {name!r}")
    if len(names) == 1:
        controls[None] = controls[names[0]]
    else:
        whole = dist.new_group(backend="gloo", timeout=timeout)
        controls[None] = ControlGroup(whole, ranks.flatten().tolist(), timeout, "the mesh")
    return controls


def _resolve_shape(shape: tuple[int, ...], world: int) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape} may hold at most one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if world % known:
            raise ValueError(f"mesh shape {shape}: {world} ranks do not divide by {known}")
        shape = tuple(world // known if s == -1 else s for s in shape)
    if any(s < 1 for s in shape):
        raise ValueError(f"mesh shape {shape} must hold positive sizes")
    return shape


def _init_process_group(env: LaunchEnv | None, backend, device, timeout) -> None:
    kwargs = dict(backend=backend, timeout=timeout)
    if backend == "nccl":
        kwargs["device_id"] = device
    if env is None or env.world_size == 1:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return
    addr, port = _rendezvous_address(env)
    dist.init_process_group(init_method=f"tcp://{addr}:{port}", rank=env.rank,
                            world_size=env.world_size, **kwargs)


def close_mesh() -> None:
    """Leave torch.distributed (before exit: gloo threads can abort at teardown); meshes close."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
