"""Asynchronous read-back of device results: the host queues more work before it waits for them."""

from __future__ import annotations

import torch


class Readback:
    """Device values the host needs, copied into pinned memory behind an event, so the host can queue more
    work before waiting for them (on CUDA); elsewhere a plain copy."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self, *tensors: torch.Tensor | None, timed: bool = False):
        """Queue the copies of ``tensors`` (None entries stay None); returns what :meth:`wait` takes. ``timed``: the
        event behind them keeps its time on the device clock (:meth:`seconds_between`)."""
        if not self.cuda:
            return tensors
        host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in tensors]
        event = torch.cuda.Event(enable_timing=timed)
        event.record()
        return host, event

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
