"""Asynchronous read-back of device results: the host queues more work before it waits for them."""

from __future__ import annotations

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
