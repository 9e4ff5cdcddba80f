"""``head_parallel``: q, k, v and their gradients split over heads on one mesh dim.

Rank r of P holds heads [r*H/P, (r+1)*H/P) of q and [r*H_kv/P, (r+1)*H_kv/P) of k and v, so
every rank attends its own heads over the full sequence with no communication. With the
``nvfuser`` kernel the fusions carry the split as nvFuser DID annotations (a loop split of
the head axis, parallelized on ``mesh_x``), as nvFuser's own multidevice SDPA tests do.
"""

from __future__ import annotations

from sdpa_fusion.local import local_backward, local_forward

from .base import Description, Schedule


class HeadParallel(Schedule):
    name = "head_parallel"
    sharded_dim = 1
    supports_thd = True  # whole packed sequences on every rank

    def global_spec(self, spec):
        return spec.replace(heads=spec.heads * self.size, kv_heads=spec.kv_heads * self.size)

    def validate(self, spec):
        super().validate(spec)

    def _kernel(self, kernel):
        return kernel.split_heads(self.mesh, self.dim) if self.size > 1 else kernel

    def forward(self, q, k, v, spec, kernel, dropout=None):
        return local_forward(self._kernel(kernel), q, k, v, spec, dropout)

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None):
        return local_backward(self._kernel(kernel), dout, q, k, v, out, lse, spec, dropout)

    def describe(self, spec):
        return Description(
            self.name, self.size, steps=1, bytes_sent=0, bytes_received=0,
            flops=spec.flops() / self.size, backward_steps=1,
            backward_flops=(spec.flops(backward=True) - spec.flops()) / self.size,
            notes=f"{spec.heads // self.size} of {spec.heads} heads per rank, no communication",
        )
