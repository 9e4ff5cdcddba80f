"""What torch.distributed sees of a step: calls and bytes per op and process group.

    from tests.comms import counting
    with counting() as seen:
        out = sdpa_fusion.attention(q, k, v, schedule=sched)
    seen.calls("all_gather_into_tensor", sched.group)    # collectives started on that group
    seen.sent(sched.group), seen.received(sched.group)  # bytes this rank moved over it
    seen.ops(sched.group)                                # {op: calls}
    seen.reset()                                         # count the backward alone next

Like PyTorch's ``CommDebugMode``, but at torch.distributed's Python entry points, with the
group and bytes of every call: ``counting`` replaces the functions below (in
``torch.distributed`` and in ``torch.distributed.distributed_c10d``, whose globals ``P2POp``
checks) by counting wrappers that call the originals. A call made inside another counted
call (``batch_isend_irecv`` running its ``isend``s, ``all_gather_object`` its
``all_gather``) is part of the outer one and not counted again. The counts are this rank's:
what the schedules do, not what they say they do (their ``Communicator`` counts are not read).

Bytes are those that leave and reach this rank, the convention of ``describe()``:

    isend, send / irecv, recv       the tensor's bytes, sent / received
    batch_isend_irecv               one call; its isends' bytes sent, its irecvs' received
    all_gather(_into_tensor)        (P - 1) x the input's bytes, each way
    reduce_scatter(_tensor)         (P - 1) x the output's bytes, each way
    all_to_all(_single)             what goes to (comes from) the other ranks, each way
    all_reduce                      2 (P - 1) / P x the tensor's bytes, each way (a ring)
    broadcast                       the source sends (P - 1) x the bytes, the others receive them
    barrier, monitored_barrier, all_gather_object, broadcast_object_list: calls only

P is the size of the call's group; a group is named by its ``group_name`` (WORLD for None).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

P2P = ("isend", "irecv", "send", "recv")
COLLECTIVES = ("batch_isend_irecv", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "all_reduce",
               "broadcast", "barrier", "monitored_barrier", "all_gather_object",
               "broadcast_object_list")
OPS = P2P + COLLECTIVES


@dataclasses.dataclass
class Traffic:
    """Calls of one op on one group, the bytes this rank sent and received in them, and the
    point-to-point bytes per peer (global ranks)."""

    calls: int = 0
    sent: int = 0
    received: int = 0
    sent_to: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    received_from: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_name(group) -> str:
    """The name of ``group``: a process group, its name, or None for the default group."""
    if isinstance(group, str):
        return group
    return (group if group is not None else dist.group.WORLD).group_name


def _arg(args, kwargs, index: int, name: str, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


class Counter:
    """Calls and bytes of every counted op, per (op, group name). Queries take ``group`` as a
    process group or its name (None: every group) and ``op`` as a name or several."""

    def __init__(self):
        self.table: dict[tuple[str, str], Traffic] = collections.defaultdict(Traffic)
        self._lock = threading.Lock()

    # ---- queries ------------------------------------------------------------------------
    def _rows(self, op=None, group=None):
        name = None if group is None else group_name(group)
        ops = (op,) if isinstance(op, str) else op
        return [t for (o, g), t in self.table.items()
                if (ops is None or o in ops) and (name is None or g == name)]

    def calls(self, op=None, group=None) -> int:
        """Calls of ``op`` (a name, several, or all when None) on ``group`` (all when None)."""
        return sum(t.calls for t in self._rows(op, group))

    def sent(self, group=None, op=None) -> int:
        """Bytes this rank sent over ``group`` (every group when None)."""
        return sum(t.sent for t in self._rows(op, group))

    def received(self, group=None, op=None) -> int:
        """Bytes this rank received over ``group`` (every group when None)."""
        return sum(t.received for t in self._rows(op, group))

    def ops(self, group=None) -> dict[str, int]:
        """{op: calls} on ``group`` (every group when None)."""
        name = None if group is None else group_name(group)
        counts = collections.Counter()
        for (o, g), t in self.table.items():
            if name is None or g == name:
                counts[o] += t.calls
        return dict(counts)

    def peers(self, group=None) -> tuple[dict[int, int], dict[int, int]]:
        """({peer: bytes sent to it}, {peer: bytes received from it}) of point-to-point ops."""
        to, frm = collections.Counter(), collections.Counter()
        for t in self._rows(None, group):
            to.update(t.sent_to)
            frm.update(t.received_from)
        return dict(to), dict(frm)

    def groups(self) -> set[str]:
        """Names of the groups any op was called on."""
        return {g for (_, g), t in self.table.items() if t.calls}

    def reset(self) -> None:
        with self._lock:
            self.table.clear()

    def __str__(self) -> str:
        rows = [f"{o} on group {g}: {t.calls} calls, {t.sent} B sent, {t.received} B received"
                for (o, g), t in sorted(self.table.items())]
        return "\n".join(rows) or "no communication"

    # ---- recording --------------------------------------------------------------------------
    def record(self, op: str, group, sent: int = 0, received: int = 0, to=None, frm=None):
        with self._lock:
            row = self.table[(op, group_name(group))]
            row.calls += 1
            row.sent += sent
            row.received += received
            row.sent_to.update(to or {})
            row.received_from.update(frm or {})


def _size(group) -> int:
    return dist.get_world_size(group)


def _p2p(op: str, args, kwargs):
    """(group, sent, received, to, from) of one isend/irecv/send/recv."""
    tensor = _arg(args, kwargs, 0, "tensor")
    sending = op in ("isend", "send")
    group = _arg(args, kwargs, 2, "group")
    peer = _arg(args, kwargs, 1, "dst" if sending else "src")
    if peer is None:  # given as a rank of the group
        peer = dist.get_global_rank(group or dist.group.WORLD,
                                    kwargs["group_dst" if sending else "group_src"])
    n = _nbytes(tensor)
    if sending:
        return group, n, 0, {peer: n}, {}
    return group, 0, n, {}, {peer: n}


def _bytes(op: str, args, kwargs):
    """(group, sent, received, to, from) of one call of a collective ``op``."""
    if op in P2P:
        return _p2p(op, args, kwargs)
    if op == "batch_isend_irecv":
        p2p_ops = _arg(args, kwargs, 0, "p2p_op_list")
        sent, received, to, frm = 0, 0, collections.Counter(), collections.Counter()
        for p in p2p_ops:
            name = p.op.__name__.lstrip("_")
            n = _nbytes(p.tensor)
            if name.endswith("isend"):
                sent, to[p.peer] = sent + n, to[p.peer] + n
            else:
                received, frm[p.peer] = received + n, frm[p.peer] + n
        return p2p_ops[0].group, sent, received, to, frm
    positions = {  # op -> (index, name) of the tensor that sizes it, index of the group
        "all_gather": ((1, "tensor"), 2), "all_gather_into_tensor": ((1, "input_tensor"), 2),
        "reduce_scatter": ((0, "output"), 3), "reduce_scatter_tensor": ((0, "output"), 3),
        "all_reduce": ((0, "tensor"), 2), "broadcast": ((0, "tensor"), 2),
        "all_to_all_single": ((1, "input"), 4), "all_to_all": ((1, "input_tensor_list"), 2),
        "barrier": (None, 0), "monitored_barrier": (None, 0), "all_gather_object": (None, 2),
        "broadcast_object_list": (None, 2),
    }
    sizing, group_at = positions[op]
    group = _arg(args, kwargs, group_at, "group")
    if sizing is None:
        return group, 0, 0, {}, {}
    t = _arg(args, kwargs, *sizing)
    p = _size(group)
    if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"):
        n = (p - 1) * _nbytes(t)
        return group, n, n, {}, {}
    if op == "all_reduce":
        n = 2 * (p - 1) * _nbytes(t) // p
        return group, n, n, {}, {}
    if op == "broadcast":
        src = _arg(args, kwargs, 1, "src")
        mine = src == dist.get_rank()
        return group, (p - 1) * _nbytes(t) if mine else 0, 0 if mine else _nbytes(t), {}, {}
    return (group, *_all_to_all(op, args, kwargs, group, p), {}, {})


def _all_to_all(op: str, args, kwargs, group, p: int) -> tuple[int, int]:
    """(sent, received) of an all-to-all: what goes to and comes from the other ranks."""
    me = dist.get_group_rank(group or dist.group.WORLD, dist.get_rank())
    if op == "all_to_all":
        outputs, inputs = _arg(args, kwargs, 0, "output_tensor_list"), _arg(args, kwargs, 1,
                                                                            "input_tensor_list")
        return (sum(_nbytes(t) for j, t in enumerate(inputs) if j != me),
                sum(_nbytes(t) for j, t in enumerate(outputs) if j != me))
    output, t = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input")
    out_splits, in_splits = _arg(args, kwargs, 2, "output_split_sizes"), _arg(args, kwargs, 3,
                                                                              "input_split_sizes")

    def others(x: torch.Tensor, splits) -> int:
        rows = list(splits) if splits else [x.shape[0] // p] * p
        row = _nbytes(x) // max(x.shape[0], 1)
        return sum(n for j, n in enumerate(rows) if j != me) * row

    return others(t, in_splits), others(output, out_splits)


_state = threading.local()


def _wrap(op: str, original, counter: Counter):
    @functools.wraps(original)
    def counted(*args, **kwargs):
        depth = getattr(_state, "depth", 0)
        if depth == 0:
            group, sent, received, to, frm = _bytes(op, args, kwargs)
            counter.record(op, group, sent, received, to, frm)
        _state.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _state.depth = depth

    return counted


@contextlib.contextmanager
def counting():
    """Count what torch.distributed is asked to do inside (see the module docstring)."""
    counter = Counter()
    saved = {op: (getattr(dist, op), getattr(c10d, op)) for op in OPS}
    try:
        for op, (public, inner) in saved.items():
            wrapper = _wrap(op, inner, counter)
            setattr(dist, op, wrapper)
            setattr(c10d, op, wrapper)
        yield counter
    finally:
        for op, (public, inner) in saved.items():
            setattr(dist, op, public)
            setattr(c10d, op, inner)
