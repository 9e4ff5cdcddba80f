"""Barriers between ranks that CUDA streams pass without an SM.

A barrier kernel needs an SM: on a side stream it waits until the attention kernel that holds
every SM ends. CUDA's stream memory operations run in the stream's front end instead, beside
any kernel: ``cuStreamWriteValue32`` writes a word once everything the stream did before is
visible, and ``cuStreamWaitValue32`` holds the stream until a word reaches a value.

``StreamBarrier``: the n-th time a rank passes it, it writes n into its word in every peer's
signal pad, then waits until every peer's word in its own pad has reached n. Counts only grow
(the wait compares cyclically, so wrapping past 2**32 is harmless), and a peer that has
passed n + 1 still counts as arrived at n. A wait has no time limit of its own; the host
watches the stream (``waiting.StallWatch``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: fenced after the stream's earlier work


@functools.cache
def _driver():
    """The CUDA driver's stream memory operations (write, wait), else a RuntimeError."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        write, wait = lib.cuStreamWriteValue32_v2, lib.cuStreamWaitValue32_v2
    except (OSError, AttributeError) as e:
        raise RuntimeError(f"the CUDA driver has no stream memory operations ({e}); a driver "
                           f"for CUDA 11.7 or newer has them") from e
    for fn in (write, wait):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib, write, wait


def available() -> tuple[bool, str]:
    """(whether streams can write and wait for words here, why not)."""
    try:
        _driver()
    except RuntimeError as e:
        return False, str(e)
    return True, ""


def _check(result: int, what: str) -> None:
    if result:
        lib = _driver()[0]
        name = ctypes.c_char_p()
        lib.cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({result})")


class StreamBarrier:
    """A barrier of the ranks of the symmetric-memory ``handle`` on signal words ``channel``
    (words [c * world, (c + 1) * world) of every pad for channel c)."""

    def __init__(self, handle, channel: int):
        world, rank = handle.world_size, handle.rank
        pads = handle.signal_pad_ptrs
        word = 4 * (channel * world + rank)
        self._peers_words = [pads[p] + word for p in range(world) if p != rank]
        self._own_words = [pads[rank] + 4 * (channel * world + p) for p in range(world)
                           if p != rank]
        self.passes = 0

    def pass_(self) -> None:
        """Enqueue on the current stream: say this rank has arrived, then wait for every peer."""
        _, write, wait = _driver()
        self.passes += 1
        count = self.passes & 0xFFFFFFFF
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for address in self._peers_words:
            _check(write(stream, address, count, _WRITE_DEFAULT), "cuStreamWriteValue32")
        for address in self._own_words:
            _check(wait(stream, address, count, _WAIT_GEQ), "cuStreamWaitValue32")
