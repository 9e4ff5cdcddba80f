"""The protocol of ``StreamBarrier`` without a GPU: which signal words a pass writes and waits
for, with which counts (a recording stand-in for the CUDA driver). On GPUs
tests/gpu_distributed/test_stream_signals_gpu.py checks that ranks really meet."""

from __future__ import annotations

import types

import pytest

from schedules import stream_signals


class _Handle:
    world_size, rank = 4, 2
    signal_pad_ptrs = [1000, 2000, 3000, 4000]


@pytest.fixture
def calls(monkeypatch):
    made = []

    def op(kind):
        def record(stream, address, value, flags):
            made.append((kind, address, value))
            return 0
        return record

    monkeypatch.setattr(stream_signals, "_driver", lambda: (None, op("write"), op("wait")))
    stream = types.SimpleNamespace(cuda_stream=7)
    monkeypatch.setattr(stream_signals.torch.cuda, "current_stream", lambda: stream)
    return made


def test_a_pass_writes_its_count_to_every_peer_then_waits_for_theirs(calls):
    barrier = stream_signals.StreamBarrier(_Handle(), channel=1)
    barrier.pass_()
    barrier.pass_()
    word = 4 * (1 * 4 + 2)  # channel 1, this rank (2), of 4
    first = [("write", pad + word, 1) for pad in (1000, 2000, 4000)]
    first += [("wait", 3000 + 4 * (4 + peer), 1) for peer in (0, 1, 3)]
    assert calls == first + [(kind, address, 2) for kind, address, _ in first]
    assert barrier.passes == 2


def test_channels_use_separate_words(calls):
    for channel in (0, 1):
        stream_signals.StreamBarrier(_Handle(), channel).pass_()
    addresses = [address for _, address, _ in calls]
    assert len(set(addresses)) == len(addresses)


def test_a_driver_error_names_the_operation(monkeypatch):
    lib = types.SimpleNamespace(cuGetErrorName=lambda result, name: 0)
    monkeypatch.setattr(stream_signals, "_driver",
                        lambda: (lib, lambda *a: 0, lambda *a: 1))
    monkeypatch.setattr(stream_signals.torch.cuda, "current_stream",
                        lambda: types.SimpleNamespace(cuda_stream=7))
    with pytest.raises(RuntimeError, match="cuStreamWaitValue32 failed"):
        stream_signals.StreamBarrier(_Handle(), 0).pass_()
