"""Readback: device values reach the host behind an event, through a ring of pinned buffers per shape and dtype."""

import pytest
import torch

from hf_specdec.runtime import Readback

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_off_cuda_a_plain_copy():
    readback = Readback(torch.device("cpu"))
    value = torch.arange(3)
    host = readback.wait(readback.start(value, None))
    assert torch.equal(host[0], value) and host[1] is None


@cuda
def test_read_backs_in_flight_keep_their_values_and_the_ring_is_reused():
    readback = Readback(torch.device("cuda"), slots=3)
    torch.cuda._sleep(10 ** 7)  # the copies queue behind a long kernel
    pending = [readback.start(torch.full((2, 4), i, device="cuda"), torch.tensor(i, device="cuda"), timed=True)
               for i in range(3)]
    for i, p in enumerate(pending):
        big, scalar = readback.wait(p)
        assert (big == i).all() and int(scalar) == i
    assert readback.seconds_between(pending[0], pending[2]) >= 0
    again = readback.wait(readback.start(torch.full((2, 4), 7, device="cuda"), None))
    assert again[0] is readback.wait(pending[0])[0]  # the ring came round: the first buffer again
    assert (again[0] == 7).all() and again[1] is None


def test_off_cuda_the_clock_times_the_host_between_waits():
    import time

    from hf_specdec.runtime import ReadbackClock

    readback = Readback(torch.device("cpu"))
    clock = ReadbackClock(readback)
    time.sleep(0.02)
    clock.mark()  # the host's clock starts here for the first read-back
    first = clock.since_last(readback.wait(readback.start(torch.arange(2))))
    time.sleep(0.03)
    second = clock.since_last(readback.wait(readback.start(torch.arange(2))))
    assert 0 <= first < 0.02 and 0.03 <= second < 1.0


@cuda
def test_on_cuda_the_clock_times_the_device_between_timed_read_backs():
    """Two read-backs with a long kernel between them: the device clock times the kernel, not the host's wait."""
    from hf_specdec.runtime import ReadbackClock

    readback = Readback(torch.device("cuda"))
    clock = ReadbackClock(readback)
    first = readback.start(torch.zeros(2, device="cuda"), timed=True)
    torch.cuda._sleep(10 ** 7)  # ~5 ms or more
    second = readback.start(torch.ones(2, device="cuda"), timed=True)
    readback.wait(first)
    clock.since_last(first)
    host = readback.wait(second)
    seconds = clock.since_last(second)
    assert (host[0] == 1).all() and 1e-3 < seconds < 1.0
    third = readback.start(torch.ones(2, device="cuda"), timed=True)
    readback.wait(third)
    assert clock.since_last(third) < seconds  # nothing ran between them on the device
