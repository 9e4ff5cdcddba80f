"""sdpa-fusion: scaled-dot-product attention as nvFuser fusions, over a device mesh."""

from . import masks
from .api import Plan, attention, explain, plan
from .kernels import KernelUnavailable
from .layout import Layout
from .mesh import Mesh, VirtualMesh, close_mesh, init_mesh
from .spec import AttentionSpec
from .waiting import MeshTimeout

_DEFINITIONS = ("LseMerge", "SdpaBackward", "SdpaForward", "SdpaForwardBackward")

__all__ = [
    "AttentionSpec", "KernelUnavailable", "Layout", "LseMerge", "Mesh", "MeshTimeout", "Plan",
    "SdpaBackward", "SdpaForward", "SdpaForwardBackward", "VirtualMesh", "attention",
    "close_mesh", "explain", "init_mesh", "masks", "plan",
]


def __getattr__(name: str):
    """The fusion definitions, imported on first use so that nvfuser_direct stays optional."""
    if name in _DEFINITIONS:
        from . import definitions

        return getattr(definitions, name)
    raise AttributeError(f"module 'sdpa_fusion' has no attribute {name!r}")
