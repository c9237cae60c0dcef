"""Asynchronous read-back of device results: the host queues more work before it waits for them."""

from __future__ import annotations

import time

import torch


class Readback:
    """Device values the host needs, copied into pinned memory behind an event, so the host can queue more
    work before waiting for them (on CUDA); elsewhere a plain copy.

    The pinned buffers are a ring per shape and dtype, allocated once (a pinned allocation per read-back costs
    more host time than the copy): what :meth:`wait` returns stays valid until ``slots`` more read-backs of that
    shape were started (copy it to keep it longer); a caller waits for each read-back within a few of its start."""

    def __init__(self, device: torch.device, slots: int = 8):
        self.cuda = device.type == "cuda"
        self.slots = slots
        self._rings: dict[tuple, list] = {}  # (shape, dtype) -> [next slot, pinned buffers]

    def start(self, *tensors: torch.Tensor | None, timed: bool = False):
        """Queue the copies of ``tensors`` (None entries stay None); returns what :meth:`wait` takes. ``timed``: the
        event behind them keeps its time on the device clock (:meth:`seconds_between`)."""
        if not self.cuda:
            return tensors
        host = [None if t is None else self._buffer(t).copy_(t, non_blocking=True) for t in tensors]
        event = torch.cuda.Event(enable_timing=timed)
        event.record()
        return host, event

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """The next pinned buffer of ``tensor``'s shape and dtype in its ring (allocated at its first use: a short
        call uses few)."""
        key = (tuple(tensor.shape), tensor.dtype)
        ring = self._rings.setdefault(key, [0, []])
        i = ring[0]
        ring[0] = (i + 1) % self.slots
        if i == len(ring[1]):
            ring[1].append(torch.empty(key[0], dtype=key[1], pin_memory=True))
        return ring[1][i]

    def seconds_between(self, earlier, later) -> float | None:
        """Device-clock seconds between two timed read-backs both waited for (None off CUDA)."""
        if not self.cuda:
            return None
        return earlier[1].elapsed_time(later[1]) / 1e3

    def wait(self, pending) -> list[torch.Tensor | None]:
        """The host copies of what :meth:`start` queued, once they have landed."""
        if not self.cuda:
            return [None if t is None else t.cpu() for t in pending]
        host, event = pending
        event.synchronize()
        return host


class ReadbackClock:
    """Seconds between consecutive read-backs a loop waited for, each one its step or round: on the device clock
    where both were timed on CUDA (a step queued ahead runs while the host is held up elsewhere, so the host's clock
    would time it short), else the host's between its waits (or since :meth:`mark`, for the first one)."""

    def __init__(self, readback: Readback):
        self.readback = readback
        self.last = None  # the last read-back given to since_last
        self.marked = time.perf_counter()

    def mark(self) -> None:
        """The host's clock starts here for the next read-back (one without an earlier one to time from)."""
        self.marked = time.perf_counter()

    def since_last(self, pending) -> float:
        """Seconds from the last read-back given here to ``pending``, which the host has just waited for."""
        now = time.perf_counter()
        between = None if self.last is None else self.readback.seconds_between(self.last, pending)
        seconds = now - self.marked if between is None else between
        self.last, self.marked = pending, now
        return seconds
