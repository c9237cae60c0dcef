"""peer_sum: the ranks of a group simulated in one process, every rank's buffer and flags in one tensor (each rank's
kernel reaches the others' at their offsets, as on GPUs it reaches the peers' mapped memory). The ranks push, then
wait and sum, one after the other (the two phases of the one launch the GPUs run): each gets the sum of every
rank's values in rank order, the same bits on every rank, and leaves its flags down for the next call."""

import pytest
import torch

from hf_specdec.kernels import peer_sum as ps


def _group(world: int, slot_numel: int, dtype, device):
    per_rank = ps.RING * world * slot_numel
    data = torch.full((world * per_rank,), float("nan"), dtype=dtype, device=device)
    flags = torch.zeros(world * ps.RING * ps.MAX_PROGRAMS * world, dtype=torch.int32, device=device)
    data_rel = torch.arange(world, dtype=torch.int64, device=device) * per_rank
    flag_rel = torch.arange(world, dtype=torch.int64, device=device) * (ps.RING * ps.MAX_PROGRAMS * world)
    counts = [torch.zeros(ps.MAX_PROGRAMS, dtype=torch.int32, device=device) for _ in range(world)]  # each rank's
    return data, data_rel, flags, flag_rel, counts


def _exchange(xs, group, slot_numel):
    data, data_rel, flags, flag_rel, counts = group
    world = len(xs)
    for rank, x in enumerate(xs):
        ps.peer_sum(x, data, data_rel, flags, flag_rel, counts[rank], rank, world, slot_numel, phase=ps.PUSH)
    return [ps.peer_sum(x, data, data_rel, flags, flag_rel, counts[rank], rank, world, slot_numel, phase=ps.WAIT)
            for rank, x in enumerate(xs)]


# bf16 on GPUs only: the interpreter does not follow bf16 stores through offsets into another rank's part
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_peer_sum_gives_every_rank_the_sum_in_rank_order(triton_device, world, dtype):
    torch.manual_seed(world)
    slot_numel = 1024 * ps.MAX_PROGRAMS  # a program's share of a slot: one block of 1024
    group = _group(world, slot_numel, dtype, triton_device)
    data, counts = group[0], group[4]
    per_rank = data.numel() // world
    for call, numel in enumerate([5, 2500, 1, 3000, 700, 64]):  # more calls than slots: each slot used again
        xs = [torch.randn(numel, device=triton_device).to(dtype) for _ in range(world)]
        expected = sum(x.float() for x in xs).to(dtype)  # rank order, fp32
        slot = int(counts[0][0]) % ps.RING  # program 0's next slot
        outs = _exchange(xs, group, slot_numel)
        for out in outs:
            assert torch.equal(out, expected), (call, numel)
        assert not group[2].any()  # every flag down again
        for rank in range(world):  # program 0 counted the call (below RING) and wrote its block in that slot
            assert int(counts[rank][0]) == (slot + 1) % ps.RING
            for q in range(world):
                start = rank * per_rank + (slot * world + q) * slot_numel  # program 0's region
                assert torch.equal(data[start:start + min(numel, 1024)], xs[q][:1024]), (call, rank, q)


def test_triton_peer_sum_writes_in_place_and_refuses_what_does_not_fit(triton_device):
    slot_numel = 1024 * ps.MAX_PROGRAMS
    group = _group(2, slot_numel, torch.float32, triton_device)
    xs = [torch.randn(200, device=triton_device) for _ in range(2)]
    expected = xs[0] + xs[1]
    data, data_rel, flags, flag_rel, counts = group
    for rank, x in enumerate(xs):
        ps.peer_sum(x, data, data_rel, flags, flag_rel, counts[rank], rank, 2, slot_numel, phase=ps.PUSH)
    for rank, x in enumerate(xs):
        got = ps.peer_sum(x, data, data_rel, flags, flag_rel, counts[rank], rank, 2, slot_numel, out=x, phase=ps.WAIT)
        assert got is x and torch.equal(x, expected)
    args = (data, data_rel, flags, flag_rel, counts[0])
    with pytest.raises(ValueError, match="fit a slot"):
        ps.peer_sum(torch.ones(slot_numel + 1, device=triton_device), *args, 0, 2, slot_numel)
    with pytest.raises(ValueError, match="slots of at least 131072"):  # blocks of 2048 in slots of 1562 a program
        ps.peer_sum(torch.ones(70000, device=triton_device), *args, 0, 2, 100000)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        ps.peer_sum(xs[0], *args, 2, 2, slot_numel)
    with pytest.raises(ValueError, match="contiguous"):
        ps.peer_sum(torch.ones(8, 2, device=triton_device).t(), *args, 0, 2, slot_numel)


def test_blocks_keep_the_programs_within_the_flags():
    assert ps.block_for(1) == 1024 and ps.block_for(5376) == 1024
    for numel in (1 << 16, 5376 * 64, 1 << 20):
        block = ps.block_for(numel)
        assert -(-numel // block) <= ps.MAX_PROGRAMS and block & (block - 1) == 0


def test_triton_a_rank_a_call_ahead_writes_nothing_its_peer_still_has_to_read(triton_device):
    """Rank 0 finishes a call and pushes the next before rank 1 has read the first (legal: nothing orders them), with
    the two calls' programs on different block sizes and counts: each program has its own slot and region, so rank 1
    still reads the first call's values."""
    slot_numel = 2048 * ps.MAX_PROGRAMS
    data, data_rel, flags, flag_rel, counts = group = _group(2, slot_numel, torch.float32, triton_device)

    def call(rank, x, phase):
        return ps.peer_sum(x, data, data_rel, flags, flag_rel, counts[rank], rank, 2, slot_numel, phase=phase)

    for _ in range(3):  # two programs: their counts run ahead of the others'
        xs = [torch.randn(1500, device=triton_device) for _ in range(2)]
        assert torch.equal(_exchange(xs, group, slot_numel)[0], xs[0] + xs[1])
    first = [torch.randn(3000, device=triton_device) for _ in range(2)]  # blocks of 1024
    second = [torch.randn(70000, device=triton_device) for _ in range(2)]  # blocks of 2048
    call(0, first[0], ps.PUSH)
    call(1, first[1], ps.PUSH)
    got0 = call(0, first[0], ps.WAIT)
    call(0, second[0], ps.PUSH)  # rank 0 runs ahead
    got1 = call(1, first[1], ps.WAIT)
    assert torch.equal(got0, first[0] + first[1]) and torch.equal(got1, got0)
    call(1, second[1], ps.PUSH)
    assert torch.equal(call(0, second[0], ps.WAIT), second[0] + second[1])
    assert torch.equal(call(1, second[1], ps.WAIT), second[0] + second[1])
    assert not flags.any() and int(counts[0].max()) < ps.RING  # the counts stay below RING
