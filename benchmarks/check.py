"""Is one attention step right? Its out and gradients on sampled rows against fp32 math.

A benchmark that claims a length or a speed checks the step it timed: ATen's cuDNN backward
past 2^31-element offsets returns a wrong dQ with no error, so a step that ran proves
nothing. The reference is computed on the tensors' device in fp32, a chunk of keys and a few
heads at a time (never [S, S], never an fp32 copy of a whole tensor), so it stays small at
millions of tokens:

    out_i = sum_j P_ij v_j,   P_ij = exp(scale q_i.k_j - lse_i)   (lse_i over the keys i sees)
    dQ_i  = scale sum_j P_ij (dO_i.v_j - D_i) k_j,   D_i = dO_i.O_i (the fp32 O_i)
    dV_j  = sum_i P_ij dO_i,   dK_j = scale sum_i P_ij (dO_i.v_j - D_i) q_i

Query rows (out, dQ) are spread over the sequence: first, last and evenly spaced between.
Key rows (dK, dV) need the softmax of every query that sees them, within ``key_flops`` of
fp32 work: causal, they lie near the end of their sequence, where few queries see them (the
nearer, the longer the sequence); without a mask every query sees every key, a full fp32
forward, so dK and dV are checked only where that fits (``notes`` says when not).
Under GQA query head h reads K/V head h // (H // H_kv). A row's error is ||x - ref|| /
||ref|| per head; a tensor's is the largest over its rows and heads (dQ leaves out rows that
see one key: their dQ is 0).

Inputs are read through ``Problem``: a function ``rows -> [B, H, len(rows), E]`` per tensor,
rows being global token positions. ``check`` and ``check_packed`` read tensors held whole;
``Generated`` draws inputs per chunk of tokens from a seed, so that a rank of a
context-parallel run, holding only its shard, checks its rows against the global problem
(``check_shard``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import torch

# bf16 attention lands within ~1e-2 of fp32 at long sequences (a bf16-rounding kernel's worst
# row here: 3e-3); 5e-2 leaves the worst of a few hundred rows and heads room, and is still
# 7x below the broken cuDNN dQ (0.35 to 77x off). fp16 rounds 8x finer.
TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-4}
ROWS = 16            # query rows checked (out, dQ)
KEY_ROWS = 8         # key rows checked (dK, dV)
KEY_TAIL = 512       # causal: checked keys lie at most this far before their sequence's end
KEY_FLOPS = 1e14     # the most fp32 work the dK/dV reference may take: ~3 s on an H200
RANK_KEY_FLOPS = 5e11  # the same for one rank of many (check_packed_rank): ~10 ms on an H200
BATCHES = 2          # batch elements checked when B > 1 (the first and the last)
KEYS_PER_STEP = 4096
HEADS_PER_STEP = 8
ROWS_PER_STEP = 256
NAMES = ("out", "dq", "dk", "dv")
# dQ of a row and dK of a key are sums of one term per key (query) it meets, with both signs:
# over a few terms they cancel, and a row's relative error means nothing there. torch's own
# bf16 SDPA (128-token causal, 20 draws, against fp64) is off by up to 2.6 on a key one query
# sees and 0.11 on a row of four keys, and by at most 0.04 from five terms on: rows of fewer
# terms are left out of dQ and dK (out and dV, sums of positive weights, keep every row).
MIN_TERMS = 5

Rows = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Problem:
    """The global problem, read by rows: ``q(rows)`` (and k, v, dout) gives [B, H, n, E] of
    the global token positions ``rows``. Packed problems give their sequence boundaries
    (``cu_seqlens``, a tuple): the mask is then per sequence."""

    q: Rows
    k: Rows
    v: Rows
    dout: Rows
    seq_len: int
    causal: bool
    scale: float
    cu_seqlens: tuple[int, ...] | None = None

    def bounds(self, rows: torch.Tensor):
        """(start, end) of the sequence of each of ``rows``."""
        if self.cu_seqlens is None:
            return torch.zeros_like(rows), torch.full_like(rows, self.seq_len)
        cu = torch.tensor(self.cu_seqlens, device=rows.device)
        seq = torch.searchsorted(cu, rows, right=True) - 1
        return cu[seq], cu[seq + 1]

    def keys_of(self, rows: torch.Tensor):
        """[lo, hi): the keys each query row sees."""
        start, end = self.bounds(rows)
        return start, (rows + 1 if self.causal else end)

    def queries_of(self, keys: torch.Tensor):
        """[lo, hi): the queries that see each key."""
        start, end = self.bounds(keys)
        return (keys if self.causal else start), end


@dataclasses.dataclass
class Report:
    """Per tensor the largest relative row error (None: not checked here), where it was
    ([batch, head, position]), how many rows were checked, why some were not (``notes``),
    and the verdict."""

    errors: dict
    worst: dict
    rows: dict
    query_rows: list
    key_rows: list
    tolerance: float
    notes: list = dataclasses.field(default_factory=list)

    @property
    def right(self) -> bool:
        """Every checked error within the tolerance (a NaN is not), out checked at least."""
        checked = [e for e in self.errors.values() if e is not None]
        return self.errors["out"] is not None and all(e <= self.tolerance for e in checked)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "right": self.right}


def line(report: dict) -> str:
    """'right: out 3.1e-03, dq 4.0e-03, dk -, dv - (tolerance 5e-02)' of a report's dict."""
    cells = ", ".join(f"{n} {'-' if e is None else f'{e:.1e}'}"
                      for n, e in report["errors"].items())
    return (f"{'right' if report['right'] else 'WRONG'}: {cells} "
            f"(tolerance {report['tolerance']:.0e})")


def merge(reports: list[dict]) -> dict:
    """One report (as ``Report.as_dict``) from every rank's: the largest errors (NaN wins),
    the rows summed, the positions joined."""
    out = {"errors": {}, "worst": {}, "rows": {}, "query_rows": [], "key_rows": [],
           "tolerance": reports[0]["tolerance"],
           "notes": list(dict.fromkeys(n for r in reports for n in r["notes"]))}
    for name in NAMES:
        found = [r for r in reports if r["errors"][name] is not None]
        worst = max(found, key=lambda r: _order(r["errors"][name]), default=None)
        out["errors"][name] = worst["errors"][name] if worst else None
        out["worst"][name] = worst["worst"][name] if worst else None
        out["rows"][name] = sum(r["rows"][name] for r in reports)
    for r in reports:
        out["query_rows"] += r["query_rows"]
        out["key_rows"] += r["key_rows"]
    return {**out, "right": Report(**out).right}


def _order(e: float) -> float:
    return math.inf if math.isnan(e) else e


# ---- entry points ---------------------------------------------------------------------------
def check(q, k, v, dout, out, dq, dk, dv, *, causal: bool, scale: float | None = None,
          heads: int | None = None, **sampling) -> Report:
    """Check a step on tensors held whole: q, dout, out, dq [B, H, S, E] and k, v, dk, dv
    [B, H_kv, S, E] (logical shapes, any memory order). ``heads``: check only that many K/V
    heads (the first, the last and evenly spaced between) and their query heads, every head
    by default (the step ran on all; a reference of a few costs that much less, and the last
    head keeps the largest offsets of a BHSE tensor in the check). ``sampling``: ``rows``,
    ``key_rows``, ``key_flops`` of ``check_shard``."""
    kv_heads = q_heads = None
    if heads is not None:
        groups = q.shape[1] // k.shape[1]
        kv_heads = _spread(k.shape[1], heads).to(q.device)
        q_heads = (kv_heads[:, None] * groups + torch.arange(groups, device=q.device)).flatten()
        q, dout, out, dq = (t.index_select(1, q_heads) for t in (q, dout, out, dq))
        k, v, dk, dv = (t.index_select(1, kv_heads) for t in (k, v, dk, dv))
    batches = _spread(q.shape[0], BATCHES).tolist()
    problem = Problem(*(_held(t, batches) for t in (q, k, v, dout)), q.shape[2], causal,
                      _scale(scale, q))
    positions = torch.arange(q.shape[2], device=q.device)
    report = check_shard(problem, positions, out, dq, dk, dv, batches=batches, **sampling)
    if heads is not None:  # name the heads of the step, not those of the sample
        for name, worst in report.worst.items():
            if worst is not None:
                chosen = q_heads if name in ("out", "dq") else kv_heads
                worst[1] = int(chosen[worst[1]])
    return report


def check_packed(q, k, v, dout, out, dq, dk, dv, cu_seqlens, *, causal: bool = True,
                 scale: float | None = None, **sampling) -> Report:
    """Check a step on packed [T, H, E] tensors of the sequences ``cu_seqlens`` delimits."""
    out, dq, dk, dv = (t.permute(1, 0, 2).unsqueeze(0) for t in (out, dq, dk, dv))
    problem = packed_problem(q, k, v, dout, cu_seqlens, causal=causal, scale=scale)
    positions = torch.arange(q.shape[0], device=q.device)
    return check_shard(problem, positions, out, dq, dk, dv, **sampling)


def packed_problem(q, k, v, dout, cu_seqlens, *, causal: bool = True,
                   scale: float | None = None) -> Problem:
    """The ``Problem`` of packed [T, H, E] inputs held whole, sequences as ``cu_seqlens``
    (what ``check_shard`` checks a rank's part of a packed batch against)."""
    q, k, v, dout = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v, dout))
    cu = tuple(int(x) for x in cu_seqlens)
    return Problem(*(_held(t, [0]) for t in (q, k, v, dout)), q.shape[2], causal,
                   _scale(scale, q), cu)


def check_packed_rank(problem: Problem, index: torch.Tensor, out, dq, dk, dv, *,
                      key_flops: float = RANK_KEY_FLOPS) -> dict:
    """One rank's packed results [T_local, H, E] against ``problem`` (``packed_problem`` of
    the whole batch), as a dict that ``merge`` joins over ranks; ``index`` gives each local
    row's global token (a schedule packing's ``token_index``; -1: padding, not checked)."""
    real = (index >= 0).nonzero().squeeze(1)
    results = (t.index_select(0, real).permute(1, 0, 2).unsqueeze(0) for t in (out, dq, dk, dv))
    return check_shard(problem, index[real], *results, key_flops=key_flops).as_dict()


def judged(m, checks: dict):
    """The measurement ``m`` of a checked step, or one of status "wrong" (no figure) where
    ``checks`` (``merge``'s) found a wrong row."""
    if m.status == "ok" and not checks["right"]:
        return type(m)(status="wrong", error=line(checks))
    return m


def check_shard(problem: Problem, positions: torch.Tensor, out, dq, dk, dv, *,
                rows: int = ROWS, key_rows: int = KEY_ROWS, key_flops: float = KEY_FLOPS,
                batches=None) -> Report:
    """Check this rank's results ``out``, ``dq`` [B, H, n, E] and ``dk``, ``dv``
    [B, H_kv, n, E], whose slot i holds global position ``positions[i]``, against
    ``problem``: ``rows`` query rows, up to ``key_rows`` key rows whose reference takes at
    most ``key_flops``; ``batches``: the batch elements of the results that ``problem``
    gives (all by default)."""
    batches = list(range(out.shape[0])) if batches is None else batches
    positions = positions.to(out.device)
    q_slots = _spread(len(positions), rows).to(out.device)
    per_pair = 4 * len(batches) * out.shape[1] * out.shape[3]  # QK and PV, every head
    k_slots, notes = _key_slots(problem, positions, key_rows, key_flops / per_pair)
    errors, worst, counted = dict.fromkeys(NAMES), dict.fromkeys(NAMES), dict.fromkeys(NAMES, 0)
    with torch.no_grad(), _fp32_math():
        q_rows = positions[q_slots]
        ref_out, lse = _by_blocks(_forward, problem, q_rows)
        ref_dq = _by_blocks(_dq, problem, q_rows, ref_out, lse)
        lo, hi = problem.keys_of(q_rows)
        results = {"out": (out, q_slots, q_rows, ref_out, None),
                   "dq": (dq, q_slots, q_rows, ref_dq, hi - lo >= MIN_TERMS)}
        if len(k_slots):
            k_rows = positions[k_slots]
            ref_dk, ref_dv = _dkdv(problem, k_rows)
            q_lo, q_hi = problem.queries_of(k_rows)
            results.update(dk=(dk, k_slots, k_rows, ref_dk, q_hi - q_lo >= MIN_TERMS),
                           dv=(dv, k_slots, k_rows, ref_dv, None))
        for name, (got, slots, at, ref, keep) in results.items():
            errors[name], worst[name], counted[name] = _compare(got, batches, slots, at, ref,
                                                                keep)
    return Report(errors, worst, counted, q_rows.tolist(),
                  positions[k_slots].tolist() if len(k_slots) else [],
                  TOLERANCE.get(out.dtype, TOLERANCE[torch.bfloat16]), notes)


# ---- inputs a check can regenerate ----------------------------------------------------------
class Generated:
    """Standard-normal rows of a [1, H, S, E] tensor that no rank needs to hold whole: token
    chunk c (``chunk`` tokens, every head) is drawn from its own generator, seeded by
    (``seed``, ``index``, c), so any rank makes any rows, alike on every rank of one device
    type. Called with rows it gives [1, H, n, E]; ``into(t, positions)`` fills a shard.
    The generator's seed packs (c, seed, index) into 32 bits (a CPU generator keeps no more):
    ``seed`` and ``index`` below 16, up to 2^24 chunks."""

    def __init__(self, heads: int, head_dim: int, *, dtype, device, seed: int, index: int,
                 chunk: int = 1024):
        for name, value in (("seed", seed), ("index", index)):
            if not 0 <= value < 16:
                raise ValueError(f"{name}={value} must be in [0, 16) (it takes 4 bits of the "
                                 f"generator's 32-bit seed)")
        self.heads, self.head_dim, self.chunk = heads, head_dim, chunk
        self.dtype, self.device = dtype, torch.device(device)
        self.base = seed * 16 + index

    def _draw(self, c: int) -> torch.Tensor:
        generator = torch.Generator(device=self.device).manual_seed((c << 8) + self.base)
        t = torch.empty((self.chunk, self.heads, self.head_dim), dtype=self.dtype,
                        device=self.device)
        return t.normal_(generator=generator)

    def _rows(self, rows: torch.Tensor, write) -> None:
        """``write(slots, values [m, H, E])`` for the rows of every chunk ``rows`` touch."""
        chunks = rows // self.chunk
        for c in torch.unique(chunks).tolist():
            slots = (chunks == c).nonzero().squeeze(1)
            write(slots, self._draw(c).index_select(0, rows[slots] - c * self.chunk))

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(self.device)
        out = torch.empty((len(rows), self.heads, self.head_dim), dtype=self.dtype,
                          device=self.device)
        self._rows(rows, lambda slots, x: out.index_copy_(0, slots, x))
        return out.permute(1, 0, 2).unsqueeze(0)

    def into(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Fill ``t`` (logical [1, H, n, E], any memory order) with the rows ``positions``."""
        self._rows(positions.to(self.device),
                   lambda slots, x: t[0].index_copy_(1, slots, x.transpose(0, 1)))
        return t


# ---- the reference ----------------------------------------------------------------------------
def _by_blocks(fn, problem, rows, *per_row):
    """``fn(problem, rows, *per_row)`` over blocks of ROWS_PER_STEP rows, joined on the row
    dim (dim 2) of every result."""
    step = ROWS_PER_STEP
    parts = [fn(problem, rows[a:a + step], *(t[:, :, a:a + step] for t in per_row))
             for a in range(0, len(rows), step)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p, dim=2) for p in zip(*parts))
    return torch.cat(parts, dim=2)


def _key_chunks(problem: Problem, lo: torch.Tensor, hi: torch.Tensor):
    """(visible [n, c], k, v) of consecutive chunks of c keys covering the [lo, hi) of n
    rows (chunks no row sees skipped): which row sees which key, and the chunk's K and V."""
    spans = torch.stack([lo, hi], dim=1).unique(dim=0).tolist()  # rows of one sequence alike
    start, stop = int(lo.min()), int(hi.max())
    for a in range(start, stop, KEYS_PER_STEP):
        b = min(a + KEYS_PER_STEP, stop)
        if not any(x < b and y > a for x, y in spans):  # between the sequences rows see
            continue
        keys = torch.arange(a, b, device=lo.device)
        visible = (keys >= lo[:, None]) & (keys < hi[:, None])
        yield visible, problem.k(keys), problem.v(keys)


def _heads(t: torch.Tensor, heads: slice, groups: int) -> torch.Tensor:
    """fp32 K/V of query heads ``heads`` (each reads K/V head h // groups)."""
    index = torch.arange(heads.start, heads.stop, device=t.device) // groups
    return t.index_select(1, index).float()


def _head_blocks(heads: int):
    return [slice(a, min(a + HEADS_PER_STEP, heads)) for a in range(0, heads, HEADS_PER_STEP)]


def _forward(problem: Problem, rows: torch.Tensor):
    """fp32 out [B, H, n, E] and lse [B, H, n] of query ``rows`` (online softmax)."""
    q = problem.q(rows).float()
    lo, hi = problem.keys_of(rows)
    m = torch.full(q.shape[:3], -math.inf, device=q.device)
    total, acc = torch.zeros_like(m), torch.zeros_like(q)
    for visible, k, v in _key_chunks(problem, lo, hi):
        groups = q.shape[1] // k.shape[1]
        for h in _head_blocks(q.shape[1]):
            s = (q[:, h] @ _heads(k, h, groups).transpose(-1, -2)) * problem.scale
            s = s.masked_fill(~visible, -math.inf)
            m_new = torch.maximum(m[:, h], s.amax(-1))
            base = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = torch.exp(s - base[..., None])
            alpha = torch.exp(m[:, h] - base)
            total[:, h] = total[:, h] * alpha + p.sum(-1)
            acc[:, h] = acc[:, h] * alpha[..., None] + p @ _heads(v, h, groups)
            m[:, h] = m_new
    return acc / total[..., None], m + torch.log(total)


def _dq(problem: Problem, rows: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """fp32 dQ [B, H, n, E] of query ``rows``, given their fp32 out and lse."""
    q, do = problem.q(rows).float(), problem.dout(rows).float()
    delta = (do * out).sum(-1)
    lo, hi = problem.keys_of(rows)
    dq = torch.zeros_like(q)
    for visible, k, v in _key_chunks(problem, lo, hi):
        groups = q.shape[1] // k.shape[1]
        for h in _head_blocks(q.shape[1]):
            kh = _heads(k, h, groups)
            s = (q[:, h] @ kh.transpose(-1, -2)) * problem.scale
            p = torch.exp(s.masked_fill(~visible, -math.inf) - lse[:, h, :, None])
            dp = do[:, h] @ _heads(v, h, groups).transpose(-1, -2)
            dq[:, h] += (p * (dp - delta[:, h, :, None])) @ kh * problem.scale
    return dq


def _queries(problem: Problem, keys: torch.Tensor) -> torch.Tensor:
    """Every query row that sees one of ``keys``, in order."""
    spans = torch.unique(torch.stack(problem.queries_of(keys), dim=1), dim=0).tolist()
    return torch.unique(torch.cat([torch.arange(a, b, device=keys.device) for a, b in spans]))


def _dkdv(problem: Problem, keys: torch.Tensor):
    """fp32 dK, dV [B, H_kv, n, E] of ``keys``, from every query that sees them."""
    queries = _queries(problem, keys)
    k, v = problem.k(keys).float(), problem.v(keys).float()
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, len(queries), ROWS_PER_STEP):
        block = queries[a:a + ROWS_PER_STEP]
        out, lse = _forward(problem, block)
        q, do = problem.q(block).float(), problem.dout(block).float()
        groups = q.shape[1] // k.shape[1]
        kv_of = torch.arange(q.shape[1], device=q.device) // groups
        q_lo, q_hi = problem.keys_of(block)
        visible = (keys >= q_lo[:, None]) & (keys < q_hi[:, None])
        kh, vh = k.index_select(1, kv_of), v.index_select(1, kv_of)
        s = ((q @ kh.transpose(-1, -2)) * problem.scale).masked_fill(~visible, -math.inf)
        p = torch.exp(s - lse[..., None])
        ds = p * (do @ vh.transpose(-1, -2) - (do * out).sum(-1)[..., None])
        dv.index_add_(1, kv_of, p.transpose(-1, -2) @ do)
        dk.index_add_(1, kv_of, ds.transpose(-1, -2) @ q * problem.scale)
    return dk, dv


# ---- sampling and comparing -------------------------------------------------------------------
def _spread(n: int, count: int) -> torch.Tensor:
    """Up to ``count`` indices of range(n): the first, the last and evenly spaced between."""
    if n == 0 or count <= 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.linspace(0, n - 1, min(count, n)).round().long().unique()


def _key_slots(problem: Problem, positions: torch.Tensor, count: int, pairs: float):
    """(slots of the keys to check, notes): spread over the keys within ``tail`` of their
    sequence's end (causal; any otherwise), ``tail`` halved from KEY_TAIL until the queries
    that see them attend to at most ``pairs`` keys in all; keys of one-token sequences are
    left out (their dK is 0)."""
    start, end = problem.bounds(positions)
    tail = KEY_TAIL if problem.causal else math.inf
    while True:
        candidates = ((end - start > 1) & (end - positions <= tail)).nonzero().squeeze(1)
        slots = candidates[_spread(len(candidates), count).to(candidates.device)]
        if not len(slots):
            return slots, []
        lo, hi = problem.keys_of(_queries(problem, positions[slots]))
        needed = int((hi - lo).sum())
        if needed <= pairs:
            return slots, []
        if not problem.causal or tail <= 1:
            return slots[:0], [f"dk, dv not checked: their reference attends {needed:.2e} "
                               f"query-key pairs, past key_flops' {pairs:.2e}"]
        tail //= 2


def _held(t: torch.Tensor, batches) -> Rows:
    """Rows of a [B, H, S, E] tensor held whole, for the batch elements ``batches``."""
    return lambda rows: torch.stack([t[b].index_select(1, rows) for b in batches])


def _compare(got, batches, slots, positions, ref, keep):
    """(largest relative row error, [batch, head, position] of it, rows compared); rows where
    ``keep`` is False are left out."""
    x = torch.stack([got[b].index_select(1, slots) for b in batches]).float()
    rel = (x - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)  # [B, H, n]
    if keep is not None:
        rel, positions = rel[:, :, keep], positions[keep]
    if rel.numel() == 0:
        return None, None, 0
    flat = torch.where(rel.isnan(), math.inf, rel).flatten().argmax()
    b, h, i = (int(index) for index in torch.unravel_index(flat, rel.shape))
    return float(rel[b, h, i]), [batches[b], h, int(positions[i])], rel.shape[2]


def _scale(scale, q) -> float:
    return scale if scale is not None else q.shape[-1] ** -0.5


@contextlib.contextmanager
def _fp32_math():
    """fp32 matmuls in full precision (no TF32) inside."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)
