"""FlashAttention-4's backward over several calls on the same query rows (Hopper, sm90).

A ring's query rows meet one K/V block per step, one kernel call each. FA4's
``_flash_attn_bwd`` runs three kernels per call: a preprocess (dO·O, the base-2 lse of the
rows, a zeroed fp32 dQ accumulator), the backward (dK, dV, dQ added into the accumulator)
and a postprocess (the accumulator scaled into dQ). ``QueryRows`` runs the preprocess and
the postprocess once for the rows and lets every call add into one accumulator.

The backward keeps its dQ tiles in its MMA's register order, so calls share an accumulator
only in one tile configuration (FA4's non-causal one: 80-row tiles at head dim 128), each
call on whole tiles. A call on other rows runs on the tiles around them, the rows it leaves
out masked by a base-2 lse of +inf (no probability, so no dQ of those rows nor dK/dV from
them); the preprocess writes that +inf past the last row itself. A causal call is square and
on whole tiles (``rows_fit``). The kernels are compiled and launched as ``_flash_attn_bwd``
of flash-attn-4 4.0.0b36 does on sm90 for dense tensors without window or mods.
"""

from __future__ import annotations

import torch

from .fa4_entry import backward_internals, interface
from .fa4_entry import bshd as _bshd

_COMPILED: dict = {}  # the backward kernel per configuration (as FA4's compile cache)


def config(head_dim: int):
    """FA4's sm90 backward configuration that every call of ``QueryRows`` runs in."""
    return interface()._tile_size_bwd_sm90(head_dim, head_dim, False, False)


def rows_fit(spans, rows: int, head_dim: int) -> bool:
    """Whether calls on the query rows ``spans`` ((start, stop, causal) each, of ``rows``
    rows) can share one accumulator: a causal call starts on a tile and ends on one or at
    the last row (its mask would not survive a shift); any other call does."""
    tile = config(head_dim).m_block_size
    return all(not causal or (start % tile == 0 and (stop % tile == 0 or stop == rows))
               for start, stop, causal in spans)


def usable(device: torch.device) -> bool:
    """Whether ``QueryRows`` runs on ``device`` (an sm90 GPU)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _round(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class QueryRows:
    """The backward of kernel calls on the query rows of ``q``, ``dout`` and ``out`` (logical
    [B, H, S, E], BHSE or BSHE) with ``lse`` fp32 [B, H, S]: ``call`` runs one call (dK and
    dV written, dQ accumulated), ``finish`` writes the rows' dQ (zeros in rows no call
    reached)."""

    def __init__(self, q, dout, out, lse, *, scale: float):
        fi = interface()
        self.q, self.dout = _bshd(q), _bshd(dout)
        b, s, h, e = self.q.shape
        self.scale, self.rows = scale, s
        self.dtype = fi.torch2cute_dtype_map[q.dtype]
        self.cfg = config(e)
        self.tile = self.cfg.m_block_size
        self.hdim_multiple = 64 if self.cfg.dKV_swapAB else 32
        self.width = _round(e, self.hdim_multiple)
        rounded = _round(s, self.tile)
        kw = dict(dtype=torch.float32, device=q.device)
        self.dpsum = torch.empty(b, h, rounded, **kw)
        self.lse_log2 = torch.empty(b, h, rounded, **kw)
        self.accum = torch.empty(b, h, rounded * self.width, **kw)
        with torch.cuda.device(q.device):
            fi._bwd_preprocess(
                _bshd(out), self.dout, self.dpsum, lse.contiguous(), self.lse_log2, self.accum,
                None, None, None, self.dtype, e, e, self.tile, fake_mode=False,
                hdim_multiple_of=self.hdim_multiple,
            )

    def call(self, rows: slice, k, v, dk, dv, *, causal: bool) -> None:
        """One call: the query rows ``rows`` (a slice) vs ``k``, ``v`` [B, H_kv, s_k, E]
        (causal only when square and on whole tiles: ``rows_fit``); its dK and dV written
        into ``dk``, ``dv`` (shaped like k and v), its dQ accumulated."""
        start, stop, _ = rows.indices(self.rows)
        if causal and not (rows_fit([(start, stop, True)], self.rows, self.q.shape[-1])
                           and stop - start == k.shape[2]):
            raise ValueError(f"QueryRows: a causal call on rows {start}:{stop} of {self.rows} "
                             f"with {k.shape[2]} keys is not square on whole "
                             f"{self.tile}-row tiles (ask rows_fit first)")
        with torch.cuda.device(self.q.device):
            first, last = start - start % self.tile, min(_round(stop, self.tile), self.rows)
            outside = [span for span in ((first, start), (stop, last)) if span[0] < span[1]]
            kept = [self.lse_log2[:, :, a:b].clone() for a, b in outside]
            for a, b in outside:  # rows of the call's tiles that are not its own
                self.lse_log2[:, :, a:b] = float("inf")
            self._call(first, last, *(_bshd(t) for t in (k, v, dk, dv)), causal)
            for (a, b), lse_log2 in zip(outside, kept):
                self.lse_log2[:, :, a:b] = lse_log2

    def finish(self, dq: torch.Tensor) -> torch.Tensor:
        """The rows' dQ written into ``dq`` (logical [B, H, S, E]); returns it."""
        cfg = self.cfg
        with torch.cuda.device(dq.device):
            interface()._bwd_postprocess_convert(
                self.accum, _bshd(dq), self.scale, None, None, 90, self.dtype, dq.shape[-1],
                self.tile, 128 if cfg.dQ_single_wg else cfg.num_wg * 128, cfg.AtomLayoutMdQ,
                cfg.dQ_swapAB, use_2cta_instrs=False, cluster_size=1, fake_mode=False,
                hdim_multiple_of=self.hdim_multiple,
            )
        self.q = self.dout = self.accum = self.dpsum = self.lse_log2 = None
        return dq

    def _call(self, first: int, last: int, k, v, dk, dv, causal) -> None:
        """The kernel on rows first:last (first on a tile) of [B, S, H, E] tensors."""
        span = _round(last - first, self.tile)
        accum = self.accum[:, :, first * self.width:(first + span) * self.width]
        lse_log2, dpsum = (t[:, :, first:first + span] for t in (self.lse_log2, self.dpsum))
        q, dout = self.q[:, first:last], self.dout[:, first:last]
        if q.shape[2] == k.shape[2]:
            self._backward(q, k, v, dout, lse_log2, dpsum, accum, dk, dv, causal)
            return
        # GQA: dK/dV of the query heads of a K/V head summed in fp32, then converted (as FA4)
        n_tile = self.cfg.n_block_size
        b, s_k, h_kv, _ = k.shape
        sums = [torch.zeros(b, h_kv, _round(s_k, n_tile) * _round(d, self.hdim_multiple),
                            dtype=torch.float32, device=k.device) for d in (q.shape[-1],
                                                                            v.shape[-1])]
        self._backward(q, k, v, dout, lse_log2, dpsum, accum, *sums, causal)
        for acc, grad, scale in zip(sums, (dk, dv), (self.scale, 1.0)):
            interface()._bwd_postprocess_convert(
                acc, grad, scale, None, None, 90, self.dtype, grad.shape[-1], n_tile,
                self.cfg.num_wg * 128, self.cfg.AtomLayoutNdKV, self.cfg.dKV_swapAB,
                cluster_size=1, fake_mode=False, hdim_multiple_of=self.hdim_multiple,
            )

    def _backward(self, q, k, v, dout, lse_log2, dpsum, accum, dk, dv, causal) -> None:
        """FA4's sm90 backward kernel (compiled once per configuration) on these tensors."""
        cute, to_cute_tensor, AuxData, Backward = backward_internals()
        cfg, s_q, s_k = self.cfg, q.shape[1], k.shape[1]
        groups = q.shape[2] // k.shape[2]
        key = (self.dtype, q.shape[-1], v.shape[-1], groups, causal,
               _round(s_q, cfg.m_block_size) == cfg.m_block_size,
               _round(s_k, cfg.n_block_size) == cfg.n_block_size)
        args = [q.detach(), k.detach(), v.detach(), dout, lse_log2, dpsum, accum, dk, dv,
                self.scale, None, None, None, None, None, None, None, None, None]
        if key not in _COMPILED:
            kernel = Backward(
                self.dtype, q.shape[-1], v.shape[-1], groups, causal, is_local=False,
                deterministic=False, tile_m=cfg.m_block_size, tile_n=cfg.n_block_size,
                Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO,
                PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB,
                dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB,
                AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV,
                AtomLayoutMdQ=cfg.AtomLayoutMdQ, num_threads=(cfg.num_wg + 1) * 128,
                V_in_regs=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                has_aux_tensors=False, q_subtile_factor=2, dQ_single_wg=cfg.dQ_single_wg,
            )
            tensors = [to_cute_tensor(t) for t in args[:9]]
            _COMPILED[key] = cute.compile(
                kernel, *tensors, *args[9:], AuxData(None, None), None, None,
                cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                options="--enable-tvm-ffi",
            )
        _COMPILED[key](*args, AuxData(None, None), None, None)
