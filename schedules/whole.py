"""Running a packed batch split by whole documents (partition ``documents``) in a sequence
schedule (``ring``, ``allgather``, ``ulysses``, and the outer schedule of ``hybrid``): a rank's
rows are its whole documents, then its part of each cut packing of its groups
(``schedules.documents``), disjoint sets that no merge joins:

    rows [0, W)   local varlen kernel calls over the whole documents
    then, per group of ranks that cuts documents (most ranks first), that group's rows: the
                  schedule's own packed path on its cut packing, run by a *twin* (the same
                  schedule, mesh, communicator and buffers, partition ``cut_partition``; over
                  the group's ranks only where they are not all of them: ``schedules.groups``)

No merge joins them. The whole documents' calls run in pieces of about equal work inside the
groups' plans, where a transfer is in flight that no call of the plan hides
(``runner.with_beside``): per group, one piece beside its first such transfer (Ulysses' first
exchange, the ring's first block in backward) and one beside its last (Ulysses' last
exchange, the dK/dV sums coming home; the ring's last block in forward, which no rank
relays). Ulysses, one group, two pieces:

    Gather(0)  Beside(0)  KV(0, arrives)  Attend  StartScatter(0)  Beside(1)  Land(0)
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import itertools

import torch

from sdpa_fusion.local import local_backward, local_forward

from . import dry_run
from .assign import work
from .base import DESCRIBED, Description, Schedule
from .documents import DocumentPacking, DocumentSplit
from .choice import packed_partition
from .groups import SubLine
from .partition import Auto, Documents


def whole_spec(spec):
    """The local problem of the whole documents of ``spec`` (its packing a DocumentPacking)."""
    cu = spec.packing.whole_offsets
    return over_documents(spec, spec.packing.whole_documents).replace(
        packing=None, q_len=cu[-1], kv_len=cu[-1], cu_seqlens=cu, cu_seqlens_padded=None)


def over_documents(spec, documents):
    """``spec`` for a part of its batch: the documents ``documents`` (their indices in the
    batch), numbered from 0 there. A mask names sequences by their index in the batch, so it
    takes those documents' rows (``Mask.select``)."""
    return spec if spec.mask is None else spec.replace(mask=spec.mask.select(documents))


def whole_pieces(spec, count: int) -> tuple:
    """(rows, local problem) of ``count`` runs of consecutive whole documents of ``spec`` (its
    packing a DocumentPacking) of about equal work (``assign.work``), each with a token;
    fewer where fewer documents have one. Made once per problem and kept on the packing
    (every layer's calls on a batch ask for the same pieces)."""
    kept = spec.packing.__dict__.setdefault("_whole_pieces", {})
    key = (spec.replace(packing=None), count)  # the packing holds it: no cycle through it
    if key not in kept:
        kept[key] = _whole_pieces(spec, count)
    return kept[key]


def _whole_pieces(spec, count: int) -> tuple:
    lengths, cu = spec.packing.whole_lengths, spec.packing.whole_offsets
    real = [i for i, n in enumerate(lengths) if n]
    count = min(max(count, 1), len(real))
    done = list(itertools.accumulate(work(lengths[i]) for i in real))
    at = [0]  # the first document of each run, among the real ones
    for j in range(1, count):  # after the document where the work reaches j / count
        cut = bisect.bisect_left(done, done[-1] * j / count) + 1
        at.append(min(max(cut, at[-1] + 1), len(real) - count + j))
    bounds = [0, *(real[i] for i in at[1:]), len(lengths)] if real else []
    documents, pieces = spec.packing.whole_documents, []
    for a, b in zip(bounds, bounds[1:]):
        offsets = tuple(c - cu[a] for c in cu[a:b + 1])
        pieces.append((slice(cu[a], cu[b]), over_documents(spec, documents[a:b]).replace(
            packing=None, q_len=offsets[-1], kv_len=offsets[-1], cu_seqlens=offsets,
            cu_seqlens_padded=None)))
    return tuple(pieces)


def whole_calls(spec) -> int:
    """Kernel calls on the whole documents of ``spec``: one when no document is cut, else
    the pieces run beside the cut groups' transfers (``WholeDocuments._beside``)."""
    cuts = len(spec.packing.cuts)
    if not cuts:
        return 1 if spec.packing.whole_tokens else 0
    return len(whole_pieces(spec, 2 * cuts))


def cut_specs(spec) -> list:
    """(group, rows, local problem) of each cut packing of ``spec`` (its packing a
    DocumentPacking), in row order."""
    out, split = [], spec.packing.split
    for group, rows, cut in spec.packing.cuts:
        cu, padded = cut.offsets
        out.append((group, rows, over_documents(spec, split.cut_docs[group]).replace(
            packing=cut, q_len=cut.tokens, kv_len=cut.tokens, cu_seqlens=cu,
            cu_seqlens_padded=padded)))
    return out


def whole_documents(cls: type) -> type:
    """Schedule class ``cls`` running packed batches under partition ``documents``."""
    return type(cls.__name__, (WholeDocuments, cls),
                {"__doc__": cls.__doc__, "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__})


class WholeDocuments:
    """What ``whole_documents`` puts before a sequence schedule class (which says what its
    exchanges of cut documents cost a rank: ``exchange``, a ``schedules.assign.Exchange``)."""

    def _make_split(self, cu: tuple, padded: tuple | None, device):
        if not self.by_documents(cu, padded):
            return super()._make_split(cu, padded, device)
        return DocumentSplit(self.partition, self.size, cu, padded, device,
                             gather=self._gather_tokens, exchange=self.exchange,
                             cut_partition=self.cut_partition)

    def by_documents(self, cu: tuple, padded: tuple | None) -> bool:
        """Whether the packing ``cu``/``padded`` is split by whole documents."""
        return isinstance(self.partition, Documents) and self.partition_choice(cu, padded)[0] \
            == "documents"

    def partition_choice(self, cu: tuple, padded: tuple | None) -> tuple[str, str]:
        """(the partition the packing ``cu``/``padded`` takes, why), made once per packing."""
        if not isinstance(self.partition, Auto):
            return self.partition.name, "named by the schedule's partition option"
        choices = self.__dict__.setdefault("_choices", collections.OrderedDict())
        key = (cu, padded)
        if key not in choices:
            lengths = tuple(b - a for a, b in zip(cu, cu[1:]))
            choices[key] = packed_partition(self, lengths, self.partition.tolerance,
                                            getattr(self, "transport", "auto"),
                                            groups=self.partition.groups)
            while len(choices) > 4:
                choices.popitem(last=False)
        return choices[key]

    def local_tokens(self, spec) -> int:
        if spec.layout.is_varlen and self._documents(spec):
            return self.local_spec(spec).packing.tokens
        return super().local_tokens(spec)

    def twin(self, group: tuple[int, int] | None = None):
        """This schedule with partition ``cut_partition``, sharing mesh, comm and buffers; over
        the ranks ``group`` = (first, size) of its line only, when given and not all of them
        (``schedules.groups``; p2p transfers, which need nothing of the other ranks)."""
        twins = self.__dict__.setdefault("_twins", {})
        key = None if group is None or group[1] == self.size else group
        if key not in twins:
            twin = self.copy_without_caches()
            twin.partition = self.cut_partition
            twin._splits, twin._positions, twin._contiguous = collections.OrderedDict(), {}, {}
            twin.__dict__.pop("comm", None)
            if key is not None:
                twin.mesh = SubLine(self.mesh, self.dim, *key)
                twin.transport, twin._movers = "p2p", {}
            twins[key] = twin
        return twins[key]

    def _running_twin(self, group: tuple[int, int] | None = None):
        """``twin(group)`` about to run: it takes this schedule's communicator (of its group)."""
        twin = self.twin(group)
        if self.mesh is not None and "comm" not in twin.__dict__:
            if twin.mesh is self.mesh:
                twin.__dict__["comm"] = self.comm
            else:
                twin.__dict__["comm"] = self.comm.line(*group)
                twin._movers = {device: m.over(twin.comm) for device, m in self._movers.items()}
        return twin

    def validate(self, spec):
        if not isinstance(spec.packing, DocumentPacking):
            return super().validate(spec)
        Schedule.validate(self, spec)
        for group, _, cut in cut_specs(spec):
            try:
                self.twin(group).validate(cut)
            except ValueError as e:
                first, size = group
                cut_docs = len(spec.packing.assignment.cut_over(group))
                raise ValueError(
                    f"partition 'documents' cuts {cut_docs} document(s) over ranks "
                    f"{first}-{first + size - 1}, which run schedule {self.name!r} over those "
                    f"{size} ranks: {e}") from e

    def call_extent(self, spec) -> tuple[int, int]:
        if not isinstance(spec.packing, DocumentPacking):
            return super().call_extent(spec)
        longest = max(spec.packing.whole_lengths, default=0)
        extents = [self.twin(group).call_extent(cut) for group, _, cut in cut_specs(spec)]
        return (max([longest, *(rows for rows, _ in extents)]),
                max([longest, *(keys for _, keys in extents)]))

    def kernel_calls(self, spec) -> int:
        """Those of the cut documents' schedules and of the whole documents (``whole_calls``)."""
        if not isinstance(spec.packing, DocumentPacking):
            return super().kernel_calls(spec)
        return max(1, whole_calls(spec) + sum(self.twin(group).kernel_calls(cut)
                                              for group, _, cut in cut_specs(spec)))

    def forward(self, q, k, v, spec, kernel, dropout=None, *, out=None, lse=None, beside=(),
                kept=None):
        if not isinstance(spec.packing, DocumentPacking):
            return super().forward(q, k, v, spec, kernel, dropout, out=out, lse=lse,
                                   beside=beside, kept=kept)
        assert not beside, "a documents split runs its own work beside its cut groups'"
        w, cuts = spec.packing.whole_tokens, cut_specs(spec)
        if not cuts:  # every document whole: the local call's results as they are
            return local_forward(kernel, q, k, v, whole_spec(spec), out=out, lse=lse)
        if not w and len(cuts) == 1:  # every row cut over one group
            group, _, cut = cuts[0]
            return self._running_twin(group).forward(q, k, v, cut, kernel, out=out, lse=lse,
                                                     kept=_of_group(kept, group))
        out = torch.empty_like(q) if out is None else out
        if lse is None:
            lse = torch.empty((1, q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)

        def whole(rows, piece):
            local_forward(kernel, q[rows], k[rows], v[rows], piece, out=out[rows],
                          lse=lse[:, :, rows])

        pieces = self._beside(spec, whole, len(cuts))
        for (group, rows, cut), beside in zip(cuts, pieces):
            self._running_twin(group).forward(q[rows], k[rows], v[rows], cut, kernel,
                                              out=out[rows], lse=lse[:, :, rows], beside=beside,
                                              kept=_of_group(kept, group))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, spec, kernel, dropout=None, *, dq=None, dk=None,
                 dv=None, beside=(), kept=None):
        grads = dict(dq=dq, dk=dk, dv=dv)
        if not isinstance(spec.packing, DocumentPacking):
            return super().backward(dout, q, k, v, out, lse, spec, kernel, dropout, **grads,
                                    beside=beside, kept=kept)
        assert not beside, "a documents split runs its own work beside its cut groups'"
        w, cuts = spec.packing.whole_tokens, cut_specs(spec)
        if not cuts:
            return local_backward(kernel, dout, q, k, v, out, lse, whole_spec(spec), **grads)
        if not w and len(cuts) == 1:
            group, _, cut = cuts[0]
            return self._running_twin(group).backward(dout, q, k, v, out, lse, cut, kernel,
                                                      **grads, kept=_of_group(kept, group))
        dq, dk, dv = (torch.empty_like(t) if g is None else g
                      for g, t in zip(grads.values(), (q, k, v)))

        def whole(rows, piece):
            local_backward(kernel, dout[rows], q[rows], k[rows], v[rows], out[rows],
                           lse[:, :, rows].contiguous(), piece, dq=dq[rows], dk=dk[rows],
                           dv=dv[rows])

        pieces = self._beside(spec, whole, len(cuts))
        for (group, rows, cut), beside in zip(cuts, pieces):
            self._running_twin(group).backward(
                dout[rows], q[rows], k[rows], v[rows], out[rows], lse[:, :, rows].contiguous(),
                cut, kernel, dq=dq[rows], dk=dk[rows], dv=dv[rows], beside=beside,
                kept=_of_group(kept, group))
        return dq, dk, dv

    def backward_reads_inputs(self, spec) -> bool:
        if isinstance(spec.packing, DocumentPacking) and spec.packing.whole_tokens:
            return True  # the whole documents' calls read them
        return super().backward_reads_inputs(spec)

    def _beside(self, spec, whole, groups: int) -> list[list]:
        """The whole documents' calls ``whole(rows, piece)`` as the work each of the ``groups``
        cut groups' plans runs beside its transfers: two pieces each, where documents allow
        (``runner.with_beside``: one beside its first transfer, one beside its last)."""
        calls = [functools.partial(whole, rows, piece)
                 for rows, piece in whole_pieces(spec, 2 * groups)]
        return [calls[2 * i:2 * i + 2] for i in range(groups)]

    def describe(self, spec):
        if not (spec.layout.is_varlen and self._documents(spec)):
            return self._chosen(spec, super().describe(spec))
        local = self.local_spec(spec)
        packing, whole = local.packing, whole_spec(local)
        calls = whole_calls(local)
        forward = whole.flops() if calls else 0.0
        # steps: the cut groups' (the cost model sizes their transfers by them), else the call
        steps = 0 if packing.cuts else calls
        d = Description(self.name, self.size, steps=steps, bytes_sent=0, bytes_received=0,
                        flops=forward, backward_steps=steps,
                        backward_flops=whole.flops(backward=True) - forward if calls else 0.0)
        beside = " beside the cut documents' transfers" if packing.cuts else ""
        notes = [f"{len(packing.whole_lengths)} whole documents ({packing.whole_tokens} tokens, "
                 f"{calls} local kernel call(s){beside}, nothing travels)"]
        for group, rows, _ in packing.cuts:
            first, size = group
            part = self.twin(group).describe(self._cut_global(spec, group))
            over = "every rank" if size == self.size else f"ranks {first}-{first + size - 1}"
            notes.append(f"{len(packing.assignment.cut_over(group))} cut over {over} "
                         f"({rows.stop - rows.start} tokens here): {part.notes}")
            d = dataclasses.replace(d, **{f: getattr(d, f) + getattr(part, f) for f in DESCRIBED})
        # the twins' descriptions are this schedule's (same name and ranks), summed
        return self._chosen(spec, dataclasses.replace(
            d, notes="; ".join(notes), memory_of=dry_run.memory_of(self, spec)))

    def _documents(self, spec) -> bool:
        return self.by_documents(spec.cu_seqlens, spec.cu_seqlens_padded)

    def _chosen(self, spec, d: Description) -> Description:
        """``d`` with the partition a packed ``spec`` took, and why, before its notes."""
        if not (spec.layout.is_varlen and isinstance(self.partition, Documents)):
            return d
        name, why = self.partition_choice(spec.cu_seqlens, spec.cu_seqlens_padded)
        said = name if name == self.partition.name else f"{self.partition!r}: {name}"
        return dataclasses.replace(d, notes=f"partition {said} ({why}); {d.notes}")

    def _cut_global(self, spec, group):
        """The global problem of the cut packing of ``group`` of the global ``spec``."""
        split = self.split(spec.cu_seqlens, spec.cu_seqlens_padded, "cpu")
        cu = split.cuts[group].cu_seqlens
        return over_documents(spec, split.cut_docs[group]).replace(
            q_len=cu[-1], kv_len=cu[-1], cu_seqlens=cu, cu_seqlens_padded=None, packing=None)


def _of_group(kept: dict | None, group) -> dict | None:
    """What a call's forward keeps for the cut documents of ``group`` (None: nothing kept)."""
    return None if kept is None else kept.setdefault(group, {})
