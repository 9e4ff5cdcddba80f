"""sdpa-fusion: scaled-dot-product attention as nvFuser fusions, over a device mesh."""

from .api import Plan, attention, explain, plan
from .kernels import KernelUnavailable
from .layout import Layout
from .mesh import Mesh, close_mesh, init_mesh
from .spec import AttentionSpec

__all__ = [
    "AttentionSpec", "KernelUnavailable", "Layout", "Mesh", "Plan", "attention", "close_mesh",
    "explain", "init_mesh", "plan",
]
