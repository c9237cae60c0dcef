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
