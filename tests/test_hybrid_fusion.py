"""The nvFuser fusions of the ``hybrid`` schedule with inner head_parallel, on CPU: the kernel
split over the inner dim of a 2-D mesh builds its forward and backward fusions with the head
axis split over the ranks of the inner line (a DID annotation), and prints them as scripts.

Single-process: nvFuser's multidevice communicator cannot start on CPU ranks under mpirun,
so the mesh here is the geometry of one rank of a 2-D mesh, without processes.
tests/distributed/test_hybrid.py checks that the hybrid asks its kernel for this split.

Run: python -m pytest -q tests/test_hybrid_fusion.py
"""

import pytest
import torch

nvfuser = pytest.importorskip("nvfuser_direct")

from sdpa_fusion import AttentionSpec  # noqa: E402
from sdpa_fusion.definitions import SdpaBackward, SdpaForward  # noqa: E402
from sdpa_fusion.kernels import get  # noqa: E402
from sdpa_fusion.mesh import Mesh  # noqa: E402


def rank_of_mesh(shape, names, coordinate) -> Mesh:
    """The Mesh seen by the rank at ``coordinate`` of a mesh of ``shape`` (ranks numbered in
    row-major order, as init_mesh numbers them): its dims and lines, no process groups."""
    mesh = Mesh.__new__(Mesh)
    ranks = torch.arange(torch.Size(shape).numel()).view(shape)
    mesh.layout, mesh._where = ranks, list(coordinate)
    mesh.names, mesh.shape, mesh._nvfuser_meshes = tuple(names), tuple(shape), {}
    return mesh


@pytest.mark.parametrize("shape, coordinate, line", [
    ((2, 2), (1, 1), [1, 3]),          # rank 3 of 2x2: the heads line of column 1
    ((2, 4), (0, 2), [2, 6]),          # rank 2 of 2x4
    ((4, 2), (3, 0), [0, 2, 4, 6]),    # rank 6 of 4x2
], ids=["2x2", "2x4", "4x2"])
@pytest.mark.parametrize("cls", [SdpaForward, SdpaBackward], ids=lambda c: c.__name__)
def test_inner_head_split_is_a_did_annotation_on_the_inner_line(shape, coordinate, line, cls):
    mesh = rank_of_mesh(shape, ("heads", "seq"), coordinate)
    assert mesh.ranks("heads") == line
    kernel = get("nvfuser").split_heads(mesh, "heads")
    assert kernel.parts == shape[0]
    spec = AttentionSpec(1, 4 * shape[0], 2 * shape[0], 256, 256, 64, causal=True, layout="bshe")
    fd = cls(spec)
    fd.multidevice_schedule(kernel.mesh, kernel.parts)
    script = str(fd)
    assert f"DeviceMesh({line})" in script
    assert f"outer_split(1, {shape[0]})" in script and "ParallelType.mesh_x" in script
    for tv in fd.fusion.inputs():
        if tv.is_tensor() and tv.ndim >= 3:
            assert "(DeviceMesh{" + " ".join(map(str, line)) + "})" in str(tv)
            assert "ideviceIdx.x" in str(tv)
    compile(script, "hybrid_fusion", "exec")
